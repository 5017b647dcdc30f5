#!/bin/bash
# The memory issue's device runs: two real ms-swift islands + syncer on one GPU at a model size,
# with every process's peak RSS sampled from /proc (scripts/memwatch.py).
#
# usage: bash scripts/device_memory.sh SIZE [WHEEL_DIR]     SIZE: 0.7b | 2.7b
# Results under $OUT/SIZE (report, logs, mem.json). Knobs as scripts/swift_island_gpu.sh
# (STEPS 12, SYNC_EVERY 4, FRAGMENTS 4 here: the issue's run).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIZE=${1:?size: 0.7b or 2.7b}
WHEELS=${2:-$REPO/.whl}
case "$SIZE" in
  0.7b) MODEL_ARGS="--layers 16 --hidden 2048 --heads 16 --kv_heads 4 --ffn 5632 --vocab 1024" ;;
  2.7b) MODEL_ARGS="--layers 32 --hidden 2560 --heads 20 --kv_heads 4 --ffn 8960 --vocab 1024" ;;
  *) echo "unknown size $SIZE" >&2; exit 2 ;;
esac
export MODEL_ARGS STEPS=${STEPS:-12} SYNC_EVERY=${SYNC_EVERY:-4} FRAGMENTS=${FRAGMENTS:-4}
RESULT=${OUT:-/tmp/yeto_device}/$SIZE
mkdir -p "$RESULT"
python3 "$REPO/scripts/memwatch.py" "$RESULT/mem.json" diloco.syncer _megatron &
WATCH=$!
T0=$(date +%s)
bash "$REPO/scripts/swift_island_gpu.sh" "$WHEELS" "$RESULT"
RC=$?
T1=$(date +%s)
kill -TERM $WATCH; wait $WATCH
echo "[device_memory] $SIZE exit $RC, wall ${T0}->${T1} ($((T1 - T0)) s incl. install and model creation)" | tee -a "$RESULT/report.txt"
python3 - "$RESULT/mem.json" <<'PY' | tee -a "$RESULT/report.txt"
import json, sys
m = json.load(open(sys.argv[1]))
print(f"host used: start {m['host_used_start_kib']/2**20:.1f} GiB, peak {m['host_used_peak_kib']/2**20:.1f} GiB")
for p in m["processes"]:
    if p["hwm_kib"] > 2**20 / 4:
        print(f"pid {p['pid']}: peak RSS {p['peak_rss_kib']/2**20:.2f} GiB, VmHWM {p['hwm_kib']/2**20:.2f} GiB  {p['cmd'][:100]}")
PY
exit $RC

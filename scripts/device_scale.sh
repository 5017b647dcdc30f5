#!/bin/bash
# The syncer-speed issue's CPU benchmarks on a quiet many-core host (the device machine's CPUs):
# bench_scale.py at each size given, then bench_wire.py. Results under $OUT/scale.
#
# usage: bash scripts/device_scale.sh [WHEEL_DIR] [GIB ...]     (default sizes: 2.5 1.0)
# WHEEL_DIR/yeto holds the msgspec, pyzmq, xxhash, prometheus_client cp312 wheels (docs/SWIFT.md).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${1:-$REPO/.whl}
shift || true
SIZES=${*:-2.5 1.0}
RESULT=${OUT:-/tmp/yeto_device}/scale
mkdir -p "$RESULT"
python3 -m pip install -q --no-deps --no-index "$WHEELS"/yeto/*.whl >"$RESULT/pip.log" 2>&1 || { tail "$RESULT/pip.log"; exit 3; }
export PYTHONPATH=$REPO
echo "[device_scale] $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB" | tee "$RESULT/report.txt"
for gib in $SIZES; do
  python3 "$REPO/benchmarks/bench_scale.py" --gib "$gib" --rounds 4 >"$RESULT/scale_$gib.log" 2>&1
  echo "[device_scale] bench_scale --gib $gib exit $?: $(tail -1 "$RESULT/scale_$gib.log")" | tee -a "$RESULT/report.txt"
done
python3 "$REPO/benchmarks/bench_wire.py" >"$RESULT/wire.log" 2>&1
echo "[device_scale] bench_wire exit $?: $(tail -1 "$RESULT/wire.log")" | tee -a "$RESULT/report.txt"

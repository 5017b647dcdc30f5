#!/bin/bash
# Several device jobs in one call, their results packed into ONE archive ($OUT/results.tgz: the
# device returns only a few files) and every report printed to stdout.
# usage: bash scripts/device_batch.sh JOB...   JOB: probe | recv | init | zmqinit | gputest | wan | scale | wire | 2.7b | 2.7b-np | 0.7b | 0.7b-np
# (DIGEST=0 in the environment: island jobs skip the end-to-end digest files, for whole-run timing)
# (an island job may carry a tag: 2.7b_a, 2.7b_b, ... each keep their results apart)
# Environment: WHEELS (default .whl), STEPS / SYNC_EVERY (default 48 / 16 for the 2.7b jobs),
# PROFILE=1 (the island jobs: the syncer's CPU per thread and a py-spy window, scripts/profile_syncer.py).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${WHEELS:-$REPO/.whl}
DEST=${OUT:-/tmp/yeto_batch}
WORKDIR=/tmp/yeto_batch_results
mkdir -p "$WORKDIR" "$DEST"
export STEPS=${STEPS:-48} SYNC_EVERY=${SYNC_EVERY:-16}
installed=0
install() { [ $installed = 1 ] && return; python3 -m pip install -q --no-deps --no-index $(find "$WHEELS" -type f -name '*.whl') >"$WORKDIR/pip.log" 2>&1; installed=1; }
for job in "$@"; do
  echo "=== $job $(date +%T)"
  case "$job" in
    probe) install; PYTHONPATH=$REPO python3 "$REPO/scripts/probe_fork.py" --gib 8 2>&1 | tail -3 ;;
    wire) install; PYTHONPATH=$REPO python3 "$REPO/benchmarks/bench_wire.py" 2>&1 | tail -1 ;;
    wan*) install; PYTHONPATH=$REPO python3 "$REPO/benchmarks/bench_wan.py" --out "$WORKDIR/$job" ${WAN_ARGS:-} 2>&1 | grep '^{' ;;
    gputest) install; (cd "$REPO" && python3 -m pytest -q -m gpu -p no:cacheprovider tests/diloco/island/test_slots.py \
               tests/diloco/island/test_delta_source.py tests/diloco/test_quant.py 2>&1 | tail -5) ;;
    recv) install; python3 "$REPO/scripts/probe_recv.py" --mib 4096 --islands 1; python3 "$REPO/scripts/probe_recv.py" --mib 4096 --islands 2 ;;
    init) install
       for v in ${INIT_VARIANTS:-16:4:0:1 16:4:0:0}; do  # part MiB : data threads : client window (0: the code's) : INIT lanes
         IFS=: read -r mib threads window lanes <<<"$v"
         PYTHONPATH=$REPO timeout 300 python3 \
           "$REPO/scripts/probe_init.py" --gib 2.5 --window "$window" \
           --syncer-args "--part-mib $mib --data-threads $threads --init-lanes ${lanes:-1}" \
           ${SPY:+--spy "$WORKDIR/spy_${v//:/_}"} 2>&1 \
           | tail -4 | sed "s/^/[$v] /" | tee -a "$WORKDIR/init.txt"
         [ -n "${SPY:-}" ] && for f in "$WORKDIR/spy_${v//:/_}"/*.txt; do python3 "$REPO/scripts/spy_summary.py" "$f" --leaves 30; done
       done ;;
    zmqinit) install  # INIT's framing over bare zmq: the transport alone, then a syncer-like consumer
       IFS=, read -ra variants <<<"${ZMQ_INIT_VARIANTS:---workers 0,--workers 4,--workers 4 --touched,--workers 4 --rcvhwm 16,--workers 4 --window 8}"
       for v in "${variants[@]}"; do  # comma-separated variants, each a list of probe flags
         PYTHONPATH=$REPO timeout 200 python3 "$REPO/scripts/probe_zmq_init.py" --gib 10 $v 2>&1 | tail -2 | head -1 \
           | tee -a "$WORKDIR/zmqinit.txt"
       done ;;
    scale) install; PYTHONPATH=$REPO python3 "$REPO/benchmarks/bench_scale.py" --gib 2.5 --rounds 4 2>&1 | tail -1 ;;
    *-np) install; OUT=$WORKDIR/np NO_PLUGIN=1 SKIP_INSTALL=1 bash "$REPO/scripts/device_memory.sh" "${job%-np}" "$WHEELS" 2>&1 | tail -8 ;;
    *) install
       if [ "${PROFILE:-0}" = 1 ]; then
         python3 "$REPO/scripts/profile_syncer.py" "$WORKDIR/prof_$job" --delay-s "${PROFILE_DELAY_S:-40}" \
           --spy-s "${PROFILE_SPY_S:-30}" >"$WORKDIR/prof_$job.txt" 2>&1 &
       fi
       OUT=$WORKDIR/$job SKIP_INSTALL=1 bash "$REPO/scripts/device_memory.sh" "${job%%_*}" "$WHEELS" >/dev/null 2>&1
       wait
       [ -f "$WORKDIR/prof_$job.txt" ] && head -12 "$WORKDIR/prof_$job.txt"
       grep -v "^\s*$" "$WORKDIR/$job/${job%%_*}/report.txt" | grep -v "loss lines\|'loss'" | tail -45 ;;
  esac
  tar -czf "$DEST/results.tgz" -C "$WORKDIR" --exclude='*.pt' --exclude='ckpt' . 2>/dev/null  # after every job
done
echo "=== done $(date +%T)"

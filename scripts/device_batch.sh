#!/bin/bash
# Several device jobs in one call, their results packed into ONE archive ($OUT/results.tgz: the
# device returns only a few files) and every report printed to stdout.
# usage: bash scripts/device_batch.sh JOB...   JOB: probe | recv | init | numa | fault | fold | zmqinit | gputest | wan | scale | wire | 2.7b | 2.7b-np | 0.7b | 0.7b-np
# (DIGEST=0 in the environment: island jobs skip the end-to-end digest files, for whole-run timing)
# (an island job may carry a tag: 2.7b_a, 2.7b-np_a, ... each keep their results apart; a tag holding
# "one", 2.7b_one / 2.7b-np_one, runs one island instead of two)
# Environment: WHEELS (default .whl), STEPS / SYNC_EVERY (default 48 / 16 for the 2.7b jobs),
# PROFILE=1 (the island jobs: the syncer's CPU per thread and a py-spy window, scripts/profile_syncer.py),
# PROFILE_ISLAND=1 (the same for island 0, py-spy sampling only the GIL holder), ISLANDS_ALL=1 (every job one island).
# Every island job samples the GPU's utilization twice a second (gpu.csv beside its report).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${WHEELS:-$REPO/.whl}
DEST=${OUT:-/tmp/yeto_batch}
WORKDIR=/tmp/yeto_batch_results
mkdir -p "$WORKDIR" "$DEST"
export STEPS=${STEPS:-48} SYNC_EVERY=${SYNC_EVERY:-16}
installed=0
GPUW=
gpu_watch() { nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used --format=csv,noheader,nounits \
  -lms 500 >"$1" 2>/dev/null & GPUW=$!; }
gpu_summary() { awk -F', ' '$2 > 0 {n++; u += $2; m += $3} END {if (n) printf "[gpu] %d busy samples: utilization %.0f %%, memory %.0f %%\n", n, u / n, m / n}' "$1"; }
install() { [ $installed = 1 ] && return; python3 -m pip install -q --no-deps --no-index $(find "$WHEELS" -type f -name '*.whl') >"$WORKDIR/pip.log" 2>&1; installed=1; }
for job in "$@"; do
  echo "=== $job $(date +%T)"
  case "$job" in *_one*) export ISLANDS=1 ;; *) export ISLANDS=${ISLANDS_ALL:-2} ;; esac  # a tag with "one": one island
  case "$job" in
    probe) install; PYTHONPATH=$REPO python3 "$REPO/scripts/probe_fork.py" --gib 8 2>&1 | tail -3 ;;
    wire) install; PYTHONPATH=$REPO python3 "$REPO/benchmarks/bench_wire.py" 2>&1 | tail -1 ;;
    wan*) install; PYTHONPATH=$REPO python3 "$REPO/benchmarks/bench_wan.py" --out "$WORKDIR/$job" ${WAN_ARGS:-} 2>&1 | grep '^{' ;;
    gputest) install; (cd "$REPO" && python3 -m pytest -q -m gpu -p no:cacheprovider tests/diloco/island/test_slots.py \
               tests/diloco/island/test_delta_source.py tests/diloco/test_quant.py 2>&1 | tail -5) ;;
    recv) install; python3 "$REPO/scripts/probe_recv.py" --mib 4096 --islands 1; python3 "$REPO/scripts/probe_recv.py" --mib 4096 --islands 2 ;;
    init) install; lines=4; [ -n "${TRACE:-}" ] && lines=26  # TRACE=1: per-part timelines (scripts/trace_init.py)
       # part MiB : data threads : client window (0: the code's) : INIT lanes [: TRACE_VARIANT, with TRACE=1]
       for v in ${INIT_VARIANTS:-16:4:0:1 16:4:0:0}; do
         IFS=: read -r mib threads window lanes tvariant <<<"$v"
         TRACE_VARIANT=${tvariant:-} PYTHONPATH=$REPO timeout 300 python3 \
           "$REPO/scripts/probe_init.py" --gib 2.5 --window "$window" \
           --syncer-args "--part-mib $mib --data-threads $threads --init-lanes ${lanes:-1}" \
           ${SPY:+--spy "$WORKDIR/spy_${v//:/_}"} ${TRACE:+--trace "$WORKDIR/trace_${v//:/_}"} 2>&1 \
           | tail -"$lines" | sed "s/^/[$v] /" | tee -a "$WORKDIR/init.txt"
         [ -n "${SPY:-}" ] && for f in "$WORKDIR/spy_${v//:/_}"/*.txt; do python3 "$REPO/scripts/spy_summary.py" "$f" --leaves 30; done
       done ;;
    numa) install  # the host's NUMA nodes; with two, INIT with island and syncer each on its own node (as two hosts)
       lscpu | grep -i "model name\|socket\|numa\|L3"; ls -d /sys/devices/system/node/node* 2>/dev/null
       nodes=$(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l)
       if [ "$nodes" -ge 2 ]; then
         a=$(cat /sys/devices/system/node/node0/cpulist); b=$(cat /sys/devices/system/node/node1/cpulist)
         for v in "" "--island-cpus $a --syncer-cpus $b" "" "--island-cpus $a --syncer-cpus $b"; do
           PYTHONPATH=$REPO timeout 200 python3 "$REPO/scripts/probe_init.py" --gib 2.5 $v 2>&1 | tail -1 \
             | tee -a "$WORKDIR/numa.txt"
         done
       fi ;;
    fault) install; python3 "$REPO/scripts/probe_fault.py" --gib 4 2>&1 | tail -12 ;;
    fold) install  # the data plane folding two islands' 2.5 GiB pushes alone: fresh against resident sums
       for t in ${FOLD_THREADS:-4 8}; do
         PYTHONPATH=$REPO timeout 200 python3 "$REPO/scripts/probe_fold.py" --gib 2.5 --data-threads "$t" 2>&1 | tail -5 \
           | cut -c1-400 | tee -a "$WORKDIR/fold.txt"
       done ;;
    zmqinit) install  # INIT's framing over bare zmq: the transport alone, then a syncer-like consumer
       IFS=, read -ra variants <<<"${ZMQ_INIT_VARIANTS:---workers 0,--workers 4,--workers 4 --touched,--workers 4 --rcvhwm 16,--workers 4 --window 8}"
       for v in "${variants[@]}"; do  # comma-separated variants, each a list of probe flags
         PYTHONPATH=$REPO timeout 200 python3 "$REPO/scripts/probe_zmq_init.py" --gib 10 $v 2>&1 | tail -2 | head -1 \
           | tee -a "$WORKDIR/zmqinit.txt"
       done ;;
    scale) install; PYTHONPATH=$REPO python3 "$REPO/benchmarks/bench_scale.py" --gib 2.5 --rounds 4 2>&1 | tail -1 ;;
    *-np*) install; mkdir -p "$WORKDIR/$job"; gpu_watch "$WORKDIR/$job/gpu.csv"
       OUT=$WORKDIR/$job NO_PLUGIN=1 SKIP_INSTALL=1 bash "$REPO/scripts/device_memory.sh" "${job%%-np*}" "$WHEELS" 2>&1 | tail -8
       kill $GPUW 2>/dev/null; gpu_summary "$WORKDIR/$job/gpu.csv" ;;
    *) install; mkdir -p "$WORKDIR/$job"; gpu_watch "$WORKDIR/$job/gpu.csv"
       if [ "${PROFILE:-0}" = 1 ]; then
         python3 "$REPO/scripts/profile_syncer.py" "$WORKDIR/prof_$job" --delay-s "${PROFILE_DELAY_S:-40}" \
           --spy-s "${PROFILE_SPY_S:-30}" >"$WORKDIR/prof_$job.txt" 2>&1 &
       fi
       if [ "${PROFILE_ISLAND:-0}" = 1 ]; then
         python3 "$REPO/scripts/profile_syncer.py" "$WORKDIR/prof_island_$job" --match _megatron/pt --env YETO_ISLAND_ID=0 \
           --exclude torch.distributed.run --settle-s 20 --gil --delay-s "${PROFILE_DELAY_S:-40}" --spy-s "${PROFILE_SPY_S:-30}" \
           >"$WORKDIR/prof_island_$job.txt" 2>&1 &
       fi
       OUT=$WORKDIR/$job SKIP_INSTALL=1 bash "$REPO/scripts/device_memory.sh" "${job%%_*}" "$WHEELS" >/dev/null 2>&1
       kill $GPUW 2>/dev/null
       wait
       gpu_summary "$WORKDIR/$job/gpu.csv"
       [ -f "$WORKDIR/prof_$job.txt" ] && head -12 "$WORKDIR/prof_$job.txt"
       [ -f "$WORKDIR/prof_island_$job.txt" ] && head -16 "$WORKDIR/prof_island_$job.txt" \
         && python3 "$REPO/scripts/spy_summary.py" "$WORKDIR/prof_island_$job/spy.txt" --leaves 25 --depth 3
       grep -v "^\s*$" "$WORKDIR/$job/${job%%_*}/report.txt" | grep -v "loss lines\|'loss'" | tail -45 ;;
  esac
  tar -czf "$DEST/results.tgz" -C "$WORKDIR" --exclude='*.pt' --exclude='ckpt' . 2>/dev/null  # after every job
done
echo "=== done $(date +%T)"

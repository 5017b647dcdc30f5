#!/bin/bash
# Two DiLoCo islands as two REAL ms-swift `megatron pt` jobs sharing one GPU, plus the syncer.
#
# usage: bash scripts/swift_island_gpu.sh [WHEEL_DIR] [RESULT_DIR]
#   WHEEL_DIR   wheels prepared on a machine with PyPI access (default: <repo>/.whl):
#                 core/ report/   bash /work/shared/tools/swift_gpu_kit/download_wheels.sh .whl
#                 yeto/           msgspec + pyzmq cp312 wheels (see docs/SWIFT.md)
#                 kit/            make_tiny_model.py, make_dataset.py, te_shim/ from the swift GPU kit
#   RESULT_DIR  where the logs, step logs and digests are copied at the end (default: $OUT or
#               /tmp/yeto_swift_out); the run itself works in $WORK (default /tmp/yeto_swift).
# Knobs (environment): STEPS (40), SYNC_EVERY (8), FRAGMENTS (2), SYNC_PORT (5599), MODEL_ARGS (tiny),
#   SYNCER_ARGS (extra yeto-syncer flags), SYNCER_ENV (extra VAR=value pairs for the syncer),
#   ISLAND_ENV (extra VAR=value pairs for both islands), ISLAND_ARGS (extra `megatron pt` flags for both
#   islands, with and without the plugin: e.g. "--optimizer sgd --sgd_momentum 0", two 2.7B islands in
#   an H100's memory),
#   ISLAND_TIMEOUT_S (420), PY (python3), SKIP_INSTALL=1 to reuse an installed environment,
#   DIGEST=0 to skip the islands' end-to-end digest files (whole-run timing of what a user runs),
#   SYNCER_PYTHONPATH (a checkout whose syncer runs instead of this one's: A/B runs),
#   ISLANDS=1 (one island instead of two: the issue's one-island run),
#   NO_PLUGIN=1 (the same two jobs without the plugin and without a syncer: the baseline of the
#   "whole run" figure; the report gives each island's wall time either way).
# Exit status: 0 only if the syncer and both islands exit 0 and both final digests are equal.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$(cd "${1:-$REPO/.whl}" && pwd)
RESULT=${2:-${OUT:-/tmp/yeto_swift_out}}
WORK=${WORK:-/tmp/yeto_swift}
KIT=${SWIFT_KIT:-$WHEELS/kit}
PY=${PY:-python3}
STEPS=${STEPS:-40}; SYNC_EVERY=${SYNC_EVERY:-8}; FRAGMENTS=${FRAGMENTS:-2}; ISLANDS=${ISLANDS:-2}
case "$ISLANDS" in 1|2) ;; *) echo "ISLANDS must be 1 or 2, not '$ISLANDS'" >&2; exit 2 ;; esac
SYNC_PORT=${SYNC_PORT:-5599}; ISLAND_TIMEOUT_S=${ISLAND_TIMEOUT_S:-420}
mkdir -p "$WORK" "$RESULT"
REPORT="$WORK/report.txt"; : >"$REPORT"
say() { echo "[swift_island_gpu] $*" | tee -a "$REPORT"; }

# --- 1. offline install (no resolver, no index) -------------------------------------------
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  $PY -m pip install -q --no-deps --no-index $(find "$WHEELS" -type f -name '*.whl') >"$WORK/pip.log" 2>&1 \
    || { say "pip install failed"; tail -20 "$WORK/pip.log"; exit 3; }
fi
$PY - <<'PY' 2>&1 | tee -a "$REPORT"
import importlib.util as u, torch
need = ['swift', 'megatron.core', 'mcore_bridge', 'zmq', 'msgspec', 'xxhash', 'safetensors', 'transformers']
print('missing modules:', [m for m in need if u.find_spec(m) is None])
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(),
      '| transformer_engine:', u.find_spec('transformer_engine') is not None)
PY

# --- 2. tiny random Qwen2 + jsonl data (offline) ---------------------------------------------
# MODEL_ARGS sizes the model, e.g. the 0.7B of the "Real model sizes" issues:
#   MODEL_ARGS="--layers 16 --hidden 2048 --heads 16 --kv_heads 4 --ffn 5632 --vocab 1024"
MODEL_DIR="$WORK/tiny_qwen2${MODEL_ARGS:+_$(echo "$MODEL_ARGS" | tr -dc '0-9')}"
[ -d "$MODEL_DIR" ] || $PY "$KIT/make_tiny_model.py" "$MODEL_DIR" --arch qwen2 ${MODEL_ARGS:-} >>"$REPORT" 2>&1
[ -f "$WORK/data/pt.jsonl" ] || $PY "$KIT/make_dataset.py" "$WORK/data" >>"$REPORT" 2>&1
# Island 1 reads the same samples in reverse order, so the islands' local steps differ (ms-swift's
# Megatron sampler does not take --seed).
[ -f "$WORK/data/pt_island1.jsonl" ] || tac "$WORK/data/pt.jsonl" >"$WORK/data/pt_island1.jsonl"

export PYTHONPATH="$KIT/te_shim:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export SWIFT_TE_SHIM=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
PLUGIN=$(cd "$REPO" && $PY -m swift_plugin)
TE_PLUGIN="$REPO/scripts/swift/te_local_spec_plugin.py"
say "plugin $PLUGIN; steps $STEPS, sync every $SYNC_EVERY, fragments $FRAGMENTS, islands $ISLANDS${ISLAND_ARGS:+, island flags: $ISLAND_ARGS}"
rm -rf "$WORK/ckpt" "$WORK"/steps-*.jsonl "$WORK"/digest-*.json "$WORK/events.jsonl" "$WORK/runs"

# --- 3. the syncer -------------------------------------------------------------------------
export YETO_SYNC_KEY=${YETO_SYNC_KEY:-swift-gpu-test-key}
if [ -n "${NO_PLUGIN:-}" ]; then
  PLUGIN_ARGS=(--external_plugins "$TE_PLUGIN")
  sleep infinity & SYNCER=$!  # no syncer: a placeholder the waits below can end
else
  PLUGIN_ARGS=(--external_plugins "$TE_PLUGIN" "$PLUGIN" --callbacks yeto)
PYTHONPATH="${SYNCER_PYTHONPATH:+$SYNCER_PYTHONPATH:}$PYTHONPATH" env ${SYNCER_ENV:-} $PY -m diloco.syncer --bind "tcp://127.0.0.1:$SYNC_PORT" --islands "$ISLANDS" --sync-every "$SYNC_EVERY" \
  --total-steps "$STEPS" --grace-ms 500 --quorum-timeout-s 120 --final-timeout-s 300 --dead-after-s 120 \
  --checkpoint-dir "$WORK/ckpt" --checkpoint-every 0 --event-log "$WORK/events.jsonl" --status-every-s 10 ${SYNCER_ARGS:-} \
  >"$WORK/syncer.log" 2>&1 &
SYNCER=$!
fi

# --- 4. two islands: same GPU, different MASTER_PORT, own island id / seed / logs ------------
island() {  # island ID MASTER_PORT
  YETO_SYNC_ADDR="tcp://127.0.0.1:$SYNC_PORT" YETO_ISLAND_ID=$1 YETO_DILOCO_FRAGMENTS=$FRAGMENTS \
  YETO_DILOCO_STEP_LOG="$WORK/steps-{island}.jsonl" \
  YETO_CONNECT_TIMEOUT_S=300 YETO_FINAL_TIMEOUT_S=300 YETO_DILOCO_INITIAL_CUT_TIMEOUT=300 \
  NPROC_PER_NODE=1 MASTER_PORT=$2 \
  env ${ISLAND_ENV:-} ${DIGEST_ENV:-} timeout "$ISLAND_TIMEOUT_S" $PY -m swift.cli._megatron.main pt \
    --model "$MODEL_DIR" --model_type qwen2 --template qwen \
    --dataset "$WORK/data/$([ "$1" = 1 ] && echo pt_island1.jsonl || echo pt.jsonl)" --split_dataset_ratio 0 \
    "${PLUGIN_ARGS[@]}" \
    --tensor_model_parallel_size 1 --pipeline_model_parallel_size 1 \
    --micro_batch_size 4 --global_batch_size 16 --max_length 256 \
    --train_iters "$STEPS" --lr 1e-3 --min_lr 1e-4 --lr_warmup_iters 5 \
    --padding_free false --masked_softmax_fusion false --bias_dropout_fusion false \
    --bias_activation_fusion false --cross_entropy_loss_fusion false --attention_backend local \
    --logging_steps 5 --save_steps 100000 --save_safetensors false --no_save_optim true --no_save_rng true \
    --check_model false --dataloader_num_workers 0 --dataset_num_proc 1 \
    --output_dir "$WORK/runs/island$1" ${ISLAND_ARGS:-} >"$WORK/island$1.log" 2>&1
  local rc=$?
  echo "$(( $(date +%s%N) / 1000000 - T_START_MS ))" >"$WORK/wall-$1.ms"
  return $rc
}
# DIGEST=0: no end-to-end digest export after the final cut (it re-exports the model, seconds at
# 2.7B: a check of this script, not part of a user's run); the syncer's FINAL_ACK check remains.
if [ "${DIGEST:-1}" != 0 ]; then DIGEST_ENV="YETO_DILOCO_DIGEST_FILE=$WORK/digest-{island}.json"; else DIGEST_ENV=""; fi
T_START_MS=$(( $(date +%s%N) / 1000000 ))
ISL=$(seq 0 $((ISLANDS - 1)))
island 0 29510 & I0=$!
RC1=0; [ "$ISLANDS" = 2 ] && { island 1 29520 & I1=$!; }
wait $I0; RC0=$?
[ "$ISLANDS" = 2 ] && { wait $I1; RC1=$?; }
say "island wall times (launch to exit, s): $(for i in $ISL; do awk '{printf "%.1f ", $1 / 1000}' "$WORK/wall-$i.ms"; done)"
if [ -n "${NO_PLUGIN:-}" ]; then kill $SYNCER 2>/dev/null; wait $SYNCER 2>/dev/null; say "exit codes (no plugin): island0=$RC0 island1=$RC1"; cp "$REPORT" "$WORK/island0.log" "$WORK/island1.log" "$RESULT/" 2>/dev/null; [ "$RC0" = 0 ] && [ "$RC1" = 0 ]; exit $?; fi
# The syncer exits by itself after both FINAL_ACKs; bound the wait anyway.
for _ in $(seq 60); do kill -0 $SYNCER 2>/dev/null || break; sleep 1; done
if kill -0 $SYNCER 2>/dev/null; then say "syncer still running; stopping it"; kill $SYNCER; fi
wait $SYNCER; RCS=$?
say "exit codes: island0=$RC0 island1=$RC1 syncer=$RCS"

# --- 5. results: steps, commits, digests, step-log tables -------------------------------------
for i in $ISL; do
  say "island$i: $(grep -c '"step"' "$WORK/steps-$i.jsonl" 2>/dev/null || echo 0) step-log lines, last iteration: \
$(grep -o "iteration=[0-9]*\|'iteration': '[0-9]*/[0-9]*'" "$WORK/island$i.log" | tail -1)"
  say "digest island$i: $(cat "$WORK/digest-$i.json" 2>/dev/null || echo MISSING)"
done
say "commits (changed): $(grep -c '"changed": true' "$WORK/events.jsonl" 2>/dev/null || echo 0)"
D0=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['digest'])" "$WORK/digest-0.json" 2>/dev/null)
D1=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['digest'])" "$WORK/digest-1.json" 2>/dev/null)
if [ "${DIGEST:-1}" = 0 ]; then SAME=1; say "DIGEST=0: no digest files (the syncer checked every FINAL_ACK's digests: exit $RCS)"
elif [ "$ISLANDS" = 1 ] && [ -n "$D0" ]; then SAME=1; say "one island, digest $D0"
elif [ -n "$D0" ] && [ "$D0" = "$D1" ]; then SAME=1; say "DIGESTS EQUAL: $D0"; else SAME=0; say "DIGESTS DIFFER OR MISSING: '$D0' vs '$D1'"; fi
$PY -m diloco.steplog_report $(for i in $ISL; do echo "$WORK/steps-$i.jsonl"; done) 2>&1 | tee -a "$REPORT"
for i in $ISL; do say "island$i loss lines:"; grep -o "'loss': [0-9.]*" "$WORK/island$i.log" | tr '\n' ' ' | tee -a "$REPORT"; echo | tee -a "$REPORT"; done

# At most 8 files come back from the device: the report, three logs, and one archive of the rest.
cp "$REPORT" "$WORK/syncer.log" "$WORK/island0.log" "$WORK/island1.log" "$RESULT/" 2>/dev/null
tar -czf "$RESULT/run_files.tar.gz" -C "$WORK" $(cd "$WORK" && ls steps-*.jsonl digest-*.json events.jsonl pip.log 2>/dev/null)
[ "$RC0" = 0 ] && [ "$RC1" = 0 ] && [ "$RCS" = 0 ] && [ "$SAME" = 1 ]

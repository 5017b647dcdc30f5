#!/usr/bin/env bash
# Two DiLoCo islands sharing ONE GPU, real megatron-core on CUDA, a real syncer:
#   island 0 = DP2 (both ranks on the GPU) with the gloo bridge bridging every group
#              (ranks_per_node=1: DP and WORLD run on gloo, CUDA tensors staged through pinned host memory);
#   island 1 = TP1 (one rank).
# What a 1-GPU machine allows of the multi-GPU run (TP on NCCL inside a node needs 2+ GPUs).
# usage: bash scripts/gpu_bridged_islands.sh WHEEL_DIR [OUT_DIR]
#   WHEEL_DIR holds cp312 wheels of megatron-core 0.16.1, msgspec and pyzmq (the device has torch, numpy,
#   safetensors, xxhash, matplotlib).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:?wheel dir}; OUT=${2:-/tmp/yeto_gpu_bridge}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH="/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
set +e
python3 -m diloco.demo.cli --device cuda --layouts dp2,tp1 --ranks-per-node 1 --steps 40 --sync-every 10 \
  --fragments 2 --hidden 128 --layers 4 --no-baseline --out "$OUT/demo" --summary "$OUT/summary.json" \
  --timeout-s 230 2>&1 | tee "$OUT/demo.log"
rc=${PIPESTATUS[0]}
set -e
grep -h "gloo_bridge" "$OUT"/demo/island0.log | sort | uniq -c | head -20 || true
echo "yeto-demo exit code: $rc"
exit "$rc"

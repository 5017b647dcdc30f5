"""CUDA tensors through every wrapped call: 2 processes, every group bridged.

With ``YETO_RANKS_PER_NODE=1`` each rank is its own "node", so WORLD (NCCL by
default, shadowed by gloo) and every new group run through host staging with
pinned buffers. Both ranks may share one GPU: the NCCL world is created lazily
and never used, every call goes to gloo.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gloo_bridge
from gloo_bridge import device
from gloo_bridge_suite import free_port, init_world, run_op_suite, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.integ,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _body(rank: int, port: int) -> list[str]:
    gloo_bridge.install()  # ranks per node from YETO_RANKS_PER_NODE=1
    device.set_current_device(rank % torch.cuda.device_count())
    init_world(rank, 2, port, "nccl")
    errors: list[str] = []
    group = dist.new_group([0, 1])
    if not (gloo_bridge.is_bridged(None) and gloo_bridge.is_bridged(group)):
        errors.append("WORLD and the 2-rank group must be bridged with one rank per node")
    if dist.get_backend(group) != "gloo" or dist.get_backend() != "nccl":
        errors.append(f"backends: group {dist.get_backend(group)}, world {dist.get_backend()}")
    cuda = device.current_device()
    errors += run_op_suite(group, cuda, "cuda group")
    errors += run_op_suite(None, cuda, "cuda world")
    stats = gloo_bridge.bridge_stats()
    if not stats["pinned"] or stats["allocations"] == 0:
        errors.append(f"expected pinned staging buffers, got {stats}")
    dist.destroy_process_group()
    gloo_bridge.uninstall()
    return errors


@pytest.mark.timeout(240)
def test_cuda_tensors_through_every_bridged_op(tmp_path: Path) -> None:
    verdicts = run_ranks(2, functools.partial(_body, port=free_port()), tmp_path, start_method="spawn",
                         env={"YETO_RANKS_PER_NODE": "1"}, timeout_s=200)
    failures = {r: v["errors"] for r, v in enumerate(verdicts) if not v["ok"]}
    assert not failures, failures

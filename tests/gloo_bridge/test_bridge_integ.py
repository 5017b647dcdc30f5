"""4 real processes as 2 nodes x 2 ranks, megatron-core TP=2 groups under the gloo bridge.

Checks that exactly the groups spanning nodes are bridged (TP inside a node
is not; DP across nodes and WORLD are), that megatron's import-time references
are rerouted and restored, and that every wrapped call gives the reference
result on bridged groups, once with CPU tensors passed straight to gloo and
once through the host staging path (forced on CPU).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Imported before forking so each worker starts in well under a second.
import megatron.core.parallel_state as ps
import megatron.core.tensor_parallel.mappings as mappings
import megatron.core.distributed.param_and_grad_buffer as pgb

import gloo_bridge
from gloo_bridge_suite import free_port, init_world, run_op_suite, run_ranks

pytestmark = pytest.mark.integ
WORLD, RANKS_PER_NODE = 4, 2


def _body(rank: int, port: int, stage: bool) -> list[str]:
    orig_ag, orig_cm = mappings.dist_all_gather_func, pgb._coalescing_manager
    gloo_bridge.install(ranks_per_node=RANKS_PER_NODE, stage_cpu_tensors=stage)
    gloo_bridge.install(ranks_per_node=RANKS_PER_NODE, stage_cpu_tensors=stage)  # idempotent
    errors: list[str] = []
    if mappings.dist_all_gather_func is orig_ag or pgb._coalescing_manager is orig_cm:
        errors.append("megatron's import-time references were not rerouted")
    init_world(rank, WORLD, port, "gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp, dp = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    expect = {
        "tp (inside a node)": (tp, False),
        "dp (across nodes)": (dp, True),
        "dp gloo (across nodes)": (ps.get_data_parallel_group_gloo(), True),
        "model parallel (inside a node)": (ps.get_model_parallel_group(), False),
        "WORLD": (None, True),
        "WORLD object": (dist.group.WORLD, True),
    }
    for name, (group, want) in expect.items():
        if gloo_bridge.is_bridged(group) is not want:
            errors.append(f"is_bridged({name}) is {not want}, want {want}")
    if sorted(dist.get_process_group_ranks(dp)) != [rank % 2, rank % 2 + 2]:
        errors.append(f"unexpected dp ranks {dist.get_process_group_ranks(dp)}")
    cpu = torch.device("cpu")
    errors += run_op_suite(dp, cpu, f"dp stage={stage}")
    errors += run_op_suite(None, cpu, f"world stage={stage}")
    errors += run_op_suite(tp, cpu, f"tp unbridged stage={stage}", bridged=False)
    stats = gloo_bridge.bridge_stats()
    if stage and stats["allocations"] == 0:
        errors.append("forced staging allocated no host buffer")
    if stage and stats["allocations"] > 200:
        errors.append(f"host buffers are not reused: {stats}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    gloo_bridge.uninstall()
    if mappings.dist_all_gather_func is not orig_ag or pgb._coalescing_manager is not orig_cm:
        errors.append("uninstall did not restore megatron's references")
    if "gloo_bridge" in (dist.all_reduce.__doc__ or "") or dist.new_group is not dist.distributed_c10d.new_group:
        errors.append("uninstall did not restore torch.distributed.all_reduce")
    return errors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [False, True], ids=["cpu-direct", "cpu-staged"])
def test_megatron_groups_and_ops_under_bridge(stage: bool, tmp_path: Path) -> None:
    verdicts = run_ranks(WORLD, functools.partial(_body, port=free_port(), stage=stage), tmp_path)
    failures = {r: v["errors"] for r, v in enumerate(verdicts) if not v["ok"]}
    assert not failures, failures


def _guard_body(rank: int, port: int) -> list[str]:
    """One node, 2 ranks, default backend gloo: nothing spans nodes, nothing is bridged.

    In a process with an accelerator the bridge still routes such gloo groups through the
    staging path (gloo handed a device tensor crashes the process). ``guard_gloo`` is what
    ``install()`` sets from the device helper; forced on here, with CPU tensors forced
    through staging, to exercise that routing on a CPU machine.
    """
    from gloo_bridge import patching

    gloo_bridge.install(ranks_per_node=2, stage_cpu_tensors=True)
    init_world(rank, 2, port, "gloo")
    errors: list[str] = []
    bridge = patching._BRIDGE
    assert bridge is not None
    if bridge.guard_gloo:
        errors.append("guard_gloo is on without an accelerator")
    t = torch.ones(4)
    dist.all_reduce(t)
    if gloo_bridge.bridge_stats()["allocations"] != 0:
        errors.append("a gloo group that does not span nodes was staged without an accelerator")
    bridge.guard_gloo = True
    if gloo_bridge.is_bridged(None):
        errors.append("is_bridged(WORLD) is True on one node")
    errors += run_op_suite(None, torch.device("cpu"), "guarded world")
    if gloo_bridge.bridge_stats()["allocations"] == 0:
        errors.append("the guarded gloo group did not go through the staging path")
    dist.destroy_process_group()
    gloo_bridge.uninstall()
    return errors


@pytest.mark.timeout(120)
def test_gloo_guard_stages_unbridged_gloo_groups(tmp_path: Path) -> None:
    verdicts = run_ranks(2, functools.partial(_guard_body, port=free_port()), tmp_path)
    failures = {r: v["errors"] for r, v in enumerate(verdicts) if not v["ok"]}
    assert not failures, failures

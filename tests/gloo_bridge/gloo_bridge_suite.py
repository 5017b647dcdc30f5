"""Shared multi-rank harness and op-by-op reference checks for the gloo bridge tests.

Why one module: the CPU integration test (4 ranks, megatron-core groups) and
the GPU test (2 ranks, CUDA tensors) must check exactly the same calls against
the same reference results; only the device and the groups differ. Each check
appends a message on mismatch instead of raising, so every rank keeps running
the same sequence of collectives and no rank is left blocked; the parent then
asserts on every rank's verdict.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gloo_bridge
from tests.support.ports import free_port  # noqa: F401  (re-exported to the bridge tests)

PG_TIMEOUT = timedelta(seconds=60)


def _worker(rank: int, env: dict[str, str], body: Callable[[int], list[str]], out_dir: str) -> None:
    os.environ.clear()  # the caller's environment at the call (a forkserver child has the server's)
    os.environ.update(env)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.set_num_threads(1)
    verdict: dict[str, Any]
    try:
        errors = body(rank)
        verdict = {"ok": not errors, "errors": errors}
    except BaseException:  # the parent must see why, not a bare exit code
        verdict = {"ok": False, "errors": [traceback.format_exc()]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(verdict))


def run_ranks(world: int, body: Callable[[int], list[str]], out_dir: Path, *, start_method: str = "forkserver",
              env: dict[str, str] | None = None, timeout_s: float = 150.0) -> list[dict[str, Any]]:
    """Run ``body(rank)`` in ``world`` processes; return every rank's verdict.

    A rank that hangs past ``timeout_s`` is killed and reported as failed, so a
    deadlock turns into a test failure instead of a stuck suite.
    """
    env = {**os.environ, **(env or {})}
    ctx = mp.get_context(start_method)
    procs = [ctx.Process(target=_worker, args=(r, env, body, str(out_dir)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline_each = timeout_s
    for p in procs:
        p.join(deadline_each)
        deadline_each = 5.0 if p.is_alive() else deadline_each
    verdicts = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            verdicts.append({"ok": False, "errors": [f"rank {r} timed out"]})
            continue
        path = out_dir / f"rank{r}.json"
        if not path.exists():
            verdicts.append({"ok": False, "errors": [f"rank {r} exited {p.exitcode} without a verdict"]})
            continue
        verdicts.append(json.loads(path.read_text()))
    return verdicts


def init_world(rank: int, world: int, port: int, backend: str) -> None:
    """Join a TCP-initialized world (after the bridge is installed)."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=PG_TIMEOUT)


class Checker:
    """Collects mismatches instead of raising, so all ranks stay in lockstep."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.errors: list[str] = []

    def equal(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        got_cpu = got.detach().cpu()
        if got_cpu.dtype != want.dtype or got_cpu.shape != want.shape or not torch.equal(got_cpu, want):
            self.errors.append(f"[{self.label}] {name}: got {got_cpu.tolist()} want {want.tolist()}")

    def true(self, name: str, cond: bool) -> None:
        if not cond:
            self.errors.append(f"[{self.label}] {name}: false")


def run_op_suite(group: dist.ProcessGroup | None, device: torch.device, label: str, bridged: bool = True) -> list[str]:
    """Every wrapped call on ``group`` with tensors on ``device`` vs reference results.

    ``bridged=False`` runs the same suite on a group the bridge leaves alone
    (a sanity check of the references and of the pass-through), skipping the
    bridge-only error check.
    """
    c = Checker(label)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    n, me = len(ranks), dist.get_rank(group)
    k = 4

    def base(r: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.arange(k) + 10 * r + 1).to(dtype)

    def dv(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    total = sum(base(r) for r in range(n))

    # all_reduce: sync, async, AVG (emulated), MAX, bf16, non-contiguous.
    t = dv(base(me)); dist.all_reduce(t, group=group); c.equal("all_reduce", t, total)
    t = dv(base(me)); w = dist.all_reduce(t, group=group, async_op=True); w.wait(); c.equal("all_reduce async", t, total)
    t = dv(base(me)); dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group); c.equal("all_reduce avg", t, total / n)
    t = dv(base(me)); dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group); c.equal("all_reduce max", t, base(n - 1))
    t = dv(base(me, torch.bfloat16)); dist.all_reduce(t, group=group)
    c.equal("all_reduce bf16", t, total.to(torch.bfloat16))
    if bridged:  # plain gloo reduces a strided view wrongly; the bridge stages it through a dense buffer
        full = dv(torch.zeros(k, 2)); full[:, 0] = dv(base(me)); col = full[:, 0]
        dist.all_reduce(col, group=group); c.equal("all_reduce non-contiguous", full[:, 0].contiguous(), total)
        c.equal("all_reduce non-contiguous untouched", full[:, 1].contiguous(), torch.zeros(k))

    # broadcast from the last member (global rank), sync and async.
    src = ranks[-1]
    t = dv(base(me)); dist.broadcast(t, src=src, group=group); c.equal("broadcast", t, base(n - 1))
    t = dv(base(me)); dist.broadcast(t, src=ranks[0], group=group, async_op=True).wait()
    c.equal("broadcast async", t, base(0))

    # reduce to the first member.
    t = dv(base(me)); dist.reduce(t, dst=ranks[0], group=group)
    if me == 0:
        c.equal("reduce", t, total)
    t = dv(base(me)); dist.reduce(t, dst=ranks[0], op=dist.ReduceOp.AVG, group=group)
    if me == 0:
        c.equal("reduce avg", t, total / n)

    # all_gather (list), all_gather_into_tensor (+ async, + legacy name).
    outs = [dv(torch.zeros(k)) for _ in range(n)]
    dist.all_gather(outs, dv(base(me)), group=group)
    for r in range(n):
        c.equal(f"all_gather[{r}]", outs[r], base(r))
    want_cat = torch.cat([base(r) for r in range(n)])
    out = dv(torch.zeros(n * k)); dist.all_gather_into_tensor(out, dv(base(me)), group=group)
    c.equal("all_gather_into_tensor", out, want_cat)
    if bridged:  # the stacked [n, k] output form is NCCL's; plain gloo refuses it, the bridge accepts it
        out = dv(torch.zeros(n, k))
        dist.all_gather_into_tensor(out, dv(base(me)), group=group, async_op=True).wait()
        c.equal("all_gather_into_tensor async stacked", out, want_cat.view(n, k))
    out = dv(torch.zeros(n * k)); dist._all_gather_base(out, dv(base(me)), group=group)
    c.equal("_all_gather_base", out, want_cat)

    # reduce_scatter_tensor (emulated): SUM sync, AVG async; input must be untouched.
    inp_cpu = torch.cat([base(me) * (j + 1) for j in range(n)])
    want_rs = sum(base(r) for r in range(n)) * (me + 1)
    inp = dv(inp_cpu); out = dv(torch.zeros(k))
    dist.reduce_scatter_tensor(out, inp, group=group)
    c.equal("reduce_scatter_tensor", out, want_rs)
    c.equal("reduce_scatter_tensor input untouched", inp, inp_cpu)
    out = dv(torch.zeros(k))
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG, group=group, async_op=True).wait()
    c.equal("reduce_scatter_tensor avg async", out, want_rs / n)
    out = dv(torch.zeros(k)); dist._reduce_scatter_base(out, inp, group=group)
    c.equal("_reduce_scatter_base", out, want_rs)

    # all_to_all_single: equal splits, then uneven splits (rank r sends j+1 items to j).
    inp = dv(torch.arange(n * 2, dtype=torch.float32) + 100 * me); out = dv(torch.zeros(n * 2))
    dist.all_to_all_single(out, inp, group=group)
    c.equal("all_to_all_single", out, torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 100 * r
                                                 for r in range(n)]))
    in_splits = [j + 1 for j in range(n)]
    inp = dv(torch.full((sum(in_splits),), float(me)))
    out = dv(torch.zeros(n * (me + 1)))
    dist.all_to_all_single(out, inp, [me + 1] * n, in_splits, group=group, async_op=True).wait()
    c.equal("all_to_all_single uneven async", out, torch.cat([torch.full((me + 1,), float(r)) for r in range(n)]))

    # gather to / scatter from the first member.
    glist = [dv(torch.zeros(k)) for _ in range(n)] if me == 0 else None
    dist.gather(dv(base(me)), glist, dst=ranks[0], group=group)
    if glist is not None:
        for r in range(n):
            c.equal(f"gather[{r}]", glist[r], base(r))
    slist = [dv(base(r) * 2) for r in range(n)] if me == 0 else None
    t = dv(torch.zeros(k)); dist.scatter(t, slist, src=ranks[0], group=group)
    c.equal("scatter", t, base(me) * 2)

    # point to point: pairs (0,1), (2,3)... blocking; then a ring with isend/irecv and P2POp.
    if n % 2 == 0:
        peer = ranks[me ^ 1]
        if me % 2 == 0:
            dist.send(dv(base(me)), dst=peer, group=group)
            t = dv(torch.zeros(k)); dist.recv(t, src=peer, group=group); c.equal("send/recv back", t, base(me ^ 1))
        else:
            t = dv(torch.zeros(k)); dist.recv(t, src=peer, group=group); c.equal("send/recv", t, base(me ^ 1))
            dist.send(dv(base(me)), dst=peer, group=group)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    t = dv(torch.zeros(k))
    works = [dist.isend(dv(base(me)), dst=nxt, group=group), dist.irecv(t, src=prv, group=group)]
    for w in works:
        w.wait()
    c.equal("isend/irecv ring", t, base((me - 1) % n))
    t = dv(torch.zeros(k, dtype=torch.bfloat16))
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, dv(base(me, torch.bfloat16)), nxt, group),
                                   dist.P2POp(dist.irecv, t, prv, group)])
    for w in reqs:
        w.wait()
    c.equal("batch_isend_irecv ring bf16", t, base((me - 1) % n, torch.bfloat16))

    # Megatron's DDP pattern: async reduce-scatters inside a coalescing manager, waited on the manager.
    outs2 = [dv(torch.zeros(k)) for _ in range(2)]
    inp2 = [dv(inp_cpu * (i + 1)) for i in range(2)]
    with dist._coalescing_manager(group, async_ops=True) as cm:
        for o, i in zip(outs2, inp2):
            dist.reduce_scatter_tensor(o, i, group=group, async_op=True)
    cm.wait()
    for idx, o in enumerate(outs2):
        c.equal(f"coalesced reduce_scatter[{idx}]", o, want_rs * (idx + 1))

    dist.barrier(group=group)
    dist.barrier(group=group, async_op=True).wait()

    # The NCCL-only PREMUL_SUM is refused on every rank before any communication.
    if not bridged:
        return c.errors
    try:
        dist.all_reduce(dv(base(me)), op=dist._make_nccl_premul_sum(2.0), group=group)
        c.true("premul_sum refused", False)
    except gloo_bridge.UnsupportedBridgedOp as exc:
        c.true("premul_sum error names the op", "all_reduce" in str(exc) and "PREMUL_SUM" in str(exc))
    return c.errors

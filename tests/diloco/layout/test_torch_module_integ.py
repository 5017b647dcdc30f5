"""TorchLayout + FragmentTransfer on a plain module, DP2 over gloo in forked processes.

(Threads cannot share one process's default group, and dist.isend needs a
registered group, so ranks are processes, via the same fork launcher.)
"""

from __future__ import annotations

import pytest
import torch

from diloco.demo.ranks import run_ranks


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from diloco.island.transfer import FragmentTransfer
    from diloco.layout.torch_module import TorchLayout
    from diloco.plan import make_plan

    m = _module()
    layout = TorchLayout(m, group=dist.group.WORLD)
    plan = make_plan(layout.specs(), 2)
    xfer = FragmentTransfer(layout, plan, dist.group.WORLD)
    fails = []
    with torch.no_grad():  # rank 1's copy drifts: export must read rank 0's copy
        if rank == 1:
            for p in m.parameters():
                p.add_(1.0)
    ref = dict(_module().named_parameters())
    for f in range(2):
        got = xfer.export_fragment(f, delta=False)
        if rank == 0:
            for n, t in got or []:
                if not torch.equal(t, ref[n].detach()):
                    fails.append(f"export {n}")
    gen = torch.Generator().manual_seed(1)
    vals = {n: torch.randn(s.shape, generator=gen) for n, s in plan.specs.items()}
    ids = {n: p.data_ptr() for n, p in m.named_parameters()}
    for f in range(2):
        sent = xfer.apply_fragment(f, [(n, vals[n]) for n in plan.names(f)] if rank == 0 else None)
        if rank == 0 and (sent != plan.nbytes(f) or xfer.last_apply_network_bytes != plan.nbytes(f)):
            fails.append(f"bytes {sent}/{xfer.last_apply_network_bytes} vs {plan.nbytes(f)}")
    for n, p in m.named_parameters():
        if not torch.equal(p.detach(), vals[n]) or p.data_ptr() != ids[n]:
            fails.append(f"apply {n}")
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    d = xfer.export_fragment(0, delta=True)
    if rank == 0:
        for n, t in d or []:
            if not torch.equal(t, vals[n] * 2.0 - vals[n]):
                fails.append(f"delta {n}")
    return fails


@pytest.mark.timeout(60)
def test_torch_layout_dp2() -> None:
    results = run_ranks(2, _worker, timeout_s=50)
    assert results == [[], []]


@pytest.mark.timeout(60)
def test_run_ranks_names_the_failing_rank() -> None:
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_ranks(2, _fail_on_rank1, timeout_s=30)


def _fail_on_rank1(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom")
    dist.barrier()  # rank 0 blocks here; the launcher must kill it
    return rank

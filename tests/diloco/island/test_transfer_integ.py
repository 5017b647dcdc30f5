"""FragmentTransfer on real megatron-core layouts (GPTModel + DDP + DistributedOptimizer, CPU, gloo, forked ranks).

Each case builds, in every worker, an unsharded TP1/PP1 reference from the same
seed (megatron's CPU init makes TP shards of the same seed bit-identical to it),
then the layout under test, and checks export / apply / alpha / anchors / delta
against values computed independently in this file (chunk-by-stride slicing).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

warnings.filterwarnings("ignore")
pytest.importorskip("megatron.core")

from diloco.demo.gpt import ModelSpec, build_island_model  # noqa: E402
from diloco.demo.ranks import run_ranks  # noqa: E402

SPEC = ModelSpec(vocab=150, vocab_pad_to=256, hidden=64, layers=4, heads=4, query_groups=2, ffn=128, seq=8, swiglu=True)
MOE_SPEC = ModelSpec(vocab=150, vocab_pad_to=256, hidden=64, layers=2, heads=4, query_groups=2, ffn=64, seq=8, moe_experts=4)
N_FRAGMENTS = 3


def _reference(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Canonical fp32 values of a TP1/PP1 model of the same seed (params, padding rows dropped)."""
    ref = build_island_model(spec, tp=1, pp=1)
    out = {}
    for name, p in ref.unwrapped[0].named_parameters():
        t = p.detach().float().clone()
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = t[: spec.vocab]
        out[name] = t
    return out


def _expected_local(p: torch.nn.Parameter, g: torch.Tensor, tp: tuple[int, int], etp: tuple[int, int]) -> torch.Tensor:
    """The local shard of canonical value g for param p, padding rows zero (written independently of diloco)."""
    if not getattr(p, "tensor_model_parallel", False):
        if p.shape[0] != g.shape[0]:
            g = torch.cat([g, torch.zeros(p.shape[0] - g.shape[0], *g.shape[1:])])
        return g
    rank, count = etp if getattr(p, "allreduce", True) is False else tp
    d = p.partition_dim
    if d == 0 and p.shape[0] * count != g.shape[0]:
        g = torch.cat([g, torch.zeros(p.shape[0] * count - g.shape[0], *g.shape[1:])])
    parts = g.chunk(getattr(p, "partition_stride", 1), d)
    return torch.cat([part.chunk(count, d)[rank] for part in parts], d)


def _worker(rank: int, world: int, spec_kw: dict[str, Any], tp: int, pp: int, ep: int, distopt: bool) -> dict:
    from megatron.core import parallel_state as ps

    from diloco.island.transfer import FragmentTransfer
    from diloco.layout.megatron import MegatronLayout
    from diloco.plan import layout_fingerprint, make_plan

    spec = ModelSpec(**spec_kw)
    fails: list[str] = []
    ref = _reference(spec) if pp == 1 and ep == 1 else None
    built = build_island_model(spec, tp=tp, pp=pp, ep=ep, use_distributed_optimizer=distopt)
    layout = built.layout()
    plan = make_plan(layout.specs(), N_FRAGMENTS)
    xfer = FragmentTransfer(layout, plan, torch.distributed.group.WORLD)
    tpi = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etpi = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())

    # 1. export of the freshly built model equals the unsharded reference, bitwise.
    for f in range(plan.n_fragments):
        got = xfer.export_fragment(f, delta=False)
        if rank != 0:
            if got is not None:
                fails.append("non-sync rank got an export")
            continue
        assert got is not None
        if [n for n, _ in got] != list(plan.names(f)):
            fails.append(f"export {f}: names out of plan order")
        if ref is not None:
            for n, t in got:
                if not torch.equal(t, ref[n]):
                    fails.append(f"export {f}: {n} differs from the TP1 reference")

    # 2. apply known random values; check masters, model params, padding rows, bytes.
    gen = torch.Generator().manual_seed(7)
    values = {n: torch.randn(s.shape, generator=gen) for n, s in plan.specs.items()}
    gpt = built.unwrapped[0]
    pad_before = {n: p.detach().clone() for n, p in gpt.named_parameters() if "word_embeddings" in n or "output" in n}
    for f in range(plan.n_fragments):
        sent = xfer.apply_fragment(f, [(n, values[n]) for n in plan.names(f)] if rank == 0 else None)
        if rank == 0 and distopt and sent != plan.nbytes(f):
            fails.append(f"apply {f}: sync rank handed out {sent} bytes for a {plan.nbytes(f)}-byte fragment")
        if rank == 0 and xfer.last_apply_network_bytes > plan.nbytes(f) and distopt:
            fails.append(f"apply {f}: network bytes {xfer.last_apply_network_bytes} exceed the fragment")
        if rank != 0 and sent != 0:
            fails.append("non-sync rank reported bytes")
    layers = MegatronLayout._layer_numbers(gpt)
    n_local = MegatronLayout._num_local_experts(gpt)
    for pname, p in gpt.named_parameters():
        cname = MegatronLayout._canonical(pname, p, layers, n_local, ps.get_expert_model_parallel_rank())
        want = _expected_local(p, values[cname], tpi, etpi)
        rows = min(p.shape[0], want.shape[0])
        if pname in pad_before:
            valid = max(0, min(p.shape[0], spec.vocab - tpi[0] * p.shape[0])) if getattr(
                p, "tensor_model_parallel", False) else spec.vocab
            if not torch.equal(p.detach()[valid:], pad_before[pname][valid:]):
                fails.append(f"{pname}: padding rows changed")
            rows = valid
            want = want[:valid]
        if not torch.equal(p.detach()[:rows], want[:rows].to(p.dtype)):
            fails.append(f"{pname}: model param != bf16(global slice)")
    for piece in layout.local_pieces():
        if piece.master.dtype != torch.float32:
            fails.append(f"{piece.name}: master not fp32")
    for f in range(plan.n_fragments):
        got = xfer.export_fragment(f, delta=False)
        if rank == 0:
            for n, t in got or []:
                if not torch.equal(t, values[n]):
                    fails.append(f"re-export {f}: {n} != applied value")
    # 3. alpha blending and anchors on fragment 0; delta export.
    values2 = {n: torch.randn(s.shape, generator=gen) for n, s in plan.specs.items()}
    xfer.apply_fragment(0, [(n, values2[n]) for n in plan.names(0)] if rank == 0 else None, alpha=0.5)
    blended = xfer.export_fragment(0, delta=False)
    delta = xfer.export_fragment(0, delta=True)
    if rank == 0:
        for (n, t), (_, d) in zip(blended or [], delta or []):
            want = values[n] * 0.5 + values2[n] * 0.5
            if not torch.equal(t, want):
                fails.append(f"alpha: {n} != 0.5*local + 0.5*global")
            if not torch.equal(d, want - values2[n]):
                fails.append(f"delta after alpha: {n} != master - anchor")
    # 4. train a step, then delta == master - anchor for a fragment applied with alpha 0.
    loss = built.train_step()
    after = xfer.export_fragment(1, delta=False)
    d1 = xfer.export_fragment(1, delta=True)
    if rank == 0:
        changed = False
        for (n, t), (_, d) in zip(after or [], d1 or []):
            changed |= not torch.equal(t, values[n])
            if not torch.equal(d, t - values[n]):
                fails.append(f"delta after step: {n} != master - anchor")
        if not changed:
            fails.append("training step did not change fragment 1")
    # 5. The background path (own gloo data group, worker thread) gives the same bits.
    fails += _background_checks(rank, built, xfer, plan, after, d1, gen)
    return {
        "fails": fails,
        "fingerprint": layout_fingerprint(plan),
        "anchors": [xfer.has_anchor(f) for f in range(plan.n_fragments)],
        "loss": loss,
    }


def _background_checks(rank: int, built: Any, xfer: Any, plan: Any, after: Any, d1: Any,
                       gen: torch.Generator) -> list[str]:
    """Snapshot fragment 1 at the state of `after`, train on, then gather in the background:
    the delta is the snapshot's (== d1, bitwise). Stage + install: progress on fragment 1
    (θ_now + (g − θ_push)), replace on fragment 2; both against the synchronous path."""
    from datetime import timedelta

    from diloco.island.background import Background
    from diloco.island.datapath import DataPath
    from diloco.island.delta_source import DeltaSource

    fails: list[str] = []
    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=60))
    data = DataPath(xfer, group)
    bg = Background("test-data", 1, 60.0)
    out: dict[str, Any] = {}
    data.snapshot(1)
    built.train_step()  # the masters move on while the push is in flight
    now = xfer.export_fragment(1, delta=False)
    def push() -> None:  # what the client does with a DeltaSource before the staging may run
        d = data.gather_delta(1)
        out["d"] = d.materialize([plan.specs[n].shape for n in d.names]) if isinstance(d, DeltaSource) else d

    bg.submit("push", "push", push)
    g = {n: torch.randn(s.shape, generator=gen) for n, s in plan.specs.items()}
    for f, progress in ((1, True), (2, False)):
        vals = [(n, g[n]) for n in plan.names(f)] if rank == 0 else None
        bg.submit("stage", "stage", lambda f=f, vals=vals, progress=progress: data.stage(f, vals, progress))
    if not bg.drain(60) or bg.error:
        return [f"background: {bg.error or 'timeout'}"]
    data.install(1, "progress")
    data.install(2, "blend", 0.0)
    xfer.refresh([1, 2])
    got1 = xfer.export_fragment(1, delta=False)
    got2 = xfer.export_fragment(2, delta=False)
    next1 = xfer.export_fragment(1, delta=True)
    if rank == 0:
        for (n, d), (_, want) in zip(out["d"], d1):
            if not torch.equal(d, want):
                fails.append(f"background delta {n} is not the snapshot's")
        for (n, t), (_, t_now), (_, t_push), (_, nd) in zip(got1, now, after, next1):
            want = t_now + (g[n] - t_push)
            if not torch.equal(t, want):
                fails.append(f"progress install {n} != θ_now + (g − θ_push)")
            if not torch.equal(nd, want - g[n]):
                fails.append(f"next delta {n} != unmerged progress")
        for n, t in got2:
            if not torch.equal(t, g[n]):
                fails.append(f"staged replace {n} != g")
    bg.close()
    return fails


def _check(results: list[dict]) -> str:
    for r, res in enumerate(results):
        assert res["fails"] == [], f"rank {r}: {res['fails'][:8]}"
        assert res["anchors"] == [True] * N_FRAGMENTS
    fps = {res["fingerprint"] for res in results}
    assert len(fps) == 1
    return fps.pop()


_FINGERPRINTS: dict[str, str] = {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world,tp,pp,distopt",
    [(2, 2, 1, True), (2, 1, 2, True), (4, 2, 1, True), (4, 2, 1, False)],
    ids=["tp2", "pp2", "tp2xdp2", "tp2xdp2-nodistopt"],
)
def test_export_apply_megatron(world: int, tp: int, pp: int, distopt: bool) -> None:
    results = run_ranks(world, _worker, SPEC.__dict__, tp, pp, 1, distopt, timeout_s=100)
    _FINGERPRINTS[f"{world}/{tp}/{pp}/{distopt}"] = _check(results)
    # Plan determinism across layouts: every layout of SPEC yields the same plan and fingerprint.
    assert len(set(_FINGERPRINTS.values())) == 1, _FINGERPRINTS


@pytest.mark.timeout(120)
def test_export_apply_moe_ep2() -> None:
    """megatron-core's MoE (SequentialMLP, allgather dispatcher) runs on CPU: EP2 over two ranks."""
    results = run_ranks(2, _worker, MOE_SPEC.__dict__, 1, 1, 2, True, timeout_s=100)
    _check(results)

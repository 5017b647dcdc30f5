"""The commit's fused pass (outer step and the fp32 broadcast digests chunk by chunk) makes exactly
the value and the payload that the step followed by ``encode_payload`` would (``dataplane.commit_part``)."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.outer import OuterHyper
from diloco.syncer.dataplane import CommitPart, RoundSum, encode_part_payload, run_work
from diloco.syncer.core.kernels import Scratch, absmax, magnitude_bound, outer_step
from diloco.wire import FragmentLayout

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mu", [0.0, 0.9])
def test_fused_commit_matches_step_then_encode(mu: float) -> None:
    layout = FragmentLayout.of([("a", (3,)), ("b", (700_001,)), ("c", (50, 100))])
    E = 4096 * 100  # parts straddle tensors; chunks of 1 MiB straddle nothing but their tensor
    g = torch.Generator().manual_seed(3)
    value = torch.randn(layout.numel, generator=g)
    momentum = torch.randn(layout.numel, generator=g) * 0.1 if mu > 0 else None
    s = torch.randn(layout.numel, generator=g)
    hyper = OuterHyper(lr=0.7, momentum=mu)
    for k in range(layout.n_parts(E)):
        lo, hi = layout.part_range(k, E)
        ours_sum, ours_m = s.clone(), None if momentum is None else momentum.clone()
        rs = RoundSum(1, 0, 0, ours_sum, layout.n_parts(E))
        res = run_work(CommitPart(1, 0, k, value, ours_m, None, rs, 5, hyper, layout, E, ("float32",), 1,
                                  seed=77, check=True))
        assert res.error is None
        ref_sum, ref_m = s.clone(), None if momentum is None else momentum.clone()
        outer_step(ref_sum, value, ref_m, None, lo, hi, 5.0, 0.7, mu, Scratch(), False)
        ref = encode_part_payload(ref_sum, layout, k, E, "float32", seed=77)
        (payloads, absmax), = res.parts
        got = payloads["float32"]
        assert torch.equal(ours_sum, ref_sum) and (ours_m is None or torch.equal(ours_m, ref_m))
        assert got.metas == ref.metas and got.chunk_bytes == ref.chunk_bytes and got.nbytes == ref.nbytes
        assert [bytes(f) for f in got.frames] == [bytes(f) for f in ref.frames]
        assert absmax[0] == float(ref_sum[lo:hi].abs().max())


def test_the_folds_magnitude_bound_is_above_max_abs_and_flags_nan_and_inf() -> None:
    gen = torch.Generator().manual_seed(3)
    for scale in (1e-30, 1e-3, 1.0, 1e15):
        t = torch.randn(1 << 18, generator=gen) * scale
        t[123] = 40.0 * scale  # one element dominating the norm: the bound must still cover it
        assert absmax(t) <= magnitude_bound(t) <= 1.02 * float(t.norm()) + 1e-18
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.zeros(1 << 18)
        t[-1] = bad
        assert magnitude_bound(t) == math.inf
    huge = torch.full((1000,), 3e37)  # finite, but the squares overflow: the exact max comes back
    assert magnitude_bound(huge) == pytest.approx(3e37)
    assert magnitude_bound(torch.zeros(0)) == 0.0

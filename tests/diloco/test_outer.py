"""The outer merge + Nesterov step against a literal numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco.outer import BLOCK_ELEMS, MergeScratch, OuterHyper, merge_weights, outer_step

pytestmark = pytest.mark.timeout(60)


def reference(v, m, deltas, ws, lr, mu):
    s = np.zeros_like(v)
    for d, w in zip(deltas, ws):
        s = s + d.astype(np.float32) * np.float32(w)
    g = -(s / np.float32(sum(ws)))
    m = np.float32(mu) * m + g
    return v - np.float32(lr) * (g + np.float32(mu) * m), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outer_step_bitwise_across_blocks_and_commits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, BLOCK_ELEMS // 2 + 7), (5,)]  # spans blocks, ragged last block
    values = [torch.randn(s, generator=gen) for s in shapes]
    moms = [torch.zeros(s) for s in shapes]
    nv = [v.numpy().copy() for v in values]
    nm = [m.numpy().copy() for m in moms]
    hyper, scratch = OuterHyper(lr=0.7, momentum=0.9), MergeScratch()
    for commit in range(3):
        ws = [3, 0, 700001 + commit, 12]
        deltas = [[(torch.randn(s, generator=gen) * 0.01).to(dtype) for s in shapes] for _ in ws]
        assert outer_step(values, moms, deltas, ws, hyper, scratch)
        for j in range(len(shapes)):
            nv[j], nm[j] = reference(nv[j], nm[j], [d[j].float().numpy() for d in deltas], ws, 0.7, 0.9)
            assert np.array_equal(values[j].numpy().view(np.uint32), nv[j].view(np.uint32))
            assert np.array_equal(moms[j].numpy().view(np.uint32), nm[j].view(np.uint32))


def test_all_zero_weights_change_nothing_and_weighting_rules() -> None:
    v, m = torch.ones(4), torch.zeros(4)
    assert not outer_step([v], [m], [[torch.ones(4)]], [0], OuterHyper(), MergeScratch())
    assert torch.equal(v, torch.ones(4)) and torch.equal(m, torch.zeros(4))
    assert merge_weights([5, 7], [1, 1], "tokens") == [5, 7]
    assert merge_weights([0, 0], [1, 1], "tokens") == [1, 1]
    assert merge_weights([5, 7], [0, 1], "tokens") == [0, 7]
    assert merge_weights([5, 7], [2, 0], "equal") == [1, 0]
    with pytest.raises(ValueError):
        OuterHyper(momentum=1.0)

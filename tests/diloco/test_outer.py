"""Merge weights, outer hyper-parameters, and the data plane's fold + outer step against numpy, bit for bit.

The syncer folds each part of each push into a running fp32 sum (``fold_part``) and then
runs the outer Nesterov step per part, over cache blocks (``commit_part``), out of place
into the sum buffer.  The reference below is docs/PROTOCOL.md "Commit", one numpy fp32 op
at a time, each part folded in its own order.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from diloco.outer import OuterHyper, push_weight
from diloco.syncer.dataplane import COMMIT_BLOCK, CommitPart, FoldPart, RoundSum, run_work
from diloco.wire import Bcast, FragmentLayout, Push, decode, encode, open_message, seal

pytestmark = pytest.mark.timeout(120)

PART = 49 * 4096  # 200704 elements: every part spans commit blocks (COMMIT_BLOCK is smaller), the last one ragged
SCHEMA = [("w", (3, 200_001)), ("b", (5,)), ("v", (7,))]  # 600015 elements: 3 parts, the last short
LAYOUT = FragmentLayout.of(SCHEMA)
N_PARTS = LAYOUT.n_parts(PART)


def test_push_weight_rules() -> None:
    assert push_weight(2, 10, "tokens") == 10
    assert push_weight(0, 10, "tokens") == 0  # no local step: weight 0 whatever the rule
    assert push_weight(2, 0, "tokens") == -1  # refused by the caller (no fallback to steps)
    assert push_weight(0, 0, "tokens") == 0
    assert push_weight(3, 0, "steps") == 3 and push_weight(0, 5, "steps") == 0
    assert push_weight(5, 7, "equal") == 1 and push_weight(0, 7, "equal") == 0
    assert isinstance(push_weight(2, 1 << 40, "tokens"), int)
    with pytest.raises(ValueError, match="weighting"):
        push_weight(1, 1, "loss")


def test_outer_hyper_validation() -> None:
    h = OuterHyper()
    assert (h.lr, h.momentum) == (1.0, 0.0)
    assert OuterHyper(lr=1e-3, momentum=0.0).momentum == 0.0
    for bad in ({"momentum": 1.0}, {"momentum": -0.1}, {"lr": 0.0}, {"lr": -1.0}, {"lr": math.nan},
                {"lr": math.inf}):
        with pytest.raises(ValueError):
            OuterHyper(**bad)


def reference(v: np.ndarray, m: np.ndarray, deltas: dict[int, np.ndarray], ws: dict[int, int],
              orders: list[list[int]], lr: float, mu: float) -> tuple[np.ndarray, np.ndarray]:
    s = np.empty_like(v)
    for k, order in enumerate(orders):
        lo, hi = LAYOUT.part_range(k, PART)
        acc = deltas[order[0]][lo:hi].astype(np.float32) * np.float32(ws[order[0]])
        for i in order[1:]:
            acc = acc + deltas[i][lo:hi].astype(np.float32) * np.float32(ws[i])
        s[lo:hi] = acc
    g = -(s / np.float32(sum(ws.values())))
    m = np.float32(mu) * m + g
    return v - np.float32(lr) * (g + np.float32(mu) * m), m


def bitwise(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def part_message(island: int, k: int, tensors: list[tuple[str, torch.Tensor]]):
    header = Push(island=island, generation=1, fragment=0, round=1, attempt=0, base_version=0, local_steps=1,
                  tokens=1, part=k, n_parts=N_PARTS)
    return open_message(encode(header, LAYOUT.slice_part(tensors, k, PART)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_and_commit_parts_bitwise_across_parts_blocks_and_commits(dtype: torch.dtype) -> None:
    assert N_PARTS == 3 and PART > COMMIT_BLOCK and PART % COMMIT_BLOCK  # spans blocks, the last one ragged
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    value = torch.randn(LAYOUT.numel, generator=gen)
    momentum = torch.zeros(LAYOUT.numel)
    nv, nm = value.numpy().copy(), momentum.numpy().copy()
    mu, lr = 0.9, 0.7
    hyper = OuterHyper(lr=lr, momentum=mu)
    for commit in range(3):
        # weights: small, large, one that is not an fp32 integer (16777219 rounds), a zero-weight push
        ws = {0: 3, 1: 700001 + commit, 2: 16777219, 3: 12, 4: 0}
        weighted = [i for i, w in ws.items() if w > 0]
        deltas = {i: [(n, (torch.randn(s, generator=gen) * 0.01).to(dtype)) for n, s in SCHEMA] for i in weighted}
        flat = {i: torch.cat([t.reshape(-1).float() for _, t in deltas[i]]).numpy() for i in weighted}
        sum_buf = torch.full((LAYOUT.numel,), float("nan"))  # arbitrary bytes: the first fold overwrites
        rs = RoundSum(round=commit + 1, attempt=0, fragment=0, flat=sum_buf, n_parts=N_PARTS)
        orders = []
        for k in range(N_PARTS):
            order = weighted[:]
            rng.shuffle(order)
            orders.append(order)
        # Folds of different parts interleave (as they do across workers); each part keeps its order.
        jobs = [(k, i) for k in range(N_PARTS) for i in orders[k]]
        jobs.sort(key=lambda ki: (orders[ki[0]].index(ki[1]), rng.random()))
        for k, i in jobs:
            lo, _hi = LAYOUT.part_range(k, PART)
            res = run_work(FoldPart(rs, k, lo, part_message(i, k, deltas[i]), ws[i], i))
            assert res.error is None
        assert rs.started == [True] * N_PARTS
        # Commit 1 writes its momentum beside the old one (a checkpoint pins it).
        new_m = torch.empty(LAYOUT.numel) if commit == 1 else None
        old_m = momentum.clone()
        results = []
        span = 1 + commit % 2  # commit work items of one part, then of two parts each (the last may hold one)
        for k in reversed(range(0, N_PARTS, span)):  # spans are independent
            parts = min(span, N_PARTS - k)
            lo, hi = LAYOUT.part_range(k, PART)[0], LAYOUT.part_range(k + parts - 1, PART)[1]
            results.append(run_work(CommitPart(commit + 1, 0, k, value, momentum, new_m, rs, sum(ws.values()),
                                               hyper, LAYOUT, PART, ("float32", "bfloat16"), commit + 1, parts=parts)))
            assert len(results[-1].parts) == parts
        assert all(r.error is None for r in results)
        nv, nm = reference(nv, nm, flat, ws, orders, lr, mu)
        new_value = rs.flat  # written out of place, where the sum was
        assert bitwise(new_value.numpy(), nv)
        if new_m is not None:
            assert bitwise(new_m.numpy(), nm) and torch.equal(momentum, old_m)
            momentum = new_m
        else:
            assert bitwise(momentum.numpy(), nm)
        # The broadcast payloads of each part: fp32 exactly the new value, bf16 its rounding.
        made = [(k, payloads) for r in results for k, (payloads, _absmax) in enumerate(r.parts, start=r.work.part)]
        assert sorted(k for k, _ in made) == list(range(N_PARTS))
        for k, payloads in made:
            lo, hi = LAYOUT.part_range(k, PART)
            for wire_dtype, payload in payloads.items():
                msg = decode(seal(Bcast(fragment=0, version=commit + 1, round=commit + 1, cut=False, part=k,
                                        n_parts=N_PARTS), payload))
                got = torch.cat([t.reshape(-1) for _, t in msg.tensors])
                want = new_value[lo:hi] if wire_dtype == "float32" else new_value[lo:hi].bfloat16()
                assert [n for n, _ in msg.tensors] == [LAYOUT.names[i] for i, _a, _b in LAYOUT.segments(lo, hi)]
                assert got.dtype == want.dtype and torch.equal(got, want), (wire_dtype, k)
        value = new_value


def test_refused_fold_leaves_the_sum_untouched_and_a_void_sum_skips() -> None:
    gen = torch.Generator().manual_seed(3)
    d = [(n, torch.randn(s, generator=gen)) for n, s in SCHEMA]
    rs = RoundSum(round=1, attempt=0, fragment=0, flat=torch.zeros(LAYOUT.numel), n_parts=N_PARTS)
    lo, _ = LAYOUT.part_range(1, PART)
    assert run_work(FoldPart(rs, 1, lo, part_message(0, 1, d), 2, 0)).error is None
    before = rs.flat.clone()
    bad = [(n, t.clone()) for n, t in d]
    bad[0][1][2, 199_000] = float("inf")  # in part 2
    lo2, _ = LAYOUT.part_range(2, PART)
    res = run_work(FoldPart(rs, 2, lo2, part_message(1, 2, bad), 3, 1))
    assert res.error is not None and "NaN or Inf" in res.error
    assert torch.equal(rs.flat, before) and rs.started == [False, True, False]
    frames = encode(Push(island=1, generation=1, fragment=0, round=1, attempt=0, base_version=0, local_steps=1,
                         tokens=1, part=1, n_parts=N_PARTS), LAYOUT.slice_part(d, 1, PART))
    raw = bytearray(frames[2])
    raw[0] ^= 1
    res = run_work(FoldPart(rs, 1, lo, open_message([frames[0], frames[1], bytes(raw), *frames[3:]]), 3, 1))
    assert res.error is not None and "digest" in res.error and torch.equal(rs.flat, before)
    rs.void = True
    assert run_work(FoldPart(rs, 1, lo, part_message(2, 1, d), 5, 2)).error is None
    assert torch.equal(rs.flat, before)

"""Robust aggregation and admission-gate rules as plain values (``robust.py``, ``gate.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.syncer.allowlist import read_allow_list
from diloco.syncer.core.gate import Gate
from diloco.syncer.core.robust import (PartBound, Reference, cap_weight, check_chunk, clamp_counts, clip_scale,
                                       finish_part, overflow_safe, unjudged_excess)
from diloco.wire import WireError


def test_counts_are_clamped_and_a_liars_weight_capped() -> None:
    steps, toks, why = clamp_counts(2**40, 2**64 - 1, sync_every=10, steps_factor=4, max_tokens_per_step=1000)
    assert (steps, toks) == (40, 40_000) and why
    assert clamp_counts(10, 5000, 10, 4, 1000) == (10, 5000, None)
    w, why = cap_weight(2**64 - 1, 10, [10**7], factor=4.0)  # the other pushed 1e7 tokens per step
    assert w == 4 * 10**8 and why  # the liar's share: 4/5, not 100 %
    assert cap_weight(10**8, 10, [], 4.0) == (10**8, None)
    # The lower median: with two rates the liar's own claim is never the reference.
    assert cap_weight(2**40, 1, [2**40, 100], 4.0)[0] == 400
    # Per step: an honest island that pushed after 10 steps, against one that pushed after 2
    # (the same tokens per step), is not capped.
    assert cap_weight(40960, 10, [8192 / 2], 4.0) == (40960, None)


def test_an_attempt_judged_by_nothing_is_judged_when_complete() -> None:
    assert unjudged_excess({0: (100, 2), 1: (400, 2)}, 4.0) is None
    assert unjudged_excess({0: (100, 2), 1: (500, 10)}, 4.0) is None  # more steps, same rate
    assert unjudged_excess({1: (2**40, 2)}, 4.0) is None  # a lone push: nothing to compare
    island, why = unjudged_excess({0: (100, 2), 1: (2**40, 2), 2: (120, 2)}, 4.0)
    assert island == 1 and "capped at 400" in why


def test_part_bounds_refuse_absurd_elements_and_norms() -> None:
    with pytest.raises(WireError, match="above the bound"):
        check_chunk(PartBound(), 1e30, torch.full((4,), 1e30))
    b = PartBound(hard_norm=10.0)
    check_chunk(b, 6.0, torch.full((4,), 6.0))
    with pytest.raises(WireError, match="above the bound"):
        finish_part(b)  # norm 12 > 10
    ok = PartBound(hard_norm=10.0)
    check_chunk(ok, 3.0, torch.full((4,), 3.0))
    finish_part(ok)
    assert math.isclose(ok.sumsq, 36.0)
    assert overflow_safe([2**40] * 64) and not overflow_safe([2**120])


def test_reference_rms_comes_from_the_previous_round_of_the_fragment() -> None:
    ref = Reference()
    assert ref.bound(0, 1, 0, 4, 64.0).hard_norm == math.inf
    for island, norm in ((0, 2.0), (1, 4.0), (2, 100.0)):
        ref.sink(0, 1, island, 4)(norm)
    ref.sink(0, 3, 0, 4)(1.0)  # round 3 of fragment 0 starts: round 1 becomes the reference
    assert math.isclose(ref.rms[0], 2.0)  # median of RMS 1, 2, 50
    assert math.isclose(ref.bound(0, 3, 0, 4, 64.0).hard_norm, 64.0 * 2.0 * 2.0)


def test_keys_own_island_ids_and_hellos_are_rate_limited(tmp_path) -> None:
    g = Gate()
    assert g.key_problem(1, "K" * 40) is None
    g.bind(1, "K" * 40)
    assert "another key" in g.key_problem(1, "L" * 40)
    assert "owns island id 1" in g.key_problem(2, "K" * 40)
    assert g.key_problem(1, "") is None  # HMAC / insecure: no per-island keys
    g2 = Gate()
    g2.restore(g.to_json())
    assert g2.bindings == {1: "K" * 40}
    sent = [g.allow_hello(b"peer", 0.0) for _ in range(10)]
    assert sent.count(True) == 4 and g.rate_limited == 6
    assert g.allow_hello(b"peer", 2.0)  # earned one back
    (tmp_path / "ids").write_text("# id = key\n0 = " + "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7" + "\n")
    assert read_allow_list(str(tmp_path / "ids"), 2) == {0: "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"}
    (tmp_path / "bad").write_text("5 = nope\n")
    with pytest.raises(ValueError, match="bad:1"):
        read_allow_list(str(tmp_path / "bad"), 2)


def test_a_part_is_clipped_above_the_clip_norm_and_refused_above_the_hard_one() -> None:
    seen = []

    def part(norm: float) -> PartBound:
        b = PartBound(hard_norm=64.0, clip_norm=8.0, on_clip=lambda n, c: seen.append((n, c)))
        check_chunk(b, norm, torch.tensor([norm]))
        return b
    assert clip_scale(part(4.0)) == 1.0 and seen == []
    b2 = part(32.0)
    assert clip_scale(b2) == 0.25 and seen == [(32.0, 8.0)] and math.isclose(b2.sumsq, 64.0)
    with pytest.raises(WireError, match="above the bound"):
        clip_scale(part(65.0))
    nan = PartBound(hard_norm=64.0, clip_norm=8.0)
    nan.sumsq = float("nan")
    with pytest.raises(WireError, match="above the bound"):
        clip_scale(nan)
    ref = Reference()
    for island, norm in ((0, 2.0), (1, 4.0), (2, 100.0)):
        ref.sink(0, 1, island, 4)(norm)
    b3 = ref.bound(0, 2, 1, 4, 64.0, 8.0)  # the next round's first bound already sees round 1
    assert math.isclose(b3.clip_norm, 8.0 * 2.0 * 2.0) and math.isclose(b3.hard_norm, 64.0 * 2.0 * 2.0)
    b3.sumsq = 64.0 ** 2
    assert math.isclose(clip_scale(b3), 0.5)
    assert "i1:clipped1" in ref.summary()


def test_the_norm_reference_is_per_local_step_and_a_push_is_bounded_by_its_own_steps() -> None:
    """A staggered fragment's first round covers few steps and the next many: the later round's
    larger (honest) delta is not clipped against the first. A push's steps count as clamped for
    its weight, so claiming more steps buys at most ``max_steps_factor`` of norm room."""
    from diloco.syncer.core.config import SyncerConfig
    from diloco.syncer.core.records import PushRecord, RoundRecord
    from diloco.syncer.core.robustrules import part_bound
    ref = Reference()
    for island, norm in ((0, 2.0), (1, 2.0)):  # round 1: 4 steps, part RMS 1, so 0.25 per step
        ref.sink(0, 1, island, 4, steps=4)(norm)
    grown = ref.bound(0, 2, 0, 4, 64.0, 8.0, steps=16)
    assert math.isclose(ref.rms[0], 0.25)
    assert math.isclose(grown.clip_norm, 8.0 * 0.25 * 16 * 2.0)
    check_chunk(grown, 6.0, torch.full((4,), 6.0))  # 6x round 1's RMS after 4x the steps
    assert clip_scale(grown) == 1.0
    short = ref.bound(0, 2, 1, 4, 64.0, 8.0, steps=1)
    check_chunk(short, 6.0, torch.full((4,), 6.0))  # the same delta after one step: clipped
    assert clip_scale(short) < 1.0
    cfg = SyncerConfig(islands=2, sync_every=16)
    r = RoundRecord(round=2, fragment=0, attempt=0, members=frozenset({0, 1}), attempt_started=0.0)
    r.pushes[1] = PushRecord(island=1, base_version=1, local_steps=10**6, tokens=1, weight=1, n_parts=1)
    liar = part_bound(cfg, ref, r, 1, 4)
    assert math.isclose(liar.clip_norm, 8.0 * 0.25 * cfg.max_steps_factor * 16 * 2.0)

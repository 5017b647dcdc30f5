"""The held final cut: a fragment whose final value was streamed to an island in fp32 after it
said it is done goes to it as a HELD notice (``Final.held``, no bytes); every other fragment, a
bf16 island, an island whose send failed and an island that redialed get the fp32 stream."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from diloco.digest import tensor_digest
from diloco.syncer.core.records import Outgoing, OutStream
from diloco.wire import Final, FinalAck, Shutdown

from state_driver import Driver, of, streams  # noqa: E402
from test_state import CFG, GEN, delta, hb, hello, open_round1, peer, pushes, started  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _finish_training(d: Driver, dtype: torch.dtype = torch.float32) -> tuple[list, list]:
    """Round 1 (fragment 0) commits before anyone is done; every island then says done, round 2
    (fragment 1) commits and goes out as a BCAST to done islands; the flush rounds merge nothing.
    Returns everything sent from then on, and what the last push produced (the final cut)."""
    open_round1(d)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0, tensors=delta(0, i, dtype)), now=1.0)
    for i in range(3):
        d.send(peer(i), hb(i, 4, done=True), now=2.0)
    out: list = []
    sent: list = []
    for r in (2, 3, 4):
        for i in range(3):
            rec = d.st.rounds.get(r)
            if rec is None:
                continue
            f = rec.fragment
            out = d.send_all(peer(i), pushes(i, r, f, base=d.st.fragments[f].version, steps=2 if r == 2 else 0,
                                             tensors=delta(f, i, dtype)), now=2.0)
            sent += out
    assert d.st.phase == "final" and d.st.versions() == (1, 1)
    return sent, out


def _held(out: list, p: bytes) -> list[int]:
    return [o.header.fragment for o in of(out, Final) if o.peer == p and o.header.held]


def _streamed(out: list, p: bytes) -> list[int]:
    return [o.fragment for o in streams(out, "FINAL") if o.peer == p]


def _digests(d: Driver) -> tuple[str, ...]:
    return tuple(tensor_digest(f.layout.flat_views(f.value)) for f in d.st.fragments)


def test_a_value_streamed_after_done_goes_as_a_held_final_and_is_checked() -> None:
    d = started(replace(CFG, total_steps=4))
    _, out = _finish_training(d)
    for i in range(3):
        # Fragment 1's value went out after the island's done: HELD. Fragment 0's went out before it.
        assert _held(out, peer(i)) == [1] and _streamed(out, peer(i)) == [0]
    notice = next(o.header for o in of(out, Final) if o.header.held)
    assert (notice.version, notice.versions, notice.part, notice.n_parts) == (1, (1, 1), 0, 0)
    # The resend to islands that have not acknowledged keeps the held notices (same sessions).
    out = d.tick(2.0 + d.st.final.resend_s() + 0.1)
    assert all(_held(out, peer(i)) == [1] and _streamed(out, peer(i)) == [0] for i in range(3))
    ok = _digests(d)
    for i in range(3):
        out = d.send(peer(i), FinalAck(island=i, generation=GEN[i], versions=(1, 1), digests=ok), now=4.0)
    assert d.st.finished and d.st.exit_code == 0 and len(of(out, Shutdown)) == 3


def test_a_held_final_whose_value_differs_at_the_island_fails_the_run() -> None:
    d = started(replace(CFG, total_steps=4))
    _finish_training(d)
    ok = _digests(d)
    for i in range(3):
        d.send(peer(i), FinalAck(island=i, generation=GEN[i], versions=(1, 1),
                                 digests=(ok[0], "0" * 32) if i == 1 else ok), now=4.0)
    assert d.st.finished and d.st.exit_code == 1


def test_a_send_error_or_a_redial_gets_the_bytes_again() -> None:
    d = started(replace(CFG, total_steps=4))
    _finish_training(d)
    # A send error to island 1: what else went to it is uncertain, so its final cut goes as bytes.
    d.st.on_lost(peer(1), "FINAL", 0, False, now=2.1)
    d.send(peer(1), hb(1, 4, done=True), now=2.2)  # heard from again: the lost FINAL is resent
    out = d.tick(2.0 + d.st.final.resend_s() + 0.1)
    assert _held(out, peer(1)) == [] and sorted(_streamed(out, peer(1))) == [0, 1]
    assert _held(out, peer(0)) == [1]
    # Island 2 redials: a new session gets the whole final cut as bytes.
    out = d.send(peer(2) + b"r", hello(2, 301), now=2.5)
    assert _held(out, peer(2) + b"r") == [] and _streamed(out, peer(2) + b"r") == [0, 1]
    assert d.st.islands[2].done_values == {}


def test_bf16_islands_and_values_streamed_before_done_are_never_held() -> None:
    d = started(replace(CFG, total_steps=4), dtype="bfloat16")
    sent, out = _finish_training(d, torch.bfloat16)
    bcasts = streams(sent, "BCAST")
    assert bcasts and all(o.wire_dtype == "bfloat16" for o in bcasts)
    assert not [o for o in out if isinstance(o, Outgoing) and isinstance(o.header, Final)]
    assert all(sorted(_streamed(out, peer(i))) == [0, 1] for i in range(3))
    assert all(isinstance(o, OutStream) and o.wire_dtype == "float32" for o in streams(out, "FINAL"))


def test_only_round_values_sent_after_done_are_remembered() -> None:
    from diloco.syncer.core.records import IslandRecord

    rec = IslandRecord(0)
    rec.streamed(0, 2, "float32")
    assert not rec.holds_final(0, 2)  # before done: the island did not hash it
    rec.done = True
    rec.streamed(0, 3, "float32", cut=True)
    assert not rec.holds_final(0, 3)  # a cut goes to a session that may not have said done itself
    rec.streamed(0, 3, "float32")
    rec.streamed(1, 5, "float32")
    assert rec.holds_final(0, 3) and rec.holds_final(1, 5) and not rec.holds_final(0, 2)
    rec.unsent(1, 4)  # another version skipped: changes nothing
    assert rec.holds_final(1, 5)
    rec.unsent(1, 5)  # the stream was superseded before a part went: its final goes as bytes
    assert not rec.holds_final(1, 5)
    rec.streamed(0, 4, "bfloat16")
    assert not rec.holds_final(0, 3) and not rec.holds_final(0, 4)

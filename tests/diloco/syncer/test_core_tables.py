"""The core's tables on their own (Sessions, RoundBook, Finalize) and the Coordinator driven by
scripted events: plain values, no sockets, no processes, milliseconds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from diloco.protocol.schedule import Schedule
from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.checks import Dropped, Refused
from diloco.syncer.core.coordinator import Coordinator
from diloco.syncer.core.effects import Journal
from diloco.syncer.core.events import Lost, Received, Tick
from diloco.syncer.core.finalize import Finalize
from diloco.syncer.core.records import IslandRecord
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.wire import Heartbeat, HostBufferPool, Pull, Welcome

from state_driver import kinds, of, opened, run_work, unchecked  # noqa: E402
from test_state import CFG, FP, GEN, hello, inits, peer  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def bound_sessions() -> tuple[Sessions, IslandRecord]:
    s = Sessions(CFG, Journal())
    h = hello(1, GEN[1])
    s.check_hello(peer(1), h, unchecked(h), 0.0, "")
    s.accept_hello(h, "")
    assert not s.retire(h)
    return s, s.bind(peer(1), h, 0.0)


def test_sessions_bind_check_and_supersede() -> None:
    s, rec = bound_sessions()
    assert rec.bound and rec.nonce and s.island_of(peer(1)) == 1 and s.stamp(peer(1)) == (rec.nonce, 1)
    assert s.stamp(b"nobody") == (0, 0)
    hb = Heartbeat(island=1, generation=GEN[1], step=0)
    with pytest.raises(Dropped, match="session nonce"):
        s.session(1, GEN[1], peer(1), opened(hb, nonce=rec.nonce + 1, seq=1))
    with pytest.raises(Refused, match="not island 1's current"):
        s.session(1, GEN[1] + 1, peer(1), opened(hb, nonce=rec.nonce, seq=1))
    msg = opened(hb, nonce=rec.nonce, seq=1)
    assert s.session(1, GEN[1], peer(1), msg) is rec
    s.touch(rec, msg, 1.0)
    with pytest.raises(Dropped, match="a replay"):
        s.session(1, GEN[1], peer(1), msg)
    # A redial of the island: the old generation is retired, the old routing id superseded.
    h2 = hello(1, GEN[1] + 1)
    s.check_hello(peer(2), h2, unchecked(h2), 2.0, "")
    with pytest.raises(Dropped, match="seen before"):
        s.check_hello(peer(1), hello(1, GEN[1]), unchecked(hello(1, GEN[1])), 2.0, "")
    s.accept_hello(h2, "")
    assert s.retire(h2) and 1 not in s.proven
    s.bind(peer(2), h2, 2.0)
    assert s.take_superseded() == [peer(1)] and s.take_superseded() == []
    with pytest.raises(Refused, match="was replaced"):
        s.bound_island(1, GEN[1])


def test_sessions_ready_needs_a_proven_session_and_a_cut() -> None:
    s, rec = bound_sessions()
    assert s.live() == [rec] and s.ready() == []
    rec.cut_sent = True
    assert s.ready() == []  # a HELLO alone is not membership
    s.proven.add(1)
    assert s.ready() == [rec]
    s.declare_dead(CFG.dead_after_s + 1.0)
    assert s.live() == [] and not rec.cut_sent


def roundbook(**cfg: object) -> RoundBook:
    config = replace(CFG, **{"max_gathering_rounds": min(2, int(cfg.get("max_open_rounds", 2))), **cfg})
    book = FragmentBook(config, HostBufferPool())
    book.fix_layout(FP, 2)
    return RoundBook(config, book)


def islands_at(*steps: int) -> list[IslandRecord]:
    return [IslandRecord(i, bound=True, alive=True, cut_sent=True, last_step=s) for i, s in enumerate(steps)]


def test_roundbook_opens_by_the_kth_fastest_clock_one_round_per_fragment() -> None:
    rb = roundbook()
    # quorum 2, H=4, P=2: round t opens when the 2nd fastest island reaches step 2t.
    opened_, over = rb.open_training(islands_at(9, 4, 0), now=0.0)
    assert [(r.round, r.fragment) for r in opened_] == [(1, 0), (2, 1)] and not over
    assert rb.next_open == 3 and rb.has_fragment(0)
    assert rb.open_training(islands_at(9, 9, 9), now=0.0)[0] == []  # round 3 waits for round 1 (fragment 0)
    r1 = rb.rounds[1]
    rb.restart(r1, frozenset({0}), now=1.0)
    assert (r1.attempt, r1.members, r1.attempt_started, r1.pushes) == (1, frozenset({0}), 1.0, {})
    rb.retire(rb.rounds[2])
    assert rb.next_commit == 1  # commits finish out of order: round 1 is still the first uncommitted
    rb.retire(r1)
    assert rb.next_commit == 3 and "r" not in rb.status()


def test_rounds_due_by_the_last_step_open_as_training_rounds_when_every_island_is_done() -> None:
    rb = roundbook(total_steps=8)  # H=4, P=2: rounds 1-4 open at steps 2, 4, 6, 8
    done = [replace(i, done=True) for i in islands_at(8, 8, 8)]  # the last step and the end in one turn
    opened_, over = rb.open_training(done, now=0.0)
    assert [(r.round, r.fragment, r.flush) for r in opened_] == [(1, 0, False), (2, 1, False)] and not over
    assert rb.open_training(done, now=0.0) == ([], False)  # round 3 waits for round 1 (fragment 0)
    rb.retire(rb.rounds[1])
    rb.retire(rb.rounds[2])
    opened_, over = rb.open_training(done, now=0.0)
    assert [(r.round, r.flush) for r in opened_] == [(3, False), (4, False)] and over  # the flush waits for them
    early = [replace(i, done=True) for i in islands_at(5, 3, 7)]  # stopped before the end: rounds due by step 3
    rb = roundbook(total_steps=8)
    opened_, over = rb.open_training(early, now=0.0)
    assert [r.round for r in opened_] == [1] and over  # round 2 (step 4) is not due: only the flush is left


def test_one_round_gathers_at_a_time_by_default_the_next_opens_once_it_closed() -> None:
    rb = roundbook(max_gathering_rounds=1)
    opened_, _ = rb.open_training(islands_at(9, 4, 0), now=0.0)
    assert [(r.round, r.fragment) for r in opened_] == [(1, 0)]  # round 2's step is reached, round 1 gathers
    assert rb.full() and rb.open_flush({1}, frozenset({0, 1}), now=0.0) == []
    rb.rounds[1].closed = True  # round 1 has its pushes (it commits): its sum is the next value, not a new sum
    opened_, _ = rb.open_training(islands_at(9, 4, 0), now=0.0)
    assert [(r.round, r.fragment) for r in opened_] == [(2, 1)] and rb.full()
    rb.retire(rb.rounds[1])
    assert rb.full()  # round 2 gathers


def test_gathering_rounds_must_fit_the_open_rounds() -> None:
    with pytest.raises(ValueError, match="--max-gathering-rounds"):
        replace(CFG, max_open_rounds=2, max_gathering_rounds=3)
    with pytest.raises(ValueError, match="--max-gathering-rounds"):
        replace(CFG, max_gathering_rounds=0)


def test_roundbook_flush_rounds_within_the_open_rounds_limit() -> None:
    rb = roundbook(max_open_rounds=1)
    opened_ = rb.open_flush({0, 1}, frozenset({0, 1}), now=0.0)
    assert [(r.round, r.fragment, r.flush) for r in opened_] == [(1, 0, True)]
    assert rb.open_flush({0, 1}, frozenset({0, 1}), now=0.0) == []


def test_finalize_waits_for_flush_joins_and_acks() -> None:
    cfg = replace(CFG, total_steps=8, join_timeout_s=5.0)
    fin = Finalize(cfg)
    isl = islands_at(8, 8, 8)
    for i in isl:
        i.joined = True
    assert fin.due(0.0, True, False, isl, isl, 0.0) is None  # flush not started
    fin.start_flush(Schedule(cfg.sync_every, 2, cfg.total_steps))
    assert fin.flush_left == {0, 1}
    fin.flushed(0)
    fin.flushed(1)
    assert fin.due(0.0, True, True, isl, isl, 0.0) is None  # a round is still open
    isl[2].joined = False
    assert fin.due(1.0, True, False, isl, isl, 0.0) is None  # a slow island may still join
    assert fin.due(6.0, True, False, isl, isl, 0.0) == isl
    fin.begin(6.0, isl[:2])
    assert fin.phase == "final" and fin.final_expected == {0, 1} and fin.owes_final(isl[0])
    assert fin.resend_to(6.0, isl) == [] and fin.resend_to(6.0 + fin.resend_s(), isl) == isl[:2]
    assert fin.verdict(isl, [], ()) is None  # no acknowledgement yet
    isl[0].final_acked = isl[1].final_acked = True
    assert fin.verdict(isl, [], ()) == (0, "training finished")
    assert "islands [1]" in (fin.timed_out(6.0 + cfg.final_timeout_s, [isl[0], IslandRecord(1)]) or "")
    fin.finish(0)
    assert fin.finished and fin.exit_code == 0


def test_coordinator_takes_scripted_events() -> None:
    c = Coordinator(CFG, syncer_id=7)
    out = c.handle(Received(peer(0), opened(hello(0, GEN[0]))), 0.0)
    assert kinds(out) == ["Welcome"] and of(out, Welcome)[0].header.need_init
    nonce = of(out, Welcome)[0].header.nonce
    seq = 0
    for f in (0, 1):
        for header, tensors in inits(f):
            seq += 1
            assert c.handle(Received(peer(0), opened(header, tensors, nonce=nonce, seq=seq)), 0.0) == []
    work = c.take_work()
    assert len(work) == 4 and c.take_work() == []
    out = [o for w in work for o in c.handle(run_work(w), 0.0)]
    assert c.initialised and c.versions() == (0, 0)
    assert kinds(out) == ["BCAST", "BCAST"]  # the last INIT copy completes island 0's cut
    seq += 1
    out = c.handle(Received(peer(0), opened(Heartbeat(island=0, generation=GEN[0], step=0), nonce=nonce,
                                            seq=seq)), 1.0)
    assert kinds(out) == ["Heartbeat"]  # proven now, but no round opens before step 2
    assert c.handle(Lost(peer(0), "BCAST", 1, True), 1.5) == [] and c.islands[0].owe_pulls
    assert c.handle(Tick(), CFG.dead_after_s + 2.0) == [] and c.live() == []
    assert "phase=running" in c.status() and c.gauges(2.0).phase == "running"
    assert c.take_events() == [] and not c.take_checkpoint() and not of(out, Pull)
    with pytest.raises(TypeError, match="not an event"):
        c.handle(object(), 0.0)  # type: ignore[arg-type]

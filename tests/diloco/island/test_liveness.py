"""The initial-cut wait's rejoin rule (diloco/island/liveness.py): plain values, no process.

Issue 27: an island whose own link is fine must not redial because island 0's INIT, which its
cut waits for, stalls; it still rejoins when its own cut was lost (INIT complete, nothing
moving toward it), and island 0, whose INIT it is, keeps the plain rule.
"""

from __future__ import annotations

import logging

import pytest

from diloco import wire
from diloco.island.liveness import CutWatch, Liveness

pytestmark = pytest.mark.timeout(30)

TOTAL = 1000
"""fp32 bytes of every fragment: a complete INIT."""
TIMEOUT = 2.0


def _notice(init: int, sent: int = 0, syncer: int = 7) -> wire.Progress:
    return wire.Progress(init_bytes=init, in_bytes=init, commits=0, sent_bytes=sent, syncer_id=syncer)


def test_init_silence_is_reported_only_while_incomplete_and_the_notices_are_fresh() -> None:
    lv = Liveness(now=0.0)
    assert lv.init_silent_s(TOTAL, 1.0, TIMEOUT) is None  # no notice: nothing says the syncer hears us
    lv.on_progress(_notice(400), 1.0)
    assert lv.init_silent_s(TOTAL, 3.0, TIMEOUT) == 2.0  # counted from the first notice
    lv.on_progress(_notice(500), 4.0)
    lv.on_progress(_notice(500), 5.0)
    assert lv.init_silent_s(TOTAL, 6.0, TIMEOUT) == 2.0  # counted from the last change
    assert lv.init_silent_s(TOTAL, 7.5, TIMEOUT) is None  # the last notice is too old
    assert lv.init_silent_s(0, 6.0, TIMEOUT) is None  # total unknown
    lv.on_progress(_notice(500, syncer=8), 9.0)  # a new syncer instance: a new baseline
    assert lv.init_silent_s(TOTAL, 10.0, TIMEOUT) == 1.0
    lv.on_progress(_notice(TOTAL, syncer=8), 11.0)
    assert lv.init_silent_s(TOTAL, 12.0, TIMEOUT) is None  # INIT complete


def test_a_healthy_island_waiting_on_a_stalled_init_does_not_rejoin_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    lv = Liveness(now=0.0)
    watch = CutWatch(lv, island=1, timeout_s=TIMEOUT, init_total_bytes=TOTAL, now=0.0)
    assert not watch.rejoin_now(1, 0.0)
    lv.on_progress(_notice(600), 0.5)
    with caplog.at_level(logging.INFO, logger="diloco.island.liveness"):
        for k in range(1, 121):  # one minute of checks, a notice every second, INIT standing still
            now = 0.5 * k
            if k % 2 == 0:
                lv.on_progress(_notice(600), now)
            assert not watch.rejoin_now(1, now)
    waits = [r for r in caplog.records if "waits on island 0's INIT" in r.getMessage()]
    assert len(waits) == 1 and "island 1" in waits[0].getMessage() and "not redialing" in waits[0].getMessage()
    assert watch.on_init_s is not None and watch.on_init_s > 50
    assert "waiting on island 0's INIT, silent" in watch.waiting_on()


def test_init_moving_again_then_stalling_again_is_a_change_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    lv = Liveness(now=0.0)
    watch = CutWatch(lv, island=1, timeout_s=TIMEOUT, init_total_bytes=TOTAL, now=0.0)
    lv.on_progress(_notice(100), 0.0)
    with caplog.at_level(logging.INFO, logger="diloco.island.liveness"):
        assert not watch.rejoin_now(0, 0.0)
        lv.on_progress(_notice(100), 3.0)
        assert not watch.rejoin_now(0, 3.0) and watch.on_init_s == 3.0
        lv.on_progress(_notice(200), 4.0)  # INIT moves: the cut's clock moves
        assert not watch.rejoin_now(0, 4.0) and watch.on_init_s is None and watch.waiting_on() == ""
        lv.on_progress(_notice(200), 6.5)
        assert not watch.rejoin_now(0, 6.5) and watch.on_init_s == 2.5
    assert sum("waits on island 0's INIT" in r.getMessage() for r in caplog.records) == 2


def test_a_cut_lost_on_our_link_still_rejoins_once_init_is_complete() -> None:
    lv = Liveness(now=0.0)
    watch = CutWatch(lv, island=1, timeout_s=TIMEOUT, init_total_bytes=TOTAL, now=0.0)
    assert not watch.rejoin_now(1, 0.0)
    lv.on_progress(_notice(TOTAL, sent=300), 0.5)
    lv.on_progress(_notice(TOTAL, sent=300), 1.5)  # INIT complete, nothing more comes our way
    assert not watch.rejoin_now(1, 1.9)
    assert watch.rejoin_now(1, 2.1)
    assert not watch.rejoin_now(1, 2.2)  # the rejoin's cut gets a whole timeout
    assert watch.rejoin_now(1, 4.2)


def test_without_fresh_notices_or_as_island_0_the_plain_rule_rejoins() -> None:
    lv = Liveness(now=0.0)
    other = CutWatch(lv, island=1, timeout_s=TIMEOUT, init_total_bytes=TOTAL, now=0.0)
    assert not other.rejoin_now(0, 0.0)
    lv.on_progress(_notice(100), 0.5)
    assert other.rejoin_now(0, 2.6)  # the syncer's last word is 2.1 s old: nothing says it hears us
    lv = Liveness(now=0.0)
    source = CutWatch(lv, island=0, timeout_s=TIMEOUT, init_total_bytes=TOTAL, now=0.0)
    assert not source.rejoin_now(0, 0.0)
    for t in (0.5, 1.5, 2.5):
        lv.on_progress(_notice(100), t)  # island 0's own INIT stands still: its redial resumes it
    assert source.rejoin_now(0, 2.5) and source.on_init_s is None


def test_fragments_arriving_or_our_own_init_restart_the_clock() -> None:
    lv = Liveness(now=0.0)
    watch = CutWatch(lv, island=1, timeout_s=TIMEOUT, init_total_bytes=TOTAL, now=0.0)
    lv.on_progress(_notice(TOTAL), 0.0)
    assert not watch.rejoin_now(0, 1.5)
    assert not watch.rejoin_now(1, 3.0)  # a fragment arrived (a HELD notice moves no counter)
    assert not watch.rejoin_now(1, 4.9)
    watch.moved(4.9)
    assert not watch.rejoin_now(1, 6.8)
    assert watch.rejoin_now(1, 7.0)

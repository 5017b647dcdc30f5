"""Liveness means progress (issue 23, item 4) and a HELLO is not membership (item 2), driven inline.

Under the default quorum (all islands), an island that heartbeats but never pushes must not stop
the merge: at the quorum timeout it is dropped from the round, the others commit, and it is a
member of the next round again.  A HELLO alone never makes an island a member."""

from __future__ import annotations

from dataclasses import replace

import pytest

from diloco.wire import Pull

from state_driver import Driver, of, streams  # noqa: E402
from test_state import CFG, GEN, hb, hello, inits, peer, pushes, started  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ALL = replace(CFG, quorum=0)  # the default: every member must push


def test_a_heartbeating_island_that_never_pushes_is_dropped_at_the_quorum_timeout() -> None:
    d = started(ALL)
    for i in range(3):
        d.send(peer(i), hb(i, 2), now=1.0)
    r = d.st.rounds[1]
    assert r.members == frozenset({0, 1, 2})
    for i in (0, 1):
        d.send_all(peer(i), pushes(i, 1, 0), now=1.5)
    for t in (4.0, 8.0, 10.5):  # island 2 stays alive, and silent on round 1
        d.send(peer(2), hb(2, 2), now=t)
        assert not d.tick(t) or d.st.versions() == (0, 0)
    assert d.st.versions() == (0, 0)  # before the quorum timeout the round waits for island 2
    out = d.tick(11.5)  # 10 s after the attempt started
    assert d.st.versions() == (1, 0) and 1 not in d.st.rounds  # committed with islands 0 and 1
    dropped = [e for e in d.st.events if "dropped_islands" in e]
    assert [e["dropped_islands"] for e in dropped] == [[2]]
    commit = [e for e in d.st.events if e.get("round") == 1 and "pushed" in e][-1]
    assert commit["pushed"] == [0, 1] and commit["attempt"] == 0  # no re-push needed
    assert d.st.reference.tally[2] == {"lagged": 1}
    assert "i2:lagged1" in d.st.status()
    assert {o.peer for o in streams(out)} >= {peer(0), peer(1), peer(2)}  # the new value goes to everyone
    # The dropped island rejoins at the next round.
    for i in range(3):
        d.send(peer(i), hb(i, 4), now=12.0)
    assert d.st.rounds[2].members == frozenset({0, 1, 2})
    for i in range(3):
        d.send_all(peer(i), pushes(i, 2, 1), now=12.5)
    assert d.st.versions() == (1, 1)


def test_nobody_pushing_re_pulls_everyone_and_an_explicit_quorum_is_not_waived() -> None:
    d = started(replace(CFG, quorum=3))
    for i in range(3):
        d.send(peer(i), hb(i, 2), now=1.0)
    out = d.tick(11.5)  # no push at all: a lost PULL or a cut network, everyone is asked again
    assert sorted(o.peer for o in of(out, Pull)) == [peer(0), peer(1), peer(2)] and d.st.rounds[1].attempt == 1
    d.send_all(peer(0), pushes(0, 1, 0, attempt=1), now=12.0)
    d.send_all(peer(1), pushes(1, 1, 0, attempt=1), now=12.0)
    out = d.tick(22.0)  # 2 < --quorum 3 without island 2: it cannot commit, so island 2 is asked again
    assert d.st.versions() == (0, 0) and d.st.rounds[1].attempt == 2
    assert sorted(o.peer for o in of(out, Pull)) == [peer(0), peer(1), peer(2)]


def test_a_hello_alone_is_not_membership() -> None:
    d = Driver(ALL)
    for i in range(3):
        d.send(peer(i), hello(i, GEN[i]), now=0.0)
    d.send_all(peer(0), inits(0) + inits(1), 0.0)
    d.send(peer(1), hb(1, 0), now=0.5)  # island 2 said HELLO and got its cut, but never spoke again
    d.send(peer(0), hb(0, 2), now=1.0)
    d.send(peer(1), hb(1, 2), now=1.0)
    assert d.st.rounds[1].members == frozenset({0, 1})
    for i in (0, 1):
        d.send_all(peer(i), pushes(i, 1, 0), now=1.5)
    assert d.st.versions() == (1, 0)  # the phantom never held the round up
    # Once island 2 speaks in its session, it is a member of the next round.
    for i in (2, 0, 1):
        d.send(peer(i), hb(i, 4), now=2.0)
    assert d.st.rounds[2].members == frozenset({0, 1, 2})

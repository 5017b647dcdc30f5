"""HELLOs are bounded (issue 23, item 5), driven inline: a new HELLO of an island cancels its old
connection's streams (the loop drops what the state lists in ``superseded``), and the replay memory
has a fixed size whatever the number of HELLOs."""

from __future__ import annotations

import msgspec
import pytest

from diloco.syncer.core.sessions import HELLOS_REMEMBERED

from state_driver import Driver, errors, streams  # noqa: E402
from test_state import CFG, GEN, hello, inits, peer  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_a_new_hello_supersedes_the_old_connection_and_its_cut() -> None:
    d = Driver(CFG)
    for i in range(3):
        d.send(peer(i), msgspec.structs.replace(hello(i, GEN[i]), instance=10 + i), now=0.0)
    out = d.send_all(peer(0), inits(0) + inits(1), 0.0)
    assert {o.peer for o in streams(out)} == {peer(0), peer(1), peer(2)}  # every island's cut
    d.st.sessions.superseded.clear()
    out = d.send(b"redial-1", msgspec.structs.replace(hello(1, 999), instance=11), now=1.0)
    assert not errors(out) and d.st.sessions.superseded == [peer(1)]  # the loop drops the old cut stream
    assert [o.peer for o in streams(out)] == [b"redial-1", b"redial-1"]  # one new cut, to the new connection


def test_replay_memory_is_fixed_size_under_a_hello_flood() -> None:
    d = Driver(CFG)
    n = HELLOS_REMEMBERED * CFG.islands + 500
    for k in range(n):  # one process redialing again and again (a fresh routing id each time)
        out = d.send(b"p%d" % k, msgspec.structs.replace(hello(1, 1000 + k), instance=7), now=float(k))
        assert not errors(out)
        d.st.sessions.superseded.clear()
    assert len(d.st.sessions.hellos_seen) <= HELLOS_REMEMBERED * CFG.islands
    assert len(d.st.islands[1].retired_generations) <= HELLOS_REMEMBERED
    assert len(d.st.sessions.peers) == 1 and d.st.islands[1].generation == 1000 + n - 1
    # A recent HELLO replayed is still dropped, answered with nothing.
    assert d.send(b"replayer", msgspec.structs.replace(hello(1, 1000 + n - 2), instance=7), now=float(n)) == []

"""Cuts fragment by fragment and the values a HELLO claims to hold (``syncer/core/cuts.py``).

Driven like ``test_state.py``: hand-built parted messages through the real codec, the data
plane's work (INIT copies, the digests of claimed values, folds, commits) run inline. The claim
of a fragment is ``diloco.digest.tensor_digest`` of the fp32 value the island holds.
"""

from __future__ import annotations

import logging

import msgspec
import pytest

from diloco.digest import tensor_digest
from diloco.syncer.dataplane import run_work
from diloco.wire import Held, Welcome

from state_driver import Driver, bitwise, errors, flat, of, streams  # noqa: E402
from test_state import CFG, GEN, hb, hello, init_values, inits, open_round1, peer, pushes, started  # noqa: E402

pytestmark = pytest.mark.timeout(60)

OWN = [tensor_digest(init_values(f)) for f in range(2)]
"""What an island that starts from island 0's weights claims."""


def claiming(i: int, gen: int, holds: list[str]):  # noqa: ANN201 - a Hello
    return msgspec.structs.replace(hello(i, gen), holds=tuple(holds))


def held(out: list) -> list[tuple[bytes, int, int, int]]:
    return [(o.peer, o.header.fragment, o.header.version, o.header.round) for o in of(out, Held)]


def test_a_matching_claim_is_answered_held_per_fragment_as_init_lands(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "diloco.syncer.core")
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    d.send(peer(1), claiming(1, GEN[1], OWN))  # joins while island 0 has streamed nothing yet
    d.send(peer(2), hello(2, GEN[2]))
    out = d.send_all(peer(0), inits(0))
    # Fragment 0 holds its value: island 1 is told it holds it (no bytes), the others get it streamed.
    assert held(out) == [(peer(1), 0, 0, 0)]
    assert sorted(o.peer for o in streams(out) if o.fragment == 0) == [peer(0), peer(2)]
    assert not d.st.islands[1].cut_sent
    out = d.send_all(peer(0), inits(1))
    assert held(out) == [(peer(1), 1, 0, 0)]
    assert all(o.peer != peer(1) for o in streams(out))
    assert all(i.cut_sent for i in d.st.islands)
    assert "island 1: fragments 0-1 match the syncer's values, no cut needed" in caplog.text
    # A claim decides only what travels to the claimant: the values are island 0's INIT, bit for bit.
    for f in range(2):
        assert bitwise(d.st.fragments[f].value, flat(init_values(f)))


def test_a_claim_that_differs_gets_that_fragment_cut(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "diloco.syncer.core")
    d = started()
    out = d.send(peer(1), claiming(1, 999, [OWN[0], "0" * 32]), now=1.0)  # a rejoin claiming fragment 0 only
    assert held(out) == [(peer(1), 0, 0, 0)]
    assert [(o.peer, o.fragment, o.cut) for o in streams(out)] == [(peer(1), 1, True)]
    assert "island 1: fragments 0 match the syncer's values, no cut needed; fragments 1 differ: cut" in caplog.text
    # No claim for a fragment ("") is the cut as before.
    out = d.send(peer(2), claiming(2, 998, ["", OWN[1]]), now=1.0)
    assert held(out) == [(peer(2), 1, 0, 0)] and [o.fragment for o in streams(out)] == [0]


def test_after_a_commit_the_initial_values_no_longer_match() -> None:
    d = started()
    open_round1(d)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0))
    assert d.st.fragments[0].version == 1
    out = d.send(peer(2), claiming(2, 997, OWN), now=2.0)
    # Fragment 0 moved on (version 1): its cut streams; fragment 1 is still island 0's INIT.
    assert held(out) == [(peer(2), 1, 0, 0)]
    assert [(o.fragment, o.version, o.round, o.cut) for o in streams(out)] == [(0, 1, 1, True)]
    # A claim of the committed value itself matches again (the digest follows the version).
    from diloco.wire import FragmentLayout

    frag = d.st.fragments[0]
    assert isinstance(frag.layout, FragmentLayout)
    now_value = tensor_digest(frag.layout.flat_views(frag.value))
    out = d.send(peer(2), claiming(2, 996, [now_value, ""]), now=3.0)
    assert held(out) == [(peer(2), 0, 1, 1)]


def test_a_commit_reaches_an_island_whose_cut_is_half_given() -> None:
    # Island 2 (re)joins claiming fragment 1 only: fragment 0 of its cut streams at once, fragment 1
    # waits for the digest its claim needs (held back here while a round of fragment 0 commits).
    d = started()
    d.st.fragments[1].value_digest = None  # no digest known, as after --resume (INIT streamed one)
    d.send(peer(2), claiming(2, 995, ["", OWN[1]]), now=1.0, run=False)
    digests = d.st.take_work()
    assert [type(w).__name__ for w in digests] == ["DigestFragment"]
    assert d.st.islands[2].cut_given == {0} and not d.st.islands[2].cut_sent
    open_round1(d)
    d.send_all(peer(0), pushes(0, 1, 0))
    out = d.send_all(peer(1), pushes(1, 1, 0))
    # The commit of fragment 0 goes to island 2 too: it was given fragment 0 of its cut.
    assert d.st.fragments[0].version == 1
    assert (peer(2), 0, 1) in [(o.peer, o.fragment, o.version) for o in streams(out)]
    out = [o for w in digests for o in d.st.on_result(run_work(w), 2.0)]
    assert held(out) == [(peer(2), 1, 0, 0)] and d.st.islands[2].cut_sent


def test_malformed_claims_are_refused() -> None:
    d = started()
    assert errors(d.send(peer(2), claiming(2, 990, [OWN[0]]), now=1.0)) == ["bad_holds"]  # one per fragment
    assert errors(d.send(peer(2), claiming(2, 991, ["zz" * 16, ""]), now=1.0)) == ["bad_holds"]  # not hex
    assert errors(d.send(peer(2), claiming(2, 992, ["a" * 65, ""]), now=1.0)) == ["bad_holds"]  # too long
    assert d.st.islands[2].generation == GEN[2]


def test_welcome_says_which_fragments_hold_a_value() -> None:
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    d.send_all(peer(0), inits(1))
    out = d.send(peer(0), hello(0, 12345), now=1.0)  # island 0 redials mid-INIT
    (w,) = [o.header for o in of(out, Welcome)]
    assert w.need_init and w.initialised == (False, True)
    # Island 0 resumes with fragment 0 only; fragment 1 is complete.
    d.send(peer(0), hb(0, 0, gen=12345), now=1.0)
    d.send_all(peer(0), inits(0, gen=12345))
    assert d.st.initialised

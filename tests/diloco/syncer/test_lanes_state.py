"""The INIT lane at the syncer's core (``Sessions.bind_lane``, ``wire.Lane``): what binds a second
connection to island 0's session, what it may carry, and what it costs a party that lies.

Real wire messages through the codec; data-plane work inline (``state_driver``)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from diloco.protocol.session import lane_nonce
from diloco.syncer.core.config import SyncerConfig
from diloco.wire import Heartbeat, Lane, LaneOk, Welcome

from state_driver import Driver, errors, init_parts, of, opened

import test_parts_state as one  # one fragment of 7 parts, three islands

pytestmark = pytest.mark.timeout(60)

LANE = b"lane-of-0"


def hello_all(cfg: SyncerConfig = one.CFG) -> Driver:
    d = Driver(cfg)
    for i in range(cfg.islands):
        d.send(one.peer(i), one.hello(i, numel=(one.NUMEL,)))
    return d


def lane_msg(d: Driver, island: int = 0, seq: int = 1, nonce: int | None = None, generation: int | None = None):
    gen = one.GEN[island] if generation is None else generation
    nonce = lane_nonce(d.nonces[one.peer(island)]) if nonce is None else nonce
    return opened(Lane(island=island, generation=gen), (), nonce, seq)


def init_on(d: Driver, peer: bytes, first_seq: int, nonce: int | None = None) -> list:
    """Island 0's INIT of fragment 0 sent on ``peer`` with that connection's sequence numbers (and by
    default the lane's nonce)."""
    out = []
    nonce = lane_nonce(d.nonces[one.peer(0)]) if nonce is None else nonce
    for k, (header, t) in enumerate(init_parts(0, 1, one.tensors(0), d.E, generation=one.GEN[0])):
        out += d.handle(peer, opened(header, t, nonce, first_seq + k))
    return out


def test_welcome_offers_a_lane_to_island_0_only() -> None:
    d = Driver(one.CFG)
    w0 = of(d.send(one.peer(0), one.hello(0, numel=(one.NUMEL,))), Welcome)[0].header
    w1 = of(d.send(one.peer(1), one.hello(1, numel=(one.NUMEL,))), Welcome)[0].header
    assert w0.lanes == 1 and w1.lanes == 0
    d = Driver(dataclasses.replace(one.CFG, init_lanes=0))
    assert of(d.send(one.peer(0), one.hello(0, numel=(one.NUMEL,))), Welcome)[0].header.lanes == 0


def test_init_on_the_lane_lands_with_its_own_sequence_numbers() -> None:
    d = hello_all()
    ok = d.handle(LANE, lane_msg(d))
    assert [(o.peer, o.header) for o in ok] == [(one.peer(0), LaneOk(generation=one.GEN[0]))]  # on the first
    assert d.st.sessions.islands[0].lane == LANE and d.st.island_of(LANE) == 0
    out = init_on(d, LANE, first_seq=2)  # the lane's own sequence: 1 was LANE
    assert not errors(out) and d.st.initialised
    assert d.st.sessions.islands[0].recv_seq == 0  # the first connection's sequence is untouched
    assert one.bitwise(d.st.fragments[0].value.numpy(), one.flat(one.tensors(0)).numpy())
    # The first connection goes on with its own numbers.
    d.send(one.peer(0), one.hb(0, 0))
    assert d.st.sessions.islands[0].recv_seq == 1 and d.st.sessions.islands[0].lane_seq == 2 + one.N_PARTS - 1


def test_a_lane_carries_init_only() -> None:
    d = hello_all()
    d.handle(LANE, lane_msg(d))
    hb = opened(Heartbeat(island=0, generation=one.GEN[0], step=1, done=False), (), lane_nonce(d.nonces[one.peer(0)]), 2)
    assert d.handle(LANE, hb) == [] and d.st.journal.dropped == 1  # wrong_peer: nothing answered
    assert d.st.sessions.islands[0].last_step == 0


@pytest.mark.parametrize("why", ["nonce", "session_nonce", "zero_nonce", "seq", "generation", "first_connection",
                                 "another_island"])
def test_a_lane_that_does_not_prove_the_session_binds_nothing(why: str) -> None:
    d = hello_all()
    peer = {"first_connection": one.peer(0), "another_island": one.peer(1)}.get(why, LANE)
    msg = {"nonce": lambda: lane_msg(d, nonce=lane_nonce(d.nonces[one.peer(0)]) ^ 1),
           "session_nonce": lambda: lane_msg(d, nonce=d.nonces[one.peer(0)]),  # the first connection's
           "zero_nonce": lambda: lane_msg(d, nonce=0),
           "seq": lambda: lane_msg(d, seq=2),
           "generation": lambda: lane_msg(d, generation=one.GEN[0] + 1),
           "first_connection": lambda: lane_msg(d, seq=1),
           "another_island": lambda: lane_msg(d, seq=1)}[why]()
    out = d.handle(peer, msg)
    assert d.st.sessions.islands[0].lane == b"" and not d.st.sessions.lanes
    if why == "generation":
        assert errors(out) == ["unknown_generation"]
    else:
        assert out == [] and d.st.journal.dropped == 1
    # INIT on the unbound routing id is dropped: nothing is allocated for it.
    init_on(d, LANE, first_seq=2)
    assert not d.st.fragments or d.st.fragments[0].value is None


def test_lanes_only_for_island_0_and_only_when_offered() -> None:
    d = hello_all()
    assert errors(d.handle(LANE, lane_msg(d, island=1))) == ["lane_not_island0"]
    d = hello_all(dataclasses.replace(one.CFG, init_lanes=0))
    assert errors(d.handle(LANE, lane_msg(d))) == ["no_lanes"]
    assert not d.st.sessions.lanes


def test_a_refusal_on_the_lane_is_answered_on_the_first_connection() -> None:
    d = hello_all()
    d.handle(LANE, lane_msg(d))
    (header, t), *_ = init_parts(0, 1, one.tensors(0), d.E, generation=one.GEN[0])
    bad = msgspec.structs.replace(header, n_fragments=2)
    out = d.handle(LANE, opened(bad, t, lane_nonce(d.nonces[one.peer(0)]), 2))
    assert errors(out) == ["fragments_mismatch"] and out[0].peer == one.peer(0)


def test_a_lane_binds_once_per_session_and_a_replay_takes_nothing_over() -> None:
    d = hello_all()
    captured = lane_msg(d)
    d.handle(LANE, captured)
    for k in range(50):  # the captured LANE replayed from other routing ids
        assert d.handle(b"thief-%d" % k, captured) == []
    assert d.st.sessions.lanes == {LANE: 0} and d.st.journal.dropped == 50
    # A first-connection message replayed on the lane fails the lane's nonce; the lane goes on.
    assert not errors(init_on(d, LANE, first_seq=50, nonce=d.nonces[one.peer(0)]))
    assert not d.st.initialised and d.st.sessions.islands[0].lane_seq == 1
    assert not errors(init_on(d, LANE, first_seq=2)) and d.st.initialised


def test_a_new_hello_unbinds_the_lane_and_its_session_may_bind_a_new_one() -> None:
    d = hello_all()
    d.handle(LANE, lane_msg(d))
    d.send(one.peer(0), one.hello(0, gen=99, numel=(one.NUMEL,)))  # a reconnect: a new session
    assert d.st.sessions.lanes == {} and d.st.sessions.islands[0].lane == b""
    # INIT on the old lane is dropped: it belongs to the retired session.
    out = []
    for k, (header, t) in enumerate(init_parts(0, 1, one.tensors(0), d.E, generation=99)):
        out += d.handle(LANE, opened(header, t, lane_nonce(d.nonces[one.peer(0)]), 2 + k))
    assert not d.st.initialised
    d.handle(b"lane-2", lane_msg(d, generation=99))
    assert d.st.sessions.lanes == {b"lane-2": 0}

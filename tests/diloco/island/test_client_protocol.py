"""ClientProtocol with scripted syncer messages: no socket, no thread, no clock (milliseconds)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco import wire
from diloco.config import IslandConfig
from diloco.island.client_protocol import ClientProtocol, SyncError
from diloco.island.effects import BACKOFF_MAX_S, BACKOFF_START_S
from diloco.island.liveness import CutWatch
from diloco.island.outbox import Outgoing

pytestmark = pytest.mark.timeout(30)

KEY = b"protocol-test-key"
GEN = 0x1234


class Syncer:
    """The syncer's side of one session, scripted: frames of messages stamped as the syncer does."""

    def __init__(self) -> None:
        self.nonce = 0
        self.seq = 0

    def frames(self, header: wire.Header, tensors: list | None = None, **stamp: int) -> list:
        self.seq += 1
        flat = [(n, t.reshape(-1)) for n, t in tensors or []]
        return wire.encode(header, flat, key=KEY, **{"nonce": self.nonce, "seq": self.seq, **stamp})

    def welcome(self, generation: int, syncer_id: int = 7, n: int = 2,
                initialised: tuple[bool, ...] | None = None) -> list:
        self.nonce, self.seq = 1000 + syncer_id, 0
        held = (True,) * n if initialised is None else initialised
        return self.frames(wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=syncer_id,
                                        need_init=not all(held), versions=(0,) * n, sync_every=10, total_steps=0,
                                        generation=generation, nonce=self.nonce, initialised=held))


def _protocol(shape: tuple[int, ...] = (3,), **kw: object) -> ClientProtocol:
    cfg = IslandConfig(sync_addr="tcp://127.0.0.1:9", island_id=1, key=KEY, heartbeat_s=0.2, sync_timeout_s=2.0,
                       **kw)
    return ClientProtocol(cfg, "ab" * 16, [wire.FragmentLayout.of([("w", shape)])] * 2, now=0.0, instance=5)


def _joined(shape: tuple[int, ...] = (3,)) -> tuple[ClientProtocol, Syncer]:
    p, s = _protocol(shape), Syncer()
    p.hello(GEN)
    assert p.handle(s.welcome(GEN), now=0.1).wake
    return p, s


def test_hello_opens_a_session_and_only_our_welcome_is_taken() -> None:
    p, s = _protocol(), Syncer()
    hello = wire.decode(p.hello(GEN), key=KEY).header
    assert isinstance(hello, wire.Hello)
    assert (hello.island, hello.generation, hello.instance, hello.fragment_numel) == (1, GEN, 5, (3, 3))
    p.handle(s.welcome(GEN + 1), now=0.1)  # a WELCOME answering another connection's HELLO
    assert p.welcome is None and p.stats.refused == 1
    eff = p.handle(s.welcome(GEN), now=0.2)
    assert eff.wake and eff.redial_s is None and p.welcome is not None and p.welcome.syncer_id == 7
    assert p.stats.messages_recv == 2


def test_messages_outside_the_session_are_refused() -> None:
    p, s = _joined()
    pull = wire.Pull(fragment=0, round=1, attempt=0)
    p.handle(s.frames(pull, nonce=999), now=1.0)  # another session
    p.handle(s.frames(pull, seq=1), now=1.0)  # a replayed sequence number
    tampered = s.frames(pull)
    tampered[0] = bytes(32)
    p.handle(tampered, now=1.0)
    assert p.stats.refused == 3 and p.take_ready_pulls() == []
    p.handle(s.frames(pull), now=1.0)
    assert p.take_ready_pulls() == [pull]


def test_pulls_newest_attempt_once_and_again_after_stale_base() -> None:
    p, s = _joined()
    for attempt in (0, 2, 1, 2):
        p.handle(s.frames(wire.Pull(fragment=0, round=1, attempt=attempt)), now=1.0)
    p.handle(s.frames(wire.Pull(fragment=1, round=2, attempt=0)), now=1.0)
    assert [(q.fragment, q.round, q.attempt) for q in p.take_ready_pulls()] == [(0, 1, 2), (1, 2, 0)]
    p.handle(s.frames(wire.Pull(fragment=0, round=1, attempt=2)), now=1.0)  # resent after taken
    assert p.take_ready_pulls() == []
    p.handle(s.frames(wire.Error(code="stale_base", reason="base", fragment=0, round=1)), now=1.0)
    assert p.take_stale() == [(0, 1)] and p.take_stale() == []
    p.handle(s.frames(wire.Pull(fragment=0, round=1, attempt=2)), now=1.0)
    assert [q.attempt for q in p.take_ready_pulls()] == [2]


def test_broadcasts_in_increasing_version_order_and_none_after_the_final_cut() -> None:
    p, s = _joined()
    for v in (1, 3, 2):
        p.handle(s.frames(wire.Bcast(fragment=0, version=v, round=v, cut=False),
                          [("w", torch.full((3,), float(v)))]), now=1.0)
    got = p.take_bcasts()
    assert [(b.fragment, b.version) for b in got] == [(0, 3)]
    assert torch.equal(got[0].tensors[0][1], torch.full((3,), 3.0))
    for f in range(2):
        p.handle(s.frames(wire.Final(fragment=f, version=4, n_fragments=2, versions=(4, 4)), [("w", torch.ones(3))]),
                 now=1.0)
    p.handle(s.frames(wire.Bcast(fragment=1, version=9, round=9, cut=False), [("w", torch.zeros(3))]), now=1.0)
    assert p.final_received() == 2 and p.take_bcasts() == []
    header, values = p.take_final(0) or (None, [])
    assert header is not None and torch.equal(values[0][1], torch.ones(3))
    assert p.take_final(0) == (header, [])  # the tensors are let go of once taken


def test_received_values_land_where_the_target_says() -> None:
    anchors = torch.zeros(3)
    calls: list[tuple[int, str, bool]] = []

    def target(f: int, dtype: str, busy: bool) -> tuple[list[torch.Tensor] | None, int]:
        calls.append((f, dtype, busy))
        return ([anchors] if f == 0 else None), len(calls)

    p, s = _protocol(), Syncer()
    p.receive_target = target
    p.hello(GEN)
    p.handle(s.welcome(GEN), now=0.0)
    p.handle(s.frames(wire.Bcast(fragment=0, version=1, round=1, cut=True), [("w", torch.full((3,), 2.0))]),
             now=1.0)
    p.handle(s.frames(wire.Final(fragment=1, version=1, n_fragments=2, versions=(1, 1)), [("w", torch.ones(3))]),
             now=1.0)
    assert torch.equal(anchors, torch.full((3,), 2.0))
    bcast = p.take_bcasts()[0]
    assert bcast.arrival == 1 and bcast.tensors[0][1].data_ptr() == anchors.data_ptr()
    assert calls[1] == (1, "float32", False)  # a final value of a quiet fragment may land in the anchors


def test_the_final_cut_lands_in_quiet_anchors_and_a_resent_final_is_dropped() -> None:
    anchors = [torch.zeros(3), torch.zeros(3)]
    calls: list[tuple[int, str, bool]] = []

    def target(f: int, dtype: str, busy: bool) -> tuple[list[torch.Tensor] | None, int]:
        calls.append((f, dtype, busy))
        return ([anchors[f]] if not busy else None), len(calls)

    p, s = _protocol(), Syncer()
    p.receive_target = target
    p.hello(GEN)
    p.handle(s.welcome(GEN), now=0.0)
    final = wire.Final(fragment=0, version=4, n_fragments=2, versions=(4, 4))
    p.handle(s.frames(final, [("w", torch.full((3,), 4.0))]), now=1.0)
    assert torch.equal(anchors[0], torch.full((3,), 4.0)) and p.final_received() == 1
    # A resend (the syncer's FINAL timer) is checked and dropped: no buffer, the anchor untouched.
    p.handle(s.frames(final, [("w", torch.full((3,), 5.0))]), now=2.0)
    assert torch.equal(anchors[0], torch.full((3,), 4.0)) and len(calls) == 1  # no buffer asked for
    header, values = p.take_final(0) or (None, [])
    assert header == final and values[0][1].data_ptr() == anchors[0].data_ptr()
    p.handle(s.frames(final, [("w", torch.full((3,), 6.0))]), now=3.0)  # after it was taken, too
    assert torch.equal(anchors[0], torch.full((3,), 4.0)) and p.take_final(0) == (header, [])
    assert p.stats.refused == 0


def test_rejoin_codes_a_restarted_syncer_and_fatal_refusals() -> None:
    p, s = _joined()
    eff = p.handle(s.frames(wire.Heartbeat(syncer_id=99)), now=1.0)
    assert eff.redial_s == 0.0
    p.connection_lost()
    p.redialing(now=1.0)
    assert p.welcome is None and p.stats.redials == 1
    p.hello(GEN + 1)
    p.handle(s.welcome(GEN + 1, syncer_id=99), now=1.1)
    assert p.handle(s.frames(wire.Error(code="unknown_generation", reason="?"), nonce=0), now=1.2).redial_s == 0.0
    p.handle(s.frames(wire.Error(code="fingerprint_mismatch", reason="layout differs")), now=1.3)
    with pytest.raises(SyncError, match="fingerprint"):
        p.take_ready_pulls()


def test_island_in_use_is_retried_before_a_welcome_and_fatal_after() -> None:
    p, s = _protocol(), Syncer()
    p.hello(GEN)
    eff = p.handle(s.frames(wire.Error(code="island_in_use", reason="bound")), now=0.1)
    assert eff.redial_s == 1.0 and p.last_refusal is not None and not p.failed()
    p.hello(GEN + 1)
    p.handle(s.welcome(GEN + 1), now=0.2)
    p.handle(s.frames(wire.Error(code="island_in_use", reason="bound")), now=0.3)
    assert p.failed()


def test_the_final_ack_is_resent_to_the_same_syncer_after_a_redial() -> None:
    p, s = _joined()
    ack = p.final_ack([3, 3], ["d0", "d1"])
    assert ack.generation == GEN
    p.redialing(now=1.0)
    p.hello(GEN + 1)
    eff = p.handle(s.welcome(GEN + 1), now=1.1)
    assert eff.send == [ack]
    assert p.restamp(eff.send[0]).generation == GEN + 1  # type: ignore[union-attr]


def test_timers_heartbeat_silence_backoff_and_rejoin() -> None:
    p, s = _joined()
    assert p.tick(0.2).heartbeat
    assert not p.tick(0.3).heartbeat  # not due yet
    assert p.tick(0.5, rejoin=True).rejoin
    delays = [p.tick(10.0 + k).redial_s for k in range(8)]  # silent for longer than the timeout
    assert delays[:3] == [BACKOFF_START_S, 2 * BACKOFF_START_S, 4 * BACKOFF_START_S]
    assert delays[-1] == BACKOFF_MAX_S
    p.redialing(now=20.0)
    p.handle(s.frames(wire.Heartbeat(syncer_id=7)), now=20.5)  # heard: the backoff starts over
    assert p.socket_error(OSError("reset")).redial_s == BACKOFF_START_S
    assert p.tick(21.0).redial_s is None


def test_a_stalled_init_elsewhere_never_redials_a_healthy_connection() -> None:
    # Island 1 (2 fragments of 3 fp32 elements: a complete INIT is 24 bytes) waits for its cut for
    # a minute while island 0's INIT stands at 12 bytes; the syncer answers every heartbeat.
    p, s = _joined()
    watch = CutWatch(p.liveness, island=1, timeout_s=2.0, init_total_bytes=24, now=0.1)
    assert not watch.rejoin_now(0, 0.1)
    for k in range(1, 61):
        now = 0.1 + k
        p.handle(s.frames(wire.Heartbeat(syncer_id=7)), now=now)
        p.handle(s.frames(wire.Progress(init_bytes=12, in_bytes=12, syncer_id=7)), now=now)
        assert p.tick(now + 0.5).redial_s is None
        assert not watch.rejoin_now(0, now + 0.5)
    assert watch.on_init_s == pytest.approx(59.5) and p.stats.refused == 0  # since the first notice, at 1.1
    # The syncer falls silent: now our connection is gone, and that redials.
    assert p.tick(60.1 + 2.5).redial_s is not None and watch.rejoin_now(0, 60.1 + 2.5)


def test_sealed_messages_carry_the_session_and_increasing_sequence_numbers() -> None:
    p, _ = _joined()
    assert p.report_step(5, done=False) and not p.report_step(5, done=False)
    first = wire.open_message(p.seal(p.heartbeat()), key=KEY)
    second = wire.open_message(p.seal(p.restamp(p.heartbeat())), key=KEY)
    assert first.nonce == second.nonce == 1007 and (first.seq, second.seq) == (1, 2)
    assert first.header.step == 5 and first.header.generation == GEN  # type: ignore[union-attr]


def test_streams_are_cut_into_parts_and_only_init_survives_a_redial() -> None:
    p, _ = _joined(shape=(2, 3))
    delta = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
    push = Outgoing(p.push_header(wire.Pull(fragment=1, round=3, attempt=0), 2, 5, 500), delta, "float32",
                    threading.Event())
    init = Outgoing(p.init_header(0), delta, "float32", threading.Event())
    push.stream, init.stream = p.stream_of(push), p.stream_of(init)
    assert push.stream.n_parts == 1
    msg = wire.decode(push.stream.frames_of(0) or [], key=KEY)
    assert isinstance(msg.header, wire.Push) and msg.header.local_steps == 5
    assert torch.equal(msg.tensors[0][1], delta[0][1].reshape(-1)) and p.stats.push_bytes_sent == 24
    kept = p.streams_after_redial([push, init])
    assert kept == [init] and init.stream is None  # parked until the new WELCOME says where INIT stands
    assert push.sent is not None and push.sent.is_set() and push.tensors == []
    p.hello(GEN + 1)
    p.handle(_.welcome(GEN + 1, syncer_id=8, initialised=(False, False)), now=1.0)
    assert p.resume_streams(kept) == [init] and init.stream is not None and init.stream.next_part == 0
    assert p.push_header(wire.Pull(fragment=0, round=1, attempt=0), 0, 0, 0).n_parts == 0


def test_init_resumes_after_a_redial_where_the_syncer_stands() -> None:
    p, s = _joined()
    flat = [("w", torch.ones(3))]
    streams = [Outgoing(p.init_header(f), flat, "float32", threading.Event()) for f in range(2)]
    # Fragment 0 went out whole on the first connection; fragment 1 was mid-stream when it reset.
    p.init_sent(0)
    streams[1].stream = p.stream_of(streams[1])
    parked = p.streams_after_redial(streams[1:])
    p.hello(GEN + 1)
    # The syncer holds fragment 1 complete (its last parts landed) but lost fragment 0 with the reset.
    p.handle(s.welcome(GEN + 1, initialised=(False, True)), now=1.0)
    assert p.resume_streams(parked) == []
    assert streams[1].sent is not None and streams[1].sent.is_set() and streams[1].tensors == []
    assert p.take_init_lost() == [0] and p.take_init_lost() == []
    # Fragment 0 sent whole again; after another redial the syncer holds everything: nothing is lost.
    p.init_sent(0)
    p.hello(GEN + 2)
    p.handle(s.welcome(GEN + 2, initialised=(True, True)), now=2.0)
    assert p.take_init_lost() == []


def _claiming(claims: list[str]) -> tuple[ClientProtocol, Syncer]:
    cfg = IslandConfig(sync_addr="tcp://127.0.0.1:9", island_id=1, key=KEY, heartbeat_s=0.2, sync_timeout_s=2.0)
    p, s = ClientProtocol(cfg, "ab" * 16, [wire.FragmentLayout.of([("w", (3,))])] * 2, now=0.0, instance=5,
                          claims=claims), Syncer()
    hello = wire.decode(p.hello(GEN), key=KEY).header
    assert isinstance(hello, wire.Hello) and hello.holds == tuple(claims)
    p.handle(s.welcome(GEN), now=0.1)
    return p, s


def test_held_is_a_cut_without_bytes_only_for_what_we_claim() -> None:
    p, s = _claiming(["a" * 32, ""])
    p.handle(s.frames(wire.Held(fragment=1, version=0, round=0)), now=1.0)  # not claimed: ignored
    p.handle(s.frames(wire.Held(fragment=0, version=3, round=5)), now=1.0)
    (b,) = p.take_bcasts()
    assert (b.fragment, b.version, b.round, b.cut, b.held, b.tensors) == (0, 3, 5, True, True, [])
    p.handle(s.frames(wire.Held(fragment=0, version=3, round=5)), now=1.0)  # a replay of that version
    p.handle(s.frames(wire.Held(fragment=-1, version=0, round=0)), now=1.0)  # malformed
    assert p.take_bcasts() == [] and p.stats.refused == 1
    # A value received for fragment 0 replaces what we hold: a later HELLO claims nothing of it.
    p.handle(s.frames(wire.Bcast(fragment=0, version=4, round=6, cut=False), [("w", torch.ones(3))]), now=1.0)
    again = wire.decode(p.hello(GEN + 1), key=KEY).header
    assert isinstance(again, wire.Hello) and again.holds == ()


def test_start_up_over_claims_nothing_and_lets_go_of_parked_helds() -> None:
    p, s = _claiming(["a" * 32, "b" * 32])
    p.handle(s.frames(wire.Held(fragment=1, version=0, round=0)), now=1.0)
    assert p.drop_claims() == [1] and p.take_bcasts() == []
    p.handle(s.frames(wire.Held(fragment=0, version=0, round=0)), now=1.0)  # too late: training moves the masters
    assert p.take_bcasts() == []
    hello = wire.decode(p.hello(GEN + 1), key=KEY).header
    assert isinstance(hello, wire.Hello) and hello.holds == ()
    # The cut of fragment 1 (whose HELD was let go of) is still taken when it comes.
    p.handle(s.welcome(GEN + 1), now=2.0)
    p.handle(s.frames(wire.Bcast(fragment=1, version=0, round=0, cut=True), [("w", torch.ones(3))]), now=2.0)
    assert [b.fragment for b in p.take_bcasts()] == [1]


def test_an_init_gap_makes_island_0_redial() -> None:
    p, s = _joined()
    eff = p.handle(s.frames(wire.Error(code="init_gap", reason="INIT part 5 of fragment 1, expected part 3")),
                   now=1.0)
    assert eff.redial_s == 0.0 and not p.failed()


def test_a_push_part_is_never_computed_into_a_ring_buffer_zmq_still_sends() -> None:
    """Two pushes of a fragment of two parts, the second short (one small frame, copied by zmq and
    done at once) while the first, large, is still queued: the next push's first part used to
    take the ring buffer of that queued part (round robin) and overwrite it under zmq, so the
    syncer got the new bytes in the old part and refused its digests. Every part must arrive as
    it was digested."""
    import zmq

    from diloco.island.delta_source import DeltaSource
    from diloco.wire.pacing import Pacer, send_tracked

    E = 16 * wire.PART_ALIGN_ELEMS  # parts of 256 KiB: zero-copy frames, above zmq's copy threshold
    p = _protocol(shape=(E + 16,))
    s = Syncer()
    p.hello(GEN)
    s.nonce, s.seq = 1007, 0
    p.handle(s.frames(wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=7, need_init=False, versions=(0, 0),
                                   sync_every=10, total_steps=0, generation=GEN, nonce=s.nonce,
                                   initialised=(True, True), part_elems=E)), now=0.1)
    anchor = torch.zeros(E + 16)
    pushes = []
    for i, f in enumerate((0, 1)):
        snap = torch.full((E + 16,), float(i + 1))
        pushes.append(Outgoing(p.push_header(wire.Pull(fragment=f, round=f + 1, attempt=0), 0, 5, 50),
                               DeltaSource(["w"], [snap], [anchor]), "float32", threading.Event()))
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)  # inproc: zmq holds a sent frame until it is read
    try:
        rx.bind("inproc://ring-test")
        tx.connect("inproc://ring-test")
        pacer = Pacer(2, lambda _d, frames, track: send_tracked(tx, frames, zmq.NOBLOCK, track))
        for out in pushes:
            out.stream = p.stream_of(out)
            assert out.stream.n_parts == 2
            pacer.add(b"", out.stream)
        for _ in range(3):  # nothing read yet: push 0's part 0 stays queued, its short part 1 is done
            pacer.pump()
        assert pushes[1].stream.next_part == 1  # push 1's part 0 was computed meanwhile
        got = []
        deadline = time.monotonic() + 10
        while (pacer.pending() or rx.poll(0)) and time.monotonic() < deadline:
            pacer.pump()  # every part the window lets go (computed now), read only afterwards
            while rx.poll(0):
                got.append(wire.decode(rx.recv_multipart(), key=KEY))
            time.sleep(0.005)  # zmq reports a read part released a moment later
        assert pacer.pending() == 0 and len(got) == 4
        for msg in got:  # decode checked every chunk digest; the values are each push's own
            h = msg.header
            assert isinstance(h, wire.Push)
            assert all(torch.all(t == float(h.fragment + 1)) for _n, t in msg.tensors), (h.fragment, h.part)
    finally:
        rx.close(linger=0)
        tx.close(linger=0)
        ctx.term()


def test_the_part_ring_hands_out_only_buffers_zmq_released() -> None:
    from types import SimpleNamespace

    from diloco.island.delta_source import PartRing

    ring = PartRing(2)
    a, b = ring.take(8), ring.take(8)
    assert a is not b
    queued, released = SimpleNamespace(done=False), SimpleNamespace(done=True)
    ring.hold(a, queued)  # a large part still in zmq's queue
    ring.hold(b, released)  # a short part after it, copied and done at once
    assert ring.take(8) is b and ring.take(8) is b  # never a (a plain round robin gave a here)
    queued.done = True
    assert ring.take(8) is a


def test_chunk_work_goes_parallel_for_init_final_and_once_done() -> None:
    """INIT and FINAL always use the shared chunk threads; a push or a broadcast only once the
    island said done (no training loop shares the GIL then); during training they stay inline."""
    from diloco.island.effects import CHUNK_PARALLEL, chunk_parallel

    push = wire.Push(island=0, generation=GEN, fragment=0, round=1, attempt=0, base_version=0, local_steps=1,
                     tokens=1, part=0, n_parts=1)
    bcast = wire.Bcast(fragment=0, version=1, round=1, cut=False, part=0, n_parts=1, commit_us=0)
    init = wire.Init(island=0, generation=GEN, fragment=0, n_fragments=1, part=0, n_parts=1, schema=())
    final = wire.Final(fragment=0, version=1, n_fragments=1, versions=(1,), part=0, n_parts=1)
    assert chunk_parallel(push) is CHUNK_PARALLEL and chunk_parallel(bcast) is CHUNK_PARALLEL
    assert chunk_parallel(push, done=True) and chunk_parallel(bcast, done=True)
    assert chunk_parallel(init) and chunk_parallel(final)

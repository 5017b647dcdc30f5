"""SyncClient against a scripted syncer on a real ROUTER socket (tcp loopback)."""

from __future__ import annotations

import hmac
import time

import msgspec
import pytest
import torch
import zmq

from diloco import wire
from diloco.config import IslandConfig
from diloco.island.client import SyncClient, SyncError
from diloco.security import ServerAuth, ServerCurve

pytestmark = pytest.mark.timeout(60)

KEY = b"client-test-key"


class ScriptedSyncer:
    """A ROUTER socket the test drives by hand: it records what islands send.

    It speaks HMAC mode as the real syncer does: Curve keys derived from KEY, a ZAP handler,
    and a session (nonce, sequence numbers) opened by each WELCOME."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = ServerAuth(self.ctx, ServerCurve.from_shared_key(KEY))
        self.auth.secure(self.sock)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self.peer: bytes | None = None
        self.nonce = 0
        self.seq = 0

    def recv(self, kind: type, timeout_s: float = 10.0) -> wire.Message:
        """Next message of ``kind`` (others, e.g. heartbeats, are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                peer, *frames = self.sock.recv_multipart(copy=False)
                msg = wire.decode(frames, key=KEY)
                if isinstance(msg.header, kind):
                    self.peer = peer.bytes
                    return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s}s")

    def send(self, header: wire.Header, tensors: list | None = None) -> None:
        assert self.peer is not None
        # Fragment values travel as parts: here each fits one part of flat segments.
        flat = [(n, t.reshape(-1)) for n, t in tensors or []]
        self.sock.send_multipart([self.peer, *self.frames(header, flat)], copy=False)

    def frames(self, header: wire.Header, flat: list | None = None, **stamp: int) -> list:
        """The frames of one message of the current session (``nonce=``/``seq=`` override the stamp)."""
        self.seq += 1
        kw = {"nonce": self.nonce, "seq": self.seq, **stamp}
        return wire.encode(header, flat or [], key=KEY, **kw)

    def welcome(self, syncer_id: int = 7, n: int = 2) -> wire.Hello:
        hello = self.recv(wire.Hello).header
        self.nonce, self.seq = 1000 + syncer_id, 0
        self.send(wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=syncer_id, need_init=False,
                               versions=(0,) * n, sync_every=10, total_steps=0, generation=hello.generation,
                               nonce=self.nonce))
        return hello

    def close(self) -> None:
        self.sock.close()
        self.auth.stop()
        self.ctx.term()


@pytest.fixture
def syncer():
    s = ScriptedSyncer()
    yield s
    s.close()


def _client(addr: str, shape: tuple[int, ...] = (3,), **kw: object) -> SyncClient:
    cfg = IslandConfig(sync_addr=addr, island_id=1, key=KEY, heartbeat_s=0.2, sync_timeout_s=2.0, **kw)
    return SyncClient(cfg, fingerprint="ab" * 16, layouts=[wire.FragmentLayout.of([("w", shape)])] * 2)


def _wait(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_hello_welcome_and_push_roundtrip(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr, shape=(2, 3))
    try:
        hello = syncer.welcome()
        assert (hello.island, hello.fingerprint, hello.n_fragments, hello.fragment_numel) == (1, "ab" * 16, 2, (6, 6))
        assert client.wait_welcome(5).syncer_id == 7
        delta = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
        assert client.push(wire.Pull(fragment=1, round=3, attempt=0), 2, 5, 500, delta)
        msg = syncer.recv(wire.Push)
        assert msg.header == wire.Push(island=1, generation=hello.generation, fragment=1, round=3, attempt=0,
                                       base_version=2, local_steps=5, tokens=500, part=0, n_parts=1)
        assert torch.equal(msg.tensors[0][1], delta[0][1].reshape(-1))
        assert client.stats.push_bytes_sent == 24
        # A zero-weight push travels bare: no parts, no tensors.
        assert client.push(wire.Pull(fragment=1, round=4, attempt=0), 2, 0, 0, delta)
        bare = syncer.recv(wire.Push)
        assert bare.header.n_parts == 0 and bare.tensors == [] and client.stats.push_bytes_sent == 24
    finally:
        client.close()


def test_take_ready_pulls_keeps_newest_attempt_and_drops_resent(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        syncer.welcome()
        client.wait_welcome(5)
        for attempt in (0, 2, 1, 2):  # newest attempt 2, resent once, an old one late
            syncer.send(wire.Pull(fragment=0, round=1, attempt=attempt))
        syncer.send(wire.Pull(fragment=1, round=2, attempt=0))
        syncer.send(wire.Pull(fragment=1, round=2, attempt=0))
        syncer.send(wire.Pull(fragment=0, round=1, attempt=2))  # marker: last message
        time.sleep(0.3)
        pulls = client.take_ready_pulls()
        assert [(p.fragment, p.round, p.attempt) for p in pulls] == [(0, 1, 2), (1, 2, 0)]
        # A resent copy after the pull was taken is not handed out again; a newer attempt is.
        syncer.send(wire.Pull(fragment=0, round=1, attempt=2))
        syncer.send(wire.Pull(fragment=0, round=1, attempt=3))
        _wait(lambda: client.stats.messages_recv >= 9)
        time.sleep(0.1)
        assert [(p.fragment, p.round, p.attempt) for p in client.take_ready_pulls()] == [(0, 1, 3)]
        assert client.take_ready_pulls() == []
    finally:
        client.close()


def test_broadcasts_in_increasing_version_order(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        syncer.welcome()
        client.wait_welcome(5)

        def bcast(f: int, v: int) -> None:
            syncer.send(wire.Bcast(fragment=f, version=v, round=v, cut=False),
                        [("w", torch.full((3,), float(v)))])

        for v in (1, 3, 2):  # 2 arrives after 3: ignored
            bcast(0, v)
        bcast(1, 5)
        _wait(lambda: client.stats.messages_recv >= 5)
        got = client.take_bcasts()
        assert [(b.fragment, b.version) for b in got] == [(0, 3), (1, 5)]
        assert torch.equal(got[0].tensors[0][1], torch.full((3,), 3.0))
        bcast(0, 3)  # identical replay
        bcast(1, 4)  # older
        bcast(0, 4)
        _wait(lambda: client.stats.messages_recv >= 8)
        time.sleep(0.1)
        assert [(b.fragment, b.version) for b in client.take_bcasts()] == [(0, 4)]
    finally:
        client.close()


def test_redial_under_new_generation_when_syncer_restarts(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr, shape=(2,))
    try:
        first = syncer.welcome(syncer_id=7)
        client.wait_welcome(5)
        syncer.send(wire.Bcast(fragment=0, version=4, round=4, cut=False), [("w", torch.ones(2))])
        _wait(lambda: client.stats.messages_recv >= 2)
        assert [b.version for b in client.take_bcasts()] == [4]
        # A heartbeat from a different syncer instance makes the client rejoin.
        syncer.send(wire.Heartbeat(syncer_id=99))
        second = syncer.welcome(syncer_id=99)
        assert second.generation != first.generation
        _wait(lambda: client.generation == second.generation)
        # The new syncer resumed an older checkpoint: its cut (version 2) must be accepted.
        syncer.send(wire.Bcast(fragment=0, version=2, round=0, cut=True), [("w", torch.zeros(2))])
        _wait(lambda: client.stats.messages_recv >= 4)
        time.sleep(0.1)
        got = client.take_bcasts()
        assert [(b.fragment, b.version, b.cut) for b in got] == [(0, 2, True)]
        # A push queued now carries the new generation.
        client.push(wire.Pull(fragment=0, round=5, attempt=0), 2, 1, 1, [("w", torch.ones(2))])
        assert syncer.recv(wire.Push).header.generation == second.generation
        assert client.stats.redials == 1
    finally:
        client.close()


@pytest.mark.integ  # waits seconds of real time on a real socket (the client's timers)
def test_redial_after_silence(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        first = syncer.welcome()
        client.wait_welcome(5)
        # The syncer says nothing for longer than sync_timeout_s (2 s): the client redials.
        second = syncer.recv(wire.Hello, timeout_s=10).header
        assert second.generation != first.generation and second.island == 1
    finally:
        client.close()


@pytest.mark.integ  # waits seconds of real time on a real socket (the client's timers)
def test_fatal_refusal_raises_at_next_boundary(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        syncer.recv(wire.Hello)
        syncer.send(wire.Error(code="fingerprint_mismatch", reason="layout fingerprint differs"))
        with pytest.raises(SyncError, match="fingerprint"):
            client.wait_welcome(5)
        with pytest.raises(SyncError):
            client.take_ready_pulls()
    finally:
        client.close()


def test_rejoin_when_syncer_no_longer_knows_us(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        first = syncer.welcome()
        client.wait_welcome(5)
        syncer.send(wire.Error(code="not_bound", reason="island 1 has not said HELLO"))
        second = syncer.welcome()
        assert second.generation != first.generation
        client.wait_welcome(5)
        assert client.stats.redials == 1
    finally:
        client.close()


def test_push_dropped_when_queue_full() -> None:
    # No syncer at all: nothing drains beyond what zmq buffers, so the bounded queue fills.
    cfg = IslandConfig(sync_addr="tcp://127.0.0.1:9", island_id=0, send_queue=2, heartbeat_s=5.0,
                       sync_timeout_s=60.0)
    client = SyncClient(cfg, fingerprint="00", layouts=[wire.FragmentLayout.of([("w", (1 << 16,))])])
    try:
        big = [("w", torch.zeros(1 << 16))]
        results = [client.push(wire.Pull(fragment=0, round=1, attempt=0), 0, 1, 1, big) for _ in range(400)]
        assert not all(results), "a full queue must drop pushes instead of blocking"
        assert client.stats.pushes_dropped == results.count(None)
    finally:
        client.close(linger_s=0.1)


def test_client_refuses_a_hostile_syncer_and_keeps_serving(syncer: ScriptedSyncer) -> None:
    """Malformed, tampered, replayed and foreign-session messages are refused one log line each;
    the I/O thread survives, nothing of them is applied, and valid traffic still flows."""
    client = _client(syncer.addr)
    try:
        hello = syncer.welcome()
        client.wait_welcome(5)
        good = wire.Bcast(fragment=0, version=1, round=1, cut=False)
        ones = [("w", torch.ones(3))]
        valid = syncer.frames(good, ones)
        flipped = list(valid)
        chunk = bytearray(bytes(memoryview(flipped[2])))
        chunk[1] ^= 0x10
        flipped[2] = bytes(chunk)  # payload bit: header MAC holds, digest does not
        huge = wire.encode(wire.Bcast(fragment=0, version=1, round=1, cut=False), [], key=KEY,
                           nonce=syncer.nonce, seq=syncer.seq + 100)
        env = msgspec.msgpack.decode(bytes(memoryview(huge[1])))
        env["tensors"] = [["w", "float32", [0, 2**63], []]]  # declares 0 bytes, absurd dims
        body = msgspec.msgpack.encode(env)
        huge = [hmac.digest(KEY, body, "sha256"), body]
        hostile = [
            [b"garbage"],
            [b"\x00" * 32, b"\xc1\xc1"],
            flipped,
            huge,
            syncer.frames(wire.Bcast(fragment=0, version=1, round=1, cut=False), [("w", torch.ones(4))]),  # shape
            syncer.frames(wire.Bcast(fragment=9, version=1, round=1, cut=False), ones),  # fragment outside plan
            syncer.frames(good, ones, nonce=syncer.nonce + 1),  # another session
            syncer.frames(good, ones, nonce=0),  # no session
            syncer.frames(wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=7, need_init=False,
                                       versions=(0, 0), sync_every=10, total_steps=0,
                                       generation=hello.generation, nonce=5), nonce=5),  # a second WELCOME
            valid,  # its sequence number is that of ``flipped``, which was taken: a replay now
        ]
        for frames in hostile:
            syncer.sock.send_multipart([syncer.peer, *frames], copy=False)
        syncer.sock.send_multipart([syncer.peer, *valid], copy=False)  # a replay: stale sequence number
        _wait(lambda: client.stats.refused >= len(hostile) + 1)
        time.sleep(0.2)
        assert client.stats.refused == len(hostile) + 1
        assert client.take_bcasts() == []  # none of it was applied
        # The client keeps serving: a valid BCAST is taken, a PULL answered, heartbeats flow.
        syncer.send(wire.Bcast(fragment=0, version=2, round=2, cut=False), [("w", torch.full((3,), 2.0))])
        syncer.send(wire.Pull(fragment=1, round=2, attempt=0))
        _wait(lambda: client.stats.messages_recv >= len(hostile) + 4)  # + WELCOME, the replay, 2 more
        got = client.take_bcasts()
        assert [(b.fragment, b.version) for b in got] == [(0, 2)]
        assert torch.equal(got[0].tensors[0][1], torch.full((3,), 2.0))
        pulls = client.take_ready_pulls()
        assert [(p.fragment, p.round) for p in pulls] == [(1, 2)]
        assert client.push(pulls[0], 0, 1, 10, [("w", torch.zeros(3))])
        push = syncer.recv(wire.Push)
        assert push.header.generation == hello.generation
    finally:
        client.close()


def test_client_messages_carry_the_session(syncer: ScriptedSyncer) -> None:
    """Every message after HELLO carries WELCOME's nonce and an increasing sequence number."""
    client = _client(syncer.addr)
    try:
        syncer.welcome()
        client.wait_welcome(5)
        client.report_step(3)
        seen = []
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            if syncer.sock.poll(100):
                _peer, *frames = syncer.sock.recv_multipart(copy=False)
                opened = wire.open_message(frames, key=KEY)
                seen.append((opened.nonce, opened.seq))
        assert len(seen) == 3 and {n for n, _ in seen} == {syncer.nonce}
        assert [q for _, q in seen] == sorted({q for _, q in seen}) and seen[0][1] >= 1
    finally:
        client.close()


# ---------------------------------------------------------------- faults (issue 13)


def test_an_unexpected_exception_on_the_io_thread_is_fatal_at_the_next_boundary(syncer: ScriptedSyncer,
                                                                                 monkeypatch) -> None:
    client = _client(syncer.addr)
    try:
        syncer.welcome()
        client.wait_welcome(5)

        def boom(*_a: object) -> None:
            raise RuntimeError("decoder bug")

        monkeypatch.setattr(client.protocol, "_on_pull", boom)
        syncer.send(wire.Pull(fragment=0, round=1, attempt=0))
        _wait(lambda: not client._thread.is_alive())
        with pytest.raises(SyncError, match="I/O thread failed: RuntimeError: decoder bug"):
            client.take_ready_pulls()
        with pytest.raises(SyncError):
            client.take_bcasts()
    finally:
        client.close(linger_s=0.1)


def test_stale_base_lets_the_same_pull_be_answered_again(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        hello = syncer.welcome()
        assert hello.instance != 0
        client.wait_welcome(5)
        pull = wire.Pull(fragment=1, round=4, attempt=0)
        syncer.send(pull)
        _wait(lambda: client.stats.messages_recv >= 2)
        assert client.take_ready_pulls() == [pull]
        syncer.send(pull)  # a resent copy of a pull we answered: ignored
        syncer.send(wire.Error(code="stale_base", reason="base 0 < 1", fragment=1, round=4))
        _wait(lambda: client.stats.messages_recv >= 4)
        assert client.take_stale() == [(1, 4)] and client.take_stale() == []
        syncer.send(pull)  # after stale_base the syncer's PULL is answered again
        _wait(lambda: client.stats.messages_recv >= 5)
        assert client.take_ready_pulls() == [pull]
    finally:
        client.close()


def test_no_bcast_after_the_final_cut_and_the_ack_is_resent_after_a_redial(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        syncer.welcome()
        client.wait_welcome(5)
        value = [("w", torch.ones(3))]
        for f in range(2):
            syncer.send(wire.Final(fragment=f, version=3, n_fragments=2, versions=(3, 3)), value)
        syncer.send(wire.Bcast(fragment=0, version=4, round=9, cut=False), [("w", torch.zeros(3).bfloat16())])
        _wait(lambda: client.final_fragments() is not None and client.stats.messages_recv >= 4)
        assert client.take_bcasts() == []  # a BCAST behind the FINAL is never applied
        client.send_final_ack([3, 3], ["d0", "d1"])
        ack = syncer.recv(wire.FinalAck).header
        assert ack.digests == ("d0", "d1")
        # A redial (the syncer no longer knows us): the same syncer gets the ack again.
        syncer.send(wire.Error(code="unknown_generation", reason="?"))
        syncer.welcome()
        again = syncer.recv(wire.FinalAck).header
        assert again.digests == ("d0", "d1") and again.generation != ack.generation
    finally:
        client.close()


@pytest.mark.integ  # waits seconds of real time on a real socket (the client's timers)
def test_island_in_use_before_a_welcome_is_retried_then_reported(syncer: ScriptedSyncer) -> None:
    client = _client(syncer.addr)
    try:
        first = syncer.recv(wire.Hello).header
        syncer.send(wire.Error(code="island_in_use", reason="island id 1 is bound to another live process"))
        second = syncer.recv(wire.Hello, timeout_s=5).header  # retried, same process instance
        assert second.instance == first.instance and second.generation != first.generation
        with pytest.raises(SyncError, match="island_in_use"):
            client.wait_welcome(1.5)
    finally:
        client.close()

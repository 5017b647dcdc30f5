"""A live syncer under hostile traffic in each security mode (docs/SECURITY.md).

* fuzzing: thousands of generated malformed messages (tests.support.fuzz) from an
  authenticated connection: zero crashes, every one refused, RSS bounded, state unchanged,
  and a normal round still commits exactly the numpy reference afterwards;
* replays of every captured island message kind, from another connection and from the
  island's own: nothing answered, nothing changed;
* slow-loris: incomplete multipart messages over raw ZMTP and an unlisted Curve key cost
  the syncer < 16 MiB of RSS, while listed islands keep being served.
"""

from __future__ import annotations

import os
import random
import re
import time

import numpy as np
import pytest
import zmq

from tests.support.fuzz import Fuzzer, raw_zmtp_flood
from diloco.wire import Bcast, Error, FinalAck, Final, Heartbeat, Hello, Pull, Shutdown, Welcome, open_message
from security_setup import P, SHAPES, Setup, hello, last_status, push_header, rss, start, tensors
from syncer_harness import Island, commit_event, reference_fragment

N_FUZZ = int(os.environ.get("YETO_FUZZ_MESSAGES", "2000"))
RSS_BOUND = 16 << 20


def drain(isl: Island) -> int:
    n = 0
    while isl.sock.poll(0):
        isl.sock.recv_multipart()
        n += 1
    return n


def counts(status: str) -> tuple[int, int]:
    wire = int(re.search(r"wire_refusals=(\d+)", status).group(1))  # type: ignore[union-attr]
    state = int(re.search(r"refusals=(\d+) ", status).group(1))  # type: ignore[union-attr]
    return wire, state


def commit_round_1(s: Setup, a: Island, b: Island, seed: int = 5) -> None:
    """The legitimate pushes of round 1 commit exactly the reference: nothing hostile was taken."""
    rng = np.random.default_rng(seed)
    d = {isl.island: [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES] for isl in (a, b)}
    a.send(push_header(a, tokens=300), tensors(d[0]))
    b.send(push_header(b, tokens=100), tensors(d[1]))
    order = commit_event(s.syncer.log_path.parent / "events.jsonl", 1)["fold_order"]
    ref, _ = reference_fragment(s.value[0], s.mom[0], d, {0: 300, 1: 100}, order, 4096)
    for isl in (a, b):
        m = isl.expect(Bcast, strict=False)
        assert (m.header.fragment, m.header.version, m.header.cut) == (0, 1, False)
        for (_n, t), want in zip(m.tensors, ref):
            assert np.array_equal(t.numpy(), want)


def run_fuzz(s: Setup, n: int, seed: int = 11) -> dict[str, int]:
    """Send ``n`` generated messages from ``evil``; returns messages per kind."""
    # Captured valid traffic of both islands, plus a PUSH stream built but never sent.
    captured = s.a.sent + s.b.sent + s.b.part_frames(push_header(s.b), tensors(s.value[0]), key=s.key)
    fuzz = Fuzzer(random.Random(seed), s.key, captured)
    per_kind: dict[str, int] = {}
    for i in range(n):
        kind, frames = fuzz.message()
        per_kind[kind] = per_kind.get(kind, 0) + 1
        s.evil.sock.send_multipart(frames)
        if i % 50 == 0:
            drain(s.evil)
            time.sleep(0.002)  # let the syncer keep up: RCVHWM would otherwise throttle us
    return per_kind


@pytest.mark.integ
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["curve", "hmac"])
def test_fuzz_live_syncer(tmp_path, mode: str) -> None:
    s = start(tmp_path, mode)
    try:
        before_status = last_status(s.syncer)
        w0, r0 = counts(before_status)
        rss0 = rss(s.syncer)
        per_kind = run_fuzz(s, N_FUZZ)
        for _ in range(3):  # incomplete multipart messages over raw ZMTP: refused at the greeting
            raw_zmtp_flood("127.0.0.1", int(s.syncer.endpoint.rsplit(":", 1)[1]), frames=16, frame_bytes=1 << 20)
        deadline = time.monotonic() + 60
        while sum(counts(last_status(s.syncer, 0.0))) - w0 - r0 < N_FUZZ:
            assert time.monotonic() < deadline, f"refusals stuck below {N_FUZZ}: {last_status(s.syncer, 0)}"
        status = last_status(s.syncer)
        assert s.syncer.proc.poll() is None, "the syncer died"
        w1, r1 = counts(status)
        assert (w1 - w0) + (r1 - r0) == N_FUZZ, (per_kind, status)  # every message refused, once
        assert "versions=[0, 0]" in status and "open=[r1/f0/a0:0/2]" in status and "commits=0" in status
        grown = rss(s.syncer) - rss0
        print(f"FUZZ mode={mode} messages={N_FUZZ} kinds={per_kind} wire_refusals={w1 - w0} "
              f"state_refusals={r1 - r0} rss_growth_mib={grown / 2**20:.1f}")
        assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
        assert "Traceback" not in s.syncer.log() and "internal error" not in s.syncer.log()
        commit_round_1(s, s.a, s.b)
    finally:
        s.close()


@pytest.mark.integ
@pytest.mark.timeout(180)
def test_replays_of_every_island_kind_are_dropped(tmp_path) -> None:
    s = start(tmp_path, "hmac")
    try:
        kinds = {}
        for frames in s.a.sent + s.b.sent:
            kinds.setdefault(type(open_message(frames, key=s.key).header).__name__, frames)
        assert set(kinds) == {"Hello", "Init", "Heartbeat"}
        # A push part sent for real, then replayed.
        parts = s.b.part_frames(push_header(s.b, tokens=100), tensors([x * 0 + 0.01 for x in s.value[0]]), key=s.key)
        drain(s.evil)
        w0, r0 = counts(last_status(s.syncer))
        for frames in kinds.values():
            s.evil.sock.send_multipart(frames)  # another connection
            s.a.sock.send_multipart(frames)  # the island's own connection: stale sequence number
        s.b.sock.send_multipart(parts[0])
        s.b.sock.send_multipart(parts[0])  # same part again, same connection
        s.evil.sock.send_multipart(parts[0])
        for p in parts[1:]:
            s.b.sock.send_multipart(p)
        wait = last_status(s.syncer)
        w1, r1 = counts(wait)
        assert (w1 - w0, r1 - r0) == (0, 2 * len(kinds) + 2), wait
        log = s.syncer.log()
        for code in ("replayed_hello", "wrong_peer", "replayed_seq"):
            assert f": {code}:" in log
        assert drain(s.evil) == 0  # the replayer got nothing at all
        got = []
        while s.a.sock.poll(200):  # the island's own connection: its replays answered with nothing
            got.append(type(open_message(s.a.sock.recv_multipart(), key=s.key).header).__name__)
        assert set(got) <= {"Progress"}, got  # (PROGRESS notices come every second regardless)
        # The round commits exactly the reference: b's push once, a's push.
        rng = np.random.default_rng(8)
        da = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
        s.a.send(push_header(s.a, tokens=300), tensors(da))
        db = [x * 0 + 0.01 for x in s.value[0]]
        order = commit_event(tmp_path / "events.jsonl", 1)["fold_order"]
        ref, s.mom[0] = reference_fragment(s.value[0], s.mom[0], {0: da, 1: db}, {0: 300, 1: 100}, order, 4096)
        for isl in (s.a, s.b):
            m = isl.expect(Bcast, strict=False)
            assert m.header.version == 1
            assert all(np.array_equal(t.numpy(), want) for (_n, t), want in zip(m.tensors, ref))
        # Round 2, then FINAL: a captured PUSH and FINAL_ACK replayed change nothing either.
        for isl in (s.a, s.b):
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=2))
        for isl in (s.a, s.b):
            pull = isl.expect(Pull, strict=False).header
            isl.send(push_header(isl, fragment=pull.fragment, round=pull.round, local_steps=0, tokens=0,
                                 base_version=0))
        for _ in range(P):  # both reached --total-steps: one flush round per fragment, one after another
            for isl in (s.a, s.b):
                p = isl.expect(Pull, strict=False).header
                isl.send(push_header(isl, fragment=p.fragment, round=p.round, local_steps=0, tokens=0,
                                     base_version=1 if p.fragment == 0 else 0))
        for isl in (s.a, s.b):
            assert sorted(isl.expect(Final, strict=False).header.fragment for _ in range(P)) == [0, 1]
        s.a.send(FinalAck(island=0, generation=s.a.generation, versions=(1, 0)))
        ack = s.a.sent[-1]
        push = next(f for f in s.a.sent if type(open_message(f, key=s.key).header).__name__ == "Push")
        for frames in (ack, push):
            s.evil.sock.send_multipart(frames)
            s.a.sock.send_multipart(frames)
        time.sleep(0.5)
        assert s.syncer.proc.poll() is None  # island 1 has not acked: a replayed ack finished nothing
        s.b.send(FinalAck(island=1, generation=s.b.generation, versions=(1, 0)))
        assert s.syncer.wait(30) == 0
        assert drain(s.evil) == 0
        assert s.syncer.log().count("dropped ") >= 2 * len(kinds) + 2 + 4
    finally:
        s.close()


@pytest.mark.integ
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["curve", "hmac"])
def test_slow_loris_costs_the_syncer_nothing(tmp_path, mode: str) -> None:
    s = start(tmp_path, mode)
    try:
        port = int(s.syncer.endpoint.rsplit(":", 1)[1])
        time.sleep(0.5)
        rss0 = rss(s.syncer)
        accepted, held = 0, []  # connections stay open while RSS is measured
        for _ in range(4):  # 4 x 64 MiB of MORE frames that never complete, over raw ZMTP
            accepted += raw_zmtp_flood("127.0.0.1", port, frames=64, frame_bytes=1 << 20, keep=held)
        # A Curve peer with a key the syncer does not list (in HMAC mode: keys not derived from
        # our key) sends 64 MiB of complete messages: dropped in the handshake.
        stranger = s.island(1, "late", key=b"not-the-key")
        if mode == "hmac":
            stranger.sock.close(0)
            stranger = Island(s.ctx, s.syncer.endpoint, 1, key=b"not-the-key", schema=[SHAPES] * 2)
        stranger.sock.setsockopt(zmq.SNDHWM, 4)
        blob = b"\x00" * (1 << 20)
        for _ in range(64):
            try:
                stranger.sock.send_multipart([blob, blob], flags=zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.01)
        time.sleep(1.0)
        grown = rss(s.syncer) - rss0
        print(f"SLOWLORIS mode={mode} raw_bytes_accepted={accepted} rss_growth_mib={grown / 2**20:.2f}")
        assert grown < RSS_BOUND, f"RSS grew by {grown / 2**20:.1f} MiB"
        assert not stranger.sock.poll(100)
        for sock in held:
            sock.close()
        stranger.close()
        assert "ZAP: refused a Curve handshake" in s.syncer.log() or mode == "hmac"
        commit_round_1(s, s.a, s.b)  # listed islands were served all along
    finally:
        s.close()


def heartbeat_rtt(isl: Island, step: int, timeout_s: float = 5.0) -> float:
    """Seconds from a HEARTBEAT to the syncer's HEARTBEAT reply (nothing else may arrive meanwhile)."""
    t0 = time.monotonic()
    isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=step))
    while True:
        left = t0 + timeout_s - time.monotonic()
        assert left > 0 and isl.sock.poll(int(left * 1000)), f"no HEARTBEAT reply in {timeout_s} s"
        h = open_message(isl.sock.recv_multipart(), key=isl.key).header
        if isinstance(h, Heartbeat):
            return time.monotonic() - t0
        assert type(h).__name__ == "Progress", h


@pytest.mark.integ
@pytest.mark.timeout(240)
def test_a_hello_flood_costs_little_and_its_phantom_ids_are_never_waited_for(tmp_path) -> None:
    """An admitted key sends 5,000 HELLOs cycling 63 ids (fresh generations, 50 connections) at 8
    fragments: the syncer grows < 64 MiB, answers a real island's heartbeats within 1 s all along,
    and the next round opens with, and commits from, the two real islands only."""
    s = start(tmp_path, "hmac", fragments=8, islands=65, extra=["--sync-every", "8", "--total-steps", "4"])
    conns: list[Island] = []
    try:
        time.sleep(0.5)
        rss0 = rss(s.syncer)
        conns = [s.island(2 + k % 63) for k in range(50)]
        worst = 0.0
        sent = answered = 0
        while sent < 5000:
            for k, c in enumerate(conns):
                island = 2 + (sent % 63)
                c.send(hello(c, island=island, generation=random.getrandbits(62), n_fragments=8))
                sent += 1
            for c in conns:
                answered += drain(c)
            if sent % 1000 == 0:  # a real island's heartbeat, answered in time during the flood
                worst = max(worst, heartbeat_rtt(s.a, 1))
        time.sleep(1.0)
        for c in conns:
            answered += drain(c)
        assert answered >= len(conns)  # HELLOs within the rate were admitted (WELCOME, cut streams)
        grown = rss(s.syncer) - rss0
        worst = max(worst, heartbeat_rtt(s.a, 1))
        print(f"HELLO_FLOOD hellos={sent} rss_growth_mib={grown / 2**20:.2f} worst_heartbeat_s={worst:.3f}")
        assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
        assert worst < 1.0, f"a heartbeat waited {worst:.2f} s"
        commit_round_1(s, s.a, s.b)
        # Round 2 opens after the flood: its members are the two real islands, never the phantoms
        # (the quorum timeout is 600 s: waiting on one would hang this test).
        for isl in (s.a, s.b):
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=2))
        for isl in (s.a, s.b):
            assert isl.expect(Pull, strict=False).header.round == 2
            isl.send(push_header(isl, fragment=1, round=2, tokens=100),
                     tensors([np.zeros(sh, np.float32) for _n, sh in SHAPES]))
        assert commit_event(s.syncer.log_path.parent / "events.jsonl", 2, timeout_s=30.0)["pushed"] == [0, 1]
    finally:
        for c in conns:
            c.close()
        s.close()

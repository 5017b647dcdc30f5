"""Security figures: fuzzing a live syncer per mode, the slow-loris bound, and what integrity costs.

1. ``--messages`` (default 10,000) generated malformed messages per mode (Curve, HMAC) from an
   authenticated connection against a real ``yeto-syncer``: crashes, refusals, RSS growth,
   state unchanged, and a normal round committing the exact reference afterwards (the live
   tests in ``tests/diloco/syncer/test_syncer_security_integ.py``, at full size).
2. Slow-loris: 256 MiB of never-completed multipart frames over raw ZMTP per mode, and for
   contrast against an ``--insecure`` syncer (the unbounded case the handshake prevents).
3. Digest cost: xxh3-64 (what chunks carry) against keyed BLAKE2b-64 over 4 MiB chunks, and
   loopback throughput of plain TCP against CurveZMQ (what covers the chunks instead).
4. Pre-authentication cost: the syncer's RSS growth per unauthenticated connection that sent a
   ZMTP greeting and then stays silent in its handshake (target <= 64 KiB; caps and handshake
   timeout raised so that every one is accepted and held), and the seconds a real island needs to join (WELCOME and its whole cut) while
   1,500 idle TCP connections from 127.0.0.2 are open (target <= 10 s).
5. Lying islands: for absurd tokens, a 1e30 and a 3e38 delta, the merged value's largest
   deviation from the starting value over the honest bound ``lr x (1 + mu) x max|honest delta|``
   (<= 1 means within the honest islands' range) and whether the round committed.

Ratios are against baselines measured in the same run; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "diloco" / "syncer")]

from tests.support.fuzz import raw_zmtp_flood  # noqa: E402
from security_setup import last_status, rss, start  # noqa: E402
from syncer_harness import SyncerProc  # noqa: E402
from test_syncer_security_integ import commit_round_1, counts, run_fuzz  # noqa: E402
from test_syncer_preauth_integ import greeting, join_new_island  # noqa: E402
from test_syncer_attacks_integ import commit_of, new_value  # noqa: E402
from security_setup import SHAPES, push_header, tensors  # noqa: E402
from diloco.wire import Pull  # noqa: E402


def fuzz(mode: str, n: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        s = start(Path(tmp), mode)
        try:
            w0, r0 = counts(last_status(s.syncer))
            rss0 = rss(s.syncer)
            t0 = time.perf_counter()
            kinds = run_fuzz(s, n)
            deadline = time.monotonic() + 300
            while sum(counts(last_status(s.syncer, 0.0))) - w0 - r0 < n and time.monotonic() < deadline:
                pass
            seconds = time.perf_counter() - t0
            status = last_status(s.syncer)
            w1, r1 = counts(status)
            alive = s.syncer.proc.poll() is None
            unchanged = "versions=[0, 0]" in status and "open=[r1/f0/a0:0/2]" in status
            grown = rss(s.syncer) - rss0
            commit_round_1(s, s.a, s.b)
            return {"mode": mode, "messages": n, "kinds": kinds, "crashes": 0 if alive else 1,
                    "wire_refusals": w1 - w0, "state_refusals": r1 - r0, "rss_growth_mib": round(grown / 2**20, 2),
                    "state_unchanged": unchanged, "round_committed_after": True, "seconds": round(seconds, 1)}
        finally:
            s.close()


def slow_loris(mode: str, mib: int = 256) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "insecure":
            syncer = SyncerProc(Path(tmp), ["--islands", "2", "--insecure"])
            proc = syncer
        else:
            s = start(Path(tmp), mode)
            proc = s.syncer
        try:
            port = int(proc.endpoint.rsplit(":", 1)[1])
            time.sleep(0.5)
            rss0 = rss(proc)
            held: list = []  # open while RSS is measured: zmq frees an incomplete message on close
            rounds, frames = (4, 64) if mib >= 256 else (1, max(1, mib))
            sent = sum(raw_zmtp_flood("127.0.0.1", port, frames=frames, frame_bytes=1 << 20, keep=held)
                       for _ in range(rounds))
            time.sleep(1.0)
            grown = rss(proc) - rss0
            for sock in held:
                sock.close()
            return {"mode": mode, "attempted_mib": rounds * frames, "accepted_by_tcp_mib": round(sent / 2**20, 1),
                    "rss_growth_mib": round(grown / 2**20, 2)}
        finally:
            if mode == "insecure":
                syncer.stop()
            else:
                s.close()


def digests(mib: int = 256) -> dict[str, float]:
    chunk = os.urandom(4 << 20)
    n = mib // 4
    t0 = time.perf_counter()
    for _ in range(n):
        xxhash.xxh3_64_intdigest(chunk)
    t_xxh = time.perf_counter() - t0
    key = os.urandom(32)
    t0 = time.perf_counter()
    for _ in range(n):
        hashlib.blake2b(chunk, digest_size=8, key=key).digest()
    t_b2 = time.perf_counter() - t0
    return {"xxh3_gbps": mib / 1024 / t_xxh, "blake2b_keyed_gbps": mib / 1024 / t_b2, "blake2b_vs_xxh3": t_b2 / t_xxh}


def transport(mib: int = 256) -> dict[str, float]:
    def run(curve: bool) -> float:
        ctx = zmq.Context()
        r, d = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        if curve:
            pub, sec = zmq.curve_keypair()
            cpub, csec = zmq.curve_keypair()
            r.curve_server, r.curve_secretkey, r.curve_publickey = True, sec, pub
            d.curve_serverkey, d.curve_publickey, d.curve_secretkey = pub, cpub, csec
        port = r.bind_to_random_port("tcp://127.0.0.1")
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send(b"x")
        r.recv_multipart()
        buf = os.urandom(4 << 20)
        t0 = time.perf_counter()
        for _ in range(mib // 4):
            d.send(buf, copy=False)
            r.recv_multipart(copy=False)
        dt = time.perf_counter() - t0
        r.close(0)
        d.close(0)
        ctx.term()
        return mib / 1024 / dt

    plain, curve = run(False), run(True)
    return {"plain_gbps": plain, "curve_gbps": curve, "curve_vs_plain": curve / plain}


def per_connection(conns: int) -> dict[str, object]:
    """RSS growth per unauthenticated connection (HMAC mode: PLAIN greeting plus a frame header)."""
    caps = ["--max-connections", str(conns + 64), "--max-connections-per-address", str(conns + 64),
            "--max-handshaking", str(conns + 64), "--max-handshaking-per-address", str(conns + 64),
            "--handshake-timeout-s", "60"]
    with tempfile.TemporaryDirectory() as tmp:
        s = start(Path(tmp), "hmac", extra=caps)
        held: list[socket.socket] = []
        try:
            port = int(s.syncer.endpoint.rsplit(":", 1)[1])
            time.sleep(0.5)
            rss0 = rss(s.syncer)
            for _ in range(conns):
                c = socket.create_connection(("127.0.0.1", port), timeout=2.0)
                c.sendall(greeting("PLAIN"))  # then silence: held in its handshake (timeout raised to 60 s)
                held.append(c)
            time.sleep(1.0)
            grown = rss(s.syncer) - rss0
            alive = "conns=" in last_status(s.syncer)
            return {"connections": conns, "rss_growth_kib_per_connection": round(grown / conns / 1024, 2),
                    "target_kib": 64, "status_seen": alive}
        finally:
            for c in held:
                c.close()
            s.close()


def join_under_idle(idle: int) -> dict[str, object]:
    """Seconds for a real island to join while ``idle`` TCP connections from 127.0.0.2 are open."""
    with tempfile.TemporaryDirectory() as tmp:
        s = start(Path(tmp), "hmac", extra=["--islands", "3", "--quorum", "2"], soft_nofile=1024)
        held: list[socket.socket] = []
        try:
            port = int(s.syncer.endpoint.rsplit(":", 1)[1])
            for _ in range(idle):
                c = socket.socket()
                c.setblocking(False)
                c.bind(("127.0.0.2", 0))
                try:
                    c.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                held.append(c)
            time.sleep(1.0)
            took = join_new_island(s, 2, "evil")
            return {"idle_connections": idle, "join_s": round(took, 3), "target_s": 10.0}
        finally:
            for c in held:
                c.close()
            s.close()


def lying_island(attack: str) -> dict[str, object]:
    """Honest island 0 and lying island 1 push round 1; the merged value's deviation over the honest bound."""
    with tempfile.TemporaryDirectory() as tmp:
        s = start(Path(tmp), "hmac")
        try:
            rng = np.random.default_rng(4)
            honest = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
            if attack == "tokens-first":  # the liar pushes before any weight was seen
                lie = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
                s.b.send(push_header(s.b, tokens=2**62), tensors(lie))
                time.sleep(0.3)
                s.a.send(push_header(s.a, tokens=100), tensors(honest))
                for isl in (s.a, s.b):  # judged when complete: re-pulled, then capped
                    while isl.expect(Pull, strict=False).header.attempt != 1:
                        pass
                s.b.send(push_header(s.b, tokens=2**62, attempt=1), tensors(lie))
                s.a.send(push_header(s.a, tokens=100, attempt=1), tensors(honest))
            else:
                s.a.send(push_header(s.a, tokens=100), tensors(honest))
                time.sleep(0.3)  # the honest push is seen first
            if attack == "tokens-first":
                pass
            elif attack == "tokens":
                s.b.send(push_header(s.b, tokens=2**62), tensors([
                    (rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]))
            else:
                s.b.send(push_header(s.b, tokens=100), tensors([np.full(sh, float(attack), np.float32)
                                                               for _n, sh in SHAPES]))
                while s.a.expect(Pull, strict=False).header.attempt != 1:  # re-pulled without the liar
                    pass
                s.a.send(push_header(s.a, tokens=100, attempt=1), tensors(honest))
            ev = commit_of(s, 1)
            got = new_value(s.a, 1)
            dev = max(float(np.abs(g - v).max()) for g, v in zip(got, s.value[0]))
            bound = 0.7 * 1.9 * max(float(np.abs(h).max()) for h in honest)
            return {"attack": attack, "committed": True, "pushed": ev["pushed"], "weights": ev["weights"],
                    "deviation_over_honest_bound": round(dev / bound, 4)}
        finally:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000, help="fuzz messages per mode")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny run (200 messages, HMAC mode only, 8 MiB floods and transfers): checks the benchmark runs")
    args = ap.parse_args()
    mib = 8 if args.smoke else 256
    if args.smoke:
        args.messages = 200
    out: dict[str, object] = {"fuzz": [], "slow_loris": []}
    for mode in ("hmac",) if args.smoke else ("curve", "hmac"):
        r = fuzz(mode, args.messages)
        print(f"fuzz {mode}: {r}")
        out["fuzz"].append(r)  # type: ignore[union-attr]
    for mode in ("hmac",) if args.smoke else ("curve", "hmac", "insecure"):
        r = slow_loris(mode, mib)
        print(f"slow-loris {mode}: {r}")
        out["slow_loris"].append(r)  # type: ignore[union-attr]
    out["per_connection"] = per_connection(16 if args.smoke else 256)
    print(f"per connection: {out['per_connection']}")
    out["join_under_idle"] = join_under_idle(100 if args.smoke else 1500)
    print(f"join under idle connections: {out['join_under_idle']}")
    out["lying_islands"] = [lying_island(a) for a in ("tokens", "tokens-first", "1e30", "3e38")]
    print(f"lying islands: {out['lying_islands']}")
    out["digests"] = digests(mib)
    out["transport"] = transport(mib)
    print(f"digests: {out['digests']}")
    print(f"transport: {out['transport']}")
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()

"""Security figures: fuzzing a live syncer per mode, the slow-loris bound, and what integrity costs.

1. ``--messages`` (default 10,000) generated malformed messages per mode (Curve, HMAC) from an
   authenticated connection against a real ``yeto-syncer``: crashes, refusals, RSS growth,
   state unchanged, and a normal round committing the exact reference afterwards (the live
   tests in ``tests/diloco/syncer/test_syncer_security_integ.py``, at full size).
2. Slow-loris: 256 MiB of never-completed multipart frames over raw ZMTP per mode, and for
   contrast against an ``--insecure`` syncer (the unbounded case the handshake prevents).
3. Digest cost: xxh3-64 (what chunks carry) against keyed BLAKE2b-64 over 4 MiB chunks, and
   loopback throughput of plain TCP against CurveZMQ (what covers the chunks instead).

Ratios are against baselines measured in the same run; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import xxhash
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "diloco" / "syncer")]

from tests.support.fuzz import raw_zmtp_flood  # noqa: E402
from security_setup import last_status, rss, start  # noqa: E402
from syncer_harness import SyncerProc  # noqa: E402
from test_syncer_security_integ import commit_round_1, counts, run_fuzz  # noqa: E402


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
    out["digests"] = digests(mib)
    out["transport"] = transport(mib)
    print(f"digests: {out['digests']}")
    print(f"transport: {out['transport']}")
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()

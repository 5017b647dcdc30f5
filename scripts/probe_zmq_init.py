"""INIT's framing over bare zmq: what the transport and a syncer-like consumer cost (device probe).

    python scripts/probe_zmq_init.py [--gib 2.5] [--part-mib 8] [--window 2] [--rcvhwm 2] [--workers 4]
                                     [--streams 1] [--sockbuf-mib 0]

A sender process streams ``--gib`` GiB as INIT does: messages of one small header frame and
``--part-mib`` MiB of 1 MiB chunk frames, sent zero-copy from one buffer, at most ``--window``
messages in zmq's hands (``MessageTracker``s polled every millisecond, as ``wire.pacing`` does;
0: no window, only ``SNDHWM``). This process receives on a ROUTER with ``--rcvhwm`` and either
drops each message (``--workers 0``: the transport alone) or, like the syncer's loop, hands
message ``k`` to worker ``k mod workers``, which digests each chunk (xxh3) and copies it into a
preallocated value, while the loop stops reading once two messages per worker are unfinished.
``--streams N`` splits the parts over N sender processes, one connection each (part ``k`` on
stream ``k mod N``; the receiver gets N zmq I/O threads); ``--sockbuf-mib`` sets ``SO_SNDBUF``
and ``SO_RCVBUF`` on both ends (0: the kernel's autotuning). ``--adopt``: the workers digest each
chunk and keep its frame as the value's storage (no copy, no fresh value: zero-copy INIT's ceiling);
``--syncer-malloc`` applies the syncer's glibc thresholds (``hostmem.tune_syncer_malloc``). Nothing of ``diloco`` runs, so ``scripts/probe_init.py``'s figure over this one is our own cost.
The last line is one JSON object (``gbps``; ``bytes_ok``: every byte arrived in place).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time

import numpy as np
import xxhash
import zmq

CHUNK = 1 << 20


def _sender(addr: str, total: int, part: int, window: int, stream: int = 0, streams: int = 1,
            sockbuf: int = 0) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, 64)
    if sockbuf:
        s.setsockopt(zmq.SNDBUF, sockbuf)
    s.connect(addr)
    buf = np.arange(total // 4, dtype=np.float32).view(np.uint8)
    inflight: list[zmq.MessageTracker] = []
    for k, lo in enumerate(range(0, total, part)):
        if k % streams != stream:
            continue
        while window and len(inflight) >= window:
            s.poll(1, zmq.POLLIN)  # the client's 1 ms wake-up
            inflight = [t for t in inflight if not t.done]
        hi = min(total, lo + part)
        frames = [k.to_bytes(8, "little") + bytes(504)] + [memoryview(buf[a:min(hi, a + CHUNK)])
                                                             for a in range(lo, hi, CHUNK)]
        trackers = []
        for i, f in enumerate(frames):
            more = zmq.SNDMORE if i < len(frames) - 1 else 0
            t = s.send(f, more, copy=False, track=bool(window))
            if window and t is not None and not t.done:
                trackers.append(t)
        if trackers:
            inflight.append(zmq.MessageTracker(*trackers))
    s.send(b"end")
    s.close(linger=-1)
    ctx.term()


def _consume(value: np.ndarray | None, kept: dict, jobs: queue.SimpleQueue, done: queue.SimpleQueue,
             wake_w: int) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        offset, frames = job
        for f in frames:
            view = memoryview(f)
            xxhash.xxh3_64_intdigest(view)
            if value is None:
                kept[offset] = f  # adopted: the frame is the value's storage
            else:
                value[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
            offset += view.nbytes
        done.put(1)
        os.write(wake_w, b"x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.5)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--window", type=int, default=2, help="messages in zmq's hands at the sender (0: no window)")
    ap.add_argument("--rcvhwm", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4, help="0: drop each message (the transport alone)")
    ap.add_argument("--touched", action="store_true",
                    help="fault the value's pages in first (the syncer's value is fresh: its first touch is INIT's)")
    ap.add_argument("--streams", type=int, default=1, help="sender processes, one connection each")
    ap.add_argument("--sockbuf-mib", type=int, default=0, help="SO_SNDBUF / SO_RCVBUF on both ends (0: kernel's)")
    ap.add_argument("--adopt", action="store_true", help="keep each digested frame as the value (no copy)")
    ap.add_argument("--syncer-malloc", action="store_true", help="the syncer's glibc heap thresholds")
    ap.add_argument("--smoke", action="store_true", help="32 MiB: checks it runs (the suite)")
    a = ap.parse_args()
    if a.smoke:
        a.gib = 1 / 32
    part, total = a.part_mib << 20, int(a.gib * 2**30) // 4 * 4
    if a.syncer_malloc:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from diloco.hostmem import tune_syncer_malloc
        tune_syncer_malloc()
    ctx = zmq.Context(io_threads=a.streams)
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.RCVHWM, a.rcvhwm)
    if a.sockbuf_mib:
        r.setsockopt(zmq.RCVBUF, a.sockbuf_mib << 20)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    value = None if a.adopt else np.empty(total, dtype=np.uint8)
    kept: dict[int, zmq.Frame] = {}
    if a.touched and value is not None:
        value.fill(0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    jobs = [queue.SimpleQueue() for _ in range(a.workers)]
    done: queue.SimpleQueue = queue.SimpleQueue()
    workers = [threading.Thread(target=_consume, args=(value, kept, q, done, wake_w), daemon=True) for q in jobs]
    for w in workers:
        w.start()
    senders = [mp.get_context("spawn").Process(target=_sender, args=(f"tcp://127.0.0.1:{port}", total, part, a.window,
                                                                    i, a.streams, a.sockbuf_mib << 20))
               for i in range(a.streams)]
    for sender in senders:
        sender.start()
    poller, held = zmq.Poller(), zmq.Poller()
    poller.register(r, zmq.POLLIN)
    poller.register(wake_r, zmq.POLLIN)
    held.register(wake_r, zmq.POLLIN)
    unfinished, received, t0, ended, ends = 0, 0, None, False, 0
    deadline = time.monotonic() + 600
    while not (ended and unfinished == 0):
        if time.monotonic() > deadline:
            raise SystemExit("probe_zmq_init: timed out")
        full = a.workers and unfinished >= 2 * a.workers
        (held if full else poller).poll(20)
        try:
            while os.read(wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                done.get_nowait()
                unfinished -= 1
            except queue.Empty:
                break
        while not ended and not (a.workers and unfinished >= 2 * a.workers):
            try:
                msg = r.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if t0 is None:
                t0 = time.monotonic()
            if msg[1].bytes == b"end":
                ends += 1
                ended = ends == a.streams
                continue
            k = int.from_bytes(msg[1].bytes[:8], "little")
            received += sum(len(f) for f in msg[2:])
            if a.workers:
                unfinished += 1
                jobs[k % a.workers].put((k * part, msg[2:]))
    seconds = time.monotonic() - (t0 or time.monotonic())
    for q in jobs:
        q.put(None)
    for sender in senders:
        sender.join(timeout=60)
    expected = np.arange(total // 4, dtype=np.float32).view(np.uint8)
    if a.workers and value is None:  # adopted frames: every byte in place, frame by frame
        ok = received == total and sum(len(f) for f in kept.values()) == total and all(
            np.array_equal(np.frombuffer(memoryview(f), dtype=np.uint8), expected[o : o + len(f)])
            for o, f in kept.items())
    else:
        ok = received == total and (a.workers == 0 or bool(np.array_equal(value, expected)))
    gbps = total / max(seconds, 1e-9) / 1e9
    print(f"{total / 2**30:.2f} GiB in {part >> 20} MiB messages, window {a.window}, RCVHWM {a.rcvhwm}, "
          f"{a.workers or 'no'} workers, {a.streams} streams, sockbuf {a.sockbuf_mib} MiB{', adopted' if a.adopt else ''}: {seconds:.2f}s "
          f"({gbps:.2f} GB/s)")
    print(json.dumps({"gbps": round(gbps, 3), "seconds": round(seconds, 3), "bytes_ok": ok, "window": a.window,
                      "rcvhwm": a.rcvhwm, "workers": a.workers, "part_mib": a.part_mib, "gib": a.gib,
                      "streams": a.streams, "sockbuf_mib": a.sockbuf_mib, "adopt": a.adopt}))
    r.close(linger=0)
    ctx.term()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

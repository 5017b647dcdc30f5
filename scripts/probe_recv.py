"""Loopback receive throughput of a bare zmq ROUTER against glibc's mmap threshold (device probe).

    python scripts/probe_recv.py [--mib 2048] [--islands 1]

One or more DEALER processes send 32 MiB messages of 8 frames of 4 MiB (the syncer's part shape)
to a ROUTER in this process, which receives them zero-copy and drops them, as the syncer's loop
does once a part is folded. Run once per threshold: 1 MiB (every received frame is mapped and
unmapped), 8 MiB (the syncer's setting, ``diloco.hostmem.SYNCER_MMAP_BYTES``) and 64 MiB (frames
reused from the heap) and glibc's dynamic default. Each line: the threshold and the GB/s received.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import time

import zmq

FRAME = 4 << 20
FRAMES = 8


def _sender(addr: str, n: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, 4)
    s.connect(addr)
    frames = [memoryview(bytearray(os.urandom(16)) * (FRAME // 16)) for _ in range(FRAMES)]
    s.send(b"go")
    for _ in range(n):
        s.send_multipart([b"h", *frames], copy=False)
    s.send(b"end")
    time.sleep(1.0)


def _run(threshold: int, n: int, islands: int) -> float:
    child = mp.get_context("spawn")
    if threshold >= 0:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (fixed for this process from now on)
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.RCVHWM, 2)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    procs = [child.Process(target=_sender, args=(f"tcp://127.0.0.1:{port}", n)) for _ in range(islands)]
    for p in procs:
        p.start()
    t0, got, ended = 0.0, 0, 0
    while ended < islands:
        if not r.poll(60_000):
            raise TimeoutError("a sender went silent for 60 s")
        m = r.recv_multipart(copy=False)
        body = m[1].bytes if len(m) == 2 else b""
        if body == b"go":
            t0 = t0 or time.perf_counter()
        elif body == b"end":
            ended += 1
        else:
            got += sum(len(f.buffer) for f in m[2:])
    dt = time.perf_counter() - t0
    for p in procs:
        p.join()
    r.close(0)
    ctx.term()
    return got / dt / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=2048, help="MiB each sender sends")
    p.add_argument("--islands", type=int, default=1, help="senders at once")
    p.add_argument("--threshold", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    n = max(1, a.mib // (FRAME * FRAMES >> 20))
    if a.threshold is not None:
        print(f"mmap threshold {a.threshold}: {_run(a.threshold, n, a.islands):.2f} GB/s (islands {a.islands})")
        return
    for t in (1 << 20, 8 << 20, 64 << 20, -1):  # each in a fresh process: a threshold cannot be unset
        os.system(f"python3 {__file__} --mib {a.mib} --islands {a.islands} --threshold {t}")


if __name__ == "__main__":
    main()

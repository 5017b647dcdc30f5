"""Benchmark: the syncer at a real fragment size (issue "Real model sizes (1 of 2)").

A real ``yeto-syncer`` process, two islands (real ``SyncClient`` objects, scripted at
the tensor level) sharing one fragment of ``--gib`` GiB in ``--tensors`` tensors, and a
third island that only pings (heartbeats) throughout.  Baselines are measured in the
same run on a bare zmq DEALER/ROUTER pair (an echo process) moving the same bytes.

Figures (last line, one JSON object):

* ``heartbeat_p99_ms_during_commit``: p99 of heartbeat round trips of the pinging island
  sent while a round was in flight (push start to BCAST received at both islands);
  target <= 100.
* ``round_vs_wire``: push start -> BCAST received at both islands, over the bare pair
  moving the same bytes both ways (2 islands up, 2 down); target <= 1.5.
* ``init_vs_wire``: INIT start -> cut received at island 0 (INIT up, cut down) over the
  bare pair moving the fragment up and back; target <= 1.3.
* ``syncer_rss_over_state``: syncer peak RSS (VmHWM) / (value + momentum + one sum; the
  momentum only with ``--outer-momentum > 0`` in ``--syncer-args``); target <= 1.25.
* ``syncer_rss_over_model``: (syncer VmHWM - its RSS before any island joined) / fragment
  bytes (the model here is one fragment): the figure of ``bench_memory.py``'s
  ``syncer_peak_over_model`` for one fragment.
* ``merge_gbps_vs_memcpy``: the syncer's commit throughput (fragment bytes / commit time, from
  its log, median over rounds) over a memcpy of the same bytes in this process; target >= 0.5.
* ``digest_gbps``: ``diloco.digest.FragmentDigest`` fed the fragment part by part (32 MiB), on
  one core; ``digest_vs_xxh3`` over xxh3-128 of one contiguous buffer of the same bytes;
  target >= 5 GB/s.
* ``rounds_changed``: rounds that changed the model (must equal ``rounds``).

Usage::

    python benchmarks/bench_scale.py [--gib 1.0] [--tensors 30] [--rounds 4] [--data-threads N] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import zmq  # noqa: E402

from diloco import wire
from diloco.security import ClientCurve, secure_client  # noqa: E402
from diloco.config import IslandConfig  # noqa: E402
from diloco.island.client import SyncClient  # noqa: E402

log = logging.getLogger("bench_scale")
REPO = Path(__file__).resolve().parents[1]

_ECHO = r"""
import sys, zmq
n_clients, n_frames = int(sys.argv[1]), int(sys.argv[2])
ctx = zmq.Context(); r = ctx.socket(zmq.ROUTER); port = r.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    got = {}
    while len(got) < n_clients or any(len(v) < n_frames for v in got.values()):
        msg = r.recv_multipart(copy=False)
        if msg[1].bytes == b"quit":
            sys.exit(0)
        got.setdefault(msg[0].bytes, []).append(msg[1])
    for ident, frames in got.items():
        for f in frames:
            r.send_multipart([ident, f], copy=False)
"""


def bare_wire(n_clients: int, payload: list[torch.Tensor], repeat: int) -> float:
    """Median seconds for ``n_clients`` DEALERs to send ``payload`` (4 MiB frames) to a ROUTER
    process and get it back: the bare-zmq cost of the same bytes both ways."""
    frames = []
    for t in payload:
        b = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        frames.extend(b[o : o + (4 << 20)] for o in range(0, b.nbytes, 4 << 20))
    proc = subprocess.Popen([sys.executable, "-c", _ECHO, str(n_clients), str(len(frames))], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    ctx = zmq.Context()
    socks = []
    for _ in range(n_clients):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.SNDHWM, 8)
        s.setsockopt(zmq.RCVHWM, 8)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()

        def run(s: zmq.Socket) -> None:
            for f in frames:
                s.send(f, copy=False)
            for _ in frames:
                s.recv(copy=False)

        th = [threading.Thread(target=run, args=(s,)) for s in socks]
        for t in th:
            t.start()
        for t in th:
            t.join()
        times.append(time.perf_counter() - t0)
    socks[0].send(b"quit")
    proc.wait(timeout=30)
    for s in socks:
        s.close(0)
    ctx.term()
    return statistics.median(times)


class Pinger(threading.Thread):
    """Island 2: HELLO, then a heartbeat every 10 ms, timing each reply; discards everything else."""

    def __init__(self, addr: str, key: bytes, fingerprint: str, numel: int) -> None:
        super().__init__(daemon=True)
        self.addr, self.key, self.fp, self.numel = addr, key, fingerprint, numel
        self.samples: list[tuple[float, float]] = []  # (send time, rtt)
        self.stop = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVHWM, 8)
        secure_client(s, ClientCurve.from_shared_key(self.key))  # HMAC mode: Curve keys derived from the key
        s.connect(self.addr)
        gen = random.getrandbits(62)
        nonce, seq = 0, 0
        s.send_multipart(wire.encode(wire.Hello(protocol=wire.PROTOCOL_VERSION, island=2, generation=gen,
                                                fingerprint=self.fp, n_fragments=1, wire_dtype="float32",
                                                fragment_numel=(self.numel,)), key=self.key))
        while not self.stop.is_set():
            t0 = time.monotonic()
            if nonce:  # heartbeats belong to the session WELCOME opened
                seq += 1
                s.send_multipart(wire.encode(wire.Heartbeat(island=2, generation=gen, step=0), key=self.key,
                                             nonce=nonce, seq=seq))
            while not self.stop.is_set():
                if not s.poll(100):
                    continue
                frames = s.recv_multipart(copy=False)
                try:
                    h = wire.open_message(frames, key=self.key).header
                except wire.WireError:
                    continue
                if isinstance(h, wire.Welcome):
                    nonce = h.nonce
                    break
                if isinstance(h, wire.Heartbeat):
                    self.samples.append((t0, time.monotonic() - t0))
                    break
            time.sleep(0.01)
        s.close(0)
        ctx.term()


class RssSampler(threading.Thread):
    """Samples a process's RSS every 20 ms, so the report can say when the peak happened."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            m = re.search(r"VmRSS:\s+(\d+) kB", text)
            if m:
                self.samples.append((time.monotonic(), int(m.group(1)) * 1024))
            time.sleep(0.02)

    def peak_between(self, a: float, b: float) -> int:
        return max((r for t, r in self.samples if a <= t <= b), default=0)


def pinger_main(argv: list[str]) -> None:
    """``--role pinger ADDR FP NUMEL OUT``: ping from a process of its own (no GIL shared with
    the islands' clients), write the samples to OUT as JSON when told to stop (SIGTERM)."""
    import signal

    addr, fp, numel, out = argv[0], argv[1], int(argv[2]), argv[3]
    p = Pinger(addr, os.environ["YETO_SYNC_KEY"].encode(), fp, numel)
    signal.signal(signal.SIGTERM, lambda *_: p.stop.set())
    Path(out).write_text("[]")  # ready: SIGTERM now ends the pinger cleanly
    p.start()
    while not p.stop.is_set():
        time.sleep(0.05)
    p.join(5)
    Path(out).write_text(json.dumps(p.samples))


def memcpy_and_digest(values: list[tuple[str, torch.Tensor]]) -> tuple[float, float, float]:
    """(memcpy GB/s, FragmentDigest GB/s, FragmentDigest / xxh3-128 of a contiguous buffer) over the
    fragment's bytes, on this thread (one core), medians of three."""
    import xxhash

    from diloco.digest import FragmentDigest

    layout = wire.FragmentLayout.of([(n, tuple(t.shape)) for n, t in values])
    flat = torch.cat([t.reshape(-1) for _, t in values])
    dst = torch.empty_like(flat)
    nbytes = flat.numel() * 4
    part = 8 << 20

    def timed(fn: Any) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def digest() -> None:
        d = FragmentDigest(layout.names, layout.shapes)
        for a in range(0, flat.numel(), part):
            d.update(flat[a : a + part])
        d.hexdigest()

    copy_s = timed(lambda: dst.copy_(flat))
    digest_s = timed(digest)
    xxh3_s = timed(lambda: xxhash.xxh3_128_hexdigest(memoryview(flat.view(torch.uint8).numpy())))
    del flat, dst
    return nbytes / copy_s / 1e9, nbytes / digest_s / 1e9, xxh3_s / digest_s


def vm_rss(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def vm_hwm(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--data-threads", type=int, default=0, help="syncer --data-threads (0: its default)")
    ap.add_argument("--insecure", action="store_true", help="no key: plain TCP (the syncer's --insecure)")
    ap.add_argument("--syncer-args", default="", help="more syncer flags, e.g. '--part-mib 16 --outer-momentum 0.9'")
    ap.add_argument("--smoke", action="store_true", help="tiny fragment, two rounds: checks it runs (seconds)")
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        pinger_main(sys.argv[3:])
        return
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    if args.smoke:
        args.gib, args.tensors, args.rounds = 1 / 64, 4, 2
    numel = int(args.gib * 2**30 / 4) // args.tensors * args.tensors
    per = numel // args.tensors
    names = [f"decoder.layers.{i}.weight" for i in range(args.tensors)]
    g = torch.Generator().manual_seed(0)
    values = [(n, torch.randn(per, generator=g)) for n in names]
    delta = [(n, torch.randn(per, generator=g) * 1e-3) for n in names]
    nbytes = numel * 4
    print(f"fragment: {nbytes / 2**30:.2f} GiB in {args.tensors} tensors")

    memcpy_gbps, digest_gbps, digest_vs_xxh3 = memcpy_and_digest(values)
    print(f"memcpy {memcpy_gbps:.2f} GB/s, fragment digest {digest_gbps:.2f} GB/s ({digest_vs_xxh3:.3f} of xxh3)")
    wire_init = bare_wire(1, [t for _, t in values], repeat=2)
    wire_round = bare_wire(2, [t for _, t in delta], repeat=2)
    print(f"bare zmq: one island up+down {wire_init:.3f}s, two islands up+down {wire_round:.3f}s")

    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    # HMAC mode (the default a user gets with a shared key: key-derived CurveZMQ transport,
    # see docs/SECURITY.md), or --insecure (plain TCP, closed test networks only).
    key = b"" if args.insecure else b"bench-scale-key"
    env = dict(os.environ, PYTHONPATH=str(REPO), YETO_SYNC_KEY=key.decode())
    cmd = [sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:0", "--islands", "3", "--quorum", "2",
           "--grace-ms", "0", "--sync-every", "1", "--total-steps", str(args.rounds), "--checkpoint-every", "0",
           "--dead-after-s", "600", "--final-timeout-s", "120", "--join-timeout-s", "0", "--status-every-s", "2",
           "--event-log", str(tmp / "events.jsonl")]
    if args.data_threads:
        cmd += ["--data-threads", str(args.data_threads)]
    cmd += args.syncer_args.split() + (["--insecure"] if args.insecure else [])
    log_f = open(tmp / "syncer.log", "w")
    syncer = subprocess.Popen(cmd, stderr=log_f, stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"bound (tcp://\S+)", (tmp / "syncer.log").read_text())):
            assert syncer.poll() is None and time.monotonic() < deadline, (tmp / "syncer.log").read_text()
            time.sleep(0.05)
        addr = m.group(1)
        rss_idle = vm_rss(syncer.pid)  # before any island joined
        fp = "bench-scale"
        layout = wire.FragmentLayout.of([(n, (per,)) for n in names])
        clients = [SyncClient(IslandConfig(sync_addr=addr, island_id=i, key=key, sync_timeout_s=120.0,
                                           send_queue=4), fp, [layout]) for i in range(2)]
        for c in clients:
            c.wait_welcome(60)
        samples_path = tmp / "pings.json"
        pinger = subprocess.Popen([sys.executable, __file__, "--role", "pinger", addr, fp, str(numel),
                                   str(samples_path)], env=env)
        sampler = RssSampler(syncer.pid)
        sampler.start()
        t_init = time.monotonic()
        done = clients[0].send_init(0, values)
        got_cut = [False, False]
        while not all(got_cut):
            for i, c in enumerate(clients):
                if not got_cut[i] and c.wait_bcast(0.01):
                    c.take_bcasts()
                    got_cut[i] = True
                    if i == 0:
                        init_s = time.monotonic() - t_init
        assert done.wait(60)
        print(f"INIT + cut at island 0: {init_s:.3f}s")
        time.sleep(1.0)
        round_s, windows = [], []
        for t in range(1, args.rounds + 1):
            for c in clients:
                c.report_step(t)
            pulls: list[wire.Pull | None] = [None, None]
            while not all(pulls):
                for i, c in enumerate(clients):
                    if pulls[i] is None:
                        ready = c.take_ready_pulls()
                        if ready:
                            pulls[i] = ready[0]
                time.sleep(0.001)
            t0 = time.monotonic()
            for c, p in zip(clients, pulls):
                assert p is not None
                c.push(p, t - 1, 1, 1000, delta)
            got = [False, False]
            while not all(got):
                for i, c in enumerate(clients):
                    if not got[i] and c.wait_bcast(0.005):
                        b = c.take_bcasts()
                        got[i] = bool(b) and b[0].version == t
            t1 = time.monotonic()
            round_s.append(t1 - t0)
            windows.append((t0, t1))
            print(f"round {t}: push start -> BCAST at both islands {t1 - t0:.3f}s")
        rss = vm_hwm(syncer.pid)
        sampler.stop.set()
        t_rounds = windows[0][0] if windows else time.monotonic()
        rss_init = sampler.peak_between(t_init, t_rounds)
        rss_rounds = sampler.peak_between(t_rounds, time.monotonic())
        deadline = time.monotonic() + 60
        while not samples_path.exists() and pinger.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a pinger still importing would die of SIGTERM without its samples
        pinger.terminate()
        pinger.wait(30)
        ping_samples = [tuple(x) for x in json.loads(samples_path.read_text())]
        # The figures are in; the pinger never pushes or acknowledges, so stop the syncer here
        # (SIGTERM: it exits 130) instead of finalizing.
        syncer.terminate()
        code = syncer.wait(120)
        for c in clients:
            c.close(1.0)
    finally:
        if syncer.poll() is None:
            syncer.kill()
        log_f.close()
    during = [rtt for (ts, rtt) in ping_samples if any(a <= ts <= b for a, b in windows)]
    during.sort()
    p99 = during[min(len(during) - 1, int(0.99 * len(during)))] * 1e3 if during else float("nan")
    events = [json.loads(x) for x in (tmp / "events.jsonl").read_text().splitlines()]
    changed = sum(1 for e in events if e.get("changed") and not e.get("flush"))
    momentum = re.search(r"--outer-momentum[ =]([0-9.]+)", args.syncer_args)
    with_momentum = bool(momentum and float(momentum.group(1)) > 0)
    state = (3 if with_momentum else 2) * nbytes
    merges = [float(g) for g in re.findall(r"-> version \d+ .* in [0-9.]+s \(([0-9.]+) GB/s\)",
                                           (tmp / "syncer.log").read_text())]
    merge_gbps = statistics.median(merges) if merges else float("nan")
    out = {
        "heartbeat_p99_ms_during_commit": round(p99, 1),
        "heartbeats_during_commit": len(during),
        "round_vs_wire": round(statistics.median(round_s) / wire_round, 3),
        "round_s": round(statistics.median(round_s), 3),
        "wire_round_s": round(wire_round, 3),
        "init_vs_wire": round(init_s / wire_init, 3),
        "init_s": round(init_s, 3),
        "wire_init_s": round(wire_init, 3),
        "syncer_rss_over_state": round(rss / state, 3),
        "syncer_rss_over_model": round((rss - rss_idle) / nbytes, 3),
        "merge_gbps_vs_memcpy": round(merge_gbps / memcpy_gbps, 3),
        "merge_gbps": round(merge_gbps, 2),
        "memcpy_gbps": round(memcpy_gbps, 2),
        "digest_gbps": round(digest_gbps, 2),
        "digest_vs_xxh3": round(digest_vs_xxh3, 3),
        "syncer_peak_rss_gib": round(rss / 2**30, 3),
        "syncer_rss_init_gib": round(rss_init / 2**30, 3),
        "syncer_rss_rounds_gib": round(rss_rounds / 2**30, 3),
        "rounds": args.rounds,
        "rounds_changed": changed,
        "syncer_exit": code,
        "fragment_gib": round(nbytes / 2**30, 3),
        "cpus": os.cpu_count(),
        "syncer_args": args.syncer_args,
        "mode": "insecure" if args.insecure else "hmac",
        "smoke": args.smoke,
    }
    print(f"syncer log: {tmp / 'syncer.log'}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Benchmarks of the island data path (export / apply), each against a baseline measured in the same run.

World 4 (TP2 x DP2, DistributedOptimizer, bf16) real megatron-core GPTModel on CPU/gloo, forked ranks.

(a) ``apply_bytes_per_fragment_byte``: fragment bytes the sync rank hands out
    per applied fragment byte (each element leaves it once: target 1.0), and
    ``apply_network_bytes_per_fragment_byte`` (the part that went over the
    network; the rest the sync rank owns itself). ``apply_vs_world_broadcast``:
    our apply (data path, no model refresh) time / a world broadcast of the
    whole fragment's bytes (target <= 0.5); ``apply_with_refresh_s`` also
    includes the DP all-gather that refreshes the bf16 model copy.
(b) ``export_vs_gloo_p2p`` / ``apply_vs_gloo_p2p``: our throughput / raw gloo
    isend-irecv throughput of the very same per-peer byte counts into
    preallocated buffers (no packing, no assembly); target >= 0.8.
    ``refresh_fragment_s`` / ``refresh_all_s``: the model-copy refresh after an
    apply (DP all-gather) of only the smallest fragment's buckets vs the whole model
    (equal here: without overlapped grad reduce megatron keeps one DDP bucket, so a
    fragment's buckets are the whole model; jobs with bucketed DDP gather less).

(c) ``init_vs_max_gather_send``: INIT wall time (island start-up streaming every
    fragment to a syncer whose link is throttled to about the island's gather
    speed) / max(gather alone, send alone); target <= 1.15 (1.0 = perfect
    overlap, 2.0 = no overlap).
(d) ``idle_boundary_p50_ms``: p50 of a step boundary with nothing to do, vs
    ``gloo_barrier_p50_ms`` on the same group.
(e) ``push_blocked_vs_copy``: training-thread time a push costs (snapshot + hand-off
    to the background worker; the delta and the gather run in the background) / a
    plain copy of the same bytes (the rank's share of the fragment) on the masters'
    device; target <= 1.5. ``apply_blocked_vs_copy``: the same for an apply (the
    progress-preserving install of a fragment staged in the background, without the
    model-copy refresh, reported as ``apply_refresh_vs_copy``); target <= 2.0. The
    slowest rank counts. Host-blocked time: on CUDA our copies are async (not
    synchronized), the baseline copy is synchronized.

Usage::

    python benchmarks/bench_island.py [--hidden 1024] [--layers 4] [--repeat 5] [--device cuda]

Human-readable lines first; the last line printed is one JSON object with the
figures (the lead adds (c) INIT overlap and (d) idle boundary as more
functions collected by ``main``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import zmq  # noqa: E402

warnings.filterwarnings("ignore")
from diloco.demo.gpt import ModelSpec, build_island_model  # noqa: E402
from diloco.demo.ranks import run_ranks  # noqa: E402

log = logging.getLogger("bench_island")


def _timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of `fn` over `repeat` runs, each started together on every rank."""
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _raw_p2p(counts: dict[int, int], to_sync: bool, repeat: int) -> float:
    """Raw gloo p2p of the same per-peer element counts between rank 0 and each peer."""
    me = dist.get_rank()
    bufs = {peer: torch.ones(n, dtype=torch.float32) for peer, n in counts.items()}

    def run() -> None:
        works = []
        if me == 0:
            for peer, buf in sorted(bufs.items()):
                works.append(dist.irecv(buf, src=peer) if to_sync else dist.isend(buf, dst=peer))
        elif me in bufs:
            works.append(dist.isend(bufs[me], dst=0) if to_sync else dist.irecv(bufs[me], src=0))
        for w in works:
            w.wait()

    return _timed(run, repeat)


def bench_export_apply(rank: int, world: int, spec_kw: dict[str, Any], repeat: int) -> dict[str, float]:
    """Parts (a) and (b); runs on every rank, rank 0's dict is the result."""
    from diloco.island.transfer import FragmentTransfer
    from diloco.plan import make_plan

    spec = ModelSpec(**spec_kw)
    built = build_island_model(spec, tp=2, pp=1)
    layout = built.layout()
    plan = make_plan(layout.specs(), spec.layers)
    xfer = FragmentTransfer(layout, plan, dist.group.WORLD)
    f = 0
    nbytes = plan.nbytes(f)
    route = xfer._routes[f]
    export_counts = {src: sum(s.n for s, _ in items) for src, items in route.export.items() if src != 0}
    apply_counts = {dst: sum(s.n for s, _ in items) for dst, items in route.apply.items() if dst != 0}
    values = xfer.export_fragment(f, delta=False)

    t_export = _timed(lambda: xfer.export_fragment(f, delta=False), repeat)
    t_raw_export = _raw_p2p(export_counts, True, repeat)
    sent = [0]

    def apply(refresh: bool) -> None:
        sent[0] = xfer.apply_fragment(f, values if rank == 0 else None, refresh=refresh)

    t_apply = _timed(lambda: apply(False), repeat)
    network = xfer.last_apply_network_bytes
    t_apply_refresh = _timed(lambda: apply(True), repeat)
    t_raw_apply = _raw_p2p(apply_counts, False, repeat)
    # Model-copy refresh after an apply: only the applied fragment's DDP buckets vs the whole model.
    small = min(range(plan.n_fragments), key=plan.nbytes)
    t_refresh_fragment = _timed(lambda: xfer.refresh([small]), repeat)
    t_refresh_all = _timed(lambda: layout.refresh_model_params(), repeat)
    flat = torch.zeros(nbytes // 4, dtype=torch.float32)
    t_bcast = _timed(lambda: dist.broadcast(flat, src=0), repeat)
    return {
        "fragment_mb": nbytes / 1e6,
        "apply_bytes_per_fragment_byte": sent[0] / nbytes,
        "apply_network_bytes_per_fragment_byte": network / nbytes,
        "apply_s": t_apply,
        "apply_with_refresh_s": t_apply_refresh,
        "world_broadcast_s": t_bcast,
        "apply_vs_world_broadcast": t_apply / t_bcast,
        "export_s": t_export,
        "export_gbps": nbytes / t_export / 1e9,
        "apply_gbps": nbytes / t_apply / 1e9,
        "refresh_fragment_mb": plan.nbytes(small) / 1e6,
        "refresh_fragment_s": t_refresh_fragment,
        "refresh_all_s": t_refresh_all,
        "export_vs_gloo_p2p": t_raw_export / t_export,
        "apply_vs_gloo_p2p": t_raw_apply / t_apply,
    }


class _ThrottledSyncer(threading.Thread):
    """A scripted syncer whose link absorbs INIT bytes at ``rate`` bytes/s (sleeps per message)."""

    def __init__(self, n_fragments: int) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.n = n_fragments
        self.rate = 1e12
        self.absorbed = 0
        self.done = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        from diloco import wire

        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, *frames = self.sock.recv_multipart(copy=False)
            msg = wire.decode(frames)
            if isinstance(msg.header, wire.Hello):
                welcome = wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=1, need_init=True,
                                       versions=(0,) * self.n, sync_every=100, total_steps=0,
                                       generation=msg.header.generation, nonce=1)
                self.sock.send_multipart([peer.bytes, *wire.encode(welcome, nonce=1, seq=1)])
            elif isinstance(msg.header, wire.Init):
                time.sleep(wire.payload_bytes(msg) / self.rate)
                if msg.header.part == msg.header.n_parts - 1:  # a fragment travels as parts
                    self.absorbed += 1
                if self.absorbed == self.n:
                    self.done.set()
        self.sock.close()
        self.ctx.term()


def bench_init_and_idle(rank: int, world: int, spec_kw: dict[str, Any], idle_steps: int) -> dict[str, float]:
    """Parts (c) and (d); runs on every rank, rank 0's dict is the result."""
    from diloco.config import IslandConfig
    from diloco.island.boundary import Island
    from diloco.island.client import SyncClient
    from diloco.island.lifecycle import fragment_layouts

    spec = ModelSpec(**spec_kw)
    built = build_island_model(spec, tp=2, pp=1)
    syncer = None
    addr = "tcp://127.0.0.1:1"  # only the sync rank connects
    if rank == 0:
        syncer = _ThrottledSyncer(spec.layers)
        syncer.start()
        addr = syncer.addr
    cfg = IslandConfig(sync_addr=addr, island_id=0, fragments=spec.layers, initial_cut_timeout_s=0.0,
                       heartbeat_s=1.0)
    island = Island(cfg, built.layout())
    n = island.plan.n_fragments
    total = sum(island.plan.nbytes(f) for f in range(n))

    # Gather alone: every fragment exported to the sync rank, nothing sent.
    dist.barrier()
    t0 = time.perf_counter()
    held = [island.transfer.export_fragment(f, delta=False) for f in range(n)]
    dist.barrier()
    t_gather = time.perf_counter() - t0
    t_send = 0.0
    if syncer is not None:
        # Throttle the link to the gather speed: the case where overlap matters most.
        syncer.rate = total / t_gather
        client = SyncClient(cfg, island.fingerprint, fragment_layouts(island.plan))
        client.wait_welcome(30)
        sends = []
        for _ in range(2):  # the first pass also warms the receiver's buffers: keep the best
            t0 = time.perf_counter()
            for f in range(n):
                client.send_init(f, held[f])
            syncer.done.wait(300)
            sends.append(time.perf_counter() - t0)
            syncer.absorbed = 0
            syncer.done.clear()
        t_send = min(sends)
        client.close()
    del held
    dist.barrier()
    t0 = time.perf_counter()
    island.start()
    if syncer is not None:
        syncer.done.wait(300)
    t_init = time.perf_counter() - t0

    # Idle boundaries vs a gloo barrier on the same group.
    idle, barrier = [], []
    for step in range(1, idle_steps + 1):
        t0 = time.perf_counter()
        island.step_end(step)
        idle.append(time.perf_counter() - t0)
    for _ in range(idle_steps):
        t0 = time.perf_counter()
        dist.barrier(group=island.group)
        barrier.append(time.perf_counter() - t0)
    if island.client is not None:
        island.client.close(linger_s=0.2)
    if syncer is not None:
        syncer.stop.set()
        syncer.join(5)
    return {
        "init_total_mb": total / 1e6,
        "init_gather_s": t_gather,
        "init_send_s": t_send,
        "init_s": t_init,
        "init_vs_max_gather_send": t_init / max(t_gather, t_send),
        "idle_boundary_p50_ms": 1e3 * statistics.median(idle),
        "gloo_barrier_p50_ms": 1e3 * statistics.median(barrier),
    }


def bench_push_apply(rank: int, world: int, spec_kw: dict[str, Any], repeat: int, device: str) -> dict[str, float]:
    """Part (e); runs on every rank, the figures are the slowest rank's."""
    from datetime import timedelta

    from diloco.island.background import Background
    from diloco.island.datapath import DataPath
    from diloco.island.transfer import FragmentTransfer
    from diloco.plan import make_plan
    from gloo_bridge import device as dev

    if device == "cuda":
        dev.set_current_device(0)
        # The ranks run on gloo: CUDA tensors must go through the bridge's host staging (gloo
        # handed a raw CUDA tensor crashes the process), as in a job without NCCL across nodes.
        import gloo_bridge

        gloo_bridge.install(ranks_per_node=1)
    spec = ModelSpec(**spec_kw)
    built = build_island_model(spec, tp=2, pp=1, device=device)
    layout = built.layout()
    plan = make_plan(layout.specs(), spec.layers)
    xfer = FragmentTransfer(layout, plan, dist.group.WORLD)
    data = DataPath(xfer, dist.new_group(backend="gloo", timeout=timedelta(seconds=300)))
    bg = Background("bench-data", 1, 300.0)
    f = 0
    values = xfer.export_fragment(f, delta=False)
    xfer.apply_fragment(f, values if rank == 0 else None)
    masters = [p.master for i, p in enumerate(xfer._pieces) if i in data._mine[f]]
    dsts = [torch.empty_like(m) for m in masters]

    def plain_copy() -> None:
        for d, m in zip(dsts, masters):
            d.copy_(m)
        if masters:
            dev.synchronize(masters[0].device)

    def host_time(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    pushes, applies, refreshes, copies = [], [], [], []
    for _ in range(repeat + 1):
        dist.barrier()
        copies.append(host_time(plain_copy))
        dist.barrier()
        pushes.append(host_time(lambda: (data.snapshot(f), bg.submit("push", "push", lambda: data.gather_delta(f)))))
        bg.submit("stage", "stage", lambda: data.stage(f, values if rank == 0 else None, True))
        assert bg.drain(300) and bg.error is None, bg.error
        dist.barrier()
        applies.append(host_time(lambda: data.install(f, "progress")))
        dist.barrier()
        refreshes.append(host_time(lambda: xfer.refresh([f])))
    bg.close()
    med = [statistics.median(x[1:]) for x in (pushes, applies, refreshes, copies)]  # the first run warms up
    # The island waits for its slowest rank: compare the slowest rank's times.
    worst = torch.tensor([*med, data.share_nbytes(f)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    push_s, apply_s, refresh_s, copy_s, share = (float(x) for x in worst)
    return {
        "largest_share_mb": share / 1e6,
        "plain_copy_s": copy_s,
        "push_blocked_s": push_s,
        "apply_blocked_s": apply_s,
        "apply_refresh_s": refresh_s,
        "push_blocked_vs_copy": push_s / copy_s,
        "apply_blocked_vs_copy": apply_s / copy_s,
        "apply_refresh_vs_copy": refresh_s / copy_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--idle-steps", type=int, default=200)
    ap.add_argument("--only", choices=("ab", "cd", "e"), default=None, help="run only parts (a, b), (c, d) or (e)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the masters live, part (e)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: the test suite runs it")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.repeat, args.idle_steps = 64, 2, 1, 5
    logging.basicConfig(level=logging.WARNING)
    spec = ModelSpec(
        vocab=32000, hidden=args.hidden, layers=args.layers, heads=16, query_groups=4,
        ffn=4 * args.hidden, seq=16,
    )
    figures: dict[str, float] = {}
    ab = {} if args.only in ("cd", "e") else run_ranks(4, bench_export_apply, spec.__dict__, args.repeat, timeout_s=590)[0]
    for k, v in ab.items():
        print(f"{k:40s} {v:.4g}")
    figures.update(ab)
    cd = {} if args.only in ("ab", "e") else run_ranks(4, bench_init_and_idle, spec.__dict__, args.idle_steps, timeout_s=590)[0]
    for k, v in cd.items():
        print(f"{k:40s} {v:.4g}")
    figures.update(cd)
    e = {} if args.only in ("ab", "cd") else run_ranks(4, bench_push_apply, spec.__dict__, args.repeat, args.device,
                                                        timeout_s=590)[0]
    for k, v in e.items():
        print(f"{k:40s} {v:.4g}")
    figures.update(e)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

"""Benchmark of the gloo bridge: bridged device collectives vs plain gloo on CPU tensors.

What it measures, in one run on one host, 2 processes, every group bridged
(``YETO_RANKS_PER_NODE=1``):
- ``broadcast``, ``all_reduce`` and a ``send``/``recv`` ping-pong on a bridged
  group with CUDA tensors (through pinned host staging), against the same gloo
  op on CPU tensors of the same size called on torch's original functions (the
  baseline). Ratio ``bridged_time / cpu_time``; the target is <= 1.15.
- Host staging copies: a device -> host -> device round trip through a pinned
  buffer vs a pageable one. ``pinned_vs_pageable`` = pageable_time /
  pinned_time (= pinned throughput / pageable throughput; > 1 means pinned wins).
On a CPU-only machine the CUDA figures are null and the staging path is timed
with CPU tensors forced through it (``staged_cpu_vs_cpu_gloo``), to show the
bridge's own overhead.

The last line printed is one JSON object (keys: ``bridged_cuda_vs_cpu_gloo``,
``pinned_vs_pageable``, ``staged_cpu_vs_cpu_gloo`` and per-op figures).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gloo_bridge  # noqa: E402
from gloo_bridge import device  # noqa: E402

OPS = ("broadcast", "all_reduce", "sendrecv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_op(run: Callable[[], None], iters: int, warmup: int, group: dist.ProcessGroup,
             orig_barrier: Callable[..., Any], orig_all_reduce: Callable[..., Any]) -> float:
    """Seconds per call, the slowest rank's figure."""
    for _ in range(warmup):
        run()
    orig_barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    orig_all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def _op_runner(op: str, tensor: torch.Tensor, rank: int, group: dist.ProcessGroup,
               fns: dict[str, Callable[..., Any]]) -> Callable[[], None]:
    if op == "broadcast":
        return lambda: fns["broadcast"](tensor, src=0, group=group)
    if op == "all_reduce":
        return lambda: fns["all_reduce"](tensor, group=group)

    def ping_pong() -> None:
        if rank == 0:
            fns["send"](tensor, dst=1, group=group)
            fns["recv"](tensor, src=1, group=group)
        else:
            fns["recv"](tensor, src=0, group=group)
            fns["send"](tensor, dst=0, group=group)
    return ping_pong


def _staging_round_trip(nbytes: int, pinned: bool, iters: int) -> float:
    """Seconds for one device -> host -> device copy of ``nbytes`` (current device)."""
    dev_t = torch.empty(nbytes, dtype=torch.uint8, device=device.current_device())
    host = device.host_buffer(nbytes, pinned)
    for _ in range(2):
        host.copy_(dev_t, non_blocking=pinned)
        dev_t.copy_(host, non_blocking=pinned)
    device.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        host.copy_(dev_t, non_blocking=pinned)
        device.synchronize_stream(dev_t.device)  # gloo would read the host copy now
        dev_t.copy_(host, non_blocking=pinned)
    device.synchronize()
    return (time.perf_counter() - t0) / iters


def _worker(rank: int, port: int, sizes_mb: list[int], iters: int, out: Any) -> None:
    os.environ["YETO_RANKS_PER_NODE"] = "1"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.set_num_threads(4)
    has_cuda = torch.cuda.is_available()
    gloo_bridge.install(stage_cpu_tensors=not has_cuda)
    if has_cuda:
        device.set_current_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if has_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    group = dist.new_group([0, 1])
    orig = {n: getattr(dist, n).__wrapped__ for n in ("broadcast", "all_reduce", "send", "recv", "barrier")}
    bridged = {n: getattr(dist, n) for n in ("broadcast", "all_reduce", "send", "recv")}
    results: dict[str, Any] = {"sizes_mb": sizes_mb, "per_op": {}}
    for mb in sizes_mb:
        numel = mb * (1 << 20) // 4
        for op in OPS:
            cpu_t = torch.ones(numel)
            t_cpu = _time_op(_op_runner(op, cpu_t, rank, group, orig), iters, 2, group, orig["barrier"],
                             orig["all_reduce"])
            # CUDA tensors (or, on CPU machines, CPU tensors forced through staging) via the bridge.
            dev_t = torch.ones(numel, device=device.current_device())
            t_bridged = _time_op(_op_runner(op, dev_t, rank, group, bridged), iters, 2, group, orig["barrier"],
                                 orig["all_reduce"])
            results["per_op"][f"{op}_{mb}MiB"] = {"cpu_gloo_ms": t_cpu * 1e3, "bridged_ms": t_bridged * 1e3,
                                                  "ratio": t_bridged / t_cpu}
    if has_cuda and rank == 0:
        nbytes = max(sizes_mb) << 20
        t_pin = _staging_round_trip(nbytes, True, iters)
        t_page = _staging_round_trip(nbytes, False, iters)
        results["staging"] = {"bytes": nbytes, "pinned_gbps": 2 * nbytes / t_pin / 1e9,
                              "pageable_gbps": 2 * nbytes / t_page / 1e9, "pinned_vs_pageable": t_page / t_pin}
    results["cuda"] = has_cuda
    results["device"] = torch.cuda.get_device_name() if has_cuda else "cpu"
    results["torch"] = torch.__version__
    dist.destroy_process_group()
    gloo_bridge.uninstall()
    if rank == 0:
        out.put(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="4,64", help="comma-separated tensor sizes in MiB (fp32)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per op (after 2 warm-ups)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (1 MiB, 1 iteration): checks the benchmark runs")
    args = parser.parse_args()
    if args.smoke:
        args.sizes_mb, args.iters = "1", 1
    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, sizes, args.iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    res = queue.get(timeout=540)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    print(f"device={res['device']} torch={res['torch']} (2 processes, 1 host, every group bridged)")
    print(f"{'op':<22}{'cpu gloo ms':>14}{'bridged ms':>14}{'ratio':>8}")
    for name, f in res["per_op"].items():
        print(f"{name:<22}{f['cpu_gloo_ms']:>14.2f}{f['bridged_ms']:>14.2f}{f['ratio']:>8.3f}")
    largest = max(sizes)
    big = [f for n, f in res["per_op"].items() if n.endswith(f"_{largest}MiB")]
    overall = sum(f["bridged_ms"] for f in big) / sum(f["cpu_gloo_ms"] for f in big)
    worst = max(f["ratio"] for f in big)
    summary: dict[str, Any] = {
        "bridged_cuda_vs_cpu_gloo": overall if res["cuda"] else None,
        "bridged_cuda_vs_cpu_gloo_worst_op": worst if res["cuda"] else None,
        "staged_cpu_vs_cpu_gloo": None if res["cuda"] else overall,
        "pinned_vs_pageable": res.get("staging", {}).get("pinned_vs_pageable"),
        "pinned_vs_pageable_means": "pageable_time / pinned_time of a device->host->device staging round trip",
        "pinned_gbps": res.get("staging", {}).get("pinned_gbps"),
        "pageable_gbps": res.get("staging", {}).get("pageable_gbps"),
        "ratio_means": f"bridged_time / cpu_gloo_time, summed over ops at {largest} MiB",
        "per_op": {n: {k: round(v, 4) for k, v in f.items()} for n, f in res["per_op"].items()},
        "device": res["device"],
        "torch": res["torch"],
    }
    if "staging" in res:
        print(f"staging round trip {res['staging']['bytes'] >> 20} MiB: pinned {summary['pinned_gbps']:.1f} GB/s, "
              f"pageable {summary['pageable_gbps']:.1f} GB/s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

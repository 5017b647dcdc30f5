"""The syncer's data plane folding two islands' pushes alone: no network, no islands (device probe).

    python scripts/probe_fold.py [--gib 2.5] [--part-mib 16] [--data-threads 4] [--rounds 3] [--smoke]

Real push messages (``wire.encode`` of two islands' deltas, opened as the loop opens them) are
folded by a real :class:`~diloco.syncer.dataplane.DataPlane` with the robust bounds the syncer
passes (a reference RMS, so every chunk is bounded and its squares summed), in the loop's order:
island 0's part ``k``, then island 1's, part by part, with at most ``--backlog-mib`` of parts
queued (the loop's cap). Each round folds into a fresh sum, as the syncer's rounds do
(``book.fresh``), and one more round into a sum already resident shows what the fresh pages cost.
A memcpy of the same bytes in this process is the yardstick.

Prints per round the fold GB/s (pushed bytes over the wall from the first submit to the last
result) and each worker's CPU share; the last line is one JSON object. If the data plane alone
folds far faster than the syncer takes in pushes in a real run (1.6 GB/s from two 2.7B islands,
docs/PERFORMANCE.md, session 25), the limit is upstream of it: the loop, the sockets or the islands.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from diloco import wire  # noqa: E402
from diloco.syncer.core.robust import Reference  # noqa: E402
from diloco.syncer.core.work import FoldPart, Result, RoundSum  # noqa: E402
from diloco.syncer.dataplane import DataPlane  # noqa: E402
from profile_syncer import thread_times  # noqa: E402

log = logging.getLogger("probe_fold")
ISLANDS = 2


def encoded_pushes(deltas: list[torch.Tensor], layout: wire.FragmentLayout, part_elems: int) -> list[list[list]]:
    """Per island, per part: the frames of its PUSH message (views of the delta: no copy)."""
    n_parts = layout.n_parts(part_elems)
    return [[wire.encode(wire.Push(island=i, generation=1, fragment=0, round=1, attempt=0, base_version=0,
                                   local_steps=16, tokens=1000 + i, part=k, n_parts=n_parts),
                         layout.slice_part([("w", d)], k, part_elems))
             for k in range(n_parts)] for i, d in enumerate(deltas)]


def fold_round(plane: DataPlane, results: queue.SimpleQueue, pushes: list[list[list]], flat: torch.Tensor,
               layout: wire.FragmentLayout, part_elems: int, backlog_bytes: int, ref: Reference,
               round_: int) -> tuple[float, int]:
    """Fold every part of every island into ``flat`` as the loop dispatches them; (seconds, bytes)."""
    n_parts = layout.n_parts(part_elems)
    rs = RoundSum(round_, 0, 0, flat, n_parts)
    order = [(i, k) for k in range(n_parts) for i in range(ISLANDS)]
    done = nbytes = 0
    t0 = time.perf_counter()
    for i, k in order:
        opened = wire.open_message(pushes[i][k])
        while plane.backlog_bytes + opened.nbytes > backlog_bytes and plane.backlog_bytes > 0:
            r: Result = results.get(timeout=60)
            if r.error:
                raise SystemExit(f"fold refused: {r.error}")
            done += 1
        lo, hi = layout.part_range(k, part_elems)
        bound = ref.bound(0, round_, i, hi - lo, 64.0, 8.0, steps=16)
        plane.submit(FoldPart(rs, k, lo, opened, 1000 + i, i, None, hi - lo, bound))
        nbytes += opened.nbytes
    while done < len(order):
        r = results.get(timeout=60)
        if r.error:
            raise SystemExit(f"fold refused: {r.error}")
        done += 1
    return time.perf_counter() - t0, nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.5, help="fragment size (each island pushes one)")
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--data-threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="rounds into fresh sums (then one into a resident one)")
    ap.add_argument("--backlog-mib", type=int, default=128, help="parts queued at most (the loop's cap)")
    ap.add_argument("--smoke", action="store_true", help="32 MiB, 1 MiB parts, one fresh round: checks it runs")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.smoke:
        a.gib, a.part_mib, a.rounds, a.data_threads = 1 / 32, 1, 1, 2
    torch.set_num_threads(1)
    numel = int(a.gib * 2**30) // 4
    part_elems = (a.part_mib << 20) // 4
    layout = wire.FragmentLayout.of([("w", (numel,))])
    gen = torch.Generator().manual_seed(5)
    deltas = [torch.randn(numel, generator=gen).mul_(1e-3) for _ in range(ISLANDS)]
    pushes = encoded_pushes(deltas, layout, part_elems)
    ref = Reference()
    for i in range(ISLANDS):  # a reference from an earlier round: the fold bounds every chunk and sums squares
        ref.sink(0, 0, i, numel, 16)(1e-3 * math.sqrt(numel) * 16)
    results: queue.SimpleQueue[Result] = queue.SimpleQueue()
    plane = DataPlane(a.data_threads, results.put)
    workers = {t.native_id: t.name for t in threading.enumerate() if t.name.startswith("yeto-")}
    rows = []
    try:
        flat = torch.empty(0)
        for r in range(a.rounds + 1):
            fresh = r < a.rounds
            if fresh:
                flat = torch.empty(numel)  # a new sum, as each round's in the syncer: its pages come as it is folded
            c0 = thread_times(os.getpid())
            seconds, nbytes = fold_round(plane, results, pushes, flat, layout, part_elems,
                                         a.backlog_mib << 20, ref, r + 1)
            c1 = thread_times(os.getpid())
            busy = {workers[int(t)]: round((c1[t][1] - c0[t][1]) / seconds, 2)
                    for t in c1 if t in c0 and int(t) in workers}
            rows.append({"fresh": fresh, "gbps": round(nbytes / seconds / 1e9, 3), "seconds": round(seconds, 3),
                         "busy": busy})
            print(f"round {r + 1}: {'fresh' if fresh else 'resident'} sum, {nbytes / 2**30:.2f} GiB folded in "
                  f"{seconds:.3f}s ({nbytes / seconds / 1e9:.2f} GB/s); workers busy {busy}", flush=True)
    finally:
        plane.close()
    expect = (deltas[0] * 1000 + deltas[1] * 1001)[: min(numel, 1 << 20)]
    exact = torch.allclose(flat[: expect.numel()], expect, rtol=1e-6, atol=0.0)
    src = torch.randn(numel, generator=gen)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    memcpy_gbps = numel * 4 / (time.perf_counter() - t0) / 1e9
    fresh_rows = [r["gbps"] for r in rows if r["fresh"]]
    print(json.dumps({"fold_gbps_fresh": round(min(fresh_rows), 3), "fold_gbps_fresh_best": round(max(fresh_rows), 3),
                      "fold_gbps_resident": rows[-1]["gbps"], "memcpy_gbps": round(memcpy_gbps, 3),
                      "sum_matches": bool(exact), "gib": a.gib, "part_mib": a.part_mib,
                      "data_threads": a.data_threads, "rounds": rows, "smoke": a.smoke}))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks of the sync data path, each against a baseline measured in the same run.

(a) ``wire_vs_zmq``: a fragment of fp32 tensors travels island (DEALER) ->
    syncer (ROUTER) -> island through ``diloco.wire`` (encode, zero-copy
    send, receive, validate + decode, and the same back), versus the very same
    bytes in the very same frame sizes over a bare DEALER/ROUTER pair that
    neither hashes, authenticates nor copies.  Ratio = bare_time / wire_time
    (higher is better; 1.0 means the protocol costs nothing; target >= 0.8).

(b) ``merge_vs_numpy``: the syncer's merge + outer Nesterov step
    (the syncer's data plane: verify, fold, outer step, digests) on a 128 MiB fragment with 4 islands'
    deltas, versus the same arithmetic as numpy in-place ufuncs; the two
    must agree bit for bit. Ratio = numpy_time / ours_time (target >= 1.0: folding each chunk
    while it is in cache, and the outer step over cache blocks, beat whole-array ufuncs).

Usage::

    python benchmarks/bench_wire.py [--mib 256] [--merge-mib 128] [--repeat 5] [--smoke]

Human-readable lines first; the last line printed is one JSON object with the
figures (``main()`` collects them from the ``bench_*`` functions, so further
benchmarks add a function and one line in ``main``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import zmq

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco import wire  # noqa: E402

log = logging.getLogger("bench_wire")

_KEY = b"bench-shared-key"
_RECV_TIMEOUT_MS = 120_000  # a hung peer turns into an error, not a stuck benchmark


def _fragment(total_mib: int, n_tensors: int = 4) -> list[tuple[str, torch.Tensor]]:
    """``n_tensors`` fp32 tensors of ``total_mib`` MiB in all (2-D, like weight matrices)."""
    numel = (total_mib << 20) // 4 // n_tensors
    cols = 1024
    rows = max(1, numel // cols)
    gen = torch.Generator().manual_seed(0)
    return [(f"decoder.layers.{i}.mlp.weight", torch.randn(rows, cols, generator=gen)) for i in range(n_tensors)]


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """A bound ROUTER (syncer side) and a connected DEALER (island side) on a free port."""
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, _RECV_TIMEOUT_MS)
        s.setsockopt(zmq.SNDTIMEO, _RECV_TIMEOUT_MS)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def _serve(router: zmq.Socket, rounds: int, handle: Callable[[list[zmq.Frame]], list]) -> threading.Thread:
    """Run the syncer side in a thread: receive ``rounds`` messages, answer each with ``handle``."""
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            for _ in range(rounds):
                ident, *frames = router.recv_multipart(copy=False)
                router.send_multipart([ident, *handle(frames)], copy=False)
        except BaseException as exc:  # reported by the caller through .errors
            errors.append(exc)

    thread = threading.Thread(target=loop, name="bench-syncer", daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def _recv(dealer: zmq.Socket, server: threading.Thread) -> list:
    """One reply, failing fast with the syncer side's own error instead of waiting out the timeout."""
    deadline = time.monotonic() + _RECV_TIMEOUT_MS / 1000
    while not dealer.poll(100):
        if server.errors:  # type: ignore[attr-defined]
            raise server.errors[0]  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError("no reply from the syncer side")
    return dealer.recv_multipart(copy=False)


def bench_wire_vs_zmq(mib: int = 256, repeat: int = 5, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
                      part_mib: int = 32) -> dict:
    """Round trip of a ``mib`` MiB fp32 fragment through the protocol vs bare zmq.

    The fragment travels as the syncer's parts of ``part_mib`` MiB, one message each (a single
    message of a whole fragment is above ``Limits.max_message_bytes`` and is refused, as it is by
    the syncer); the bare baseline sends exactly the same frames. Both legs run in one process
    (syncer side in a thread), alternating bare and protocol rounds so that background load hits
    both alike; the figure is the ratio of medians.
    """
    tensors = _fragment(mib)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    layout = wire.FragmentLayout.of([(n, tuple(t.shape)) for n, t in tensors])
    part_elems = (part_mib << 20) // 4
    n_parts = layout.n_parts(part_elems)
    pushes = [wire.Push(island=0, generation=1, fragment=0, round=1, attempt=0, base_version=0, local_steps=10,
                        tokens=1, part=k, n_parts=n_parts) for k in range(n_parts)]
    parts = [layout.slice_part(tensors, k, part_elems) for k in range(n_parts)]
    bcast = wire.Bcast(fragment=0, version=1, round=1, cut=False)

    # The bare baseline sends exactly the frames the protocol would (same count and sizes).
    templates = [wire.encode(h, p, key=_KEY, chunk_bytes=chunk_bytes) for h, p in zip(pushes, parts)]
    bare_msgs = [[bytes(t[0]), bytes(t[1]), *t[2:]] for t in templates]

    ctx = zmq.Context()
    try:
        router, dealer = _pair(ctx)

        def syncer_side(frames: list[zmq.Frame]) -> list:
            msg = wire.decode(frames, key=_KEY)
            return wire.encode(bcast, msg.tensors, key=_KEY, chunk_bytes=chunk_bytes)

        def echo_side(frames: list[zmq.Frame]) -> list:
            return frames

        def wire_round(server: threading.Thread) -> list:
            back = []
            for h, p in zip(pushes, parts):
                dealer.send_multipart(wire.encode(h, p, key=_KEY, chunk_bytes=chunk_bytes), copy=False)
                back.append(wire.decode(_recv(dealer, server), key=_KEY))
            return back

        def bare_round(server: threading.Thread) -> list:
            for frames in bare_msgs:
                dealer.send_multipart(frames, copy=False)
                if len(_recv(dealer, server)) != len(frames):
                    raise RuntimeError("bare echo lost frames")
            return []

        # Correctness first (untimed): what comes back is bit-identical.
        server = _serve(router, n_parts, syncer_side)
        back = wire_round(server)
        server.join()
        got = torch.cat([t.reshape(-1) for m in back for _, t in m.tensors])
        if not torch.equal(got, torch.cat([t.reshape(-1) for _, t in tensors])):
            raise RuntimeError("round trip changed the fragment")

        bare_times: list[float] = []
        wire_times: list[float] = []
        plan = [("bare", echo_side, bare_round, []), ("wire", syncer_side, wire_round, [])]  # warm-up
        for _ in range(repeat):
            plan += [("bare", echo_side, bare_round, bare_times), ("wire", syncer_side, wire_round, wire_times)]
        for _label, handler, runner, sink in plan:
            server = _serve(router, n_parts, handler)
            t0 = time.perf_counter()
            runner(server)
            sink.append(time.perf_counter() - t0)
            server.join()
            if server.errors:  # type: ignore[attr-defined]
                raise server.errors[0]  # type: ignore[attr-defined]
    finally:
        ctx.destroy(linger=0)

    bare = statistics.median(bare_times)
    ours = statistics.median(wire_times)
    gib = 2 * nbytes / (1 << 30)  # both directions
    print(f"wire (a): {mib} MiB fp32 fragment, {len(tensors)} tensors, {n_parts} parts of {part_mib} MiB, chunks of "
          f"{chunk_bytes >> 20} MiB, island -> syncer -> island, median of {repeat}")
    print(f"  bare zmq DEALER/ROUTER : {bare * 1e3:8.1f} ms  ({gib / bare:6.2f} GiB/s)")
    print(f"  diloco.wire            : {ours * 1e3:8.1f} ms  ({gib / ours:6.2f} GiB/s)")
    print(f"  wire_vs_zmq (bare/ours): {bare / ours:.3f}  (target >= 0.8)")
    return {
        "wire_vs_zmq": round(bare / ours, 4),
        "wire_ms": round(ours * 1e3, 2),
        "bare_zmq_ms": round(bare * 1e3, 2),
        "wire_mib": mib,
    }


def bench_merge_vs_numpy(mib: int = 128, islands: int = 4, repeat: int = 5, part_mib: int = 32) -> dict:
    """(b) ``merge_vs_numpy``: the syncer's merge + outer Nesterov step vs memory-bound numpy.

    One fp32 fragment of ``mib`` MiB (value, momentum) and ``islands`` fp32
    deltas; ours is the syncer's data-plane work on one thread, part by part
    (32 MiB parts): each island's PUSH parts verified (xxh3) and folded into the
    running sum, then the outer step written out of place into the sum (which
    becomes the value; the old value is the next sum, as in the syncer) and the
    fp32 broadcast payload digested; the baseline is the merge arithmetic alone
    as numpy in-place ufuncs on preallocated arrays. Both start from the same
    state and must agree bit for bit. Ratio = numpy_time / ours_time (target >= 0.5).
    """
    import numpy as np

    from diloco import wire
    from diloco.outer import OuterHyper
    from diloco.syncer.dataplane import CommitPart, FoldPart, RoundSum, run_work

    numel = (mib << 20) // 4
    gen = torch.Generator().manual_seed(1)
    value0 = torch.randn(numel, generator=gen)
    deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in range(islands)]
    weights = [1000 + 17 * i for i in range(islands)]
    hyper = OuterHyper(lr=0.7, momentum=0.9)  # the full Nesterov step: the most work per element
    part_elems = (part_mib << 20) // 4
    layout = wire.FragmentLayout.of([("w", (numel,))])
    n_parts = layout.n_parts(part_elems)
    pushes = [[wire.open_message(wire.encode(wire.Push(island=i, generation=1, fragment=0, round=1, attempt=0,
                                                        base_version=0, local_steps=1, tokens=w, part=k,
                                                        n_parts=n_parts),
                                             layout.slice_part([("w", d)], k, part_elems)))
               for k in range(n_parts)] for i, (d, w) in enumerate(zip(deltas, weights))]
    state = {"value": value0.clone(), "spare": torch.empty(numel)}
    mom = torch.zeros(numel)
    nv, nm = value0.numpy().copy(), np.zeros(numel, dtype=np.float32)
    nd = [d.numpy() for d in deltas]
    acc, tmp = np.empty(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
    mu, lr, total = np.float32(hyper.momentum), np.float32(hyper.lr), np.float32(sum(weights))

    phases = {"fold": [], "commit": [], "numpy_fold": [], "numpy_commit": []}

    def numpy_step() -> None:
        t0 = time.perf_counter()
        np.multiply(nd[0], np.float32(weights[0]), out=acc)
        for d, w in zip(nd[1:], weights[1:]):
            np.multiply(d, np.float32(w), out=tmp)
            np.add(acc, tmp, out=acc)
        phases["numpy_fold"].append(time.perf_counter() - t0)
        np.divide(acc, total, out=acc)
        np.negative(acc, out=acc)
        np.multiply(nm, mu, out=nm)
        np.add(nm, acc, out=nm)
        np.multiply(nm, mu, out=tmp)
        np.add(tmp, acc, out=tmp)
        np.multiply(tmp, lr, out=tmp)
        np.subtract(nv, tmp, out=nv)
        phases["numpy_commit"].append(time.perf_counter() - t0 - phases["numpy_fold"][-1])

    def ours_step() -> None:
        t0 = time.perf_counter()
        rs = RoundSum(1, 0, 0, state["spare"], n_parts)
        for i, parts in enumerate(pushes):
            for k, opened in enumerate(parts):
                lo, _hi = layout.part_range(k, part_elems)
                res = run_work(FoldPart(rs, k, lo, opened, weights[i], i))
                assert res.error is None, res.error
        phases["fold"].append(time.perf_counter() - t0)
        for k in range(n_parts):
            lo, hi = layout.part_range(k, part_elems)
            # check=False: the syncer proves the step finite from its magnitude bounds (kernels.step_bounds)
            run_work(CommitPart(1, 0, k, state["value"], mom, None, rs, sum(weights), hyper, layout,
                                part_elems, ("float32",), 1, check=False))
        state["spare"], state["value"] = state["value"], rs.flat
        phases["commit"].append(time.perf_counter() - t0 - phases["fold"][-1])

    ours_times, numpy_times = [], []
    for i in range(repeat + 1):  # the first pass of each warms buffers and is not timed
        t0 = time.perf_counter()
        ours_step()
        t1 = time.perf_counter()
        numpy_step()
        t2 = time.perf_counter()
        if i == 0:
            if not (np.array_equal(state["value"].numpy(), nv) and np.array_equal(mom.numpy(), nm)):
                raise AssertionError("merge_vs_numpy: the data plane and the numpy reference disagree")
            continue
        ours_times.append(t1 - t0)
        numpy_times.append(t2 - t1)
    ours = statistics.median(ours_times)
    base = statistics.median(numpy_times)
    print(f"merge (b): {mib} MiB fp32 fragment, {islands} islands' fp32 deltas, median of {repeat}")
    print(f"  numpy in-place ufuncs  : {base * 1e3:8.1f} ms")
    print(f"  syncer data plane      : {ours * 1e3:8.1f} ms (verify + fold + outer step + payload digests)")
    split = {k: round(statistics.median(v[1:]) * 1e3, 2) for k, v in phases.items()}  # the warm-up pass left out
    print(f"  of which folds {split['fold']} ms and the step {split['commit']} ms (numpy: "
          f"{split['numpy_fold']} and {split['numpy_commit']} ms)")
    print(f"  merge_vs_numpy (numpy/ours): {base / ours:.3f}  (target >= 1.0)")
    return {"merge_vs_numpy": round(base / ours, 4), "merge_ms": round(ours * 1e3, 2),
            "numpy_merge_ms": round(base * 1e3, 2), "merge_mib": mib,
            **{f"{k}_ms": v for k, v in split.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="fragment size in MiB (default 256)")
    parser.add_argument("--merge-mib", type=int, default=128, help="fragment size of the merge benchmark (default 128)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repeats per variant (default 5)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks it runs (seconds)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if args.smoke:
        args.mib, args.merge_mib, args.repeat = 8, 8, 1

    figures: dict = {}
    figures.update(bench_wire_vs_zmq(mib=args.mib, repeat=args.repeat, part_mib=min(32, max(1, args.mib // 4))))
    figures.update(bench_merge_vs_numpy(mib=args.merge_mib, repeat=args.repeat,
                                        part_mib=min(32, max(1, args.merge_mib // 4))))
    figures["smoke"] = args.smoke
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()

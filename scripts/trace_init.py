"""Per-part timelines of INIT through the island's client and the syncer (``probe_init.py --trace``).

    python scripts/trace_init.py syncer TRACE.json -- <yeto-syncer args>   (run a traced syncer)
    python scripts/trace_init.py report DIR                                 (summarise DIR's traces)

Nothing here changes what the code does: it wraps a few functions to take a clock reading.
On the syncer: every message the loop opens (``loop.open_message``), every work item handed to the
data plane and run by a worker (``dataplane.run_work``), and how long the loop's thread waited in
``poll``. On the island (:func:`trace_island`, in the probe's own process): every part handed to
zmq (``pacing.send_tracked``) and the moment the client saw zmq let go of it (``Pacer.pump``).
The report says where a part's time went, stage by stage, so the pipeline's slowest stage shows
(the question INIT's 5 GB/s target asks, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DUMP_EVERY_S = 0.5


def _stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return (f"n={len(xs)} mean={1e3 * statistics.fmean(xs):.2f}ms p50={1e3 * xs[len(xs) // 2]:.2f}ms "
            f"p90={1e3 * xs[int(0.9 * (len(xs) - 1))]:.2f}ms max={1e3 * xs[-1]:.2f}ms")


def trace_syncer(out: Path, argv: list[str]) -> int:
    """Run the syncer's ``main(argv)`` with its loop and data plane wrapped; the events go to ``out``
    every :data:`DUMP_EVERY_S` (the probe kills the syncer, so nothing waits for its exit)."""
    from diloco.syncer import cli, dataplane, loop
    from diloco.syncer.core.work import InitPart
    import zmq

    _variants(os.environ.get("TRACE_VARIANT", ""))
    ev: dict[str, list] = {"open": [], "submit": [], "run": [], "poll": []}
    main_ident = threading.get_ident()
    open_message = loop.open_message

    def traced_open(frames: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        opened = open_message(frames, **kw)
        h = opened.header
        ev["open"].append((t0, time.monotonic(), type(h).__name__, getattr(h, "fragment", -1), getattr(h, "part", -1)))
        return opened
    loop.open_message = traced_open

    run_work = dataplane.run_work

    def traced_run(work: Any, scratch: Any = None) -> Any:
        t0 = time.monotonic()
        r = run_work(work, scratch)
        if isinstance(work, InitPart):
            ev["run"].append((t0, time.monotonic(), work.fragment, work.part, threading.current_thread().name))
        return r
    dataplane.run_work = traced_run

    submit = dataplane.DataPlane.submit

    def traced_submit(self: Any, work: Any) -> None:
        if isinstance(work, InitPart):
            ev["submit"].append((time.monotonic(), work.fragment, work.part, self.backlog_bytes))
        submit(self, work)
    dataplane.DataPlane.submit = traced_submit  # type: ignore[method-assign]

    poll = zmq.Poller.poll

    def traced_poll(self: Any, timeout: Any = None) -> Any:
        t0 = time.monotonic()
        r = poll(self, timeout)
        if threading.get_ident() == main_ident:
            ev["poll"].append((t0, time.monotonic(), len(r)))
        return r
    zmq.Poller.poll = traced_poll  # type: ignore[method-assign]

    def dump() -> None:
        while True:
            time.sleep(DUMP_EVERY_S)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps({k: list(v) for k, v in ev.items()}))
            tmp.replace(out)
    threading.Thread(target=dump, daemon=True, name="trace-dump").start()
    return cli.main(argv)


def _variants(names: str) -> None:
    """Experiments on the syncer's INIT path, by name (comma-separated; ``TRACE_VARIANT``):
    ``huge``: fresh values get ``madvise(MADV_HUGEPAGE)``; ``populate``: each INIT part's range is
    ``madvise(MADV_POPULATE_WRITE)`` before its copy; ``unfused``: the value's bound in a second
    pass over the part after the copy (the code before the per-chunk bound)."""
    import ctypes
    import math

    from diloco.syncer import dataplane
    from diloco.syncer.core import book
    from diloco.syncer.core.kernels import BLOCK, magnitude_bound
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = 4096

    def advise(ptr: int, nbytes: int, advice: int) -> None:
        first, last = -(-ptr // page) * page, (ptr + nbytes) // page * page
        if last > first and libc.madvise(first, last - first, advice) != 0:
            print(f"madvise({advice}) failed: errno {ctypes.get_errno()}", file=sys.stderr)
    for name in filter(None, names.split(",")):
        if name == "huge":
            fresh = book.FragmentBook.fresh

            def huge_fresh(self: Any, numel: int, what: str = "") -> Any:
                t = fresh(self, numel, what)
                advise(t.data_ptr(), numel * 4, 14)
                return t
            book.FragmentBook.fresh = huge_fresh  # type: ignore[method-assign]
        elif name == "populate":
            init_part = dataplane.init_part

            def populated(w: Any) -> float:
                hi = w.lo + sum(math.prod(m.shape) for m in w.opened.metas)
                advise(w.value.data_ptr() + 4 * w.lo, 4 * (hi - w.lo), 23)
                return init_part(w)
            dataplane.init_part = populated
        elif name == "unfused":
            def two_pass(w: Any) -> float:
                starts = dataplane._segment_starts(w.opened, w.lo)
                dests = [w.value[s : s + math.prod(m.shape)] for s, m in zip(starts, w.opened.metas)]
                w.opened.copy_into(dests, parallel=False)
                hi = starts[-1] + math.prod(w.opened.metas[-1].shape) if starts else w.lo
                return max((magnitude_bound(w.value[a : min(hi, a + BLOCK)]) for a in range(w.lo, hi, BLOCK)),
                           default=0.0)
            dataplane.init_part = two_pass
        else:
            raise SystemExit(f"TRACE_VARIANT: unknown {name!r}")
    print(f"trace variants: {names or '(none)'}", file=sys.stderr)


def trace_island() -> Callable[[Path], None]:
    """Wrap this process's client send path; returns ``save(path)`` writing what was seen."""
    from diloco.island import client, lane
    from diloco.wire import pacing

    ev: dict[str, list] = {"handed": [], "retired": []}
    send_tracked = pacing.send_tracked

    def traced_send(sock: Any, frames: list[Any], flags: int = 0, track: bool = True) -> Any:
        t0 = time.monotonic()
        tracker = send_tracked(sock, frames, flags, track)
        if track and len(frames) > 2:
            ev["handed"].append((t0, time.monotonic(), id(sock), id(tracker), sum(len(memoryview(f)) for f in frames[2:])))
        return tracker
    client.send_tracked = traced_send  # type: ignore[attr-defined]
    lane.send_tracked = traced_send  # type: ignore[attr-defined]

    pump = pacing.Pacer.pump

    def traced_pump(self: Any) -> None:
        before = {id(t) for v in self._inflight.values() for t, _s, _l in v}
        pump(self)
        after = {id(t) for v in self._inflight.values() for t, _s, _l in v}
        now = time.monotonic()
        ev["retired"].extend((now, i) for i in before - after)
    pacing.Pacer.pump = traced_pump  # type: ignore[method-assign]

    def save(path: Path) -> None:
        path.write_text(json.dumps(ev))
    return save


def counts(d: Path) -> dict[str, int]:
    """Parts each side traced: ``island_parts`` handed to zmq, ``syncer_parts`` run by a worker."""
    isl = json.loads((d / "island.json").read_text())
    syn = json.loads((d / "syncer.json").read_text())
    return {"island_parts": len(isl["handed"]), "syncer_parts": len(syn["run"])}


def report(d: Path) -> str:
    """Where INIT's parts spent their time, from ``d/island.json`` and ``d/syncer.json``."""
    isl = json.loads((d / "island.json").read_text())
    syn = json.loads((d / "syncer.json").read_text())
    lines = []
    handed = isl["handed"]
    retired = {i: t for t, i in isl["retired"]}
    t0 = handed[0][0] if handed else 0.0
    socks = sorted({h[2] for h in handed})
    for s in socks:
        hs = [h for h in handed if h[2] == s]
        span = hs[-1][1] - hs[0][0]
        nbytes = sum(h[4] for h in hs)
        lines.append(f"island stream {socks.index(s)}: {len(hs)} parts, {nbytes / 2**20:.0f} MiB in {span:.2f}s "
                     f"({nbytes / span / 1e9 if span else 0:.2f} GB/s)")
        lines.append(f"  send call: {_stats([h[1] - h[0] for h in hs])}")
        lines.append(f"  handed -> seen released: {_stats([retired[h[3]] - h[1] for h in hs if h[3] in retired])}")
        lines.append(f"  gap between hand-offs: {_stats([b[0] - a[1] for a, b in zip(hs, hs[1:])])}")
    opens = [o for o in syn["open"] if o[2] == "Init"]
    others = [o for o in syn["open"] if o[2] != "Init"]
    lines.append(f"syncer opened {len(opens)} INIT parts ({len(others)} other messages): {_stats([o[1] - o[0] for o in opens])}")
    if opens:
        lines.append(f"  first INIT part {opens[0][0] - t0:+.3f}s after the island's first hand-off, last {opens[-1][1] - t0:+.3f}s")
        lines.append(f"  gap between opens: {_stats([b[0] - a[1] for a, b in zip(opens, opens[1:])])}")
    sub = {(s[1], s[2]): s for s in syn["submit"]}
    runs = syn["run"]
    waits = [r[0] - sub[(r[2], r[3])][0] for r in runs if (r[2], r[3]) in sub]
    lines.append(f"data plane: {len(runs)} INIT parts run: {_stats([r[1] - r[0] for r in runs])}")
    lines.append(f"  queued before a worker took it: {_stats(waits)}")
    if runs:
        lo, hi = min(r[0] for r in runs), max(r[1] for r in runs)
        per: dict[str, float] = {}
        for r in runs:
            per[r[4]] = per.get(r[4], 0.0) + r[1] - r[0]
        lines.append("  workers busy over INIT: " + ", ".join(f"{k} {100 * v / (hi - lo):.0f}%" for k, v in sorted(per.items())))
        polls = [p for p in syn["poll"] if lo <= p[0] <= hi]
        lines.append(f"loop: {len(polls)} polls during INIT, waited {sum(p[1] - p[0] for p in polls):.2f}s of {hi - lo:.2f}s; "
                     f"each {_stats([p[1] - p[0] for p in polls])}")
        backlog = [s[3] for s in syn["submit"]]
        lines.append(f"  backlog at submit (MiB): mean {statistics.fmean(backlog) / 2**20:.0f} max {max(backlog) / 2**20:.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "syncer":
        rest = sys.argv[3:]
        raise SystemExit(trace_syncer(Path(sys.argv[2]), rest[1:] if rest[:1] == ["--"] else rest))
    if len(sys.argv) == 3 and sys.argv[1] == "report":
        print(report(Path(sys.argv[2])))
        raise SystemExit(0)
    raise SystemExit(__doc__)

"""INIT throughput of one island into a real syncer, and where its CPU goes (device probe).

    python scripts/probe_init.py [--gib 2.5] [--fragments 4] [--window 2] [--syncer-args "..."]

A real ``yeto-syncer`` (HMAC mode, one island) and one real ``SyncClient`` in this process
streaming ``--fragments`` INIT fragments of ``--gib`` GiB each, two in flight, as an island's
start-up does (``island/lifecycle.py``), claiming their digests in HELLO as a real island does (the
syncer then holds the island's values: no cut comes back). ``--window`` overrides the client's stream window
(``island.client.WINDOW``: parts of INIT in zmq's hands) for this run only. Prints INIT GB/s (bytes over
first send to the last fragment released by zmq, and to the initial cut received) and the CPU
each thread of the syncer and of this process used during INIT, as a share of one core, so a
saturated thread shows. The last line is one JSON object (``initialised``: fragments the syncer
logged as initialised, which must be all of them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from diloco import wire  # noqa: E402
from diloco.config import IslandConfig  # noqa: E402
from diloco.digest import tensor_digest  # noqa: E402
from diloco.island import client as client_mod  # noqa: E402
from diloco.island.client import SyncClient  # noqa: E402
from profile_syncer import thread_times as thread_cpu  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def busy(before: dict, after: dict, seconds: float) -> list[str]:
    """Threads that used more than 5 % of a core between two samples, busiest first."""
    rows = []
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        if used > 0.05 * seconds:
            rows.append((used / seconds, f"{name}/{tid} {100 * used / seconds:.0f}%"))
    return [r for _, r in sorted(rows, reverse=True)]


class Trainer:
    """A thread that launches small torch ops back to back, as a training loop's Python does: each op
    releases the GIL and takes it back, so a thread holding the GIL meanwhile slows it down."""

    def __init__(self) -> None:
        self.x = torch.zeros(256)
        self.ops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe-train", daemon=True)
        self._t0 = 0.0

    def _spin(self, until: Callable[[], bool]) -> int:
        n, x = 0, self.x
        while not until():
            for _ in range(100):
                x.add_(1.0)
            n += 100
        return n

    def rate_alone(self, seconds: float) -> float:
        t0 = time.monotonic()
        n = self._spin(lambda: time.monotonic() - t0 > seconds)
        return n / (time.monotonic() - t0)

    def _run(self) -> None:
        self.ops = self._spin(self._stop.is_set)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.ops / (time.monotonic() - self._t0)


def cpu_list(spec: str) -> set[int]:
    """CPUs of a list such as ``0-7,12`` (empty: none given)."""
    cpus: set[int] = set()
    for item in filter(None, spec.split(",")):
        lo, _, hi = item.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.5)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--window", type=int, default=0, help="client stream window (0: the code's WINDOW)")
    ap.add_argument("--syncer-args", default="")
    ap.add_argument("--smoke", action="store_true", help="two fragments of 8 MiB: checks it runs (the suite)")
    ap.add_argument("--spy", type=Path, default=None,
                    help="record py-spy stacks (native, idle included) of the syncer and of this process "
                         "during INIT into this folder: syncer.txt, island.txt, syncer_gil.txt")
    ap.add_argument("--train", action="store_true",
                    help="a thread launches small torch ops throughout, as a training loop does: their rate "
                         "during INIT over their rate alone (train_rate_ratio) is what streaming costs training")
    ap.add_argument("--no-claims", action="store_true",
                    help="claim nothing in HELLO: the syncer sends the cut back while INIT streams")
    ap.add_argument("--island-cpus", default="",
                    help="run this process (the island: its values, client and zmq threads) on these CPUs, "
                         "e.g. 0-7 (default: all); with --syncer-cpus on another NUMA node, each side's memory "
                         "is its own, as on two hosts")
    ap.add_argument("--syncer-cpus", default="", help="run the syncer on these CPUs, e.g. 8-15 (default: all)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="record per-part timelines of the client and the syncer into this folder and "
                         "print where the parts' time went (scripts/trace_init.py)")
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="the syncer's GIL switch interval (sys.setswitchinterval, set before its code runs), "
                         "in ms (0: Python's default of 5 ms)")
    ap.add_argument("--island-switch-ms", type=float, default=0.0,
                    help="the same for this process (the island's client), in ms (0: the default)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.island_switch_ms > 0:
        sys.setswitchinterval(a.island_switch_ms / 1000)
    island_cpus, syncer_cpus = cpu_list(a.island_cpus), cpu_list(a.syncer_cpus)
    if island_cpus:  # before any value is touched or thread started: they inherit it, pages come local
        os.sched_setaffinity(0, island_cpus)
    torch.set_num_threads(1)
    if a.smoke:
        a.gib, a.fragments, a.tensors = 1 / 128, 2, 3
    if a.window:
        client_mod.WINDOW = a.window  # type: ignore[attr-defined]
    per = int(a.gib * 2**30 / 4) // a.tensors
    layouts, values = [], []
    for f in range(a.fragments):
        names = [f"f{f}.t{i}" for i in range(a.tensors)]
        layouts.append(wire.FragmentLayout.of([(n, (per,)) for n in names]))
        values.append([(n, torch.full((per,), float(f + 1))) for n in names])
    nbytes = a.fragments * a.tensors * per * 4
    tmp = Path(tempfile.mkdtemp(prefix="probe_init_"))
    key = b"probe-init-key"
    env = dict(os.environ, PYTHONPATH=str(REPO), YETO_SYNC_KEY=key.decode())
    if a.switch_ms > 0:  # the syncer's interpreter sets it before its own code runs
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(f"import sys\nsys.setswitchinterval({a.switch_ms / 1000!r})\n")
        env["PYTHONPATH"] = f"{tmp / 'site'}{os.pathsep}{REPO}"
    save_trace = None
    if a.trace is not None:
        import trace_init
        a.trace.mkdir(parents=True, exist_ok=True)
        save_trace = trace_init.trace_island()
        launch = [sys.executable, str(REPO / "scripts" / "trace_init.py"), "syncer", str(a.trace / "syncer.json"), "--"]
    else:
        launch = [sys.executable, "-m", "diloco.syncer"]
    cmd = [*launch, "--bind", "tcp://127.0.0.1:0", "--islands", "1",
           "--sync-every", "1", "--total-steps", "1", "--checkpoint-every", "0", "--join-timeout-s", "0",
           "--dead-after-s", "600", "--final-timeout-s", "60", *a.syncer_args.split()]
    with open(tmp / "syncer.log", "w") as log_f:
        syncer = subprocess.Popen(cmd, stderr=log_f, stdout=subprocess.DEVNULL, env=env,
                                  preexec_fn=(lambda: os.sched_setaffinity(0, syncer_cpus)) if syncer_cpus else None)
    client: SyncClient | None = None
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"bound (tcp://\S+)", (tmp / "syncer.log").read_text())):
            if syncer.poll() is not None or time.monotonic() > deadline:
                raise SystemExit((tmp / "syncer.log").read_text())
            time.sleep(0.05)
        client = SyncClient(IslandConfig(sync_addr=m.group(1), island_id=0, key=key, sync_timeout_s=120.0,
                                         send_queue=4), "probe-init", layouts,
                            claims=None if a.no_claims else [tensor_digest(v) for v in values])
        client.wait_welcome(60)
        spies = []
        if a.spy is not None:
            a.spy.mkdir(parents=True, exist_ok=True)
            for name, pid, extra in (("syncer", syncer.pid, ["--idle"]), ("island", os.getpid(), ["--idle"]),
                                     ("syncer_gil", syncer.pid, ["--gil"])):
                spies.append(subprocess.Popen(["py-spy", "record", "--native", "--threads", "--rate", "250",
                                               "--duration", "2", "--format", "raw", "--pid", str(pid),
                                               "--output", str(a.spy / f"{name}.txt"), *extra],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(0.5)  # py-spy attaches
        trainer = Trainer() if a.train else None
        alone = trainer.rate_alone(1.0) if trainer is not None else 0.0
        if trainer is not None:
            trainer.start()
        s0, c0 = thread_cpu(syncer.pid), thread_cpu(os.getpid())
        t0 = time.monotonic()
        inflight: list = []
        for f in range(a.fragments):
            while len(inflight) >= 2:
                if not inflight.pop(0).wait(120):
                    raise SystemExit("INIT send timed out")
            inflight.append(client.send_init(f, values[f]))
        for ev in inflight:
            if not ev.wait(120):
                raise SystemExit("INIT send timed out")
        sent_s = time.monotonic() - t0
        s1, c1 = thread_cpu(syncer.pid), thread_cpu(os.getpid())
        during = trainer.stop() if trainer is not None else 0.0
        cut = set(range(a.fragments)) if not a.no_claims else set()  # claimed: HELD, nothing comes back
        while len(cut) < a.fragments and time.monotonic() - t0 < 300:
            if client.wait_bcast(0.01):
                cut |= {b.fragment for b in client.take_bcasts()}
        cut_s = time.monotonic() - t0
        initialised, deadline = 0, time.monotonic() + 120
        while initialised < a.fragments and time.monotonic() < deadline:  # the syncer verified and holds each
            initialised = (tmp / "syncer.log").read_text().count("initialised by island 0")
            time.sleep(0.05)
        print(f"INIT {nbytes / 2**30:.2f} GiB in {a.fragments} fragments, window {client_mod.WINDOW}, "
              f"syncer {a.syncer_args or '(defaults)'}: sent {sent_s:.2f}s ({nbytes / sent_s / 1e9:.2f} GB/s), "
              f"cut at {cut_s:.2f}s")
        print("  syncer threads during INIT:", ", ".join(busy(s0, s1, sent_s)))
        print("  island threads during INIT:", ", ".join(busy(c0, c1, sent_s)))
        if trainer is not None:
            print(f"  training thread: {alone:.0f} ops/s alone, {during:.0f} ops/s during INIT "
                  f"({during / alone:.3f})")
        for spy in spies:
            spy.wait(timeout=60)
        traced: dict[str, int] = {}
        if save_trace is not None:
            save_trace(a.trace / "island.json")
            time.sleep(1.2)  # the syncer's next dump
            print(trace_init.report(a.trace))
            traced = trace_init.counts(a.trace)
        print(json.dumps({"init_gbps": round(nbytes / sent_s / 1e9, 3), "init_s": round(sent_s, 3),
                          "cut_s": round(cut_s, 3), "initialised": initialised, "window": client_mod.WINDOW,
                          "syncer_args": a.syncer_args, "switch_ms": a.switch_ms,
                          "island_switch_ms": a.island_switch_ms, "gib": a.gib, "fragments": a.fragments,
                          "island_cpus": a.island_cpus, "syncer_cpus": a.syncer_cpus,
                          **({"train_rate_ratio": round(during / alone, 4)} if trainer is not None else {}),
                          **({"traced": traced} if traced else {})}))
        return 0
    finally:
        if client is not None:
            client.close()
        syncer.kill()
        syncer.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

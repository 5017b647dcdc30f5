"""Host memory of sync: what an island and the syncer hold beyond the training loop itself.

    python benchmarks/bench_memory.py [--model-mib 512] [--smoke]

Real processes: a real ``yeto-syncer`` and two real one-process islands (Python API,
``TorchLayout``) training a plain MLP with SGD on synthetic data; the baseline is the very
same training process with sync off. Every process's VmRSS / VmHWM is read from /proc (the
island's own peak: VmHWM; the syncer's: sampled by this process every 50 ms, since its RSS
before any island joined is the reference). Each figure is a ratio over the model's fp32
bytes M, measured in this run:

| key | what | target |
|---|---|---|
| island_extra_over_model | (island peak − baseline peak) / M, 4 fragments, fp32 wire | ≤ 1.4 |
| island_extra_over_model_8f | the same, 8 fragments | ≤ 1.25 |
| island_extra_over_model_q4 | the same, q4 pushes with error feedback | ≤ 1.9 |
| syncer_peak_over_model | (syncer peak − its RSS before any island joined) / M, momentum 0 | ≤ 1.3 |
| syncer_peak_over_model_momentum | the same with --outer-momentum 0.9 | ≤ 2.3 |
| released_after_final | (island peak − RSS after finish) / (island peak − baseline peak) | ≥ 0.9 |
| rank_anchor_over_slice | world-2 islands (megatron-core GPT: TP2, and DistributedOptimizer over DP2): the largest rank's anchors / its own slice's fp32 bytes | ≤ 1.1 |

The last line printed is one JSON object with these keys (and the raw MiB figures).

Parts scale with the model: the syncer's default ``--part-mib auto`` makes a part about 1/128 of
the largest fragment (a power of two from 1 to 32 MiB: 1 MiB for this 512 MiB model in 4
fragments, 4 MiB at 0.7B, 16 MiB at 2.7B, 32 MiB from 7B on). A part is held a fixed number of
times per island (the island's push ring holds 2, its receive side up to 3; the syncer about 3
per island and 2 per data-plane worker), so parts stay a small share of every model instead of
1/16 of this one's fragments at a fixed 32 MiB. ``--part-mib N`` measures at a fixed size.

The baseline (the same loop, sync off) is the median of ``--baselines`` runs: its peak moves by
up to 0.2 M from run to run, more than some targets' margin.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("bench_memory")

KEY = "bench-memory-key"


def _status_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _own_kib(field: str) -> int:
    return _status_kib(os.getpid(), field)


# ---------------------------------------------------------------------------- island process
def run_island(args: argparse.Namespace) -> None:
    """One island (or, with --no-sync, the baseline): train, finish, report memory as JSON."""
    import torch

    from diloco.config import IslandConfig
    from diloco.hostmem import tune_island_malloc
    from diloco.island.boundary import Island
    from diloco.layout.torch_module import TorchLayout

    torch.set_num_threads(1)
    tune_island_malloc()  # the same heap profile with and without sync
    torch.manual_seed(0)
    layers = 32  # enough tensors for 8 fragments
    width = max(64, int((args.model_mib * 2**20 / 4 / layers) ** 0.5) // 64 * 64)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    island = None
    phases = {"model_kib": _own_kib("VmRSS")}
    if not args.no_sync:
        cfg = IslandConfig(sync_addr=args.addr, island_id=args.island, key=KEY, fragments=args.fragments,
                           wire_dtype=args.wire_dtype, sync_rounds=True, tokens_per_step=8)
        island = Island(cfg, TorchLayout(model, opt), tokens_per_step=8)
        phases["built_kib"] = _own_kib("VmRSS")
        island.start()
        phases["started_kib"], phases["started_hwm_kib"] = _own_kib("VmRSS"), _own_kib("VmHWM")
    data = torch.Generator().manual_seed(args.island)
    for step in range(1, args.steps + 1):
        x = torch.randn(8, width, generator=data)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if island is not None:
            island.step_end(step, float(loss))
        phases[f"step{step}_kib"] = _own_kib("VmRSS")
    before_finish = _own_kib("VmRSS")
    peak_training = _own_kib("VmHWM")
    if island is not None:
        island.finish()
    out = {"model_bytes": model_bytes, "peak_kib": _own_kib("VmHWM"), "rss_after_kib": _own_kib("VmRSS"),
           "rss_before_finish_kib": before_finish, "peak_training_kib": peak_training,
           "sync_buffers": getattr(island, "sync_buffers", {}), "phases": phases}
    Path(args.result).write_text(json.dumps(out))


# ---------------------------------------------------------------------------- driver
class _Sampler(threading.Thread):
    """Samples one process's VmRSS every 50 ms; keeps the max (the syncer's VmHWM includes
    its start-up, so its peak over its idle RSS is measured this way)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self._halt = pid, 0, threading.Event()
        self.timeline: list[tuple[float, int]] = []
        """(wall time, VmRSS KiB) whenever RSS moved by 8 MiB or more (bounded by the run's length)."""

    def run(self) -> None:
        while not self._halt.is_set():
            rss = _status_kib(self.pid, "VmRSS")
            self.peak_kib = max(self.peak_kib, rss)
            if not self.timeline or abs(rss - self.timeline[-1][1]) >= 8192:
                self.timeline.append((time.time(), rss))
            time.sleep(0.05)

    def stop(self) -> int:
        self._halt.set()
        self.join(timeout=5)
        return self.peak_kib


def _bound_address(syncer: subprocess.Popen, log_path: Path, timeout_s: float = 60.0) -> str:
    """The address a starting syncer logs that it bound (``--bind tcp://127.0.0.1:*``)."""
    deadline = time.monotonic() + timeout_s
    while not (m := re.search(r"bound (tcp://\S+)", log_path.read_text())):
        if syncer.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the syncer did not start: {log_path}")
        time.sleep(0.05)
    return m.group(1)


def _island_cmd(args: argparse.Namespace, island: int, addr: str, result: Path, fragments: int, wire_dtype: str,
                no_sync: bool = False) -> list[str]:
    cmd = [sys.executable, __file__, "--role", "island", "--island", str(island), "--addr", addr,
           "--result", str(result), "--fragments", str(fragments), "--wire-dtype", wire_dtype,
           "--model-mib", str(args.model_mib), "--steps", str(args.steps)]
    return cmd + (["--no-sync"] if no_sync else [])


def measure(args: argparse.Namespace, work: Path, name: str, fragments: int, wire_dtype: str,
            momentum: float) -> dict:
    """One syncer + two islands; their memory figures in KiB."""
    run = work / name
    run.mkdir()
    (run / "key").write_text(KEY)
    sync_every = max(fragments, args.steps // 3)
    syncer_log = open(run / "syncer.log", "w")
    syncer = subprocess.Popen(
        [sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*", "--islands", "2",
         "--sync-every", str(sync_every), "--total-steps", str(args.steps), "--key-file", str(run / "key"),
         "--outer-lr", "1.0", "--outer-momentum", str(momentum), "--checkpoint-dir", str(run / "ckpt"),
         "--part-mib", args.part_mib,
         *shlex.split(args.syncer_args)],
        stderr=syncer_log, start_new_session=True)
    try:
        addr = _bound_address(syncer, run / "syncer.log")
        time.sleep(0.3)
        syncer_idle = _status_kib(syncer.pid, "VmRSS")
        sampler = _Sampler(syncer.pid)
        sampler.start()
        islands = []
        for i in range(2):
            with open(run / f"island{i}.log", "w") as lf:
                islands.append(subprocess.Popen(
                    _island_cmd(args, i, addr, run / f"island{i}.json", fragments, wire_dtype),
                    stdout=lf, stderr=subprocess.STDOUT, start_new_session=True))
        for i, p in enumerate(islands):
            if p.wait(timeout=args.timeout_s) != 0:
                tail = (run / f"island{i}.log").read_text()[-3000:]
                raise RuntimeError(f"{name}: island {i} failed; its log ends:\n{tail}")
        syncer.wait(timeout=120)
        syncer_peak = sampler.stop()
        (run / "syncer_rss.tsv").write_text("".join(
            f"{time.strftime('%H:%M:%S', time.localtime(t))}.{int(t * 1000) % 1000:03d}\t{kib / 1024:.0f}\n"
            for t, kib in sampler.timeline))
    finally:
        for p in [syncer]:
            if p.poll() is None:
                p.kill()
        syncer_log.close()
    res = [json.loads((run / f"island{i}.json").read_text()) for i in range(2)]
    log.info("%s: island peaks %s MiB, syncer idle %.0f peak %.0f MiB", name,
             [round(r["peak_kib"] / 1024) for r in res], syncer_idle / 1024, syncer_peak / 1024)
    return {"islands": res, "syncer_idle_kib": syncer_idle, "syncer_peak_kib": syncer_peak}


def world2(args: argparse.Namespace, work: Path) -> dict:
    """Two world-2 islands (``diloco.demo.island``: megatron-core GPT, gloo; TP2 and DP2 with the
    distributed optimizer) and a real syncer; each rank's sync buffers and own slice, as the
    islands report them."""
    run = work / "world2"
    run.mkdir()
    (run / "key").write_text(KEY)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "YETO_SYNC_KEY": KEY}
    steps = 8 if args.smoke else 16
    with open(run / "syncer.log", "w") as slog:
        syncer = subprocess.Popen(
            [sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*", "--islands", "2", "--sync-every",
             str(steps // 2), "--total-steps", str(steps), "--key-file", str(run / "key")],
            stderr=slog, start_new_session=True, env=env)
    islands: list[subprocess.Popen] = []
    try:
        addr = _bound_address(syncer, run / "syncer.log")
        hidden = "64" if args.smoke else "256"
        for i, layout in enumerate(("tp2", "dp2")):
            with open(run / f"island{i}.log", "w") as lf:
                islands.append(subprocess.Popen(
                    [sys.executable, "-m", "diloco.demo.island", "--name", f"island{i}", "--island-id", str(i),
                     "--layout", layout, "--sync-addr", addr, "--steps", str(steps), "--fragments", "2",
                     "--out", str(run), "--hidden", hidden, "--layers", "4", "--seq", "16", "--micro-batch", "2",
                     "--data-seed", str(i), "--timeout-s", str(args.timeout_s)],
                    stdout=lf, stderr=subprocess.STDOUT, start_new_session=True, env=env))
        for i, p in enumerate(islands):
            if p.wait(timeout=args.timeout_s) != 0:
                raise RuntimeError(f"world2: island {i} failed; its log ends:\n"
                                   f"{(run / f'island{i}.log').read_text()[-3000:]}")
        syncer.wait(timeout=120)
    finally:
        for p in [*islands, syncer]:
            if p.poll() is None:
                p.kill()
    ranks = [rank for i in range(2) for rank in json.loads((run / f"island{i}.json").read_text())["ranks"]]
    worst = max(r["sync_buffers"]["anchors"] / r["slice_bytes"] for r in ranks)
    log.info("world2: anchors / own slice per rank %s",
             [round(r["sync_buffers"]["anchors"] / r["slice_bytes"], 3) for r in ranks])
    return {"rank_anchor_over_slice": round(worst, 3), "ranks": ranks}


def baseline(args: argparse.Namespace, work: Path) -> dict:
    """The training process with sync off, ``--baselines`` times; the run with the median peak."""
    runs = []
    for k in range(max(1, args.baselines)):
        result = work / f"baseline{k}.json"
        subprocess.run(_island_cmd(args, 0, "", result, 4, "float32", no_sync=True), check=True,
                       timeout=args.timeout_s)
        runs.append(json.loads(result.read_text()))
    runs.sort(key=lambda r: r["peak_kib"])
    log.info("baseline peaks %s MiB", [round(r["peak_kib"] / 1024) for r in runs])
    return runs[len(runs) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-mib", type=float, default=512.0, help="fp32 model size")
    p.add_argument("--steps", type=int, default=24, help="training steps (3 rounds per fragment at 4 fragments)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: the suite runs it")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--only", default="", help="comma-separated runs to measure (fp32_4f, fp32_8f, q4_4f, momentum, world2); "
                   "the keys of runs left out are null. Default: all")
    p.add_argument("--part-mib", default="auto", help="the syncer's --part-mib (see the module docstring)")
    p.add_argument("--baselines", type=int, default=3, help="runs of the no-sync baseline (the median counts)")
    p.add_argument("--syncer-args", default="", help="extra yeto-syncer flags for every run, e.g. "
                   "'--max-open-rounds 1'")
    p.add_argument("--role", default="driver", choices=["driver", "island"], help=argparse.SUPPRESS)
    p.add_argument("--island", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--addr", default="", help=argparse.SUPPRESS)
    p.add_argument("--keep", default="", help="keep every run's logs (and the syncer's RSS timeline, "
                   "syncer_rss.tsv) under this new directory")
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--fragments", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--wire-dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--no-sync", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.role == "island":
        run_island(args)
        return 0
    if args.smoke:
        args.model_mib, args.steps, args.part_mib, args.baselines = 16.0, 8, "1", 1
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = baseline(args, work)
        model = base["model_bytes"]
        base_peak = base["peak_kib"] * 1024

        plan = {"fp32_4f": (4, "float32", 0.0), "fp32_8f": (8, "float32", 0.0), "q4_4f": (4, "q4", 0.0),
                "momentum": (4, "float32", 0.9)}
        only = [n for n in args.only.split(",") if n] or [*plan, "world2"]
        unknown = sorted(set(only) - set(plan) - {"world2"})
        if unknown:
            p.error(f"--only: unknown runs {unknown} (known: {sorted(plan)} and world2)")
        runs = {name: measure(args, work, name, *plan[name]) for name in plan if name in only}
        w2 = world2(args, work) if "world2" in only else None
    main_run = runs.get("fp32_4f")
    released = None if main_run is None else min(
        (r["peak_kib"] - r["rss_after_kib"]) / max(1, r["peak_kib"] - base["peak_kib"]) for r in main_run["islands"])

    def extra(run: dict | None) -> float | None:
        return None if run is None else round(max((r["peak_kib"] * 1024 - base_peak) / model for r in run["islands"]), 3)

    def syncer(run: dict | None) -> float | None:
        return None if run is None else round((run["syncer_peak_kib"] - run["syncer_idle_kib"]) * 1024 / model, 3)

    out = {
        "model_mib": round(model / 2**20, 1),
        "part_mib": args.part_mib,
        "baseline_peak_mib": round(base_peak / 2**20, 1),
        "island_peak_mib": None if main_run is None else [round(r["peak_kib"] / 1024, 1) for r in main_run["islands"]],
        "island_sync_buffers": None if main_run is None else main_run["islands"][0]["sync_buffers"],
        "island_extra_over_model": extra(main_run),
        "island_extra_over_model_8f": extra(runs.get("fp32_8f")),
        "island_extra_over_model_q4": extra(runs.get("q4_4f")),
        "syncer_peak_over_model": syncer(main_run),
        "syncer_peak_over_model_momentum": syncer(runs.get("momentum")),
        "released_after_final": None if released is None else round(released, 3),
        "rank_anchor_over_slice": None if w2 is None else w2["rank_anchor_over_slice"],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launch one demo run — a real syncer, N islands and the baselines — and summarise it.

The machinery behind ``yeto-demo`` and ``benchmarks/bench_quality.py`` (one copy, so the demo
and the quality benchmark measure the same thing). :class:`DemoSettings` is the one typed
configuration; :meth:`DemoSettings.validate` checks every value against the demo model
(heads, layers) *before* any process starts and names the flag that is wrong. :func:`run_demo`
starts each process in its own session (an island forks its ranks into that process group),
so a failure, a timeout or Ctrl-C kills whole groups and leaves no orphan rank behind.

Runs it can start next to the islands, all from island 0's initial weights (same layout, same
seed) and on the same held-out batches:

* ``alone``: island 0's data stream, no sync — what one island would reach by itself;
* ``dp-bound``: one job that trains on every island's stream at once (N x the batch) for the
  same steps — the data-parallel upper bound DiLoCo tries to approach.

The summary's verdict compares the *final merged* model (every island holds it after the final
cut) with those runs by held-out loss.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

from diloco.config import WIRE_DTYPE_NAMES
from diloco.demo.island import check_layout, parse_layout
from diloco.steplog_report import summarize

log = logging.getLogger("yeto-demo")

# Tuned with benchmarks/bench_quality.py (docs/PERFORMANCE.md, "Quality"). Synchronous rounds
# are what pays: a 0.2 s demo step is shorter than a round trip, so asynchronously a commit
# lands 2-4 steps after its push, and at H <= 20 that staleness costs more than any setting
# gains (islands/alone 0.98-1.00 and noisy). Held at each round's step, H = 10 is the middle
# of the good region (H 4..12, 1-4 fragments: 0.957-0.978, deterministic); plain averaging
# (lr 1, no momentum) beats every outer lr away from 1 and every momentum tried (6-24 outer
# steps per fragment are too few for momentum: it overshoots). lr and momentum are also the
# syncer's own defaults; H is not (--sync-every 100: H trades bandwidth), nor are synchronous
# rounds for islands (YETO_DILOCO_SYNC_ROUNDS=0: at real sizes nothing waits).
DEFAULT_SYNC_EVERY = 10
DEFAULT_FRAGMENTS = 4
DEFAULT_OUTER_LR = 1.0
DEFAULT_OUTER_MOMENTUM = 0.0
DEFAULT_SYNC_ROUNDS = True

ALONE, DP_BOUND = "alone", "dp-bound"
_OUTPUT_SUFFIXES = (".log", ".jsonl", ".json", ".png", ".ready")
"""What a demo run writes into --out (plus sync.key, ckpt/ and tb/): what --overwrite removes."""


class DemoConfigError(ValueError):
    """A demo flag is wrong; the message starts with the flag's name."""


@dataclass(frozen=True)
class DemoSettings:
    """Everything one demo run needs; each field is the ``yeto-demo`` flag of the same name."""

    islands: int = 2
    """``--islands``: number of DiLoCo islands."""
    layouts: tuple[str, ...] = ("tp2", "pp2")
    """``--layouts``: layout per island (cycled), parts ``tpN``, ``ppN``, ``dpN``."""
    steps: int = 240
    """``--steps``: inner steps per island (and per baseline)."""
    fragments: int = DEFAULT_FRAGMENTS
    """``--fragments``: fragments the model is cut into (1 .. --layers)."""
    sync_every: int = DEFAULT_SYNC_EVERY
    """``--sync-every``: H, inner steps between two syncs of one fragment (--fragments .. --steps)."""
    outer_lr: float = DEFAULT_OUTER_LR
    """``--outer-lr``: the syncer's outer Nesterov learning rate (> 0)."""
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    """``--outer-momentum``: the syncer's outer Nesterov momentum (0 <= m < 1)."""
    out: str = "runs/demo"
    """``--out``: output directory; must be empty or absent unless ``overwrite``."""
    overwrite: bool = False
    """``--overwrite``: reuse a non-empty --out, removing a previous run's files first."""
    summary: str | None = None
    """``--summary``: where the summary JSON goes (default ``<out>/summary.json``)."""
    baseline: bool = True
    """Not ``--no-baseline``: also train ``alone`` (island 0's model and data, no sync)."""
    dp_bound: bool = False
    """``--dp-bound``: also train ``dp-bound`` (every island's data at once, no sync)."""
    hidden: int = 64
    """``--hidden``: model width (a multiple of the 4 heads and of every layout's TP)."""
    layers: int = 4
    """``--layers``: transformer layers (every layout's PP divides it)."""
    micro_batch: int = 8
    """``--micro-batch``: sequences per island step."""
    lr: float = 3e-3
    """``--lr``: inner Adam learning rate."""
    wire_dtype: str = "float32"
    """``--wire-dtype``: the islands' YETO_WIRE_DTYPE (pushes and broadcasts)."""
    timeout_s: float = 1800.0
    """``--timeout-s``: give up (and kill every process) after this long."""
    device: str = "cpu"
    """``--device``: cpu, or cuda (every rank on a visible GPU)."""
    ranks_per_node: int = 0
    """``--ranks-per-node``: > 0 installs the gloo bridge in the islands."""
    sync_rounds: bool = DEFAULT_SYNC_ROUNDS
    """``--sync-rounds`` / ``--async-rounds``: the islands' YETO_DILOCO_SYNC_ROUNDS (hold at each
    round's step until its commit is installed)."""
    flush_merge: str = "mean"
    """The syncer's ``--flush-merge`` (benchmarks compare it; the demo does not expose it)."""
    metrics_port: int = 0
    """``--metrics-port``: > 0 passes through to the syncer (Prometheus metrics and /healthz on 127.0.0.1)."""

    def layout_of(self, island: int) -> str:
        return self.layouts[island % len(self.layouts)]

    @property
    def summary_path(self) -> str:
        return os.path.abspath(self.summary or os.path.join(self.out, "summary.json"))

    def validate(self) -> None:
        """Raise DemoConfigError naming the first flag whose value cannot work."""
        def need(ok: bool, flag: str, why: str) -> None:
            if not ok:
                raise DemoConfigError(f"{flag}: {why}")

        need(self.islands >= 1, "--islands", f"must be >= 1, got {self.islands}")
        need(self.steps >= 1, "--steps", f"must be >= 1, got {self.steps}")
        need(self.layers >= 1, "--layers", f"must be >= 1, got {self.layers}")
        need(self.hidden >= 4 and self.hidden % 4 == 0, "--hidden", f"must be a positive multiple of the 4 "
             f"attention heads, got {self.hidden}")
        need(1 <= self.fragments <= self.layers, "--fragments", f"must be between 1 and --layers "
             f"({self.layers}): fragments are cut along layers, got {self.fragments}")
        need(self.fragments <= self.sync_every <= self.steps, "--sync-every", f"must be between --fragments "
             f"({self.fragments}: one fragment syncs every H/fragments steps) and --steps ({self.steps}), "
             f"got {self.sync_every}")
        need(self.outer_lr > 0 and math.isfinite(self.outer_lr), "--outer-lr", f"must be > 0, got {self.outer_lr}")
        need(self.flush_merge in ("mean", "outer"), "flush_merge", f"must be mean or outer, got {self.flush_merge!r}")
        need(0 <= self.outer_momentum < 1, "--outer-momentum", f"must satisfy 0 <= m < 1, got {self.outer_momentum}")
        need(self.micro_batch >= 1, "--micro-batch", f"must be >= 1, got {self.micro_batch}")
        need(self.lr > 0 and math.isfinite(self.lr), "--lr", f"must be > 0, got {self.lr}")
        need(self.wire_dtype in WIRE_DTYPE_NAMES, "--wire-dtype", f"must be one of {', '.join(WIRE_DTYPE_NAMES)}, "
             f"got {self.wire_dtype!r}")
        need(self.timeout_s > 0, "--timeout-s", f"must be > 0, got {self.timeout_s}")
        need(self.device in ("cpu", "cuda"), "--device", f"must be cpu or cuda, got {self.device!r}")
        need(self.ranks_per_node >= 0, "--ranks-per-node", f"must be >= 0, got {self.ranks_per_node}")
        need(0 <= self.metrics_port <= 65535, "--metrics-port", f"must be 0 (off) or a TCP port, got "
             f"{self.metrics_port}")
        need(len(self.layouts) > 0, "--layouts", "needs at least one layout")
        for lay in self.layouts:
            try:
                check_layout(lay, self.layers, self.hidden)
            except ValueError as exc:
                raise DemoConfigError(f"--layouts: {exc}") from None


def prepare_out(settings: DemoSettings) -> str:
    """Create --out, or refuse a non-empty one unless --overwrite (then remove the old run's files)."""
    out = os.path.abspath(settings.out)
    if os.path.isdir(out) and os.listdir(out):
        if not settings.overwrite:
            raise DemoConfigError(f"--out: {out} is not empty (a previous run?); pass --overwrite to replace "
                                  "its files, or choose another --out")
        for old in os.listdir(out):
            path = os.path.join(out, old)
            if old in ("ckpt", "tb") and os.path.isdir(path):
                shutil.rmtree(path)
            elif old == "sync.key" or old.endswith(_OUTPUT_SUFFIXES):
                os.remove(path)
    elif os.path.exists(out) and not os.path.isdir(out):
        raise DemoConfigError(f"--out: {out} exists and is not a directory")
    os.makedirs(out, exist_ok=True)
    return out


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: IO[str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_group(p: _Proc) -> None:
    """SIGKILL the process's whole group: the island and every rank it forked."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.popen.pid, signal.SIGKILL)


def run_names(settings: DemoSettings, with_islands: bool = True) -> list[str]:
    """Names of the runs, islands first: ``island0``.., then ``alone`` and ``dp-bound`` if asked."""
    return (([f"island{i}" for i in range(settings.islands)] if with_islands else [])
            + ([ALONE] if settings.baseline else []) + ([DP_BOUND] if settings.dp_bound else []))


def run_demo(settings: DemoSettings, with_islands: bool = True) -> dict[str, Any]:
    """Validate, start every process, show progress, and return the summary (also written as JSON).

    ``with_islands=False`` runs only the baselines (no syncer): the quality benchmark trains
    them apart from the islands, so that the islands run at equal speeds. Raises
    DemoConfigError before starting anything if a flag is wrong or --out is taken.
    """
    settings.validate()
    out = prepare_out(settings)
    key = secrets.token_hex(16)
    key_file = os.path.join(out, "sync.key")
    with open(key_file, "w") as fh:
        fh.write(key)
    env = {**os.environ, "YETO_SYNC_KEY": key, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "YETO_WIRE_DTYPE": settings.wire_dtype, "YETO_DILOCO_SYNC_ROUNDS": "1" if settings.sync_rounds else "0"}
    addr = f"tcp://127.0.0.1:{_free_port()}"
    procs: list[_Proc] = []

    def spawn(name: str, cmd: list[str]) -> _Proc:
        fh = open(os.path.join(out, f"{name}.log"), "w")
        # Its own session: one killpg ends the island and the ranks it forks.
        proc = _Proc(name, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True), fh)
        procs.append(proc)
        return proc

    s = settings
    layouts = [s.layout_of(i) for i in range(s.islands)]
    extra = [n for n in (ALONE, DP_BOUND) if n in run_names(s)]
    what = [f"{s.islands} islands ({', '.join(layouts)})"] if with_islands else []
    print(f"starting {' and '.join(what + extra)}: importing megatron-core takes a few seconds; logs in {out}",
          flush=True)
    t0 = time.time()
    ok = False
    syncer: _Proc | None = None
    try:
        common = ["--steps", str(s.steps), "--fragments", str(s.fragments), "--out", out, "--hidden", str(s.hidden),
                  "--layers", str(s.layers), "--micro-batch", str(s.micro_batch), "--lr", str(s.lr),
                  "--timeout-s", str(s.timeout_s), "--device", s.device, "--ranks-per-node", str(s.ranks_per_node)]
        island = [sys.executable, "-m", "diloco.demo.island"]
        if with_islands:
            syncer = spawn("syncer", [
                sys.executable, "-m", "diloco.syncer", "--bind", addr, "--islands", str(s.islands),
                "--sync-every", str(s.sync_every), "--total-steps", str(s.steps),
                "--checkpoint-dir", os.path.join(out, "ckpt"), "--checkpoint-every", "4", "--key-file", key_file,
                "--event-log", os.path.join(out, "events.jsonl"), "--quorum-timeout-s", "120",
                "--final-timeout-s", "300", "--outer-lr", str(s.outer_lr),
                "--outer-momentum", str(s.outer_momentum), "--flush-merge", s.flush_merge,
                *(["--metrics-port", str(s.metrics_port)] if s.metrics_port else [])])
            for i, lay in enumerate(layouts):
                spawn(f"island{i}", [*island, "--name", f"island{i}", "--island-id", str(i), "--layout", lay,
                                     "--sync-addr", addr, "--data-seed", str(i), "--start-together",
                                     str(s.islands), *common])
            log.info("syncer at %s, %d islands (%s), %d steps, H=%d, %d fragments, outer lr %g momentum %g",
                     addr, s.islands, ",".join(layouts), s.steps, s.sync_every, s.fragments, s.outer_lr,
                     s.outer_momentum)
        # The baselines use island 0's layout and seed: island 0's initial weights are the
        # syncer's initial cut, so every run starts from the same model.
        if s.baseline:
            spawn(ALONE, [*island, "--name", ALONE, "--layout", layouts[0], "--data-seed", "0", *common])
        if s.dp_bound:
            spawn(DP_BOUND, [*island, "--name", DP_BOUND, "--layout", layouts[0], "--data-seed", "0",
                             "--batch-streams", str(s.islands), *common])
        ok = _watch(procs, syncer, out, s, t0)
    finally:
        # Failure, timeout, Ctrl-C or success: no process (or forked rank) outlives the demo.
        for p in procs:
            _kill_group(p)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=30)
            p.log.close()
    summary = summarize_run(out, s, time.time() - t0, ok, with_islands)
    with open(s.summary_path, "w") as fh:
        json.dump(summary, fh, indent=1)
    return summary


def _progress(out: str, name: str) -> tuple[int, float | None]:
    try:
        with open(os.path.join(out, f"{name}.progress.jsonl"), "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 400))
            lines = fh.read().decode(errors="replace").splitlines()
        last = json.loads(lines[-1]) if lines and lines[-1].endswith("}") else None
        return (int(last["step"]), float(last["loss"])) if last else (0, None)
    except (OSError, ValueError, KeyError, IndexError):
        return 0, None


def _rounds(out: str) -> int:
    try:
        with open(os.path.join(out, "events.jsonl")) as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def _watch(procs: list[_Proc], syncer: _Proc | None, out: str, s: DemoSettings, t0: float) -> bool:
    """Show progress until every process ended; False on a failure or the timeout (the caller kills)."""
    last_print = 0.0
    while True:
        failed = [p for p in procs if p.popen.poll() not in (None, 0)]
        if failed:
            for p in failed:
                log.error("%s exited with code %s (see %s/%s.log); stopping every process", p.name,
                          p.popen.returncode, out, p.name)
            return False
        if all(p.popen.poll() is not None for p in procs):
            return True
        if time.time() - t0 > s.timeout_s:
            log.error("timeout after %.0fs (--timeout-s); stopping every process", s.timeout_s)
            return False
        if time.time() - last_print >= 5.0:
            parts = []
            for p in procs:
                if p is not syncer:
                    step, loss = _progress(out, p.name)
                    parts.append(f"{p.name} {step}/{s.steps}" + (f" loss {loss:.3f}" if loss is not None else ""))
            log.info("%s | rounds %d | %.0fs", " | ".join(parts), _rounds(out), time.time() - t0)
            last_print = time.time()
        time.sleep(0.5)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else round(a / b, 4)


def summarize_run(out: str, s: DemoSettings, wall: float, ok: bool, with_islands: bool = True) -> dict[str, Any]:
    """The summary JSON: per-run losses, the merged model vs the baselines, sync figures."""
    names = [n for n in run_names(s, with_islands) if n.startswith("island")]
    runs: dict[str, dict[str, Any] | None] = {}
    for n in run_names(s, with_islands):
        try:
            with open(os.path.join(out, f"{n}.json")) as fh:
                r = json.load(fh)
            runs[n] = {k: r[k] for k in ("layout", "first_loss", "train_loss", "eval_loss", "digest", "versions")}
        except (OSError, ValueError, KeyError):
            runs[n] = None
    moved = 0
    sync_share = {}
    for n in names:
        path = os.path.join(out, f"{n}.steplog.jsonl")
        if os.path.exists(path):
            st = summarize(path)
            moved += st.data_bytes_sent + st.data_bytes_recv + st.control_bytes_sent + st.control_bytes_recv
            sync_share[n] = st.sync_share
    digests = [r["digest"] if (r := runs.get(n)) else None for n in names]
    evals = [r["eval_loss"] for n in names if (r := runs.get(n))]
    merged = sum(evals) / len(evals) if ok and names and len(evals) == len(names) else None
    alone = (runs.get(ALONE) or {}).get("eval_loss")
    dp = (runs.get(DP_BOUND) or {}).get("eval_loss")
    summary: dict[str, Any] = {
        "ok": ok,
        "wall_s": round(wall, 1),
        "islands_count": s.islands,
        "layouts": [s.layout_of(i) for i in range(s.islands)],
        "steps": s.steps,
        "sync_every": s.sync_every,
        "fragments": s.fragments,
        "outer_lr": s.outer_lr,
        "outer_momentum": s.outer_momentum,
        "sync_rounds": s.sync_rounds,
        "flush_merge": s.flush_merge,
        "wire_dtype": s.wire_dtype,
        "micro_batch": s.micro_batch,
        "lr": s.lr,
        "rounds_committed": _rounds(out),
        "bytes_moved": moved,
        "sync_share": sync_share,
        "islands": runs,
        "digests_equal": ok and bool(names) and None not in digests and len(set(digests)) == 1,
        "merged_eval_loss": merged,
        "eval_loss_spread": (max(evals) - min(evals)) if merged is not None else None,
        "alone_eval_loss": alone,
        "dp_bound_eval_loss": dp,
        "islands_vs_alone": _ratio(merged, alone),
        "islands_vs_dp": _ratio(merged, dp),
        "summary_path": s.summary_path,
    }
    summary["verdict"] = verdict(summary)
    return summary


def verdict(s: dict[str, Any]) -> str:
    """One line: the merged islands vs alone (and vs the data-parallel bound), by held-out loss."""
    merged, alone, dp = s.get("merged_eval_loss"), s.get("alone_eval_loss"), s.get("dp_bound_eval_loss")
    if merged is None:
        return "verdict: none — the islands did not all finish"
    n = s.get("islands_count", 0)
    if alone is None:
        text = f"verdict: the merged islands reach held-out loss {merged:.3f} (no alone baseline to compare)"
    else:
        r = merged / alone
        word = "BETTER" if r < 1 else "WORSE" if r > 1 else "EQUAL"
        text = (f"verdict: merged {n} islands {merged:.3f} vs alone {alone:.3f} held-out loss: {word} than one "
                f"island alone by {abs(1 - r) * 100:.1f}% (islands/alone = {r:.3f})")
    if dp is not None:
        text += f"; data-parallel bound {dp:.3f} (islands/dp = {merged / dp:.3f})"
    return text


def format_summary(s: dict[str, Any]) -> str:
    """The final table: one row per run, the held-out loss being the final model's."""
    rows = [f"{'run':<10} {'layout':<8} {'first loss':>10} {'train loss':>10} {'held-out':>10} {'sync share':>10}"]
    for n, r in s["islands"].items():
        if r is None:
            rows.append(f"{n:<10} (no result)")
            continue
        share = s["sync_share"].get(n)
        rows.append(f"{n:<10} {r['layout']:<8} {r['first_loss']:>10.3f} {r['train_loss']:>10.3f} "
                    f"{r['eval_loss']:>10.3f} {'-' if share is None else f'{100 * share:.1f}%':>10}")
    rows.append("held-out: loss of the final model (the islands': the merged final cut) on the same held-out batches")
    rows.append(f"rounds committed: {s['rounds_committed']}   bytes moved: {s['bytes_moved'] / 2**20:.1f} MiB   "
                f"wall: {s['wall_s']:.0f}s   final-cut digests equal: {s['digests_equal']}")
    rows.append(s["verdict"])
    return "\n".join(rows)


__all__ = ["DemoConfigError", "DemoSettings", "format_summary", "parse_layout", "prepare_out", "run_demo",
           "run_names", "summarize_run", "verdict"]

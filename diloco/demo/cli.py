"""``yeto-demo``: a local syncer plus DiLoCo islands training a small GPT on CPU.

What a newcomer runs first. It starts a real ``yeto-syncer`` process and N islands, each a
real multi-process megatron-core GPT (gloo) with its own layout (``tp2`` and ``pp2`` by
default: islands with different layouts sync through canonical global tensors), plus the
same model trained **alone** (island 0's initial weights and data stream, no sync) as the
baseline. It shows live progress, then prints a summary — loss per run, the held-out loss of
the final merged model vs alone (the verdict), rounds committed, bytes moved, share of step
time spent in sync — runs the step-log report, saves its plots, and writes the summary as
JSON (``--summary``, default ``<out>/summary.json``), including a digest of each island's
global parameters after the final cut: they must be equal. The picture (``<out>/steplog.png``)
opens with every run's loss on one chart, rounds marked, the verdict as its title; TensorBoard
event files of every run are in ``<out>/tb`` (``tensorboard --logdir <out>/tb``), and
``--metrics-port`` lets Prometheus scrape the syncer while it runs. The machinery lives in
:mod:`diloco.demo.runner` (shared with ``benchmarks/bench_quality.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from types import FrameType

from diloco.config import WIRE_DTYPE_NAMES
from diloco.demo import runner
from diloco.demo.runner import DemoConfigError, DemoSettings
from diloco.steplog import StepRecord, read_steplog
from diloco.steplog_report import Comparison, format_table, plot_logs, summarize

log = logging.getLogger("yeto-demo")
EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    d = DemoSettings()
    p = argparse.ArgumentParser(prog="yeto-demo", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--islands", type=int, default=d.islands, help=f"number of islands (default {d.islands})")
    p.add_argument("--layouts", default=",".join(d.layouts),
                   help="comma-separated layout per island, e.g. tp2,pp2 or tp2,tp1 (cycled; default "
                        f"{','.join(d.layouts)}); TP divides the 4 heads and 2 query groups, PP divides --layers")
    p.add_argument("--steps", type=int, default=d.steps, help=f"inner steps per island (default {d.steps})")
    p.add_argument("--fragments", type=int, default=d.fragments,
                   help=f"fragments the model is cut into, 1..--layers (default {d.fragments})")
    p.add_argument("--sync-every", type=int, default=d.sync_every,
                   help=f"H: inner steps between two syncs of the same fragment (default {d.sync_every})")
    p.add_argument("--outer-lr", type=float, default=d.outer_lr,
                   help=f"syncer's outer Nesterov learning rate (default {d.outer_lr})")
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum,
                   help=f"syncer's outer Nesterov momentum (default {d.outer_momentum})")
    rounds = p.add_mutually_exclusive_group()
    rounds.add_argument("--sync-rounds", dest="sync_rounds", action="store_true", default=d.sync_rounds,
                        help="islands hold at each round's step until its commit is installed: synchronous, "
                             f"reproducible{' (default)' if d.sync_rounds else ''}")
    rounds.add_argument("--async-rounds", dest="sync_rounds", action="store_false",
                        help="islands never wait: a commit is installed whenever it has arrived"
                             f"{'' if d.sync_rounds else ' (default)'}")
    p.add_argument("--out", default=d.out, help=f"output directory, empty or new (default {d.out})")
    p.add_argument("--overwrite", action="store_true", help="reuse a non-empty --out (removes the old run's files)")
    p.add_argument("--summary", default=None, help="write the summary JSON here (default <out>/summary.json)")
    p.add_argument("--no-baseline", action="store_true", help="skip the alone baseline (faster)")
    p.add_argument("--dp-bound", action="store_true",
                   help="also train one job on every island's data at once (the data-parallel upper bound)")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"model width (default {d.hidden})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"transformer layers (default {d.layers})")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch,
                   help=f"sequences per island step (default {d.micro_batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"inner Adam learning rate (default {d.lr})")
    p.add_argument("--wire-dtype", default=d.wire_dtype,
                   help=f"pushes and broadcasts: {' or '.join(WIRE_DTYPE_NAMES)} (default {d.wire_dtype})")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s,
                   help=f"give up after this long (default {d.timeout_s:.0f})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device,
                   help="cpu (default) or cuda: every rank on a visible GPU (rank %% GPUs)")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node,
                   help="> 0: islands install the gloo bridge with this many ranks per node (1 bridges every group)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="> 0: the syncer serves Prometheus metrics and /healthz on 127.0.0.1:PORT (needs the "
                        "metrics extra)")
    return p


def settings_from_args(argv: list[str] | None = None) -> DemoSettings:
    a = _parser().parse_args(argv)
    return DemoSettings(
        islands=a.islands, layouts=tuple(x.strip() for x in a.layouts.split(",") if x.strip()), steps=a.steps,
        fragments=a.fragments, sync_every=a.sync_every, outer_lr=a.outer_lr, outer_momentum=a.outer_momentum,
        out=a.out, overwrite=a.overwrite, summary=a.summary, baseline=not a.no_baseline, dp_bound=a.dp_bound,
        hidden=a.hidden, layers=a.layers, micro_batch=a.micro_batch, lr=a.lr, wire_dtype=a.wire_dtype,
        timeout_s=a.timeout_s, device=a.device, ranks_per_node=a.ranks_per_node, sync_rounds=a.sync_rounds,
        metrics_port=a.metrics_port)


def comparison(out: str, settings: DemoSettings, records: list[tuple[str, list[StepRecord]]],
               verdict: str) -> Comparison:
    """The picture's first panel: every run's loss (its progress file), island 0's applied rounds."""
    losses: dict[str, list[tuple[int, float]]] = {}
    for name in runner.run_names(settings):
        try:
            with open(os.path.join(out, f"{name}.progress.jsonl")) as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
            losses[name] = [(int(r["step"]), float(r["loss"])) for r in rows]
        except (OSError, ValueError, KeyError):
            continue
    rounds = [r.step for r in records[0][1] if any(e["type"] == "apply" for e in r.events)] if records else []
    return Comparison(losses=losses, rounds=rounds, title=verdict)


def _terminate(signum: int, _frame: FrameType | None) -> None:
    # SystemExit unwinds through run_demo's finally, which kills every process group.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``yeto-demo``; returns the exit status (0 only if every process succeeded
    and the final digests are equal)."""
    settings = settings_from_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = runner.run_demo(settings)
    except DemoConfigError as exc:
        print(f"yeto-demo: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(runner.format_summary(summary))
    out = os.path.abspath(settings.out)
    logs = [os.path.join(out, f"{n}.steplog.jsonl") for n in runner.run_names(settings) if n.startswith("island")]
    logs = [p for p in logs if os.path.exists(p)]
    if logs:
        print(format_table([summarize(p) for p in logs]))
        png = os.path.join(out, "steplog.png")
        try:
            records = [(os.path.basename(p), read_steplog(p)) for p in logs]
            plot_logs(records, png, comparison(out, settings, records, summary["verdict"]))
            print(f"step-log plots: {png}")
        except ImportError:
            print("step-log plots skipped: matplotlib is not installed")
    if os.path.isdir(os.path.join(out, "tb")):
        print(f"TensorBoard: tensorboard --logdir {os.path.join(out, 'tb')}")
    print(f"summary JSON: {summary['summary_path']}")
    return 0 if summary["ok"] and summary["digests_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

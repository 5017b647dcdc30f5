"""``yeto-demo``: a local syncer plus DiLoCo islands training a small GPT on CPU.

What a newcomer runs first. It starts a real ``yeto-syncer`` process and N islands, each a
real multi-process megatron-core GPT (gloo) with its own layout (``tp2`` and ``pp2`` by
default: islands with different layouts sync through canonical global tensors), plus the
same model trained **alone** (island 0's data stream, no sync) as the baseline. It shows
live progress, then prints a summary — loss per island vs alone, rounds committed, bytes
moved, share of step time spent in sync — runs the step-log report and saves its plots,
and optionally writes the summary as JSON (``--summary``), including a digest of each
island's global parameters after the final cut: they must be equal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO

from diloco.demo.island import parse_layout
from diloco.steplog_report import format_table, plot_logs, summarize
from diloco.steplog import read_steplog

log = logging.getLogger("yeto-demo")


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: IO[str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="yeto-demo", description=__doc__.splitlines()[0])
    p.add_argument("--islands", type=int, default=2, help="number of islands (default 2)")
    p.add_argument("--layouts", default="tp2,pp2",
                   help="comma-separated layout per island, e.g. tp2,pp2 or tp2,tp1 (cycled; default tp2,pp2)")
    p.add_argument("--steps", type=int, default=240, help="inner steps per island (default 240)")
    p.add_argument("--fragments", type=int, default=4, help="fragments the model is cut into (default 4)")
    p.add_argument("--sync-every", type=int, default=40,
                   help="H: inner steps between two syncs of the same fragment (default 40)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="syncer's outer Nesterov learning rate (0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="syncer's outer Nesterov momentum (0.9)")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--summary", default=None, help="write the summary as JSON to this file")
    p.add_argument("--no-baseline", action="store_true", help="skip the alone baseline (faster)")
    p.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long (default 1800)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default) or cuda: every rank on a visible GPU (rank %% GPUs)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="> 0: islands install the gloo bridge with this many ranks per node (1 bridges every group)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``yeto-demo``; returns the exit status (0 only if every process succeeded
    and the final digests are equal)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    if args.islands < 1 or not layouts:
        print("yeto-demo: --islands must be >= 1 and --layouts non-empty", file=sys.stderr)
        return 2
    for lay in layouts:
        try:
            parse_layout(lay)
        except ValueError as exc:
            print(f"yeto-demo: --layouts: {exc}", file=sys.stderr)
            return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        if old.endswith((".progress.jsonl", ".steplog.jsonl", ".json")) or old == "events.jsonl":
            os.remove(os.path.join(out, old))
    key = secrets.token_hex(16)
    key_file = os.path.join(out, "sync.key")
    with open(key_file, "w") as fh:
        fh.write(key)
    env = {**os.environ, "YETO_SYNC_KEY": key, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    t0 = time.time()
    procs: list[_Proc] = []

    def spawn(name: str, cmd: list[str]) -> _Proc:
        fh = open(os.path.join(out, f"{name}.log"), "w")
        proc = _Proc(name, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env), fh)
        procs.append(proc)
        return proc

    syncer = spawn("syncer", [sys.executable, "-m", "diloco.syncer", "--bind", addr, "--islands", str(args.islands),
                              "--sync-every", str(args.sync_every), "--total-steps", str(args.steps),
                              "--checkpoint-dir", os.path.join(out, "ckpt"), "--checkpoint-every", "4",
                              "--key-file", key_file, "--event-log", os.path.join(out, "events.jsonl"),
                              "--quorum-timeout-s", "120", "--final-timeout-s", "300",
                              "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)])
    names = []
    common = ["--steps", str(args.steps), "--fragments", str(args.fragments), "--out", out, "--hidden",
              str(args.hidden), "--layers", str(args.layers), "--timeout-s", str(args.timeout_s),
              "--device", args.device, "--ranks-per-node", str(args.ranks_per_node)]
    for i in range(args.islands):
        name, lay = f"island{i}", layouts[i % len(layouts)]
        names.append(name)
        spawn(name, [sys.executable, "-m", "diloco.demo.island", "--name", name, "--island-id", str(i), "--layout",
                     lay, "--sync-addr", addr, "--data-seed", str(i), *common])
    if not args.no_baseline:
        spawn("alone", [sys.executable, "-m", "diloco.demo.island", "--name", "alone", "--layout", "tp1",
                        "--data-seed", "0", *common])
    log.info("syncer at %s, %d islands (%s), %d steps, H=%d, %d fragments; logs in %s", addr, args.islands,
             ",".join(layouts[i % len(layouts)] for i in range(args.islands)), args.steps, args.sync_every,
             args.fragments, out)
    ok = _watch(procs, syncer, out, args, t0)
    wall = time.time() - t0
    summary = _summarize(out, names, args, wall, ok)
    print(_format_summary(summary))
    logs = [os.path.join(out, f"{n}.steplog.jsonl") for n in names]
    logs = [p for p in logs if os.path.exists(p)]
    if logs:
        print(format_table([summarize(p) for p in logs]))
        png = os.path.join(out, "steplog.png")
        try:
            plot_logs([(os.path.basename(p), read_steplog(p)) for p in logs], png)
            print(f"step-log plots: {png}")
        except ImportError:
            print("step-log plots skipped: matplotlib is not installed")
    if args.summary:
        with open(args.summary, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0 if ok and summary["digests_equal"] else 1


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


def _watch(procs: list[_Proc], syncer: _Proc, out: str, args: argparse.Namespace, t0: float) -> bool:
    """Show progress until every process ended; kill everything on timeout or an island failure."""
    last_print = 0.0
    ok = True
    while True:
        alive = [p for p in procs if p.popen.poll() is None]
        failed = [p for p in procs if p.popen.poll() not in (None, 0)]
        if failed:
            for p in failed:
                log.error("%s exited with code %s (see %s/%s.log)", p.name, p.popen.returncode, out, p.name)
            ok = False
            break
        if not alive:
            break
        if time.time() - t0 > args.timeout_s:
            log.error("timeout after %.0fs", args.timeout_s)
            ok = False
            break
        if time.time() - last_print >= 5.0:
            parts = []
            for p in procs:
                if p is syncer:
                    continue
                step, loss = _progress(out, p.name)
                parts.append(f"{p.name} {step}/{args.steps}" + (f" loss {loss:.3f}" if loss is not None else ""))
            log.info("%s | rounds %d | %.0fs", " | ".join(parts), _rounds(out), time.time() - t0)
            last_print = time.time()
        time.sleep(0.5)
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
        p.popen.wait(timeout=30)
        p.log.close()
    return ok


def _summarize(out: str, names: list[str], args: argparse.Namespace, wall: float, ok: bool) -> dict:
    islands = {}
    for n in names + ([] if args.no_baseline else ["alone"]):
        try:
            with open(os.path.join(out, f"{n}.json")) as fh:
                islands[n] = json.load(fh)
        except (OSError, ValueError):
            islands[n] = None
    moved = 0
    sync_share = {}
    for n in names:
        path = os.path.join(out, f"{n}.steplog.jsonl")
        if os.path.exists(path):
            s = summarize(path)
            moved += s.data_bytes_sent + s.data_bytes_recv + s.control_bytes_sent + s.control_bytes_recv
            sync_share[n] = s.sync_share
    digests = [islands[n]["digest"] if islands.get(n) else None for n in names]
    return {
        "ok": ok,
        "wall_s": round(wall, 1),
        "steps": args.steps,
        "sync_every": args.sync_every,
        "fragments": args.fragments,
        "rounds_committed": _rounds(out),
        "bytes_moved": moved,
        "sync_share": sync_share,
        "islands": {n: (None if r is None else {k: r[k] for k in ("layout", "first_loss", "train_loss",
                                                                   "eval_loss", "digest", "versions")})
                    for n, r in islands.items()},
        "digests_equal": ok and None not in digests and len(set(digests)) == 1,
    }


def _format_summary(s: dict) -> str:
    rows = [f"{'run':<10} {'layout':<8} {'first loss':>10} {'train loss':>10} {'eval loss':>10} {'sync share':>10}"]
    for n, r in s["islands"].items():
        if r is None:
            rows.append(f"{n:<10} (no result)")
            continue
        share = s["sync_share"].get(n)
        rows.append(f"{n:<10} {r['layout']:<8} {r['first_loss']:>10.3f} {r['train_loss']:>10.3f} "
                    f"{r['eval_loss']:>10.3f} {'-' if share is None else f'{100 * share:.1f}%':>10}")
    rows.append(f"rounds committed: {s['rounds_committed']}   bytes moved: {s['bytes_moved'] / 2**20:.1f} MiB   "
                f"wall: {s['wall_s']:.0f}s   final-cut digests equal: {s['digests_equal']}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())

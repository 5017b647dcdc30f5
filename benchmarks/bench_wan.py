"""Two islands over emulated WAN links (tests/support/linkemu.py): what slow links cost a run.

    python benchmarks/bench_wan.py [--model-mib 256] [--steps 60] [--sync-every 20] [--smoke]

For each case (50 MB/s / 25 ms and 10 MB/s / 50 ms, pushes in fp32 and q4) a real syncer and
2 real islands (plain PyTorch, ``TorchLayout``), each island behind its own link, train
``--steps`` steps of ``--step-s`` seconds.  Reported per case, as ratios against baselines of
the same run:

* ``sync_share``: the islands' wall time outside their own steps during training, over training;
* ``installed``: rounds whose commit changed the model during training, of those scheduled;
* ``start_over_floor``: start-up time over its physical floor (INIT bytes / rate: the islands start
  from one seed and claim it, so no cut is downloaded, docs/PROTOCOL.md "Claimed values");
* ``finish_over_floor``: finish time over its floor (one push of every fragment up, the final
  fp32 cut down);
* ``predicted_s`` / ``measured_s``: one round's transfer (push up + broadcast down) as the
  syncer predicted it from the link it measured (each commit event's ``predicted_s``, for the
  island that pushed last), and as measured: push → merged value in at that island (step logs:
  the push record's ``time`` to the apply's ``arrived_at``); medians over the training rounds,
  and ``predicted_over_measured``. ``nominal_s``: the same prediction from the emulated rate;
* ``rejoins``: redials of both islands (0 expected).

The last line is one JSON object.  ``--smoke``: a 2 MiB model at 4 MB/s, one case, seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import linkemu  # noqa: E402
import wan_harness  # noqa: E402

from diloco.steplog import read_steplog  # noqa: E402
from diloco.syncer.links import predict_fit, wire_bytes_per_elem  # noqa: E402

log = logging.getLogger("bench_wan")


def _round_latencies(steplogs: list[Path]) -> dict[tuple[int, int], tuple[int, float]]:
    """Per training round (fragment, round), its transfer as measured: push → merged value in, at
    the island that pushed last (it waits for no other island's push), from the step logs: a
    push's record ``time`` (the end of the boundary that queued it) to its round's apply
    ``arrived_at`` (the last part in). Returns (that island, seconds). It includes the syncer's
    commit, which is small beside the link."""
    pushed: dict[tuple[int, int], dict[int, float]] = {}
    arrived: dict[tuple[int, int], dict[int, float]] = {}
    for i, path in enumerate(steplogs):
        for rec in read_steplog(str(path)):
            for e in rec.events:
                if e["type"] == "push" and e["data_bytes"] > 0 and not e["dropped"]:
                    pushed.setdefault((e["fragment"], e["round"]), {})[i] = rec.time
                elif e["type"] == "apply" and "arrived_at" in e:
                    arrived.setdefault((e["fragment"], e["round"]), {})[i] = e["arrived_at"]
    out = {}
    for key, at in arrived.items():
        starts = pushed.get(key, {})
        if len(starts) == len(steplogs) and set(at) == set(starts):
            last = max(starts, key=lambda i: starts[i])
            out[key] = (last, at[last] - starts[last])
    return out


def _predicted_vs_measured(commits: list[dict], measured: dict[tuple[int, int], tuple[int, float]]
                           ) -> tuple[float, float, int]:
    """Medians over the rounds that have both: the syncer's own prediction for the island that
    pushed last (the commit event's ``predicted_s``, from the link it measured) and the measured
    transfer. Returns (predicted s, measured s, rounds)."""
    pairs = []
    for c in commits:
        got = measured.get((c["fragment"], c["round"]))
        if got is not None and str(got[0]) in c.get("predicted_s", {}):
            pairs.append((c["predicted_s"][str(got[0])], got[1]))
    if not pairs:
        return float("nan"), float("nan"), 0
    return statistics.median(p for p, _ in pairs), statistics.median(m for _, m in pairs), len(pairs)


def _case(name: str, rate: float, delay: float, dtype: str, args: argparse.Namespace, out: Path) -> dict:
    spec = linkemu.LinkSpec(up_bytes_s=rate, down_bytes_s=rate, delay_s=delay)
    run = wan_harness.WanRun(model_mib=args.model_mib, width=args.width, links=[spec, spec], steps=args.steps,
                             sync_every=args.sync_every, fragments=args.fragments, step_s=args.step_s,
                             wire_dtype=dtype, part_mib=args.part_mib, heartbeat_s=1.0, sync_timeout_s=30.0,
                             timeout_s=args.timeout_s)
    t0 = time.monotonic()
    res = wan_harness.run(run, out)
    wall = time.monotonic() - t0
    ok = all(c == 0 for c in res.island_codes) and res.syncer_code == 0
    ok = ok and len({r.get("digest") for r in res.islands}) == 1
    model_bytes = sum(p.numel() for p in wan_harness.build_model(args.model_mib, args.width).parameters()) * 4
    frag_elems = model_bytes // 4 // args.fragments
    # Sync share: boundary time (export, apply, wait) over training time, from the step logs.
    share = []
    for i in range(2):
        recs = [r for r in read_steplog(str(out / f"island{i}.steplog.jsonl")) if r.phase == "train"]
        sync = sum(r.export_s + r.apply_s + r.wait_s for r in recs)
        total = sum(r.step_s for r in recs) + sync
        share.append(sync / total if total else float("nan"))
    commits = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()] if ok else []
    commits = [c for c in commits if "pushed" in c and "dropped" not in c]
    scheduled = args.steps * args.fragments // args.sync_every
    installed = sum(1 for c in commits if c.get("changed") and not c.get("flush"))
    # INIT up only: both islands start from one seed and claim it, so neither downloads its cut (HELD).
    start_floor = model_bytes / rate
    finish_floor = model_bytes * wire_bytes_per_elem(dtype) / 4 / rate + model_bytes / rate  # pushes up, fp32 final
    fit = predict_fit(frag_elems, dtype, rate, rate, 2 * delay, args.sync_every, args.fragments, args.step_s)
    finish_s = max(r.get("finish_s", 0) for r in res.islands) or float("nan")
    latencies = _round_latencies([out / f"island{i}.steplog.jsonl" for i in range(2)])
    predicted, measured, n_rounds = _predicted_vs_measured([c for c in commits if not c.get("flush")], latencies)
    return {
        "case": name, "ok": ok, "wall_s": round(wall, 1),
        "sync_share": round(max(share), 4),
        "installed": installed, "scheduled": scheduled,
        "start_s": round(max(r.get("start_s", 0) for r in res.islands), 2),
        "start_over_floor": round(max(r.get("start_s", 0) for r in res.islands) / start_floor, 3),
        "finish_s": round(finish_s, 2), "finish_over_floor": round(finish_s / finish_floor, 3),
        "nominal_s": round(fit.up_s + fit.down_s, 2), "predicted_s": round(predicted, 2),
        "measured_s": round(measured, 2), "measured_rounds": n_rounds,
        "predicted_over_measured": round(predicted / measured, 3),
        "fits": fit.fits, "need_sync_every": fit.need_sync_every,
        "rejoins": sum(r.get("redials", 0) for r in res.islands),
        "warned": "raise --sync-every" in res.syncer_log,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-mib", type=float, default=256.0)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.5, help="seconds each step sleeps on top of its compute")
    p.add_argument("--part-mib", type=float, default=8.0)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every link rate (e.g. 0.1 with a 10x smaller model)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="", help="comma-separated case names (default: all four)")
    p.add_argument("--smoke", action="store_true", help="a 2 MiB model at 4 MB/s, one case (seconds)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases = [("50MBps_25ms_fp32", 50e6, 0.025, "float32"), ("50MBps_25ms_q4", 50e6, 0.025, "q4"),
             ("10MBps_50ms_fp32", 10e6, 0.050, "float32"), ("10MBps_50ms_q4", 10e6, 0.050, "q4")]
    if args.smoke:
        args.model_mib, args.width, args.steps, args.sync_every, args.step_s, args.part_mib = 2, 256, 16, 8, 0.2, 0.5
        cases = [("smoke_4MBps_10ms_fp32", 4e6, 0.010, "float32")]
    if args.only:
        unknown = set(args.only.split(",")) - {c[0] for c in cases}
        if unknown:
            p.error(f"--only: unknown cases {sorted(unknown)}; known: {[c[0] for c in cases]}")
        cases = [c for c in cases if c[0] in args.only.split(",")]
    base = Path(args.out or tempfile.mkdtemp(prefix="bench_wan_"))
    rows = []
    for name, rate, delay, dtype in cases:
        row = _case(name, rate * args.scale, delay, dtype, args, base / name)
        log.info("%s", json.dumps(row))
        rows.append(row)
    print(json.dumps({"bench": "wan", "model_mib": args.model_mib, "steps": args.steps, "sync_every": args.sync_every,
                      "fragments": args.fragments, "step_s": args.step_s, "cases": rows,
                      "ok": all(r["ok"] for r in rows)}))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

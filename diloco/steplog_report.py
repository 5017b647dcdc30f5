"""Summaries and plots of step logs: the ``yeto-steplog`` console script.

``yeto-steplog LOG [LOG...] [--plot FILE.png] [--json]`` reads one step log per
island (written by :class:`diloco.steplog.StepLog`) and answers the questions
one asks of a DiLoCo run: what share of the step time went to synchronisation,
how the boundary time splits into export / apply / waiting, how long the slow
boundaries were (p95, max), how many bytes one committed round costs, and how
stale the applied values were. The table puts one island per column so islands
can be compared side by side; ``--json`` prints the same numbers for scripts;
``--plot`` draws boundary time per step, stacked by phase, with the loss and a
marker at every applied round, one panel per island.

Definitions (the tests pin these):
    train records   records with phase "train" (one per training step); the boundary
                    time figures and the step count use only these, while start-up
                    and finish() are reported as their own totals (start_s, finish_s)
    finish_s        sum(blocked_s) of the "finish" records: what finish() blocked in its
                    own work (applies, the final cut's install); not its waits
    finish_wall_s   the last "finish" record's time - the last "train" record's time: the
                    last step's end to the final cut installed, waits for the flush rounds
                    included (None without both)
    percentiles     linear interpolation between closest ranks (numpy's default)
    other_s         blocked_s - export_s - apply_s - wait_s, floored at 0
    sync_share      sum(blocked_s) / sum(step_s + blocked_s) over train records
    rounds          number of ``apply`` events (committed rounds this island applied)
    bytes per round sum of ``data_bytes`` of ``push`` events / rounds (sent) and of
                    ``apply`` events / rounds (received): only what rounds move, not
                    INIT, the initial or final cut, headers or heartbeats
    data / control  totals over every record: payload bytes (the events' data_bytes)
                    and control bytes (headers, heartbeats; per record)
    lag_steps       from ``apply`` events (steps between push and apply of a round)
    commit s        the syncer's commit time of each applied version (``apply`` events)
    link            the last ``link`` event: up/down throughput and RTT the client measured
    version lag     for each round this island both pushed and applied:
                    applied version - 1 - push base_version, i.e. how many
                    commits of that fragment the push's anchor was behind

matplotlib is imported only for ``--plot`` (Agg backend), so the table works on
a machine without a display or without matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from diloco.steplog import StepLogContents, StepRecord, read_steplog_contents


@dataclass(frozen=True)
class IslandSummary:
    """The numbers of one step log. Times in seconds unless the name says ms;
    ``None`` where there was nothing to measure (e.g. no apply events)."""

    path: str
    island: int | None
    records: int
    steps: int
    first_step: int | None
    last_step: int | None
    malformed_lines: int
    truncated_tail: bool
    start_s: float
    finish_s: float
    finish_wall_s: float | None
    boundary_ms_p50: float | None
    boundary_ms_p95: float | None
    boundary_ms_max: float | None
    step_total_s: float
    boundary_total_s: float
    export_s: float
    apply_s: float
    wait_s: float
    other_s: float
    export_share: float | None
    apply_share: float | None
    wait_share: float | None
    other_share: float | None
    sync_share: float | None
    rounds: int
    round_bytes_sent: int
    round_bytes_recv: int
    data_bytes_sent: int
    data_bytes_recv: int
    control_bytes_sent: int
    control_bytes_recv: int
    bytes_sent_per_round: float | None
    bytes_recv_per_round: float | None
    bytes_per_push: float | None
    """Payload bytes of a weighted push, on average (what the wire carried)."""
    push_compression: float | None
    """fp32 bytes of the pushed deltas / their wire bytes (1 fp32, 2 bf16, ~3.9 int8, ~7.5 q4)."""
    pushes: int
    applies: int
    lag_steps_p50: float | None
    lag_steps_max: int | None
    version_lag_p50: float | None
    version_lag_max: int | None
    final_loss: float | None
    commit_s_p50: float | None = None
    """The syncer's commit time of the applied versions (``apply`` events' ``commit_s``)."""
    commit_s_max: float | None = None
    stage_s_p50: float | None = None
    """This island's background staging of applied round values (``apply`` events' ``stage_s``)."""
    stage_s_max: float | None = None
    link_up_mb_s: float | None = None
    """The link as the client last measured it (``link`` events): up and down MB/s, RTT ms."""
    link_down_mb_s: float | None = None
    link_rtt_ms: float | None = None


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _event_int(event: dict[str, Any], key: str) -> int | None:
    value = event.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def version_lags(records: Sequence[StepRecord]) -> list[int]:
    """Version staleness of each round this island pushed and then applied.

    Pairs each ``apply`` event with this island's ``push`` for the same
    (fragment, round), latest attempt wins (earlier attempts were dropped by
    the syncer). Rounds without both halves, or with fields missing, are
    skipped: the quantity is simply not derivable for them.
    """
    base_by_round: dict[tuple[int, int], int] = {}
    lags: list[int] = []
    for record in records:
        for event in record.events:
            fragment, rnd = _event_int(event, "fragment"), _event_int(event, "round")
            if fragment is None or rnd is None:
                continue
            if event["type"] == "push":
                base = _event_int(event, "base_version")
                if base is not None:
                    base_by_round[(fragment, rnd)] = base
            elif event["type"] == "apply":
                version = _event_int(event, "version")
                base = base_by_round.pop((fragment, rnd), None)
                if version is not None and base is not None:
                    lags.append(version - 1 - base)
    return lags


def summarize(path: str, contents: StepLogContents | None = None) -> IslandSummary:
    """Compute the :class:`IslandSummary` of one step log (read from ``path``
    unless its ``contents`` were already read)."""
    if contents is None:
        contents = read_steplog_contents(path)
    records = contents.records
    train = [r for r in records if r.phase == "train"]
    boundary = [r.blocked_s for r in train]
    step_total = math.fsum(r.step_s for r in train)
    boundary_total = math.fsum(boundary)
    export = math.fsum(r.export_s for r in train)
    apply = math.fsum(r.apply_s for r in train)
    wait = math.fsum(r.wait_s for r in train)
    other = math.fsum(max(0.0, r.blocked_s - r.export_s - r.apply_s - r.wait_s) for r in train)
    applies = [e for r in records for e in r.events if e["type"] == "apply"]
    pushes = [e for r in records for e in r.events if e["type"] == "push"]
    weighted = [e for e in pushes if (_event_int(e, "data_bytes") or 0) > 0 and not e.get("dropped")]
    lag_steps = [v for v in (_event_int(e, "lag_steps") for e in applies) if v is not None]
    commits = [float(e["commit_s"]) for e in applies if isinstance(e.get("commit_s"), (int, float)) and e["commit_s"] > 0]
    stages = [float(e["stage_s"]) for e in applies if isinstance(e.get("stage_s"), (int, float))]
    links = [e for r in records for e in r.events if e["type"] == "link"]
    link = links[-1] if links else {}
    vlags = version_lags(records)
    rounds = len(applies)
    sent = sum(_event_int(e, "data_bytes") or 0 for e in pushes)
    recv = sum(_event_int(e, "data_bytes") or 0 for e in applies)
    losses = [r.loss for r in records if r.loss is not None]
    return IslandSummary(
        path=path,
        island=records[-1].island if records else None,
        records=len(records),
        # Distinct steps (a restarted job appending to the same file may repeat some).
        steps=len({r.step for r in train}),
        first_step=train[0].step if train else None,
        last_step=train[-1].step if train else None,
        malformed_lines=contents.malformed,
        truncated_tail=contents.truncated_tail,
        start_s=math.fsum(r.blocked_s for r in records if r.phase == "start"),
        finish_s=math.fsum(r.blocked_s for r in records if r.phase == "finish"),
        finish_wall_s=_finish_wall(records),
        boundary_ms_p50=_ms(_pct(boundary, 50)),
        boundary_ms_p95=_ms(_pct(boundary, 95)),
        boundary_ms_max=_ms(max(boundary) if boundary else None),
        step_total_s=step_total,
        boundary_total_s=boundary_total,
        export_s=export,
        apply_s=apply,
        wait_s=wait,
        other_s=other,
        export_share=_share(export, boundary_total),
        apply_share=_share(apply, boundary_total),
        wait_share=_share(wait, boundary_total),
        other_share=_share(other, boundary_total),
        sync_share=_share(boundary_total, step_total + boundary_total),
        rounds=rounds,
        round_bytes_sent=sent,
        round_bytes_recv=recv,
        data_bytes_sent=sum(r.data_bytes_sent for r in records),
        data_bytes_recv=sum(r.data_bytes_recv for r in records),
        control_bytes_sent=sum(r.control_bytes_sent for r in records),
        control_bytes_recv=sum(r.control_bytes_recv for r in records),
        bytes_sent_per_round=sent / rounds if rounds else None,
        bytes_recv_per_round=recv / rounds if rounds else None,
        bytes_per_push=(math.fsum(e["data_bytes"] for e in weighted) / len(weighted)) if weighted else None,
        push_compression=(math.fsum(e.get("fp32_bytes", 0) for e in weighted)
                          / math.fsum(e["data_bytes"] for e in weighted))
        if weighted and all(e.get("fp32_bytes") for e in weighted) else None,
        # Counters are cumulative: the largest seen is the total (max, not
        # last, in case a restarted job appended to the same file).
        pushes=max((r.pushes for r in records), default=0),
        applies=max((r.applies for r in records), default=0),
        lag_steps_p50=_pct(lag_steps, 50),
        lag_steps_max=max(lag_steps) if lag_steps else None,
        version_lag_p50=_pct(vlags, 50),
        version_lag_max=max(vlags) if vlags else None,
        final_loss=losses[-1] if losses else None,
        commit_s_p50=_pct(commits, 50),
        commit_s_max=max(commits) if commits else None,
        stage_s_p50=_pct(stages, 50),
        stage_s_max=max(stages) if stages else None,
        link_up_mb_s=link["up_bytes_s"] / 1e6 if "up_bytes_s" in link else None,
        link_down_mb_s=link["down_bytes_s"] / 1e6 if "down_bytes_s" in link else None,
        link_rtt_ms=link["rtt_s"] * 1e3 if "rtt_s" in link else None,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


# --- text table -------------------------------------------------------------


def _num(value: float | int | None, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return fmt.format(value)


def _bytes(value: float | int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _pct_str(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _phase(total: float, share: float | None) -> str:
    return f"{total:.3f} s ({_pct_str(share)})"


def _finish_wall(records: Sequence[StepRecord]) -> float | None:
    """The last finish record's time minus the last train record's (None without both)."""
    train = [r.time for r in records if r.phase == "train"]
    finish = [r.time for r in records if r.phase == "finish"]
    return max(0.0, finish[-1] - train[-1]) if train and finish else None


def format_table(summaries: Sequence[IslandSummary]) -> str:
    """Render the summaries as a plain-text table, one column per log."""
    rows: list[tuple[str, list[str]]] = [
        ("log", [os.path.basename(s.path) for s in summaries]),
        ("island", [_num(s.island, "{}") for s in summaries]),
        ("steps", [f"{s.steps} ({_num(s.first_step, '{}')}..{_num(s.last_step, '{}')})" for s in summaries]),
        ("records", [str(s.records) for s in summaries]),
        ("skipped lines", [f"{s.malformed_lines}{' +truncated' if s.truncated_tail else ''}" for s in summaries]),
        ("boundary ms p50", [_num(s.boundary_ms_p50, "{:.3f}") for s in summaries]),
        ("boundary ms p95", [_num(s.boundary_ms_p95, "{:.3f}") for s in summaries]),
        ("boundary ms max", [_num(s.boundary_ms_max, "{:.3f}") for s in summaries]),
        ("start-up", [f"{s.start_s:.3f} s" for s in summaries]),
        ("finish (blocked)", [f"{s.finish_s:.3f} s" for s in summaries]),
        ("last step -> final cut", [_num(s.finish_wall_s, "{:.3f} s") for s in summaries]),
        ("boundary total", [f"{s.boundary_total_s:.3f} s" for s in summaries]),
        ("  export", [_phase(s.export_s, s.export_share) for s in summaries]),
        ("  apply", [_phase(s.apply_s, s.apply_share) for s in summaries]),
        ("  wait", [_phase(s.wait_s, s.wait_share) for s in summaries]),
        ("  other", [_phase(s.other_s, s.other_share) for s in summaries]),
        ("sync share of step time", [_pct_str(s.sync_share) for s in summaries]),
        ("rounds applied", [str(s.rounds) for s in summaries]),
        ("bytes sent / round", [_bytes(s.bytes_sent_per_round) for s in summaries]),
        ("bytes recv / round", [_bytes(s.bytes_recv_per_round) for s in summaries]),
        ("bytes / push", [_bytes(s.bytes_per_push) for s in summaries]),
        ("push compression", ["-" if s.push_compression is None else f"{s.push_compression:.2f}x"
                              for s in summaries]),
        ("data sent total", [_bytes(s.data_bytes_sent) for s in summaries]),
        ("data recv total", [_bytes(s.data_bytes_recv) for s in summaries]),
        ("control sent total", [_bytes(s.control_bytes_sent) for s in summaries]),
        ("control recv total", [_bytes(s.control_bytes_recv) for s in summaries]),
        ("pushes", [str(s.pushes) for s in summaries]),
        ("applies", [str(s.applies) for s in summaries]),
        ("lag steps p50 / max", [f"{_num(s.lag_steps_p50, '{:g}')} / {_num(s.lag_steps_max, '{}')}" for s in summaries]),
        ("version lag p50 / max", [f"{_num(s.version_lag_p50, '{:g}')} / {_num(s.version_lag_max, '{}')}" for s in summaries]),
        ("syncer commit s p50 / max", [f"{_num(s.commit_s_p50, '{:.2f}')} / {_num(s.commit_s_max, '{:.2f}')}"
                                       for s in summaries]),
        ("stage s p50 / max", [f"{_num(s.stage_s_p50, '{:.2f}')} / {_num(s.stage_s_max, '{:.2f}')}" for s in summaries]),
        ("link up / down MB/s", [f"{_num(s.link_up_mb_s, '{:.1f}')} / {_num(s.link_down_mb_s, '{:.1f}')}"
                                 for s in summaries]),
        ("link RTT ms", [_num(s.link_rtt_ms, "{:.1f}") for s in summaries]),
        ("final loss", [_num(s.final_loss, "{:.4f}") for s in summaries]),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [max(len(cells[i]) for _, cells in rows) for i in range(len(summaries))]
    lines = []
    for n, (label, cells) in enumerate(rows):
        lines.append("  ".join([label.ljust(label_w)] + [c.rjust(w) for c, w in zip(cells, col_w)]).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    # Strict JSON has no NaN/inf (a diverged loss): emit null instead.
    return None if isinstance(value, float) and not math.isfinite(value) else value


def summaries_to_json(summaries: Sequence[IslandSummary]) -> str:
    """The summaries as one strict JSON object ``{"logs": [...]}`` (NaN -> null)."""
    logs = [{k: _json_safe(v) for k, v in asdict(s).items()} for s in summaries]
    return json.dumps({"logs": logs}, allow_nan=False)


# --- plot -------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """The first panel of a picture: every run's training loss on one chart (the demo's question,
    "did DiLoCo pay off?"), the rounds marked, the held-out verdict as the title."""

    losses: dict[str, list[tuple[int, float]]]
    """Run name -> (step, training loss); names starting with ``island`` are drawn solid, the
    baselines (``alone``, ``dp-bound``) dashed."""
    rounds: list[int]
    """Steps at which a round was applied (dotted vertical lines)."""
    title: str
    """The verdict line."""


def _plot_comparison(ax: Any, c: Comparison) -> None:
    import textwrap

    styles = {"alone": ("black", "--"), "dp-bound": ("tab:gray", "--")}
    for k, (name, points) in enumerate(sorted(c.losses.items(), key=lambda kv: (not kv[0].startswith("island"),
                                                                                kv[0]))):
        points = [(s, v) for s, v in points if math.isfinite(v)]
        if not points:
            continue
        steps = np.array([s for s, _ in points], dtype=np.float64)
        values = np.array([v for _, v in points], dtype=np.float64)
        color, style = styles.get(name, (f"C{k}", "-"))
        ax.plot(steps, values, color=color, linestyle=style, linewidth=0.6, alpha=0.3)
        w = max(1, min(10, len(values) // 10))  # a moving mean, so the runs can be told apart
        smooth = np.convolve(values, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1:], smooth, color=color, linestyle=style, linewidth=1.6, label=name)
    if c.rounds:
        ax.vlines(sorted(set(c.rounds)), 0, 1, transform=ax.get_xaxis_transform(), colors="tab:purple",
                  linestyles=":", linewidth=0.6, label="round applied")
    ax.set_title(textwrap.fill(c.title, 110), fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(loc="upper right", fontsize="small")


def plot_logs(logs: Sequence[tuple[str, Sequence[StepRecord]]], out_png: str,
              comparison: Comparison | None = None) -> None:
    """Write a PNG with, first, the ``comparison`` panel when given, then one panel per
    ``(path, records)`` log: boundary ms per step stacked by phase, loss on a second axis, a
    dotted vertical line at each step that applied a round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = 1 if comparison is not None else 0
    fig, axes = plt.subplots(len(logs) + extra, 1, figsize=(10, 3.2 * (len(logs) + extra)), squeeze=False,
                             sharex=False)
    if comparison is not None:
        _plot_comparison(axes[0, 0], comparison)
    colors = {"export": "tab:blue", "apply": "tab:green", "wait": "tab:orange", "other": "tab:gray"}
    for ax, (path, records) in zip(axes[extra:, 0], logs):
        island = records[-1].island if records else "?"
        ax.set_title(f"island {island}: {os.path.basename(path)}")
        ax.set_xlabel("step")
        ax.set_ylabel("boundary time (ms)")
        records = [r for r in records if r.phase == "train"]
        if not records:
            ax.text(0.5, 0.5, "no training records", ha="center", va="center", transform=ax.transAxes)
            continue
        steps = np.array([r.step for r in records], dtype=np.float64)
        phases = {
            "export": np.array([r.export_s for r in records]) * 1e3,
            "apply": np.array([r.apply_s for r in records]) * 1e3,
            "wait": np.array([r.wait_s for r in records]) * 1e3,
            "other": np.array([max(0.0, r.blocked_s - r.export_s - r.apply_s - r.wait_s) for r in records]) * 1e3,
        }
        # Stacked step-fills instead of bars: thousands of steps stay cheap and
        # each step's band is exactly its own value.
        bottom = np.zeros_like(steps)
        for name, values in phases.items():
            ax.fill_between(steps, bottom, bottom + values, step="mid", color=colors[name], alpha=0.8,
                            linewidth=0, label=name)
            bottom = bottom + values
        applied = sorted({r.step for r in records if any(e["type"] == "apply" for e in r.events)})
        if applied:
            ax.vlines(applied, 0, 1, transform=ax.get_xaxis_transform(), colors="black", linestyles=":",
                      linewidth=0.7, label="round applied")
        # Headroom above the tallest boundary so the legend does not hide it.
        ax.set_ylim(0, max(float(bottom.max()), 1e-3) * 1.3)
        ax.legend(loc="upper left", fontsize="small", ncol=5)
        loss_points = [(r.step, r.loss) for r in records if r.loss is not None and math.isfinite(r.loss)]
        if loss_points:
            lax = ax.twinx()
            lax.plot([s for s, _ in loss_points], [v for _, v in loss_points], color="tab:red", linewidth=1.0)
            lax.set_ylabel("loss", color="tab:red")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


# --- CLI --------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yeto-steplog",
        description="Summarise DiLoCo step logs (one per island): boundary time, sync share, bytes, staleness.",
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="step log (JSON lines) of one island")
    parser.add_argument("--plot", metavar="FILE.png", help="also write a plot, one panel per log")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``yeto-steplog``; returns the exit status (2: unreadable log)."""
    args = _parser().parse_args(argv)
    logs: list[tuple[str, StepLogContents]] = []
    for path in args.logs:
        try:
            logs.append((path, read_steplog_contents(path)))
        except OSError as exc:
            print(f"yeto-steplog: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    summaries = [summarize(path, contents) for path, contents in logs]
    print(summaries_to_json(summaries) if args.json else format_table(summaries))
    if args.plot:
        plot_logs([(path, contents.records) for path, contents in logs], args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tests of the step log writer/reader, the ``yeto-steplog`` report and the demo corpus."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest

from diloco.corpus import load_corpus
from diloco.steplog import BoundaryRecord, StepLog, StepRecord, parse_record, read_steplog, read_steplog_contents
from diloco.steplog_report import format_table, main, summarize, version_lags

pytestmark = pytest.mark.timeout(60)


def rec(step: int, **kw: Any) -> StepRecord:
    base: dict[str, Any] = dict(
        step=step, phase="train", pushed=(), applied=(), installed=(), versions=(0, 0), blocked_s=0.0,
        data_bytes_sent=0, data_bytes_recv=0, pushes=0, applies=0,
        time=1_700_000_000.0 + step, step_s=1.0, export_s=0.0, apply_s=0.0, wait_s=0.0,
        control_bytes_sent=0, control_bytes_recv=0, round=0, attempt=-1, events=[], loss=None, island=0,
    )
    base.update(kw)
    return StepRecord(**base)


def write_log(path: Path, records: list[StepRecord]) -> None:
    log = StepLog(str(path))
    for r in records:
        log.record(r)
    log.close()


# A hand-made island log whose summary is worked out by hand below.
HAND_LOG = [
    rec(1, blocked_s=0.010, wait_s=0.002, loss=3.0,
        events=[{"type": "cut", "fragment": 0, "version": 0}, {"type": "cut", "fragment": 1, "version": 0}]),
    rec(2, blocked_s=0.100, export_s=0.060, wait_s=0.020, data_bytes_sent=1000, pushes=1, round=1, attempt=0,
        loss=2.9, events=[{"type": "push", "fragment": 0, "round": 1, "attempt": 0, "base_version": 0,
                           "data_bytes": 1000, "local_steps": 2}]),
    rec(3, blocked_s=0.050, apply_s=0.030, wait_s=0.010, data_bytes_recv=2000, pushes=1, applies=1,
        versions=(1, 0), round=1, attempt=0,
        events=[{"type": "apply", "fragment": 0, "version": 1, "round": 1, "data_bytes": 2000, "lag_steps": 1,
                 "staged_from": 100.0, "stage_s": 0.25}]),
    rec(4, step_s=2.0, blocked_s=0.020, export_s=0.010, wait_s=0.005, data_bytes_sent=3000, pushes=2, applies=1,
        versions=(1, 0), round=2, attempt=0, loss=2.5,
        events=[{"type": "push", "fragment": 1, "round": 2, "attempt": 0, "base_version": 0,
                 "data_bytes": 3000, "local_steps": 2}]),
    # Fragment 1 was committed twice by others meanwhile: applied version 3
    # against base 0 means the push's anchor was 2 commits behind.
    rec(5, blocked_s=0.220, apply_s=0.100, wait_s=0.100, data_bytes_recv=4000, pushes=2, applies=2,
        versions=(1, 3), round=2, attempt=0, loss=2.4,
        events=[{"type": "apply", "fragment": 1, "version": 3, "round": 2, "data_bytes": 4000, "lag_steps": 3,
                 "staged_from": 101.0, "stage_s": 0.75}]),
]


def test_write_read_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "island0.jsonl"
    log = StepLog(str(path))
    assert log.enabled
    for r in HAND_LOG:
        log.record(r)
        # Line-buffered: each record is readable before close.
        assert read_steplog(str(path))[-1] == r
    log.close()
    log.record(rec(99))  # after close: dropped, no error
    assert not log.enabled
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(HAND_LOG)
    assert json.loads(lines[1])["events"][0]["type"] == "push"
    assert read_steplog(str(path)) == HAND_LOG

    disabled = StepLog(None)
    disabled.record(rec(1))
    disabled.close()
    assert not disabled.enabled


def test_nan_loss_survives(tmp_path: Path) -> None:
    path = tmp_path / "nan.jsonl"
    write_log(path, [rec(1, loss=float("nan"))])
    (back,) = read_steplog(str(path))
    assert back.loss is not None and math.isnan(back.loss)


def test_truncated_last_line_then_restart(tmp_path: Path) -> None:
    path = tmp_path / "killed.jsonl"
    write_log(path, HAND_LOG[:2])
    full = json.dumps(dataclasses.asdict(HAND_LOG[2]))
    with open(path, "a", encoding="utf-8") as f:
        f.write(full[: len(full) // 2])  # the writer died mid-line
    contents = read_steplog_contents(str(path))
    assert contents.records == HAND_LOG[:2]
    assert contents.truncated_tail and contents.malformed == 0

    # A restarted job appends: its first record must start on a fresh line,
    # leaving the fragment as one malformed line in the middle.
    write_log(path, HAND_LOG[3:4])
    contents = read_steplog_contents(str(path))
    assert contents.records == HAND_LOG[:2] + HAND_LOG[3:4]
    assert contents.malformed == 1 and not contents.truncated_tail


def test_malformed_lines_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = json.dumps(dataclasses.asdict(HAND_LOG[0]))

    def variant(**changes: Any) -> str:
        obj = dataclasses.asdict(HAND_LOG[1])
        obj.update(changes)
        return json.dumps(obj)

    missing = dataclasses.asdict(HAND_LOG[1])
    del missing["wait_s"]
    bad = [
        "{not json",
        "[1, 2, 3]",
        json.dumps(missing),
        variant(step=True),
        variant(pushes=1.5),
        variant(blocked_s=-0.1),
        variant(data_bytes_sent=-1),
        variant(phase="warmup"),
        variant(pushed=[0.5]),
        variant(versions=[0, "1"]),
        variant(events=[{"fragment": 0}]),
        variant(loss="low"),
    ]
    extra_key = variant(future_field=1)
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([good, *bad, "", extra_key]) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="diloco.steplog"):
        contents = read_steplog_contents(str(path))
    assert contents.records == [HAND_LOG[0], HAND_LOG[1]]
    assert contents.malformed == len(bad)
    assert not contents.truncated_tail
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"skipped {len(bad)} malformed" in warnings[0] and "line 2" in warnings[0]
    with pytest.raises(ValueError, match="wait_s"):
        parse_record(json.dumps(missing))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_write_error_disables_log_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    log = StepLog("/dev/full")
    with caplog.at_level(logging.WARNING, logger="diloco.steplog"):
        log.record(HAND_LOG[0])  # ENOSPC on the line flush
        log.record(HAND_LOG[1])
    assert not log.enabled
    assert sum("step logging disabled" in r.getMessage() for r in caplog.records) == 1
    log.close()


def test_summary_numbers(tmp_path: Path) -> None:
    path = tmp_path / "hand.jsonl"
    write_log(path, HAND_LOG)
    s = summarize(str(path))
    approx = pytest.approx
    assert s.records == 5
    assert (s.island, s.steps, s.first_step, s.last_step, s.malformed_lines) == (0, 5, 1, 5, 0)
    # boundaries sorted: 10, 20, 50, 100, 220 ms; p95 at rank 3.8 -> 100 + 0.8 * 120
    assert s.boundary_ms_p50 == approx(50.0)
    assert s.boundary_ms_p95 == approx(196.0)
    assert s.boundary_ms_max == approx(220.0)
    assert s.boundary_total_s == approx(0.4)
    assert (s.export_s, s.apply_s, s.wait_s) == (approx(0.07), approx(0.13), approx(0.137))
    assert s.other_s == approx(0.063)
    assert s.export_share == approx(0.175)
    assert s.apply_share == approx(0.325)
    assert s.wait_share == approx(0.3425)
    assert s.other_share == approx(0.1575)
    assert s.step_total_s == approx(6.0)
    assert s.sync_share == approx(0.4 / 6.4)
    assert s.rounds == 2  # cut events are not rounds
    assert (s.round_bytes_sent, s.round_bytes_recv) == (4000, 6000)
    assert (s.data_bytes_sent, s.data_bytes_recv) == (4000, 6000)
    assert s.bytes_sent_per_round == approx(2000.0)
    assert s.bytes_recv_per_round == approx(3000.0)
    assert (s.pushes, s.applies) == (2, 2)
    assert s.lag_steps_p50 == approx(2.0) and s.lag_steps_max == 3
    assert s.version_lag_p50 == approx(1.0) and s.version_lag_max == 2
    assert s.final_loss == approx(2.4)
    assert s.stage_s_p50 == approx(0.5) and s.stage_s_max == approx(0.75)
    table = format_table([s])
    assert "sync share of step time" in table and "196.000" in table and "0.50 / 0.75" in table


def test_version_lag_uses_latest_attempt(tmp_path: Path) -> None:
    push = {"type": "push", "fragment": 0, "round": 4, "data_bytes": 1, "local_steps": 1}
    records = [
        rec(1, events=[dict(push, attempt=0, base_version=1)]),
        # re-pulled: the attempt-1 push (anchor advanced to 2) is the one committed
        rec(2, events=[dict(push, attempt=1, base_version=2)]),
        rec(3, events=[{"type": "apply", "fragment": 0, "version": 3, "round": 4}]),
        # an apply with no push of ours (we were not a member) is not derivable
        rec(4, events=[{"type": "apply", "fragment": 1, "version": 7, "round": 5, "lag_steps": None}]),
        # finalization records carry phase "finish", not a training step
        rec(4, phase="finish", step_s=0.0, events=[{"type": "final", "versions": [3, 7]}]),
    ]
    assert version_lags(records) == [0]
    path = tmp_path / "lags.jsonl"
    write_log(path, records)
    s = summarize(str(path))
    assert (s.records, s.steps, s.rounds) == (5, 4, 2)
    assert s.lag_steps_p50 is None and s.lag_steps_max is None
    assert s.version_lag_p50 == 0.0


def test_phases_and_bytes_per_round_from_push_and_apply_events_only(tmp_path: Path) -> None:
    records = [
        rec(0, phase="start", step_s=0.0, blocked_s=5.0, data_bytes_sent=8000, data_bytes_recv=8000,
            control_bytes_sent=300, control_bytes_recv=200, installed=(0, 1),
            events=[{"type": "init", "fragment": 0, "data_bytes": 4000}, {"type": "init", "fragment": 1,
                                                                         "data_bytes": 4000},
                    {"type": "cut", "fragment": 0, "version": 0, "data_bytes": 4000},
                    {"type": "cut", "fragment": 1, "version": 0, "data_bytes": 4000}]),
        *HAND_LOG,
        rec(5, phase="finish", step_s=0.0, blocked_s=2.0, data_bytes_recv=8000, control_bytes_recv=50,
            installed=(0, 1), events=[{"type": "final", "versions": [1, 3], "data_bytes": 8000}]),
    ]
    path = tmp_path / "phases.jsonl"
    write_log(path, records)
    assert read_steplog(str(path)) == records
    s = summarize(str(path))
    assert (s.records, s.steps, s.first_step, s.last_step) == (7, 5, 1, 5)
    assert (s.start_s, s.finish_s) == (5.0, 2.0)
    # The finish's wall: the last step's end (HAND_LOG's step 5, at +5 s) to the final cut's record
    # (also at +5 s here): none; the later record below waits 3 s for a flush round.
    assert s.finish_wall_s == 0.0
    late = tmp_path / "late.jsonl"
    write_log(late, records[:-1] + [dataclasses.replace(records[-1], time=records[-1].time + 3.0)])
    assert summarize(str(late)).finish_wall_s == pytest.approx(3.0)
    # Start-up and finish are not training boundaries: the timing figures are HAND_LOG's.
    assert s.boundary_total_s == pytest.approx(0.4) and s.sync_share == pytest.approx(0.4 / 6.4)
    # INIT, the initial cut and the final cut are not rounds' bytes...
    assert (s.round_bytes_sent, s.round_bytes_recv) == (4000, 6000)
    assert (s.bytes_sent_per_round, s.bytes_recv_per_round) == (2000.0, 3000.0)
    # ...but they are in the data totals, and control bytes are counted apart.
    assert (s.data_bytes_sent, s.data_bytes_recv) == (12000, 22000)
    assert (s.control_bytes_sent, s.control_bytes_recv) == (300, 250)
    assert "start-up" in format_table([s])


def test_empty_log_summary(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("", encoding="utf-8")
    s = summarize(str(path))
    assert s.steps == 0 and s.boundary_ms_p50 is None and s.sync_share is None and s.rounds == 0
    assert "-" in format_table([s])


def test_cli_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log0, log1 = tmp_path / "island0.jsonl", tmp_path / "island1.jsonl"
    write_log(log0, HAND_LOG)
    write_log(log1, [dataclasses.replace(r, island=1, loss=None) for r in HAND_LOG[:3]])
    png = tmp_path / "steps.png"

    assert main([str(log0), str(log1), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "island0.jsonl" in out and "island1.jsonl" in out and "boundary ms p95" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000

    assert main([str(log0), str(log1), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [entry["island"] for entry in doc["logs"]] == [0, 1]
    assert doc["logs"][0]["rounds"] == 2 and doc["logs"][1]["final_loss"] is None
    assert doc["logs"][0]["sync_share"] == pytest.approx(0.0625)

    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_boundary_part_of_a_record() -> None:
    r = HAND_LOG[2]
    b = r.boundary()
    assert type(b) is BoundaryRecord and isinstance(r, BoundaryRecord)
    assert (b.step, b.phase, b.versions, b.data_bytes_recv, b.applies) == (3, "train", (1, 0), 2000, 1)


def test_corpus_is_shipped_text() -> None:
    text = load_corpus()
    size = len(text.encode("utf-8"))
    assert 200_000 <= size <= 600_000
    assert "To be, or not to be" in text and "\r" not in text
    assert all(ch.isprintable() or ch == "\n" for ch in set(text))
    notice = Path(__file__).resolve().parents[2] / "diloco" / "data" / "NOTICE.txt"
    assert "public domain" in notice.read_text(encoding="utf-8")

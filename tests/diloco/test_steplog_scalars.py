"""Sync scalars in the job's writers (diloco/steplog_scalars.py): a view of the step log.

Written through a real ``torch.utils.tensorboard.SummaryWriter`` and read back with
tensorboard's own event reader; the values are worked out by hand from the records, and
``sync_share`` over a whole log equals ``yeto-steplog``'s."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from diloco.config import ConfigError, IslandConfig
from diloco.steplog import StepLog, StepRecord
from diloco.steplog_report import summarize
from diloco.steplog_scalars import ScalarView, island_scalars

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from tbevents import read_scalars  # noqa: E402

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


LOG = [
    rec(0, phase="start", step_s=0.0, blocked_s=0.5, data_bytes_recv=800,
        events=[{"type": "cut", "fragment": 0, "version": 0, "data_bytes": 400},
                {"type": "cut", "fragment": 1, "version": 0, "data_bytes": 400}]),
    rec(1, blocked_s=0.25, export_s=0.2, data_bytes_sent=100, pushes=1,
        events=[{"type": "push", "fragment": 0, "round": 1, "attempt": 0, "data_bytes": 100}]),
    rec(2, blocked_s=0.25, apply_s=0.1, wait_s=0.1, data_bytes_recv=400, pushes=1, applies=1, versions=(1, 0),
        events=[{"type": "apply", "fragment": 0, "version": 1, "round": 1, "data_bytes": 400, "lag_steps": 1},
                {"type": "refused", "count": 2, "data_bytes": 0}]),
    rec(3, step_s=3.0, pushes=1, applies=1, versions=(1, 0),
        events=[{"type": "push_dropped", "fragment": 1, "round": 2, "attempt": 0, "data_bytes": 100}]),
    rec(4, blocked_s=1.0, apply_s=0.5, data_bytes_recv=400, pushes=1, applies=2, versions=(1, 1),
        events=[{"type": "apply", "fragment": 1, "version": 1, "round": 2, "data_bytes": 400, "lag_steps": None}]),
    rec(4, phase="finish", step_s=0.0, blocked_s=2.0, data_bytes_recv=800, pushes=1, applies=2, versions=(2, 2),
        events=[{"type": "final", "versions": [2, 2], "data_bytes": 800}]),
]


def test_summary_writer_gets_the_scalars_at_the_interval(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    path = tmp_path / "island0.steplog.jsonl"
    log = StepLog(str(path), island_scalars([writer], 2))
    for r in LOG:
        log.record(r)
    log.close()
    writer.close()
    got = read_scalars(str(tmp_path / "tb"))
    # Windows: steps 1-2 (written at 2), steps 3-4 (written at 4); finish at step 4 again.
    assert got["diloco/sync_share"] == [(2, pytest.approx(0.5 / 2.5)), (4, pytest.approx(1.0 / 5.0))]
    assert got["diloco/push_blocked_ms"] == [(2, pytest.approx(100.0)), (4, pytest.approx(0.0))]
    assert got["diloco/apply_blocked_ms"] == [(2, pytest.approx(50.0)), (4, pytest.approx(250.0))]
    assert got["diloco/wait_blocked_ms"] == [(2, pytest.approx(50.0)), (4, pytest.approx(0.0))]
    assert got["diloco/rounds_merged"] == [(2, 1.0), (4, 2.0)]
    assert got["diloco/rounds_missed"] == [(2, 0.0), (4, 2.0)]  # a dropped push, an apply without our push
    assert got["diloco/refusals"] == [(2, 2.0), (4, 2.0)]
    assert got["diloco/data_bytes_sent"] == [(2, 100.0), (4, 100.0)]
    assert got["diloco/data_bytes_recv"] == [(2, 1200.0), (4, 1600.0)]
    assert got["diloco/staleness_steps/f0"] == [(2, 1.0), (4, 1.0)]
    assert "diloco/staleness_steps/f1" not in got  # its only apply had no push of ours
    assert got["diloco/version/f0"] == [(2, 1.0), (4, 1.0)]
    assert got["diloco/version/f1"] == [(2, 0.0), (4, 1.0)]
    # The finish record ends on the step already written: nothing more.
    assert all(step != 5 for series in got.values() for step, _ in series)


def test_whole_log_window_matches_the_report(tmp_path: Path) -> None:
    """One window over every training step: the scalar is yeto-steplog's sync share."""
    path = tmp_path / "island0.steplog.jsonl"
    sink = _Wandb()
    log = StepLog(str(path), ScalarView([sink], log_interval=4))
    for r in LOG:
        log.record(r)
    log.close()
    assert [step for step, _ in sink.calls] == [4]
    assert sink.calls[0][1]["diloco/sync_share"] == pytest.approx(summarize(str(path)).sync_share)


class _Wandb:
    """A wandb-like sink: ``log(dict, step=)`` (as wandb and Megatron's get_wandb_writer())."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log(self, values: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(values)))


class _Broken:
    def add_scalar(self, tag: str, value: float, step: int) -> None:
        raise OSError("disk full")


def test_failing_writer_is_dropped_and_the_log_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = _Wandb()
    path = tmp_path / "log.jsonl"
    log = StepLog(str(path), ScalarView([_Broken(), sink], log_interval=1))
    for r in LOG:
        log.record(r)
    log.close()
    assert [s for s, _ in sink.calls] == [1, 2, 3, 4]
    assert "scalar writer _Broken failed" in caplog.text
    assert len(path.read_text().splitlines()) == len(LOG)


def test_scalars_without_a_step_log_file() -> None:
    sink = _Wandb()
    log = StepLog(None, ScalarView([sink], log_interval=2))
    for r in LOG:
        log.record(r)
    assert [s for s, _ in sink.calls] == [2, 4]


def test_island_config_writer_and_interval() -> None:
    sink = _Wandb()
    cfg = IslandConfig.from_env({"YETO_SYNC_ADDR": "tcp://127.0.0.1:1", "YETO_ISLAND_ID": "0",
                                 "YETO_DILOCO_LOG_INTERVAL": "5"}, writer=sink)
    assert cfg.log_interval == 5 and cfg.writers() == [sink]
    view = island_scalars(cfg.writers(), cfg.log_interval)
    assert view is not None and view.log_interval == 5
    assert island_scalars(IslandConfig(sync_addr="tcp://h:1", island_id=0).writers(), 0) is None
    with pytest.raises(ConfigError, match="writer"):
        IslandConfig(sync_addr="tcp://h:1", island_id=0, writer=object())
    with pytest.raises(ConfigError, match="YETO_DILOCO_LOG_INTERVAL"):
        IslandConfig(sync_addr="tcp://h:1", island_id=0, log_interval=-1)

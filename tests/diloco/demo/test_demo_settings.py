"""The demo's own checks, before any process starts: flags, --out, and the summary's verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.demo import cli
from diloco.demo.island import check_layout
from diloco.demo.runner import DemoConfigError, DemoSettings, prepare_out, summarize_run, verdict

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("flags, named", [
    (["--fragments", "0"], "--fragments"),
    (["--fragments", "5", "--layers", "4"], "--fragments"),
    (["--sync-every", "2", "--fragments", "4"], "--sync-every"),
    (["--sync-every", "500", "--steps", "240"], "--sync-every"),
    (["--layouts", "tp4"], "--layouts"),
    (["--layouts", "tp2,pp3"], "--layouts"),
    (["--layouts", "xx2"], "--layouts"),
    (["--layouts", ","], "--layouts"),
    (["--islands", "0"], "--islands"),
    (["--hidden", "30"], "--hidden"),
    (["--outer-momentum", "1.0"], "--outer-momentum"),
    (["--outer-lr", "0"], "--outer-lr"),
    (["--wire-dtype", "int3"], "--wire-dtype"),
])
def test_a_bad_flag_is_refused_by_name_before_anything_starts(tmp_path: Path, capsys, flags, named) -> None:
    out = tmp_path / "demo"
    assert cli.main([*flags, "--out", str(out)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(f"yeto-demo: {named}:"), err
    assert "YETO_" not in err
    assert not out.exists()  # nothing was created, so nothing was started


def test_layouts_are_checked_against_the_model() -> None:
    assert check_layout("tp2", layers=4, hidden=64) == (2, 1, 1)
    assert check_layout("pp2dp2", layers=4, hidden=64) == (1, 2, 2)
    with pytest.raises(ValueError, match="heads"):
        check_layout("tp4", layers=4, hidden=64)
    with pytest.raises(ValueError, match="--layers 3"):
        check_layout("pp2", layers=3, hidden=64)


def test_a_non_empty_out_is_refused_without_overwrite(tmp_path: Path, capsys) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "island0.json").write_text("{}")
    assert cli.main(["--out", str(out), "--steps", "40"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "--out" in err and "--overwrite" in err
    assert (out / "island0.json").read_text() == "{}"


def test_overwrite_removes_the_old_run_and_keeps_other_files(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    (out / "ckpt" / "r1").mkdir(parents=True)
    for name in ("island0.json", "events.jsonl", "syncer.log", "steplog.png", "sync.key", "start.0.ready"):
        (out / name).write_text("old")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DemoConfigError, match="^--out"):
        prepare_out(DemoSettings(out=str(out)))
    prepare_out(DemoSettings(out=str(out), overwrite=True))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _result(out: Path, name: str, eval_loss: float, digest: str | None = "d") -> None:
    (out / f"{name}.json").write_text(json.dumps({
        "layout": "tp1", "first_loss": 4.0, "train_loss": 2.5, "eval_loss": eval_loss, "digest": digest,
        "versions": [3, 3]}))


def test_summary_compares_the_merged_model_with_alone_and_the_dp_bound(tmp_path: Path) -> None:
    s = DemoSettings(out=str(tmp_path), dp_bound=True)
    _result(tmp_path, "island0", 2.2)
    _result(tmp_path, "island1", 2.2)
    _result(tmp_path, "alone", 2.4)
    _result(tmp_path, "dp-bound", 2.0)
    summary = summarize_run(str(tmp_path), s, wall=1.0, ok=True)
    assert summary["digests_equal"]
    assert summary["merged_eval_loss"] == pytest.approx(2.2)
    assert summary["islands_vs_alone"] == pytest.approx(2.2 / 2.4, abs=1e-4)
    assert summary["islands_vs_dp"] == pytest.approx(1.1)
    assert summary["summary_path"] == str(tmp_path / "summary.json")
    line = summary["verdict"]
    assert line.startswith("verdict: merged 2 islands 2.200 vs alone 2.400")
    assert "BETTER than one island alone by 8.3%" in line and "islands/dp = 1.100" in line
    assert json.loads(json.dumps(summary)) == summary


def test_verdict_says_worse_and_none_when_an_island_is_missing(tmp_path: Path) -> None:
    s = DemoSettings(out=str(tmp_path))
    _result(tmp_path, "island0", 2.5)
    _result(tmp_path, "alone", 2.0)
    summary = summarize_run(str(tmp_path), s, wall=1.0, ok=True)
    assert summary["merged_eval_loss"] is None and summary["islands_vs_alone"] is None
    assert summary["verdict"].startswith("verdict: none")
    _result(tmp_path, "island1", 2.5)
    summary = summarize_run(str(tmp_path), s, wall=1.0, ok=True)
    assert "WORSE than one island alone by 25.0%" in verdict(summary)


def test_round_mode_flags() -> None:
    assert cli.settings_from_args([]).sync_rounds is DemoSettings().sync_rounds
    assert cli.settings_from_args(["--async-rounds"]).sync_rounds is False
    assert cli.settings_from_args(["--sync-rounds"]).sync_rounds is True
    with pytest.raises(SystemExit):
        cli.settings_from_args(["--sync-rounds", "--async-rounds"])

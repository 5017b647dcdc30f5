"""The main job end to end at a small size: ``yeto-demo`` with a real syncer and two islands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.tbevents import read_scalars

pytestmark = [pytest.mark.integ, pytest.mark.timeout(600)]


def test_demo_small_run_ends_with_equal_digests_and_tells_the_truth(tmp_path: Path) -> None:
    out, summary = tmp_path / "demo", tmp_path / "summary.json"
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.demo.cli", "--islands", "2", "--layouts", "tp2,pp2", "--steps", "30",
         "--sync-every", "10", "--fragments", "2", "--hidden", "32", "--layers", "2", "--out", str(out),
         "--summary", str(summary), "--timeout-s", "500", "--metrics-port", str(port)],
        capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["ok"] and s["digests_equal"]
    assert s["rounds_committed"] >= 4
    islands = [s["islands"][f"island{i}"] for i in range(2)]
    assert islands[0]["digest"] == islands[1]["digest"] and islands[0]["digest"]
    assert islands[0]["versions"] == islands[1]["versions"] and min(islands[0]["versions"]) >= 2
    for r in islands:
        assert r["train_loss"] < r["first_loss"]
    alone = s["islands"]["alone"]
    assert alone["train_loss"] < alone["first_loss"]
    # alone is island 0's model on island 0's data: the same first step, bit for bit.
    assert alone["layout"] == "tp2" and alone["first_loss"] == islands[0]["first_loss"]
    # One merged model (equal digests), the same held-out batches: the same loss up to bf16
    # rounding between a TP2 and a PP2 forward.
    assert abs(islands[0]["eval_loss"] - islands[1]["eval_loss"]) < 2e-3
    assert s["islands_vs_alone"] == pytest.approx(s["merged_eval_loss"] / alone["eval_loss"], abs=1e-4)
    # What the user sees: the start, the table, the verdict, where the summary went.
    assert "starting 2 islands (tp2, pp2) and alone" in proc.stdout
    assert "final-cut digests equal: True" in proc.stdout
    assert "verdict: merged 2 islands" in proc.stdout and "than one island alone by" in proc.stdout
    assert f"summary JSON: {summary}" in proc.stdout
    assert "boundary ms p50" in proc.stdout
    assert (out / "steplog.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard: every run's loss; each island's sync scalars every 10 steps, as its step log says.
    assert f"TensorBoard: tensorboard --logdir {out / 'tb'}" in proc.stdout
    for name in ("island0", "island1", "alone"):
        tb = read_scalars(str(out / "tb" / name))
        assert [step for step, _ in tb["loss"]] == list(range(1, 31)), name
        assert tb["eval_loss"] == [(30, pytest.approx(s["islands"][name]["eval_loss"], rel=1e-6))]
        if name == "alone":
            assert not any(tag.startswith("diloco/") for tag in tb)
            continue
        assert [step for step, _ in tb["diloco/sync_share"]] == [10, 20, 30]
        assert all(0 <= v < 1 for _, v in tb["diloco/sync_share"])
        merged = [v for _, v in tb["diloco/rounds_merged"]]
        assert merged == sorted(merged) and merged[-1] >= 2
    # --metrics-port reached the syncer.
    assert f"metrics on http://127.0.0.1:{port}/metrics" in (out / "syncer.log").read_text()


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(pid))
    return pids


def test_a_failed_demo_leaves_no_process_behind(tmp_path: Path) -> None:
    """--timeout-s runs out mid-training: the demo fails, and kills every island, rank and the syncer."""
    out = tmp_path / "demo-killed"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.demo.cli", "--islands", "2", "--layouts", "tp2,tp1", "--steps", "100000",
         "--sync-every", "1000", "--fragments", "2", "--hidden", "32", "--layers", "2", "--out", str(out),
         "--no-baseline", "--timeout-s", "20"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "timeout after 20s" in proc.stderr
    assert "verdict: none" in proc.stdout
    assert _processes_mentioning(str(out)) == []

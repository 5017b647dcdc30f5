"""The main job end to end at a small size: ``yeto-demo`` with a real syncer and two islands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integ, pytest.mark.timeout(600)]


def test_demo_small_run_ends_with_equal_digests_and_lower_loss(tmp_path) -> None:
    out, summary = tmp_path / "demo", tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.demo.cli", "--islands", "2", "--layouts", "tp2,pp2", "--steps", "30",
         "--sync-every", "10", "--fragments", "2", "--hidden", "32", "--layers", "2", "--out", str(out),
         "--summary", str(summary), "--timeout-s", "500"],
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
    assert s["islands"]["alone"]["train_loss"] < s["islands"]["alone"]["first_loss"]
    # The summary table and the step-log report were printed; the plot was saved.
    assert "final-cut digests equal: True" in proc.stdout
    assert "boundary ms p50" in proc.stdout
    assert (out / "steplog.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

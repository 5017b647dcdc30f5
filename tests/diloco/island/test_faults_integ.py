"""Faults with real processes (issue 13, "What to show"): messages lost on purpose, islands
SIGKILLed and restarted, the syncer killed and resumed. Every run must complete with every
island bitwise equal to the syncer's final checkpoint (the syncer also checked each island's
FINAL_ACK digests: its exit code is 0 only if they matched) and no push counted twice."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults_harness import Run  # noqa: E402

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]

LOST = "drop:CUT:2,drop:BCAST:4,fail:BCAST:9,drop:PULL:7,fail:PULL:12,fail:CUT:5,drop:FINAL:2,fail:FINAL:4"


def _finish(run: Run, timeout_s: float = 200.0) -> None:
    try:
        code, codes = run.wait(timeout_s)
    finally:
        run.stop()
    logs = run.syncer_logs()
    assert all(c == 0 for c in codes.values()), (codes, logs[-3000:])
    assert code == 0, logs[-4000:]
    problems = run.check()
    assert not problems, problems


def test_lost_bcast_pull_cut_and_final_are_repaired(tmp_path) -> None:
    run = Run(tmp_path, faults=LOST)
    run.start()
    _finish(run)
    logs = run.syncer_logs()
    fired = logs.count("fault hook:")
    assert fired == len(LOST.split(",")), fired
    assert "stale_base" in logs or "FINAL again" in logs or "resending fragment" in logs


def test_island_kill_loop_and_a_syncer_kill(tmp_path) -> None:
    run = Run(tmp_path, steps=60)
    run.start()
    try:
        run.kill_loop(5, random.Random(13))
        deadline = time.monotonic() + 60
        while len(run.commits()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        run.kill_syncer()
        run.start_syncer(resume=True)
    except BaseException:
        run.stop()
        raise
    _finish(run)
    assert run.figures["island_kills"] == 5 and run.figures["syncer_kills"] == 1

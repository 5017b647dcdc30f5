"""Faults with real processes (issue 13, "What to show"): messages lost on purpose, islands
SIGKILLed and restarted, the syncer killed and resumed. Every run must complete with every
island bitwise equal to the syncer's final checkpoint (the syncer also checked each island's
FINAL_ACK digests: its exit code is 0 only if they matched) and no push counted twice."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults_harness import Run  # noqa: E402

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]

LOST = "drop:CUT:2,drop:BCAST:4,fail:BCAST:6,drop:PULL:7,fail:PULL:12,fail:CUT:5,drop:FINAL:2,fail:FINAL:4"


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
    run = Run(tmp_path, faults=LOST, steps=80)
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
        # Two commits, and a checkpoint on disk (written in the background): the resumed syncer
        # needs one, and a kill during the first write leaves none (a loaded machine did that).
        while (len(run.commits()) < 2 or not (tmp_path / "ckpt" / "latest").exists()) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "ckpt" / "latest").exists(), run.syncer_logs()[-3000:]
        run.kill_syncer()
        run.start_syncer(resume=True)
    except BaseException:
        run.stop()
        raise
    _finish(run)
    assert run.figures["island_kills"] == 5 and run.figures["syncer_kills"] == 1


def test_syncer_gone_for_a_long_while(tmp_path) -> None:
    """The syncer is SIGKILLed and stays away for 10 s, over twice YETO_SYNC_TIMEOUT_S and three
    times --dead-after-s: the islands keep training meanwhile (no step waits on the syncer), redial
    with backoff, rejoin the resumed syncer and end bitwise equal to its final checkpoint."""
    # Enough steps (0.05 s each) that training outlasts start-up, one commit and the 10 s away
    # even when commits come slowly (one snapshot slot per island, a loaded machine).
    run = Run(tmp_path, steps=400)
    run.start()
    try:
        deadline = time.monotonic() + 90
        # A commit, and its checkpoint on disk (written in the background): the resumed syncer
        # needs one.
        while (len(run.commits()) < 1 or not (tmp_path / "ckpt" / "latest").exists()) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(run.commits()) >= 1 and (tmp_path / "ckpt" / "latest").exists(), run.syncer_logs()[-3000:]
        run.kill_syncer()
        gone = time.time()
        time.sleep(10.0)
        back = time.time()
        run.start_syncer(resume=True)
    except BaseException:
        run.stop()
        raise
    _finish(run)
    trained_meanwhile = {}
    for i in range(run.islands):
        rows = [json.loads(line) for line in (tmp_path / f"island{i}.steplog.jsonl").read_text().splitlines()]
        trained_meanwhile[i] = sum(1 for r in rows if r["phase"] == "train" and gone + 1.0 < r["time"] < back)
        stats = json.loads((tmp_path / f"island{i}.json").read_text())["stats"]
        assert stats["redials"] >= 1, (i, stats)
    # Steps of 0.05 s or more: 9 s away leaves room for at most ~180; every island that was
    # still training trained on (one that had already finished waits for the final cut).
    assert max(trained_meanwhile.values()) >= 20, trained_meanwhile
    resumed = (tmp_path / "syncer1.log").read_text()
    assert "resumed:" in resumed and "commit round" in resumed, resumed[-3000:]
    # The restored values are let go once superseded: no round waits for the memory budget.
    assert "fragment buffers alive" not in resumed, resumed[-3000:]


def test_held_final_cut_and_a_lost_value_it_names(tmp_path) -> None:
    """fp32 islands: the final value of a fragment streamed to an island after its done goes as a
    HELD notice (no bytes). One such BCAST is lost silently: the island's next push of that
    fragment is refused ``stale_base`` and the value is resent (the island redials for the bytes
    if it still lacks it: ``test_final_held_integ.py``). Every island still ends bitwise equal to
    the syncer's final checkpoint, and the syncer checked each FINAL_ACK's digests."""
    run = Run(tmp_path, faults="drop:BCAST_DONE:1", steps=40, wire_dtype="float32")
    run.start()
    _finish(run)
    logs = run.syncer_logs()
    assert logs.count("fault hook:") == 1, logs[-3000:]
    assert "HELD, not sent again" in logs
    islands = "".join(p.read_text() for p in sorted(tmp_path.glob("island*.log")))
    assert "fragments from values already here" in islands and "(0 fragments from" not in islands, islands[-3000:]

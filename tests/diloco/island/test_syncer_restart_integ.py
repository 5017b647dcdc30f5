"""A syncer killed mid-run and restarted with ``--resume``: islands rejoin, nothing is corrupted.

Two real islands (TP1 and TP2 megatron-core GPTs, real processes) train against a real
syncer that checkpoints every commit. The syncer is SIGKILLed after a few commits and
started again with ``--resume`` on the same address. The islands notice (silence, then a
refusal of their old generation), redial under new generations, install the resumed cut
and finish; both end bitwise identical to the resumed syncer's final checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from diloco.digest import checkpoint_digests, combined_digest
from tests.support.ports import free_port as _free_port

pytestmark = [pytest.mark.integ, pytest.mark.timeout(420)]


def _commits(path) -> list[dict]:
    """Complete commit lines of the event log (a line being appended right now is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]
    return [e for e in lines if "pushed" in e]  # commit lines (not the summary, clamps or drops)


def test_islands_survive_a_syncer_restart(tmp_path) -> None:
    addr = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "YETO_SYNC_KEY": "restart-key",
           "YETO_SYNC_TIMEOUT_S": "3", "YETO_HEARTBEAT_S": "0.5"}
    steps = 200
    syncer_cmd = [sys.executable, "-m", "diloco.syncer", "--bind", addr, "--islands", "2", "--sync-every", "10",
                  "--total-steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
                  "--event-log", str(tmp_path / "events.jsonl"), "--quorum-timeout-s", "60"]
    first = subprocess.Popen(syncer_cmd, stdout=open(tmp_path / "syncer1.log", "w"), stderr=subprocess.STDOUT,
                             env=env)
    islands = [subprocess.Popen(
        [sys.executable, "-m", "diloco.demo.island", "--name", f"island{i}", "--island-id", str(i), "--layout",
         layout, "--sync-addr", addr, "--steps", str(steps), "--fragments", "2", "--out", str(tmp_path),
         "--hidden", "32", "--layers", "2", "--seq", "16", "--micro-batch", "2", "--data-seed", str(i),
         "--timeout-s", "360"],
        stdout=open(tmp_path / f"island{i}.log", "w"), stderr=subprocess.STDOUT, env=env)
        for i, layout in enumerate(("tp1", "tp2"))]
    second = None
    try:
        deadline = time.monotonic() + 240
        # Kill once both islands are in rounds (the round clock does not wait for a late
        # joiner: island 0 alone may commit several rounds before island 1 says HELLO).
        while len(_commits(tmp_path / "events.jsonl")) < 3 or \
                not any(len(c["pushed"]) == 2 for c in _commits(tmp_path / "events.jsonl")):
            assert time.monotonic() < deadline, "no commits before the kill"
            assert all(p.poll() is None for p in islands), "an island ended before the kill"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = len(_commits(tmp_path / "events.jsonl"))
        second = subprocess.Popen([*syncer_cmd, "--resume"], stdout=open(tmp_path / "syncer2.log", "w"),
                                  stderr=subprocess.STDOUT, env=env)
        codes = [p.wait(timeout=330) for p in islands]
        assert second.wait(timeout=60) == 0, (tmp_path / "syncer2.log").read_text()[-3000:]
    finally:
        for p in [*islands, first, *([second] if second else [])]:
            if p.poll() is None:
                p.kill()
    for i, code in enumerate(codes):
        assert code == 0, (tmp_path / f"island{i}.log").read_text()[-3000:]
    for i in range(2):
        assert "joined a new syncer instance" in (tmp_path / f"island{i}.log").read_text()

    # Every round the resumed syncer re-ran closed without waiting out a quorum timeout: the
    # islands answered its pulls although they had seen those round numbers committed before.
    assert "dropping them" not in (tmp_path / "syncer2.log").read_text()

    commits = _commits(tmp_path / "events.jsonl")
    resumed = commits[killed_at:]
    assert resumed, "the resumed syncer committed nothing"
    rounds = [c["round"] for c in resumed]
    assert len(set(rounds)) == len(rounds)
    for f in {c["fragment"] for c in resumed}:  # fragments commit side by side, each in round order
        mine = [c["round"] for c in resumed if c["fragment"] == f]
        assert mine == sorted(mine)

    results = [json.loads((tmp_path / f"island{i}.json").read_text()) for i in range(2)]
    assert results[0]["versions"] == results[1]["versions"]
    assert results[0]["digest"] == results[1]["digest"]
    ckpt = tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text().strip()
    versions, digests = checkpoint_digests(ckpt)
    assert versions == results[0]["versions"]
    assert combined_digest(digests) == results[0]["digest"]

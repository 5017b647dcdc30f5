"""The syncer's benchmarks run end to end in their ``--smoke`` mode (tiny sizes, real processes).

Checks what a smoke run can check without timing anything: the last line is one JSON object
with every figure, the merge agreed with numpy bit for bit (the benchmark raises otherwise),
the round trip was exact, and every round changed the model.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def _last_json(script: str) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke"], capture_output=True,
                          text=True, timeout=280, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_wire_smoke() -> None:
    figures = _last_json("bench_wire.py")
    assert figures["smoke"] is True
    for key in ("wire_vs_zmq", "merge_vs_numpy"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key


def test_bench_scale_smoke() -> None:
    figures = _last_json("bench_scale.py")
    assert figures["smoke"] is True and figures["syncer_exit"] == 130
    assert figures["rounds_changed"] == figures["rounds"] == 2
    for key in ("round_vs_wire", "init_vs_wire", "syncer_rss_over_state", "merge_gbps_vs_memcpy", "digest_gbps",
                "digest_vs_xxh3"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key


def _probe_json(script: str, *extra: str) -> dict:
    """Run ``scripts/SCRIPT --smoke [extra]`` in its own process group (killed whole on timeout: the
    probes start a syncer or a sender); its last line, parsed."""
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / script), "--smoke", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def test_probe_init_smoke(tmp_path: Path) -> None:
    """scripts/probe_init.py (the INIT throughput probe of the device runs) streams every fragment
    into a real syncer, which verifies and holds each one; with ``--trace`` both sides' timelines
    (scripts/trace_init.py) saw every part. Both sides pinned to CPUs of our own (the NUMA split of
    the device's ``numa`` job) still deliver every fragment."""
    cpu = str(min(os.sched_getaffinity(0)))
    figures = _probe_json("probe_init.py", "--trace", str(tmp_path / "trace"), "--island-cpus", cpu, "--syncer-cpus", cpu)
    assert figures["island_cpus"] == figures["syncer_cpus"] == cpu
    assert figures["initialised"] == figures["fragments"] == 2
    assert math.isfinite(figures["init_gbps"]) and figures["init_gbps"] > 0
    parts = figures["traced"]
    assert parts["island_parts"] == parts["syncer_parts"] > 0


def test_probe_zmq_init_smoke() -> None:
    """scripts/probe_zmq_init.py (INIT's framing over bare zmq) delivers every byte to its place."""
    figures = _probe_json("probe_zmq_init.py")
    assert figures["bytes_ok"] is True and figures["workers"] == 4
    assert math.isfinite(figures["gbps"]) and figures["gbps"] > 0


def test_probe_fault_smoke() -> None:
    """scripts/probe_fault.py (fresh-memory write rates, a device probe) measures every case it can."""
    figures = _probe_json("probe_fault.py")
    assert {"plain_x1", "plain_x2"} <= set(figures)
    assert all(math.isfinite(v) and v > 0 for v in figures.values())


def test_probe_fold_smoke() -> None:
    """scripts/probe_fold.py (the data plane folding two islands' pushes alone) folds every part of
    both pushes into fresh and resident sums, and the sum is the weighted sum of the deltas."""
    figures = _probe_json("probe_fold.py")
    assert figures["sum_matches"] is True and figures["smoke"] is True
    assert [r["fresh"] for r in figures["rounds"]] == [True, False]
    for key in ("fold_gbps_fresh", "fold_gbps_resident", "memcpy_gbps"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key

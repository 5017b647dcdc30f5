"""Every benchmark in benchmarks/ runs in its ``--smoke`` mode, and its last line is one JSON object
with the figures it promises (so a benchmark can never break silently).

Parametrized over every ``benchmarks/bench_*.py`` file: a benchmark without ``--smoke`` fails here.
The figures of a smoke run mean nothing; only their presence and the run's success are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integ, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.name for p in (REPO / "benchmarks").glob("bench_*.py"))

EXPECTED_KEYS: dict[str, set[str]] = {
    "bench_bridge.py": {"staged_cpu_vs_cpu_gloo", "per_op", "pinned_vs_pageable", "device"},
    "bench_memory.py": {"island_extra_over_model", "syncer_peak_over_model", "released_after_final",
                        "rank_anchor_over_slice"},
    "bench_lowbit.py": {"block", "q4_bytes_vs_fp32", "int8_bytes_vs_fp32", "quality_sweep"},
    "bench_quality.py": {"islands_vs_alone", "islands_vs_dp", "eval_loss", "settings"},
    "bench_security.py": {"fuzz", "slow_loris", "digests", "transport"},
    "bench_wire.py": {"wire_vs_zmq", "merge_vs_numpy"},
}
"""Figures each benchmark's last line must carry; a benchmark not listed must print a non-empty object."""

SMOKE_TIMEOUT_S = 540


def test_every_benchmark_is_covered() -> None:
    assert len(BENCHMARKS) >= 7, BENCHMARKS
    assert set(EXPECTED_KEYS) <= set(BENCHMARKS)


@pytest.mark.parametrize("bench", BENCHMARKS)
def test_smoke_mode_runs_and_prints_its_figures(bench: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / bench), "--smoke"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, start_new_session=True)
    tail = (run.stdout[-3000:] + "\n--- stderr ---\n" + run.stderr[-3000:])
    assert run.returncode == 0, f"{bench} --smoke exited {run.returncode}:\n{tail}"
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert lines, f"{bench} --smoke printed nothing:\n{tail}"
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise AssertionError(f"{bench} --smoke: the last line is not JSON ({exc}):\n{lines[-1][:500]}") from None
    assert isinstance(figures, dict) and figures, f"{bench} --smoke: the last line is not a non-empty object"
    missing = EXPECTED_KEYS.get(bench, set()) - figures.keys()
    assert not missing, f"{bench} --smoke: figures missing {sorted(missing)}; got {sorted(figures)}"

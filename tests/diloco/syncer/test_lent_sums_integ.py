"""Lent sums end to end: a real syncer and two real islands (``bench_memory.py --smoke``, fp32, four
fragments), the syncer's data plane slowed (``YETO_TEST_DATAPLANE_DELAY_S``) so that the flush rounds'
first parts arrive while the previous round's commit consumes its old value. Some round's sum lies in
that value's pages (``work.PageLoan``) or in the book's resident spare (a consumed value no sum took,
``FragmentBook.keep_spare``), and the run still ends with every island acknowledging the
final cut's digests (the syncer exits 0 only then). The merge's exactness on lent memory is checked
against the plain path in ``test_page_loan.py`` and ``test_consume.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[3]


def test_a_round_sums_into_a_consumed_value_and_the_run_ends_acknowledged(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "YETO_TEST_DATAPLANE_DELAY_S": "0.1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_memory.py"), "--smoke", "--only", "fp32_4f",
                          "--keep", str(tmp_path / "runs")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=280, start_new_session=True)
    assert run.returncode == 0, run.stderr[-3000:]
    log = "".join(p.read_text() for p in (tmp_path / "runs").glob("*/syncer.log"))
    commits = [line for line in log.splitlines() if "commit round" in line]
    reused = ("the sum lay in an old value's pages", "the sum lay in the resident spare")
    assert commits and any(any(r in c for r in reused) for c in commits), "\n".join(commits)
    assert "every island acknowledged the final cut" in log and "syncer finished with exit code 0" in log

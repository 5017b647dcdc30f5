"""The examples under examples/ run as a user runs them, and their islands end identical to
the syncer's final cut (the newest checkpoint), byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.digest import checkpoint_digests, combined_digest

pytestmark = [pytest.mark.integ, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["torch_two_islands.py", "megatron_two_islands.py"])
def test_example_islands_end_at_the_syncers_final_cut(script: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(REPO / "examples" / script), "--out", str(out)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:] + (out / "syncer.log").read_text()[-2000:]
    assert "identical after the final cut: True" in run.stdout
    ckpt = out / "ckpt" / (out / "ckpt" / "latest").read_text().strip()
    versions, digests = checkpoint_digests(ckpt)
    for i in range(2):
        result = json.loads((out / f"island{i}.json").read_text())
        assert result["versions"] == versions and min(versions) >= 1
        assert result["digest"] == combined_digest(digests)

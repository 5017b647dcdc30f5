"""Every console command answers ``--help`` with its usage and exits 0 (and does nothing else)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integ, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "yeto-syncer": ["-m", "diloco.syncer"],
    "yeto-steplog": ["-m", "diloco.steplog_report"],
    "yeto-demo": ["-m", "diloco.demo.cli"],
    "yeto-keys": ["-m", "diloco.keys_cli"],
    "python -m swift_plugin": ["-m", "swift_plugin"],
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_prints_usage_and_exits_0(name: str, tmp_path: Path) -> None:
    prog = name.split()[-1]
    run = subprocess.run([sys.executable, *COMMANDS[name], "--help"], capture_output=True, text=True, env=_env(),
                         cwd=tmp_path, timeout=90)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: ") and prog in run.stdout.splitlines()[0]
    assert "plugin.py" not in run.stdout.splitlines()[-1]  # swift_plugin: the usage, not the path
    assert list(tmp_path.iterdir()) == []  # --help wrote nothing
    # The installed console script (when on PATH) answers alike.
    script = shutil.which(name) if " " not in name else None
    if script is not None:
        run = subprocess.run([script, "--help"], capture_output=True, text=True, env=_env(), cwd=tmp_path,
                             timeout=90)
        assert run.returncode == 0 and run.stdout.startswith("usage: "), run.stderr


def test_swift_plugin_prints_only_the_path_and_refuses_other_arguments() -> None:
    run = subprocess.run([sys.executable, "-m", "swift_plugin"], capture_output=True, text=True, env=_env(),
                         timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith("plugin.py") and len(run.stdout.splitlines()) == 1
    assert Path(run.stdout.strip()).is_file()
    bad = subprocess.run([sys.executable, "-m", "swift_plugin", "--pth"], capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""

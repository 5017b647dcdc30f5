"""Shared fixtures and the fast/integ split of the suite.

* ``python -m pytest`` runs the fast set: pyproject's ``addopts`` deselect ``integ``, and files
  named ``*_integ.py`` are not even imported then (their imports, megatron's included, cost
  seconds). ``scripts/test.sh`` passes ``-m ""`` and runs everything.
* Every test in a ``*_integ.py`` file is marked ``integ`` here, so a file's name and its marker
  never disagree; integ tests elsewhere carry the marker themselves.
* Fixtures: ``free_port`` (an int), ``syncer_proc`` (a factory of real syncer processes, each
  killed with its process group at teardown), ``spawned`` (a list: append a Popen, its process
  group is killed at teardown).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from tests.support.ports import free_port as _free_port
from tests.support.procs import kill_group
from tests.support.syncer_proc import SyncerProc

INTEG_SUFFIX = "_integ.py"


def _integ_deselected(config: pytest.Config) -> bool:
    return " ".join(str(config.getoption("markexpr") or "").split()) == "not integ"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip importing ``*_integ.py`` files when the run deselects integ anyway (the default)."""
    if collection_path.name.endswith(INTEG_SUFFIX) and _integ_deselected(config):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a ``*_integ.py`` file ``integ``."""
    for item in items:
        if item.path.name.endswith(INTEG_SUFFIX) and item.get_closest_marker("integ") is None:
            item.add_marker(pytest.mark.integ)


@pytest.fixture
def free_port() -> int:
    """A free TCP port on 127.0.0.1 (see tests.support.ports for the race it leaves)."""
    return _free_port()


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[Any]]]:
    """A list the test appends its child processes to; each one's process group is killed at teardown."""
    procs: list[subprocess.Popen[Any]] = []
    yield procs
    for p in procs:
        kill_group(p)


@pytest.fixture
def syncer_proc(tmp_path: Path) -> Iterator[Callable[..., SyncerProc]]:
    """A factory ``start(args, tmp=tmp_path) -> SyncerProc`` of real syncer processes, stopped at teardown."""
    started: list[SyncerProc] = []

    def start(args: Sequence[str] = (), tmp: Path | None = None) -> SyncerProc:
        s = SyncerProc(tmp or tmp_path, args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()

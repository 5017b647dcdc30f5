"""Child processes that never outlive their test: spawn each in its own process group, kill the group.

A process that forks workers (an island's ranks, a syncer's pool) leaves orphans when only its
leader is killed; :func:`kill_group` kills the whole group and waits, bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any, Sequence


def spawn(cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **kw)`` in a new session (its own process group), so
    :func:`kill_group` reaches every process it forks."""
    return subprocess.Popen(list(cmd), start_new_session=True, **kw)


def kill_group(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> int | None:
    """SIGKILL ``proc``'s process group (or ``proc`` alone when it shares ours) and reap it.

    Returns its exit code, or None if it could not be reaped within ``timeout_s``. Never raises for
    a process that is already gone.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pgid = os.getpgid(proc.pid)
            if pgid == proc.pid and pgid != os.getpgrp():
                os.killpg(pgid, signal.SIGKILL)
            else:
                proc.kill()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None

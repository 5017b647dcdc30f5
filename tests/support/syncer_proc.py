"""A real ``python -m diloco.syncer`` process bound to a random localhost port, for integ tests.

The syncer runs in its own process group (killed as a whole by :meth:`SyncerProc.stop`), with
stderr in ``<tmp>/syncer.log``; start-up waits, bounded, for the ``bound tcp://...`` log line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from tests.support.procs import kill_group, spawn

REPO = Path(__file__).resolve().parents[2]


class SyncerProc:
    """A syncer subprocess bound to a random localhost port; stderr goes to a log file.

    Args:
        tmp: working directory of the process and home of ``syncer.log``.
        args: extra CLI flags; ``--insecure`` is added unless a key flag is given.
        start_timeout_s: how long to wait for the bound address in the log (default 60 s).
    Raises RuntimeError (with the log) when the process exits or stays silent past the timeout.
    """

    def __init__(self, tmp: Path, args: Sequence[str], start_timeout_s: float = 60.0) -> None:
        self.log_path = tmp / "syncer.log"
        if not any(a in args for a in ("--key-file", "--curve-secret-file", "--insecure")):
            args = [*args, "--insecure"]
        env = {k: v for k, v in os.environ.items() if k != "YETO_SYNC_KEY"}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["OMP_NUM_THREADS"] = "1"
        self._log = open(self.log_path, "w")
        self.proc = spawn(
            [sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*", "--status-every-s", "0.5",
             # DiLoCo's Nesterov step (not the plain-averaging default): the references check momentum too.
             "--outer-lr", "0.7", "--outer-momentum", "0.9", *args],
            stdout=subprocess.DEVNULL, stderr=self._log, env=env, cwd=str(tmp),
        )
        deadline = time.monotonic() + start_timeout_s
        while True:
            m = re.search(r"bound (tcp://\S+)", self.log())
            if m:
                self.endpoint = m.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"syncer did not start (rc={self.proc.returncode}):\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Kill the process group (idempotent) and close the log."""
        kill_group(self.proc)
        self._log.close()

"""The island's background worker: data-path jobs (push gathers, apply staging) off the training thread.

Why one thread, FIFO: the jobs run point-to-point traffic on the island's *data group*
(its own gloo group, see :mod:`diloco.island.boundary`). Every rank submits the same jobs
in the same order (they come from the broadcast orders), so one FIFO worker per rank
runs the same sequence of transfers on every rank and the messages pair up. Two workers
could reorder them and deadlock.

Agreement: a rank never decides alone that a job is over. Jobs are numbered in submit
order (the numbers are identical on every rank); each rank reports the highest number it
has completed and whether one failed, and the boundary's order exchange all-reduces that
(``diloco.island.orders``), so every rank learns the same "done everywhere" number and
the same error flag at the same boundary.

Bounded memory: at most ``max_pushes`` push jobs unfinished per rank; submitting another
waits (locally, with a timeout) for the oldest. Every wait has a timeout.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class _Job:
    seq: int
    kind: str
    what: str
    fn: Callable[[], None]


class BackgroundError(RuntimeError):
    """A background job failed or a wait for one timed out on this rank."""


class Background:
    """One daemon worker thread running jobs in submit order.

    Args:
        name: thread name (logs).
        max_pushes: push jobs that may be unfinished at once (default 1).
        timeout_s: bound on every wait of the training thread for a job.
    """

    def __init__(self, name: str, max_pushes: int = 1, timeout_s: float = 300.0) -> None:
        if max_pushes < 1:
            raise ValueError(f"Background: max_pushes must be >= 1, got {max_pushes}")
        self._max_pushes = max_pushes
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque[_Job] = collections.deque()
        self._unfinished: dict[int, _Job] = {}
        self._seq = 0
        self._done = 0
        self._error: str | None = None
        self._closed = False
        self.busy_s = 0.0
        """Seconds the worker spent in jobs (all of them)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread
    @property
    def submitted(self) -> int:
        """Number of the last job submitted (0: none)."""
        return self._seq

    @property
    def done(self) -> int:
        """Highest job number such that it and every job before it completed on this rank."""
        with self._lock:
            return self._done

    @property
    def error(self) -> str | None:
        """The first failure on this rank, if any (the worker stops running jobs after one)."""
        with self._lock:
            return self._error

    def submit(self, kind: str, what: str, fn: Callable[[], None]) -> int:
        """Queue ``fn``; returns its job number. A push waits while ``max_pushes`` are unfinished."""
        with self._cond:
            if kind == "push":
                deadline = time.monotonic() + self._timeout_s
                while sum(j.kind == "push" for j in self._unfinished.values()) >= self._max_pushes:
                    if self._error is not None:
                        break  # the job will be skipped; the error surfaces at the next exchange
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._error = self._error or f"a push waited {self._timeout_s:.0f}s for the one in flight"
                        break
                    self._cond.wait(min(left, 0.5))
            self._seq += 1
            job = _Job(self._seq, kind, what, fn)
            self._queue.append(job)
            self._unfinished[job.seq] = job
            self._cond.notify_all()
            return job.seq

    def wait(self, seq: int, timeout_s: float | None = None) -> bool:
        """Wait until job ``seq`` (and every earlier one) is over on this rank; False on a timeout.

        Returns True also when a job failed (then :attr:`error` says why)."""
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self._done < seq and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every submitted job (see :meth:`wait`)."""
        return self.wait(self._seq, timeout_s)

    def fail(self, why: str) -> None:
        """Record a failure seen by the training thread (it surfaces at the next exchange)."""
        with self._cond:
            self._error = self._error or why
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the worker after the queued jobs (does not wait for a stuck one beyond a second)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait(0.5)
                if not self._queue:
                    return
                job = self._queue.popleft()
                skip = self._error is not None
            t0 = time.monotonic()
            failure = None
            if not skip:
                try:
                    job.fn()
                except BaseException as exc:  # noqa: BLE001 - reported at the next boundary, on every rank
                    failure = f"background {job.what} failed: {type(exc).__name__}: {exc}"
                    log.error("%s", failure)
            with self._cond:
                self.busy_s += time.monotonic() - t0
                if failure is not None and self._error is None:
                    self._error = failure
                del self._unfinished[job.seq]
                if not skip and failure is None:
                    self._done = job.seq
                self._cond.notify_all()

"""Sync scalars in the job's own writers (TensorBoard, wandb): a view of the step log.

An operator watches a long run where the loss already is: the job's TensorBoard or wandb.
:class:`ScalarView` receives every :class:`~diloco.steplog.StepRecord` the island writes
(``StepLog.record`` hands it over, whether or not a log file is open) and, every
``log_interval`` training steps and once at finish, writes these scalars under ``diloco/``
at the training step as ``global_step`` (the x axis of the loss):

================================  =====================================================
``diloco/sync_share``             sum(blocked_s) / sum(step_s + blocked_s) over the window
                                  (the window: the train records since the last write)
``diloco/push_blocked_ms``        export_s per train step in the window, mean, ms
``diloco/apply_blocked_ms``       apply_s per train step in the window, mean, ms
``diloco/wait_blocked_ms``        wait_s per train step in the window, mean, ms
``diloco/rounds_merged``          committed rounds applied (the record's ``applies``)
``diloco/rounds_missed``          applied rounds this island had no push in (``apply``
                                  events with ``lag_steps`` null) plus pushes the send
                                  queue dropped (``push_dropped`` events); cumulative
``diloco/refusals``               messages of the syncer this island refused (``refused``
                                  events' ``count``); cumulative
``diloco/data_bytes_sent``        payload bytes sent (``data_bytes_sent``); cumulative
``diloco/data_bytes_recv``        payload bytes received (``data_bytes_recv``); cumulative
``diloco/staleness_steps/fK``     fragment K: ``lag_steps`` of its latest apply (steps
                                  between this island's push and installing the commit)
``diloco/version/fK``             fragment K: the version held (the last committed
                                  version installed; -1 none yet)
================================  =====================================================

The step log stays the record of truth: every value is computed from the records alone, so
``yeto-steplog`` on the file and these scalars agree.

A writer is anything with ``add_scalar(tag, value, global_step)`` (TensorBoard's
``SummaryWriter``, Megatron's ``get_tensorboard_writer()``) or with ``log(dict, step)``
(wandb, Megatron's ``get_wandb_writer()``). Nothing is imported for them: the writers are
handed in. Failure semantics, as for the step log: a writer that raises is logged once and
dropped; the training loop never sees the error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from diloco.steplog import StepRecord

log = logging.getLogger(__name__)

PREFIX = "diloco/"
DEFAULT_LOG_INTERVAL = 10
"""Steps between two writes when neither the island config nor the job names an interval."""


def is_writer(obj: object) -> bool:
    """True for an object the view can write to (``add_scalar`` or ``log``)."""
    return callable(getattr(obj, "add_scalar", None)) or callable(getattr(obj, "log", None))


class ScalarView:
    """Writes the sync scalars of one island's step records to its writers.

    Use one per island, on the sync rank (the one writing the step log), from the training
    thread; not thread-safe. Memory: a few numbers plus two per fragment.

    Args:
        writers: TensorBoard-like (``add_scalar``) or wandb-like (``log``) objects; None
            entries are skipped.
        log_interval: write every this many training steps (>= 1).
    """

    def __init__(self, writers: Sequence[object | None], log_interval: int = DEFAULT_LOG_INTERVAL) -> None:
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.writers: list[Any] = [w for w in writers if w is not None]
        for w in self.writers:
            if not is_writer(w):
                raise TypeError(f"{type(w).__name__} has neither add_scalar nor log: not a scalar writer")
        self.log_interval = log_interval
        self.written = 0
        """Times scalars were written (to every writer)."""
        self._win = [0, 0.0, 0.0, 0.0, 0.0, 0.0]  # train records, step_s, blocked_s, export_s, apply_s, wait_s
        self._missed = 0
        self._refusals = 0
        self._sent = 0
        self._recv = 0
        self._lag: dict[int, int] = {}
        self._versions: tuple[int, ...] = ()
        self._applies = 0
        self._last_step = -1

    @property
    def enabled(self) -> bool:
        return bool(self.writers)

    def add(self, rec: StepRecord) -> None:
        """Take one record; write the scalars when its step closes an interval (or at finish)."""
        if not self.writers:
            return
        self._sent += rec.data_bytes_sent
        self._recv += rec.data_bytes_recv
        self._applies = rec.applies
        self._versions = rec.versions
        for e in rec.events:
            kind = e.get("type")
            if kind == "apply":
                lag = e.get("lag_steps")
                if isinstance(lag, int):
                    self._lag[int(e["fragment"])] = lag
                else:
                    self._missed += 1
            elif kind == "push_dropped":
                self._missed += 1
            elif kind == "refused":
                self._refusals += int(e.get("count", 1))
        if rec.phase == "train":
            w = self._win
            w[0] += 1
            w[1] += rec.step_s
            w[2] += rec.blocked_s
            w[3] += rec.export_s
            w[4] += rec.apply_s
            w[5] += rec.wait_s
            if rec.step % self.log_interval == 0:
                self._write(rec.step)
        elif rec.phase == "finish" and rec.step != self._last_step:
            self._write(rec.step)

    def scalars(self) -> dict[str, float]:
        """The scalars as they would be written now (tag -> value)."""
        n, step_s, blocked, export, apply, wait = self._win
        out: dict[str, float] = {}
        if n:
            total = step_s + blocked
            out[PREFIX + "sync_share"] = blocked / total if total > 0 else 0.0
            out[PREFIX + "push_blocked_ms"] = 1e3 * export / n
            out[PREFIX + "apply_blocked_ms"] = 1e3 * apply / n
            out[PREFIX + "wait_blocked_ms"] = 1e3 * wait / n
        out[PREFIX + "rounds_merged"] = float(self._applies)
        out[PREFIX + "rounds_missed"] = float(self._missed)
        out[PREFIX + "refusals"] = float(self._refusals)
        out[PREFIX + "data_bytes_sent"] = float(self._sent)
        out[PREFIX + "data_bytes_recv"] = float(self._recv)
        for f, lag in sorted(self._lag.items()):
            out[f"{PREFIX}staleness_steps/f{f}"] = float(lag)
        for f, v in enumerate(self._versions):
            out[f"{PREFIX}version/f{f}"] = float(v)
        return out

    def _write(self, step: int) -> None:
        values = self.scalars()
        self._win = [0, 0.0, 0.0, 0.0, 0.0, 0.0]
        self._last_step = step
        for w in list(self.writers):
            try:
                if callable(getattr(w, "add_scalar", None)):
                    for tag, value in values.items():
                        w.add_scalar(tag, value, step)
                else:
                    w.log(values, step=step)
            except Exception as exc:  # noqa: BLE001 - an observer never stops training
                log.warning("scalar writer %s failed (%s: %s); sync scalars to it are disabled",
                            type(w).__name__, type(exc).__name__, exc)
                self.writers.remove(w)
        self.written += 1

    def flush(self) -> None:
        """Flush writers that buffer (``SummaryWriter.flush``); errors are logged, never raised."""
        for w in self.writers:
            fn = getattr(w, "flush", None)
            if callable(fn):
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001
                    log.warning("scalar writer %s: flush failed (%s)", type(w).__name__, exc)


def island_scalars(writers: Sequence[object], log_interval: int) -> ScalarView | None:
    """The view for an island's config (``IslandConfig.writers()``, ``log_interval``; 0 = the
    default interval); None when there is no writer."""
    if not writers:
        return None
    return ScalarView(writers, log_interval or DEFAULT_LOG_INTERVAL)

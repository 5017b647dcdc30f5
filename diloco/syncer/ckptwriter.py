"""The syncer's checkpoint writer: one background write at a time, off the control loop.

Writing a checkpoint of a large model takes minutes; the loop must keep answering heartbeats
meanwhile, so the write runs on a thread of its own.  The caller owns the snapshot's pins:
when :meth:`CheckpointWriter.reap` reports a finished write, the caller releases them
(``Coordinator.release_snapshot``).  A failed write is logged and remembered in ``failed``;
the syncer keeps serving without it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from diloco.syncer.core.records import FragmentSnapshot, Snapshot
from diloco.syncer.store import CheckpointStore

log = logging.getLogger("diloco.syncer.loop")


class CheckpointWriter:
    """Writes one :class:`Snapshot` at a time to ``store`` on a daemon thread."""

    def __init__(self, store: CheckpointStore | None) -> None:
        self.store = store
        self.failed = False
        """The last write raised (logged); the final exit code reports it."""
        self._thread: threading.Thread | None = None
        self._written: set[int] = set()

    @property
    def busy(self) -> bool:
        """A write is in flight or finished but not yet reaped."""
        return self._thread is not None

    def start(self, snap: Snapshot) -> None:
        """Start writing ``snap`` (the caller checked :attr:`busy` is False and a store exists).

        The writer holds the snapshot's tensors only until each fragment is on disk: the caller
        must not keep ``snap`` itself, and learns which fragments are let go from :meth:`take_written`."""
        store = self.store
        assert store is not None and self._thread is None
        self.failed = False
        frags: list[FragmentSnapshot] = list(snap.fragments)
        head = dataclasses.replace(snap, fragments=())
        written = self._written = set()

        def write() -> None:
            try:
                store.save(head, frags, written.add)
            except Exception:  # noqa: BLE001 - reported through ``failed`` on the loop thread
                log.exception("checkpoint write failed; the syncer keeps serving without it")
                self.failed = True
            finally:
                frags.clear()

        self._thread = threading.Thread(target=write, name="yeto-checkpoint", daemon=True)
        self._thread.start()

    def take_written(self) -> set[int]:
        """Fragments written since the last call (the loop unpins them: ``Coordinator.unpin``)."""
        done = set(self._written)  # set.add on the writer thread is atomic; copy, then remove those
        self._written -= done
        return done

    def reap(self, wait: bool) -> bool:
        """True once when the write in flight has finished (``wait``: wait for it first)."""
        if self._thread is None:
            return False
        if wait:
            self._thread.join()
        if self._thread.is_alive():
            return False
        self._thread = None
        return True

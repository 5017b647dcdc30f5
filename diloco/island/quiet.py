"""Which fragments' anchors a received value may land in right now (the sync rank's client).

A value received straight into the anchors saves a fragment-sized buffer, but only while
nothing else uses them: no value of the fragment pending, staging or being installed (a
staging job may write or read the anchor), and no other stream of it arriving. ``QuietAnchors``
numbers every value of a fragment as it begins arriving (``begin``), lets at most one of them
take the anchors, and frees them again when a value is installed that began after no other
(``installed``). Thread-safe: ``begin`` runs on the client's I/O thread, ``installed`` on the
training thread.
"""

from __future__ import annotations

import threading

__all__ = ["QuietAnchors"]


class QuietAnchors:
    """Quiet fragments (all of them at first) and the arrival count of each."""

    def __init__(self, n_fragments: int) -> None:
        self._lock = threading.Lock()
        self._quiet: set[int] = set(range(n_fragments))
        self._arrivals: dict[int, int] = {}

    def begin(self, f: int, may_take: bool) -> tuple[bool, int]:
        """A value of ``f`` begins arriving: (whether it takes the anchors, its arrival number).
        It takes them only if ``may_take`` (the caller's own conditions) and ``f`` is quiet. Either
        way ``f`` is busy from now until :meth:`installed` says a value begun after no other is
        installed: a pooled value staged later writes the anchors too."""
        with self._lock:
            arrival = self._arrivals[f] = self._arrivals.get(f, 0) + 1
            take = may_take and f in self._quiet
            self._quiet.discard(f)  # any value begun is outstanding, in the anchors or not
            return take, arrival

    def installed(self, f: int, arrival: int) -> None:
        """Value number ``arrival`` of ``f`` is installed: ``f`` is quiet again unless a later
        value has begun arriving since."""
        with self._lock:
            if arrival == self._arrivals.get(f, 0):
                self._quiet.add(f)

"""The digest of an INIT value, taken in stream order while its parts are copied in.

A claim (a HELLO's ``holds``) is checked against ``diloco.digest.tensor_digest`` of the syncer's
value (``cuts.py``). For the value INIT gives a fragment, that digest is taken as INIT streams,
not by a pass over the whole value after its last part: each time the parts copied in so far
extend the prefix already hashed, one :class:`~.work.DigestSpan` hashes that span of the value on
the data plane (bytes a worker has just written, usually still in cache). One span per fragment is
on the data plane at a time, so the hasher sees the stream in order while the parts themselves are
copied in any order. So the claims of the islands that start with island 0 are answered as soon as
the last part is in, instead of after a separate pass over every fragment.

:class:`InitDigest` owns one fragment's progress (which parts are in, how far the hash got); it
does no I/O and runs no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.digest import FragmentDigest
from diloco.wire.parts import FragmentLayout


@dataclass
class InitDigest:
    """One INIT stream's digest progress.

    ``hasher`` is fed by the data plane, one span at a time (:meth:`next_span` hands out at most
    one until :meth:`hashed_to` says it ended); ``copied[k]``: part ``k`` is in the value."""

    hasher: FragmentDigest
    copied: list[bool]
    hashed: int = 0
    """Parts fed to the hasher (a prefix of the stream)."""
    busy: bool = False
    """A span is on the data plane."""

    @classmethod
    def of(cls, layout: FragmentLayout, n_parts: int) -> InitDigest:
        return cls(FragmentDigest(layout.names, layout.shapes), [False] * n_parts)

    def copied_part(self, part: int) -> None:
        """Part ``part`` was copied into the value."""
        self.copied[part] = True

    def next_span(self, min_parts: int = 1) -> tuple[int, int] | None:
        """Parts ``[first, end)`` copied in and not hashed yet, at least ``min_parts`` of them or the
        rest of the stream, when no span is out (the span is then out until :meth:`hashed_to`); None
        when there is nothing to hash now."""
        if self.busy:
            return None
        end = self.hashed
        while end < len(self.copied) and self.copied[end]:
            end += 1
        if end == self.hashed or (end - self.hashed < min_parts and end < len(self.copied)):
            return None
        self.busy = True
        return self.hashed, end

    def hashed_to(self, end: int) -> None:
        """The span out ended: parts before ``end`` are hashed."""
        self.hashed, self.busy = end, False


__all__ = ["InitDigest"]

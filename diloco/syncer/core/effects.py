"""The effects of the syncer's core: what a transition asks its drivers to do.

Contract: :data:`Out` is the one type every rule of :class:`diloco.syncer.core.coordinator.Coordinator`
appends to its ``out`` list and every entry point returns: an :class:`~diloco.syncer.core.records.Outgoing`
(one small control message, sent at once) or an :class:`~diloco.syncer.core.records.OutStream` (a
parted BCAST/FINAL stream the loop encodes and paces). The helpers below build the three messages
the rules send most (PULL, BCAST, FINAL, a held FINAL) from the records they concern.

:class:`Journal` holds the effects that are not messages, until the driver takes them: the
data-plane work items (fold a part, copy an INIT part, commit a part, hash a final value) and
the event-log records; and the refusal counters the operator reads. It holds no protocol
state and does no I/O.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from diloco.syncer.core.records import FragmentRecord, IslandRecord, Outgoing, OutStream, RoundRecord
from diloco.syncer.core.work import Work
from diloco.wire import Final, Pull, bcast_dtype

Out = Outgoing | OutStream
"""One message the loop must send, in the order of the list that carries it."""

__all__ = ["Journal", "Out", "Outgoing", "OutStream", "bcast", "final", "final_or_held", "pull"]


def pull(peer: bytes, r: RoundRecord) -> Outgoing:
    """The PULL of round ``r``'s current attempt, to routing id ``peer``."""
    return Outgoing(peer, Pull(fragment=r.fragment, round=r.round, attempt=r.attempt))


def bcast(isl: IslandRecord, frag: FragmentRecord, round_: int, cut: bool) -> OutStream:
    """The current value of ``frag`` to ``isl`` (in its broadcast dtype), as of ``round_``; ``cut``:
    part of the island's cut. Noted on ``isl`` (``IslandRecord.streamed``) for a held FINAL."""
    dtype = bcast_dtype(isl.wire_dtype)
    isl.streamed(frag.index, frag.version, dtype, cut)
    return OutStream(isl.peer, "BCAST", frag.index, frag.version, round_, cut, dtype)


def final(isl: IslandRecord, frag: FragmentRecord, versions: tuple[int, ...]) -> OutStream:
    """The final value of ``frag`` to ``isl`` (fp32), with every fragment's final version."""
    return OutStream(isl.peer, "FINAL", frag.index, frag.version, 0, False, "float32", versions)


def final_or_held(isl: IslandRecord, frag: FragmentRecord, versions: tuple[int, ...]) -> Out:
    """The final value of ``frag`` to ``isl``: a HELD notice (``Final.held``, no bytes) when its
    version is the fp32 value streamed to ``isl`` after it said done (``IslandRecord.holds_final``),
    else the fp32 stream (:func:`final`). The loop sends a held notice behind every value
    already streaming to that island, so it arrives after the value it names."""
    if isl.holds_final(frag.index, frag.version):
        return Outgoing(isl.peer, Final(fragment=frag.index, version=frag.version, n_fragments=len(versions),
                                        versions=versions, part=0, n_parts=0, held=True))
    return final(isl, frag, versions)


class Journal:
    """Effects that are not messages, queued until the driver takes them, and the refusal counts.

    Owns: ``work`` (data-plane items, in dispatch order: the order of a part's folds is the fold
    order the event log records), ``events`` (event-log records, oldest first), ``refusals``
    (messages refused, all reasons), ``refused_by`` (refusals per reason code) and ``dropped``
    (refusals answered with nothing); and whether a checkpoint fell due."""

    def __init__(self) -> None:
        self.work: list[Work] = []
        self.events: list[dict[str, Any]] = []
        self.refusals = 0
        self.refused_by: Counter[str] = Counter()
        self.dropped = 0
        self.checkpoint_due = False
        """A checkpoint fell due (every ``--checkpoint-every`` commits, and at the end of the run)."""

    def take_work(self) -> list[Work]:
        """The queued data-plane work, in dispatch order; the queue is empty afterwards."""
        work, self.work = self.work, []
        return work

    def take_events(self) -> list[dict[str, Any]]:
        """The queued event-log records, oldest first; the queue is empty afterwards."""
        events, self.events = self.events, []
        return events

    def refused(self, code: str) -> None:
        """Count one refusal of reason ``code``."""
        self.refusals += 1
        self.refused_by[code] += 1

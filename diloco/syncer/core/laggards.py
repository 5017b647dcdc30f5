"""Liveness means progress: who is dropped from a round, and when (docs/PROTOCOL.md, "Quorum").

Heartbeats say an island is alive, not that it will push: a round must never wait on an island
that answers heartbeats but does not push, or whose part stream stopped. Two rules, applied to the
current attempt of every open round before the quorum rule (``merge.Merge.check_quorum``):

* **Stall**: a push started but sent no part for ``--dead-after-s``. Its parts are already in
  the running sum, so the attempt is dropped and re-pulled *without* that island.
* **Quorum timeout**: ``--quorum-timeout-s`` after the attempt started, every member that has
  not started its push is dropped from the round. A push still streaming parts is progress and
  is waited for (the stall rule bounds it). The others then commit when they meet the quorum
  (``--quorum`` pushes; with the default "all", all remaining members); else the attempt is
  re-pulled with the smaller membership. When that membership alone can never reach an
  explicit ``--quorum``, the dropped islands are asked again rather than waiting forever.

:class:`Laggards` owns one table: the islands dropped from each open round. A dropped island
stays out of the round's later attempts and is a member of the next round as usual. Each drop
is logged, counted per island (``lagged`` in the status line) and written to the event log.
Memory: one small set per open round (at most ``--max-open-rounds``). No I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Journal
from diloco.syncer.core.records import RoundRecord
from diloco.syncer.core.robust import Reference

log = logging.getLogger("diloco.syncer.core")


class Laggards:
    """Round -> islands dropped from it (their later attempts leave them out).

    Args:
        config: ``--quorum``.
        reference: per-island tallies (``lagged``).
        journal: where each drop is written to the event log.
    """

    def __init__(self, config: SyncerConfig, reference: Reference, journal: Journal) -> None:
        self.config = config
        self.reference = reference
        self.journal = journal
        self.dropped: dict[int, frozenset[int]] = {}

    def left_out(self, r: RoundRecord, open_rounds: Collection[int]) -> frozenset[int]:
        """Islands dropped from round ``r`` (forgets rounds that are no longer in ``open_rounds``)."""
        for t in [t for t in self.dropped if t not in open_rounds]:
            del self.dropped[t]
        return self.dropped.get(r.round, frozenset())

    def drop(self, r: RoundRecord, islands: frozenset[int], why: str, now: float,
             open_rounds: Collection[int]) -> None:
        """Drop ``islands`` from round ``r`` (this and its later attempts); logged, counted, recorded."""
        self.dropped[r.round] = self.left_out(r, open_rounds) | islands
        for i in sorted(islands):
            self.reference.count(i, "lagged")
        log.warning("round %d attempt %d: islands %s dropped from the round (%s); they rejoin at the next round",
                    r.round, r.attempt, sorted(islands), why)
        self.journal.events.append({"time": now, "round": r.round, "fragment": r.fragment, "attempt": r.attempt,
                                    "dropped_islands": sorted(islands), "why": why})

    def attempt_members(self, r: RoundRecord, ready: frozenset[int], open_rounds: Collection[int]) -> frozenset[int]:
        """Members of ``r``'s next attempt out of the ``ready`` islands: not those dropped from it,
        unless the rest can never reach an explicit ``--quorum`` (then they are asked again)."""
        left_out = self.left_out(r, open_rounds)
        members = ready - left_out
        if left_out & ready and 0 < self.config.quorum and len(members) < self.config.quorum:
            log.warning("round %d: --quorum %d cannot be met without islands %s: asking them again", r.round,
                        self.config.quorum, sorted(left_out & ready))
            self.dropped.pop(r.round, None)
            return ready
        return members

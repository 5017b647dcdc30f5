"""Liveness means progress: who is dropped from a round, and when (docs/PROTOCOL.md, "Quorum").

A mixin of :class:`diloco.syncer.state.SyncerState`. Heartbeats say an island is alive, not that
it will push: a round must never wait on an island that answers heartbeats but does not push,
or whose part stream stopped. Two rules, applied to the current attempt of every open round
before the quorum rule:

* **Stall**: a push started but sent no part for ``--dead-after-s``. Its parts are already in
  the running sum, so the attempt is dropped and re-pulled *without* that island.
* **Quorum timeout**: ``--quorum-timeout-s`` after the attempt started, every member that has
  not started its push is dropped from the round. A push still streaming parts is progress and
  is waited for (the stall rule bounds it). The others then commit when they meet the quorum
  (``--quorum`` pushes; with the default "all", all remaining members); else the attempt is
  re-pulled with the smaller membership. When that membership alone can never reach an
  explicit ``--quorum``, the dropped islands are asked again rather than waiting forever.

A dropped island stays out of the round's later attempts and is a member of the next round
as usual. Each drop is logged, counted per island (``lagged`` in the status line) and written
to the event log. Memory: one small set per open round (at most ``--max-open-rounds``). No I/O.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from diloco.syncer.fields import StateFields
from diloco.syncer.core.records import IslandRecord, RoundRecord
from diloco.syncer.core.robust import Reference

if TYPE_CHECKING:
    from diloco.syncer.core.effects import Out

log = logging.getLogger("diloco.syncer.state")


class Laggards(StateFields):
    """The stall and quorum-timeout drops (methods of ``SyncerState``)."""

    reference: Reference
    laggards: dict[int, frozenset[int]]
    """Round -> islands dropped from it (their later attempts leave them out)."""
    proven: set[int]
    """Islands whose current session sent a message after HELLO (``ready``)."""

    def _left_out(self, r: RoundRecord) -> frozenset[int]:
        """Islands dropped from round ``r`` (forgets rounds that are no longer open)."""
        for t in [t for t in self.laggards if t not in self.rounds]:
            del self.laggards[t]
        return self.laggards.get(r.round, frozenset())

    def _drop(self, r: RoundRecord, islands: frozenset[int], why: str, now: float) -> None:
        self.laggards[r.round] = self._left_out(r) | islands
        for i in sorted(islands):
            self.reference.count(i, "lagged")
        log.warning("round %d attempt %d: islands %s dropped from the round (%s); they rejoin at the next round",
                    r.round, r.attempt, sorted(islands), why)
        self.events.append({"time": now, "round": r.round, "fragment": r.fragment, "attempt": r.attempt,
                            "dropped_islands": sorted(islands), "why": why})

    def _drop_laggards(self, r: RoundRecord, now: float, out: list[Out]) -> bool:
        """Apply both rules to ``r``'s attempt; True when the attempt was restarted."""
        cfg = self.config
        partial = [p for p in r.pushes.values() if not p.complete]
        stalled = frozenset(p.island for p in partial if now - p.last_part_at > cfg.dead_after_s)
        if stalled:
            self._drop(r, stalled, f"no part for --dead-after-s={cfg.dead_after_s:g}s mid-push", now)
            self._restart_attempt(r, now, out, f"the push of islands {sorted(stalled)} stalled mid-stream")
            return True
        if now - r.attempt_started < cfg.quorum_timeout_s:
            return False
        silent = r.members - set(r.pushes)
        if not silent:
            return False  # every member pushes; a push still streaming is progress
        complete = sum(p.complete for p in r.pushes.values())
        pushing = r.members - silent
        if not pushing:
            # Nobody pushed at all (a network cut, a lost PULL): ask everyone again.
            self._restart_attempt(r, now, out, f"0/{len(r.members)} pushes after "
                                               f"{now - r.attempt_started:.1f}s", resend=True)
            return True
        self._drop(r, silent, f"no push after --quorum-timeout-s={cfg.quorum_timeout_s:g}s", now)
        # The value again, to dropped islands that may have lost it (a reset connection drops what
        # TCP held without a send error); an island that has it ignores the replay.
        frag = self.fragments[r.fragment]
        for i in sorted(silent):
            isl = self.islands[i]
            if isl.bound and isl.alive and isl.cut_sent:
                out.append(self._bcast(isl, frag, frag.round, cut=False))
        r.members = pushing
        need = cfg.quorum if cfg.quorum > 0 else 1
        if partial or complete >= need:
            return False  # the quorum rule closes the round with the others (or waits for a streaming push)
        self._restart_attempt(r, now, out, f"{complete} pushes after {now - r.attempt_started:.1f}s, "
                                           f"--quorum {cfg.quorum}")
        return True

    def _attempt_members(self, r: RoundRecord, ready: frozenset[int]) -> frozenset[int]:
        """Members of ``r``'s next attempt out of the ``ready`` islands: not those dropped from it,
        unless the rest can never reach an explicit ``--quorum`` (then they are asked again)."""
        left_out = self._left_out(r)
        members = ready - left_out
        if left_out & ready and 0 < self.config.quorum and len(members) < self.config.quorum:
            log.warning("round %d: --quorum %d cannot be met without islands %s: asking them again", r.round,
                        self.config.quorum, sorted(left_out & ready))
            self.laggards.pop(r.round, None)
            return ready
        return members

    def ready(self) -> list[IslandRecord]:
        """Islands that may be members of a round: live, cut sent, not evicted, and *proven*: a HELLO
        alone is not membership; the island must have sent a message of its session since (a
        HEARTBEAT, INIT, PUSH or FINAL_ACK sealed with the WELCOME's nonce)."""
        return [i for i in self.live() if i.cut_sent and not i.evicted and i.island in self.proven]

"""Recovery rules of the syncer's core: what is owed after a lost message, how refused pushes count
towards eviction, and why an attempt is dropped and re-pulled rather than patched (docs/PROTOCOL.md,
"Faults"; docs/RELIABILITY.md).

:class:`Recovery` owns no table: it applies these rules across the tables it is handed (sessions,
rounds, fragments, laggards) through their own methods, and appends what to send to ``out``. A
started push cannot be taken out of the running sum, so a broken attempt is always replaced by a
new one; a non-finite commit leaves value and momentum exactly as they were. No I/O.
"""

from __future__ import annotations

import logging

from diloco.protocol import refusals
from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.checks import Refused
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Journal, Out, bcast, final, pull
from diloco.syncer.core.finalize import Finalize
from diloco.syncer.core.laggards import Laggards
from diloco.syncer.core.records import IslandRecord, Outgoing, RoundRecord
from diloco.syncer.core.robust import BOUND_MARK, Reference
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.wire import Error, Push

log = logging.getLogger("diloco.syncer.core")

COUNTED_REFUSALS = refusals.COUNTED
"""PUSH refusals that count towards ``--max-refusals`` (with ``bad_push`` from the data plane): what
the island sent was wrong. Races (an attempt or round that moved on meanwhile) do not count."""


class Recovery:
    """Lost messages, refusal counting, attempt restarts and dropped commits.

    Args:
        config: ``--max-refusals``, ``--islands``.
        sessions, rounds, book, laggards, final: the tables these rules read and change (each
            through its own methods).
        reference: robust-aggregation tallies and the islands benched from the next attempt.
        journal: events and refusal counts.
    """

    def __init__(self, config: SyncerConfig, sessions: Sessions, rounds: RoundBook, book: FragmentBook,
                 laggards: Laggards, final: Finalize, reference: Reference, journal: Journal) -> None:
        self.config = config
        self.sessions = sessions
        self.rounds = rounds
        self.book = book
        self.laggards = laggards
        self.final = final
        self.reference = reference
        self.journal = journal

    def on_push_refused(self, h: Push, r: Refused, now: float, out: list[Out]) -> None:
        """Bookkeeping of a refused PUSH from a bound island's current generation: its later parts
        are dropped quietly, ``stale_base`` sends the current value and the PULL again, and the
        refusal counts towards ``--max-refusals``."""
        if not 0 <= h.island < self.config.islands:
            return
        rec = self.sessions.islands[h.island]
        if not rec.bound or h.generation != rec.generation:
            return
        if h.part == 0:
            rec.refused_push = (h.round, h.attempt)
        rnd = self.rounds.get(h.round)
        if r.code == "stale_base" and rnd is not None and rec.cut_sent and rec.alive:
            frag = self.book.fragments[r.fragment]
            out.append(bcast(rec, frag, frag.round, cut=False))
            out.append(pull(rec.peer, rnd))  # the loop sends it after the value
        if r.code in COUNTED_REFUSALS:
            self.count_refusal(rec, f"{r.code}: {r.reason}", now, out)

    def count_refusal(self, rec: IslandRecord, why: str, now: float, out: list[Out]) -> None:
        """One more push refusal in a row; ``--max-refusals`` of them evict the island from rounds
        (one island whose pushes are always refused must not re-pull the same round forever)."""
        rec.refusals_in_row += 1
        if why.startswith("bad_push"):
            self.reference.count(rec.island, "refused")
        if why.startswith("bad_push") and BOUND_MARK in why:
            # An out-of-bound delta is no accident: its attempt is replaced without the island, so the
            # round commits with the others (a corrupted or non-finite part is re-pulled from it).
            self.reference.benched.add(rec.island)
        if rec.evicted or rec.refusals_in_row < self.config.max_refusals:
            return
        rec.evicted = True
        reason = (f"island {rec.island} evicted from rounds after {rec.refusals_in_row} refused pushes in a row "
                  f"(--max-refusals {self.config.max_refusals}; last: {why[:200]}); it is readmitted when it "
                  f"says HELLO again")
        log.error("%s", reason)
        self.journal.events.append({"time": now, "evicted": rec.island, "reason": why[:200]})
        out.append(Outgoing(rec.peer, Error(code="evicted", reason=reason)))
        self.rounds.leave_out(rec.island)

    def deliver_owed(self, out: list[Out]) -> None:
        """Resend what a send error lost (``Sessions.on_lost``), once the island was heard from after it."""
        phase = self.final.phase
        for rec in self.sessions.live():
            if not (rec.owed or rec.owe_pulls) or rec.last_seen <= rec.lost_at:
                continue
            owed, rec.owed, rec.owe_pulls = rec.owed, {}, False
            for f, cut in sorted(owed.items()):
                frag = self.book.fragments[f]
                if frag.consuming:
                    rec.owed[f] = cut  # its value goes as the commit passes it: the new one follows
                    continue
                if self.final.owes_final(rec):
                    out.append(final(rec, frag, self.book.versions()))
                elif phase == "running" and rec.has_cut(f) and frag.initialised:
                    log.info("island %d: resending fragment %d version %d%s", rec.island, f, frag.version,
                             " (cut)" if cut else "")
                    out.append(bcast(rec, frag, frag.round, cut))
            if phase == "running" and rec.cut_sent:
                for r in self.rounds.in_order():
                    if rec.island in r.members and rec.island not in r.pushes and not r.closed:
                        out.append(pull(rec.peer, r))

    def restart_attempt(self, r: RoundRecord, now: float, out: list[Out], why: str, resend: bool = False) -> None:
        """Drop the attempt's pushes (and its running sum) and pull the live members again.

        ``resend`` (a quorum timeout): members that did not push get the fragment's current value
        first. A member that lost a BCAST or its cut without a send error (a connection reset
        drops what TCP still held) never pushes that fragment; this is how it gets it again.
        An island that has the value ignores the replay."""
        if r.sum is not None:
            r.sum.void = True
        benched = self.reference.benched
        members = self.laggards.attempt_members(
            r, frozenset(i.island for i in self.sessions.ready() if i.island not in benched), self.rounds.numbers())
        if benched:
            log.warning("round %d: islands %s left out of the next attempt (their part was refused)", r.round,
                        sorted(benched))
            benched.clear()
        if resend:
            frag = self.book.fragments[r.fragment]
            for i in sorted(r.members - set(r.pushes)):
                isl = self.sessions.islands[i]
                if i in members:
                    out.append(bcast(isl, frag, frag.round, cut=False))
        log.warning("round %d attempt %d dropped (%s): re-pulling %s as attempt %d", r.round, r.attempt, why,
                    sorted(members), r.attempt + 1)
        self.rounds.restart(r, members, now)
        out.extend(pull(self.sessions.islands[i].peer, r) for i in sorted(members))

    def drop_commit(self, r: RoundRecord, now: float, out: list[Out]) -> None:
        """A commit whose result is not finite changes nothing (value and momentum were written out
        of place): the round is dropped, logged and re-pulled as a new attempt."""
        frag = self.book.fragments[r.fragment]
        frag.committing = frag.consuming = False
        r.new_momentum = None
        r.closed = r.committing = False
        self.journal.refusals += 1
        log.error("round %d fragment %d attempt %d: the outer step's result is not finite (%s); nothing "
                  "committed (fragment stays at version %d), re-pulling", r.round, r.fragment, r.attempt,
                  r.commit_failed, frag.version)
        self.journal.events.append({"time": now, "round": r.round, "fragment": r.fragment, "attempt": r.attempt,
                                    "dropped": "non-finite commit", "pushed": sorted(r.pushes)})
        self.restart_attempt(r, now, out, "the commit's result was not finite")

"""The rounds table and the round clock (docs/PROTOCOL.md, "Rounds", "Flush rounds").

:class:`RoundBook` owns the open rounds (one :class:`~diloco.syncer.core.records.RoundRecord`
each, an ``OpenRound``: its fragment, attempt, frozen members, pushes and running sum), the next
round to open and the first round not yet committed. Its rules: which island's step opens a
round when islands run at different speeds (the K-th fastest still training), one open round
per fragment, at most ``--max-open-rounds`` and of them at most ``--max-gathering-rounds`` still
gathering pushes, a round's sum must fit the fragment buffers'
budget (it waits at most ``book.OVER_BUDGET_WAIT_S``), how an attempt restarts, and that
commits retire rounds so that ``next_commit`` is the first uncommitted one.

It reads the fragments' buffers through the :class:`~diloco.syncer.core.book.FragmentBook` it is
handed and changes only its own table; the coordinator sends the PULLs. No I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from diloco.protocol.schedule import Schedule
from diloco.syncer.core.book import OVER_BUDGET_WAIT_S, FragmentBook
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.records import IslandRecord, RoundRecord

log = logging.getLogger("diloco.syncer.core")

OpenRound = RoundRecord
"""An open round of the table (the record type)."""


class RoundBook:
    """Open rounds, ``next_open`` and ``next_commit``.

    Args:
        config: ``--sync-every``, ``--total-steps``, ``--quorum``, ``--max-open-rounds``.
        book: the fragments table and its buffer budget (read only).
    """

    def __init__(self, config: SyncerConfig, book: FragmentBook) -> None:
        self.config = config
        self.book = book
        self.rounds: dict[int, OpenRound] = {}
        self.next_open = 1  # next round number to open
        self.next_commit = 1  # rounds commit strictly in this order
        self.over_budget_since: float | None = None
        """Clock since when the next round waits for fragment buffers to be let go (:meth:`sum_fits`)."""

    # ------------------------------------------------------------------ queries

    def in_order(self) -> list[OpenRound]:
        """The open rounds, oldest first."""
        return sorted(self.rounds.values(), key=lambda r: r.round)

    def get(self, round_: int) -> OpenRound | None:
        return self.rounds.get(round_)

    def numbers(self) -> set[int]:
        """The numbers of the open rounds."""
        return set(self.rounds)

    def has_fragment(self, fragment: int) -> bool:
        """Whether a round of ``fragment`` is open (one open round per fragment)."""
        return any(r.fragment == fragment for r in self.rounds.values())

    def full(self) -> bool:
        """Whether no further round may open now: ``--max-open-rounds`` are open, or
        ``--max-gathering-rounds`` of them still gather pushes (not closed)."""
        gathering = sum(not r.closed for r in self.rounds.values())
        return len(self.rounds) >= self.config.max_open_rounds or gathering >= self.config.max_gathering_rounds

    def status(self) -> str:
        """The open rounds for the status line: round/fragment/attempt:complete/members, C closed, F flush."""
        return " ".join(
            f"r{r.round}/f{r.fragment}/a{r.attempt}:{sum(p.complete for p in r.pushes.values())}/{len(r.members)}"
            f"{'C' if r.closed else ''}{'F' if r.flush else ''}"
            for r in self.in_order()
        )

    # ------------------------------------------------------------------ budget

    def fits(self, fragment: int) -> bool:
        """Whether one more buffer of ``fragment``'s size fits the fragment buffers' budget, counting the
        buffers alive now and the sums of open rounds that are still to be allocated; the book's spare
        counts as free (the next sum takes it, or it is let go)."""
        sizes = {f.index: f.layout.numel * 4 for f in self.book.fragments if f.layout is not None}
        pending = sum(sizes.get(r.fragment, 0) for r in self.rounds.values() if r.sum is None)
        alive = self.book.live_bytes - self.book.spare_bytes
        return alive + pending + sizes.get(fragment, 0) <= self.book.limit_bytes()

    def sum_fits(self, fragment: int, now: float) -> bool:
        """Whether a new round of ``fragment`` fits the fragment buffers' budget (``book.FragmentBook``):
        the buffers alive now (a superseded value a stream or a checkpoint still reads counts until
        it is let go), the sums of open rounds still to be allocated, and this round's sum. A round
        that does not fit waits, at most ``book.OVER_BUDGET_WAIT_S``, then opens with a warning."""
        book = self.book
        if self.fits(fragment):
            self.over_budget_since = None
            return True
        if self.over_budget_since is None:
            self.over_budget_since = now
            log.info("round %d waits: %.0f MiB of fragment buffers alive (superseded values still being sent "
                     "or checkpointed), budget %.0f MiB", self.next_open, book.live_bytes / 2**20,
                     book.limit_bytes() / 2**20)
        if now - self.over_budget_since < OVER_BUDGET_WAIT_S:
            return False
        log.warning("round %d opens over the memory budget after %.0fs: %.0f MiB of fragment buffers alive, "
                    "budget %.0f MiB (a slow stream or checkpoint holds superseded values)", self.next_open,
                    now - self.over_budget_since, book.live_bytes / 2**20, book.limit_bytes() / 2**20)
        self.over_budget_since = None
        return True

    # ------------------------------------------------------------------ the round clock

    def open(self, t: int, fragment: int, members: frozenset[int], now: float, flush: bool) -> OpenRound:
        """Open round ``t`` of ``fragment`` with ``members`` (attempt 0)."""
        r = RoundRecord(round=t, fragment=fragment, attempt=0, members=members, attempt_started=now, flush=flush)
        self.rounds[t] = r
        self.next_open = t + 1
        return r

    def open_training(self, ready: Sequence[IslandRecord], now: float) -> tuple[list[OpenRound], bool]:
        """The round clock (docs/PROTOCOL.md, "Rounds"): the K-th fastest ``ready`` island still
        training opens every round whose opening step it reached, in order, while the previous
        round of that fragment committed, ``--max-open-rounds`` allows and the sum fits.

        Once every ``ready`` island is done, the clock is the last step all of them reached: the
        rounds due by then still open as training rounds (an island that reports its last step and
        its end at once, as one whose last ``on_step_end`` finishes, loses no scheduled round to the
        flush), and the schedule is over at the first round not due.

        Returns the rounds opened, and whether the schedule is over (only flush rounds are left)."""
        members = frozenset(i.island for i in ready)
        sched = Schedule(self.config.sync_every, self.book.n_fragments, self.config.total_steps)
        training = sorted((i.last_step for i in ready if not i.done), reverse=True)
        opened: list[OpenRound] = []
        all_done = not training
        if all_done:
            clock = min((i.last_step for i in ready), default=0)
        else:
            clock = training[min(self.config.effective_quorum, len(training)) - 1]
        while True:
            t = self.next_open
            threshold = sched.opening_step(t)
            if not sched.in_training(t):
                return opened, True  # the schedule is over: only the flush is left
            if clock < threshold:
                return opened, all_done
            fragment = sched.fragment_of(t)
            if self.has_fragment(fragment):
                return opened, False  # the previous round of this fragment is still uncommitted
            if self.full():
                return opened, False  # each open round holds a running sum
            if not self.sum_fits(fragment, now):
                return opened, False
            opened.append(self.open(t, fragment, members, now, flush=False))
            log.info("open round %d fragment %d (clock step %d >= %d), members %s", t, fragment, clock,
                     threshold, sorted(members))

    def open_flush(self, flush_left: set[int], members: frozenset[int], now: float) -> list[OpenRound]:
        """One flush round per fragment of ``flush_left`` not open yet, within the same limits."""
        opened: list[OpenRound] = []
        for fragment in sorted(flush_left):
            if self.has_fragment(fragment):
                continue
            if any(r.flush and r.fragment == fragment for r in self.rounds.values()):
                continue
            if self.full() or not self.sum_fits(fragment, now):
                return opened
            opened.append(self.open(self.next_open, fragment, members, now, flush=True))
            log.info("open flush round %d fragment %d, members %s", self.next_open - 1, fragment, sorted(members))
        return opened

    # ------------------------------------------------------------------ attempts and commits

    def restart(self, r: OpenRound, members: frozenset[int], now: float) -> None:
        """Drop ``r``'s attempt (its pushes, and its running sum, voided for the folds still queued) and
        start the next one with ``members``."""
        if r.sum is not None:
            r.sum.void = True
        r.attempt += 1
        r.pushes.clear()
        r.sum = None
        r.members = members
        r.attempt_started = now
        r.grace_deadline = None

    def leave_out(self, island: int) -> None:
        """``island`` is evicted: it leaves the members of every open round it has not pushed to yet."""
        for r in self.rounds.values():
            if not r.closed and island in r.members and island not in r.pushes:
                r.members = r.members - {island}

    def retire(self, r: OpenRound) -> None:
        """``r`` committed: it leaves the table. Commits start in round order but may finish out of it,
        so ``next_commit`` is the first round still open (or the next to open)."""
        del self.rounds[r.round]
        self.next_commit = min(self.rounds, default=self.next_open)

    def resume_at(self, next_round: int) -> None:
        """A checkpoint's next round: the first round to open and to commit."""
        self.next_open = self.next_commit = next_round

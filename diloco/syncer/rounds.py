"""The round clock and finalization of the syncer state machine (docs/PROTOCOL.md, "Rounds",
"Flush rounds", "Finalization").

A mixin of :class:`diloco.syncer.state.SyncerState`, kept apart so the state's handlers read
as message rules and this module reads as the schedule: which island's step opens a round
when islands run at different speeds, when the flush rounds come, and when the final cut goes
out (and again, to islands that have not acknowledged it).  It only reads and writes the
state's own records; no I/O.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from diloco.protocol.schedule import Schedule
from diloco.syncer.core.book import OVER_BUDGET_WAIT_S
from diloco.syncer.core.work import DigestFragment
from diloco.syncer.fields import StateFields
from diloco.syncer.core.records import FragmentRecord, IslandRecord, Outgoing, OutStream, RoundRecord
from diloco.wire import Shutdown

if TYPE_CHECKING:
    from diloco.syncer.core.effects import Out

log = logging.getLogger("diloco.syncer.state")


class RoundClock(StateFields):
    """Round opening, flush rounds and finalization (methods of ``SyncerState``)."""

    def _finished_training(self, isl: IslandRecord) -> bool:
        total = self.config.total_steps
        return isl.done or (total > 0 and isl.last_step >= total)

    def _open_rounds(self, now: float, out: list[Out]) -> None:
        """The round clock (docs/PROTOCOL.md, "Rounds"): the K-th fastest island still training
        opens rounds; once every island finished, one flush round per fragment."""
        if not self.initialised:
            return
        ready = self.ready()  # a HELLO alone is not membership (laggards.py)
        if not ready:
            return
        members = frozenset(i.island for i in ready)
        sched = Schedule(self.config.sync_every, self.n_fragments, self.config.total_steps)
        training = sorted((i.last_step for i in ready if not i.done), reverse=True)
        if training:
            clock = training[min(self.config.effective_quorum, len(training)) - 1]
            while True:
                t = self.next_open
                threshold = sched.opening_step(t)
                if not sched.in_training(t):
                    break  # the schedule is over: only the flush is left
                if clock < threshold:
                    return
                fragment = sched.fragment_of(t)
                if any(r.fragment == fragment for r in self.rounds.values()):
                    return  # the previous round of this fragment is still uncommitted
                if len(self.rounds) >= self.config.max_open_rounds:
                    return  # --max-open-rounds: each open round holds a running sum
                if not self._sum_fits(fragment, now):
                    return
                self._open(t, fragment, members, now, out, flush=False)
                log.info("open round %d fragment %d (clock step %d >= %d), members %s", t, fragment, clock,
                         threshold, sorted(members))
        if not all(self._finished_training(i) for i in ready):
            return
        if self.flush_left is None:
            self.flush_left = set(sched.flush_fragments())
            log.info("every island finished training: one flush round per fragment merges their last steps")
        for fragment in sorted(self.flush_left):
            if any(r.fragment == fragment for r in self.rounds.values()):
                continue
            if any(r.flush and r.fragment == fragment for r in self.rounds.values()):
                continue
            if len(self.rounds) >= self.config.max_open_rounds or not self._sum_fits(fragment, now):
                return
            self._open(self.next_open, fragment, members, now, out, flush=True)
            log.info("open flush round %d fragment %d, members %s", self.next_open - 1, fragment, sorted(members))

    def _fits(self, fragment: int) -> bool:
        """Whether one more buffer of ``fragment``'s size fits the fragment buffers' budget, counting the
        buffers alive now and the sums of open rounds that are still to be allocated."""
        sizes = {f.index: f.layout.numel * 4 for f in self.fragments if f.layout is not None}
        pending = sum(sizes.get(r.fragment, 0) for r in self.rounds.values() if r.sum is None)
        return self.book.live_bytes + pending + sizes.get(fragment, 0) <= self.book.limit_bytes(self.fragments)

    def _sum_fits(self, fragment: int, now: float) -> bool:
        """Whether a new round of ``fragment`` fits the fragment buffers' budget (``book.FragmentBook``):
        the buffers alive now (a superseded value a stream or a checkpoint still reads counts until
        it is let go), the sums of open rounds still to be allocated, and this round's sum. A round
        that does not fit waits, at most ``book.OVER_BUDGET_WAIT_S``, then opens with a warning."""
        if self._fits(fragment):
            self.over_budget_since = None
            return True
        if self.over_budget_since is None:
            self.over_budget_since = now
            log.info("round %d waits: %.0f MiB of fragment buffers alive (superseded values still being sent "
                     "or checkpointed), budget %.0f MiB", self.next_open, self.book.live_bytes / 2**20,
                     self.book.limit_bytes(self.fragments) / 2**20)
        if now - self.over_budget_since < OVER_BUDGET_WAIT_S:
            return False
        log.warning("round %d opens over the memory budget after %.0fs: %.0f MiB of fragment buffers alive, "
                    "budget %.0f MiB (a slow stream or checkpoint holds superseded values)", self.next_open,
                    now - self.over_budget_since, self.book.live_bytes / 2**20,
                    self.book.limit_bytes(self.fragments) / 2**20)
        self.over_budget_since = None
        return True

    def _open(self, t: int, fragment: int, members: frozenset[int], now: float, out: list[Out], flush: bool) -> None:
        r = RoundRecord(round=t, fragment=fragment, attempt=0, members=members, attempt_started=now, flush=flush)
        self.rounds[t] = r
        self.next_open = t + 1
        out.extend(self._pull(r, i) for i in sorted(members))

    def _maybe_finalize(self, now: float, out: list[Out]) -> None:
        if not self.initialised or self.rounds or self.flush_left is None or self.flush_left:
            return
        everyone = self.live()
        live = [i for i in everyone if not i.evicted]
        if not live or not all(self._finished_training(i) for i in live):
            return
        missing = [i.island for i in self.islands if not i.joined]
        if missing:
            if self.started_at is None or now - self.started_at < self.config.join_timeout_s:
                return  # a slow island may still be starting: let it join the run
            log.warning("finalizing without islands %s: they never joined within --join-timeout-s=%.0fs",
                        missing, self.config.join_timeout_s)
        self.phase = "final"
        self.final_deadline = now + self.config.final_timeout_s
        self.final_resend_at = now + self._final_resend_s()
        self.final_expected = frozenset(i.island for i in live)
        versions = self.versions()
        m = self.merged_summary()
        log.info("finalizing: FINAL %s to islands %s; merged: %s", list(versions), sorted(self.final_expected), m)
        if m["scheduled_rounds"] and m["changed_in_training"] < m["scheduled_rounds"]:
            log.warning("only %d of %d scheduled rounds changed the model during training (the others merged "
                        "nothing: islands pushed no local steps, or rounds opened too late)",
                        m["changed_in_training"], m["scheduled_rounds"])
        self.events.append({"time": now, "summary": m})
        for frag in self.fragments:
            # FINAL_ACKs carry digests of what islands installed; ours is computed off the loop.
            assert frag.value is not None and frag.layout is not None
            frag.digest = None
            self.work.append(DigestFragment(frag.index, frag.value, frag.layout))
        for isl in everyone:  # an evicted island gets the final cut too, but is not waited for
            isl.final_acked = False
            isl.final_digests = ()
            out.extend(self._finals(isl))

    def _final_resend_s(self) -> float:
        """Period of the FINAL resend to islands that have not acknowledged it."""
        return min(self.config.quorum_timeout_s, self.config.final_timeout_s / 3)

    def _final(self, isl: IslandRecord, frag: FragmentRecord) -> OutStream:
        return OutStream(isl.peer, "FINAL", frag.index, frag.version, 0, False, "float32", self.versions())

    def _finals(self, isl: IslandRecord) -> list[Out]:
        return [self._final(isl, frag) for frag in self.fragments]

    def _finish(self, code: int, reason: str, out: list[Out]) -> None:
        self.phase = "done"
        self.exit_code = code
        self.checkpoint_due = True
        for isl in self.islands:
            if isl.bound:
                out.append(Outgoing(isl.peer, Shutdown(reason=reason)))

"""The merge rules of the syncer's core: fold results, laggards, quorum, and the commit
(docs/PROTOCOL.md, "Quorum", "Commit").

Commits start in round order and the commits of different fragments run side by side on the
data plane (each part of each commit is one work item); a fragment's next round opens while
another fragment commits, within ``--max-open-rounds``. Memory: the new value is written where
the round's sum was; the momentum (only with ``--outer-momentum > 0``) is updated in place,
unless a checkpoint in flight reads it or the overflow bound (``kernels.step_bound``, from the
largest magnitudes of sum, value and momentum kept per part) cannot prove the step finite: then
it is written beside the old one, checked, and a non-finite result changes nothing.

:class:`Merge` owns the run's commit counters (commits, rounds that changed the model, the last
merge's throughput); the tables it works on (rounds, fragments, islands) are handed to it and
changed through their own methods where they have one. No I/O.
"""

from __future__ import annotations

import logging

import torch

from diloco.outer import OuterHyper
from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Journal, Out, bcast
from diloco.syncer.core.finalize import Finalize
from diloco.syncer.core.kernels import FLT_MAX, step_bounds
from diloco.syncer.core.laggards import Laggards
from diloco.syncer.core.records import FragmentRecord, Outgoing, RoundRecord
from diloco.syncer.core.recovery import Recovery
from diloco.syncer.core.robustrules import judge_unjudged
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.syncer.core.work import CommitPart, FoldPart, PageLoan, Result, commit_span
from diloco.wire import Error, bcast_dtype

log = logging.getLogger("diloco.syncer.core")

PIN_WAIT_S = 30.0
"""Longest a commit with momentum waits for the checkpoint in flight to write its fragment."""


class Merge:
    """Fold results, laggards, quorum and commits.

    Args:
        config: quorum, grace, timeouts, part size, ``--checkpoint-every``, the outer optimizer.
        sessions, rounds, book, final: the tables these rules read and change.
        laggards: the islands dropped per round (the stall and quorum-timeout rules).
        recovery: attempt restarts, refusal counting, dropped commits.
        journal: data-plane work, events, refusal counts, the checkpoint flag.
    """

    def __init__(self, config: SyncerConfig, sessions: Sessions, rounds: RoundBook, book: FragmentBook,
                 final: Finalize, laggards: Laggards, recovery: Recovery, journal: Journal) -> None:
        self.config = config
        self.sessions = sessions
        self.rounds = rounds
        self.book = book
        self.final = final
        self.laggards = laggards
        self.recovery = recovery
        self.journal = journal
        self.hyper = OuterHyper(lr=config.outer_lr, momentum=config.outer_momentum)
        self.flush_hyper = OuterHyper(lr=1.0, momentum=0.0) if config.flush_merge == "mean" else self.hyper
        """The flush rounds' step: the plain weighted mean by default (``--flush-merge``)."""
        self.merge_stats: tuple[float, float] | None = None
        """(GB/s, seconds) of the last commit: fragment bytes over its commit time."""
        self.commits = 0
        self.changed_training = 0
        self.changed_flush = 0
        self.digest_seed = 0
        """Chunk-digest seed of the payloads we encode (``wire.digest_seed`` of the key; the loop sets it)."""
        self.loans: dict[int, PageLoan] = {}
        """Per fragment whose commit consumes its old value: that value's buffer, to lend (``PageLoan``)."""

    def sum_buffer(self, numel: int) -> tuple[torch.Tensor, PageLoan | None, bool]:
        """Memory for a new round's sum of ``numel`` elements, and where it lies: the book's resident
        spare (``FragmentBook.take_spare``; True), else the buffer of an old value a running commit
        consumes, when the loop let it be lent and it is :func:`~diloco.syncer.core.work.reusable`
        (the pages that commit passes stay resident for this sum; the loan), else fresh memory
        (``book.fresh``). Only the last is zeroed anew by the kernel as the folds first touch it."""
        spare = self.book.take_spare(numel)
        if spare is not None:
            return spare, None, True
        self.loans = {f: loan for f, loan in self.loans.items()  # a taken loan left the table already
                      if self.book.fragments[f].committing and (loan.keep or not loan.all_passed)}
        for f, loan in list(self.loans.items()):
            flat = loan.take(numel)
            if flat is not None:
                del self.loans[f]
                return flat, loan, False
        return self.book.fresh(numel, "sum"), None, False

    def _other_sums(self, r: RoundRecord) -> bool:
        """Whether an open round other than ``r`` holds a sum."""
        return any(o.sum is not None for o in self.rounds.in_order() if o is not r)

    def drop_laggards(self, r: RoundRecord, now: float, out: list[Out]) -> bool:
        """Apply the stall and quorum-timeout rules (``laggards.py``) to ``r``'s attempt; True when the
        attempt was restarted."""
        cfg = self.config
        partial = [p for p in r.pushes.values() if not p.complete]
        stalled = frozenset(p.island for p in partial if now - p.last_part_at > cfg.dead_after_s)
        if stalled:
            self.laggards.drop(r, stalled, f"no part for --dead-after-s={cfg.dead_after_s:g}s mid-push", now,
                               self.rounds.numbers())
            self.recovery.restart_attempt(r, now, out, f"the push of islands {sorted(stalled)} stalled mid-stream")
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
            self.recovery.restart_attempt(r, now, out, f"0/{len(r.members)} pushes after "
                                                       f"{now - r.attempt_started:.1f}s", resend=True)
            return True
        self.laggards.drop(r, silent, f"no push after --quorum-timeout-s={cfg.quorum_timeout_s:g}s", now,
                           self.rounds.numbers())
        # The value again, to dropped islands that may have lost it (a reset connection drops what
        # TCP held without a send error); an island that has it ignores the replay.
        frag = self.book.fragments[r.fragment]
        for i in sorted(silent):
            isl = self.sessions.islands[i]
            if isl.bound and isl.alive and isl.cut_sent:
                out.append(bcast(isl, frag, frag.round, cut=False))
        r.members = pushing
        need = cfg.quorum if cfg.quorum > 0 else 1
        if partial or complete >= need:
            return False  # the quorum rule closes the round with the others (or waits for a streaming push)
        self.recovery.restart_attempt(r, now, out, f"{complete} pushes after {now - r.attempt_started:.1f}s, "
                                                   f"--quorum {cfg.quorum}")
        return True

    def merge_timed(self, r: RoundRecord, frag: FragmentRecord, now: float) -> None:
        """Commit time and merge throughput of the fragment (the status line's ``merge=``)."""
        assert frag.layout is not None
        seconds = max(now - r.commit_started, 1e-9)
        frag.commit_s = seconds
        self.merge_stats = (frag.layout.numel * 4 / seconds / 1e9, seconds)

    def on_folded(self, work: FoldPart, result: Result, now: float, out: list[Out]) -> None:
        """One part folded (or refused: the island is charged and the attempt re-pulled); a fold of an
        attempt dropped meanwhile changes nothing."""
        r = self.rounds.get(work.sum.round)
        if r is None or r.sum is not work.sum:
            return  # the attempt was dropped meanwhile
        if result.error:
            self.journal.refusals += 1
            log.warning("round %d attempt %d: part %d from island %d refused (%s): it is folded into nothing, "
                        "but earlier parts were; dropping the attempt", r.round, r.attempt, work.part, work.island,
                        result.error)
            isl = self.sessions.islands[work.island]
            out.append(Outgoing(isl.peer, Error(code="bad_push", reason=result.error)))
            self.recovery.count_refusal(isl, f"bad_push: {result.error}", now, out)
            self.recovery.restart_attempt(r, now, out, f"a part of island {work.island} was refused")
            return
        push = r.pushes[work.island]
        push.folded += 1
        if push.complete:
            self.sessions.islands[work.island].refusals_in_row = 0
            self.maybe_start_grace(r, now)


    def maybe_start_grace(self, r: RoundRecord, now: float) -> None:
        """Start ``r``'s grace window (``--grace-ms``) once the quorum of its pushes is complete."""
        done = sum(p.complete for p in r.pushes.values())
        if done >= self.config.effective_quorum and r.grace_deadline is None:
            r.grace_deadline = now + self.config.grace_ms / 1000.0


    def check_quorum(self, r: RoundRecord, now: float, out: list[Out]) -> None:
        """Close, wait, or drop the attempt (docs/PROTOCOL.md, "Quorum").

        A push that has started streaming is already in the running sum and cannot be
        taken out again: while it keeps sending parts the round waits for it. Stalls and
        members silent past the quorum timeout are dropped first (:meth:`drop_laggards`)."""
        if r.closed or self.drop_laggards(r, now, out):
            return  # a stalled push or the quorum timeout restarted the attempt (:meth:`drop_laggards`)
        k = self.config.effective_quorum
        complete = sum(p.complete for p in r.pushes.values())
        partial = [p for p in r.pushes.values() if not p.complete]
        if r.members and complete == len(r.members):
            r.closed = True
        elif complete >= k and r.grace_deadline is not None and now >= r.grace_deadline and not partial:
            r.closed = True

    def start_commits(self, now: float, out: list[Out]) -> None:
        """Start every commit that may start: commits *start* in round order (a closed round waits
        for every earlier round to have started its commit), but run side by side when they are of
        different fragments; a fragment's own commits never overlap (one open round per fragment)."""
        for r in self.rounds.in_order():
            if r.committing:
                continue
            if not r.closed or self.book.fragments[r.fragment].committing or self.waits_for_checkpoint(r, now):
                return
            self.start_commit(r, now, out)

    def waits_for_checkpoint(self, r: RoundRecord, now: float) -> bool:
        """With momentum, a commit updates it in place, but the checkpoint in flight may still have to
        write the fragment (``pinned``): then the new momentum goes beside the old one if that buffer
        fits the memory budget (``RoundBook.fits``: the next round then waits for it instead), else the
        commit waits for the writer, at most :data:`PIN_WAIT_S`, and after that writes it beside anyway."""
        hyper = self.flush_hyper if r.flush else self.hyper
        if (hyper.momentum <= 0 or not self.book.is_pinned(r.fragment)
                or self.book.fragments[r.fragment].momentum is None or self.rounds.fits(r.fragment)):
            r.pin_wait_since = None
            return False
        if r.pin_wait_since is None:
            r.pin_wait_since = now
        if now - r.pin_wait_since < PIN_WAIT_S:
            return True
        log.warning("round %d: the checkpoint in flight has not written fragment %d after %.0fs; committing "
                    "with the new momentum beside the old one", r.round, r.fragment, now - r.pin_wait_since)
        return False

    def start_commit(self, r: RoundRecord, now: float, out: list[Out]) -> None:
        """Merge a closed round on the data plane, one CommitPart per span of parts (an attempt judged by nothing
        whose weights exceed the cap is re-pulled instead: ``robustrules.judge_unjudged``)."""
        unjudged = judge_unjudged(self.config, self.recovery.reference, self.journal, r, now)
        if unjudged is not None:
            self.recovery.restart_attempt(r, now, out, unjudged)
            return
        frag = self.book.fragments[r.fragment]
        total = sum(p.weight for p in r.pushes.values())
        if total == 0 or r.sum is None:
            self.finish_commit(r, now, out, changed=False)
            return
        assert frag.layout is not None and frag.value is not None
        hyper = self.flush_hyper if r.flush else self.hyper
        E = self.book.part_elems
        n = frag.layout.n_parts(E)
        r.new_momentum = None
        fresh = frag.momentum is None  # a snapshot holds zeros of its own, not this buffer
        if hyper.momentum > 0:
            self.book.ensure_momentum(frag)
        # Bounds of the result per part, from the bounds of sum, value and momentum: below FLT_MAX
        # the step is finite, so it needs no check and the momentum may be updated in place.
        mu = hyper.momentum
        m_in = frag.momentum_absmax if mu > 0 else [0.0] * n
        r.commit_bounds = [step_bounds(r.sum.absmax[k], float(total), frag.value_absmax[k], m_in[k], hyper.lr, mu)
                           for k in range(n)]
        proven = all(v < FLT_MAX and m < FLT_MAX for v, m in r.commit_bounds)
        if mu > 0 and (self.book.is_pinned(r.fragment) and not fresh or not proven):
            # A checkpoint in flight reads the momentum, or nothing proves the step finite: write
            # it beside the old one, so that a non-finite result changes nothing.
            assert frag.layout is not None
            r.new_momentum = self.book.fresh(frag.layout.numel, "momentum beside a pinned one")
        check = not proven or r.new_momentum is not None
        # The old value dies with this commit; it may go page by page as the commit passes it when no
        # part can fail (nothing to roll back to) and nothing reads it meanwhile: no checkpoint pins
        # it, no digest of it runs, no final cut reads it (the loop checks the streams: ``consume``).
        consume = (not check and not self.book.is_pinned(r.fragment) and frag.digesting != frag.version
                   and self.final.phase == "running")
        frag.consuming = consume
        r.commit_failed = None
        dtypes = ("float32",)  # views + digests; bf16 parts are encoded per stream on demand (loop.py)
        r.commit_parts_left = n
        r.committing = True
        r.commit_started = now
        r.commit_absmax = [(0.0, 0.0)] * n
        r.consumed = False
        frag.committing = True
        span = commit_span(E)
        r.sum.loan = None  # every fold of this round returned: nothing waits on its memory's old commit
        # With no other sum alive, the old value may stay whole as the spare for the next round's sum.
        keep = consume and self.book.spare is None and not self._other_sums(r)
        loan = PageLoan(frag.value, E, keep) if consume else None
        if loan is not None:
            self.loans[r.fragment] = loan  # lent to the next round's sum once the loop says it consumes
        for k in range(0, n, span):
            self.journal.work.append(CommitPart(r.round, r.fragment, k, frag.value, frag.momentum,
                                                r.new_momentum, r.sum, total, hyper, frag.layout, E, dtypes,
                                                frag.version + 1, self.digest_seed, check, min(span, n - k),
                                                consume, loan))

    def on_commit_part(self, work: CommitPart, result: Result, now: float, out: list[Out]) -> None:
        """One part of a commit done; after the last, the round commits (or, when a part was not
        finite, is dropped having changed nothing)."""
        r = self.rounds.get(work.round)
        if r is None or r.sum is not work.sum:
            return
        if result.error and work.consume:
            # Parts of the old value are gone and this part's new value is not whole: neither
            # version is left to publish. Stop loud; the last checkpoint resumes the run.
            raise RuntimeError(f"commit of round {work.round} fragment {work.fragment} failed after releasing the "
                               f"old value's pages: {result.error}")
        if result.error:
            log.error("commit of round %d parts %d-%d refused: %s", work.round, work.part, work.part + work.parts - 1,
                      result.error)
            r.commit_failed = r.commit_failed or result.error
        else:
            r.commit_absmax[work.part:work.part + work.parts] = [absmax for _payloads, absmax in result.parts]
            r.consumed = r.consumed or work.consume
        r.commit_parts_left -= work.parts
        if r.commit_parts_left == 0 and r.commit_failed:
            self.recovery.drop_commit(r, now, out)
        elif r.commit_parts_left == 0:
            self.finish_commit(r, now, out, changed=True)

    def finish_commit(self, r: RoundRecord, now: float, out: list[Out], changed: bool) -> None:
        """Publish ``r``'s commit (``changed``: a new version; else the round merged nothing): ledgers,
        the event, the round retired, and the new value to every island that has its cut."""
        frag = self.book.fragments[r.fragment]
        loan = self.loans.pop(r.fragment, None)  # its old value is passed whole: nothing more to lend
        spare = loan.spare if loan is not None and changed else None
        if spare is not None and not self._other_sums(r):
            self.book.keep_spare(spare)  # resident for the next round's sum, within the budget of one sum
        pushes = [r.pushes[i] for i in sorted(r.pushes)]
        if changed:
            assert r.sum is not None
            frag.value = r.sum.flat  # the new value was written where the sum was
            if r.new_momentum is not None:
                frag.momentum = r.new_momentum
                self.book.unpin({r.fragment})
            # Measured maxima where the commit was checked, else the bounds that proved it finite.
            measured = [(v, m) if v == v else b for (v, m), b in zip(r.commit_absmax, r.commit_bounds)]
            frag.value_absmax = [v for v, _m in measured]
            if frag.momentum is not None and (self.flush_hyper if r.flush else self.hyper).momentum > 0:
                frag.momentum_absmax = [m for _v, m in measured]
            self.merge_timed(r, frag, now)
            frag.version += 1
            frag.round = r.round
            if r.flush:
                self.changed_flush += 1
            else:
                self.changed_training += 1
            if self.config.checkpoint_every > 0 and (self.commits + 1) % self.config.checkpoint_every == 0:
                self.journal.checkpoint_due = True
        frag.committing = frag.consuming = False
        for p in pushes:
            led = self.sessions.islands[p.island].ledger
            led.merges += 1 if p.weight > 0 else 0
            led.steps += p.local_steps
            led.tokens += p.tokens
        r.new_momentum = None
        self.rounds.retire(r)
        self.commits += 1
        if r.flush:
            self.final.flushed(r.fragment)
        order = r.sum.fold_order if r.sum is not None else []
        lent = r.sum is not None and r.sum.lent
        spared = r.sum is not None and r.sum.spare
        self.journal.events.append(
            {
                "time": now,
                "round": r.round,
                "fragment": r.fragment,
                "version": frag.version,
                "attempt": r.attempt,
                "members": sorted(r.members),
                "pushed": [p.island for p in pushes],
                "weights": {str(p.island): p.weight for p in pushes},
                "fold_order": order[0] if order and all(o == order[0] for o in order) else order,
                "changed": changed,
                "flush": r.flush,
                # A round that changed nothing merged nothing (no weight, in any attempt): no commit time.
                "commit_s": round(now - r.commit_started, 6) if changed else 0.0,
                "consumed": r.consumed,
                "sum_lent": lent,
                "sum_spare": spared,
            }
        )
        log.info(
            "commit round %d fragment %d attempt %d -> version %d (pushed %s, weights %s%s)%s%s%s",
            r.round, r.fragment, r.attempt, frag.version, [p.island for p in pushes], [p.weight for p in pushes],
            ", flush" if r.flush else "",
            f" in {frag.commit_s:.3f}s ({self.merge_stats[0]:.2f} GB/s)" if changed and self.merge_stats else "",
            "; the old value went as the commit passed it" if r.consumed else "",
            "; the sum lay in an old value's pages" if lent else "; the sum lay in the resident spare" if spared else "",
        )
        if not changed:
            return
        # Islands that have not been given this fragment of their cut get this version with it instead.
        # A flush commit's value goes now only where it stands for the final value (an fp32 stream to
        # an island that said done): the final cut then names it in a held notice
        # (``effects.final_or_held``) instead of carrying it, so it waits only for the last flush.
        # Elsewhere the final cut carries it, and it is not sent twice.
        for isl in self.sessions.live():
            if isl.has_cut(frag.index) and (not r.flush or isl.holds_as_final(bcast_dtype(isl.wire_dtype))):
                out.append(bcast(isl, frag, r.round, cut=False))

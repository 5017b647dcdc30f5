"""Recovery rules of the syncer state machine: lost messages, refused pushes, dropped attempts,
and the checkpoint a restarted syncer resumes from (docs/PROTOCOL.md, "Faults"; docs/RELIABILITY.md).

A mixin of :class:`diloco.syncer.state.SyncerState`, kept apart so the rules that repair a
run read together: what is owed to an island after a send error and when it is resent, how
refusals count towards eviction, why an attempt is dropped and re-pulled rather than patched
(a started push cannot be taken out of the running sum), and how a non-finite commit leaves
value and momentum exactly as they were.  No I/O.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from diloco.protocol import refusals
from diloco.syncer.core.book import zeros
from diloco.syncer.core.kernels import BLOCK, absmax
from diloco.syncer.core.checks import Refused
from diloco.syncer.fields import StateFields
from diloco.syncer.core.gate import Gate
from diloco.syncer.core.robust import BOUND_MARK, Reference
from diloco.syncer.core.records import (
    FragmentRecord,
    FragmentSnapshot,
    IslandRecord,
    Outgoing,
    RoundRecord,
    Snapshot,
)
from diloco.wire import Error, FragmentLayout, Push

if TYPE_CHECKING:
    from diloco.syncer.core.effects import Out

log = logging.getLogger("diloco.syncer.state")

COUNTED_REFUSALS = refusals.COUNTED
"""PUSH refusals that count towards ``--max-refusals`` (with ``bad_push`` from the data plane): what
the island sent was wrong. Races (an attempt or round that moved on meanwhile) do not count."""


class Recovery(StateFields):
    """Lost messages, refusal counting, attempt restarts, checkpoints (methods of ``SyncerState``)."""

    reference: Reference
    gate: Gate

    if TYPE_CHECKING:
        def _attempt_members(self, r: RoundRecord, ready: frozenset[int]) -> frozenset[int]: ...

    def on_lost(self, peer: bytes, kind: str, fragment: int, cut: bool, now: float) -> None:
        """The loop could not deliver a message to ``peer`` (a send error: the peer is gone, or
        reconnected under the same routing id, or its queue is full).

        ``kind`` is ``BCAST`` / ``FINAL`` (a value stream of ``fragment``; ``cut``: it was part of
        a cut) or ``PULL``. The state owes the island that value (and a re-pull of its open
        rounds), delivered once a message from the island proves it is connected again; an
        island that reconnected under a new routing id gets a whole new cut anyway."""
        rec = next((i for i in self.islands if i.bound and i.peer == peer), None)
        if rec is None:
            return
        rec.lost_at = now
        if kind in ("BCAST", "FINAL") and 0 <= fragment < self.n_fragments:
            rec.owed[fragment] = rec.owed.get(fragment, False) or cut
        rec.owe_pulls = True
        log.warning("island %d: a %s%s was lost on a send error; resent once the island is heard from",
                    rec.island, kind, f" of fragment {fragment}" if kind != "PULL" else "")

    def _on_push_refused(self, h: Push, r: Refused, now: float, out: list[Out]) -> None:
        """Bookkeeping of a refused PUSH from a bound island's current generation: its later parts
        are dropped quietly, ``stale_base`` sends the current value and the PULL again, and the
        refusal counts towards ``--max-refusals``."""
        if not 0 <= h.island < self.config.islands:
            return
        rec = self.islands[h.island]
        if not rec.bound or h.generation != rec.generation:
            return
        if h.part == 0:
            rec.refused_push = (h.round, h.attempt)
        rnd = self.rounds.get(h.round)
        if r.code == "stale_base" and rnd is not None and rec.cut_sent and rec.alive:
            frag = self.fragments[r.fragment]
            out.append(self._bcast(rec, frag, frag.round, cut=False))
            out.append(self._pull(rnd, h.island))  # the loop sends it after the value
        if r.code in COUNTED_REFUSALS:
            self._count_refusal(rec, f"{r.code}: {r.reason}", now, out)

    def _count_refusal(self, rec: IslandRecord, why: str, now: float, out: list[Out]) -> None:
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
        self.events.append({"time": now, "evicted": rec.island, "reason": why[:200]})
        out.append(Outgoing(rec.peer, Error(code="evicted", reason=reason)))
        for r in self.rounds.values():
            if not r.closed and rec.island in r.members and rec.island not in r.pushes:
                r.members = r.members - {rec.island}

    def _deliver_owed(self, out: list[Out]) -> None:
        """Resend what a send error lost (``on_lost``), once the island was heard from after it."""
        for rec in self.live():
            if not (rec.owed or rec.owe_pulls) or rec.last_seen <= rec.lost_at:
                continue
            owed, rec.owed, rec.owe_pulls = rec.owed, {}, False
            for f, cut in sorted(owed.items()):
                frag = self.fragments[f]
                if self.phase == "final" and rec.island in self.final_expected and not rec.final_acked:
                    out.append(self._final(rec, frag))
                elif self.phase == "running" and rec.cut_sent and frag.initialised:
                    log.info("island %d: resending fragment %d version %d%s", rec.island, f, frag.version,
                             " (cut)" if cut else "")
                    out.append(self._bcast(rec, frag, frag.round, cut))
            if self.phase == "running" and rec.cut_sent:
                for r in sorted(self.rounds.values(), key=lambda r: r.round):
                    if rec.island in r.members and rec.island not in r.pushes and not r.closed:
                        out.append(self._pull(r, rec.island))

    def _restart_attempt(self, r: RoundRecord, now: float, out: list[Out], why: str, resend: bool = False) -> None:
        """Drop the attempt's pushes (and its running sum) and pull the live members again.

        ``resend`` (a quorum timeout): members that did not push get the fragment's current value
        first. A member that lost a BCAST or its cut without a send error (a connection reset
        drops what TCP still held) never pushes that fragment; this is how it gets it again.
        An island that has the value ignores the replay."""
        if r.sum is not None:
            r.sum.void = True
        members = self._attempt_members(r, frozenset(i.island for i in self.ready()
                                                     if i.island not in self.reference.benched))
        if self.reference.benched:
            log.warning("round %d: islands %s left out of the next attempt (their part was refused)", r.round,
                        sorted(self.reference.benched))
            self.reference.benched.clear()
        if resend:
            frag = self.fragments[r.fragment]
            for i in sorted(r.members - set(r.pushes)):
                isl = self.islands[i]
                if i in members:
                    out.append(self._bcast(isl, frag, frag.round, cut=False))
        log.warning("round %d attempt %d dropped (%s): re-pulling %s as attempt %d", r.round, r.attempt, why,
                    sorted(members), r.attempt + 1)
        r.attempt += 1
        r.pushes.clear()
        r.sum = None
        r.members = members
        r.attempt_started = now
        r.grace_deadline = None
        out.extend(self._pull(r, i) for i in sorted(members))

    def _drop_commit(self, r: RoundRecord, now: float, out: list[Out]) -> None:
        """A commit whose result is not finite changes nothing (value and momentum were written out
        of place): the round is dropped, logged and re-pulled as a new attempt."""
        frag = self.fragments[r.fragment]
        frag.committing = False
        r.new_momentum = None
        r.closed = r.committing = False
        self.refusals += 1
        log.error("round %d fragment %d attempt %d: the outer step's result is not finite (%s); nothing "
                  "committed (fragment stays at version %d), re-pulling", r.round, r.fragment, r.attempt,
                  r.commit_failed, frag.version)
        self.events.append({"time": now, "round": r.round, "fragment": r.fragment, "attempt": r.attempt,
                            "dropped": "non-finite commit", "pushed": sorted(r.pushes)})
        self._restart_attempt(r, now, out, "the commit's result was not finite")

    def release_snapshot(self) -> None:
        """The last :meth:`snapshot` has been written: commits may update momenta in place again."""
        self.pinned.clear()

    def unpin(self, fragments: set[int]) -> None:
        """The checkpoint in flight has written (and let go of) these fragments: their commits may
        update the momentum in place again."""
        self.pinned -= fragments

    def snapshot(self) -> Snapshot:
        """The checkpointable state, consistent as of now, safe to write on another thread.

        Tensors are shared, not copied: values are never written in place (a commit writes
        the next value elsewhere), and every fragment is *pinned* until the writer has written
        it (:meth:`unpin`, or :meth:`release_snapshot` at the end): a commit with momentum waits
        for that, since it updates the momentum in place (``commit.PIN_WAIT_S``). A superseded
        value the writer still holds counts against the fragment buffers' budget, so the next
        round opens once it is let go (``rounds._sum_fits``): a checkpoint costs no extra memory.
        """
        if not self.initialised or self.fingerprint is None:
            raise RuntimeError("nothing to checkpoint before every fragment is initialised")
        self.pinned = set(range(len(self.fragments)))
        frags = []
        for f in self.fragments:
            assert f.value is not None and f.layout is not None
            # No momentum buffer (momentum 0, or no commit yet): zeros that occupy no memory.
            momentum = f.momentum if f.momentum is not None else zeros(f.layout.numel)
            frags.append(FragmentSnapshot(f.version, f.schema, f.value, momentum))
        return Snapshot(
            fingerprint=self.fingerprint,
            n_fragments=self.n_fragments,
            fragments=tuple(frags),
            next_round=self.next_commit,
            ledgers={i.island: i.ledger.to_json() for i in self.islands},
            hyper={
                "outer_lr": self.config.outer_lr,
                "outer_momentum": self.config.outer_momentum,
                "weighting": self.config.weighting,
                "sync_every": self.config.sync_every,
                "key_bindings": self.gate.to_json(),
            },
        )

    def _restore(self, snap: Snapshot) -> None:
        if snap.n_fragments != len(snap.fragments) or not 1 <= snap.n_fragments <= self.config.max_fragments:
            raise ValueError(f"checkpoint declares {snap.n_fragments} fragments but holds {len(snap.fragments)}")
        if snap.next_round < 1:
            raise ValueError(f"checkpoint next_round {snap.next_round} < 1")
        frags: list[FragmentRecord] = []
        for idx, fs in enumerate(snap.fragments):
            if not fs.schema:
                raise ValueError(f"checkpoint fragment {idx}: empty schema")
            layout = FragmentLayout.of([(n, s) for n, _d, s in fs.schema])
            for t in (fs.value, fs.momentum):
                if t.dtype != torch.float32 or tuple(t.shape) != (layout.numel,):
                    raise ValueError(f"checkpoint fragment {idx}: {t.dtype} {tuple(t.shape)}, expected "
                                     f"float32 ({layout.numel},)")
            # Rounds before next_round are committed: fragment idx's last is the largest such
            # t with (t − 1) mod P == idx (rounds run fragments in turn).
            last = snap.next_round - 1 - ((snap.next_round - 2 - idx) % snap.n_fragments)
            n_parts = layout.n_parts(self.config.part_elems)
            momentum = self.book.adopt(fs.momentum.contiguous()) if self.config.outer_momentum > 0 else None
            # Magnitudes measured once here (the commit's overflow bound needs them, or its first commit
            # would write the momentum beside the old one: one more fragment buffer).
            value = self.book.adopt(fs.value.contiguous())
            frags.append(FragmentRecord(index=idx, schema=fs.schema, layout=layout, value=value,
                                        momentum=momentum, version=fs.version, initialised=True, round=max(0, last),
                                        value_absmax=part_absmax(value, layout, self.config.part_elems),
                                        momentum_absmax=part_absmax(momentum, layout, self.config.part_elems)
                                        if momentum is not None else [0.0] * n_parts))
        for island, led in snap.ledgers.items():
            if 0 <= island < self.config.islands:
                ledger = self.islands[island].ledger
                ledger.merges, ledger.steps, ledger.tokens = led["merges"], led["steps"], led["tokens"]
        saved = snap.hyper.get("key_bindings", {})
        if isinstance(saved, dict):
            self.gate.restore(saved)
        self.fingerprint = snap.fingerprint
        self.fragments = frags
        self._size_pool()
        self.next_open = self.next_commit = snap.next_round
        log.info("resumed: %d fragments at versions %s, next round %d", len(frags), list(self.versions()), snap.next_round)


def part_absmax(t: torch.Tensor, layout: FragmentLayout, part_elems: int) -> list[float]:
    """``max |t|`` over each part of a flat fragment tensor (``inf`` where not finite), block by block."""
    out = []
    for k in range(layout.n_parts(part_elems)):
        lo, hi = layout.part_range(k, part_elems)
        out.append(max((absmax(t[a:min(hi, a + BLOCK)]) for a in range(lo, hi, BLOCK)), default=0.0))
    return out

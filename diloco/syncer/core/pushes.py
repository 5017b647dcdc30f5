"""The PUSH rules of the syncer's core (docs/PROTOCOL.md, "Push", "Parts").

A push is one island's delta for one attempt of one round, streamed as parts in order. Part 0
fixes its counts (clamped and capped by the robust rules: ``robustrules.py``) and is refused
when it is against an older value than the fragment's current one (``stale_base``: the island
gets the value and the PULL again); every later part must agree with part 0 and come in order.
Every check runs before anything changes; an accepted part becomes a fold of the round's running
sum on the data plane (a :class:`~diloco.syncer.core.work.FoldPart`).

:class:`Pushes` owns no table: it checks a PUSH against the sessions, the rounds and the
fragments it is handed and records the accepted push in its round. No I/O.
"""

from __future__ import annotations

from diloco.outer import push_weight
from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.checks import Refused
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Journal
from diloco.syncer.core.merge import Merge
from diloco.syncer.core.records import PushRecord
from diloco.syncer.core.robust import Reference
from diloco.syncer.core.robustrules import part_bound, push_weight_of
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.syncer.core.work import FoldPart, RoundSum
from diloco.wire import QUANT_KINDS, Opened, Push


class Pushes:
    """PUSH parts: checked, then recorded and queued for folding.

    Args:
        config: part size, weighting, quantization block.
        sessions, rounds, book: the tables a push is checked against.
        merge: starts the grace window once the quorum of pushes is complete.
        reference: robust-aggregation reference (weights, bounds).
        journal: where the folds are queued.
    """

    def __init__(self, config: SyncerConfig, sessions: Sessions, rounds: RoundBook, book: FragmentBook,
                 merge: Merge, reference: Reference, journal: Journal) -> None:
        self.config = config
        self.sessions = sessions
        self.rounds = rounds
        self.book = book
        self.merge = merge
        self.reference = reference
        self.journal = journal

    def on_push(self, peer: bytes, h: Push, msg: Opened, now: float) -> None:
        """Check one PUSH part of ``peer``'s island and record it; Refused (nothing changed) when a rule
        is broken. An accepted weighted part is queued as a fold of the round's running sum."""
        rec = self.sessions.session(h.island, h.generation, peer, msg)
        r = self.rounds.get(h.round)
        if r is None:
            state = "already committed" if h.round < self.rounds.next_commit else "not open"
            raise Refused("unknown_round", f"round {h.round} is {state}")
        if h.fragment != r.fragment:
            raise Refused("wrong_fragment", f"round {h.round} syncs fragment {r.fragment}, not {h.fragment}")
        if h.attempt != r.attempt:
            # A later part of a push whose attempt was dropped meanwhile is the expected tail of it.
            raise Refused("stale_attempt", f"round {h.round} is at attempt {r.attempt}, push is for {h.attempt}",
                          quiet=h.part > 0 and h.attempt < r.attempt)
        if r.closed:
            raise Refused("round_closed", f"round {h.round} already closed")
        if h.island not in r.members:
            raise Refused("not_member", f"island {h.island} is not a member of round {h.round} attempt {r.attempt}")
        if h.part < 0 or h.n_parts < 0 or (h.n_parts == 0 and h.part != 0):
            raise Refused("bad_part", f"part {h.part} of {h.n_parts} is not a part index")
        frag = self.book.fragments[r.fragment]
        assert frag.layout is not None
        E = self.book.part_elems
        push = r.pushes.get(h.island)
        if h.part > 0 and push is None and rec.refused_push == (h.round, h.attempt):
            raise Refused("refused_push", f"part {h.part} of a refused push", quiet=True)
        if h.part == 0 and push is not None:
            raise Refused("duplicate_push", f"island {h.island} already pushed round {h.round} attempt {r.attempt}")
        if h.part > 0:
            if push is None or h.part != push.next_part:
                want = "no part (not started)" if push is None else f"part {push.next_part}"
                raise Refused("bad_part", f"part {h.part} of round {h.round} from island {h.island}; expected {want}")
            if (h.base_version, h.local_steps, h.tokens, h.n_parts) != (
                push.base_version, push.local_steps, push.tokens, push.n_parts
            ):
                raise Refused("bad_part", f"part {h.part} of round {h.round} disagrees with its part 0")
        else:
            if not 0 <= h.base_version <= frag.version:
                raise Refused("bad_base_version", f"base version {h.base_version} outside [0, {frag.version}]")
            if h.base_version < frag.version:
                # The island missed a value (a lost BCAST): its delta is against an older anchor
                # and would merge steps already merged. It gets the current value, then the PULL again.
                raise Refused("stale_base", f"base version {h.base_version} of fragment {r.fragment} is older "
                                            f"than its current version {frag.version}", fragment=r.fragment,
                              round=h.round)
            if h.local_steps < 0 or h.tokens < 0:
                raise Refused("bad_counts", f"local_steps {h.local_steps} / tokens {h.tokens} negative")
            weight = push_weight(h.local_steps, h.tokens, self.config.weighting)
            if weight < 0:
                raise Refused("bad_counts", f"--weighting {self.config.weighting} needs tokens > 0 for a push "
                                            f"with local steps (got tokens {h.tokens})")
            if weight == 0:
                if h.n_parts != 0 or msg.metas:
                    raise Refused("bad_part", "a zero-weight push (local_steps 0) carries no tensors (n_parts 0)")
            elif h.n_parts != frag.layout.n_parts(E):
                raise Refused("bad_part", f"n_parts {h.n_parts}, fragment {r.fragment} has "
                                          f"{frag.layout.n_parts(E)} parts")
        quant = (rec.wire_dtype, self.config.quant_block) if rec.wire_dtype in QUANT_KINDS else None
        if h.n_parts > 0 and quant is not None:
            problem = frag.layout.check_quant_part(msg.metas, h.part, h.n_parts, E, *quant)
            if problem:
                raise Refused("bad_part", f"PUSH round {h.round}: {problem}")
        elif h.n_parts > 0:
            problem = frag.layout.check_part(msg.metas, h.part, h.n_parts, E, rec.wire_dtype)
            if problem:
                raise Refused("bad_part", f"PUSH round {h.round}: {problem}")

        # --- accepted
        if push is None:
            push = r.pushes[h.island] = PushRecord(
                island=h.island, base_version=h.base_version, local_steps=h.local_steps, tokens=h.tokens,
                weight=push_weight_of(self.config, self.reference, self.journal, r, h, now), n_parts=h.n_parts,
            )
        push.last_part_at = now
        rec.refused_push = None
        self.sessions.touch(rec, msg, now)
        if h.n_parts == 0:
            rec.refusals_in_row = 0
            self.merge.maybe_start_grace(r, now)
            return
        if r.sum is None:
            flat, loan, spare = self.merge.sum_buffer(frag.layout.numel)
            r.sum = RoundSum(r.round, r.attempt, r.fragment, flat, frag.layout.n_parts(E), loan=loan, spare=spare)
        lo, hi = frag.layout.part_range(h.part, E)
        r.sum.fold_order[h.part].append(h.island)
        push.next_part += 1
        bound = part_bound(self.config, self.reference, r, h.island, hi - lo)
        self.journal.work.append(FoldPart(r.sum, h.part, lo, msg, push.weight, h.island, quant, hi - lo, bound))

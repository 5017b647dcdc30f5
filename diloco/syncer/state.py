"""The syncer's state machine: every round rule of docs/PROTOCOL.md, no sockets, no threads.

``SyncerState.handle(peer, opened, now)`` takes one opened message (MAC and header
checked, payload not read) and returns the messages to send; payload work it
accepts is queued in ``self.work`` for the data plane, whose results come back
through ``on_result(result, now)``; ``tick(now)`` applies the time rules (dead
islands, grace windows, quorum timeouts, finalization timeout).  Keeping this free
of I/O, threads and the clock lets tests drive every transition with hand-built
messages and chosen times (running the work inline), and lets the same logic
later run per fragment shard.

Failure semantics: a message that breaks a rule is *refused*: the handler
validates everything first and raises :class:`Refused` before touching any state,
so a refusal leaves the state exactly as it was; ``handle`` then logs one line and
answers the peer with ERROR.  A part refused by the data plane (bad digest, NaN)
cannot be taken out of the running sum again, so it voids its attempt: the round
is re-pulled with ``attempt + 1``.

The rules live in five modules, one concept each, all methods of this one class: this one
(entry points, PUSH, cuts), ``commit`` (fold results, quorum, commits), ``admission``
(sessions, HELLO, INIT), ``recovery`` (lost messages, refusals, dropped attempts,
checkpoints) and ``rounds`` (the round clock, flush rounds, finalization).  The buffers of
the fragments' state are allocated and accounted by ``book.FragmentBook``.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any


from diloco.outer import OuterHyper, push_weight
from diloco.protocol.schedule import Schedule
from diloco.syncer.admission import Admission
from diloco.syncer.core.gate import Gate
from diloco.syncer.laggards import Laggards
from diloco.syncer.core.robust import Reference
from diloco.syncer.robustrules import RobustRules
from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.checks import Dropped, Refused
from diloco.syncer.commit import Merge
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Out
from diloco.syncer.core.work import CommitPart, DigestFragment, FoldPart, InitPart, Result, RoundSum, Work
from diloco.syncer.recovery import Recovery
from diloco.syncer.rounds import RoundClock
from diloco.syncer.core.records import (
    FragmentRecord,
    IslandRecord,
    Outgoing,
    OutStream,
    PushRecord,
    RoundRecord,
    Snapshot,
)
from diloco.wire import (
    QUANT_KINDS,
    bcast_dtype,
    Error,
    FinalAck,
    HostBufferPool,
    Heartbeat,
    Hello,
    Init,
    Opened,
    Pull,
    Push,
)

log = logging.getLogger(__name__)


class SyncerState(Merge, Admission, Recovery, RoundClock, RobustRules, Laggards):
    """All syncer state and the transitions between states.

    Args:
        config: round, quorum, optimizer and size settings.
        syncer_id: random per process (clients redial when it changes); drawn
            here when not given.
        snapshot: a checkpoint to resume from (``--resume``); fixes the
            fingerprint, fragment values, momentum, versions and next round.
    """

    def __init__(self, config: SyncerConfig, *, syncer_id: int | None = None, snapshot: Snapshot | None = None) -> None:
        self.config = config
        self.syncer_id = syncer_id if syncer_id is not None else random.getrandbits(63)
        self.hyper = OuterHyper(lr=config.outer_lr, momentum=config.outer_momentum)
        self.flush_hyper = OuterHyper(lr=1.0, momentum=0.0) if config.flush_merge == "mean" else self.hyper
        """The flush rounds' step: the plain weighted mean by default (``--flush-merge``)."""
        self.pool = HostBufferPool()
        """Part-sized buffers, idle ones capped at a few parts (``book.IDLE_PARTS``); fragment buffers
        (values, sums, momenta) come from the book, never from here."""
        self.book = FragmentBook(config, self.pool)
        self.merge_stats: tuple[float, float] | None = None
        """(GB/s, seconds) of the last commit: fragment bytes over its commit time."""
        self.islands = [IslandRecord(i) for i in range(config.islands)]
        self.fingerprint: str | None = None
        self.fragments: list[FragmentRecord] = []
        self.rounds: dict[int, RoundRecord] = {}
        self.next_open = 1  # next round number to open
        self.next_commit = 1  # rounds commit strictly in this order
        self.commits = 0
        self.changed_training = 0
        self.changed_flush = 0
        self.refusals = 0
        self.refused_by: Counter[str] = Counter()
        """Refusals by reason code (``Refused.code``), for the metrics endpoint."""
        self.flush_left: set[int] | None = None
        """Fragments still to flush once every island finished (None: not started)."""
        self.phase = "running"  # running -> final -> done
        self.final_deadline = 0.0
        self.final_expected: frozenset[int] = frozenset()
        self.final_resend_at = 0.0
        self.exit_code: int | None = None
        self.checkpoint_due = False
        self.started_at: float | None = None
        """Clock of the first message or tick: the join timeout counts from it."""
        self.pinned: set[int] = set()
        """Fragments an in-flight checkpoint has still to write (``unpin`` as it writes them)."""
        self.over_budget_since: float | None = None
        """Clock since when the next round waits for fragment buffers to be let go (``rounds._sum_fits``)."""
        self.events: list[dict[str, Any]] = []
        self.work: list[Work] = []
        """Payload work for the data plane, drained by the loop."""
        self.digest_seed = 0
        """Chunk-digest seed of the payloads we encode (``wire.digest_seed`` of the key; the loop sets it)."""
        self.peers: dict[bytes, int] = {}
        """Routing id -> island of every current binding (to stamp what we send)."""
        self.hellos_seen: dict[tuple[int, int], None] = {}
        """(island, generation) of recent authenticated HELLOs, oldest first: a second one is a replay
        (at most ``admission.HELLOS_REMEMBERED`` per island)."""
        self.superseded: list[bytes] = []
        """Routing ids replaced by a new HELLO of their island: the loop drops their streams."""
        self.dropped = 0
        """Messages refused silently (replays, foreign routing ids)."""
        self.gate = Gate(dict(config.island_keys) if config.island_keys else None)
        self.reference = Reference()
        """Robust aggregation: reference norms and weights, per-island tallies (``robust.py``)."""
        self.laggards: dict[int, frozenset[int]] = {}
        self.proven: set[int] = set()
        """Islands dropped per round, and islands that may be members (``laggards.py``)."""
        """Key bindings and HELLO budgets (``gate.py``)."""
        if snapshot is not None:
            self._restore(snapshot)

    # ------------------------------------------------------------------ queries

    @property
    def n_fragments(self) -> int:
        return len(self.fragments)

    @property
    def initialised(self) -> bool:
        return bool(self.fragments) and all(f.initialised for f in self.fragments)

    @property
    def finished(self) -> bool:
        return self.phase == "done"

    def versions(self) -> tuple[int, ...]:
        return tuple(f.version for f in self.fragments)

    def live(self) -> list[IslandRecord]:
        return [i for i in self.islands if i.bound and i.alive]

    @property
    def scheduled_rounds(self) -> int:
        """Rounds the clock schedules during training (``ceil(t*H/P) <= total``); 0 if unbounded."""
        if self.config.total_steps <= 0 or not self.fragments:
            return 0
        return Schedule(self.config.sync_every, self.n_fragments, self.config.total_steps).scheduled_rounds

    def merged_summary(self) -> dict[str, int]:
        """What the run merged: scheduled rounds, commits, and rounds that changed the model."""
        return {
            "scheduled_rounds": self.scheduled_rounds,
            "committed_rounds": self.commits,
            "changed_in_training": self.changed_training,
            "changed_in_flush": self.changed_flush,
        }

    def status(self) -> str:
        """One line for the operator: phase, rounds, attempts, members, versions."""
        rounds = " ".join(
            f"r{r.round}/f{r.fragment}/a{r.attempt}:{sum(p.complete for p in r.pushes.values())}/{len(r.members)}"
            f"{'C' if r.closed else ''}{'F' if r.flush else ''}"
            for r in sorted(self.rounds.values(), key=lambda r: r.round)
        )
        live = ",".join(str(i.island) for i in self.live())
        m = self.merged_summary()
        commit_s = ",".join(f"{f.commit_s:.2f}" for f in self.fragments[:16])
        merge = f"{self.merge_stats[0]:.2f}GB/s" if self.merge_stats else "-"
        return (
            f"phase={self.phase} next_round={self.next_open} open=[{rounds}] live=[{live}] "
            f"versions={list(self.versions())} commits={self.commits} changed={m['changed_in_training']}"
            f"+{m['changed_in_flush']}/{m['scheduled_rounds']} refusals={self.refusals} "
            f"commit_s=[{commit_s}] merge={merge} per_island=[{self.reference.summary()}]"
        )

    # ------------------------------------------------------------------ entry points

    def handle(self, peer: bytes, msg: Opened, now: float) -> list[Out]:
        """Apply one opened message from ``peer``; return what to send."""
        if self.started_at is None:
            self.started_at = now
        header = msg.header
        out: list[Out] = []
        try:
            if isinstance(header, Hello):
                self._on_hello(peer, header, msg, now, out)
            elif isinstance(header, Init):
                self._on_init(peer, header, msg, now)
            elif isinstance(header, Push):
                self._on_push(peer, header, msg, now)
            elif isinstance(header, Heartbeat):
                self._on_heartbeat(peer, header, msg, now, out)
            elif isinstance(header, FinalAck):
                self._on_final_ack(peer, header, msg, now, out)
            else:
                raise Refused("unexpected_kind", f"{type(header).__name__} is never sent to the syncer")
        except Dropped as r:
            self.refusals += 1
            self.refused_by[r.code] += 1
            self.dropped += 1
            log.warning("dropped %s claiming island %s (peer %s), nothing answered: %s: %s",
                        type(header).__name__, getattr(header, "island", "?"), peer.hex(), r.code, r.reason)
            return []
        except Refused as r:
            if r.quiet:
                log.debug("dropped %s from island %s: %s", type(header).__name__, getattr(header, "island", "?"),
                          r.reason)
                return []
            self.refusals += 1
            self.refused_by[r.code] += 1
            island = getattr(header, "island", "?")
            log.warning(
                "refused %s from island %s (peer %s): %s: %s",
                type(header).__name__, island, peer.hex(), r.code, r.reason,
            )
            out = [Outgoing(peer, Error(code=r.code, reason=r.reason, fragment=r.fragment, round=r.round))]
            if isinstance(header, Push):
                self._on_push_refused(header, r, now, out)
            return out
        out.extend(self._progress(now))
        return out


    def on_result(self, result: Result, now: float) -> list[Out]:
        """Take one finished data-plane work item; return what to send."""
        out: list[Out] = []
        work = result.work
        if isinstance(work, FoldPart):
            self._on_folded(work, result, now, out)
        elif isinstance(work, InitPart):
            self._on_init_copied(work, result, out)
        elif isinstance(work, CommitPart):
            self._on_commit_part(work, result, now, out)
        elif isinstance(work, DigestFragment):
            frag = self.fragments[work.fragment]
            if frag.value is work.value:
                frag.digest = result.digest
                if result.error:
                    log.error("digest of fragment %d failed: %s", work.fragment, result.error)
                self._check_final(out)
        out.extend(self._progress(now))
        return out

    def tick(self, now: float) -> list[Out]:
        """Apply the time-based rules; call on every loop iteration."""
        if self.started_at is None:
            self.started_at = now
        out: list[Out] = []
        for isl in self.live():
            if now - isl.last_seen > self.config.dead_after_s:
                isl.alive = False
                # A revived island must be re-cut: it may have missed broadcasts.
                isl.cut_sent = False
                log.warning("island %d silent for %.1fs: declared dead", isl.island, now - isl.last_seen)
        if self.phase == "final" and now >= self.final_resend_at and now < self.final_deadline:
            # A FINAL lost without a send error (a connection reset) is never acknowledged:
            # send the final cut again to every island that has not acknowledged it yet.
            self.final_resend_at = now + self._final_resend_s()
            for i in sorted(self.final_expected):
                isl = self.islands[i]
                if not isl.final_acked and isl.alive:
                    log.warning("island %d has not acknowledged the final cut: FINAL again", i)
                    out.extend(self._finals(isl))
        if self.phase == "final" and now >= self.final_deadline:
            missing = sorted(i for i in self.final_expected if not self.islands[i].final_acked)
            log.error("finalization timed out: no FINAL_ACK from islands %s", missing)
            self._finish(1, f"finalization timed out waiting for islands {missing}", out)
        out.extend(self._progress(now))
        return out

    # ------------------------------------------------------------------ validation helpers


    # ------------------------------------------------------------------ handlers


    def _on_push(self, peer: bytes, h: Push, msg: Opened, now: float) -> None:
        rec = self._session(h.island, h.generation, peer, msg)
        r = self.rounds.get(h.round)
        if r is None:
            state = "already committed" if h.round < self.next_commit else "not open"
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
        frag = self.fragments[r.fragment]
        assert frag.layout is not None
        E = self.config.part_elems
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
                weight=self._robust_weight(r, h, now), n_parts=h.n_parts,
            )
        push.last_part_at = now
        rec.refused_push = None
        self._touch(rec, msg, now)
        if h.n_parts == 0:
            rec.refusals_in_row = 0
            self._maybe_start_grace(r, now)
            return
        if r.sum is None:
            r.sum = RoundSum(r.round, r.attempt, r.fragment, self.book.fresh(frag.layout.numel, "sum"),
                             frag.layout.n_parts(E))
        lo, hi = frag.layout.part_range(h.part, E)
        r.sum.fold_order[h.part].append(h.island)
        push.next_part += 1
        self.work.append(FoldPart(r.sum, h.part, lo, msg, push.weight, h.island, quant, hi - lo,
                                  self._part_bound(r, h.island, hi - lo) if quant is None else None))

    def _on_heartbeat(self, peer: bytes, h: Heartbeat, msg: Opened, now: float, out: list[Out]) -> None:
        rec = self._session(h.island, h.generation, peer, msg)
        if h.step < 0:
            raise Refused("bad_step", f"step {h.step} < 0")
        if msg.metas:
            raise Refused("unexpected_tensors", "HEARTBEAT carries no tensors")
        rec.last_step = h.step
        rec.done = h.done
        self._touch(rec, msg, now)
        out.append(Outgoing(peer, Heartbeat(syncer_id=self.syncer_id)))

    def _on_final_ack(self, peer: bytes, h: FinalAck, msg: Opened, now: float, out: list[Out]) -> None:
        rec = self._session(h.island, h.generation, peer, msg)
        if self.phase != "final":
            raise Refused("not_final", "no finalization in progress")
        if h.island not in self.final_expected:
            raise Refused("not_expected", f"island {h.island} was not sent the final cut")
        if tuple(h.versions) != self.versions():
            raise Refused("bad_versions", f"acked versions {list(h.versions)[:16]} != {list(self.versions())[:16]}")
        if h.digests and len(h.digests) != self.n_fragments:
            raise Refused("bad_digests", f"{len(h.digests)} digests for {self.n_fragments} fragments")
        rec.final_acked = True
        rec.final_digests = tuple(h.digests)
        self._touch(rec, msg, now)
        self._check_final(out)

    def _check_final(self, out: list[Out]) -> None:
        """Finish once every expected island acknowledged and every digest is known: exit 0 when
        each island installed exactly the syncer's final values, else 1 naming who differs."""
        if self.phase != "final" or not all(self.islands[i].final_acked for i in self.final_expected):
            return
        if any(f.digest is None for f in self.fragments):
            return  # the data plane is still hashing the final values
        bad = []
        for i in sorted(self.final_expected):
            got = self.islands[i].final_digests
            if not got:
                log.warning("island %d acknowledged the final cut without digests: not checked", i)
                continue
            wrong = [f.index for f, d in zip(self.fragments, got) if d != f.digest]
            if wrong:
                bad.append((i, wrong))
        if bad:
            for i, wrong in bad:
                log.error("island %d installed a final cut different from the syncer's: fragments %s differ",
                          i, wrong[:16])
            self._finish(1, f"final cut mismatch on islands {[i for i, _ in bad]}", out)
            return
        log.info("every island acknowledged the final cut %s (digests checked)", list(self.versions()))
        self._finish(0, "training finished", out)

    # ------------------------------------------------------------------ progress

    def _progress(self, now: float) -> list[Out]:
        """Rules that fire on state, in order: close, commit, cut, open, finalize."""
        out: list[Out] = []
        self._deliver_owed(out)
        if self.phase != "running":
            return out
        for r in sorted(self.rounds.values(), key=lambda r: r.round):
            self._check_quorum(r, now, out)
        self._start_commits(now, out)
        self._deliver_cuts(out)
        self._open_rounds(now, out)
        self._maybe_finalize(now, out)
        return out


    def _pull(self, r: RoundRecord, island: int) -> Outgoing:
        return Outgoing(self.islands[island].peer, Pull(fragment=r.fragment, round=r.round, attempt=r.attempt))


    def _bcast(self, isl: IslandRecord, frag: FragmentRecord, round_: int, cut: bool) -> OutStream:
        return OutStream(isl.peer, "BCAST", frag.index, frag.version, round_, cut, bcast_dtype(isl.wire_dtype))

    def _deliver_cuts(self, out: list[Out]) -> None:
        if not self.initialised:
            return
        for isl in self.live():
            if isl.cut_sent:
                continue
            for frag in self.fragments:
                # A cut carries the fragment's last committed round (0: none yet), so an island that
                # joins late knows which rounds went by without it (synchronous rounds wait for none).
                out.append(self._bcast(isl, frag, frag.round, cut=True))
            isl.cut_sent = True
            # A member that reconnected (or revived) mid-round is asked again,
            # after its cut so that it pushes against the current anchor.
            for r in sorted(self.rounds.values(), key=lambda r: r.round):
                if isl.island in r.members and isl.island not in r.pushes and not r.closed:
                    out.append(self._pull(r, isl.island))

    # ------------------------------------------------------------------ checkpoint


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

The rules live in four modules, one concept each, all methods of this one class: this one
(entry points, PUSH, quorum, commit), ``admission`` (sessions, HELLO, INIT), ``recovery``
(lost messages, refusals, dropped attempts, checkpoints) and ``rounds`` (the round clock,
flush rounds, finalization).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any

import torch

from diloco.outer import OuterHyper, push_weight
from diloco.syncer.admission import Admission
from diloco.syncer.checks import Dropped, Refused
from diloco.syncer.config import SyncerConfig
from diloco.syncer.dataplane import CommitPart, DigestFragment, FoldPart, InitPart, Result, RoundSum, Work
from diloco.syncer.recovery import Recovery
from diloco.syncer.rounds import RoundClock
from diloco.syncer.records import (
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

Out = Outgoing | OutStream


class SyncerState(Admission, Recovery, RoundClock):
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
        self.pool = HostBufferPool(max_idle_bytes=2 << 30)
        """Sum / value / momentum buffers: a freed value becomes the next round's sum."""
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
        """Fragments whose momentum an in-flight checkpoint still reads."""
        self.events: list[dict[str, Any]] = []
        self.work: list[Work] = []
        """Payload work for the data plane, drained by the loop."""
        self.digest_seed = 0
        """Chunk-digest seed of the payloads we encode (``wire.digest_seed`` of the key; the loop sets it)."""
        self.peers: dict[bytes, int] = {}
        """Routing id -> island of every current binding (to stamp what we send)."""
        self.hellos_seen: set[tuple[int, int]] = set()
        """(island, generation) of every authenticated HELLO: a second one is a replay."""
        self.dropped = 0
        """Messages refused silently (replays, foreign routing ids)."""
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
        return self.config.total_steps * self.n_fragments // self.config.sync_every

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
        return (
            f"phase={self.phase} next_round={self.next_open} open=[{rounds}] live=[{live}] "
            f"versions={list(self.versions())} commits={self.commits} changed={m['changed_in_training']}"
            f"+{m['changed_in_flush']}/{m['scheduled_rounds']} refusals={self.refusals}"
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
                weight=push_weight(h.local_steps, h.tokens, self.config.weighting), n_parts=h.n_parts,
            )
        push.last_part_at = now
        rec.refused_push = None
        self._touch(rec, msg, now)
        if h.n_parts == 0:
            rec.refusals_in_row = 0
            self._maybe_start_grace(r, now)
            return
        if r.sum is None:
            r.sum = RoundSum(r.round, r.attempt, r.fragment, self.pool.empty((frag.layout.numel,), torch.float32),
                             frag.layout.n_parts(E))
        lo, hi = frag.layout.part_range(h.part, E)
        r.sum.fold_order[h.part].append(h.island)
        push.next_part += 1
        self.work.append(FoldPart(r.sum, h.part, lo, msg, push.weight, h.island, quant, hi - lo))

    def _on_folded(self, work: FoldPart, result: Result, now: float, out: list[Out]) -> None:
        r = self.rounds.get(work.sum.round)
        if r is None or r.sum is not work.sum:
            return  # the attempt was dropped meanwhile
        if result.error:
            self.refusals += 1
            log.warning("round %d attempt %d: part %d from island %d refused (%s): it is folded into nothing, "
                        "but earlier parts were; dropping the attempt", r.round, r.attempt, work.part, work.island,
                        result.error)
            isl = self.islands[work.island]
            out.append(Outgoing(isl.peer, Error(code="bad_push", reason=result.error)))
            self._count_refusal(isl, f"bad_push: {result.error}", now, out)
            self._restart_attempt(r, now, out, f"a part of island {work.island} was refused")
            return
        push = r.pushes[work.island]
        push.folded += 1
        if push.complete:
            self.islands[work.island].refusals_in_row = 0
            self._maybe_start_grace(r, now)


    def _maybe_start_grace(self, r: RoundRecord, now: float) -> None:
        done = sum(p.complete for p in r.pushes.values())
        if done >= self.config.effective_quorum and r.grace_deadline is None:
            r.grace_deadline = now + self.config.grace_ms / 1000.0

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
        r = self.rounds.get(self.next_commit)
        if r is not None and r.closed and not any(f.committing for f in self.fragments):
            self._start_commit(r, now, out)
        self._deliver_cuts(out)
        self._open_rounds(now, out)
        self._maybe_finalize(now, out)
        return out


    def _pull(self, r: RoundRecord, island: int) -> Outgoing:
        return Outgoing(self.islands[island].peer, Pull(fragment=r.fragment, round=r.round, attempt=r.attempt))


    def _check_quorum(self, r: RoundRecord, now: float, out: list[Out]) -> None:
        """Close, wait, or drop the attempt (docs/PROTOCOL.md, "Quorum").

        A push that has started streaming is already in the running sum and cannot be
        taken out again: while it keeps sending parts the round waits for it; if it
        stalls (no part for ``--dead-after-s``), the whole attempt is dropped."""
        if r.closed:
            return
        k = self.config.effective_quorum
        complete = sum(p.complete for p in r.pushes.values())
        partial = [p for p in r.pushes.values() if not p.complete]
        stalled = [p for p in partial if now - p.last_part_at > self.config.dead_after_s]
        if stalled:
            self._restart_attempt(r, now, out, f"the push of island {stalled[0].island} stalled mid-stream")
        elif r.members and complete == len(r.members):
            r.closed = True
        elif complete >= k and r.grace_deadline is not None and now >= r.grace_deadline and not partial:
            r.closed = True
        elif complete < k and not partial and now - r.attempt_started >= self.config.quorum_timeout_s:
            self._restart_attempt(r, now, out, f"{complete}/{len(r.members)} pushes after "
                                               f"{now - r.attempt_started:.1f}s, quorum {k}", resend=True)

    def _start_commit(self, r: RoundRecord, now: float, out: list[Out]) -> None:
        """Merge a closed round (the earliest uncommitted one) on the data plane."""
        frag = self.fragments[r.fragment]
        r.commit_started = now
        total = sum(p.weight for p in r.pushes.values())
        if total == 0 or r.sum is None:
            self._finish_commit(r, now, out, changed=False)
            return
        assert frag.layout is not None and frag.value is not None and frag.momentum is not None
        # The new momentum is written beside the old one (which a checkpoint in flight may read,
        # too): a commit whose result is not finite is then dropped leaving value and momentum
        # exactly as they were.
        r.new_momentum = self.pool.empty((frag.layout.numel,), torch.float32)
        r.commit_failed = None
        E = self.config.part_elems
        dtypes = tuple(sorted({"float32"} | {bcast_dtype(i.wire_dtype) for i in self.live()}))
        n = frag.layout.n_parts(E)
        r.commit_parts_left = n
        frag.committing = True
        hyper = self.flush_hyper if r.flush else self.hyper
        for k in range(n):
            lo, hi = frag.layout.part_range(k, E)
            self.work.append(CommitPart(r.round, r.fragment, k, lo, hi, frag.value, frag.momentum, r.new_momentum,
                                        r.sum, total, hyper, frag.layout, E, dtypes, frag.version + 1,
                                        self.digest_seed))

    def _on_commit_part(self, work: CommitPart, result: Result, now: float, out: list[Out]) -> None:
        r = self.rounds.get(work.round)
        if r is None or r.sum is not work.sum:
            return
        if result.error:
            log.error("commit of round %d part %d refused: %s", work.round, work.part, result.error)
            r.commit_failed = r.commit_failed or result.error
        r.commit_parts_left -= 1
        if r.commit_parts_left == 0 and r.commit_failed:
            self._drop_commit(r, now, out)
        elif r.commit_parts_left == 0:
            self._finish_commit(r, now, out, changed=True)


    def _finish_commit(self, r: RoundRecord, now: float, out: list[Out], changed: bool) -> None:
        frag = self.fragments[r.fragment]
        pushes = [r.pushes[i] for i in sorted(r.pushes)]
        if changed:
            assert r.sum is not None
            frag.value = r.sum.flat  # the new value was written where the sum was
            if r.new_momentum is not None:
                frag.momentum = r.new_momentum
                self.pinned.discard(r.fragment)
            frag.version += 1
            frag.round = r.round
            if r.flush:
                self.changed_flush += 1
            else:
                self.changed_training += 1
            if self.config.checkpoint_every > 0 and (self.commits + 1) % self.config.checkpoint_every == 0:
                self.checkpoint_due = True
        frag.committing = False
        for p in pushes:
            led = self.islands[p.island].ledger
            led.merges += 1 if p.weight > 0 else 0
            led.steps += p.local_steps
            led.tokens += p.tokens
        del self.rounds[r.round]
        self.next_commit += 1
        self.commits += 1
        if self.flush_left is not None and r.flush:
            self.flush_left.discard(r.fragment)
        order = r.sum.fold_order if r.sum is not None else []
        self.events.append(
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
                "commit_s": round(now - r.commit_started, 6),
            }
        )
        log.info(
            "commit round %d fragment %d attempt %d -> version %d (pushed %s, weights %s%s)",
            r.round, r.fragment, r.attempt, frag.version, [p.island for p in pushes], [p.weight for p in pushes],
            ", flush" if r.flush else "",
        )
        if not changed:
            return
        # Islands still waiting for their cut get this version with the cut instead.
        for isl in self.live():
            if isl.cut_sent:
                out.append(self._bcast(isl, frag, r.round, cut=False))

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


"""The syncer's pure state machine: every round rule of docs/PROTOCOL.md, no sockets.

``SyncerState.handle(peer, msg, now)`` takes one decoded message and returns the
messages to send; ``tick(now)`` applies the time-based rules (dead islands,
grace windows, quorum timeouts, finalization timeout). Keeping this free of I/O
and of the clock lets tests drive every transition with hand-built messages
and chosen times, and lets the same logic later run per fragment shard.

Failure semantics: a message that breaks a rule is *refused*: the handler
validates everything first and raises :class:`Refused` before touching any
state, so a refusal leaves the state exactly as it was; ``handle`` then logs
one line and answers the peer with ERROR.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from diloco.outer import MergeScratch, OuterHyper, merge_weights, outer_step
from diloco.syncer.checks import Refused, check_tensors, spec_of
from diloco.syncer.config import SyncerConfig
from diloco.syncer.records import (
    FragmentRecord,
    FragmentSnapshot,
    IslandRecord,
    Outgoing,
    PushRecord,
    RoundRecord,
    Snapshot,
)
from diloco.wire import (
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    Bcast,
    Error,
    Final,
    FinalAck,
    Heartbeat,
    Hello,
    Init,
    Message,
    Pull,
    Push,
    Shutdown,
    Welcome,
)

log = logging.getLogger(__name__)

MAX_FINGERPRINT_CHARS = 256


class SyncerState:
    """All syncer state and the transitions between states.

    Args:
        config: round, quorum and optimizer settings.
        syncer_id: random per process (clients redial when it changes); drawn
            here when not given.
        snapshot: a checkpoint to resume from (``--resume``); fixes the
            fingerprint, fragment values, momentum, versions and next round.
    """

    def __init__(
        self,
        config: SyncerConfig,
        *,
        syncer_id: int | None = None,
        snapshot: Snapshot | None = None,
    ) -> None:
        self.config = config
        self.syncer_id = syncer_id if syncer_id is not None else random.getrandbits(63)
        self.hyper = OuterHyper(lr=config.outer_lr, momentum=config.outer_momentum)
        self.scratch = MergeScratch()
        self.islands = [IslandRecord(i) for i in range(config.islands)]
        self.fingerprint: str | None = None
        self.fragments: list[FragmentRecord] = []
        self.rounds: dict[int, RoundRecord] = {}
        self.next_open = 1  # next round number to open
        self.next_commit = 1  # rounds commit strictly in this order
        self.commits = 0
        self.refusals = 0
        self.phase = "running"  # running -> final -> done
        self.final_deadline = 0.0
        self.final_expected: frozenset[int] = frozenset()
        self.exit_code: int | None = None
        self.checkpoint_due = False
        self.started_at: float | None = None
        """Clock of the first message or tick: the join timeout counts from it."""
        self.pinned: set[int] = set()
        """Fragments whose momentum tensors an in-flight checkpoint still reads."""
        self.events: list[dict[str, Any]] = []
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

    def status(self) -> str:
        """One line for the operator: phase, rounds, attempts, members, versions."""
        rounds = " ".join(
            f"r{r.round}/f{r.fragment}/a{r.attempt}:{len(r.pushes)}/{len(r.members)}{'C' if r.closed else ''}"
            for r in sorted(self.rounds.values(), key=lambda r: r.round)
        )
        live = ",".join(str(i.island) for i in self.live())
        return (
            f"phase={self.phase} next_round={self.next_open} open=[{rounds}] live=[{live}] "
            f"versions={list(self.versions())} commits={self.commits} refusals={self.refusals}"
        )

    # ------------------------------------------------------------------ entry points

    def handle(self, peer: bytes, msg: Message, now: float) -> list[Outgoing]:
        """Apply one decoded message from ``peer``; return what to send."""
        if self.started_at is None:
            self.started_at = now
        header = msg.header
        out: list[Outgoing] = []
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
        except Refused as r:
            self.refusals += 1
            island = getattr(header, "island", "?")
            log.warning(
                "refused %s from island %s (peer %s): %s: %s",
                type(header).__name__, island, peer.hex(), r.code, r.reason,
            )
            return [Outgoing(peer, Error(code=r.code, reason=r.reason))]
        out.extend(self._progress(now))
        return out

    def tick(self, now: float) -> list[Outgoing]:
        """Apply the time-based rules; call on every loop iteration."""
        if self.started_at is None:
            self.started_at = now
        out: list[Outgoing] = []
        for isl in self.live():
            if now - isl.last_seen > self.config.dead_after_s:
                isl.alive = False
                # A revived island must be re-cut: it may have missed broadcasts.
                isl.cut_sent = False
                log.warning("island %d silent for %.1fs: declared dead", isl.island, now - isl.last_seen)
        if self.phase == "final" and now >= self.final_deadline:
            missing = sorted(i for i in self.final_expected if not self.islands[i].final_acked)
            log.error("finalization timed out: no FINAL_ACK from islands %s", missing)
            self._finish(1, f"finalization timed out waiting for islands {missing}", out)
        out.extend(self._progress(now))
        return out

    # ------------------------------------------------------------------ validation helpers

    def _bound_island(self, island: int, generation: int) -> IslandRecord:
        if not 0 <= island < self.config.islands:
            raise Refused("unknown_island", f"island {island} outside [0, {self.config.islands})")
        rec = self.islands[island]
        if not rec.bound:
            raise Refused("not_bound", f"island {island} has not said HELLO")
        if generation != rec.generation:
            if generation in rec.retired_generations:
                raise Refused("old_generation", f"generation {generation} of island {island} was replaced")
            raise Refused("unknown_generation", f"generation {generation} is not island {island}'s current one")
        return rec

    def _touch(self, rec: IslandRecord, peer: bytes, now: float) -> None:
        rec.last_seen = now
        rec.peer = peer
        if not rec.alive:
            rec.alive = True
            rec.cut_sent = False
            log.info("island %d is live again (generation %d)", rec.island, rec.generation)

    # ------------------------------------------------------------------ handlers

    def _on_hello(self, peer: bytes, h: Hello, msg: Message, now: float, out: list[Outgoing]) -> None:
        cfg = self.config
        if h.protocol != PROTOCOL_VERSION:
            raise Refused("protocol", f"protocol {h.protocol}, syncer speaks {PROTOCOL_VERSION}")
        if not 0 <= h.island < cfg.islands:
            raise Refused("unknown_island", f"island {h.island} outside [0, {cfg.islands})")
        if h.generation < 0:
            raise Refused("bad_generation", f"generation {h.generation} < 0")
        if h.wire_dtype not in WIRE_DTYPES:
            raise Refused("bad_dtype", f"wire dtype {h.wire_dtype[:40]!r} not in {sorted(WIRE_DTYPES)}")
        if not 1 <= h.n_fragments <= cfg.max_fragments:
            raise Refused("bad_fragments", f"n_fragments {h.n_fragments} outside [1, {cfg.max_fragments}]")
        if not 0 < len(h.fingerprint) <= MAX_FINGERPRINT_CHARS:
            raise Refused("bad_fingerprint", f"fingerprint of {len(h.fingerprint)} chars")
        if msg.tensors:
            raise Refused("unexpected_tensors", "HELLO carries no tensors")
        if self.fingerprint is not None:
            if h.fingerprint != self.fingerprint:
                raise Refused(
                    "fingerprint_mismatch",
                    f"layout fingerprint {h.fingerprint[:64]} != syncer's {self.fingerprint[:64]}",
                )
            if h.n_fragments != self.n_fragments:
                raise Refused("fragments_mismatch", f"n_fragments {h.n_fragments} != syncer's {self.n_fragments}")
        rec = self.islands[h.island]
        if h.generation in rec.retired_generations:
            raise Refused("old_generation", f"generation {h.generation} of island {h.island} was replaced")
        if self.phase == "done":
            raise Refused("finished", "the syncer has finished")

        # --- accepted: mutate from here on
        if self.fingerprint is None:
            self.fingerprint = h.fingerprint
            self.fragments = [FragmentRecord(index=f) for f in range(h.n_fragments)]
            log.info("layout fixed by island %d: fingerprint %s, %d fragments", h.island, h.fingerprint, h.n_fragments)
        if rec.bound and rec.generation != h.generation:
            rec.retired_generations.add(rec.generation)
            log.info("island %d reconnected: generation %d replaces %d", h.island, h.generation, rec.generation)
        rec.generation = h.generation
        rec.wire_dtype = h.wire_dtype
        rec.bound = True
        rec.joined = True
        rec.alive = True
        rec.final_acked = False
        # Every HELLO (new or repeated) gets the whole current cut: the island
        # may have lost its copy; replays of one version are ignored client side.
        rec.cut_sent = False
        rec.last_seen = now
        rec.peer = peer
        need_init = h.island == 0 and not self.initialised
        out.append(
            Outgoing(
                peer,
                Welcome(
                    protocol=PROTOCOL_VERSION,
                    syncer_id=self.syncer_id,
                    need_init=need_init,
                    versions=self.versions(),
                    sync_every=self.config.sync_every,
                    total_steps=self.config.total_steps,
                ),
            )
        )

    def _on_init(self, peer: bytes, h: Init, msg: Message, now: float) -> None:
        rec = self._bound_island(h.island, h.generation)
        if h.island != 0:
            raise Refused("init_not_island0", f"INIT from island {h.island}; only island 0 initialises")
        if h.n_fragments != self.n_fragments:
            raise Refused("fragments_mismatch", f"n_fragments {h.n_fragments} != {self.n_fragments}")
        if not 0 <= h.fragment < self.n_fragments:
            raise Refused("unknown_fragment", f"fragment {h.fragment} outside [0, {self.n_fragments})")
        frag = self.fragments[h.fragment]
        if frag.initialised:
            raise Refused("duplicate_init", f"fragment {h.fragment} is already initialised")
        if not msg.tensors:
            raise Refused("bad_schema", f"INIT of fragment {h.fragment} carries no tensors")
        schema = tuple(spec_of(n, t) for n, t in msg.tensors)
        check_tensors(msg, schema, "float32", f"INIT fragment {h.fragment}")

        # --- accepted. Decoded tensors are fresh allocations: own them directly.
        frag.schema = schema
        frag.values = [t.contiguous() for _, t in msg.tensors]
        frag.momentum = [torch.zeros_like(t) for t in frag.values]
        frag.published = [t.clone() for t in frag.values]
        frag.version = 0
        self._touch(rec, peer, now)
        log.info("fragment %d initialised by island 0: %d tensors", h.fragment, len(schema))

    def _on_push(self, peer: bytes, h: Push, msg: Message, now: float) -> None:
        rec = self._bound_island(h.island, h.generation)
        r = self.rounds.get(h.round)
        if r is None:
            state = "already committed" if h.round < self.next_commit else "not open"
            raise Refused("unknown_round", f"round {h.round} is {state}")
        if h.fragment != r.fragment:
            raise Refused("wrong_fragment", f"round {h.round} syncs fragment {r.fragment}, not {h.fragment}")
        if h.attempt != r.attempt:
            raise Refused("stale_attempt", f"round {h.round} is at attempt {r.attempt}, push is for {h.attempt}")
        if r.closed:
            raise Refused("round_closed", f"round {h.round} already closed")
        if h.island not in r.members:
            raise Refused("not_member", f"island {h.island} is not a member of round {h.round} attempt {r.attempt}")
        if h.island in r.pushes:
            raise Refused("duplicate_push", f"island {h.island} already pushed round {h.round} attempt {r.attempt}")
        frag = self.fragments[r.fragment]
        if not 0 <= h.base_version <= frag.version:
            raise Refused("bad_base_version", f"base version {h.base_version} outside [0, {frag.version}]")
        if h.local_steps < 0 or h.tokens < 0:
            raise Refused("bad_counts", f"local_steps {h.local_steps} / tokens {h.tokens} negative")
        check_tensors(msg, frag.schema, rec.wire_dtype, f"PUSH round {h.round}")

        # --- accepted
        r.pushes[h.island] = PushRecord(
            island=h.island,
            base_version=h.base_version,
            local_steps=h.local_steps,
            tokens=h.tokens,
            deltas=[t for _, t in msg.tensors],
        )
        self._touch(rec, peer, now)
        if len(r.pushes) >= self.config.effective_quorum and r.grace_deadline is None:
            r.grace_deadline = now + self.config.grace_ms / 1000.0

    def _on_heartbeat(self, peer: bytes, h: Heartbeat, msg: Message, now: float, out: list[Outgoing]) -> None:
        rec = self._bound_island(h.island, h.generation)
        if h.step < 0:
            raise Refused("bad_step", f"step {h.step} < 0")
        if msg.tensors:
            raise Refused("unexpected_tensors", "HEARTBEAT carries no tensors")
        rec.last_step = h.step
        rec.done = h.done
        self._touch(rec, peer, now)
        out.append(Outgoing(peer, Heartbeat(syncer_id=self.syncer_id)))

    def _on_final_ack(self, peer: bytes, h: FinalAck, msg: Message, now: float, out: list[Outgoing]) -> None:
        rec = self._bound_island(h.island, h.generation)
        if self.phase != "final":
            raise Refused("not_final", "no finalization in progress")
        if h.island not in self.final_expected:
            raise Refused("not_expected", f"island {h.island} was not sent the final cut")
        if tuple(h.versions) != self.versions():
            raise Refused("bad_versions", f"acked versions {list(h.versions)[:16]} != {list(self.versions())[:16]}")
        rec.final_acked = True
        self._touch(rec, peer, now)
        if all(self.islands[i].final_acked for i in self.final_expected):
            log.info("every island acknowledged the final cut %s", list(self.versions()))
            self._finish(0, "training finished", out)

    # ------------------------------------------------------------------ progress

    def _progress(self, now: float) -> list[Outgoing]:
        """Rules that fire on state, in order: close, commit, cut, open, finalize."""
        out: list[Outgoing] = []
        if self.phase != "running":
            return out
        for r in sorted(self.rounds.values(), key=lambda r: r.round):
            self._check_quorum(r, now, out)
        while self.next_commit in self.rounds and self.rounds[self.next_commit].closed:
            self._commit(self.rounds.pop(self.next_commit), now, out)
        self._deliver_cuts(out)
        self._open_rounds(now, out)
        self._maybe_finalize(now, out)
        return out

    def _pull(self, r: RoundRecord, island: int) -> Outgoing:
        return Outgoing(self.islands[island].peer, Pull(fragment=r.fragment, round=r.round, attempt=r.attempt))

    def _check_quorum(self, r: RoundRecord, now: float, out: list[Outgoing]) -> None:
        if r.closed:
            return
        k = self.config.effective_quorum
        n = len(r.pushes)
        if r.members and n == len(r.members):
            r.closed = True
        elif n >= k and r.grace_deadline is not None and now >= r.grace_deadline:
            r.closed = True
        elif n < k and now - r.attempt_started >= self.config.quorum_timeout_s:
            members = frozenset(i.island for i in self.live() if i.cut_sent)
            log.warning(
                "round %d attempt %d: %d/%d pushes after %.1fs (quorum %d): dropping them, re-pulling %s",
                r.round, r.attempt, n, len(r.members), now - r.attempt_started, k, sorted(members),
            )
            r.attempt += 1
            r.pushes.clear()
            r.members = members
            r.attempt_started = now
            r.grace_deadline = None
            out.extend(self._pull(r, i) for i in sorted(members))

    def _commit(self, r: RoundRecord, now: float, out: list[Outgoing]) -> None:
        """Merge a closed round (the earliest uncommitted one) and broadcast it."""
        frag = self.fragments[r.fragment]
        pushes = [r.pushes[i] for i in sorted(r.pushes)]  # increasing island id
        weights = merge_weights(
            [p.tokens for p in pushes], [p.local_steps for p in pushes], self.config.weighting
        )
        if r.fragment in self.pinned:
            # A checkpoint being written in the background holds this fragment's momentum
            # (its values are the immutable ``published`` clone): copy on write.
            frag.momentum = [m.clone() for m in frag.momentum]
            self.pinned.discard(r.fragment)
        changed = outer_step(
            frag.values, frag.momentum, [p.deltas for p in pushes], weights, self.hyper, self.scratch
        )
        for p, w in zip(pushes, weights):
            led = self.islands[p.island].ledger
            led.merges += 1 if w > 0 else 0
            led.steps += p.local_steps
            led.tokens += p.tokens
        self.next_commit += 1
        self.commits += 1
        if changed:
            frag.version += 1
            frag.published = [v.clone() for v in frag.values]
            if self.config.checkpoint_every > 0 and self.commits % self.config.checkpoint_every == 0:
                self.checkpoint_due = True
        self.events.append(
            {
                "time": now,
                "round": r.round,
                "fragment": r.fragment,
                "version": frag.version,
                "attempt": r.attempt,
                "members": sorted(r.members),
                "pushed": [p.island for p in pushes],
                "weights": {str(p.island): w for p, w in zip(pushes, weights)},
                "changed": changed,
            }
        )
        log.info(
            "commit round %d fragment %d attempt %d -> version %d (pushed %s, weights %s)",
            r.round, r.fragment, r.attempt, frag.version, [p.island for p in pushes], weights,
        )
        if not changed:
            return
        # Islands still waiting for their cut get this version with the cut instead.
        for isl in self.live():
            if isl.cut_sent:
                out.append(self._bcast(isl, frag, r.round, cut=False))

    def _bcast(self, isl: IslandRecord, frag: FragmentRecord, round_: int, cut: bool) -> Outgoing:
        return Outgoing(
            isl.peer,
            Bcast(fragment=frag.index, version=frag.version, round=round_, cut=cut),
            tuple(frag.named_published()),
            isl.wire_dtype,
            ("BCAST", frag.index, frag.version, round_, cut, isl.wire_dtype),
        )

    def _deliver_cuts(self, out: list[Outgoing]) -> None:
        if not self.initialised:
            return
        for isl in self.live():
            if isl.cut_sent:
                continue
            for frag in self.fragments:
                out.append(self._bcast(isl, frag, 0, cut=True))
            isl.cut_sent = True
            # A member that reconnected (or revived) mid-round is asked again,
            # after its cut so that it pushes against the current anchor.
            for r in sorted(self.rounds.values(), key=lambda r: r.round):
                if isl.island in r.members and isl.island not in r.pushes and not r.closed:
                    out.append(self._pull(r, isl.island))

    def _open_rounds(self, now: float, out: list[Outgoing]) -> None:
        if not self.initialised:
            return
        ready = [i for i in self.live() if i.cut_sent]
        if not ready:
            return
        top = max(i.last_step for i in ready)
        p, h = self.n_fragments, self.config.sync_every
        while True:
            t = self.next_open
            threshold = (t * h + p - 1) // p  # ceil(t * H / P)
            if self.config.total_steps > 0 and threshold > self.config.total_steps:
                return
            if top < threshold:
                return
            fragment = (t - 1) % p
            if any(r.fragment == fragment for r in self.rounds.values()):
                return  # the previous round of this fragment is still uncommitted
            members = frozenset(i.island for i in ready)
            r = RoundRecord(round=t, fragment=fragment, attempt=0, members=members, attempt_started=now)
            self.rounds[t] = r
            self.next_open += 1
            log.info("open round %d fragment %d (step %d >= %d), members %s", t, fragment, top, threshold, sorted(members))
            out.extend(self._pull(r, i) for i in sorted(members))

    def _maybe_finalize(self, now: float, out: list[Outgoing]) -> None:
        if not self.initialised or self.rounds:
            return
        live = self.live()
        if not live:
            return
        total = self.config.total_steps
        if not all(i.done or (total > 0 and i.last_step >= total) for i in live):
            return
        missing = [i.island for i in self.islands if not i.joined]
        if missing:
            if self.started_at is None or now - self.started_at < self.config.join_timeout_s:
                return  # a slow island may still be starting: let it join the run
            log.warning("finalizing without islands %s: they never joined within --join-timeout-s=%.0fs",
                        missing, self.config.join_timeout_s)
        self.phase = "final"
        self.final_deadline = now + self.config.final_timeout_s
        self.final_expected = frozenset(i.island for i in live)
        versions = self.versions()
        log.info("finalizing: FINAL %s to islands %s", list(versions), sorted(self.final_expected))
        for isl in live:
            isl.final_acked = False
            for frag in self.fragments:
                out.append(
                    Outgoing(
                        isl.peer,
                        Final(fragment=frag.index, version=frag.version, n_fragments=self.n_fragments, versions=versions),
                        tuple(frag.named_published()),
                        "float32",
                        ("FINAL", frag.index, frag.version),
                    )
                )

    def _finish(self, code: int, reason: str, out: list[Outgoing]) -> None:
        self.phase = "done"
        self.exit_code = code
        self.checkpoint_due = True
        for isl in self.islands:
            if isl.bound:
                out.append(Outgoing(isl.peer, Shutdown(reason=reason)))

    # ------------------------------------------------------------------ checkpoint

    def release_snapshot(self) -> None:
        """The last :meth:`snapshot` has been written: commits may update momenta in place again."""
        self.pinned.clear()

    def snapshot(self) -> Snapshot:
        """The checkpointable state, consistent as of now, safe to write on another thread.

        Tensors are shared, not copied: values are the immutable ``published`` clones, and
        every momentum is *pinned* until :meth:`release_snapshot`, so a commit in between
        copies that fragment's momentum before updating it. A checkpoint therefore costs
        no extra memory unless fragments commit while it is being written.
        """
        if not self.initialised or self.fingerprint is None:
            raise RuntimeError("nothing to checkpoint before every fragment is initialised")
        self.pinned = set(range(len(self.fragments)))
        return Snapshot(
            fingerprint=self.fingerprint,
            n_fragments=self.n_fragments,
            fragments=tuple(
                FragmentSnapshot(f.version, f.schema, tuple(f.published), tuple(f.momentum)) for f in self.fragments
            ),
            next_round=self.next_commit,
            ledgers={i.island: i.ledger.to_json() for i in self.islands},
            hyper={
                "outer_lr": self.config.outer_lr,
                "outer_momentum": self.config.outer_momentum,
                "weighting": self.config.weighting,
                "sync_every": self.config.sync_every,
            },
        )

    def _restore(self, snap: Snapshot) -> None:
        if snap.n_fragments != len(snap.fragments) or not 1 <= snap.n_fragments <= self.config.max_fragments:
            raise ValueError(f"checkpoint declares {snap.n_fragments} fragments but holds {len(snap.fragments)}")
        if snap.next_round < 1:
            raise ValueError(f"checkpoint next_round {snap.next_round} < 1")
        frags: list[FragmentRecord] = []
        for idx, fs in enumerate(snap.fragments):
            if len(fs.values) != len(fs.schema) or len(fs.momentum) != len(fs.schema) or not fs.schema:
                raise ValueError(f"checkpoint fragment {idx}: tensors do not match its schema")
            for (name, _d, shape), v, m in zip(fs.schema, fs.values, fs.momentum):
                for t in (v, m):
                    if t.dtype != torch.float32 or tuple(t.shape) != shape:
                        raise ValueError(f"checkpoint fragment {idx} tensor {name!r}: {t.dtype} {tuple(t.shape)}")
            values = [v.contiguous() for v in fs.values]
            frags.append(
                FragmentRecord(
                    index=idx,
                    schema=fs.schema,
                    values=values,
                    momentum=[m.contiguous() for m in fs.momentum],
                    published=[v.clone() for v in values],
                    version=fs.version,
                )
            )
        for island, led in snap.ledgers.items():
            if 0 <= island < self.config.islands:
                ledger = self.islands[island].ledger
                ledger.merges, ledger.steps, ledger.tokens = led["merges"], led["steps"], led["tokens"]
        self.fingerprint = snap.fingerprint
        self.fragments = frags
        self.next_open = self.next_commit = snap.next_round
        log.info("resumed: %d fragments at versions %s, next round %d", len(frags), list(self.versions()), snap.next_round)

"""The syncer's core: every round rule of docs/PROTOCOL.md, events in, effects out, no I/O.

:class:`Coordinator` takes one event at a time (:meth:`Coordinator.handle`: a message received,
a data-plane result, a tick of the clock, a message lost) at a time ``now`` the driver chooses,
and returns the messages to send (:data:`~diloco.syncer.core.effects.Out`). The other effects
wait in its journal until the driver takes them: data-plane work (fold a part, copy an INIT
part, commit a part, hash a final value: :meth:`take_work`), event-log records
(:meth:`take_events`), routing ids whose streams to drop (:meth:`take_superseded`) and a due
checkpoint (:meth:`take_checkpoint`). Keeping this free of I/O, threads and the clock lets tests
drive every transition with hand-built messages and chosen times, running the work inline.

It is composed of objects that each own one table: :class:`~.sessions.Sessions` (islands, peers,
HELLOs), :class:`~.roundbook.RoundBook` (open rounds, ``next_open``, ``next_commit``),
:class:`~.finalize.Finalize` (phase, flush, final cut), :class:`~.book.FragmentBook` (value,
momentum, version per fragment) and :class:`~.laggards.Laggards` (islands dropped per round);
the rules across tables are :class:`~.admission.Admission` (HELLO, INIT), :class:`~.cuts.Cuts`
(cuts fragment by fragment, claimed values), :class:`~.pushes.Pushes`
(PUSH), :class:`~.merge.Merge` (folds, quorum, commits) and :class:`~.recovery.Recovery` (lost
messages, refusals, restarts).

Failure semantics: a message that breaks a rule is *refused*: the handler validates everything
first and raises :class:`~.checks.Refused` before touching any state, so a refusal leaves the
state exactly as it was; the coordinator then logs one line and answers the peer with ERROR
(``Dropped``: nothing answered). A part refused by the data plane (bad digest, NaN) cannot be
taken out of the running sum again, so it voids its attempt: the round is re-pulled with
``attempt + 1``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from diloco.protocol.schedule import Schedule
from diloco.syncer.core import checkpoint
from diloco.syncer.core.admission import Admission
from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.checks import Dropped, Refused
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.cuts import Cuts, spans
from diloco.syncer.core.effects import Journal, Out, final_or_held, pull
from diloco.syncer.core.events import Event, Gauges, IslandGauge, Lost, Received, Tick
from diloco.syncer.core.finalize import Finalize
from diloco.syncer.core.laggards import Laggards
from diloco.syncer.core.merge import Merge
from diloco.syncer.core.pushes import Pushes
from diloco.syncer.core.records import FragmentRecord, IslandRecord, Outgoing, RoundRecord, Snapshot
from diloco.syncer.core.recovery import Recovery
from diloco.syncer.core.robust import Reference
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.syncer.core.work import CommitPart, DigestFragment, DigestSpan, FoldPart, InitPart, Result, Work
from diloco.wire import (Error, Final, FinalAck, Heartbeat, Hello, HostBufferPool, Init, Lane, LaneOk, Opened, Push,
                         Shutdown)

log = logging.getLogger("diloco.syncer.core")


class Coordinator:
    """The syncer's protocol state and every transition between states.

    Args:
        config: round, quorum, optimizer and size settings.
        syncer_id: random per process (clients redial when it changes); drawn here when not given.
        snapshot: a checkpoint to resume from (``--resume``); fixes the fingerprint, fragment
            values, momentum, versions and next round. ValueError when it is inconsistent.
    """

    def __init__(self, config: SyncerConfig, *, syncer_id: int | None = None, snapshot: Snapshot | None = None) -> None:
        self.config = config
        self.syncer_id = syncer_id if syncer_id is not None else random.getrandbits(63)
        self.pool = HostBufferPool()
        """Part-sized buffers, idle ones capped at a few parts (``book.IDLE_PARTS``); fragment buffers
        (values, sums, momenta) come from the book, never from here."""
        self.journal = Journal()
        self.book = FragmentBook(config, self.pool)
        self.sessions = Sessions(config, self.journal)
        self.roundbook = RoundBook(config, self.book)
        self.final = Finalize(config)
        self.reference = Reference()
        """Robust aggregation: reference norms and weights, per-island tallies (``robust.py``)."""
        self.laggards = Laggards(config, self.reference, self.journal)
        self.recovery = Recovery(config, self.sessions, self.roundbook, self.book, self.laggards, self.final,
                                 self.reference, self.journal)
        self.merge = Merge(config, self.sessions, self.roundbook, self.book, self.final, self.laggards,
                           self.recovery, self.journal)
        self.pushes = Pushes(config, self.sessions, self.roundbook, self.book, self.merge, self.reference,
                             self.journal)
        self.cuts = Cuts(self.sessions, self.book, self.roundbook, self.journal)
        self.admission = Admission(config, self.syncer_id, self.sessions, self.book, self.roundbook, self.final,
                                   self.recovery, self.journal)
        self.started_at: float | None = None
        """Clock of the first message or tick: the join timeout counts from it."""
        if snapshot is not None:
            checkpoint.restore(snapshot, config, self.book, self.roundbook, self.sessions)

    # ------------------------------------------------------------------ queries

    @property
    def fragments(self) -> list[FragmentRecord]:
        return self.book.fragments

    @property
    def islands(self) -> list[IslandRecord]:
        return self.sessions.islands

    @property
    def rounds(self) -> dict[int, RoundRecord]:
        """Open rounds by round number."""
        return self.roundbook.rounds

    @property
    def events(self) -> list[dict[str, Any]]:
        """Event-log records not taken yet (:meth:`take_events`)."""
        return self.journal.events

    @property
    def fingerprint(self) -> str | None:
        """The layout fingerprint fixed by the first HELLO (or the checkpoint); None before."""
        return self.book.fingerprint

    @property
    def n_fragments(self) -> int:
        return self.book.n_fragments

    @property
    def initialised(self) -> bool:
        return self.book.initialised

    @property
    def phase(self) -> str:
        return self.final.phase

    @property
    def finished(self) -> bool:
        return self.final.finished

    @property
    def exit_code(self) -> int | None:
        return self.final.exit_code

    @property
    def refusals(self) -> int:
        return self.journal.refusals

    @property
    def commits(self) -> int:
        return self.merge.commits

    def versions(self) -> tuple[int, ...]:
        return self.book.versions()

    def live(self) -> list[IslandRecord]:
        return self.sessions.live()

    def island_of(self, peer: bytes) -> int | None:
        """The island bound to routing id ``peer`` (None: none)."""
        return self.sessions.island_of(peer)

    def stamp(self, peer: bytes) -> tuple[int, int]:
        """(nonce, seq) for the next message sealed for ``peer``; (0, 0) for a peer we do not bind."""
        return self.sessions.stamp(peer)

    def committing(self) -> bool:
        """Whether a commit is in flight (a snapshot waits for it: it swaps buffers when it lands)."""
        return self.book.committing()

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
            "committed_rounds": self.merge.commits,
            "changed_in_training": self.merge.changed_training,
            "changed_in_flush": self.merge.changed_flush,
        }

    def status(self) -> str:
        """One line for the operator: phase, rounds, attempts, members, versions."""
        live = ",".join(str(i.island) for i in self.live())
        m = self.merged_summary()
        commit_s = ",".join(f"{f.commit_s:.2f}" for f in self.fragments[:16])
        stats = self.merge.merge_stats
        merge = f"{stats[0]:.2f}GB/s" if stats else "-"
        return (
            f"phase={self.phase} next_round={self.roundbook.next_open} open=[{self.roundbook.status()}] "
            f"live=[{live}] versions={list(self.versions())} commits={self.merge.commits} "
            f"changed={m['changed_in_training']}+{m['changed_in_flush']}/{m['scheduled_rounds']} "
            f"refusals={self.journal.refusals} commit_s=[{commit_s}] merge={merge} "
            f"per_island=[{self.reference.summary()}]"
        )

    def gauges(self, now: float) -> Gauges:
        """What the metrics endpoint shows of the core as of ``now``."""
        rounds = list(self.rounds.values())
        islands = tuple(IslandGauge(i.island, bool(i.bound and i.alive), now - i.last_seen if i.joined else None)
                        for i in self.islands)
        return Gauges(self.phase, len(rounds), sum(r.attempt for r in rounds),
                      max((now - r.attempt_started for r in rounds), default=0.0),
                      sum(f.version for f in self.fragments), islands, dict(self.journal.refused_by),
                      self.buffer_bytes(), self.reference.totals())

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the model-sized buffers, by kind (each tensor counted once)."""
        seen: set[int] = set()

        def size(t: Any) -> int:
            if t is None or t.data_ptr() in seen:
                return 0
            seen.add(t.data_ptr())
            return int(t.numel() * t.element_size())

        value = sum(size(f.value) for f in self.fragments)
        momentum = sum(size(f.momentum) for f in self.fragments)
        sums = sum(size(getattr(r.sum, "flat", None)) for r in self.rounds.values() if r.sum is not None)
        return {"value": value, "momentum": momentum, "running_sums": sums, "pool_idle": int(self.pool.idle_bytes)}

    # ------------------------------------------------------------------ effects the driver takes

    def take_work(self) -> list[Work]:
        """Data-plane work queued since last asked, in dispatch order."""
        return self.journal.take_work()

    def take_events(self) -> list[dict[str, Any]]:
        """Event-log records since last asked, oldest first."""
        return self.journal.take_events()

    def take_superseded(self) -> list[bytes]:
        """Routing ids a new HELLO of their island replaced: drop what still streams to them."""
        return self.sessions.take_superseded()

    @property
    def checkpoint_due(self) -> bool:
        return self.journal.checkpoint_due

    def request_checkpoint(self) -> None:
        """Make a checkpoint due now (the driver stops: SIGTERM)."""
        self.journal.checkpoint_due = True

    def take_checkpoint(self) -> bool:
        """Whether a checkpoint is due; it is no longer due afterwards."""
        due, self.journal.checkpoint_due = self.journal.checkpoint_due, False
        return due

    @property
    def digest_seed(self) -> int:
        """Chunk-digest seed of the payloads the core's commits encode (0 until the driver sets it)."""
        return self.merge.digest_seed

    def use_digest_seed(self, seed: int) -> None:
        """Chunk-digest seed of the payloads the commits encode (``wire.digest_seed`` of the key)."""
        self.merge.digest_seed = seed

    def snapshot(self) -> Snapshot:
        """The checkpointable state, consistent as of now, safe to write on another thread; every
        fragment stays pinned until :meth:`unpin` / :meth:`release_snapshot` (``checkpoint.py``)."""
        return checkpoint.snapshot(self.config, self.book, self.roundbook, self.sessions)

    def unpin(self, fragments: set[int]) -> None:
        """The checkpoint in flight has written (and let go of) these fragments: their commits may
        update the momentum in place again."""
        self.book.unpin(fragments)

    def release_snapshot(self) -> None:
        """The last :meth:`snapshot` has been written: commits may update momenta in place again."""
        self.book.unpin_all()

    # ------------------------------------------------------------------ entry points

    def handle(self, event: Event, now: float) -> list[Out]:
        """Apply one event; return what to send, in order."""
        if isinstance(event, Received):
            return self.receive(event.peer, event.msg, now, event.sender_key)
        if isinstance(event, Result):
            return self.on_result(event, now)
        if isinstance(event, Tick):
            return self.tick(now)
        if isinstance(event, Lost):
            self.on_lost(event.peer, event.kind, event.fragment, event.cut, now)
            return []
        raise TypeError(f"not an event of the syncer: {type(event).__name__}")

    def receive(self, peer: bytes, msg: Opened, now: float, sender_key: str = "") -> list[Out]:
        """Apply one opened message from ``peer`` (``sender_key``: its Curve key); return what to send."""
        if self.started_at is None:
            self.started_at = now
        header = msg.header
        out: list[Out] = []
        try:
            if isinstance(header, Hello):
                self.admission.on_hello(peer, header, msg, now, sender_key, out)
            elif isinstance(header, Init):
                self.admission.on_init(peer, header, msg, now)
            elif isinstance(header, Lane):
                rec = self.sessions.bind_lane(peer, header.island, header.generation, msg, sender_key)
                out.append(Outgoing(rec.peer, LaneOk(generation=rec.generation)))
            elif isinstance(header, Push):
                self.pushes.on_push(peer, header, msg, now)
            elif isinstance(header, Heartbeat):
                self._on_heartbeat(peer, header, msg, now, out)
            elif isinstance(header, FinalAck):
                self._on_final_ack(peer, header, msg, now, out)
            else:
                raise Refused("unexpected_kind", f"{type(header).__name__} is never sent to the syncer")
        except Dropped as r:
            self.journal.refused(r.code)
            self.journal.dropped += 1
            log.warning("dropped %s claiming island %s (peer %s), nothing answered: %s: %s",
                        type(header).__name__, getattr(header, "island", "?"), peer.hex(), r.code, r.reason)
            return []
        except Refused as r:
            if r.quiet:
                log.debug("dropped %s from island %s: %s", type(header).__name__, getattr(header, "island", "?"),
                          r.reason)
                return []
            self.journal.refused(r.code)
            island = getattr(header, "island", "?")
            log.warning(
                "refused %s from island %s (peer %s): %s: %s",
                type(header).__name__, island, peer.hex(), r.code, r.reason,
            )
            out = [Outgoing(self.sessions.reply_peer(peer), Error(code=r.code, reason=r.reason, fragment=r.fragment,
                                                                  round=r.round))]
            if isinstance(header, Push):
                self.recovery.on_push_refused(header, r, now, out)
            return out
        out.extend(self._progress(now))
        return out

    def on_result(self, result: Result, now: float) -> list[Out]:
        """Take one finished data-plane work item; return what to send."""
        out: list[Out] = []
        work = result.work
        if isinstance(work, FoldPart):
            self.merge.on_folded(work, result, now, out)
        elif isinstance(work, InitPart):
            self.admission.on_init_copied(work, result, out)
        elif isinstance(work, DigestSpan):
            self.admission.on_init_digested(work, result)
        elif isinstance(work, CommitPart):
            self.merge.on_commit_part(work, result, now, out)
        elif isinstance(work, DigestFragment) and work.claim:
            self.cuts.on_digest(work, result)
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
        self.sessions.declare_dead(now)
        for isl in self.final.resend_to(now, self.islands):
            out.extend(self._finals(isl))
        why = self.final.timed_out(now, self.islands)
        if why is not None:
            self._finish(1, why, out)
        out.extend(self._progress(now))
        return out

    def on_lost(self, peer: bytes, kind: str, fragment: int, cut: bool, now: float) -> None:
        """The loop could not deliver a message to ``peer`` (a send error: the peer is gone, or
        reconnected under the same routing id, or its queue is full).

        ``kind`` is ``BCAST`` / ``FINAL`` (a value stream of ``fragment``; ``cut``: it was part of
        a cut) or ``PULL``. The island is owed that value (and a re-pull of its open rounds),
        delivered once a message from the island proves it is connected again; an island that
        reconnected under a new routing id gets a whole new cut anyway."""
        self.sessions.on_lost(peer, kind, fragment, cut, now, self.n_fragments)

    def on_unsent(self, peer: bytes, fragment: int, version: int) -> None:
        """The loop skipped the BCAST of ``fragment`` at ``version`` to ``peer`` (superseded before
        a part went): no held FINAL may name it."""
        self.sessions.unsent(peer, fragment, version)

    # ------------------------------------------------------------------ handlers

    def _on_heartbeat(self, peer: bytes, h: Heartbeat, msg: Opened, now: float, out: list[Out]) -> None:
        rec = self.sessions.session(h.island, h.generation, peer, msg)
        if h.step < 0:
            raise Refused("bad_step", f"step {h.step} < 0")
        if msg.metas:
            raise Refused("unexpected_tensors", "HEARTBEAT carries no tensors")
        rec.last_step = h.step
        rec.done = h.done
        self.sessions.touch(rec, msg, now)
        out.append(Outgoing(peer, Heartbeat(syncer_id=self.syncer_id)))

    def _on_final_ack(self, peer: bytes, h: FinalAck, msg: Opened, now: float, out: list[Out]) -> None:
        rec = self.sessions.session(h.island, h.generation, peer, msg)
        if self.phase != "final":
            raise Refused("not_final", "no finalization in progress")
        if h.island not in self.final.final_expected:
            raise Refused("not_expected", f"island {h.island} was not sent the final cut")
        if tuple(h.versions) != self.versions():
            raise Refused("bad_versions", f"acked versions {list(h.versions)[:16]} != {list(self.versions())[:16]}")
        if h.digests and len(h.digests) != self.n_fragments:
            raise Refused("bad_digests", f"{len(h.digests)} digests for {self.n_fragments} fragments")
        rec.final_acked = True
        rec.final_digests = tuple(h.digests)
        self.sessions.touch(rec, msg, now)
        self._check_final(out)

    def _check_final(self, out: list[Out]) -> None:
        """Finish once every expected island acknowledged and every digest is known (``Finalize.verdict``)."""
        verdict = self.final.verdict(self.islands, self.fragments, self.versions())
        if verdict is not None:
            self._finish(*verdict, out)

    def _finish(self, code: int, reason: str, out: list[Out]) -> None:
        self.final.finish(code)
        self.journal.checkpoint_due = True
        for isl in self.islands:
            if isl.bound:
                out.append(Outgoing(isl.peer, Shutdown(reason=reason)))

    def _finals(self, isl: IslandRecord) -> list[Out]:
        """The final cut for ``isl``: per fragment a held notice for the fp32 value it was streamed
        after it said done, else the fp32 stream (``effects.final_or_held``)."""
        versions = self.versions()
        return [final_or_held(isl, frag, versions) for frag in self.fragments]

    # ------------------------------------------------------------------ progress

    def _progress(self, now: float) -> list[Out]:
        """Rules that fire on state, in order: close, commit, cut, open, finalize."""
        out: list[Out] = []
        self.recovery.deliver_owed(out)
        if self.phase != "running":
            return out
        for r in self.roundbook.in_order():
            self.merge.check_quorum(r, now, out)
        self.merge.start_commits(now, out)
        self.cuts.deliver(out)
        self._open_rounds(now, out)
        self._maybe_finalize(now, out)
        return out

    def _open_rounds(self, now: float, out: list[Out]) -> None:
        """The round clock (``RoundBook.open_training``); once every island finished, one flush round
        per fragment (``Finalize.start_flush``, ``RoundBook.open_flush``)."""
        if not self.initialised:
            return
        ready = self.sessions.ready()  # a HELLO alone is not membership
        if not ready:
            return
        opened, over = self.roundbook.open_training(ready, now)
        self._pull_all(opened, out)
        if not over or not all(self.final.finished_training(i) for i in ready):
            return
        self.final.start_flush(Schedule(self.config.sync_every, self.n_fragments, self.config.total_steps))
        assert self.final.flush_left is not None
        members = frozenset(i.island for i in ready)
        self._pull_all(self.roundbook.open_flush(self.final.flush_left, members, now), out)

    def _pull_all(self, opened: list[RoundRecord], out: list[Out]) -> None:
        for r in opened:
            out.extend(pull(self.islands[i].peer, r) for i in sorted(r.members))

    def _maybe_finalize(self, now: float, out: list[Out]) -> None:
        everyone = self.live()
        expected = self.final.due(now, self.initialised, bool(self.rounds), everyone, self.islands, self.started_at)
        if expected is None:
            return
        self.final.begin(now, expected)
        self.book.drop_spare()  # no round opens any more
        versions = self.versions()
        m = self.merged_summary()
        log.info("finalizing: FINAL %s to islands %s; merged: %s", list(versions), sorted(self.final.final_expected),
                 m)
        if m["scheduled_rounds"] and m["changed_in_training"] < m["scheduled_rounds"]:
            log.warning("only %d of %d scheduled rounds changed the model during training (the others merged "
                        "nothing: islands pushed no local steps, or rounds opened too late)",
                        m["changed_in_training"], m["scheduled_rounds"])
        self.journal.events.append({"time": now, "summary": m})
        for frag in self.fragments:
            # FINAL_ACKs carry digests of what islands installed; ours is computed off the loop.
            assert frag.value is not None and frag.layout is not None
            frag.digest = None
            self.journal.work.append(DigestFragment(frag.index, frag.value, frag.layout))
        for isl in everyone:  # an evicted island gets the final cut too, but is not waited for
            isl.final_acked = False
            isl.final_digests = ()
            finals = self._finals(isl)
            out.extend(finals)
            held = [o.header.fragment for o in finals if isinstance(o, Outgoing) and isinstance(o.header, Final)]
            if held:
                log.info("island %d holds fragments %s of the final cut (streamed to it after its done): HELD, "
                         "not sent again", isl.island, spans(held))

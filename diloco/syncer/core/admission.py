"""Admission to the syncer's core: HELLO and the INIT stream (docs/PROTOCOL.md, "Handshake",
"Sessions and replays", "Initial cut").

A HELLO is checked against the protocol and the session rules (``Sessions``), the layout fixed
by the first island (``FragmentBook``), the phase (``Finalize``), a live process already bound
to the island id and the key that owns it; every check runs before anything changes. The INIT
stream (island 0 only) gives every fragment its first value, copied in by the data plane.

:class:`Admission` owns no table: it applies these rules through the tables it is handed. No I/O.
"""

from __future__ import annotations

import logging

from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.checks import Refused, check_schema
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Journal, Out, final
from diloco.syncer.core.finalize import Finalize
from diloco.syncer.core.records import FragmentRecord, Outgoing
from diloco.syncer.core.recovery import Recovery
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.syncer.core.initdigest import InitDigest
from diloco.syncer.core.work import DigestSpan, InitPart, Result
from diloco.wire import PROTOCOL_VERSION, Error, FragmentLayout, Hello, Init, Opened, Welcome

log = logging.getLogger("diloco.syncer.core")

SPAN_ELEMS = 16 << 20
"""Elements (64 MiB of fp32) an INIT value's streamed digest hashes per work item at least (the
stream's rest may be less): few work items and results, and still within cache of the copies."""


class Admission:
    """HELLO and INIT.

    Args:
        config: the syncer's settings (WELCOME repeats the round settings).
        syncer_id: this syncer process's id (WELCOME; islands redial when it changes).
        sessions, book, rounds, final: the tables a HELLO and an INIT are checked against and change.
        recovery: restarts an attempt a reconnecting island left half-pushed.
        journal: where INIT copies are queued and refusals counted.
    """

    def __init__(self, config: SyncerConfig, syncer_id: int, sessions: Sessions, book: FragmentBook,
                 rounds: RoundBook, final: Finalize, recovery: Recovery, journal: Journal) -> None:
        self.config = config
        self.syncer_id = syncer_id
        self.sessions = sessions
        self.book = book
        self.rounds = rounds
        self.final = final
        self.recovery = recovery
        self.journal = journal

    def on_hello(self, peer: bytes, h: Hello, msg: Opened, now: float, sender_key: str, out: list[Out]) -> None:
        """Admit ``h`` from ``peer`` (``sender_key``: its Curve key, empty outside Curve mode): WELCOME
        opens a session; a redial while finalizing gets the final cut again."""
        cfg = self.config
        self.sessions.check_hello(peer, h, msg, now, sender_key)
        self.book.check_plan(h.fingerprint, h.n_fragments, tuple(h.fragment_numel))
        if self.final.finished:
            raise Refused("finished", "the syncer has finished")
        self.sessions.check_owner(peer, h, now, sender_key)

        # --- accepted: mutate from here on
        self.sessions.accept_hello(h, sender_key)
        if self.book.fingerprint is None:
            self.book.fix_layout(h.fingerprint, h.n_fragments, tuple(h.fragment_numel))
            log.info("layout fixed by island %d: fingerprint %s, %d fragments", h.island, h.fingerprint, h.n_fragments)
        if self.sessions.retire(h):
            # A push the old connection left half-sent is in the running sum and its last parts
            # will never come: drop that attempt now (not after --dead-after-s) and pull again;
            # the reconnected island is pulled after its cut.
            for r in self.rounds.in_order():
                p = r.pushes.get(h.island)
                if p is not None and not p.complete and not r.closed:
                    self.recovery.restart_attempt(r, now, out, f"island {h.island} reconnected mid-push")
                    r.members = r.members | {h.island}
        rec = self.sessions.bind(peer, h, now)
        need_init = h.island == 0 and not self.book.initialised
        out.append(
            Outgoing(
                peer,
                Welcome(
                    protocol=PROTOCOL_VERSION,
                    syncer_id=self.syncer_id,
                    need_init=need_init,
                    versions=self.book.versions(),
                    sync_every=cfg.sync_every,
                    total_steps=cfg.total_steps,
                    part_elems=self.book.part_elems,
                    generation=h.generation,
                    nonce=rec.nonce,
                    weighting=cfg.weighting,
                    initialised=tuple(self._holds_init(f) for f in self.book.fragments),
                    lanes=cfg.init_lanes if h.island == 0 else 0,
                ),
            )
        )
        if self.final.phase == "final":
            # A redial during finalization: the island may have lost the final cut (or its ack).
            log.info("island %d rejoined while finalizing: FINAL again", h.island)
            rec.final_digests = ()
            out.extend(final(rec, frag, self.book.versions()) for frag in self.book.fragments)

    def _holds_init(self, frag: FragmentRecord) -> bool:
        """Whether ``frag`` needs no more INIT: it has its value, or every part of it was accepted
        (the data plane is copying the last ones in)."""
        return frag.initialised or (frag.layout is not None
                                    and frag.init_next_part == frag.layout.n_parts(self.book.part_elems))

    def on_init(self, peer: bytes, h: Init, msg: Opened, now: float) -> None:
        """Take one INIT part of island 0 (in order per fragment; part 0 carries the schema and restarts
        the stream), on the session's first connection or its lane."""
        rec = self.sessions.session(h.island, h.generation, peer, msg, lane_ok=True)
        n_fragments = self.book.n_fragments
        if h.island != 0:
            raise Refused("init_not_island0", f"INIT from island {h.island}; only island 0 initialises")
        if h.n_fragments != n_fragments:
            raise Refused("fragments_mismatch", f"n_fragments {h.n_fragments} != {n_fragments}")
        if not 0 <= h.fragment < n_fragments:
            raise Refused("unknown_fragment", f"fragment {h.fragment} outside [0, {n_fragments})")
        frag = self.book.fragments[h.fragment]
        if frag.initialised:
            raise Refused("duplicate_init", f"fragment {h.fragment} is already initialised")
        E = self.book.part_elems
        if h.part == 0:
            schema = check_schema(h.schema, self.config.max_fragment_bytes, f"INIT fragment {h.fragment}")
            layout = FragmentLayout.of([(n, s) for n, _d, s in schema])
            declared = self.book.declared_numel
            if declared and layout.numel != declared[h.fragment]:
                # The part size was fixed from the declared sizes; a resume fixes it from the real ones.
                raise Refused("fragments_mismatch", f"INIT fragment {h.fragment} holds {layout.numel} elements, "
                                                    f"the HELLO that fixed the layout declared {declared[h.fragment]}")
        else:
            if h.schema:
                raise Refused("bad_schema", f"INIT part {h.part} carries a schema; only part 0 does")
            if frag.layout is None or h.part > frag.init_next_part:
                # Earlier parts were lost on the way (a connection reset): island 0 redials and
                # resumes INIT from the WELCOME, restarting this fragment from part 0.
                raise Refused("init_gap", f"INIT part {h.part} of fragment {h.fragment}, expected part "
                                          f"{frag.init_next_part if frag.layout is not None else 0}")
            if h.part != frag.init_next_part:
                raise Refused("bad_part", f"INIT part {h.part} of fragment {h.fragment}, expected part "
                                          f"{frag.init_next_part}")
            layout = frag.layout
            schema = frag.schema
        problem = layout.check_part(msg.metas, h.part, h.n_parts, E, "float32")
        if problem:
            raise Refused("bad_part", f"INIT fragment {h.fragment}: {problem}")

        # --- accepted
        if h.part == 0:
            # (Re)start of the stream: a redialed island 0 streams INIT again from part 0.
            frag.schema, frag.layout = schema, layout
            frag.value = self.book.fresh(layout.numel, "value")
            frag.momentum = None  # allocated by the first commit that needs it (--outer-momentum > 0)
            frag.value_absmax = [float("inf")] * layout.n_parts(E)
            frag.init_next_part = frag.init_done_parts = 0
            # Its digest streams with it (a claim then waits for that, not for a pass of its own).
            frag.init_digest = InitDigest.of(layout, layout.n_parts(E))
            frag.value_digest, frag.digesting = None, 0
        assert frag.value is not None
        lo, _hi = layout.part_range(h.part, E)
        frag.init_next_part += 1
        self.journal.work.append(InitPart(h.fragment, h.part, lo, msg, frag.value))
        self.sessions.touch(rec, msg, now)

    def on_init_copied(self, work: InitPart, result: Result, out: list[Out]) -> None:
        """An INIT part copied in (or refused: island 0 must stream INIT again)."""
        frag = self.book.fragments[work.fragment]
        if frag.value is not work.value or frag.initialised:
            return  # a restarted INIT stream replaced this buffer
        if result.error:
            self.journal.refusals += 1
            log.warning("INIT part %d of fragment %d refused: %s; island 0 must stream INIT again",
                        work.part, work.fragment, result.error)
            self._end_digest(frag)
            frag.value = frag.momentum = None
            frag.init_next_part = frag.init_done_parts = 0
            out.append(Outgoing(self.sessions.islands[0].peer, Error(code="bad_init", reason=result.error)))
            return
        frag.init_done_parts += 1
        frag.value_absmax[work.part] = result.absmax[0]
        assert frag.layout is not None
        if frag.init_digest is not None:
            frag.init_digest.copied_part(work.part)
            self._digest_next(frag)
        if frag.init_done_parts == frag.layout.n_parts(self.book.part_elems):
            frag.initialised = True
            if self.book.initialised:
                self.book.log_budget()
            frag.version = 0
            log.info("fragment %d initialised by island 0: %d tensors, %.1f MiB", work.fragment, len(frag.schema),
                     frag.layout.numel * 4 / 2**20)

    def on_init_digested(self, work: DigestSpan, result: Result) -> None:
        """A span of an INIT value was hashed: hand out the next one, or keep the finished digest as
        the value's (version 0). A failed span abandons the streamed digest: a claim then has the
        whole value hashed (``Cuts``)."""
        frag = self.book.fragments[work.fragment]
        state = frag.init_digest
        if state is None or state.hasher is not work.hasher or frag.value is not work.value:
            return  # a restarted INIT stream, or the value moved on
        if result.error:
            log.error("streamed digest of INIT fragment %d failed (a claim of it has the value hashed): %s",
                      work.fragment, result.error)
            self._end_digest(frag)
            return
        state.hashed_to(work.end)
        if result.digest is not None:
            frag.value_digest = (0, result.digest)
            self._end_digest(frag)
            return
        self._digest_next(frag)

    def _digest_next(self, frag: FragmentRecord) -> None:
        """Queue the next span of ``frag``'s streamed INIT digest, if one is ready and none is out.
        Only version 0 is streamed: a value a commit replaced (or is replacing) is not hashed here."""
        state = frag.init_digest
        assert state is not None
        if frag.version != 0 or frag.committing or frag.consuming:
            self._end_digest(frag)
            return
        span = state.next_span(max(1, SPAN_ELEMS // self.book.part_elems))
        if span is None:
            return
        assert frag.value is not None and frag.layout is not None
        E = self.book.part_elems
        lo, _ = frag.layout.part_range(span[0], E)
        _, hi = frag.layout.part_range(span[1] - 1, E)
        self.journal.work.append(DigestSpan(frag.index, frag.value, lo, hi, span[1], state.hasher))

    @staticmethod
    def _end_digest(frag: FragmentRecord) -> None:
        """Stop streaming ``frag``'s INIT digest (finished, failed or void); a claim then uses the
        ``value_digest`` it left, or has the value hashed whole."""
        frag.init_digest = None
        if frag.digesting == 0:
            frag.digesting = -1

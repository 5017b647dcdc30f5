"""Admission to the syncer state machine: sessions, HELLO and the INIT stream (docs/PROTOCOL.md,
"Handshake", "Sessions and replays", "Initial cut").

A mixin of :class:`diloco.syncer.state.SyncerState`, kept apart so that the state's own module
reads as the round rules (push, quorum, commit) and this one as who may talk to the syncer at
all: a HELLO is checked against the protocol, the layout fixed by the first island, the size
limits and a live process already bound to the island id; every later message must belong to
the island's current connection (routing id, session nonce, increasing sequence number).  A
refusal raises before any state changes, like every handler of the state.  No I/O.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from typing import TYPE_CHECKING


from diloco.syncer.core.checks import Dropped, Refused, check_schema
from diloco.syncer.fields import StateFields
from diloco.syncer.core.gate import Gate
from diloco.syncer.core.work import InitPart, Result
from diloco.syncer.core.records import FragmentRecord, IslandRecord, Outgoing
from diloco.wire import (
    PROTOCOL_VERSION,
    PUSH_DTYPES,
    QUANT_KINDS,
    Error,
    FragmentLayout,
    Hello,
    Init,
    Opened,
    Welcome,
)

if TYPE_CHECKING:
    from diloco.syncer.core.effects import Out

log = logging.getLogger("diloco.syncer.state")

MAX_FINGERPRINT_CHARS = 256
HELLOS_REMEMBERED = 256
"""(island, generation) pairs remembered per island id for replay detection (and retired generations
kept per island): fixed memory whatever the number of HELLOs."""


class Admission(StateFields):
    """HELLO, INIT and the session checks (methods of ``SyncerState``)."""

    gate: Gate
    proven: set[int]
    refused_by: Counter[str]
    sender_key: str = ""
    """Z85 Curve public key of the message being handled (set by the loop; empty outside Curve mode)."""

    def stamp(self, peer: bytes) -> tuple[int, int]:
        """(nonce, seq) for the next message sealed for ``peer``; (0, 0) for a peer we do not bind."""
        island = self.peers.get(peer)
        if island is None:
            return 0, 0
        rec = self.islands[island]
        rec.send_seq += 1
        return rec.nonce, rec.send_seq

    def _session(self, island: int, generation: int, peer: bytes, msg: Opened) -> IslandRecord:
        """The island's record if ``msg`` belongs to its current connection (replay protection).

        Raises Dropped (nothing answered) for another routing id, a wrong nonce or a sequence
        number that does not increase; the sequence number advances when the message is
        accepted (:meth:`_touch`)."""
        rec = self._bound_island(island, generation)
        if peer != rec.peer:
            raise Dropped("wrong_peer", f"island {island} is bound to peer {rec.peer.hex()}, not {peer.hex()}")
        if msg.nonce != rec.nonce:
            raise Dropped("bad_nonce", f"nonce {msg.nonce:x} is not island {island}'s session nonce")
        if msg.seq <= rec.recv_seq:
            raise Dropped("replayed_seq", f"sequence number {msg.seq} <= {rec.recv_seq} (a replay)")
        return rec

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

    def _touch(self, rec: IslandRecord, msg: Opened, now: float) -> None:
        """An accepted message of the island's connection: alive, and its sequence number taken."""
        rec.last_seen = now
        rec.recv_seq = msg.seq
        self.proven.add(rec.island)  # a HELLO alone is not membership (``laggards.ready``)
        if not rec.alive:
            rec.alive = True
            rec.cut_sent = False
            log.info("island %d is live again (generation %d)", rec.island, rec.generation)

    def _check_sizes(self, fragment_numel: tuple[int, ...], n_fragments: int) -> None:
        """A plan whose fragments exceed what this syncer accepts is refused with the fix."""
        if not fragment_numel:
            return
        if len(fragment_numel) != n_fragments or any(n <= 0 for n in fragment_numel):
            raise Refused("bad_fragments", f"{len(fragment_numel)} fragment sizes for {n_fragments} fragments")
        limit = self.config.max_fragment_bytes
        biggest = max(fragment_numel) * 4
        if biggest > limit:
            need = math.ceil(sum(fragment_numel) * 4 / limit)
            raise Refused(
                "fragment_too_large",
                f"a fragment holds {biggest / 2**30:.2f} GiB of fp32, this syncer accepts at most "
                f"{limit / 2**30:.2f} GiB per fragment (--max-fragment-gib): use more fragments "
                f"(YETO_DILOCO_FRAGMENTS >= {max(need, n_fragments + 1)}) or raise --max-fragment-gib",
            )
        if self.fragments and all(f.layout is not None for f in self.fragments):
            have = tuple(f.layout.numel for f in self.fragments if f.layout is not None)
            if have != tuple(fragment_numel):
                raise Refused("fragments_mismatch", f"fragment sizes {list(fragment_numel)[:8]} != {list(have)[:8]}")

    def _on_hello(self, peer: bytes, h: Hello, msg: Opened, now: float, out: list[Out]) -> None:
        cfg = self.config
        if h.protocol != PROTOCOL_VERSION:
            raise Refused("protocol", f"protocol {h.protocol}, syncer speaks {PROTOCOL_VERSION}")
        if not 0 <= h.island < cfg.islands:
            raise Refused("unknown_island", f"island {h.island} outside [0, {cfg.islands})")
        if h.generation < 0:
            raise Refused("bad_generation", f"generation {h.generation} < 0")
        if not self.gate.allow_hello(self.sender_key.encode() or peer, now):
            # Counted, not answered and logged at DEBUG only: a flood must cost neither sends nor log lines.
            self.refusals += 1
            self.refused_by["hello_rate"] += 1
            raise Refused("hello_rate", f"HELLOs from this sender faster than {self.gate.rate}/s", quiet=True)
        # A client says HELLO once per connection, under a fresh generation: a second HELLO of
        # one generation is a replay, and the replayer gets nothing (not even an ERROR).
        if (h.island, h.generation) in self.hellos_seen:
            raise Dropped("replayed_hello", f"HELLO of island {h.island} generation {h.generation} seen before")
        if msg.nonce or msg.seq:
            raise Refused("bad_session", "HELLO opens a session: nonce and seq must be 0")
        if h.wire_dtype not in PUSH_DTYPES:
            raise Refused("bad_dtype", f"wire dtype {h.wire_dtype[:40]!r} not in {list(PUSH_DTYPES)}")
        if h.wire_dtype in QUANT_KINDS and h.quant_block != cfg.quant_block:
            raise Refused("bad_quant", f"{h.wire_dtype} pushes with blocks of {h.quant_block} elements; this syncer "
                                       f"uses --quant-block {cfg.quant_block} (set YETO_QUANT_BLOCK={cfg.quant_block})")
        if not 1 <= h.n_fragments <= cfg.max_fragments:
            raise Refused("bad_fragments", f"n_fragments {h.n_fragments} outside [1, {cfg.max_fragments}]")
        if not 0 < len(h.fingerprint) <= MAX_FINGERPRINT_CHARS:
            raise Refused("bad_fingerprint", f"fingerprint of {len(h.fingerprint)} chars")
        if msg.metas:
            raise Refused("unexpected_tensors", "HELLO carries no tensors")
        if self.fingerprint is not None:
            if h.fingerprint != self.fingerprint:
                raise Refused(
                    "fingerprint_mismatch",
                    f"layout fingerprint {h.fingerprint[:64]} != syncer's {self.fingerprint[:64]}",
                )
            if h.n_fragments != self.n_fragments:
                raise Refused("fragments_mismatch", f"n_fragments {h.n_fragments} != syncer's {self.n_fragments}")
        self._check_sizes(tuple(h.fragment_numel), h.n_fragments)
        rec = self.islands[h.island]
        if self.phase == "done":
            raise Refused("finished", "the syncer has finished")
        # Another process, not a reconnect: another instance (islands send a random one per
        # process, kept across redials) while the binding was heard from within --dead-after-s.
        other = h.instance != rec.instance and peer != rec.peer
        if (rec.bound and rec.alive and rec.generation != h.generation and other
                and now - rec.last_seen <= cfg.dead_after_s):
            raise Refused("island_in_use", f"island id {h.island} is bound to another live process (peer "
                                           f"{rec.peer.hex()}, heard {now - rec.last_seen:.1f}s ago, within "
                                           f"--dead-after-s={cfg.dead_after_s:.0f}s): two processes share one "
                                           f"YETO_DILOCO_ISLAND_ID?")
        problem = self.gate.key_problem(h.island, self.sender_key)
        if problem:
            raise Refused("key_not_owner", problem)

        # --- accepted: mutate from here on
        self.hellos_seen[(h.island, h.generation)] = None
        while len(self.hellos_seen) > HELLOS_REMEMBERED * cfg.islands:
            del self.hellos_seen[next(iter(self.hellos_seen))]
        self.proven.discard(h.island)
        self.gate.bind(h.island, self.sender_key)
        if self.fingerprint is None:
            self.fingerprint = h.fingerprint
            self.fragments = [FragmentRecord(index=f) for f in range(h.n_fragments)]
            log.info("layout fixed by island %d: fingerprint %s, %d fragments", h.island, h.fingerprint, h.n_fragments)
        if rec.bound and rec.generation != h.generation:
            rec.retired_generations.add(rec.generation)
            while len(rec.retired_generations) > HELLOS_REMEMBERED:
                rec.retired_generations.pop()
            log.info("island %d reconnected: generation %d replaces %d", h.island, h.generation, rec.generation)
            # A push the old connection left half-sent is in the running sum and its last parts
            # will never come: drop that attempt now (not after --dead-after-s) and pull again;
            # the reconnected island is pulled after its cut.
            for r in list(self.rounds.values()):
                p = r.pushes.get(h.island)
                if p is not None and not p.complete and not r.closed:
                    self._restart_attempt(r, now, out, f"island {h.island} reconnected mid-push")
                    r.members = r.members | {h.island}
        if rec.evicted and rec.generation != h.generation:
            log.warning("island %d readmitted to rounds: a fresh HELLO (generation %d)", h.island, h.generation)
            rec.evicted = False
            rec.refusals_in_row = 0
        rec.generation = h.generation
        rec.instance = h.instance
        rec.owed.clear()
        rec.owe_pulls = False
        rec.refused_push = None
        rec.wire_dtype = h.wire_dtype
        rec.bound = True
        rec.joined = True
        rec.alive = True
        rec.final_acked = False
        # Every HELLO (new or repeated) gets the whole current cut: the island
        # may have lost its copy; replays of one version are ignored client side.
        rec.cut_sent = False
        rec.last_seen = now
        if rec.peer and rec.peer != peer and self.peers.pop(rec.peer, None) is not None:
            # The old connection's cut and broadcasts are cancelled (at most one cut in flight per island).
            self.superseded.append(rec.peer)
        rec.peer = peer
        self.peers[peer] = h.island
        rec.nonce = random.getrandbits(63) or 1
        rec.recv_seq = rec.send_seq = 0
        need_init = h.island == 0 and not self.initialised
        out.append(
            Outgoing(
                peer,
                Welcome(
                    protocol=PROTOCOL_VERSION,
                    syncer_id=self.syncer_id,
                    need_init=need_init,
                    versions=self.versions(),
                    sync_every=cfg.sync_every,
                    total_steps=cfg.total_steps,
                    part_elems=cfg.part_elems,
                    generation=h.generation,
                    nonce=rec.nonce,
                    weighting=cfg.weighting,
                ),
            )
        )
        if self.phase == "final":
            # A redial during finalization: the island may have lost the final cut (or its ack).
            log.info("island %d rejoined while finalizing: FINAL again", h.island)
            rec.final_digests = ()
            out.extend(self._finals(rec))

    def _on_init(self, peer: bytes, h: Init, msg: Opened, now: float) -> None:
        rec = self._session(h.island, h.generation, peer, msg)
        if h.island != 0:
            raise Refused("init_not_island0", f"INIT from island {h.island}; only island 0 initialises")
        if h.n_fragments != self.n_fragments:
            raise Refused("fragments_mismatch", f"n_fragments {h.n_fragments} != {self.n_fragments}")
        if not 0 <= h.fragment < self.n_fragments:
            raise Refused("unknown_fragment", f"fragment {h.fragment} outside [0, {self.n_fragments})")
        frag = self.fragments[h.fragment]
        if frag.initialised:
            raise Refused("duplicate_init", f"fragment {h.fragment} is already initialised")
        E = self.config.part_elems
        if h.part == 0:
            schema = check_schema(h.schema, self.config.max_fragment_bytes, f"INIT fragment {h.fragment}")
            layout = FragmentLayout.of([(n, s) for n, _d, s in schema])
        else:
            if h.schema:
                raise Refused("bad_schema", f"INIT part {h.part} carries a schema; only part 0 does")
            if frag.layout is None or h.part != frag.init_next_part:
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
        assert frag.value is not None
        lo, _hi = layout.part_range(h.part, E)
        frag.init_next_part += 1
        self.work.append(InitPart(h.fragment, h.part, lo, msg, frag.value))
        self._touch(rec, msg, now)

    def _on_init_copied(self, work: InitPart, result: Result, out: list[Out]) -> None:
        frag = self.fragments[work.fragment]
        if frag.value is not work.value or frag.initialised:
            return  # a restarted INIT stream replaced this buffer
        if result.error:
            self.refusals += 1
            log.warning("INIT part %d of fragment %d refused: %s; island 0 must stream INIT again",
                        work.part, work.fragment, result.error)
            frag.value = frag.momentum = None
            frag.init_next_part = frag.init_done_parts = 0
            out.append(Outgoing(self.islands[0].peer, Error(code="bad_init", reason=result.error)))
            return
        frag.init_done_parts += 1
        frag.value_absmax[work.part] = result.absmax[0]
        assert frag.layout is not None
        if frag.init_done_parts == frag.layout.n_parts(self.config.part_elems):
            frag.initialised = True
            self._size_pool()
            frag.version = 0
            log.info("fragment %d initialised by island 0: %d tensors, %.1f MiB", work.fragment, len(frag.schema),
                     frag.layout.numel * 4 / 2**20)

    def _size_pool(self) -> None:
        """Log the syncer's buffers by kind once every fragment's size is known (``book.FragmentBook``)."""
        if self.initialised:
            self.book.log_budget(self.fragments)

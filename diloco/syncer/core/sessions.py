"""Who may talk to the syncer: the islands table, their sessions, and the HELLO rules
(docs/PROTOCOL.md, "Handshake", "Sessions and replays").

:class:`Sessions` owns one table, the islands (one :class:`IslandRecord` each), and what binds
routing ids to them: the current peer of every island, the (island, generation) pairs of recent
HELLOs (a second one is a replay), the routing ids a new HELLO superseded, the islands whose
current session has *proven* itself (sent a message after HELLO), and the key bindings and HELLO
budgets (:class:`~diloco.syncer.core.gate.Gate`). The generation, instance, nonce and sequence
rules are :mod:`diloco.protocol.session`'s, the ones islands apply too.

A check raises :class:`~diloco.syncer.core.checks.Refused` (or ``Dropped``: nothing answered)
before anything changes; the ``accept_*`` / ``bind`` steps change the table only after every
check of a message passed. No I/O.
"""

from __future__ import annotations

import logging
import string

from diloco.protocol import session
from diloco.syncer.core.checks import Dropped, Refused
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Journal
from diloco.syncer.core.gate import Gate
from diloco.syncer.core.records import IslandRecord
from diloco.wire import MAX_DIGEST_CHARS, PROTOCOL_VERSION, PUSH_DTYPES, QUANT_KINDS, Hello, Opened

log = logging.getLogger("diloco.syncer.core")

MAX_FINGERPRINT_CHARS = 256
HELLOS_REMEMBERED = 256
"""(island, generation) pairs remembered per island id for replay detection (and retired generations
kept per island): fixed memory whatever the number of HELLOs."""


class Sessions:
    """The islands table and the sessions bound to it.

    Args:
        config: ``--islands``, ``--dead-after-s``, ``--quant-block``, ``--max-fragments``.
        journal: where a rate-limited HELLO is counted (it is refused without an answer).
    """

    def __init__(self, config: SyncerConfig, journal: Journal) -> None:
        self.config = config
        self.journal = journal
        self.islands = [IslandRecord(i) for i in range(config.islands)]
        self.peers: dict[bytes, int] = {}
        """Routing id -> island of every current binding (to stamp what we send)."""
        self.lanes: dict[bytes, int] = {}
        """Routing id -> island of every current lane (at most one per island: ``bind_lane``)."""
        self.hellos_seen: dict[tuple[int, int], None] = {}
        """(island, generation) of recent authenticated HELLOs, oldest first: a second one is a replay
        (at most :data:`HELLOS_REMEMBERED` per island)."""
        self.superseded: list[bytes] = []
        """Routing ids replaced by a new HELLO of their island: the loop drops their streams."""
        self.proven: set[int] = set()
        """Islands whose current session sent a message after HELLO (:meth:`ready`)."""
        self.gate = Gate(dict(config.island_keys) if config.island_keys else None)
        """Key bindings and HELLO budgets (``gate.py``)."""

    # ------------------------------------------------------------------ queries

    def island_of(self, peer: bytes) -> int | None:
        """The island bound to routing id ``peer``, as its first connection or its lane (None: none)."""
        island = self.peers.get(peer)
        return self.lanes.get(peer) if island is None else island

    def live(self) -> list[IslandRecord]:
        """Bound islands not declared dead."""
        return [i for i in self.islands if i.bound and i.alive]

    def ready(self) -> list[IslandRecord]:
        """Islands that may be members of a round: live, cut sent, not evicted, and *proven*: a HELLO
        alone is not membership; the island must have sent a message of its session since (a
        HEARTBEAT, INIT, PUSH or FINAL_ACK sealed with the WELCOME's nonce)."""
        return [i for i in self.live() if i.cut_sent and not i.evicted and i.island in self.proven]

    def stamp(self, peer: bytes) -> tuple[int, int]:
        """(nonce, seq) for the next message sealed for ``peer``; (0, 0) for a peer we do not bind."""
        island = self.peers.get(peer)
        if island is None:
            return 0, 0
        rec = self.islands[island]
        rec.send_seq += 1
        return rec.nonce, rec.send_seq

    def take_superseded(self) -> list[bytes]:
        """Routing ids superseded since last asked (their streams are to be dropped)."""
        out, self.superseded = self.superseded, []
        return out

    # ------------------------------------------------------------------ every message after HELLO

    def session(self, island: int, generation: int, peer: bytes, msg: Opened, lane_ok: bool = False) -> IslandRecord:
        """The island's record if ``msg`` belongs to its current connection (replay protection), or
        to its lane when ``lane_ok`` (INIT only: :meth:`bind_lane`).

        Raises Dropped (nothing answered) for another routing id, a wrong nonce or a sequence
        number that does not increase (each connection has its own); the sequence number advances
        when the message is accepted (:meth:`touch`)."""
        rec = self.bound_island(island, generation)
        lane = lane_ok and bool(rec.lane) and peer == rec.lane
        if peer != rec.peer and not lane:
            raise Dropped("wrong_peer", f"island {island} is bound to peer {rec.peer.hex()}, not {peer.hex()}")
        if session.foreign_nonce(msg.nonce, session.lane_nonce(rec.nonce) if lane else rec.nonce):
            raise Dropped("bad_nonce", f"nonce {msg.nonce:x} is not island {island}'s session nonce"
                                       f"{' of its lane' if lane else ''}")
        last = rec.lane_seq if lane else rec.recv_seq
        if session.replayed(msg.seq, last):
            raise Dropped("replayed_seq", f"sequence number {msg.seq} <= {last} (a replay)")
        rec.via_lane = lane
        return rec

    def reply_peer(self, peer: bytes) -> bytes:
        """Where an answer to a message from ``peer`` goes: a lane's island's first connection
        (nothing is sent on a lane), else ``peer`` itself."""
        island = self.lanes.get(peer)
        return self.islands[island].peer if island is not None else peer

    def bind_lane(self, peer: bytes, island: int, generation: int, msg: Opened, sender_key: str) -> IslandRecord:
        """Bind ``peer`` as the lane of ``island``'s current session (``Lane``; ``--init-lanes``).

        Refused unless the syncer takes lanes and ``island`` is island 0 (the only one that
        sends INIT); Dropped (nothing answered) unless the message carries the session's lane
        nonce (``protocol.session.lane_nonce``) and opens the lane's own sequence (seq 1), is the
        session's first LANE (a replayed one binds nothing), comes from a routing id no island is
        bound to, and (Curve) its key owns the island id. One lane per session, so the lanes
        table is bounded by ``--islands``; the caller answers ``LaneOk`` on the first connection."""
        if self.config.init_lanes < 1:
            raise Refused("no_lanes", "this syncer takes no second connection (--init-lanes 0)")
        if island != 0:
            raise Refused("lane_not_island0", f"LANE from island {island}; only island 0 sends INIT")
        rec = self.bound_island(island, generation)
        if peer == rec.peer or peer in self.peers:
            raise Dropped("lane_is_session", "a session's first connection cannot be a lane")
        if session.foreign_nonce(msg.nonce, session.lane_nonce(rec.nonce)):
            raise Dropped("bad_nonce", f"nonce {msg.nonce:x} is not the lane nonce of island {island}'s session")
        if msg.seq != 1:
            raise Dropped("bad_session", f"LANE opens its connection's sequence: seq must be 1, got {msg.seq}")
        if rec.lane:  # a lane binds once per session: a new HELLO unbinds it (``drop_lane``)
            raise Dropped("replayed_lane", f"island {island}'s session has bound its lane already")
        problem = self.gate.key_problem(island, sender_key)
        if problem:
            raise Dropped("key_not_owner", problem)
        if msg.metas:
            raise Refused("unexpected_tensors", "LANE carries no tensors")
        rec.lane, rec.lane_seq = peer, msg.seq
        self.lanes[peer] = island
        log.info("island %d: a second connection carries INIT (peer %s)", island, peer.hex())
        return rec

    def drop_lane(self, rec: IslandRecord) -> None:
        """Forget ``rec``'s lane (a new HELLO opens a session that may bind one again)."""
        if rec.lane:
            self.lanes.pop(rec.lane, None)
        rec.lane, rec.lane_seq = b"", 0

    def bound_island(self, island: int, generation: int) -> IslandRecord:
        """The record of ``island`` if it is bound under ``generation``; Refused otherwise."""
        if not 0 <= island < self.config.islands:
            raise Refused("unknown_island", f"island {island} outside [0, {self.config.islands})")
        rec = self.islands[island]
        if not rec.bound:
            raise Refused("not_bound", f"island {island} has not said HELLO")
        problem = session.generation_problem(generation, rec.generation, rec.retired_generations)
        if problem == "old_generation":
            raise Refused("old_generation", f"generation {generation} of island {island} was replaced")
        if problem:
            raise Refused("unknown_generation", f"generation {generation} is not island {island}'s current one")
        return rec

    def touch(self, rec: IslandRecord, msg: Opened, now: float) -> None:
        """An accepted message of the island's connection: alive, and its sequence number taken."""
        rec.last_seen = now
        if rec.via_lane:
            rec.lane_seq, rec.via_lane = msg.seq, False
        else:
            rec.recv_seq = msg.seq
        self.proven.add(rec.island)  # a HELLO alone is not membership (``ready``)
        if not rec.alive:
            rec.alive = True
            rec.recut()
            log.info("island %d is live again (generation %d)", rec.island, rec.generation)

    # ------------------------------------------------------------------ HELLO

    def check_hello(self, peer: bytes, h: Hello, msg: Opened, now: float, sender_key: str) -> None:
        """The HELLO's own rules, in order: protocol, island id, generation, rate, replay, session
        stamp, dtype, quantization, fragment count, fingerprint size, no tensors. A rate-limited
        HELLO is counted here and refused quietly (a flood costs neither sends nor log lines)."""
        cfg = self.config
        if h.protocol != PROTOCOL_VERSION:
            raise Refused("protocol", f"protocol {h.protocol}, syncer speaks {PROTOCOL_VERSION}")
        if not 0 <= h.island < cfg.islands:
            raise Refused("unknown_island", f"island {h.island} outside [0, {cfg.islands})")
        if h.generation < 0:
            raise Refused("bad_generation", f"generation {h.generation} < 0")
        if not self.gate.allow_hello(sender_key.encode() or peer, now):
            self.journal.refused("hello_rate")
            raise Refused("hello_rate", f"HELLOs from this sender faster than {self.gate.rate}/s", quiet=True)
        # A client says HELLO once per connection, under a fresh generation: a second HELLO of
        # one generation is a replay, and the replayer gets nothing (not even an ERROR).
        if (h.island, h.generation) in self.hellos_seen:
            raise Dropped("replayed_hello", f"HELLO of island {h.island} generation {h.generation} seen before")
        if not session.opens_session(msg.nonce, msg.seq):
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
        if h.holds and (len(h.holds) != h.n_fragments
                        or any(len(d) > MAX_DIGEST_CHARS or d.strip(string.hexdigits) for d in h.holds)):
            raise Refused("bad_holds", f"{len(h.holds)} claimed digests for {h.n_fragments} fragments, or one "
                                       f"that is not hex of at most {MAX_DIGEST_CHARS} chars")
        if msg.metas:
            raise Refused("unexpected_tensors", "HELLO carries no tensors")

    def check_owner(self, peer: bytes, h: Hello, now: float, sender_key: str) -> None:
        """Refuse a HELLO of another process while the island's binding is live (``island_in_use``)
        and one whose Curve key does not own the island id (``key_not_owner``)."""
        cfg = self.config
        rec = self.islands[h.island]
        # Another process, not a reconnect: another instance (islands send a random one per
        # process, kept across redials) while the binding was heard from within --dead-after-s.
        other = session.another_process(h.instance, peer, rec.instance, rec.peer)
        if (rec.bound and rec.alive and rec.generation != h.generation and other
                and now - rec.last_seen <= cfg.dead_after_s):
            raise Refused("island_in_use", f"island id {h.island} is bound to another live process (peer "
                                           f"{rec.peer.hex()}, heard {now - rec.last_seen:.1f}s ago, within "
                                           f"--dead-after-s={cfg.dead_after_s:.0f}s): two processes share one "
                                           f"YETO_DILOCO_ISLAND_ID?")
        problem = self.gate.key_problem(h.island, sender_key)
        if problem:
            raise Refused("key_not_owner", problem)

    def accept_hello(self, h: Hello, sender_key: str) -> None:
        """A HELLO passed every check: remember it (replays), unprove the island, bind its key."""
        self.hellos_seen[(h.island, h.generation)] = None
        while len(self.hellos_seen) > HELLOS_REMEMBERED * self.config.islands:
            del self.hellos_seen[next(iter(self.hellos_seen))]
        self.proven.discard(h.island)
        self.gate.bind(h.island, sender_key)

    def retire(self, h: Hello) -> bool:
        """Retire the island's current generation if ``h`` opens another; True when it did (a reconnect)."""
        rec = self.islands[h.island]
        if not (rec.bound and rec.generation != h.generation):
            return False
        rec.retired_generations.add(rec.generation)
        while len(rec.retired_generations) > HELLOS_REMEMBERED:
            rec.retired_generations.pop()
        log.info("island %d reconnected: generation %d replaces %d", h.island, h.generation, rec.generation)
        return True

    def bind(self, peer: bytes, h: Hello, now: float) -> IslandRecord:
        """Bind ``h``'s island to ``peer`` under a fresh session (nonce drawn, sequence numbers reset);
        a fresh generation readmits an evicted island; the old routing id is superseded."""
        rec = self.islands[h.island]
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
        rec.recut()
        rec.claims = tuple(h.holds)
        rec.last_seen = now
        if rec.peer and rec.peer != peer and self.peers.pop(rec.peer, None) is not None:
            # The old connection's cut and broadcasts are cancelled (at most one cut in flight per island).
            self.superseded.append(rec.peer)
        rec.peer = peer
        self.peers[peer] = h.island
        self.drop_lane(rec)  # a lane belongs to one session
        rec.nonce = session.draw_id()
        rec.recv_seq = rec.send_seq = 0
        return rec

    # ------------------------------------------------------------------ liveness and losses

    def declare_dead(self, now: float) -> None:
        """Islands silent for ``--dead-after-s`` are dead; a revived one is cut again."""
        for isl in self.live():
            if now - isl.last_seen > self.config.dead_after_s:
                isl.alive = False
                # A revived island must be re-cut: it may have missed broadcasts.
                isl.recut()
                log.warning("island %d silent for %.1fs: declared dead", isl.island, now - isl.last_seen)

    def unsent(self, peer: bytes, fragment: int, version: int) -> None:
        """The stream of ``fragment`` at ``version`` to ``peer`` was skipped (``IslandRecord.unsent``)."""
        i = self.island_of(peer)
        if i is not None:
            self.islands[i].unsent(fragment, version)

    def on_lost(self, peer: bytes, kind: str, fragment: int, cut: bool, now: float, n_fragments: int) -> None:
        """A message to ``peer`` could not be delivered: the island is owed that value stream
        (``kind`` BCAST / FINAL of ``fragment``; ``cut``: part of a cut) and a re-pull of its open
        rounds, once heard from again. Nothing for a routing id no island is bound to."""
        rec = next((i for i in self.islands if i.bound and i.peer == peer), None)
        if rec is None:
            return
        rec.lost_at = now
        rec.done_values = {}  # what else went to it is uncertain now: its final cut goes as bytes
        if kind in ("BCAST", "FINAL") and 0 <= fragment < n_fragments:
            rec.owed[fragment] = rec.owed.get(fragment, False) or cut
        rec.owe_pulls = True
        log.warning("island %d: a %s%s was lost on a send error; resent once the island is heard from",
                    rec.island, kind, f" of fragment {fragment}" if kind != "PULL" else "")

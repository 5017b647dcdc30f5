"""What a message from the syncer means: the receive rules of :class:`ClientProtocol`.

Methods of :class:`diloco.island.client_protocol.ClientProtocol` (the send rules are
``diloco.island.outbox``): every message is opened (MAC, header, declared sizes) and checked
against this connection's session before anything of it is used; BCAST and FINAL parts are
checked against the plan and assembled in order, straight into the island's anchors where
``receive_target`` offers them, else into one pooled buffer; pulls and broadcasts are
deduplicated for the boundary; ERROR codes decide between a refusal, a rejoin and a fatal
error. Any decode failure is a refusal counted in the stats, never an exception. No I/O:
frames and the time in, :class:`~diloco.island.client_protocol.Effects` out.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from diloco import quant, wire
from diloco.config import IslandConfig
from diloco.digest import FragmentDigest
from diloco.island.assembly import Assembly, ReceiveTarget
from diloco.island.effects import BACKOFF_START_S, Effects, chunk_parallel
from diloco.island.orders import PendingBcast
from diloco.protocol import refusals, session
from diloco.wire.schema import ITEMSIZE

if TYPE_CHECKING:
    from diloco.island.liveness import Liveness
    from diloco.island.outbox import ClientStats

log = logging.getLogger("diloco.island.client")

Tensors = list[tuple[str, torch.Tensor]]

_FATAL_CODES = refusals.FATAL
"""ERROR codes after which retrying cannot help: the island is misconfigured or too late."""
_REJOIN_CODES = refusals.REJOIN
"""ERROR codes meaning the syncer lost our binding (it restarted): say HELLO again."""
_IN_USE_RETRY_S = 1.0
"""A HELLO refused with ``island_in_use`` before we were ever welcomed is retried this often (the
previous process of this island id may just have died: its binding lapses after --dead-after-s);
``wait_welcome`` turns it into a fatal error at its timeout. Once welcomed, it is fatal at once."""


class Inbox:
    """Receive rules (methods of ``ClientProtocol``; the connection's thread)."""

    # Provided by ClientProtocol.
    _cfg: IslandConfig
    _layouts: list[wire.FragmentLayout]
    _n_fragments: int
    _guard: AbstractContextManager[object]
    stats: ClientStats
    pool: wire.HostBufferPool
    _welcome: wire.Welcome | None
    _part_elems: int
    _generation: int
    _syncer_id: int | None
    _pulls: dict[tuple[int, int], wire.Pull]
    _pulls_taken: dict[tuple[int, int], int]
    _bcasts: dict[int, PendingBcast]
    _accepted_version: list[int]
    _final: dict[int, tuple[wire.Final, Tensors]]
    _final_taken: set[int]
    _refetching: bool
    _shutdown: str | None
    _fatal: str | None
    _last_refusal: str | None
    _redial_delay: float
    _stale: list[tuple[int, int]]
    _final_ack: wire.FinalAck | None
    _bcast_digests: dict[int, tuple[int, str]]
    _done: bool
    _nonce: int
    _recv_seq: int
    _lane_ready: bool
    _feedback: quant.ErrorFeedback | None
    _claims: list[str]
    _init_held: tuple[bool, ...]
    _init_done: set[int]
    _init_lost: set[int]
    _assembling: dict[tuple[str, int], Assembly]
    _last_heard: float
    _backoff: float
    receive_target: ReceiveTarget | None
    liveness: Liveness

    def handle(self, frames: list[Any], now: float) -> Effects:
        """One message from the syncer (its frames: zmq frames or bytes-like), received at
        ``now``; what the connection must do about it.

        Any message counts as hearing from the syncer; one carrying tensors (a BCAST or FINAL
        part) moves the progress clocks. Counted in the stats once handled, so a reader that
        sees the counter move also sees its effect."""
        self._last_heard = now
        sizes = [_nbytes(f) for f in frames]
        if len(frames) > 2:  # only BCAST / FINAL parts carry tensors
            self.liveness.on_value_part(sum(sizes[2:]), now)
        out = Effects()
        try:
            self._handle(frames, now, out)
        finally:
            total, data = sum(sizes), sum(sizes[2:])
            self.stats.messages_recv += 1
            self.stats.bytes_recv += total
            self.stats.data_bytes_recv += data
            self.stats.control_bytes_recv += total - data
        if out.redial_s is None:
            self._backoff = BACKOFF_START_S
        return out

    def _refuse(self, what: str) -> None:
        self.stats.refused += 1
        log.warning("island %d: refused %s", self._cfg.island_id, what)

    def _check_session(self, opened: wire.Opened) -> str | None:
        """Why a message does not belong to this connection (None if it does); see docs/SECURITY.md.

        Before WELCOME only the WELCOME answering our HELLO (it echoes our generation and opens
        the session) and ERRORs to an unbound peer (nonce 0) are taken; after it, every message
        carries the session nonce and a strictly increasing sequence number, except an ERROR of a
        restarted syncer that no longer knows us (nonce 0, a rejoin code: we say HELLO again)."""
        h = opened.header
        if isinstance(h, wire.Welcome):
            if not session.welcome_answers(h.generation, h.nonce, opened.nonce, self._generation, self._nonce):
                return f"a WELCOME of another connection (generation {h.generation:x}, session {self._nonce:x})"
        elif opened.nonce == 0 and isinstance(h, wire.Error) and (not self._nonce or h.code in _REJOIN_CODES):
            return None
        elif session.foreign_nonce(opened.nonce, self._nonce):
            return f"{wire.kind_of(h)} with nonce {opened.nonce:x}, not this connection's {self._nonce:x}"
        elif session.replayed(opened.seq, self._recv_seq):
            return f"{wire.kind_of(h)} with sequence number {opened.seq} <= {self._recv_seq} (a replay)"
        self._recv_seq = opened.seq
        return None

    def _handle(self, frames: list[Any], now: float, out: Effects) -> None:
        try:
            opened = wire.open_message(frames, key=self._cfg.key)
        except wire.WireError as exc:
            return self._refuse(f"a message from the syncer: {exc.reason}")
        except Exception as exc:  # noqa: BLE001 - a decoder gap is a refusal, never a dead connection
            return self._refuse(f"an undecodable message from the syncer: {type(exc).__name__}: {exc}")
        problem = self._check_session(opened)
        if problem:
            return self._refuse(problem)
        h = opened.header
        digest = ""
        if isinstance(h, wire.Final) and h.held:
            if opened.metas or h.part != 0 or h.n_parts != 0:
                return self._refuse(f"a held FINAL of fragment {h.fragment} carrying parts")
            arrival, tensors = 0, []
        elif isinstance(h, (wire.Bcast, wire.Final)):
            try:
                got = self._assemble(h, opened)
            except Exception as exc:  # noqa: BLE001 - WireError, or a decoder gap: refuse the part
                self._assembling.pop((wire.kind_of(h), h.fragment), None)
                reason = exc.reason if isinstance(exc, wire.WireError) else f"{type(exc).__name__}: {exc}"
                return self._refuse(f"{wire.kind_of(h)} part {h.part} of fragment {h.fragment}: {reason}")
            if got is None:
                return None
            h, tensors, arrival, digest = got
        else:
            arrival = 0
            if opened.metas:
                self.stats.refused += 1
                log.warning("island %d: refused %s carrying tensors", self._cfg.island_id, wire.kind_of(h))
                return None
            tensors = []
        with self._guard:
            self._deliver(h, tensors, arrival, now, out, digest)
        return None

    def _deliver(self, h: wire.Header, tensors: Tensors, arrival: int, now: float, out: Effects,
                 digest: str = "") -> None:
        """A whole message of this session: its effect on the parked tables (inside the guard);
        ``digest``: of a BCAST hashed as it arrived (``""``: not hashed)."""
        if isinstance(h, wire.Welcome):
            self._on_welcome(h, out)
            return
        if isinstance(h, wire.Progress):
            self._on_progress(h, now)  # diloco.island.liveness: what a waiting island counts as moving
            return
        if isinstance(h, wire.Heartbeat):
            self.liveness.on_heartbeat_reply(now)
            if self._syncer_id is not None and h.syncer_id != self._syncer_id:
                log.warning("island %d: the syncer restarted (id %x -> %x), rejoining", self._cfg.island_id,
                            self._syncer_id, h.syncer_id)
                out.redial_s = self._take_redial_delay()
            return
        if isinstance(h, wire.Pull):
            self._on_pull(h)
        elif isinstance(h, wire.Bcast):
            self._on_bcast(h, tensors, arrival, now, digest)
        elif isinstance(h, wire.Held):
            self._on_held(h)
        elif isinstance(h, wire.LaneOk):
            self._lane_ready = h.generation == self._generation  # INIT may use the lane now
        elif isinstance(h, wire.Final):
            if h.held:
                self._on_final_held(h)
            elif self._final_ack is None:  # a FINAL resent after we acknowledged changes nothing
                self._final[h.fragment] = (h, tensors)
        elif isinstance(h, wire.Shutdown):
            log.info("island %d: SHUTDOWN from the syncer: %s", self._cfg.island_id, h.reason)
            self._shutdown = h.reason or "shutdown"
        elif isinstance(h, wire.Error):
            if h.code in _REJOIN_CODES:
                # The syncer does not know our generation (it restarted, or dropped us), or parts
                # of our INIT were lost: a new session, whose WELCOME says where INIT stands.
                why = "parts of our INIT were lost" if h.code == "init_gap" else "the syncer does not know us"
                log.warning("island %d: %s ([%s] %s), rejoining", self._cfg.island_id, why, h.code, h.reason)
                out.redial_s = self._take_redial_delay()
                return
            log.error("island %d: the syncer refused a message: [%s] %s", self._cfg.island_id, h.code, h.reason)
            if h.code == "island_in_use":
                self._last_refusal = f"[{h.code}] {h.reason}"
                if self._syncer_id is None:
                    self._redial_delay = _IN_USE_RETRY_S  # the old process may just have died
                    out.redial_s = self._take_redial_delay()
                    return
                self._fatal = f"syncer refused island {self._cfg.island_id}: [{h.code}] {h.reason}"
            elif h.code == "stale_base" and 0 <= h.fragment < self._n_fragments:
                # The syncer sends the fragment's current value, then this PULL again: answer it.
                self._pulls_taken.pop((h.fragment, h.round), None)
                self._stale.append((h.fragment, h.round))
            if h.code in _FATAL_CODES:
                self._fatal = f"syncer refused island {self._cfg.island_id}: [{h.code}] {h.reason}"
        else:
            log.warning("island %d: unexpected %s from the syncer ignored", self._cfg.island_id, type(h).__name__)
        out.wake = True

    def _take_redial_delay(self) -> float:
        """How long to wait before the redial a message asked for (then 0 again)."""
        delay, self._redial_delay = self._redial_delay, 0.0
        return delay

    def _on_progress(self, h: wire.Progress, now: float) -> None:
        """A PROGRESS notice: counted by the progress clocks, refused if malformed."""
        problem = self.liveness.on_progress(h, now)
        if problem:
            self.stats.refused += 1
            log.warning("island %d: refused %s", self._cfg.island_id, problem)

    def _assemble(self, h: wire.Bcast | wire.Final,
                  opened: wire.Opened) -> tuple[wire.Bcast | wire.Final, Tensors, int, str] | None:
        """Place one BCAST/FINAL part; the whole fragment once its last part is in (else None),
        with its digest when it was hashed as it landed (``""`` otherwise).

        Parts of one stream arrive in order on our connection; a part 0 of a newer
        version replaces an unfinished older one (the newer value supersedes it)."""
        if not 0 <= h.fragment < self._n_fragments or h.version < 0:
            raise wire.WireError(f"fragment {h.fragment} / version {h.version} outside the plan")
        kind = wire.kind_of(h)
        dtype = "float32" if isinstance(h, wire.Final) else wire.bcast_dtype(self._cfg.wire_dtype)
        layout = self._layouts[h.fragment]
        problem = layout.check_part(opened.metas, h.part, h.n_parts, self._part_elems, dtype)
        if problem:
            raise wire.WireError(problem)
        key = (kind, h.fragment)
        asm = self._assembling.get(key)
        if h.part == 0:
            asm = self._assembling[key] = self._begin_value(h, layout, dtype, key)
        elif asm is None or asm.next_part != h.part or asm.header.version != h.version:
            raise wire.WireError(f"part {h.part} of version {h.version} out of order")
        if asm.views is not None:
            lo, hi = layout.part_range(h.part, self._part_elems)
            dests = [asm.views[i][a:b] for i, a, b in layout.segments(lo, hi)]  # check_part: same segments
            opened.copy_into(dests, parallel=chunk_parallel(h, self._done))
            if asm.digest is not None:
                for piece in dests:  # stream order, while the part is still in cache
                    asm.digest.update(piece)
        asm.next_part += 1
        if asm.next_part < h.n_parts:
            return None
        del self._assembling[key]
        if asm.views is None:
            return None  # a resent FINAL of a fragment already in: nothing to deliver
        return (asm.header, [(n, v.view(shape)) for n, v, shape in zip(layout.names, asm.views, layout.shapes)],
                asm.arrival, asm.digest.hexdigest() if asm.digest is not None else "")

    def _begin_value(self, h: wire.Bcast | wire.Final, layout: wire.FragmentLayout, dtype: str,
                     key: tuple[str, int]) -> Assembly:
        """Where a value beginning to arrive lands: nowhere (a FINAL of a fragment whose final value
        is already in, or after we acknowledged the final cut), straight into the anchors (the
        fragment is quiet: ``receive_target``), else one pooled buffer.

        Two streams never write one buffer: a value lands in the anchors only when no other
        stream of its fragment is arriving, no final value of it is in, and the fragment is quiet
        (no value of it outstanding). A final value that landed in the anchors leaves its fragment
        busy, so nothing later writes them before its digest is taken and it is installed; a
        resent FINAL is dropped part by part. The final cut therefore costs no buffer of its own
        when its fragments are quiet, and at most one pooled fragment each otherwise."""
        if isinstance(h, wire.Final) and (h.fragment in self._final or self._final_ack is not None):
            return Assembly(h, None)
        busy = any(k[1] == h.fragment and k != key for k in self._assembling) or h.fragment in self._final
        views, arrival = (None, 0) if self.receive_target is None else self.receive_target(h.fragment, dtype, busy)
        if views is None:
            flat = self.pool.empty((layout.numel,), wire.WIRE_DTYPES[dtype])
            views = [flat[s : s + n] for s, n in zip(layout.starts, layout.sizes())]
        # After our done, an fp32 BCAST may become our final value (a held FINAL): hash it as it lands.
        hashed = isinstance(h, wire.Bcast) and dtype == "float32" and self._done
        return Assembly(h, views, arrival, digest=FragmentDigest(layout.names, layout.shapes) if hashed else None)

    def _on_welcome(self, h: wire.Welcome, out: Effects) -> None:
        problem = wire.check_part_elems(h.part_elems)
        if len(h.initialised) not in (0, self._n_fragments):
            problem = f"initialised of {len(h.initialised)} fragments"
        if h.protocol != wire.PROTOCOL_VERSION or len(h.versions) != self._n_fragments or problem:
            self._fatal = (f"syncer speaks protocol {h.protocol} with {len(h.versions)} fragments "
                           f"({problem or 'parts ok'}), we speak {wire.PROTOCOL_VERSION} with {self._n_fragments}")
        else:
            if self._syncer_id is not None and h.syncer_id != self._syncer_id:
                # A restarted syncer may have resumed an older checkpoint: its versions are
                # the truth now, so the version floor restarts and its cut is installed.
                log.warning("island %d: joined a new syncer instance; accepting its cut", self._cfg.island_id)
                self._accepted_version = [-1] * self._n_fragments
                self._bcasts.clear()
                self._bcast_digests.clear()
                for f in [g for g in self._final if g not in self._final_taken]:
                    del self._final[f]  # the old instance's final values: the new one sends its own
                if self._feedback is not None:
                    self._feedback.reset_all()
            if self._final_ack is not None and h.syncer_id == self._syncer_id:
                # A redial after we acknowledged the final cut: the syncer forgot the ack.
                out.send.append(self._final_ack)
            self._syncer_id = h.syncer_id
            self._init_held = tuple(h.initialised) or (False,) * self._n_fragments
            if h.need_init:
                # Sent whole on an older connection, yet not held: lost with it (a reset drops
                # what TCP held). The training thread streams them again; the rest resumes.
                lost = {f for f in self._init_done if not self._init_held[f]}
                self._init_lost |= lost
                self._init_done -= lost
            else:
                self._init_done.clear()
            self._part_elems = h.part_elems
            self._nonce = h.nonce
            self._welcome = h
            self._last_refusal = None
            self._refetching = False
        out.wake = True

    def _on_pull(self, h: wire.Pull) -> None:
        if not 0 <= h.fragment < self._n_fragments or h.round < 1 or h.attempt < 0:
            log.warning("island %d: malformed PULL %s ignored", self._cfg.island_id, h)
            return
        key = (h.fragment, h.round)
        taken = self._pulls_taken.get(key, -1)
        if h.attempt <= taken:
            return  # a resent copy of a pull we already answered
        queued = self._pulls.get(key)
        if queued is None or h.attempt > queued.attempt:
            self._pulls[key] = h
        # Forget answered pulls of rounds long gone, keeping the table small.
        if len(self._pulls_taken) > 4 * self._n_fragments + 16:
            for k in sorted(self._pulls_taken, key=lambda k: k[1])[: len(self._pulls_taken) // 2]:
                del self._pulls_taken[k]

    def _on_bcast(self, h: wire.Bcast, tensors: Tensors, arrival: int = 0, now: float = 0.0,
                  digest: str = "") -> None:
        if self._final or self._final_ack is not None:
            return  # nothing is applied after (or during) the final cut: it is the syncer's exactly
        floor = self._accepted_version[h.fragment]
        if h.version <= floor:
            if h.version == floor and digest:  # one syncer instance: the same version is the same bytes
                self._bcast_digests[h.fragment] = (h.version, digest)
            return  # an identical replay or an older value
        self._accepted_version[h.fragment] = h.version
        if digest:
            self._bcast_digests[h.fragment] = (h.version, digest)
        else:
            self._bcast_digests.pop(h.fragment, None)
        if self._claims:
            self._claims[h.fragment] = ""  # its value is being replaced: a later HELLO claims nothing of it
        if h.cut and self._feedback is not None:
            self._feedback.reset(h.fragment)  # a cut is not derived from our pushes: drop the residual
        nbytes = self._layouts[h.fragment].numel * ITEMSIZE[wire.bcast_dtype(self._cfg.wire_dtype)]
        self._bcasts[h.fragment] = PendingBcast(h.fragment, h.version, h.round, h.cut, tensors, arrival,
                                                 h.commit_us, arrived=now, wire_nbytes=nbytes)

    def _on_held(self, h: wire.Held) -> None:
        """A HELD notice: our claimed value of the fragment is the syncer's at ``version``; parked
        as a cut without bytes. Only for a fragment we still claim (start-up); ignored otherwise."""
        if not 0 <= h.fragment < self._n_fragments or h.version < 0 or h.round < 0:
            self.stats.refused += 1
            log.warning("island %d: refused a malformed HELD %s", self._cfg.island_id, h)
            return
        if not self._claims or not self._claims[h.fragment]:
            log.warning("island %d: HELD for fragment %d which we do not claim: ignored (it comes with a later "
                        "cut)", self._cfg.island_id, h.fragment)
            return
        if self._final or self._final_ack is not None or h.version <= self._accepted_version[h.fragment]:
            return
        self._accepted_version[h.fragment] = h.version
        self._bcast_digests.pop(h.fragment, None)
        if self._feedback is not None:
            self._feedback.reset(h.fragment)  # a cut: no residual of ours belongs to it
        self._bcasts[h.fragment] = PendingBcast(h.fragment, h.version, h.round, True, [], held=True)


    def _on_final_held(self, h: wire.Final) -> None:
        """A held FINAL: the final value of ``h.fragment`` is the fp32 BCAST of ``h.version`` the
        syncer streamed to us. Parked in the final cut with that BCAST's tensors when it is parked
        unapplied; else parked without tensors, and the training thread installs it from the
        anchors it was staged into, or asks for the bytes (``refetch_final``).

        The syncer sends a notice behind every value it streams to us, so a BCAST of the fragment
        still assembling here is dead (parts of it were lost): dropped. Ignored while we wait
        for a new session's bytes (``refetch_final``): notices of the old one are stale."""
        if not 0 <= h.fragment < self._n_fragments or h.version < 0 or len(h.versions) != self._n_fragments:
            self.stats.refused += 1
            log.warning("island %d: refused a malformed held FINAL %s", self._cfg.island_id, h)
            return
        if self._final_ack is not None or h.fragment in self._final or self._refetching:
            return  # a resend, or a notice of the session we left: changes nothing
        if self._assembling.pop(("BCAST", h.fragment), None) is not None:
            log.warning("island %d: a BCAST of fragment %d stopped arriving before the held FINAL that "
                        "follows it: dropped", self._cfg.island_id, h.fragment)
        parked = self._bcasts.get(h.fragment)
        if parked is not None and parked.version == h.version and parked.tensors and not parked.held \
                and wire.bcast_dtype(self._cfg.wire_dtype) == "float32":
            del self._bcasts[h.fragment]
            self._final[h.fragment] = (h, parked.tensors)
        else:
            self._final[h.fragment] = (h, [])


def _nbytes(frame: Any) -> int:
    """Bytes of one frame (a zmq frame or anything bytes-like)."""
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).nbytes

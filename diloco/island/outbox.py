"""What the island sends and how: the send rules of :class:`ClientProtocol` (no I/O).

Methods of :class:`diloco.island.client_protocol.ClientProtocol`: control messages
(HEARTBEAT, FINAL_ACK, zero-weight PUSH) go out at once; INIT and PUSH streams are cut into
parts of the syncer's size (:meth:`Outbox.stream_of`), which the connection paces
(``diloco.wire.pacing``: at most ``WINDOW`` parts of ours in zmq's queue, so a heartbeat never
waits behind a whole fragment); every message is sealed with the connection's session nonce
and the next sequence number at the moment it is handed to the socket, and stamped with the
current generation. Low-bit pushes are quantized part by part with error feedback
(``diloco.quant``); a push computed part by part (``DeltaSource``) lands in a ring of
``WINDOW`` part buffers. After a redial INIT *resumes* where the syncer stands: INIT streams are
parked until the new WELCOME, which says which fragments the syncer holds complete; those are let
go of, the others restart from part 0 (:meth:`Outbox.resume_streams`), and fragments sent whole
on an old connection that the syncer does not hold are handed back to the training thread to
stream again (:meth:`Outbox.take_init_lost`). Pushes are abandoned (the syncer pulls again):
:meth:`Outbox.streams_after_redial`.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from diloco import quant, wire
from diloco.config import IslandConfig
from diloco.protocol import session
from diloco.island.delta_source import DeltaSource, PartRing
from diloco.island.effects import CHUNK_PARALLEL, chunk_parallel
from diloco.wire.pacing import Stream

if TYPE_CHECKING:
    from diloco.island.liveness import Liveness

log = logging.getLogger("diloco.island.client")

Tensors = list[tuple[str, torch.Tensor]]

WINDOW = 2
"""Parts of our streams that zmq may hold at once (see ``diloco.wire.pacing``)."""


@dataclass
class ClientStats:
    """Byte and message counters, read by the step log (monotonic; the reader diffs them).

    ``data_*`` count tensor payload bytes (INIT/PUSH sent, BCAST/FINAL received);
    ``control_*`` everything else (MACs, headers, heartbeats); ``bytes_*`` are the sums.
    ``push_bytes_sent`` is the payload of PUSH parts only, in the wire dtype."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    data_bytes_sent: int = 0
    data_bytes_recv: int = 0
    control_bytes_sent: int = 0
    control_bytes_recv: int = 0
    push_bytes_sent: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    pushes_dropped: int = 0
    redials: int = 0
    refused: int = 0


@dataclass
class Outgoing:
    """A control message, or (``tensors`` given) a fragment stream to cut into parts."""

    header: wire.Header
    tensors: Tensors | DeltaSource = field(default_factory=list)
    wire_dtype: str | None = None
    sent: threading.Event | None = None
    stream: Stream | None = None
    lane: bool = False
    """The stream goes on the session's second connection (``wire.Lane``: INIT only)."""


class Outbox:
    """Send rules (methods of ``ClientProtocol``; the connection's thread unless said)."""

    # Provided by ClientProtocol.
    _cfg: IslandConfig
    _layouts: list[wire.FragmentLayout]
    _guard: AbstractContextManager[object]
    _part_elems: int
    _generation: int
    _step: int
    _done: bool
    _seed: int
    _nonce: int
    _send_seq: int
    _lane_seq: int
    _feedback: quant.ErrorFeedback | None
    _init_held: tuple[bool, ...]
    _init_done: set[int]
    _init_lost: set[int]
    ring: PartRing
    stats: ClientStats
    liveness: Liveness

    if TYPE_CHECKING:
        @property
        def generation(self) -> int: ...

    def heartbeat(self) -> wire.Heartbeat:
        """A HEARTBEAT of the current connection: our step and what our link measured (any thread)."""
        with self._guard:
            return wire.Heartbeat(island=self._cfg.island_id, generation=self._generation, step=self._step,
                                  done=self._done, **self.liveness.report())

    def streams_after_redial(self, streams: list[Outgoing]) -> list[Outgoing]:
        """The streams a new connection may send again: INIT streams survive a redial, parked
        (``stream`` None) until the new WELCOME says whether the syncer holds them
        (:meth:`resume_streams`); pushes do not (the syncer pulls again once it knows our new
        generation): they are let go of, their ``sent`` events set."""
        keep = []
        for out in streams:
            if isinstance(out.header, wire.Init):
                out.stream, out.lane = None, False  # a lane ends with its session
                keep.append(out)
            else:
                _release(out)
        return keep

    def resume_streams(self, streams: list[Outgoing]) -> list[Outgoing]:
        """Once WELCOME came: the parked INIT streams of ``streams`` whose fragment the syncer
        holds complete are let go of (``sent`` set, nothing sent twice); the others restart
        from part 0 (their parts cut anew). Returns the streams to hand to the pacer."""
        restart = []
        for out in streams:
            if out.stream is not None or not isinstance(out.header, wire.Init):
                continue
            f = out.header.fragment
            if f < len(self._init_held) and self._init_held[f]:
                log.info("island %d: the syncer holds INIT fragment %d already: not sent again",
                         self._cfg.island_id, f)
                _release(out)
            else:
                out.stream = self.stream_of(out)
                restart.append(out)
        return restart

    def init_sent(self, fragment: int) -> None:
        """Connection thread: every part of INIT ``fragment`` was handed to the socket (a redial
        before the syncer holds it makes it lost: :meth:`take_init_lost`)."""
        with self._guard:
            self._init_done.add(fragment)

    def take_init_lost(self) -> list[int]:
        """INIT fragments sent whole on an older connection that the syncer does not hold (its
        WELCOME said so): the training thread streams them again. Empty afterwards."""
        with self._guard:
            lost, self._init_lost = sorted(self._init_lost), set()
            return lost

    def stream_of(self, out: Outgoing) -> Stream:
        """Cut a queued INIT/PUSH into parts; each part's header carries the current generation, and
        each is sealed for the connection the stream goes on (``out.lane``: the lane's sequence)."""
        lane = out.lane
        layout = self._layouts[out.header.fragment]  # type: ignore[union-attr]
        E = self._part_elems
        n = layout.n_parts(E)
        schema = tuple(zip(layout.names, layout.shapes))
        made: list = [-1, None, None]
        """The last part whose payload was made, that payload, and the ring buffer its frames
        view (None: none): a part the socket refused (``zmq.Again``) is asked for again and must
        not be made twice (a second ring buffer taken while the first is still in flight, a
        quantization residual carried twice)."""

        def frames_of(k: int) -> list:
            if isinstance(out.header, wire.Init):
                header: wire.Header = msgspec.structs.replace(
                    out.header, generation=self.generation, part=k, n_parts=n, schema=schema if k == 0 else ())
            else:
                header = msgspec.structs.replace(out.header, generation=self.generation, part=k, n_parts=n)
            if made[0] == k:
                return self.seal(header, made[1], lane)  # sealed anew: the next sequence number
            buf = None
            if isinstance(out.header, wire.Push) and self._feedback is not None:
                payload = self._quantized_part(out.header.fragment, layout, out.tensors, k)  # frames never view the ring
            else:
                segs, buf = _part_of(out.tensors, layout, k, E, self.ring)
                payload = wire.encode_payload(segs, wire_dtype=out.wire_dtype, seed=self._seed,
                                               parallel=chunk_parallel(out.header, self._done))
            if isinstance(out.header, wire.Push):
                self.stats.push_bytes_sent += payload.nbytes
            made[0], made[1], made[2] = k, payload, buf
            return self.seal(header, payload, lane)

        def handed(k: int, tracker: object) -> None:
            if made[0] == k and made[2] is not None:
                self.ring.hold(made[2], tracker)  # not handed out again until zmq released this part

        return Stream(n, frames_of, f"{wire.kind_of(out.header)} f{out.header.fragment}",  # type: ignore[union-attr]
                      on_handed=handed)

    def seal(self, header: wire.Header, payload: wire.Payload = wire.EMPTY_PAYLOAD, lane: bool = False) -> list:
        """Frames of one message of this connection (``lane``: of its lane): the session's nonce (the
        lane's: ``session.lane_nonce``) and that connection's next sequence number, taken at send
        time (the connection seals each message just before the socket gets it)."""
        if lane:
            self._lane_seq += 1
            seq, nonce = self._lane_seq, session.lane_nonce(self._nonce)
        else:
            self._send_seq += 1
            seq, nonce = self._send_seq, self._nonce
        return wire.seal(header, payload, key=self._cfg.key, nonce=nonce, seq=seq)

    def lane_open(self) -> list:
        """Frames of the ``Lane`` message that binds a second connection to this session (its
        sequence starts at 1); only after WELCOME, and only when it offered lanes. INIT goes on the
        lane only once the syncer's ``LaneOk`` says it is bound (``ClientProtocol.lane_ready``)."""
        with self._guard:
            gen = self._generation
        self._lane_seq = 0
        return self.seal(wire.Lane(island=self._cfg.island_id, generation=gen), lane=True)

    def _quantized_part(self, fragment: int, layout: wire.FragmentLayout, tensors: Tensors | DeltaSource,
                        k: int) -> wire.Payload:
        """Part ``k`` of a push as block-quantized codes + bf16 scales, with error feedback: the
        rounding of this part is carried into the fragment's next push (``diloco.quant``)."""
        assert self._feedback is not None
        lo, hi = layout.part_range(k, self._part_elems)
        if isinstance(tensors, DeltaSource):  # computed into one ring buffer: already contiguous
            buf = self.ring.take(self._part_elems)
            tensors.slice_part(layout, k, self._part_elems, out=buf)
            flat = buf[: hi - lo]
        else:
            segs = [t for _n, t in layout.slice_part(tensors, k, self._part_elems)]
            flat = segs[0] if len(segs) == 1 else torch.cat(segs)  # one copy only when a part spans tensors
        codes, scales = self._feedback.encode(fragment, flat.float().contiguous(), lo, layout.numel)
        return wire.encode_payload([("codes", codes), ("scales", scales)], seed=self._seed, parallel=CHUNK_PARALLEL)

    def count_sent(self, data: int, control: int, now: float) -> None:
        """Bytes handed to the socket at ``now``: payload (``data``) and the rest."""
        self.liveness.on_sent(data, now)
        self.stats.data_bytes_sent += data
        self.stats.control_bytes_sent += control
        self.stats.bytes_sent += data + control

    def restamp(self, header: wire.Header) -> wire.Header:
        """Stamp the current generation on an island message at send time.

        HELLO goes first on every new socket and a DEALER connection keeps order, so the
        syncer has bound the new generation before it sees anything stamped with it.
        """
        with self._guard:
            gen = self._generation
            if isinstance(header, wire.Heartbeat):
                return wire.Heartbeat(island=self._cfg.island_id, generation=gen, step=self._step, done=self._done,
                                      **self.liveness.report())
        if isinstance(header, (wire.Init, wire.Push, wire.FinalAck)):
            return msgspec.structs.replace(header, generation=gen)
        return header


def _release(out: Outgoing) -> None:
    """Let go of a stream that will not be sent (again): its tensors, and its ``sent`` event set."""
    out.stream, out.tensors = None, []
    if out.sent is not None:
        out.sent.set()


def _part_of(tensors: Tensors | DeltaSource, layout: wire.FragmentLayout, k: int, part_elems: int,
             ring: PartRing) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor | None]:
    """Part ``k``'s segments: views of materialised tensors, or computed now by a DeltaSource
    into a free buffer of ``ring`` (consecutive views of it); and that buffer (None: none)."""
    if isinstance(tensors, DeltaSource):
        buf = ring.take(part_elems)
        return tensors.slice_part(layout, k, part_elems, out=buf), buf
    return layout.slice_part(tensors, k, part_elems), None

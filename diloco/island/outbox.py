"""The send side of the island's connection to the syncer (methods of ``SyncClient``; I/O thread).

What the client sends and how: control messages (HEARTBEAT, FINAL_ACK, zero-weight PUSH) go
out at once; INIT and PUSH streams are cut into parts of the syncer's size and paced
(``diloco.wire.pacing``: at most ``WINDOW`` parts of ours in zmq's queue, so a heartbeat never
waits behind a whole fragment); every message is sealed with the connection's session nonce
and the next sequence number at the moment zmq gets it, and stamped with the current
generation. Low-bit pushes are quantized part by part with error feedback (``diloco.quant``);
a push computed part by part (``DeltaSource``) lands in a ring of ``WINDOW`` part buffers.
After a redial INIT streams restart from part 0; pushes are abandoned (the syncer pulls again).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq

from diloco import quant, wire
from diloco.config import IslandConfig
from diloco.island.delta_source import DeltaSource, PartRing
from diloco.wire.pacing import Pacer, Stream

if TYPE_CHECKING:
    from diloco.island.liveness import Liveness

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


class Outbox:
    """Send rules of the sync client (methods of ``SyncClient``; I/O thread unless said)."""

    # Provided by SyncClient.
    _cfg: IslandConfig
    _layouts: list[wire.FragmentLayout]
    _lock: threading.Lock
    _outbox: queue.Queue[Outgoing]
    _control: queue.SimpleQueue[Outgoing]
    _streams: list[Outgoing]
    _welcome: wire.Welcome | None
    _part_elems: int
    _generation: int
    _step: int
    _done: bool
    _final_ack: wire.FinalAck | None
    _seed: int
    _nonce: int
    _send_seq: int
    _feedback: quant.ErrorFeedback | None
    ring: PartRing
    stats: ClientStats
    liveness: Liveness

    @property
    def generation(self) -> int:
        """The generation of the current connection (thread-safe)."""
        with self._lock:
            return self._generation

    def _enqueue_heartbeat(self) -> None:
        with self._lock:
            hb = wire.Heartbeat(island=self._cfg.island_id, generation=self._generation, step=self._step,
                                done=self._done, **self.liveness.report())
        self._control.put(Outgoing(hb))

    def _resend_final_ack(self) -> None:
        """Queue our FINAL_ACK again (a redial after we acknowledged: the syncer forgot it)."""
        assert self._final_ack is not None
        self._control.put(Outgoing(self._final_ack))

    def _new_pacer(self, sock: zmq.Socket) -> Pacer:
        def send(_dest: bytes, frames: list, track: bool) -> object:
            return sock.send_multipart(frames, copy=False, track=track, flags=zmq.NOBLOCK)

        pacer = Pacer(WINDOW, send)
        # INIT streams survive a redial (restarted from part 0); pushes do not: the syncer
        # pulls again once it knows our new generation.
        keep = []
        for out in self._streams:
            if isinstance(out.header, wire.Init) and out.stream is not None:
                out.stream = self._make_stream(out)
                pacer.add(b"", out.stream)
                keep.append(out)
            else:
                out.stream, out.tensors = None, []
                if out.sent is not None:
                    out.sent.set()
        self._streams = keep
        return pacer

    def _make_stream(self, out: Outgoing) -> Stream:
        """Cut a queued INIT/PUSH into parts; each part's header carries the current generation."""
        layout = self._layouts[out.header.fragment]  # type: ignore[union-attr]
        E = self._part_elems
        n = layout.n_parts(E)
        schema = tuple(zip(layout.names, layout.shapes))

        def frames_of(k: int) -> list:
            if isinstance(out.header, wire.Init):
                header: wire.Header = msgspec.structs.replace(
                    out.header, generation=self.generation, part=k, n_parts=n, schema=schema if k == 0 else ())
            else:
                header = msgspec.structs.replace(out.header, generation=self.generation, part=k, n_parts=n)
            if isinstance(out.header, wire.Push) and self._feedback is not None:
                payload = self._quantized_part(out.header.fragment, layout, out.tensors, k)
            else:
                payload = wire.encode_payload(_part_of(out.tensors, layout, k, E, self.ring), wire_dtype=out.wire_dtype,
                                              seed=self._seed)
            if isinstance(out.header, wire.Push):
                self.stats.push_bytes_sent += payload.nbytes
            return self._seal(header, payload)

        return Stream(n, frames_of, f"{wire.kind_of(out.header)} f{out.header.fragment}")  # type: ignore[union-attr]

    def _seal(self, header: wire.Header, payload: wire.Payload = wire.EMPTY_PAYLOAD) -> list:
        """Frames of one message of this connection: session nonce and the next sequence number,
        taken at send time (the I/O thread seals each message just before zmq gets it)."""
        self._send_seq += 1
        return wire.seal(header, payload, key=self._cfg.key, nonce=self._nonce, seq=self._send_seq)

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
        return wire.encode_payload([("codes", codes), ("scales", scales)], seed=self._seed)

    def _send_some(self, sock: zmq.Socket, pacer: Pacer) -> None:
        """Send control messages at once, start queued streams, top up the stream window."""
        while self._welcome is not None:  # a message before WELCOME has no session: it would be refused
            try:
                ctl = self._control.get_nowait()
            except queue.Empty:
                break
            self._send_control(sock, self._restamp(ctl.header), ctl)
        while self._welcome is not None and len(self._streams) < 2:
            try:
                out = self._outbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(out.header, wire.Push) and out.header.n_parts == 0:
                self._send_control(sock, self._restamp(out.header), out)  # zero weight: no tensors
                continue
            out.stream = self._make_stream(out)
            pacer.add(b"", out.stream)
            self._streams.append(out)
        before = {id(o.stream): (o.stream.data_bytes, o.stream.control_bytes) for o in self._streams if o.stream}
        pacer.pump()
        still = []
        for out in self._streams:
            assert out.stream is not None
            d0, c0 = before.get(id(out.stream), (0, 0))
            self._count_sent(out.stream.data_bytes - d0, out.stream.control_bytes - c0)
            if out.stream.done.is_set():
                self.stats.messages_sent += out.stream.n_parts
                # Break the out <-> stream cycle now, so the tensors die by refcount (the caller
                # bounds memory by waiting on ``sent``), not at the next garbage collection.
                out.stream, out.tensors = None, []
                if out.sent is not None:
                    out.sent.set()
            else:
                still.append(out)
        self._streams = still

    def _send_control(self, sock: zmq.Socket, header: wire.Header, out: Outgoing) -> None:
        frames = self._seal(header)
        sock.send_multipart(frames, copy=False)
        if isinstance(header, wire.Heartbeat):
            self.liveness.on_heartbeat_sent(time.monotonic())
        self.stats.messages_sent += 1
        self._count_sent(0, sum(len(memoryview(f)) for f in frames))
        if out.sent is not None:
            out.sent.set()

    def _count_sent(self, data: int, control: int) -> None:
        self.liveness.on_sent(data, time.monotonic())
        self.stats.data_bytes_sent += data
        self.stats.control_bytes_sent += control
        self.stats.bytes_sent += data + control

    def _restamp(self, header: wire.Header) -> wire.Header:
        """Stamp the current generation on an island message at send time.

        HELLO goes first on every new socket and a DEALER connection keeps order, so the
        syncer has bound the new generation before it sees anything stamped with it.
        """
        with self._lock:
            gen = self._generation
            if isinstance(header, wire.Heartbeat):
                return wire.Heartbeat(island=self._cfg.island_id, generation=gen, step=self._step, done=self._done,
                                      **self.liveness.report())
        if isinstance(header, (wire.Init, wire.Push, wire.FinalAck)):
            return msgspec.structs.replace(header, generation=gen)
        return header


def _part_of(tensors: Tensors | DeltaSource, layout: wire.FragmentLayout, k: int, part_elems: int,
             ring: PartRing) -> list[tuple[str, torch.Tensor]]:
    """Part ``k``'s segments: views of materialised tensors, or computed now by a DeltaSource
    into the next buffer of ``ring`` (consecutive views of it)."""
    if isinstance(tensors, DeltaSource):
        return tensors.slice_part(layout, k, part_elems, out=ring.take(part_elems))
    return layout.slice_part(tensors, k, part_elems)

"""The island's connection to the syncer: one thread that owns a DEALER socket.

Only the island's sync rank runs a :class:`SyncClient`. Its thread (the **connection**) owns
the socket, the poll loop, the timers, the pacer and the redials; every protocol rule
(session and generation checks, what a received message means, what to send next, when to
resend, redial or send a heartbeat) is :class:`~diloco.island.client_protocol.ClientProtocol`,
which does no I/O: the connection feeds it frames and the time and carries out the
:class:`~diloco.island.effects.Effects` it returns.

Training must never wait on the network: every send is a non-blocking hand-off to the
connection (a bounded queue: a push that does not fit is dropped with a warning; the syncer
re-pulls it with a new attempt after its quorum timeout, so nothing is lost but that
attempt). What the syncer sends is parked by the protocol until the step boundary asks for it
(pulls, broadcasts, the final cut, shutdown, errors); any message counts as hearing from the
syncer, so a slow multi-GB transfer never looks like silence.

On a socket error, a long silence, or a syncer that restarted (a new ``syncer_id``), the
connection redials with backoff under a **new generation**: the syncer then refuses anything
still in flight from the old connection, which keeps a half-sent push from being merged
twice. INIT resumes on the new connection where its WELCOME says the syncer stands (fragments it
holds are not sent again); pushes are dropped (the syncer pulls again). The connection's thread never dies silently: anything unexpected on it becomes
a fatal :class:`SyncError` that the boundary raises on every rank. State the two threads
share is guarded by one lock (the protocol's ``guard``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch
import zmq

from diloco import wire
from diloco.config import IslandConfig
from diloco.island.client_protocol import ClientProtocol
from diloco.island.delta_source import DeltaSource, PartRing
from diloco.island.effects import Effects, SyncError
from diloco.island.assembly import ReceiveTarget
from diloco.island.lane import BIND_WAIT_S, InitLane, dial
from diloco.island.liveness import Liveness
from diloco.island.orders import PendingBcast
from diloco.island.outbox import WINDOW, ClientStats, Outgoing
from diloco.protocol import session
from diloco.wire.pacing import Pacer, send_tracked

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

__all__ = ["SyncClient", "SyncError"]

_POLL_MS = 50

RECEIVE_HWM = 1
"""Whole messages zmq may queue for us beyond the one its I/O thread is reading and the one we
are copying: at most three received parts (``--part-mib`` each) exist at once. zmq mallocs every
received frame in its I/O thread's glibc arena, which keeps its high-water mark under the
island's trim threshold (``diloco.hostmem``), so this bounds that arena (measurements:
docs/PERFORMANCE.md). A deeper queue pays off only when the link outruns our copy of a part
(digest + copy, several GB/s); the syncer's heartbeats and pulls also wait behind fewer parts."""


class SyncClient:
    """One island's DEALER connection to the syncer, driven by its own thread.

    Args:
        config: the island's configuration (address, id, key, wire dtype, timeouts).
        fingerprint: the layout fingerprint (hex) of this island's fragment plan.
        layouts: the flat stream of every fragment of the plan (names and global shapes
            in plan order), to cut pushes into parts and check received ones.
        receive_target: where received values may land directly (the island's anchors);
            None: every received value is assembled in a pooled buffer.
        claims: per fragment, the digest of the value the island starts from, claimed in HELLO
            until :meth:`drop_claims` (see :class:`ClientProtocol`); None: none.
    """

    def __init__(self, config: IslandConfig, fingerprint: str, layouts: list[wire.FragmentLayout],
                 receive_target: ReceiveTarget | None = None, claims: list[str] | None = None) -> None:
        self._cfg = config
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self.protocol = ClientProtocol(config, fingerprint, layouts, time.monotonic(), receive_target,
                                       guard=self._lock, claims=claims)
        """Every rule of the conversation (no I/O); this object only carries its effects out."""
        self._outbox: queue.Queue[Outgoing] = queue.Queue(maxsize=config.send_queue)
        self._control: queue.SimpleQueue[Outgoing] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._rejoin = threading.Event()
        self._curve = config.client_curve()
        self._streams: list[Outgoing] = []
        self._lane = InitLane(config.island_id, config.sync_addr, self._curve, WINDOW)
        """The session's second connection for INIT, when WELCOME offers one (``lane.py``)."""
        self._redial_s = 0.0
        """The delay of the redial the last message asked for."""
        self._thread = threading.Thread(target=self._run, name=f"yeto-client-{config.island_id}", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> ClientStats:
        return self.protocol.stats

    @property
    def liveness(self) -> Liveness:
        """Progress clocks (what a waiting island counts as moving) and link measurements."""
        return self.protocol.liveness

    @property
    def pool(self) -> wire.HostBufferPool:
        """Where received fragments are assembled (one fragment's worth kept idle)."""
        return self.protocol.pool

    @property
    def ring(self) -> PartRing:
        return self.protocol.ring

    def part_budget(self) -> dict[str, int]:
        """Most bytes of parts this connection holds at once, by kind (the start-up log): the push
        ring (``WINDOW`` fp32 parts, allocated at the first push) and received parts (zmq's queue
        of ``RECEIVE_HWM``, the part its I/O thread reads and the one we copy, in zmq's arena).
        Sized by the syncer's ``--part-mib`` (WELCOME), whatever the model."""
        part = 4 * self.protocol.part_elems
        return {"push_ring": WINDOW * part, "receive_parts_max": (RECEIVE_HWM + 2) * part}

    @property
    def generation(self) -> int:
        """The generation of the current connection (thread-safe)."""
        return self.protocol.generation

    # ------------------------------------------------------------------ training-thread API
    def wait_welcome(self, timeout_s: float) -> wire.Welcome:
        """Block until the syncer accepted our HELLO; raise on refusal or timeout."""
        deadline = time.monotonic() + timeout_s
        p = self.protocol
        with self._lock:
            while p.welcome is None and not p.failed():
                left = deadline - time.monotonic()
                if left <= 0:
                    if p.last_refusal is not None:
                        raise SyncError(f"no WELCOME from the syncer at {self._cfg.sync_addr} within "
                                        f"{timeout_s:.0f}s: {p.last_refusal}")
                    raise TimeoutError(f"no WELCOME from the syncer at {self._cfg.sync_addr} within {timeout_s:.0f}s "
                                       "(is yeto-syncer running and reachable? same key?)")
                self._wake.wait(min(left, 0.5))
            p.check()
            welcome = p.welcome
            assert welcome is not None
            return welcome

    def send_init(self, fragment: int, tensors: Tensors) -> threading.Event:
        """Queue one INIT fragment; the returned event is set once zmq released its bytes.

        INIT blocks (with the connect timeout) when the queue is full: it happens before
        training, and the caller bounds memory by waiting on the events.
        """
        done = threading.Event()
        self._outbox.put(Outgoing(self.protocol.init_header(fragment), tensors, "float32", done),
                         timeout=self._cfg.connect_timeout_s)
        return done

    def push(self, pull: wire.Pull, base_version: int, local_steps: int, tokens: int,
             delta: Tensors | DeltaSource) -> threading.Event | None:
        """Queue a PUSH answering ``pull``; thread-safe, never blocks.

        Returns an event set once the client no longer reads ``delta`` (every part sent, or
        the push abandoned on a redial), or None (and a warning) if the queue is full.  A
        push with ``local_steps == 0`` weighs nothing and travels without tensors.
        """
        header = self.protocol.push_header(pull, base_version, local_steps, tokens)
        done = threading.Event()
        try:
            self._outbox.put_nowait(Outgoing(header, delta if local_steps else [], self._cfg.wire_dtype, done))
        except queue.Full:
            self.stats.pushes_dropped += 1
            log.warning("island %d: send queue full, dropped push of fragment %d round %d attempt %d "
                        "(the syncer will re-pull it)", self._cfg.island_id, pull.fragment, pull.round, pull.attempt)
            return None
        return done

    def report_step(self, step: int, done: bool = False) -> None:
        """Tell the syncer our step (rounds open by step); cheap, never blocks."""
        if self.protocol.report_step(step, done):
            self._control.put(Outgoing(self.protocol.heartbeat()))

    def send_final_ack(self, versions: list[int], digests: list[str] | None = None) -> None:
        """Acknowledge the installed final cut, with the digest of each installed fragment."""
        self._control.put(Outgoing(self.protocol.final_ack(versions, digests)))

    def rejoin(self) -> None:
        """Redial under a new generation (the syncer then sends its whole current cut again):
        for a start-up whose cut stopped arriving (a message lost without a send error)."""
        self._rejoin.set()

    def take_init_lost(self) -> list[int]:
        """INIT fragments the syncer lost with an old connection: stream them again."""
        return self.protocol.take_init_lost()

    def drop_claims(self) -> list[int]:
        """Claim nothing more (start-up is over); the fragments whose HELD was let go of."""
        return self.protocol.drop_claims()

    def take_stale(self) -> list[tuple[int, int]]:
        """(fragment, round) of our pushes the syncer refused as ``stale_base`` since last asked."""
        return self.protocol.take_stale()

    def take_ready_pulls(self) -> list[wire.Pull]:
        """Pulls to answer, oldest round first (see :meth:`ClientProtocol.take_ready_pulls`)."""
        return self.protocol.take_ready_pulls()

    def take_bcasts(self) -> list[PendingBcast]:
        """Global values to apply (at most one per fragment, the newest), by fragment."""
        return self.protocol.take_bcasts()

    def wait_bcast(self, timeout_s: float) -> bool:
        """Wait until at least one broadcast is pending (True) or the timeout passed."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self.protocol.has_bcasts() and not self.protocol.failed():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
            return self.protocol.has_bcasts()

    def final_fragments(self) -> dict[int, tuple[wire.Final, Tensors]] | None:
        """Every fragment of the final cut, once all have arrived; None before."""
        return self.protocol.final_fragments()

    def received_digest(self, fragment: int, version: int) -> str:
        """The digest of our last accepted BCAST of ``fragment`` if it is ``version`` and was
        hashed as it arrived (``ClientProtocol.received_digest``); else ``""``."""
        return self.protocol.received_digest(fragment, version)

    def refetch_final(self, fragment: int) -> None:
        """We do not hold the value a held FINAL of ``fragment`` names: forget it and redial; the
        syncer sends the new session the whole final cut, and what is already in is dropped."""
        self.protocol.refetch_final(fragment)
        self.rejoin()

    def final_received(self) -> int:
        """How many fragments of the final cut have arrived (taken or not)."""
        return self.protocol.final_received()

    def take_final(self, fragment: int) -> tuple[wire.Final, Tensors] | None:
        """Fragment ``fragment`` of the final cut once it has arrived (else None), held one
        fragment at a time."""
        return self.protocol.take_final(fragment)

    def wait_event(self, timeout_s: float) -> None:
        """Sleep until the connection parks something new, or the timeout."""
        with self._lock:
            self._wake.wait(timeout_s)

    @property
    def shutdown_reason(self) -> str | None:
        return self.protocol.shutdown_reason

    def close(self, linger_s: float = 5.0) -> None:
        """Flush what is queued (up to ``linger_s``) and stop the connection's thread."""
        deadline = time.monotonic() + linger_s
        while ((not self._outbox.empty() or not self._control.empty() or self._streams)
               and time.monotonic() < deadline and self._thread.is_alive()):
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=linger_s + 1.0)

    # ------------------------------------------------------------------ the connection's thread
    def _new_socket(self, ctx: zmq.Context) -> zmq.Socket:
        gen = session.draw_id()
        sock = ctx.socket(zmq.DEALER)
        # Like the syncer, refuse frames far above a part before zmq allocates them.
        dial(sock, f"island-{self._cfg.island_id}-{gen:x}", RECEIVE_HWM,
             wire.Limits().max_header_bytes + wire.Limits().max_chunk_bytes + (1 << 20), self._curve, self._cfg.sync_addr)
        sock.send_multipart(self.protocol.hello(gen), copy=False)  # nonce 0, seq 0: opens a session
        log.info("island %d: HELLO to %s (generation %x)", self._cfg.island_id, self._cfg.sync_addr, gen)
        return sock

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - never die silently: the boundary raises it on every rank
            log.exception("island %d: the client's I/O thread failed", self._cfg.island_id)
            with self._lock:
                self.protocol.fail(f"the sync client's I/O thread failed: {type(exc).__name__}: {exc}")
                self._wake.notify_all()
            for out in self._streams:
                if out.sent is not None:
                    out.sent.set()

    def _serve(self) -> None:
        ctx = zmq.Context()
        p = self.protocol
        sock = self._new_socket(ctx)
        pacer = self._new_pacer(sock)
        try:
            while not self._stop.is_set():
                tick = p.tick(time.monotonic(), self._rejoin.is_set())
                if tick.rejoin:
                    self._rejoin.clear()
                if tick.redial_s is not None:
                    sock, pacer = self._redial(ctx, sock, tick.redial_s)
                    continue
                if tick.heartbeat:
                    self._control.put(Outgoing(p.heartbeat()))
                try:
                    self._send_some(sock, pacer)
                    wait_ms = 1 if self._streams else _POLL_MS
                    if sock.poll(wait_ms, zmq.POLLIN):
                        for _ in range(16):
                            try:
                                frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            if self._carry_out(p.handle(frames, time.monotonic())):
                                sock, pacer = self._redial(ctx, sock, self._redial_s)
                                break
                except zmq.ZMQError as exc:
                    sock, pacer = self._redial(ctx, sock, p.socket_error(exc).redial_s or 0.0)
        finally:
            self._lane.close()
            sock.close(linger=0)
            ctx.term()

    def _carry_out(self, effects: Effects) -> bool:
        """Queue what the protocol asked to send, wake the training thread if asked; True when
        it asked for a redial (after ``self._redial_s``)."""
        for header in effects.send:
            self._control.put(Outgoing(header))
        if effects.wake:
            with self._lock:
                self._wake.notify_all()
        if effects.redial_s is None:
            return False
        self._redial_s = effects.redial_s
        return True

    def _redial(self, ctx: zmq.Context, sock: zmq.Socket, delay_s: float) -> tuple[zmq.Socket, Pacer]:
        self._lane.close()  # a lane lives with its session; its INIT streams resume on the new one
        sock.close(linger=0)
        self.protocol.connection_lost()
        if delay_s > 0:
            self._stop.wait(delay_s)
        self.protocol.redialing(time.monotonic())
        sock = self._new_socket(ctx)
        return sock, self._new_pacer(sock)

    def _new_pacer(self, sock: zmq.Socket) -> Pacer:
        def send(_dest: bytes, frames: list, track: bool) -> object:
            return send_tracked(sock, frames, zmq.NOBLOCK, track)

        pacer = Pacer(WINDOW, send)
        # INIT streams wait for the new WELCOME (``_send_some``: resumed or let go of); pushes end.
        self._streams = self.protocol.streams_after_redial(self._streams)
        return pacer

    def _send_some(self, sock: zmq.Socket, pacer: Pacer) -> None:
        """Send control messages at once, start queued streams, top up the stream window."""
        p = self.protocol
        self._open_lane()
        if p.welcome is not None and any(o.stream is None for o in self._streams):
            for out in p.resume_streams(self._streams):  # INIT parked by a redial: where the syncer stands
                assert out.stream is not None
                pacer.add(b"", out.stream)
            self._streams = [o for o in self._streams if o.stream is not None]
        while p.welcome is not None:  # a message before WELCOME has no session: it would be refused
            try:
                ctl = self._control.get_nowait()
            except queue.Empty:
                break
            self._send_control(sock, p.restamp(ctl.header), ctl)
        while p.welcome is not None and len(self._streams) < (1 if self._lane_pending() else 2):
            try:
                out = self._outbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(out.header, wire.Push) and out.header.n_parts == 0:
                self._send_control(sock, p.restamp(out.header), out)  # zero weight: no tensors
                continue
            self._start_stream(out, pacer)
        before = {id(o.stream): (o.stream.data_bytes, o.stream.control_bytes) for o in self._streams if o.stream}
        pacer.pump()
        if self._lane.pacer is not None:
            self._lane.pacer.pump()
        still = []
        for out in self._streams:
            if out.stream is None:  # parked until WELCOME
                still.append(out)
                continue
            d0, c0 = before.get(id(out.stream), (0, 0))
            p.count_sent(out.stream.data_bytes - d0, out.stream.control_bytes - c0, time.monotonic())
            if out.stream.done.is_set():
                self.stats.messages_sent += out.stream.n_parts
                if isinstance(out.header, wire.Init) and out.stream.ok:
                    p.init_sent(out.header.fragment)
                # Break the out <-> stream cycle now, so the tensors die by refcount (the caller
                # bounds memory by waiting on ``sent``), not at the next garbage collection.
                out.stream, out.tensors = None, []
                if out.sent is not None:
                    out.sent.set()
            else:
                still.append(out)
        self._streams = still

    def _open_lane(self) -> None:
        """Open the session's INIT lane once, when its WELCOME offers one and asks for INIT."""
        p = self.protocol
        welcome = p.welcome
        if (welcome is None or welcome.lanes < 1 or not welcome.need_init
                or self._lane.generation == p.generation):
            return
        self._lane.connect(p.generation, p.lane_open)

    def _lane_pending(self) -> bool:
        """The session's lane is open but not bound yet (no ``LaneOk``), for at most
        ``lane.BIND_WAIT_S``: a second INIT stream waits for it rather than share the first
        connection (after that, both go on the first)."""
        lane = self._lane
        return (lane.pacer is not None and lane.generation == self.protocol.generation
                and not self.protocol.lane_ready and time.monotonic() - lane.opened_at < BIND_WAIT_S)

    def _start_stream(self, out: Outgoing, pacer: Pacer) -> None:
        """Hand a new stream to a connection: an INIT stream goes on the lane once the syncer bound it
        (``LaneOk``) and no other stream uses it, everything else on the first connection."""
        p = self.protocol
        lane = self._lane.pacer if self._lane.generation == p.generation else None
        out.lane = (lane is not None and isinstance(out.header, wire.Init) and p.lane_ready
                    and not any(o.lane for o in self._streams))
        out.stream = p.stream_of(out)
        (lane if out.lane and lane is not None else pacer).add(b"", out.stream)
        if out.lane:
            log.info("island %d: INIT fragment %d on the lane", self._cfg.island_id, out.header.fragment)  # type: ignore[union-attr]
        self._streams.append(out)

    def _send_control(self, sock: zmq.Socket, header: wire.Header, out: Outgoing) -> None:
        frames = self.protocol.seal(header)
        sock.send_multipart(frames, copy=False)
        if isinstance(header, wire.Heartbeat):
            self.liveness.on_heartbeat_sent(time.monotonic())
        self.stats.messages_sent += 1
        self.protocol.count_sent(0, sum(len(memoryview(f)) for f in frames), time.monotonic())
        if out.sent is not None:
            out.sent.set()

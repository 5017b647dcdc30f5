"""The island's connection to the syncer: a DEALER socket on a background I/O thread.

Only the island's sync rank runs a :class:`SyncClient`. Training must never wait on the
network, so every send is a non-blocking hand-off to the I/O thread (a bounded queue: a
push that does not fit is dropped with a warning; the syncer re-pulls it with a new
attempt after its quorum timeout, so nothing is lost but that attempt). Everything the
syncer sends is decoded and validated on the I/O thread and parked until the step
boundary asks for it:

* pulls, deduplicated by :meth:`SyncClient.take_ready_pulls` — per (fragment, round) only
  the newest attempt, and one copy of a pull the syncer resent;
* broadcasts, accepted in increasing version order per fragment (an identical replay or
  an older version is ignored; only the newest pending value is kept, since a broadcast
  carries the whole global value);
* the final cut, shutdown and errors.

Fragments travel as **parts** (``diloco.wire.parts``): INIT and PUSH streams are cut into
parts of the syncer's size and paced (the send rules: ``diloco.island.outbox``); BCAST and
FINAL parts are checked against the plan and assembled in place (the receive rules:
``diloco.island.inbox``), handed to the boundary only once complete.  Any message from the
syncer counts as hearing from it, so a slow multi-GB transfer never looks like silence.
This module owns the socket, the I/O thread's loop, the redials and the training thread's
API; the state the two threads share is guarded by one lock.

On a socket error, a long silence, or a syncer that restarted (a new ``syncer_id``), the
client redials with backoff under a **new generation**: the syncer then refuses anything
still in flight from the old connection, which is what keeps a half-sent push from being
merged twice.  INIT streams restart from part 0 on the new connection; pushes are
dropped (the syncer pulls again).

The I/O thread never dies silently: anything unexpected on it becomes a fatal
:class:`SyncError` that the boundary raises on every rank.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time

import torch
import zmq

from diloco import quant, wire
from diloco.config import IslandConfig
from diloco.island.delta_source import DeltaSource, PartRing
from diloco.island.inbox import Inbox, ReceiveTarget, SyncError, _Assembly
from diloco.island.liveness import Liveness
from diloco.island.orders import PendingBcast
from diloco.island.outbox import WINDOW, ClientStats, Outbox, Outgoing
from diloco.protocol import session
from diloco.security import secure_client
from diloco.wire.pacing import Pacer

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

_POLL_MS = 50
_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 10.0

class SyncClient(Inbox, Outbox):
    """One island's DEALER connection to the syncer, driven by a background thread.

    Args:
        config: the island's configuration (address, id, key, wire dtype, timeouts).
        fingerprint: the layout fingerprint (hex) of this island's fragment plan.
        layouts: the flat stream of every fragment of the plan (names and global shapes
            in plan order), to cut pushes into parts and check received ones.
    """

    def __init__(self, config: IslandConfig, fingerprint: str, layouts: list[wire.FragmentLayout],
                 receive_target: ReceiveTarget | None = None) -> None:
        self._cfg = config
        self._fingerprint = fingerprint
        self._layouts = list(layouts)
        self._n_fragments = n_fragments = len(self._layouts)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._outbox: queue.Queue[Outgoing] = queue.Queue(maxsize=config.send_queue)
        self._control: queue.SimpleQueue[Outgoing] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._rejoin = threading.Event()
        self.stats = ClientStats()
        self.liveness = Liveness()
        """Progress clocks (what a waiting island counts as moving) and link measurements."""
        # Received fragments (BCAST, cuts) are assembled here: one fragment's worth kept idle.
        self.pool = wire.HostBufferPool(max_idle_bytes=max((lay.numel * 4 for lay in self._layouts), default=0))
        # State shared with the training thread, guarded by _lock.
        self._welcome: wire.Welcome | None = None
        self._part_elems = wire.DEFAULT_PART_ELEMS
        self._generation = 0
        self._syncer_id: int | None = None
        self._pulls: dict[tuple[int, int], wire.Pull] = {}
        self._pulls_taken: dict[tuple[int, int], int] = {}
        self._bcasts: dict[int, PendingBcast] = {}
        self._accepted_version: list[int] = [-1] * n_fragments
        self._final: dict[int, tuple[wire.Final, Tensors]] = {}
        self._shutdown: str | None = None
        self._fatal: str | None = None
        self._instance = random.getrandbits(62) + 1
        """Random per process, the same across redials: the syncer tells a reconnect of this
        process from a second process claiming our island id (``island_in_use``)."""
        self._last_refusal: str | None = None
        self._redial_delay = 0.0
        self._stale: list[tuple[int, int]] = []
        """(fragment, round) of pushes refused as ``stale_base``, for the boundary."""
        self._final_ack: wire.FinalAck | None = None
        """Our FINAL_ACK, resent after a redial during finalization (the syncer forgot it)."""
        self._step = 0
        self._done = False
        # I/O thread only.
        self._curve = config.client_curve()
        self._seed = wire.digest_seed(config.key)
        self._nonce = 0
        """Session nonce of the current connection (0 until WELCOME)."""
        self._send_seq = 0
        self._recv_seq = 0
        self._feedback = (quant.ErrorFeedback(config.wire_dtype, config.quant_block)
                          if config.wire_dtype in wire.QUANT_KINDS else None)
        """Residuals of low-bit pushes, per fragment, on the host where the gathered delta is."""
        self._assembling: dict[tuple[str, int], _Assembly] = {}
        self.ring = PartRing(WINDOW)
        """Where pushes computed part by part (DeltaSource) land: ``WINDOW`` parts (I/O thread)."""
        self.receive_target = receive_target
        """Where received values may land directly (the island's anchors), or None: pooled."""
        self._streams: list[Outgoing] = []
        self._thread = threading.Thread(target=self._run, name=f"yeto-client-{config.island_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training-thread API
    def wait_welcome(self, timeout_s: float) -> wire.Welcome:
        """Block until the syncer accepted our HELLO; raise on refusal or timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._welcome is None and self._fatal is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    if self._last_refusal is not None:
                        raise SyncError(f"no WELCOME from the syncer at {self._cfg.sync_addr} within "
                                        f"{timeout_s:.0f}s: {self._last_refusal}")
                    raise TimeoutError(f"no WELCOME from the syncer at {self._cfg.sync_addr} within {timeout_s:.0f}s "
                                       "(is yeto-syncer running and reachable? same key?)")
                self._wake.wait(min(left, 0.5))
            self._raise_fatal()
            assert self._welcome is not None
            return self._welcome

    def send_init(self, fragment: int, tensors: Tensors) -> threading.Event:
        """Queue one INIT fragment; the returned event is set once zmq released its bytes.

        INIT blocks (with the connect timeout) when the queue is full: it happens before
        training, and the caller bounds memory by waiting on the events.
        """
        done = threading.Event()
        header = wire.Init(island=self._cfg.island_id, generation=self._generation, fragment=fragment,
                           n_fragments=self._n_fragments)
        self._outbox.put(Outgoing(header, tensors, "float32", done), timeout=self._cfg.connect_timeout_s)
        return done

    def push(self, pull: wire.Pull, base_version: int, local_steps: int, tokens: int,
             delta: Tensors | DeltaSource) -> threading.Event | None:
        """Queue a PUSH answering ``pull``; thread-safe, never blocks.

        Returns an event set once the client no longer reads ``delta`` (every part sent, or
        the push abandoned on a redial), or None (and a warning) if the queue is full.  A
        push with ``local_steps == 0`` weighs nothing and travels without tensors.
        """
        header = wire.Push(island=self._cfg.island_id, generation=self._generation, fragment=pull.fragment,
                           round=pull.round, attempt=pull.attempt, base_version=base_version,
                           local_steps=local_steps, tokens=tokens, n_parts=0 if local_steps == 0 else 1)
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
        with self._lock:
            changed = step != self._step or done != self._done
            self._step, self._done = step, done
        if changed:
            self._enqueue_heartbeat()

    def send_final_ack(self, versions: list[int], digests: list[str] | None = None) -> None:
        """Acknowledge the installed final cut, with the digest of each installed fragment."""
        header = wire.FinalAck(island=self._cfg.island_id, generation=self._generation, versions=tuple(versions),
                               digests=tuple(digests or ()))
        with self._lock:
            self._final_ack = header
        self._control.put(Outgoing(header))

    def rejoin(self) -> None:
        """Redial under a new generation (the syncer then sends its whole current cut again):
        for a start-up whose cut stopped arriving (a message lost without a send error)."""
        self._rejoin.set()

    def take_stale(self) -> list[tuple[int, int]]:
        """(fragment, round) of our pushes the syncer refused as ``stale_base`` since last asked:
        it sends that fragment's current value and the PULL again."""
        with self._lock:
            out, self._stale = self._stale, []
            return out

    def take_ready_pulls(self) -> list[wire.Pull]:
        """Pulls to answer, oldest round first: per (fragment, round) the newest attempt,
        each (fragment, round, attempt) handed out once."""
        with self._lock:
            self._raise_fatal()
            ready = sorted(self._pulls.values(), key=lambda p: (p.round, p.fragment))
            for p in ready:
                self._pulls_taken[(p.fragment, p.round)] = p.attempt
            self._pulls.clear()
            return ready

    def take_bcasts(self) -> list[PendingBcast]:
        """Global values to apply (at most one per fragment, the newest), by fragment."""
        with self._lock:
            self._raise_fatal()
            out = [self._bcasts[f] for f in sorted(self._bcasts)] if not self._final_complete() else []
            self._bcasts.clear()
            return out

    def _final_complete(self) -> bool:
        return len(self._final) >= self._n_fragments

    def wait_bcast(self, timeout_s: float) -> bool:
        """Wait until at least one broadcast is pending (True) or the timeout passed."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._bcasts and self._fatal is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
            return bool(self._bcasts)

    def final_fragments(self) -> dict[int, tuple[wire.Final, Tensors]] | None:
        """Every fragment of the final cut, once all have arrived; None before."""
        with self._lock:
            self._raise_fatal()
            if len(self._final) < self._n_fragments:
                return None
            return dict(self._final)

    def final_received(self) -> int:
        """How many fragments of the final cut have arrived (taken or not)."""
        with self._lock:
            self._raise_fatal()
            return len(self._final)

    def take_final(self, fragment: int) -> tuple[wire.Final, Tensors] | None:
        """Fragment ``fragment`` of the final cut once it has arrived (else None); the client
        then lets go of its tensors, so the final cut is held one fragment at a time."""
        with self._lock:
            self._raise_fatal()
            got = self._final.get(fragment)
            if got is None:
                return None
            self._final[fragment] = (got[0], [])
            return got

    def wait_event(self, timeout_s: float) -> None:
        """Sleep until the I/O thread parks something new, or the timeout."""
        with self._lock:
            self._wake.wait(timeout_s)

    @property
    def shutdown_reason(self) -> str | None:
        with self._lock:
            return self._shutdown

    def close(self, linger_s: float = 5.0) -> None:
        """Flush what is queued (up to ``linger_s``) and stop the I/O thread."""
        deadline = time.monotonic() + linger_s
        while ((not self._outbox.empty() or not self._control.empty() or self._streams)
               and time.monotonic() < deadline and self._thread.is_alive()):
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=linger_s + 1.0)

    # ------------------------------------------------------------------ I/O thread
    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise SyncError(self._fatal)

    def _new_socket(self, ctx: zmq.Context) -> zmq.Socket:
        gen = session.draw_id()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"island-{self._cfg.island_id}-{gen:x}".encode())
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.RCVHWM, 8)  # parts of tens of MiB: bound what zmq holds for us
        # Like the syncer, refuse frames far above a part before zmq allocates them.
        sock.setsockopt(zmq.MAXMSGSIZE, wire.Limits().max_header_bytes + wire.Limits().max_chunk_bytes + (1 << 20))
        if self._curve is not None:
            secure_client(sock, self._curve)
        sock.connect(self._cfg.sync_addr)
        self._nonce = self._send_seq = self._recv_seq = 0
        with self._lock:
            self._generation = gen
        hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, island=self._cfg.island_id, generation=gen,
                           fingerprint=self._fingerprint, n_fragments=self._n_fragments,
                           wire_dtype=self._cfg.wire_dtype, fragment_numel=tuple(lay.numel for lay in self._layouts),
                           quant_block=self._cfg.quant_block if self._feedback is not None else 0,
                           instance=self._instance)
        sock.send_multipart(wire.encode(hello, key=self._cfg.key), copy=False)  # nonce 0, seq 0: opens a session
        log.info("island %d: HELLO to %s (generation %x)", self._cfg.island_id, self._cfg.sync_addr, gen)
        return sock

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - never die silently: the boundary raises it on every rank
            log.exception("island %d: the client's I/O thread failed", self._cfg.island_id)
            with self._lock:
                self._fatal = f"the sync client's I/O thread failed: {type(exc).__name__}: {exc}"
                self._wake.notify_all()
            for out in self._streams:
                if out.sent is not None:
                    out.sent.set()

    def _serve(self) -> None:
        ctx = zmq.Context()
        backoff = _BACKOFF_START_S
        sock = self._new_socket(ctx)
        pacer = self._new_pacer(sock)
        last_heard = time.monotonic()
        last_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_heard > self._cfg.sync_timeout_s:
                    log.warning("island %d: no word from the syncer for %.0fs, redialing", self._cfg.island_id,
                                now - last_heard)
                    sock, pacer = self._redial(ctx, sock, backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    last_heard = time.monotonic()
                    continue
                if self._rejoin.is_set():
                    self._rejoin.clear()
                    log.warning("island %d: the cut stopped arriving, rejoining", self._cfg.island_id)
                    sock, pacer = self._redial(ctx, sock, 0.0)
                    last_heard = time.monotonic()
                    continue
                if now - last_beat >= self._cfg.heartbeat_s:
                    self._enqueue_heartbeat()
                    last_beat = now
                try:
                    self._send_some(sock, pacer)
                    wait_ms = 1 if self._streams else _POLL_MS
                    if sock.poll(wait_ms, zmq.POLLIN):
                        for _ in range(16):
                            try:
                                frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            last_heard = time.monotonic()
                            if len(frames) > 2:  # only BCAST / FINAL parts carry tensors
                                self.liveness.on_value_part(sum(len(f.buffer) for f in frames[2:]), last_heard)
                            if self._on_frames(frames):
                                delay, self._redial_delay = self._redial_delay, 0.0
                                sock, pacer = self._redial(ctx, sock, delay)
                                last_heard = time.monotonic()
                                break
                            backoff = _BACKOFF_START_S
                except zmq.ZMQError as exc:
                    log.warning("island %d: socket error %s, redialing", self._cfg.island_id, exc)
                    sock, pacer = self._redial(ctx, sock, backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    last_heard = time.monotonic()
        finally:
            sock.close(linger=0)
            ctx.term()

    def _redial(self, ctx: zmq.Context, sock: zmq.Socket, delay_s: float) -> tuple[zmq.Socket, Pacer]:
        sock.close(linger=0)
        self.stats.redials += 1
        self.liveness.on_redial()
        if delay_s > 0:
            self._stop.wait(delay_s)
        with self._lock:
            self._welcome = None
            # The syncer resends the PULL of every open round we have not pushed to; a push
            # lost with the old socket must be answered again, so forget what was taken.
            self._pulls.clear()
            self._pulls_taken.clear()
        self._assembling.clear()
        sock = self._new_socket(ctx)
        return sock, self._new_pacer(sock)

    def _on_progress(self, h: wire.Progress) -> None:
        """A PROGRESS notice (inbox, I/O thread): counted by the progress clocks, refused if malformed."""
        problem = self.liveness.on_progress(h, time.monotonic())
        if problem:
            self.stats.refused += 1
            log.warning("island %d: refused %s", self._cfg.island_id, problem)



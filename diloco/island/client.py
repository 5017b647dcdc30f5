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

On a socket error, a long silence, or a syncer that restarted (a new ``syncer_id``), the
client redials with backoff under a **new generation**: the syncer then refuses anything
still in flight from the old connection, which is what keeps a half-sent push from being
merged twice.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from diloco import wire
from diloco.config import IslandConfig

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

_POLL_MS = 50
_FATAL_CODES = frozenset({"protocol", "unknown_island", "fingerprint_mismatch", "fragments_mismatch",
                          "bad_fingerprint", "bad_fragments", "bad_dtype", "finished"})
"""ERROR codes after which retrying cannot help: the island is misconfigured or too late."""
_REJOIN_CODES = frozenset({"not_bound", "unknown_generation"})
"""ERROR codes meaning the syncer lost our binding (it restarted): say HELLO again."""
_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 10.0


class SyncError(RuntimeError):
    """The syncer refused this island for good (e.g. a layout fingerprint mismatch)."""


@dataclass
class PendingBcast:
    """The newest not-yet-applied global value of one fragment."""

    fragment: int
    version: int
    round: int
    cut: bool
    tensors: Tensors


@dataclass
class ClientStats:
    """Byte and message counters, read by the step log (monotonic; the reader diffs them).

    Data bytes are tensor payload (in the wire dtype); control bytes are everything else on
    the wire (MACs, headers, heartbeats, pulls, acks).
    """

    bytes_sent: int = 0
    """Every byte handed to zmq (data + control)."""
    bytes_recv: int = 0
    """Every byte received and handled (data + control)."""
    data_bytes_sent: int = 0
    """Tensor payload bytes sent (INIT and PUSH)."""
    data_bytes_recv: int = 0
    """Tensor payload bytes received (BCAST and FINAL)."""
    control_bytes_sent: int = 0
    """Non-payload bytes sent."""
    control_bytes_recv: int = 0
    """Non-payload bytes received."""
    push_bytes_sent: int = 0
    """Tensor payload bytes of sent PUSH messages (numel x wire itemsize, summed)."""
    messages_sent: int = 0
    messages_recv: int = 0
    pushes_dropped: int = 0
    redials: int = 0
    refused: int = 0


@dataclass
class _Outgoing:
    header: wire.Header
    tensors: Tensors = field(default_factory=list)
    wire_dtype: str | None = None
    sent: threading.Event | None = None


class SyncClient:
    """One island's DEALER connection to the syncer, driven by a background thread.

    Args:
        config: the island's configuration (address, id, key, wire dtype, timeouts).
        fingerprint: the layout fingerprint (hex) of this island's fragment plan.
        n_fragments: fragments in the plan.
    """

    def __init__(self, config: IslandConfig, fingerprint: str, n_fragments: int) -> None:
        self._cfg = config
        self._fingerprint = fingerprint
        self._n_fragments = n_fragments
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._outbox: queue.Queue[_Outgoing] = queue.Queue(maxsize=config.send_queue)
        self._stop = threading.Event()
        self.stats = ClientStats()
        # State shared with the training thread, guarded by _lock.
        self._welcome: wire.Welcome | None = None
        self._generation = 0
        self._syncer_id: int | None = None
        self._pulls: dict[tuple[int, int], wire.Pull] = {}
        self._pulls_taken: dict[tuple[int, int], int] = {}
        self._bcasts: dict[int, PendingBcast] = {}
        self._accepted_version: list[int] = [-1] * n_fragments
        self._final: dict[int, tuple[wire.Final, Tensors]] = {}
        self._shutdown: str | None = None
        self._fatal: str | None = None
        self._step = 0
        self._done = False
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
        self._outbox.put(_Outgoing(header, tensors, "float32", done), timeout=self._cfg.connect_timeout_s)
        return done

    def push(self, pull: wire.Pull, base_version: int, local_steps: int, tokens: int, delta: Tensors) -> bool:
        """Queue a PUSH answering ``pull``; False (and a warning) if the queue is full."""
        header = wire.Push(island=self._cfg.island_id, generation=self._generation, fragment=pull.fragment,
                           round=pull.round, attempt=pull.attempt, base_version=base_version,
                           local_steps=local_steps, tokens=tokens)
        try:
            self._outbox.put_nowait(_Outgoing(header, delta, self._cfg.wire_dtype))
        except queue.Full:
            self.stats.pushes_dropped += 1
            log.warning("island %d: send queue full, dropped push of fragment %d round %d attempt %d "
                        "(the syncer will re-pull it)", self._cfg.island_id, pull.fragment, pull.round, pull.attempt)
            return False
        return True

    def report_step(self, step: int, done: bool = False) -> None:
        """Tell the syncer our step (rounds open by step); cheap, never blocks."""
        with self._lock:
            changed = step != self._step or done != self._done
            self._step, self._done = step, done
        if changed:
            self._enqueue_heartbeat()

    def send_final_ack(self, versions: list[int]) -> None:
        """Acknowledge the installed final cut."""
        header = wire.FinalAck(island=self._cfg.island_id, generation=self._generation, versions=tuple(versions))
        self._outbox.put(_Outgoing(header), timeout=self._cfg.final_timeout_s)

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
            out = [self._bcasts[f] for f in sorted(self._bcasts)]
            self._bcasts.clear()
            return out

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

    def wait_event(self, timeout_s: float) -> None:
        """Sleep until the I/O thread parks something new, or the timeout."""
        with self._lock:
            self._wake.wait(timeout_s)

    @property
    def shutdown_reason(self) -> str | None:
        with self._lock:
            return self._shutdown

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def close(self, linger_s: float = 5.0) -> None:
        """Flush what is queued (up to ``linger_s``) and stop the I/O thread."""
        deadline = time.monotonic() + linger_s
        while not self._outbox.empty() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=linger_s + 1.0)

    # ------------------------------------------------------------------ I/O thread
    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise SyncError(self._fatal)

    def _enqueue_heartbeat(self) -> None:
        with self._lock:
            hb = wire.Heartbeat(island=self._cfg.island_id, generation=self._generation, step=self._step,
                                done=self._done)
        try:
            self._outbox.put_nowait(_Outgoing(hb))
        except queue.Full:
            pass  # the periodic heartbeat carries the step soon enough

    def _new_socket(self, ctx: zmq.Context) -> zmq.Socket:
        gen = random.getrandbits(63) or 1
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, f"island-{self._cfg.island_id}-{gen:x}".encode())
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.RCVHWM, 256)
        sock.connect(self._cfg.sync_addr)
        with self._lock:
            self._generation = gen
        hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, island=self._cfg.island_id, generation=gen,
                           fingerprint=self._fingerprint, n_fragments=self._n_fragments,
                           wire_dtype=self._cfg.wire_dtype)
        sock.send_multipart(wire.encode(hello, key=self._cfg.key), copy=False)
        log.info("island %d: HELLO to %s (generation %x)", self._cfg.island_id, self._cfg.sync_addr, gen)
        return sock

    def _run(self) -> None:
        ctx = zmq.Context()
        backoff = _BACKOFF_START_S
        sock = self._new_socket(ctx)
        last_heard = time.monotonic()
        last_beat = 0.0
        held: collections.deque[_Outgoing] = collections.deque()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_heard > self._cfg.sync_timeout_s:
                    log.warning("island %d: no word from the syncer for %.0fs, redialing", self._cfg.island_id,
                                now - last_heard)
                    sock = self._redial(ctx, sock, backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    last_heard = time.monotonic()
                    continue
                if now - last_beat >= self._cfg.heartbeat_s:
                    self._enqueue_heartbeat()
                    last_beat = now
                try:
                    sock = self._send_some(sock, held)
                    if sock.poll(_POLL_MS, zmq.POLLIN):
                        frames = sock.recv_multipart(copy=False)
                        last_heard = time.monotonic()
                        if self._on_frames(frames):
                            sock = self._redial(ctx, sock, 0.0)
                            last_heard = time.monotonic()
                        else:
                            backoff = _BACKOFF_START_S
                except zmq.ZMQError as exc:
                    log.warning("island %d: socket error %s, redialing", self._cfg.island_id, exc)
                    sock = self._redial(ctx, sock, backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    last_heard = time.monotonic()
        finally:
            sock.close(linger=0)
            ctx.term()

    def _redial(self, ctx: zmq.Context, sock: zmq.Socket, delay_s: float) -> zmq.Socket:
        sock.close(linger=0)
        self.stats.redials += 1
        if delay_s > 0:
            self._stop.wait(delay_s)
        with self._lock:
            self._welcome = None
            # The syncer resends the PULL of every open round we have not pushed to; a push
            # lost with the old socket must be answered again, so forget what was taken.
            self._pulls.clear()
            self._pulls_taken.clear()
        return self._new_socket(ctx)

    def _send_some(self, sock: zmq.Socket, held: collections.deque[_Outgoing]) -> zmq.Socket:
        """Send queued messages without blocking; stamp the current generation on them.

        A message queued under an older generation is stamped anew: the syncer judges a
        push by (round, attempt), and refusing it as old-generation would only waste it.
        """
        for _ in range(64):
            if held:
                out = held.popleft()
            else:
                try:
                    out = self._outbox.get_nowait()
                except queue.Empty:
                    return sock
            header = self._restamp(out.header)
            frames = wire.encode(header, out.tensors, key=self._cfg.key, wire_dtype=out.wire_dtype)
            try:
                tracker = sock.send_multipart(frames, copy=False, track=out.sent is not None, flags=zmq.NOBLOCK)
            except zmq.Again:
                held.appendleft(out)
                return sock
            if out.sent is not None:
                if tracker is not None:
                    tracker.wait(self._cfg.connect_timeout_s)
                out.sent.set()
            self.stats.messages_sent += 1
            # Frames are [MAC, header, *payload chunks] (diloco.wire.codec.encode).
            control = sum(len(memoryview(f)) for f in frames[:2])
            data = sum(len(memoryview(f)) for f in frames[2:])
            self.stats.bytes_sent += control + data
            self.stats.control_bytes_sent += control
            self.stats.data_bytes_sent += data
            if isinstance(header, wire.Push):
                self.stats.push_bytes_sent += data
        return sock

    def _restamp(self, header: wire.Header) -> wire.Header:
        """Stamp the current generation on an island message at send time.

        HELLO goes first on every new socket and a DEALER connection keeps order, so the
        syncer has bound the new generation before it sees anything stamped with it.
        """
        with self._lock:
            gen = self._generation
            if isinstance(header, wire.Heartbeat):
                return wire.Heartbeat(island=self._cfg.island_id, generation=gen, step=self._step, done=self._done)
        if isinstance(header, (wire.Init, wire.Push, wire.FinalAck)):
            return msgspec.structs.replace(header, generation=gen)
        return header

    def _on_frames(self, frames: list[zmq.Frame]) -> bool:
        """Handle one message from the syncer; True asks the I/O loop to redial.

        Counted once handled, so a reader that sees the counter move also sees its effect.
        """
        try:
            return self._handle(frames)
        finally:
            self.stats.messages_recv += 1
            control = sum(len(f.buffer) for f in frames[:2])
            data = sum(len(f.buffer) for f in frames[2:])
            self.stats.bytes_recv += control + data
            self.stats.control_bytes_recv += control
            self.stats.data_bytes_recv += data

    def _handle(self, frames: list[zmq.Frame]) -> bool:
        try:
            msg = wire.decode(frames, key=self._cfg.key)
        except wire.WireError as exc:
            self.stats.refused += 1
            log.warning("island %d: refused a message from the syncer: %s", self._cfg.island_id, exc.reason)
            return False
        h = msg.header
        with self._lock:
            if isinstance(h, wire.Welcome):
                return self._on_welcome(h)
            if isinstance(h, wire.Heartbeat):
                if self._syncer_id is not None and h.syncer_id != self._syncer_id:
                    log.warning("island %d: the syncer restarted (id %x -> %x), rejoining", self._cfg.island_id,
                                self._syncer_id, h.syncer_id)
                    return True
                return False
            if isinstance(h, wire.Pull):
                self._on_pull(h)
            elif isinstance(h, wire.Bcast):
                self._on_bcast(h, msg.tensors)
            elif isinstance(h, wire.Final):
                if not 0 <= h.fragment < self._n_fragments:
                    log.warning("island %d: FINAL for unknown fragment %d ignored", self._cfg.island_id, h.fragment)
                else:
                    self._final[h.fragment] = (h, msg.tensors)
            elif isinstance(h, wire.Shutdown):
                log.info("island %d: SHUTDOWN from the syncer: %s", self._cfg.island_id, h.reason)
                self._shutdown = h.reason or "shutdown"
            elif isinstance(h, wire.Error):
                if h.code in _REJOIN_CODES:
                    # The syncer does not know our generation: it restarted (or dropped us).
                    log.warning("island %d: the syncer does not know us ([%s] %s), rejoining", self._cfg.island_id,
                                h.code, h.reason)
                    return True
                log.error("island %d: the syncer refused a message: [%s] %s", self._cfg.island_id, h.code, h.reason)
                if h.code in _FATAL_CODES:
                    self._fatal = f"syncer refused island {self._cfg.island_id}: [{h.code}] {h.reason}"
            else:
                log.warning("island %d: unexpected %s from the syncer ignored", self._cfg.island_id, type(h).__name__)
            self._wake.notify_all()
        return False

    def _on_welcome(self, h: wire.Welcome) -> bool:
        if h.protocol != wire.PROTOCOL_VERSION or len(h.versions) != self._n_fragments:
            self._fatal = (f"syncer speaks protocol {h.protocol} with {len(h.versions)} fragments, we speak "
                           f"{wire.PROTOCOL_VERSION} with {self._n_fragments}")
        else:
            if self._syncer_id is not None and h.syncer_id != self._syncer_id:
                # A restarted syncer may have resumed an older checkpoint: its versions are
                # the truth now, so the version floor restarts and its cut is installed.
                log.warning("island %d: joined a new syncer instance; accepting its cut", self._cfg.island_id)
                self._accepted_version = [-1] * self._n_fragments
                self._bcasts.clear()
            self._syncer_id = h.syncer_id
            self._welcome = h
        self._wake.notify_all()
        return False

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

    def _on_bcast(self, h: wire.Bcast, tensors: Tensors) -> None:
        if not 0 <= h.fragment < self._n_fragments or h.version < 0:
            log.warning("island %d: malformed BCAST %s ignored", self._cfg.island_id, h)
            return
        floor = self._accepted_version[h.fragment]
        if h.version <= floor:
            return  # an identical replay or an older value
        self._accepted_version[h.fragment] = h.version
        self._bcasts[h.fragment] = PendingBcast(h.fragment, h.version, h.round, h.cut, tensors)


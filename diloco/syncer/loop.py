"""The syncer's I/O loop: a pyzmq ROUTER socket around the pure ``SyncerState``.

One thread does everything, in this order per iteration: poll (short timeout),
drain a bounded batch of messages (each decoded, validated, fed to the state
machine), ``tick``, start a checkpoint if one became due, then send.

Checkpoints are written on a background thread. Writing one of a large model
takes minutes; a loop blocked that long would answer no heartbeat, and every
island would give up on the syncer and redial. The snapshot shares the state's
tensors (values are immutable published clones, momenta are copied on write
if their fragment commits meanwhile), so it costs no extra memory in the usual
case. The price: a BCAST of version v may reach islands before the checkpoint
holding v is durable. A crash then rolls the islands back to the last
checkpoint — a resumed syncer is a new syncer instance, whose cut every island
installs whatever its version — which loses inner steps but never mixes states.
At most one checkpoint is in flight; one that falls due meanwhile is written
right after. The final checkpoint (and the one on SIGTERM) is synchronous.

Sends never block: the ROUTER uses ``ROUTER_MANDATORY`` and ``NOBLOCK``, so a
peer that is gone (EHOSTUNREACH) or too slow (its send queue at SNDHWM, EAGAIN)
loses that one message, logged, and every other island is served as usual. The
protocol tolerates the loss: a lost PULL is re-sent at the next attempt, a lost
BCAST is superseded by the next version or the cut at reconnect, and a lost
FINAL shows up as a finalization timeout.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

import zmq

from diloco.syncer.records import Outgoing
from diloco.syncer.state import SyncerState
from diloco.syncer.store import CheckpointStore
from diloco.wire import Limits, WireError, decode, encode

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FINAL_FAILED = 1
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class LoopOptions:
    """Socket and housekeeping settings of the loop.

    Attributes:
        bind: zmq endpoint to bind, e.g. ``tcp://0.0.0.0:5555``.
        key: shared HMAC key (``b""``: unauthenticated).
        limits: wire limits applied to every inbound message.
        poll_ms: poll timeout; bounds how late ``tick`` runs.
        max_batch: messages handled per iteration before ``tick`` and sends.
        sndhwm: per-peer send queue bound (messages); beyond it sends fail fast.
        linger_ms: how long close() may spend flushing SHUTDOWN at exit.
        status_every_s: period of the one-line status log.
        event_log: path of the JSON-lines commit log (None: none).
    """

    bind: str = "tcp://0.0.0.0:5555"
    key: bytes = b""
    limits: Limits = field(default_factory=Limits)
    poll_ms: int = 50
    max_batch: int = 64
    sndhwm: int = 1000
    linger_ms: int = 2000
    status_every_s: float = 2.0
    event_log: str | None = None


class SyncerLoop:
    """Serve one ``SyncerState`` on a ROUTER socket until it finishes or is stopped.

    Args:
        state: the state machine (fresh or resumed).
        options: socket settings.
        store: checkpoint store, or None to run without checkpoints.
        context: zmq context (a private one by default).
    """

    def __init__(
        self,
        state: SyncerState,
        options: LoopOptions,
        store: CheckpointStore | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.state = state
        self.options = options
        self.store = store
        self.ctx = context or zmq.Context.instance()
        self.stop_event = threading.Event()
        self.wire_refusals = 0
        self.dropped_sends = 0
        self.sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, options.sndhwm)
        self.sock.setsockopt(zmq.LINGER, options.linger_ms)
        # zmq drops (and disconnects) a peer sending a frame above this before
        # allocating it; frames below it are checked precisely by wire.decode.
        lim = options.limits
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(lim.max_chunk_bytes, lim.max_header_bytes) + (1 << 20))
        self.sock.bind(options.bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._events: IO[str] | None = open(options.event_log, "a") if options.event_log else None
        self._last_status = 0.0
        self._tight_limits: Limits | None = None
        self._writer: threading.Thread | None = None
        self._writer_failed = False

    def _limits(self) -> Limits:
        """Wire limits for the next message: tightened to the model once it is known.

        Before every fragment is initialised, INIT must be admitted under the
        operator's limits. Afterwards no legitimate message (PUSH, at most one
        fragment's fp32 bytes) is larger than the largest fragment, so a hostile
        declaration beyond that is refused before decode allocates anything.
        """
        if self._tight_limits is not None:
            return self._tight_limits
        if not self.state.initialised:
            return self.options.limits
        frag_bytes = tensor_bytes = 0
        for f in self.state.fragments:
            sizes = [4 * math.prod(shape) for _n, _d, shape in f.schema]
            frag_bytes = max(frag_bytes, sum(sizes))
            tensor_bytes = max(tensor_bytes, max(sizes))
        lim = self.options.limits
        self._tight_limits = dataclasses.replace(
            lim,
            max_tensor_bytes=min(lim.max_tensor_bytes, tensor_bytes),
            max_message_bytes=min(lim.max_message_bytes, frag_bytes),
        )
        log.info("wire limits tightened to the model: tensor <= %d B, message <= %d B", tensor_bytes, frag_bytes)
        return self._tight_limits

    # ------------------------------------------------------------------ steps

    def _receive(self, now: float) -> list[Outgoing]:
        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        peer = frames[0].bytes
        try:
            msg = decode(frames[1:], key=self.options.key, limits=self._limits())
        except WireError as e:
            self.wire_refusals += 1
            log.warning("refused message from peer %s: %s", peer.hex(), e)
            return []
        try:
            return self.state.handle(peer, msg, now)
        except Exception:
            # A bug, not a bad message: keep serving the other islands.
            log.exception("internal error handling %s from peer %s", type(msg.header).__name__, peer.hex())
            return []

    def _checkpoint_if_due(self, wait: bool = False) -> None:
        """Start a due checkpoint on the writer thread; ``wait`` also waits for it (final)."""
        self._reap_writer(wait=wait)
        if not self.state.checkpoint_due or self._writer is not None:
            return  # a due checkpoint waits for the one in flight
        self.state.checkpoint_due = False
        if self.store is None or not self.state.initialised:
            return
        snap = self.state.snapshot()
        store = self.store
        self._writer_failed = False

        def write() -> None:
            try:
                store.save(snap)
            except Exception:  # noqa: BLE001 - reported on the loop thread
                log.exception("checkpoint write failed; the syncer keeps serving without it")
                self._writer_failed = True

        self._writer = threading.Thread(target=write, name="yeto-checkpoint", daemon=True)
        self._writer.start()
        if wait:
            self._reap_writer(wait=True)

    def _reap_writer(self, wait: bool) -> None:
        """Once the writer finished, release the snapshot's pins (on the loop thread)."""
        if self._writer is None:
            return
        if wait:
            self._writer.join()
        if self._writer.is_alive():
            return
        self._writer = None
        self.state.release_snapshot()

    def _write_events(self) -> None:
        events, self.state.events = self.state.events, []
        if self._events is None or not events:
            return
        for ev in events:
            self._events.write(json.dumps({"wall_time": time.time(), **ev}, sort_keys=True) + "\n")
        self._events.flush()

    def _send(self, outgoing: list[Outgoing]) -> None:
        # Frames for one (kind, fragment, version, dtype) are encoded once and
        # reused for every island; they are immutable once encoded.
        cache: dict[tuple[Any, ...], list[Any]] = {}
        for o in outgoing:
            frames = cache.get(o.cache_key) if o.cache_key is not None else None
            if frames is None:
                frames = encode(o.header, o.tensors, key=self.options.key, wire_dtype=o.wire_dtype)
                if o.cache_key is not None:
                    cache[o.cache_key] = frames
            try:
                self.sock.send_multipart([o.peer, *frames], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.dropped_sends += 1
                log.warning("peer %s is slow (send queue full): dropped %s", o.peer.hex(), type(o.header).__name__)
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self.dropped_sends += 1
                log.warning("peer %s is gone: dropped %s", o.peer.hex(), type(o.header).__name__)

    def _status(self, now: float) -> None:
        if now - self._last_status >= self.options.status_every_s:
            self._last_status = now
            log.info("status: %s wire_refusals=%d dropped_sends=%d", self.state.status(), self.wire_refusals, self.dropped_sends)

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Serve until the state finishes (its exit code) or ``stop_event`` is set (130)."""
        log.info("syncer %d serving on %s", self.state.syncer_id, self.endpoint)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self.state.finished:
                if self.stop_event.is_set():
                    log.warning("stopped: writing a checkpoint and exiting")
                    self._reap_writer(wait=True)
                    self.state.checkpoint_due = True
                    self._checkpoint_if_due(wait=True)
                    return EXIT_INTERRUPTED
                outgoing: list[Outgoing] = []
                if poller.poll(self.options.poll_ms):
                    for _ in range(self.options.max_batch):
                        try:
                            outgoing.extend(self._receive(time.monotonic()))
                        except zmq.Again:
                            break
                now = time.monotonic()
                outgoing.extend(self.state.tick(now))
                self._write_events()
                self._checkpoint_if_due()
                self._send(outgoing)
                self._status(now)
            # The final checkpoint: after any in flight, and synchronous.
            self._reap_writer(wait=True)
            self._checkpoint_if_due(wait=True)
            code = self.state.exit_code if self.state.exit_code is not None else EXIT_FINAL_FAILED
            if self._writer_failed and code == 0:
                log.error("the final checkpoint could not be written")
                code = EXIT_FINAL_FAILED
            log.info("syncer finished with exit code %d: %s", code, self.state.status())
            return code
        finally:
            self.close()

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        if not self.sock.closed:
            self.sock.close()  # LINGER lets queued SHUTDOWN frames flush

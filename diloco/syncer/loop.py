"""The syncer's control loop: a pyzmq ROUTER socket around the pure core (``core.Coordinator``).

One thread, the **control plane**, does only work whose cost does not grow with
bytes, in this order per iteration: poll (the socket and the data plane's wake-up
pipe), take finished data-plane results, open a bounded batch of messages (MAC
and header only: ``wire.open_message``) and feed them to the core,
``tick``, hand new payload work to the **data plane** (``dataplane.py``), start a
checkpoint if one fell due, send control messages, and top up the paced part
streams (``wire.pacing``).  So a heartbeat is answered within milliseconds while
a round of several GB is folded, merged and encoded on the worker threads.

Back-pressure: when the data plane holds more than ``max_backlog_bytes`` of
received parts, the loop stops reading the socket until it drains (zmq then
holds at most ``RCVHWM`` messages per island, and TCP throttles the senders), so
memory stays bounded by the core, not by what islands send. Meanwhile it waits on
the data plane's results, not on the socket it will not read.

Checkpoints are written on a background thread (``ckptwriter.py``): a loop blocked for the
minutes a large model takes would answer no heartbeat. The snapshot shares the state's tensors
and the writer lets go of each fragment once it is on disk, so it costs no memory (momentum: the
commit waits for that; a superseded value it still holds delays the next round, ``book.py``).
The price: a BCAST of version v may reach islands before the checkpoint holding v is durable; a
crash then rolls the islands back to the last checkpoint (a resumed syncer is a new instance,
whose cut every island installs), which loses inner steps but never mixes states. At most one
checkpoint is in flight; the final one (and the one on SIGTERM) is synchronous.

Sends never block: the ROUTER uses ``ROUTER_MANDATORY`` and ``NOBLOCK``, so a
peer that is gone (EHOSTUNREACH) or too slow (EAGAIN) loses that message,
logged, and every other island is served as usual. A lost value stream (BCAST,
cut, FINAL) or PULL is reported to the core (``Coordinator.on_lost``), which
resends it once the island is heard from again: nothing the core believes
delivered was dropped by the loop.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
import time
from typing import IO, Any

import zmq

from diloco.syncer.core.coordinator import Coordinator
from diloco.syncer.core.work import CommitPart, EncodePart, Result
from diloco.syncer.dataplane import DataPlane
from diloco.syncer.ckptwriter import CheckpointWriter
from diloco.syncer.encoded import EncodedCache
from diloco.syncer.faults import FaultHook, kinds_of
from diloco.syncer.links import LinkWatch
from diloco.syncer.consume import Consumption
from diloco.syncer.payloads import payload_source
from diloco.syncer.metrics import SyncerMetrics, frames_nbytes
from diloco.syncer.listener import open_listener, user_id
from diloco.syncer.loopoptions import LoopOptions
from diloco.syncer.core.records import Outgoing, OutStream
from diloco.syncer.store import CheckpointStore
from diloco.wire import Bcast, Final, Limits, Pull, WireError, digest_seed, encode, open_message, seal
from diloco.wire.pacing import Pacer, Stream, send_tracked

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FINAL_FAILED = 1
EXIT_INTERRUPTED = 130


class SyncerLoop:
    """Serve one :class:`Coordinator` on a ROUTER socket until it finishes or is stopped.

    Args:
        state: the core (fresh or resumed).
        options: socket settings.
        store: checkpoint store, or None to run without checkpoints.
        context: zmq context (a private one by default).
    """

    def __init__(
        self,
        state: Coordinator,
        options: LoopOptions,
        store: CheckpointStore | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.state = state
        self.options = options
        self.store = store
        self.ctx = context or zmq.Context.instance()
        self.stop_event = threading.Event()
        self.reload_keys = threading.Event()
        """Set (by SIGHUP) to re-read the Curve certificates directory."""
        self.wire_refusals = 0
        self.dropped_sends = 0
        self.listener = open_listener(self.ctx, options.bind, options.curve, options.limits, options.caps,
                                      options.sndhwm, options.rcvhwm, options.linger_ms)
        self.sock: zmq.Socket[Any] = self.listener.sock
        self.auth = self.listener.auth
        self.endpoint: str = self.listener.endpoint
        self._keyed_ids = options.curve is not None and options.curve.clients_dir is not None
        self._events: IO[str] | None = open(options.event_log, "a") if options.event_log else None
        self._last_status = 0.0
        self._writer = CheckpointWriter(store)
        self._results: queue.SimpleQueue[Result] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.data = DataPlane(options.data_threads, self._post)
        self.state.use_digest_seed(digest_seed(options.key))
        self._cache = EncodedCache()
        self._consumption = Consumption(self._cache)
        self._pacer = Pacer(options.window, self._send_tracked)
        self._tracked: list[tuple[Stream, OutStream]] = []
        self._held_behind: list[tuple[Stream, int, bytes]] = []
        """(stream, fragment, peer) of each held FINAL queued behind a stream still sending (at most
        one per fragment and island): lost with that stream, it is reported like the stream."""
        """Value streams handed to the pacer, until done: an abandoned one is reported lost."""
        self.faults = FaultHook.from_env()
        self.links = LinkWatch(state.config.islands)
        """Per-island throughput, PROGRESS notices, the "H too small" warning (``syncer/links.py``)."""
        self.lost_streams = 0
        self.bytes_in = 0
        self.bytes_out = 0
        """Bytes received / sent on the socket, every frame (``--metrics-port``)."""
        self.metrics: SyncerMetrics | None = None
        """Set before ``run`` to feed the metrics endpoint (``metrics.py``): events and a tick per turn."""
        self.loop_stall_max_s = 0.0
        """Longest iteration of the control loop (for benchmarks and the status line)."""
        self._room_part, self._room = 0, 0
        """The part bytes the backlog room was last sized for, and that room (:meth:`_backlog_room`)."""
        self._wire_limits = self._limits(state.book.part_elems * 4)
        """The wire limits for that part size (:meth:`_backlog_room` refreshes them)."""

    # ------------------------------------------------------------------ data plane glue

    def _post(self, result: Result) -> None:
        """Worker thread: queue a result and wake the loop (a full pipe already wakes it)."""
        self._results.put(result)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _take_results(self, now: float) -> list[OutStream | Outgoing]:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out: list[OutStream | Outgoing] = []
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return out
            work = result.work
            if isinstance(work, EncodePart) and work.sink is not None:
                if result.payloads:  # a part of one bf16 stream (``_on_demand``)
                    work.sink[work.part] = result.payloads[work.dtype]
                continue
            made = [result.payloads] if isinstance(work, EncodePart) else [p for p, _ in result.parts]
            if isinstance(work, (CommitPart, EncodePart)) and any(made):
                frag = self.state.fragments[work.fragment]
                assert frag.layout is not None
                n = frag.layout.n_parts(self.state.book.part_elems)
                for k, payloads in enumerate(made, start=work.part):
                    for dtype, payload in payloads.items():
                        self._cache.put(work.fragment, work.version, dtype, n, k, payload)
            if not isinstance(work, EncodePart):
                out.extend(self.state.on_result(result, now))

    def _submit_work(self, after_send: bool = False) -> None:
        """Hand the state's work to the data plane; a commit that may consume its old value waits for
        ``after_send`` (the turn's streams have started: ``consume.py``)."""
        self._consumption.route(self.state.take_work(), self.data.submit)
        if after_send:
            self._consumption.release(self.data.submit)

    # ------------------------------------------------------------------ steps

    def _limits(self, part: int) -> Limits:
        """Wire limits: a message is at most ``part`` bytes, one part of fp32 (the run's part size once
        the layout is fixed, the largest it may be before; pushes.py refuses a part off the cut)."""
        lim = self.options.limits
        return Limits(
            max_header_bytes=lim.max_header_bytes, max_tensors=lim.max_tensors,
            max_tensor_bytes=min(lim.max_tensor_bytes, part), max_message_bytes=min(lim.max_message_bytes, part),
            max_chunk_bytes=lim.max_chunk_bytes, max_ndim=lim.max_ndim, max_fragment_bytes=lim.max_fragment_bytes,
        )

    def _receive(self, now: float, limits: Limits) -> list[OutStream | Outgoing]:
        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        self.bytes_in += frames_nbytes(frames)
        peer = frames[0].bytes
        try:
            opened = open_message(frames[1:], key=self.options.key, limits=limits)
        except WireError as e:
            self.wire_refusals += 1
            log.warning("refused message from peer %s: %s", peer.hex(), e)
            return []
        except Exception as e:  # noqa: BLE001 - a decoder gap must cost one message, never the syncer
            self.wire_refusals += 1
            log.warning("refused undecodable message from peer %s: %s: %s", peer.hex(), type(e).__name__, e)
            return []
        sender_key = user_id(frames[1]) if self._keyed_ids else ""
        island = self.state.island_of(peer)
        self.links.on_receive(-1 if island is None else island, sum(len(f.buffer) for f in frames[3:]), now,
                              opened.header)
        try:
            return self.state.receive(peer, opened, now, sender_key)
        except Exception:
            # A bug, not a bad message: keep serving the other islands.
            log.exception("internal error handling %s from peer %s", type(opened.header).__name__, peer.hex())
            return []

    def _checkpoint_if_due(self, wait: bool = False) -> None:
        """Start a due checkpoint on the writer thread; ``wait`` also waits for it (final)."""
        self._reap_writer(wait=wait)
        if not self.state.checkpoint_due or self._writer.busy:
            return  # a due checkpoint waits for the one in flight
        if self.state.committing():
            return  # snapshot between commits: a commit in flight swaps buffers when it lands
        self.state.take_checkpoint()
        if self.store is None or not self.state.initialised:
            return
        self._writer.start(self.state.snapshot())
        if wait:
            self._reap_writer(wait=True)

    def _reap_writer(self, wait: bool) -> None:
        """Unpin the fragments the writer has written; once it finished, every pin (on the loop thread)."""
        self.state.unpin(self._writer.take_written())
        if self._writer.reap(wait):
            self.state.release_snapshot()

    def _write_events(self) -> None:
        events = self.state.take_events()
        if self.metrics is not None and events:
            self.metrics.on_events(events)
        if self._events is None or not events:
            return
        for ev in events:
            self._events.write(json.dumps({"wall_time": time.time(), **self.links.annotated(ev)}, sort_keys=True) + "\n")
        self._events.flush()

    def _send_tracked(self, peer: bytes, frames: list[Any], track: bool) -> Any:
        tracker = send_tracked(self.sock, [peer, *frames], zmq.NOBLOCK, track)
        self.bytes_out += frames_nbytes(frames)
        return tracker

    def _backlog_room(self) -> int:
        """Received part bytes the data plane may hold when the loop reads one more message: a whole
        part must fit under ``LoopOptions.backlog_cap`` (zmq holds ``rcvhwm`` more per island). It
        follows the part size the layout fixed; the budget is logged whenever that size is new."""
        part = self.state.book.part_elems * 4
        if part != self._room_part:
            self._room_part, self._room = part, self.options.backlog_cap(part) - part
            self._wire_limits = self._limits(part)
            log.info("received parts: %s", self.options.frames_budget(self.state.config.islands, part))
        return self._room

    def _stream(self, o: OutStream) -> Stream | None:
        """A paced stream of the parts of one BCAST/FINAL (``payloads.py``: shared fp32 views, bf16 on demand)."""
        state = self.state
        frag = state.fragments[o.fragment]
        assert frag.layout is not None
        E = state.book.part_elems
        n = frag.layout.n_parts(E)
        payload_of = payload_source(o, frag, E, state.digest_seed, self._cache, self.data.submit,
                                    self._consumption.versions)
        if payload_of is None:
            log.info("skipping %s of fragment %d version %d: superseded", o.kind, o.fragment, o.version)
            state.on_unsent(o.peer, o.fragment, o.version)
            return None
        key_bytes = self.options.key

        def frames_of(k: int) -> list[Any] | None:
            payload = payload_of(k)
            if payload is None:
                return None
            if o.kind == "BCAST":
                header: Any = Bcast(fragment=o.fragment, version=o.version, round=o.round, cut=o.cut, part=k, n_parts=n,
                                    commit_us=0 if o.cut or frag.version != o.version else int(frag.commit_s * 1e6))
            else:
                header = Final(fragment=o.fragment, version=o.version, n_fragments=state.n_fragments,
                               versions=o.versions, part=k, n_parts=n)
            nonce, seq = state.stamp(o.peer)
            return seal(header, payload, key=key_bytes, nonce=nonce, seq=seq)

        return Stream(n, frames_of, f"{o.kind} f{o.fragment} v{o.version}")

    def _seal_control(self, o: Outgoing) -> list[Any]:
        """Frames of a control message stamped with the peer's session (at send time)."""
        nonce, seq = self.state.stamp(o.peer)
        return encode(o.header, key=self.options.key, nonce=nonce, seq=seq)

    def _lost(self, peer: bytes, kind: str, fragment: int, cut: bool) -> None:
        self.lost_streams += 1
        self.state.on_lost(peer, kind, fragment, cut, time.monotonic())

    def _fault(self, o: OutStream | Outgoing) -> bool:
        """Test-only (``YETO_TEST_FAULTS``): True when this message is to be lost on purpose."""
        if self.faults is None:
            return False
        rec = next((i for i in self.state.islands if i.bound and i.peer == o.peer), None)
        after_done = isinstance(o, OutStream) and rec is not None and rec.holds_final(o.fragment, o.version)
        mode = self.faults.pick(kinds_of(o, after_done))
        if mode == "fail":  # as if the send failed: the state learns it
            if isinstance(o, OutStream):
                self._lost(o.peer, o.kind, o.fragment, o.cut)
            else:
                self._lost(o.peer, "PULL", -1, False)
        return mode is not None

    def _check_streams(self) -> None:
        """Report value streams the pacer abandoned (send error) to the state, which resends."""
        still = []
        for stream, o in self._tracked:
            if not stream.done.is_set():
                still.append((stream, o))
            elif not stream.ok:
                self._lost(o.peer, o.kind, o.fragment, o.cut)
                if stream.then:  # PULLs queued behind it were lost with it (the state re-pulls)
                    stream.then.clear()
        self._tracked = still
        for stream, fragment, peer in self._held_behind:
            if stream.done.is_set() and not stream.ok:  # the held FINALs behind it went with it
                self._lost(peer, "FINAL", fragment, False)
        self._held_behind = [e for e in self._held_behind if not e[0].done.is_set()]

    def _send(self, outgoing: list[OutStream | Outgoing]) -> None:
        for peer in self.state.take_superseded():  # a new HELLO of the island: its old connection's cut and streams end
            self._pacer.drop(peer, "superseded by a new HELLO of its island")
        for o in outgoing:
            if self._fault(o):
                continue
            if isinstance(o, OutStream):
                stream = self._stream(o)
                if stream is not None:
                    self._pacer.add(o.peer, stream)
                    self._tracked.append((stream, o))
                continue
            follows = isinstance(o.header, Pull) or isinstance(o.header, Final) and o.header.held
            behind = self._pacer.last_stream(o.peer) if follows else None
            if behind is not None:
                # A PULL follows every value already streaming to that island, so it is
                # answered against the newest anchor, and a held FINAL follows the value it
                # names; heartbeats and errors never wait.
                # Sealed when it is sent, so its sequence number follows the stream's.
                behind.then.append(lambda o=o: self._seal_control(o))
                if isinstance(o.header, Final):
                    self._held_behind.append((behind, o.header.fragment, o.peer))
                continue
            frames = self._seal_control(o)
            try:
                self.sock.send_multipart([o.peer, *frames], flags=zmq.NOBLOCK, copy=False)
                self.bytes_out += frames_nbytes(frames)
            except zmq.Again:
                self.dropped_sends += 1
                log.warning("peer %s is slow (send queue full): dropped %s", o.peer.hex(), type(o.header).__name__)
                if isinstance(o.header, Pull):
                    self._lost(o.peer, "PULL", -1, False)
                elif isinstance(o.header, Final):  # a held notice: owed as bytes once heard from
                    self._lost(o.peer, "FINAL", o.header.fragment, False)
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self.dropped_sends += 1
                self._pacer.drop(o.peer, "peer gone")
                log.warning("peer %s is gone: dropped %s", o.peer.hex(), type(o.header).__name__)
                if isinstance(o.header, Pull):
                    self._lost(o.peer, "PULL", -1, False)
                elif isinstance(o.header, Final):  # a held notice: owed as bytes once heard from
                    self._lost(o.peer, "FINAL", o.header.fragment, False)
        self._pacer.pump()
        self._check_streams()
        self._cache.prune(self.state.versions())
        self._consumption.prune(self.state.versions())

    def _status(self, now: float) -> None:
        if now - self._last_status >= self.options.status_every_s:
            self._last_status = now
            log.info("status: %s wire_refusals=%d dropped_sends=%d backlog=%.0fMiB streams=%d loop_max=%.0fms %s",
                     self.state.status(), self.wire_refusals, self.dropped_sends, self.data.backlog_bytes / 2**20,
                     self._pacer.pending(), self.loop_stall_max_s * 1e3, self.listener.guard.status())

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Serve until the state finishes (its exit code) or ``stop_event`` is set (130)."""
        log.info("syncer %d serving on %s (%d data-plane threads, parts of %s%g MiB)", self.state.syncer_id, self.endpoint,
                 self.data.threads, "" if self.state.config.part_elems else "auto, at most ", self.state.book.part_elems / 2**18)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.listener.guard.monitor, zmq.POLLIN)
        # While the data plane's backlog is at its cap the loop does not read the islands' socket, so
        # it must not wait on it either (readable, it would wake the loop at once, every time: a spin
        # that holds the GIL the data plane needs to drain): it waits for results and the monitor.
        held = zmq.Poller()
        held.register(self._wake_r, zmq.POLLIN)
        held.register(self.listener.guard.monitor, zmq.POLLIN)
        try:
            while not self.state.finished:
                if self.stop_event.is_set():
                    log.warning("stopped: writing a checkpoint and exiting")
                    self._drain_commits()
                    self._reap_writer(wait=True)
                    self.state.request_checkpoint()
                    self._checkpoint_if_due(wait=True)
                    return EXIT_INTERRUPTED
                if self.reload_keys.is_set() and self.auth is not None:
                    self.reload_keys.clear()
                    try:
                        self.auth.reload()
                    except ValueError as e:
                        log.error("SIGHUP: cannot re-read the island keys, keeping the old ones: %s", e)
                busy = self._pacer.pending() > 0
                room = self._backlog_room()
                limits = self._wire_limits
                full = self.data.backlog_bytes > room
                (held if full else poller).poll(1 if busy else self.options.poll_ms)
                t0 = time.monotonic()
                self.listener.guard.service(t0)
                outgoing = self._take_results(t0)
                for _ in range(self.options.max_batch):
                    if self.data.backlog_bytes > self._backlog_room():
                        break  # back-pressure: let the data plane catch up first
                    try:
                        outgoing.extend(self._receive(time.monotonic(), limits))
                    except zmq.Again:
                        break
                    self._submit_work()  # counted in the backlog before the next read
                now = time.monotonic()
                outgoing.extend(self.state.tick(now))
                outgoing.extend(self.links.observe(self.state, self._tracked, self._pacer.pending, now))
                self._submit_work()
                self._write_events()
                self._checkpoint_if_due()
                self._send(outgoing)
                self._submit_work(after_send=True)  # encodes asked for by new streams; held commits
                self._status(now)
                if self.metrics is not None:
                    self.metrics.tick(self, now)
                self.loop_stall_max_s = max(self.loop_stall_max_s, time.monotonic() - t0)
            # Flush what is still streaming (SHUTDOWN went out as control messages already).
            self._flush_streams(timeout_s=self.options.linger_ms / 1000.0)
            self._reap_writer(wait=True)
            self._checkpoint_if_due(wait=True)
            code = self.state.exit_code if self.state.exit_code is not None else EXIT_FINAL_FAILED
            if self._writer.failed and code == 0:
                log.error("the final checkpoint could not be written")
                code = EXIT_FINAL_FAILED
            log.info("syncer finished with exit code %d: %s; merged %s", code, self.state.status(),
                     self.state.merged_summary())
            return code
        finally:
            self.close()

    def _drain_commits(self, timeout_s: float = 60.0) -> None:
        """Let a commit in flight land before the last checkpoint (its buffers swap when it does)."""
        deadline = time.monotonic() + timeout_s
        while self.state.committing() and time.monotonic() < deadline:
            time.sleep(0.01)
            self._take_results(time.monotonic())
            self._submit_work(after_send=True)

    def _flush_streams(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._pacer.pending() and time.monotonic() < deadline:
            self._take_results(time.monotonic())
            self._submit_work(after_send=True)
            self._pacer.pump()
            time.sleep(0.002)

    def close(self) -> None:
        self.data.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._events is not None:
            self._events.close()
            self._events = None
        self.listener.close()
        self.auth = None

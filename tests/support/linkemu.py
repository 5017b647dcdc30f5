"""A slow link between an island and the syncer: a userspace TCP proxy (test support, not product code).

netem is not available on our machines, so tests and ``benchmarks/bench_wan.py`` put each
island behind its own :class:`LinkEmulator`: the island connects to the emulator's port, the
emulator connects to the syncer, and every byte crosses a rate limit per direction and a
one-way delay.

The link model, per direction:

* **rate**: a serializer shared by every connection of the emulator (one link, one pipe):
  a chunk of ``n`` bytes occupies the pipe ``n / rate`` seconds after the previous one left.
  The reader takes bytes off the source socket only as fast as the pipe drains, so TCP's own
  window pushes back on the sender (nothing buffers a whole fragment here).
* **delay**: each chunk is delivered ``delay_s`` (plus a uniform ``[0, jitter_s]``) after it
  left the pipe, never before an earlier chunk (TCP keeps order).
* **loss by reset**: :meth:`LinkEmulator.reset_all` (on command), :meth:`arm_reset` (once the
  ``n``-th byte of one direction counted from now would cross: that chunk is dropped and the
  connection is reset), or :meth:`reset_at` (at a monotonic time).
* **outage**: :meth:`arm_reset` with ``outage_s``: after the reset the link stays down that
  long; every connection attempt meanwhile is reset at once (counted in ``refused``, not in
  ``connections``), so the client's redials find nothing until the link comes back.  A reset closes both TCP
  sockets with ``SO_LINGER 0`` (an RST): bytes in flight are lost, as on a real link drop.

The emulator counts what it carried (:attr:`LinkEmulator.stats`): connections accepted,
bytes delivered per direction, resets.  Memory per connection is bounded by the
bandwidth-delay product (a bounded queue of chunks between the pipe and the delivery).
Every wait has a timeout; :meth:`close` stops every thread.
"""

from __future__ import annotations

import logging
import queue
import random
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

UP = "up"
"""Client (island) -> server (syncer)."""
DOWN = "down"
"""Server (syncer) -> client (island)."""

_POLL_S = 0.05
_EOF = b""


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link.

    Attributes:
        up_bytes_s: rate of the client -> server direction, bytes per second (0: unlimited).
        down_bytes_s: rate of the server -> client direction, bytes per second (0: unlimited).
        delay_s: one-way delay added to each chunk, seconds (>= 0).
        jitter_s: extra one-way delay drawn uniformly from ``[0, jitter_s]`` per chunk (order kept).
        seed: seed of the jitter draws.
    """

    up_bytes_s: float = 0.0
    down_bytes_s: float = 0.0
    delay_s: float = 0.0
    jitter_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("up_bytes_s", "down_bytes_s", "delay_s", "jitter_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"LinkSpec.{name} must be >= 0, got {value!r}")

    def rate(self, direction: str) -> float:
        return self.up_bytes_s if direction == UP else self.down_bytes_s


@dataclass
class LinkStats:
    """What the emulator carried (monotonic counters)."""

    connections: int = 0
    """TCP connections accepted from the client side."""
    bytes: dict[str, int] = field(default_factory=lambda: {UP: 0, DOWN: 0})
    """Bytes delivered to the far side, per direction."""
    resets: int = 0
    """Connections reset by the emulator."""
    refused: int = 0
    """Connection attempts reset at once because the link was down (an outage)."""


class _Pipe:
    """The serializer of one direction: when does a chunk of ``n`` bytes leave the pipe?"""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0
        self._lock = threading.Lock()

    def leave_time(self, n: int) -> float:
        with self._lock:
            now = time.monotonic()
            if self.rate <= 0:
                return now
            self._free_at = max(now, self._free_at) + n / self.rate
            return self._free_at


@dataclass
class _ResetRule:
    direction: str
    after_bytes: int
    outage_s: float = 0.0
    seen: int = 0
    fired: bool = False


class _Connection:
    """One client connection and its upstream connection, with a reader and a writer per direction."""

    def __init__(self, emu: LinkEmulator, client: socket.socket, server: socket.socket, index: int) -> None:
        self.emu = emu
        self.index = index
        self.socks = {UP: (client, server), DOWN: (server, client)}
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._eof_sent = {UP: False, DOWN: False}
        self.threads: list[threading.Thread] = []
        for d in (UP, DOWN):
            q: queue.Queue[tuple[float, bytes]] = queue.Queue(maxsize=emu.queue_chunks(d))
            self.threads.append(threading.Thread(target=self._read, args=(d, q), daemon=True,
                                                 name=f"linkemu-{index}-{d}-read"))
            self.threads.append(threading.Thread(target=self._write, args=(d, q), daemon=True,
                                                 name=f"linkemu-{index}-{d}-write"))
        for t in self.threads:
            t.start()

    def _read(self, d: str, q: queue.Queue[tuple[float, bytes]]) -> None:
        src = self.socks[d][0]
        pipe = self.emu.pipes[d]
        chunk = self.emu.chunk_bytes(d)
        rng = random.Random(self.emu.spec.seed * 1000 + self.index * 2 + (d == DOWN))
        last_deliver = 0.0
        try:
            while not self.closed.is_set():
                ready, _, _ = select.select([src], [], [], _POLL_S)
                if not ready:
                    continue
                data = src.recv(chunk)
                if self.emu.take_reset(self, d, len(data)):
                    return
                leave = pipe.leave_time(len(data)) if data else time.monotonic()
                while not self.closed.is_set() and time.monotonic() < leave:  # the pipe drains at its rate
                    time.sleep(min(_POLL_S, max(0.0, leave - time.monotonic())))
                jitter = rng.uniform(0.0, self.emu.spec.jitter_s) if self.emu.spec.jitter_s > 0 else 0.0
                last_deliver = max(last_deliver, leave + self.emu.spec.delay_s + jitter)
                while not self.closed.is_set():
                    try:
                        q.put((last_deliver, data), timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
                if not data:
                    return
        except OSError:
            self.reset("read error")

    def _write(self, d: str, q: queue.Queue[tuple[float, bytes]]) -> None:
        dst = self.socks[d][1]
        try:
            while not self.closed.is_set():
                try:
                    at, data = q.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                while not self.closed.is_set() and time.monotonic() < at:
                    time.sleep(min(_POLL_S, max(0.0, at - time.monotonic())))
                if self.closed.is_set():
                    return
                if data is _EOF or not data:
                    dst.shutdown(socket.SHUT_WR)
                    with self._lock:
                        self._eof_sent[d] = True
                        both = all(self._eof_sent.values())
                    if both:
                        self.close()
                    return
                dst.sendall(data)
                self.emu.count(d, len(data))
        except OSError:
            self.reset("write error")

    def reset(self, why: str) -> None:
        """Close both sockets with an RST (SO_LINGER 0): whatever is in flight is lost."""
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        log.info("linkemu: connection %d reset (%s)", self.index, why)
        for s in self.socks[UP]:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for s in self.socks[UP]:
            s.close()


class LinkEmulator:
    """A TCP proxy from a local port to ``target`` that behaves like a slow link.

    Args:
        target: ``(host, port)`` of the server (the syncer's bound TCP endpoint).
        spec: rates, delay and jitter.
        host: where to listen (an ephemeral port on it).
        sock_buf_bytes: kernel send/receive buffer of the emulator's sockets: small, so the
            sender's view of "sent" stays close to what the link carried.

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, target: tuple[str, int], spec: LinkSpec, host: str = "127.0.0.1",
                 sock_buf_bytes: int = 128 << 10) -> None:
        self.target = target
        self.spec = spec
        self.sock_buf_bytes = sock_buf_bytes
        self.stats = LinkStats()
        self.pipes = {UP: _Pipe(spec.up_bytes_s), DOWN: _Pipe(spec.down_bytes_s)}
        self._lock = threading.Lock()
        self._conns: list[_Connection] = []
        self._rules: list[_ResetRule] = []
        self._down_until = 0.0
        """Monotonic time an outage ends (connection attempts before it are reset)."""
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(16)
        self.port: int = self._listener.getsockname()[1]
        self.address = f"tcp://{host}:{self.port}"
        """The endpoint a client dials instead of the server's."""
        self._acceptor = threading.Thread(target=self._accept, name="linkemu-accept", daemon=True)
        self._timers: list[threading.Timer] = []

    # ------------------------------------------------------------------ sizing
    def chunk_bytes(self, d: str) -> int:
        """Bytes read at once: about 5 ms of the link, between 1 KiB and 64 KiB."""
        rate = self.spec.rate(d)
        return 64 << 10 if rate <= 0 else int(min(64 << 10, max(1 << 10, rate * 0.005)))

    def queue_chunks(self, d: str) -> int:
        """Chunks between the pipe and the delivery: twice the bandwidth-delay product, at least 8."""
        rate = self.spec.rate(d)
        if rate <= 0:
            return 64
        bdp = rate * (self.spec.delay_s + self.spec.jitter_s)
        return max(8, int(2 * bdp / self.chunk_bytes(d)) + 2)

    # ------------------------------------------------------------------ life
    def start(self) -> LinkEmulator:
        self._acceptor.start()
        return self

    def __enter__(self) -> LinkEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, reset every connection, join the threads (bounded)."""
        self._stop.set()
        for t in self._timers:
            t.cancel()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()
        self._acceptor.join(timeout=2.0)
        for c in conns:
            for t in c.threads:
                t.join(timeout=2.0)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], _POLL_S)
                if not ready:
                    continue
                client, _addr = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = time.monotonic() < self._down_until
                self.stats.refused += down
            if down:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5.0)
            except OSError as exc:
                log.warning("linkemu: cannot reach %s: %s", self.target, exc)
                client.close()
                continue
            for s in (client, server):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sock_buf_bytes)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.sock_buf_bytes)
            with self._lock:
                self.stats.connections += 1
                index = self.stats.connections
                conn = _Connection(self, client, server, index)
                self._conns = [c for c in self._conns if not c.closed.is_set()] + [conn]

    # ------------------------------------------------------------------ counters and faults
    def count(self, d: str, n: int) -> None:
        with self._lock:
            self.stats.bytes[d] += n

    def carried(self, d: str) -> int:
        """Bytes delivered so far in direction ``d``."""
        with self._lock:
            return self.stats.bytes[d]

    def connections(self) -> int:
        with self._lock:
            return self.stats.connections

    def arm_reset(self, direction: str, after_bytes: int, outage_s: float = 0.0) -> None:
        """Reset the connection carrying byte ``after_bytes`` of ``direction`` counted from now (once);
        then the link stays down for ``outage_s`` seconds (connection attempts are reset at once)."""
        if direction not in (UP, DOWN) or after_bytes < 0 or not outage_s >= 0:
            raise ValueError(f"arm_reset: direction {direction!r} / after_bytes {after_bytes} / outage_s {outage_s}")
        with self._lock:
            self._rules.append(_ResetRule(direction, after_bytes, outage_s))

    def reset_at(self, when: float) -> None:
        """Reset every connection at monotonic time ``when``."""
        timer = threading.Timer(max(0.0, when - time.monotonic()), self.reset_all)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def reset_all(self) -> int:
        """Reset every open connection now; returns how many."""
        with self._lock:
            conns = [c for c in self._conns if not c.closed.is_set()]
            self.stats.resets += len(conns)
        for c in conns:
            c.reset("on command")
        return len(conns)

    def take_reset(self, conn: _Connection, d: str, n: int) -> bool:
        """Reader hook: True (and the connection reset) when an armed rule fires on these bytes."""
        with self._lock:
            fire = False
            for rule in self._rules:
                if rule.fired or rule.direction != d:
                    continue
                if rule.seen + n > rule.after_bytes:
                    rule.fired = fire = True
                    self._down_until = max(self._down_until, time.monotonic() + rule.outage_s)
                else:
                    rule.seen += n
            if fire:
                self.stats.resets += 1
        if fire:
            conn.reset(f"armed rule after {d} bytes")
        return fire

"""Connection caps of the syncer's listening socket: what an unauthenticated peer may hold.

libzmq has no connection limit of its own, and every accepted TCP connection costs the
syncer one file descriptor and a few KiB of engine buffers before any mechanism has run.
:class:`ConnGuard` follows the socket monitor's ``ACCEPTED`` / ``DISCONNECTED`` events (keyed
by file descriptor) and shuts down, at once, a connection that would exceed:

* ``max_connections`` open connections in all;
* ``max_per_address`` open connections from one source address;
* ``max_handshaking`` connections still in their handshake in all, and
  ``max_handshaking_per_address`` from one address.

"In the handshake" means accepted less than the handshake timeout ago (``ZMQ_HANDSHAKE_IVL``):
libzmq closes a connection whose handshake has not finished by then, so one older than that
that is still open has authenticated.  (libzmq 4.3's handshake events carry no file
descriptor, so they cannot be tied to a connection; the age rule is exact up to the
timeout.)  A refused connection is shut down through a duplicate of its descriptor
(``shutdown(2)`` acts on the socket, not the descriptor), so libzmq sees an ordinary EOF and
closes it itself; the guard never closes libzmq's descriptor.  A descriptor is only acted on
after its peer address was read from the descriptor itself, and a tracked entry whose inode
changed (the number was reused) is forgotten, so a stale event never hits another peer.

Memory: one small record per open connection, bounded by ``max_connections``.  No I/O
besides ``getpeername``/``fstat``/``shutdown`` on descriptors the monitor named.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

MIN_LIBZMQ = (4, 3, 3)
"""libzmq releases before 4.3.3 have pre-authentication bugs (CVE-2019-13132, CVE-2020-15166)."""


@dataclass(frozen=True)
class ConnCaps:
    """Caps on connections (see the module docstring); every value >= 1.

    Attributes:
        max_connections: open connections in all (``--max-connections``).
        max_per_address: open connections from one source IP (``--max-connections-per-address``).
        max_handshaking: connections in their handshake in all (``--max-handshaking``).
        max_handshaking_per_address: in their handshake from one IP (``--max-handshaking-per-address``).
        handshake_s: the handshake timeout (``--handshake-timeout-s``), also ``ZMQ_HANDSHAKE_IVL``.
    """

    max_connections: int = 1024
    max_per_address: int = 64
    max_handshaking: int = 64
    max_handshaking_per_address: int = 8
    handshake_s: float = 5.0

    def __post_init__(self) -> None:
        flags = {"max_connections": "--max-connections", "max_per_address": "--max-connections-per-address",
                 "max_handshaking": "--max-handshaking", "max_handshaking_per_address": "--max-handshaking-per-address"}
        for name, flag in flags.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}: must be an int >= 1, got {value!r}")
        if not 0.1 <= self.handshake_s <= 600:
            raise ValueError(f"--handshake-timeout-s: must be in [0.1, 600], got {self.handshake_s}")


def check_libzmq(version: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The libzmq version; ValueError naming it when older than :data:`MIN_LIBZMQ`."""
    have = version if version is not None else zmq.zmq_version_info()
    if tuple(have) < MIN_LIBZMQ:
        raise ValueError(f"libzmq {'.'.join(map(str, have))} is older than "
                         f"{'.'.join(map(str, MIN_LIBZMQ))} (pre-authentication CVE-2019-13132, CVE-2020-15166): "
                         f"upgrade pyzmq / libzmq")
    return tuple(have)


def raise_fd_limit(want: int = 1 << 20) -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE toward the hard limit (at most ``want``); (old soft, new soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    new = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            new = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    log.info("open-file limit: soft %d -> %d, hard %s", soft, new, "unlimited" if hard == resource.RLIM_INFINITY
             else hard)
    return soft, new, hard


def harden_socket(sock: zmq.Socket[Any], max_frame_bytes: int, caps: ConnCaps) -> None:
    """Frame size and handshake timeout of the listening socket (before ``bind``).

    ``ZMQ_MAXMSGSIZE`` bounds every frame a peer may make libzmq buffer, the handshake's
    command frames included (libzmq allocates them before any mechanism has run), so it is
    the per-connection pre-authentication cost: keep ``max_frame_bytes`` small."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(caps.handshake_s * 1000))


@dataclass
class _Conn:
    address: str
    inode: int
    accepted: float


class ConnGuard:
    """Enforce :class:`ConnCaps` on one bound zmq socket through its monitor.

    Call :meth:`service` when :attr:`monitor` is readable (register it in the loop's poller)
    and periodically; it never blocks.  Counters: ``accepted``, ``refused`` (by reason)."""

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], caps: ConnCaps) -> None:
        self.caps = caps
        addr = f"inproc://yeto-connguard-{id(self):x}"
        sock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.monitor: zmq.Socket[Any] = ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # never lose an event (each is a few dozen bytes)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(addr)
        self._sock = sock
        self.conns: dict[int, _Conn] = {}
        self.accepted = 0
        self.refused: Counter[str] = Counter()
        self._last_sweep = 0.0

    def service(self, now: float) -> None:
        """Drain monitor events; shut down connections over a cap."""
        events: list[tuple[int, int]] = []
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                ev = parse_monitor_message(frames)
            except Exception:  # noqa: BLE001 - a malformed monitor frame must not stop the syncer
                continue
            events.append((int(ev["event"]), int(ev["value"])))
        for event, fd in events:
            if event == zmq.EVENT_ACCEPTED:
                self.accepted += 1
                self._admit(fd, now)
            elif event == zmq.EVENT_DISCONNECTED:
                self.conns.pop(fd, None)
        if now - self._last_sweep >= 1.0:
            self._last_sweep = now
            self._sweep()

    def _admit(self, fd: int, now: float) -> None:
        try:
            st = os.fstat(fd)
            with socket.socket(fileno=os.dup(fd)) as s:
                address = str(s.getpeername()[0])
        except OSError:
            self.conns.pop(fd, None)
            return  # already gone
        self.conns.pop(fd, None)
        reason = self._over_cap(address, now)
        if reason is None:
            self.conns[fd] = _Conn(address, st.st_ino, now)
            return
        self.refused[reason] += 1
        total = sum(self.refused.values())
        if total <= 5 or total % 1000 == 0:  # one line per refusal would let a stranger fill the log
            log.warning("connection from %s refused: %s (%d refused so far: %s)", address, reason, total,
                        dict(self.refused))
        self._shutdown(fd, st.st_ino)

    def _over_cap(self, address: str, now: float) -> str | None:
        caps = self.caps
        if len(self.conns) >= caps.max_connections:
            return f"max_connections ({caps.max_connections})"
        same = [c for c in self.conns.values() if c.address == address]
        if len(same) >= caps.max_per_address:
            return f"max_connections_per_address ({caps.max_per_address})"
        young = [c for c in self.conns.values() if now - c.accepted < caps.handshake_s]
        if len(young) >= caps.max_handshaking:
            return f"max_handshaking ({caps.max_handshaking})"
        if sum(c.address == address for c in young) >= caps.max_handshaking_per_address:
            return f"max_handshaking_per_address ({caps.max_handshaking_per_address})"
        return None

    @staticmethod
    def _shutdown(fd: int, inode: int) -> None:
        try:
            dup = os.dup(fd)
        except OSError:
            return
        try:
            if os.fstat(dup).st_ino == inode:
                s = socket.socket(fileno=dup)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                finally:
                    s.detach()  # the descriptor is closed below, once
        except OSError:
            pass
        finally:
            os.close(dup)

    def _sweep(self) -> None:
        """Forget entries whose descriptor closed or now names another socket (a lost event)."""
        for fd, conn in list(self.conns.items()):
            try:
                if os.fstat(fd).st_ino == conn.inode:
                    continue
            except OSError:
                pass
            del self.conns[fd]

    def status(self) -> str:
        return f"conns={len(self.conns)} conn_refused={sum(self.refused.values())}"

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)

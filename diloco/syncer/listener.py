"""The syncer's listening socket: a ROUTER hardened against peers that never authenticate.

What an unauthenticated peer may cost is fixed here, before ``bind``:

* every frame is at most ``frame_limit(limits)`` bytes (``ZMQ_MAXMSGSIZE``): the largest chunk
  or header the syncer accepts plus :data:`FRAME_SLACK`.  libzmq applies it to the
  handshake's command frames too, which it buffers before any mechanism has run, so the
  syncer's limits keep chunks and headers at 1 MiB (islands send 1 MiB chunks,
  ``wire.DEFAULT_CHUNK_BYTES``) and bulk data only ever travels as many such frames of a part;
* the handshake must finish within ``--handshake-timeout-s`` (``ZMQ_HANDSHAKE_IVL``);
* connections are capped in all, per source address and while handshaking
  (:class:`diloco.syncer.connguard.ConnGuard`);
* Curve mode: the ZAP domain is enforced, so an unlisted key fails the handshake;
* libzmq older than 4.3.3 is refused, and the open-file soft limit is raised toward the hard one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import zmq

from diloco.security import ServerAuth, ServerCurve
from diloco.syncer.connguard import ConnCaps, ConnGuard, check_libzmq, harden_socket, raise_fd_limit
from diloco.wire import Limits

log = logging.getLogger(__name__)

FRAME_SLACK = 4096
"""Bytes above the largest chunk or header a frame may have (an empty MAC frame, rounding)."""

SYNCER_LIMITS = Limits(max_header_bytes=1 << 20, max_chunk_bytes=1 << 20)
"""The syncer's default wire limits: 1 MiB chunks and headers keep every pre-authentication frame small."""


def user_id(frame: Any) -> str:
    """The ZAP User-Id of a received frame (Curve mode: the client key, Z85, which owns the island id
    it claims; ``gate.py``), or "" when it has none."""
    try:
        return str(frame.get("User-Id"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""


def frame_limit(limits: Limits) -> int:
    """``ZMQ_MAXMSGSIZE`` of the syncer's socket for ``limits``."""
    return max(limits.max_chunk_bytes, limits.max_header_bytes) + FRAME_SLACK


@dataclass
class Listener:
    """The bound socket with its ZAP handler and connection guard (close with :meth:`close`)."""

    sock: zmq.Socket[Any]
    auth: ServerAuth | None
    guard: ConnGuard
    endpoint: str

    def close(self) -> None:
        self.guard.close()
        if not self.sock.closed:
            self.sock.close()  # LINGER lets queued SHUTDOWN frames flush
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


def open_listener(ctx: zmq.Context[Any], bind: str, curve: ServerCurve | None, limits: Limits, caps: ConnCaps,
                  sndhwm: int, rcvhwm: int, linger_ms: int) -> Listener:
    """Create, harden and bind the ROUTER (see the module docstring); raises on a bad endpoint."""
    version = check_libzmq()
    raise_fd_limit()
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    auth: ServerAuth | None = None
    if curve is not None:
        # The ZAP handler runs before bind: an unlisted peer fails the handshake, so zmq never
        # buffers a frame of it beyond the handshake's own (docs/SECURITY.md).
        auth = ServerAuth(ctx, curve)
        auth.secure(sock)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    limit = frame_limit(limits)
    harden_socket(sock, limit, caps)
    guard = ConnGuard(ctx, sock, caps)
    try:
        sock.bind(bind)
    except zmq.ZMQError:
        guard.close()
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        raise
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    log.info("listener %s: libzmq %s, frames <= %d KiB before and after authentication, handshake timeout %.1fs, "
             "caps: %d connections (%d per address), %d handshaking (%d per address)", endpoint,
             ".".join(map(str, version)), limit >> 10, caps.handshake_s, caps.max_connections, caps.max_per_address,
             caps.max_handshaking, caps.max_handshaking_per_address)
    return Listener(sock, auth, guard, endpoint)

"""The island's second connection for INIT (``wire.Lane``), owned by the client's thread.

One zmq TCP stream carries about 5 GB/s on loopback and two about 8 (docs/PERFORMANCE.md), so
island 0 sends INIT on two connections when the syncer's WELCOME offers a lane
(``Welcome.lanes``, the syncer's ``--init-lanes``): a DEALER socket in a zmq context of its own
(its own I/O thread), bound to the session by a ``Lane`` message sealed with the lane's nonce
(``protocol.session.lane_nonce``) and its own sequence numbers; it is opened once per session,
when WELCOME asks for INIT. INIT streams go on it only after the syncer's ``LaneOk`` (on the first
connection) says it is bound: a lane lost or refused before that costs nothing but its speed.
A whole fragment's INIT stream goes on one connection, so its parts arrive in order; nothing
else travels on the lane and nothing comes back on it (the syncer answers a refusal on the first
connection). The lane lives with its session: a redial closes it, and the parked INIT streams
resume on the new first connection.

Memory: none of its own beyond zmq's queue of ``outbox.WINDOW`` parts (INIT parts are views of
the island's host values).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import zmq

from diloco import wire
from diloco.security import secure_client
from diloco.wire.pacing import Pacer, send_tracked

log = logging.getLogger(__name__)

__all__ = ["BIND_WAIT_S", "InitLane", "dial"]

BIND_WAIT_S = 2.0
"""Longest a second INIT stream waits for the syncer's ``LaneOk`` before it goes on the first
connection too (a loopback round trip takes milliseconds; a lane refused or lost costs this once)."""


def dial(sock: zmq.Socket[Any], routing_id: str, rcvhwm: int, max_msg_bytes: int, curve: Any, address: str) -> None:
    """Set up an island's DEALER socket the one way both of its connections use (no linger, a
    64-message send queue, ``rcvhwm`` received messages, frames above ``max_msg_bytes`` refused
    before zmq allocates them, Curve when given) and connect it to ``address``."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    if curve is not None:
        secure_client(sock, curve)
    sock.connect(address)


class InitLane:
    """The lane socket and its pacer, opened on demand for the current session.

    Args:
        island: our island id (for the routing id and the log).
        address: the syncer's address (the first connection's).
        curve: the client's Curve settings, or None (HMAC / insecure).
        window: parts of ours zmq may hold on the lane (``outbox.WINDOW``).
    """

    def __init__(self, island: int, address: str, curve: Any, window: int) -> None:
        self.island = island
        self.address = address
        self.curve = curve
        self.window = window
        self.ctx: zmq.Context[Any] | None = None
        self.sock: zmq.Socket[Any] | None = None
        self.pacer: Pacer | None = None
        self.generation = -1
        self.opened_at = 0.0
        """Clock when the lane of ``generation`` was opened (its ``Lane`` sent)."""

    def connect(self, generation: int, lane_open: Callable[[], list]) -> Pacer:
        """Open the lane of session ``generation`` and send its ``Lane`` message (``lane_open``:
        the sealed frames); returns its pacer. The socket's options are the first connection's."""
        self.close()
        self.generation = generation  # one try per session, whatever happens below
        self.opened_at = time.monotonic()
        self.ctx = zmq.Context(io_threads=1)
        sock = self.sock = self.ctx.socket(zmq.DEALER)
        # Nothing comes back on a lane: the smallest receive queue and frame limit.
        dial(sock, f"island-{self.island}-{generation:x}-lane", 1, wire.Limits().max_header_bytes + (1 << 20),
             self.curve, self.address)
        sock.send_multipart(lane_open(), copy=False)
        self.pacer = Pacer(self.window, lambda _dest, frames, track: send_tracked(sock, frames, zmq.NOBLOCK, track))
        log.info("island %d: INIT lane open to %s (generation %x)", self.island, self.address, generation)
        return self.pacer

    def close(self) -> None:
        """Close the lane (a redial, or the client's end); its streams are the client's to park. The
        session it was opened for stays remembered (``generation``): one lane per session."""
        if self.sock is not None:
            self.sock.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
        self.ctx = self.sock = self.pacer = None

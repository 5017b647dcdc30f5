"""Free localhost TCP ports for tests that must name an address before a process binds it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOW = 10000
"""Lowest port :func:`free_port` hands out."""


def _ephemeral_low() -> int:
    """The first port the kernel hands to ``bind(port 0)`` and outgoing connections (Linux), or 0."""
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Taken below the kernel's ephemeral range where there is room, so no ``bind(0)`` or outgoing
    connection of another process (gloo pairs, a syncer's zmq socket) can be given it before
    the test's process binds it; elsewhere any free port. The port is released before returning,
    so a process naming the same port may still take it first: use it only where the binder cannot
    pick its own (``bind_to_random_port`` / port 0 are race-free and preferred).
    """
    low = _ephemeral_low()
    if low - _LOW >= 1000:
        for _ in range(64):
            port = random.randrange(_LOW, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_addr() -> str:
    """``tcp://127.0.0.1:<free port>`` (see :func:`free_port` for the race it leaves)."""
    return f"tcp://127.0.0.1:{free_port()}"

"""Free localhost TCP ports for tests that must name an address before a process binds it."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    The port is released before returning, so another process may take it first; use it only where
    the binder cannot pick its own (``bind_to_random_port`` / port 0 are race-free and preferred).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_addr() -> str:
    """``tcp://127.0.0.1:<free port>`` (see :func:`free_port` for the race it leaves)."""
    return f"tcp://127.0.0.1:{free_port()}"

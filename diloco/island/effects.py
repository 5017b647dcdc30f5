"""What the island's sync-client protocol asks its connection to do (``ClientProtocol``'s output).

The protocol (:mod:`diloco.island.client_protocol`) does no I/O; each call into it returns an
:class:`Effects` that the connection thread (:mod:`diloco.island.client`) carries out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco import wire

BACKOFF_START_S = 0.2
"""First redial delay after a socket error or a silence; doubled on each further one."""
BACKOFF_MAX_S = 10.0
"""Longest redial delay."""
CHUNK_PARALLEL = False
"""``parallel`` of the island's chunk work (the outbox's digests, the inbox's verify-and-copy): on
the client thread, never on the shared chunk threads of ``diloco.wire.chunks``. The client shares
the GIL with the training loop, and every future of a chunk takes the GIL several times on two
threads: on a 2.7B ms-swift island the client and its chunk threads held 18 % of the GIL samples,
most of it in futures. Inline is also twice as fast flat out (``scripts/probe_client_gil.py``;
docs/PERFORMANCE.md, session 14). xxh3 and numpy's copy release the GIL for each 1 MiB chunk."""


def chunk_parallel(header: wire.Header, done: bool = False) -> bool:
    """``parallel`` of one message's chunk work: on the shared chunk threads for INIT (sent before
    the first step), FINAL (received after the last), and everything once the island said ``done``
    (the flush pushes and the broadcasts that end the run), when no training loop shares the GIL
    and the chunk work is all the island does; else :data:`CHUNK_PARALLEL`. On the device, INIT's
    client thread hashing inline ran at 88 % of a core and held INIT to 4.2 GB/s (docs/PERFORMANCE.md,
    session 23)."""
    return CHUNK_PARALLEL or done or isinstance(header, (wire.Init, wire.Final))


class SyncError(RuntimeError):
    """The syncer refused this island for good (e.g. a layout fingerprint mismatch)."""


@dataclass
class Effects:
    """What the connection must do after a call into the protocol."""

    redial_s: float | None = None
    """Close the socket and dial again after this many seconds (None: keep the connection)."""
    wake: bool = False
    """Something was parked or changed: wake the training thread's waits."""
    heartbeat: bool = False
    """Queue a HEARTBEAT now."""
    send: list[wire.Header] = field(default_factory=list)
    """Control messages to queue (sent once the connection has a session)."""
    rejoin: bool = False
    """The redial carries out the rejoin that was asked for."""

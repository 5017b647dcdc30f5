"""The settings of the syncer's control loop (``loop.SyncerLoop``): socket, batching, back-pressure."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.security import ServerCurve
from diloco.syncer.connguard import ConnCaps
from diloco.syncer.dataplane import default_threads
from diloco.syncer.listener import SYNCER_LIMITS
from diloco.wire import Limits


BACKLOG_PARTS = 2
"""Received parts per data-plane worker the loop reads ahead: one in work and one waiting, so a
worker that finishes finds its next part at once instead of waiting for the loop's next read."""


@dataclass(frozen=True)
class LoopOptions:
    """Socket and housekeeping settings of the loop.

    Attributes:
        bind: zmq endpoint to bind, e.g. ``tcp://0.0.0.0:5555``.
        key: shared HMAC key (``b""``: unauthenticated).
        limits: wire limits applied to every inbound message; its largest chunk or header also
            sizes ``ZMQ_MAXMSGSIZE``, the pre-authentication cost (``listener.py``).
        caps: connection caps and handshake timeout (``connguard.py``).
        poll_ms: poll timeout when nothing is being streamed; bounds how late ``tick`` runs.
        max_batch: messages handled per iteration before ``tick`` and sends.
        sndhwm: per-peer send queue bound (messages); beyond it sends fail fast.
        rcvhwm: per-peer receive queue bound (messages, each up to one part) zmq may hold for us
            (1 stalls the PLAIN handshake of HMAC mode: measured, no message is ever delivered).
        window: parts of one stream destination zmq may hold at once (``wire.pacing``).
        data_threads: data-plane workers (``--data-threads``).
        max_backlog_bytes: received part bytes the data plane may hold before the loop stops reading;
            :meth:`backlog_cap` turns it into the loop's bound.
        linger_ms: how long close() may spend flushing SHUTDOWN at exit.
        status_every_s: period of the one-line status log.
        event_log: path of the JSON-lines commit log (None: none).
        curve: CurveZMQ keys and admitted island keys (None: plain TCP, ``--insecure``).
    """

    bind: str = "tcp://0.0.0.0:5555"
    key: bytes = b""
    limits: Limits = SYNCER_LIMITS
    caps: ConnCaps = field(default_factory=ConnCaps)
    poll_ms: int = 20
    max_batch: int = 64
    sndhwm: int = 1000
    rcvhwm: int = 2
    window: int = 2
    data_threads: int = field(default_factory=default_threads)
    max_backlog_bytes: int = 128 << 20
    linger_ms: int = 2000
    status_every_s: float = 2.0
    event_log: str | None = None
    curve: ServerCurve | None = None

    def backlog_cap(self, message_bytes: int) -> int:
        """Received bytes the data plane may hold before the loop stops reading (the loop reads a
        message only while a whole one still fits): :data:`BACKLOG_PARTS` messages of up to
        ``message_bytes`` per worker, at most ``max_backlog_bytes``, never less than one message."""
        return max(message_bytes, min(self.max_backlog_bytes, BACKLOG_PARTS * self.data_threads * message_bytes))

    def frames_budget(self, islands: int, message_bytes: int) -> str:
        """The received frames the syncer may hold at once, for the start-up log: zmq's ``rcvhwm``
        messages plus the one being read, per connection (one per island; a peer still in its
        handshake adds its own), and the data plane's backlog."""
        backlog = self.backlog_cap(message_bytes)
        if self.rcvhwm <= 0:
            return f"zmq per connection: unbounded (RCVHWM {self.rcvhwm}); data-plane backlog {backlog / 2**20:.1f} MiB"
        per_island = self.rcvhwm + 1
        total = islands * per_island * message_bytes + backlog
        return (f"at most {total / 2**20:.1f} MiB held (zmq: {per_island} messages of up to "
                f"{message_bytes / 2**20:.1f} MiB per connection, {islands} islands; data-plane backlog "
                f"{backlog / 2**20:.1f} MiB)")

"""The events the syncer's core takes (``Coordinator.handle``) and the gauges it answers with.

Events are what happens to a syncer: a message arrived (a HELLO, a part, a heartbeat...), the
data plane finished a job (a :class:`~diloco.syncer.core.work.Result`), the clock moved on, or a
message could not be delivered. The driver builds them from its socket, workers and timers; the
core never sees those. Plain frozen records, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.syncer.core.work import Result
from diloco.wire import Opened


@dataclass(frozen=True)
class Received:
    """One opened message (MAC and header checked, payload not read) from routing id ``peer``;
    ``sender_key``: the Z85 Curve key it was authenticated with (empty outside Curve mode)."""

    peer: bytes
    msg: Opened
    sender_key: str = ""


@dataclass(frozen=True)
class Tick:
    """The clock moved on: apply the time rules (dead islands, grace, quorum and final timeouts)."""


@dataclass(frozen=True)
class Lost:
    """A message to ``peer`` could not be delivered: ``kind`` BCAST / FINAL (a value stream of
    ``fragment``; ``cut``: part of a cut) or PULL (``fragment`` -1)."""

    peer: bytes
    kind: str
    fragment: int = -1
    cut: bool = False


Event = Received | Result | Tick | Lost
"""Everything :meth:`diloco.syncer.core.coordinator.Coordinator.handle` takes."""


@dataclass(frozen=True)
class IslandGauge:
    """One island as the operator sees it."""

    island: int
    live: bool
    heard_age_s: float | None
    """Seconds since the island was last heard from (None: it never joined)."""


@dataclass(frozen=True)
class Gauges:
    """What the metrics endpoint reads of the core, as of one instant (O(islands + rounds + fragments))."""

    phase: str
    open_rounds: int
    open_attempts: int
    """Sum of the current attempt of every open round (each attempt is a re-pull)."""
    oldest_open_round_age_s: float
    versions_published: int
    islands: tuple[IslandGauge, ...]
    refused_by: dict[str, int]
    buffer_bytes: dict[str, int]
    """Model-sized buffers by kind (value, momentum, running_sums, pool_idle), each tensor once."""
    clipped: dict[str, int]
    """Pushes clipped (norm), capped (weight) and clamped (counts), summed over islands."""

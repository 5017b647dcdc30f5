"""The island's view of its link and of the syncer's progress: when is a wait really stuck?

A waiting island (for its initial cut, a commit under synchronous rounds, the final cut) may
wait a long time on a slow link without anything being wrong: island 0's INIT may still be
streaming over its own link, or the cut may be crossing ours.  The syncer tells it what
moves with PROGRESS notices (``wire.Progress``, cumulative counters); every BCAST/FINAL part
received moves too.  :class:`Liveness` turns them into two clocks:

* ``cut_progress_at``: the last time something that the island's *cut* depends on moved
  (INIT bytes into the syncer, value bytes out to this island, a value part received);
* ``any_progress_at``: the last time anything moved at all (also pushes of any island and
  commits), for waits on a commit or on the final cut.

A wait rule then fires only when its clock stood still for its timeout: a rejoin happens
when the connection is really gone, not because a link is slow.  It also measures the link
from this side: RTT (heartbeat to the syncer's answer), throughput up (push and INIT parts
handed to the network) and down (value parts received).  Thread-safe (the I/O thread writes,
the training thread reads); constant memory.
"""

from __future__ import annotations

import threading
import time

from diloco import wire
from diloco.wire.rates import RateMeter


class Liveness:
    """Progress clocks and link measurements of one sync client."""

    def __init__(self, now: float | None = None) -> None:
        self._lock = threading.Lock()
        now = time.monotonic() if now is None else now
        self._cut_at = now
        self._any_at = now
        self._last: tuple[int, int, int, int] | None = None
        self._last_syncer = 0
        self.queue = 0
        """Value streams the syncer had queued for us at its last notice."""
        self.notices = 0
        self.rtt_s = 0.0
        """Smoothed round-trip time (heartbeat -> the syncer's answer), seconds; 0 until measured."""
        self._beat_at: float | None = None
        self.up = RateMeter()
        self.down = RateMeter()

    # ------------------------------------------------------------------ I/O thread
    def on_progress(self, h: wire.Progress, now: float) -> str | None:
        """Take one PROGRESS notice; returns why it was refused (None: taken)."""
        counters = (h.init_bytes, h.in_bytes, h.commits, h.sent_bytes)
        if min(*counters, h.queue) < 0:
            return f"PROGRESS with a negative counter {counters} / queue {h.queue}"
        with self._lock:
            self.notices += 1
            self.queue = h.queue
            last = self._last
            if h.syncer_id != self._last_syncer:
                last = None  # a new syncer instance: its counters start over
            self._last, self._last_syncer = counters, h.syncer_id
            if last is None:
                return None
            if (h.init_bytes, h.sent_bytes) != (last[0], last[3]):
                self._cut_at = now
            if counters != last:
                self._any_at = now
        return None

    def on_value_part(self, data_bytes: int, now: float) -> None:
        """A message carrying tensors arrived (a BCAST or FINAL part): the wait moves."""
        with self._lock:
            self._cut_at = self._any_at = now
            self.down.add(data_bytes, now)

    def on_sent(self, data_bytes: int, now: float) -> None:
        """Data bytes of our INIT/PUSH parts were handed to the network."""
        if data_bytes > 0:
            with self._lock:
                self.up.add(data_bytes, now)

    def on_heartbeat_sent(self, now: float) -> None:
        with self._lock:
            if self._beat_at is None:
                self._beat_at = now

    def on_heartbeat_reply(self, now: float) -> None:
        with self._lock:
            if self._beat_at is None:
                return
            sample, self._beat_at = now - self._beat_at, None
            self.rtt_s = sample if self.rtt_s == 0 else 0.8 * self.rtt_s + 0.2 * sample

    def on_redial(self) -> None:
        """A new connection: answers to heartbeats of the old one never come."""
        with self._lock:
            self._beat_at = None

    # ------------------------------------------------------------------ any thread
    @property
    def cut_progress_at(self) -> float:
        """Monotonic time something the initial cut depends on last moved."""
        with self._lock:
            return self._cut_at

    @property
    def any_progress_at(self) -> float:
        """Monotonic time anything at the syncer or on our link last moved."""
        with self._lock:
            return self._any_at

    def report(self) -> dict[str, int]:
        """What our heartbeats tell the syncer: downlink bytes/s and RTT in microseconds."""
        with self._lock:
            return {"down_bytes_s": int(self.down.rate), "rtt_us": int(self.rtt_s * 1e6)}

    def snapshot(self) -> dict[str, float]:
        """Link figures for logs and the step log: up/down bytes per second, RTT, queue."""
        with self._lock:
            return {"up_bytes_s": self.up.rate, "down_bytes_s": self.down.rate, "rtt_s": self.rtt_s,
                    "queue": float(self.queue)}

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
when the connection is really gone, not because a link is slow.  Nor because another island
stalls: :class:`CutWatch` (the initial-cut wait's rule) never rejoins while the syncer's fresh
notices say that island 0's INIT, which the cut waits for, is incomplete (an island other than
0 cannot make it move by redialing; island 0's own stall is its own link's business, and its
silence rule handles it).  It also measures the link
from this side: RTT (heartbeat to the syncer's answer), throughput up (push and INIT parts
handed to the network) and down (value parts received).  Thread-safe (the I/O thread writes,
the training thread reads); constant memory.
"""

from __future__ import annotations

import logging
import threading
import time

from diloco import wire
from diloco.wire.rates import RateMeter

log = logging.getLogger(__name__)


class Liveness:
    """Progress clocks and link measurements of one sync client."""

    def __init__(self, now: float | None = None) -> None:
        self._lock = threading.Lock()
        now = time.monotonic() if now is None else now
        self._cut_at = now
        self._any_at = now
        self._last: tuple[int, int, int, int] | None = None
        self._last_syncer = 0
        self._notice_at: float | None = None
        """When the last PROGRESS notice was taken (None: none yet)."""
        self._init_at = now
        """When the syncer's INIT counter last changed (or its first notice came)."""
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
            self._notice_at = now
            if last is None or h.init_bytes != last[0]:
                self._init_at = now
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

    def init_silent_s(self, total_bytes: int, now: float, fresh_s: float) -> float | None:
        """How long island 0's INIT has stood still, while it is incomplete.

        Returns the seconds since the syncer's INIT counter last changed (as our notices saw it;
        counted from the first notice of a syncer instance) when the latest notice, taken at
        most ``fresh_s`` before ``now``, reports fewer than ``total_bytes`` (the fp32 bytes of
        every fragment); None when INIT is complete, ``total_bytes <= 0``, or no fresh notice
        came (then nothing says the syncer still hears us)."""
        with self._lock:
            if self._last is None or self._notice_at is None or now - self._notice_at > fresh_s:
                return None
            if total_bytes <= 0 or self._last[0] >= total_bytes:
                return None
            return max(0.0, now - self._init_at)

    def report(self) -> dict[str, int]:
        """What our heartbeats tell the syncer: downlink bytes/s and RTT in microseconds."""
        with self._lock:
            return {"down_bytes_s": int(self.down.rate), "rtt_us": int(self.rtt_s * 1e6)}

    def snapshot(self) -> dict[str, float]:
        """Link figures for logs and the step log: up/down bytes per second, RTT, queue."""
        with self._lock:
            return {"up_bytes_s": self.up.rate, "down_bytes_s": self.down.rate, "rtt_s": self.rtt_s,
                    "queue": float(self.queue)}


class CutWatch:
    """The initial-cut wait's rejoin rule: redial only when our own link lost the cut.

    A cut message lost with a connection reset nobody saw is never resent on its own, so a
    wait in which nothing the cut depends on moved for ``timeout_s`` rejoins (the syncer then
    sends the whole cut again).  Except when the syncer's notices, still arriving, say island
    0's INIT is incomplete and we are not island 0: the fragments we lack may simply have no
    value yet, our link is fine and a redial would only restart our cut.  The wait stays
    bounded by the caller's overall deadline (``initial_cut_timeout_s``); a fragment lost on our
    link while INIT is incomplete is asked for again once INIT completes and the cut stands
    still.  Logs once per change of what the wait waits on.  Sync rank only, one thread.

    Args:
        liveness: the client's progress clocks.
        island: our island id (island 0 streams INIT: it never waits on another island's).
        timeout_s: seconds with nothing moving before a rejoin (``sync_timeout_s``).
        init_total_bytes: fp32 bytes of every fragment (a complete INIT at the syncer).
        now: monotonic time the wait starts.
    """

    def __init__(self, liveness: Liveness, island: int, timeout_s: float, init_total_bytes: int,
                 now: float) -> None:
        self._lv = liveness
        self._island = island
        self._timeout_s = timeout_s
        self._total = init_total_bytes
        self._moved_at = now
        self._have = -1
        self.on_init_s: float | None = None
        """Seconds island 0's INIT had stood still at the last check that waited on it; None
        when the last check did not wait on it."""

    def moved(self, now: float) -> None:
        """Something of ours moved the cut (e.g. INIT fragments streamed again)."""
        self._moved_at = now

    def rejoin_now(self, have: int, now: float) -> bool:
        """One check of the wait, ``have`` fragments received so far: True to rejoin now."""
        if have != self._have:
            self._moved_at, self._have = now, have
        if now - max(self._moved_at, self._lv.cut_progress_at) <= self._timeout_s:
            self.on_init_s = None
            return False
        silent = None if self._island == 0 else self._lv.init_silent_s(self._total, now, self._timeout_s)
        if silent is not None:
            if self.on_init_s is None:
                log.warning("island %d: initial cut waits on island 0's INIT (silent %.0f s); our link is fine, "
                            "not redialing", self._island, silent)
            self.on_init_s = silent
            return False
        self.on_init_s = None
        self._moved_at = now  # the rejoin's cut gets a whole timeout again
        return True

    def waiting_on(self) -> str:
        """What the wait waits on, for the caller's timeout message ("" if nothing named)."""
        if self.on_init_s is None:
            return ""
        return f"waiting on island 0's INIT, silent {self.on_init_s:.0f} s"

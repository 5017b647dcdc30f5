"""What an operator scrapes from the syncer: counters fed by the control loop, read as snapshots.

:class:`SyncerMetrics` is the syncer's side of ``--metrics-port`` (the HTTP side, with
``prometheus_client``, is ``metrics_http.py``). Ownership and cost:

* the **control loop** calls :meth:`SyncerMetrics.on_events` with the events it writes to the
  event log (so the counters are views of the event log, and match it line for line) and
  :meth:`SyncerMetrics.tick` once per iteration: a clock store, plus, every
  ``snapshot_every_s`` (0.5 s), one :class:`MetricsSnapshot` built from the core's gauges
  (``Coordinator.gauges``): O(islands + open rounds + fragments), nothing that grows with bytes;
* the **HTTP thread** only reads the latest snapshot (one reference, swapped whole) and the
  clock of the last tick, so it never touches the core and never takes a lock the loop waits on.

Definitions (the tests pin these against the event log):

* committed rounds: commit events (``round`` and ``version``, no ``dropped``); ``changed``:
  those whose ``changed`` is true; failed: events with ``dropped`` (a non-finite commit);
* re-pulls: the ``attempt`` of every committed round (an attempt is a re-pull of the one
  before) plus, for rounds still open, their current attempt;
* pushes merged / empty, per island: the islands of a commit event's ``weights`` with a
  weight > 0 / = 0;
* lag in versions, per island: changed commits since the last commit that merged a push of
  that island (or since the start, when none did);
* commit latency: each commit event's ``commit_s`` (merge, outer step, finite check).

Memory: a few counters per island (``--islands``) and per refusal reason (a fixed set of codes),
a fixed histogram; nothing grows with rounds or time.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from diloco.syncer.links import LinkFigures

if TYPE_CHECKING:
    from diloco.syncer.dataplane import DataPlane
    from diloco.syncer.core.coordinator import Coordinator

COMMIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (s) of the commit-latency histogram (plus +Inf)."""
STALL_AFTER_S = 5.0
"""``/healthz`` answers 503 once the control loop has not turned for this long."""
SNAPSHOT_EVERY_S = 0.5
"""Period of the snapshot the loop publishes for the HTTP thread."""


class LoopView(Protocol):
    """What a snapshot reads of the control loop (``diloco.syncer.loop.SyncerLoop`` is one), on the
    loop's own thread: its core (``state``), its data plane's backlog and its send/refusal counters. The
    optional ``listener`` (with a connection ``guard``), ``links`` (a ``LinkWatch``) and
    ``bytes_in`` / ``bytes_out`` are read with ``getattr`` and count as absent/0 when missing."""

    @property
    def state(self) -> Coordinator: ...
    @property
    def data(self) -> DataPlane: ...
    @property
    def wire_refusals(self) -> int: ...
    @property
    def dropped_sends(self) -> int: ...
    @property
    def lost_streams(self) -> int: ...


@dataclass(frozen=True)
class IslandView:
    """One island as scraped."""

    island: int
    live: bool
    heard_age_s: float | None
    """Seconds since the island was last heard from (None: never)."""
    lag_versions: int
    pushes_merged: int
    pushes_empty: int
    link: LinkFigures = LinkFigures()
    """Its link as measured (throughput up and down, RTT, a round's predicted transfer)."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything the endpoint shows, as of ``taken_at`` (monotonic clock of the loop)."""

    taken_at: float
    phase: str
    rounds_committed: int
    rounds_changed: int
    rounds_failed: int
    repulls: int
    open_rounds: int
    oldest_open_round_age_s: float
    versions_published: int
    islands: tuple[IslandView, ...]
    refusals: dict[str, int]
    """Refusals by reason: the core's codes, plus ``wire`` (undecodable or unauthenticated)."""
    clipped: dict[str, int]
    """Pushes changed by the robust rules, by reason: ``clipped`` (norm), ``capped`` (weight), ``clamped`` (counts)."""
    bytes_in: int
    bytes_out: int
    commit_buckets: tuple[int, ...]
    """Cumulative counts per bucket of :data:`COMMIT_BUCKETS_S`, then +Inf."""
    commit_sum_s: float
    commit_count: int
    resident_bytes: int
    buffer_bytes: dict[str, int]
    """Sync buffers by kind: value, momentum, running_sums, pool_idle, backlog."""
    connections_open: int
    connections_accepted: int
    connections_refused: dict[str, int]
    dropped_sends: int
    lost_streams: int


@dataclass
class _Commits:
    committed: int = 0
    changed: int = 0
    failed: int = 0
    repulled: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(COMMIT_BUCKETS_S) + 1))
    latency_sum: float = 0.0
    latency_count: int = 0


class SyncerMetrics:
    """Counters of one syncer process (see the module docstring for who calls what).

    Args:
        islands: ``--islands`` (per-island series are 0 .. islands-1).
        snapshot_every_s: how often the loop publishes a snapshot.
        stall_after_s: how long without a tick makes the loop "stalled" (``/healthz`` 503).
    """

    def __init__(self, islands: int, snapshot_every_s: float = SNAPSHOT_EVERY_S,
                 stall_after_s: float = STALL_AFTER_S) -> None:
        self.islands = islands
        self.snapshot_every_s = snapshot_every_s
        self.stall_after_s = stall_after_s
        self.beat_at = time.monotonic()
        """Clock of the loop's last tick (read by the HTTP thread)."""
        self.stopped = False
        """Set once the loop has returned: healthz answers 503 from then on."""
        self._commits = _Commits()
        self._merged = [0] * islands
        self._empty = [0] * islands
        self._merged_at = [0] * islands  # changed commits when the island last had a push merged
        self._snapshot: MetricsSnapshot | None = None
        self._next_snapshot = 0.0
        self._lock = threading.Lock()  # only for final(): the loop thread never waits on it otherwise

    # ------------------------------------------------------------------ loop thread

    def on_events(self, events: list[dict[str, Any]]) -> None:
        """Count the events the loop writes to the event log (commit, dropped commit, eviction)."""
        c = self._commits
        for ev in events:
            if "dropped" in ev and "round" in ev:
                c.failed += 1
                continue
            if "round" not in ev or "version" not in ev:
                continue
            c.committed += 1
            c.repulled += int(ev.get("attempt", 0))
            if ev.get("changed"):
                c.changed += 1
            for key, weight in (ev.get("weights") or {}).items():
                i = int(key)
                if not 0 <= i < self.islands:
                    continue
                if weight > 0:
                    self._merged[i] += 1
                    self._merged_at[i] = c.changed
                else:
                    self._empty[i] += 1
            secs = ev.get("commit_s")
            if isinstance(secs, (int, float)):
                c.latency_sum += float(secs)
                c.latency_count += 1
                for k, bound in enumerate(COMMIT_BUCKETS_S):
                    if secs <= bound:
                        c.buckets[k] += 1
                        break
                else:
                    c.buckets[-1] += 1

    def tick(self, loop: LoopView, now: float) -> None:
        """Once per loop iteration: the liveness clock, and a snapshot when one is due."""
        self.beat_at = now
        if now >= self._next_snapshot:
            self._next_snapshot = now + self.snapshot_every_s
            self._snapshot = self._take(loop, now)

    def final(self, loop: LoopView) -> None:
        """After the loop returned (same thread): one last snapshot, and healthz 503 from now on."""
        with self._lock:
            self._snapshot = self._take(loop, time.monotonic())
            self.stopped = True

    # ------------------------------------------------------------------ any thread

    def snapshot(self) -> MetricsSnapshot | None:
        """The latest snapshot (None before the loop's first tick)."""
        return self._snapshot

    def healthy(self, now: float | None = None) -> tuple[bool, str]:
        """(True, why) while the loop turns; (False, why) once stopped or stalled."""
        now = time.monotonic() if now is None else now
        age = now - self.beat_at
        if self.stopped:
            return False, "the control loop has stopped"
        if age > self.stall_after_s:
            return False, f"the control loop has not turned for {age:.1f}s"
        return True, f"ok: last turn {age * 1e3:.0f} ms ago"

    # ------------------------------------------------------------------ snapshot

    def _take(self, loop: LoopView, now: float) -> MetricsSnapshot:
        g = loop.state.gauges(now)
        c = self._commits
        views = []
        links = getattr(loop, "links", None)
        for isl in g.islands:
            if not 0 <= isl.island < self.islands:
                continue
            views.append(IslandView(isl.island, isl.live, isl.heard_age_s,
                                    c.changed - self._merged_at[isl.island], self._merged[isl.island],
                                    self._empty[isl.island],
                                    links.figures(isl.island) if links is not None else LinkFigures()))
        refusals = dict(g.refused_by)
        if loop.wire_refusals:
            refusals["wire"] = loop.wire_refusals
        guard = getattr(getattr(loop, "listener", None), "guard", None)
        cumulative, running = [], 0
        for n in c.buckets:
            running += n
            cumulative.append(running)
        return MetricsSnapshot(
            taken_at=now, phase=g.phase, rounds_committed=c.committed, rounds_changed=c.changed,
            rounds_failed=c.failed, repulls=c.repulled + g.open_attempts, open_rounds=g.open_rounds,
            oldest_open_round_age_s=g.oldest_open_round_age_s,
            versions_published=g.versions_published, islands=tuple(views),
            refusals=refusals, clipped=dict(g.clipped),
            bytes_in=getattr(loop, "bytes_in", 0), bytes_out=getattr(loop, "bytes_out", 0),
            commit_buckets=tuple(cumulative), commit_sum_s=c.latency_sum, commit_count=c.latency_count,
            resident_bytes=resident_bytes(), buffer_bytes={**g.buffer_bytes, "backlog": int(loop.data.backlog_bytes)},
            connections_open=len(guard.conns) if guard is not None else 0,
            connections_accepted=guard.accepted if guard is not None else 0,
            connections_refused=dict(guard.refused) if guard is not None else {},
            dropped_sends=loop.dropped_sends, lost_streams=loop.lost_streams)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def frames_nbytes(frames: list[Any]) -> int:
    """Bytes of a multipart message (bytes, zmq frames, buffers)."""
    total = 0
    for f in frames:
        try:
            total += len(f) if isinstance(f, bytes) else memoryview(f).nbytes
        except TypeError:
            total += len(f)
    return total

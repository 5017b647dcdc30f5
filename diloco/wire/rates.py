"""Throughput of one direction of a link, measured from the bytes of the parts that cross it.

Both ends use it: the syncer times the parts it receives from each island and the bytes zmq
takes for each island; the island times its own pushes and the values it receives.  Bytes of
a burst are timed from the burst's first arrival (those first bytes cannot be timed: the
clock starts with them), a gap longer than ``gap_s`` starts a new burst (idle time is not the
link's), and each window of ``window_s`` yields one sample that enters an exponential average,
as does a burst that ended inside its first window (see :data:`MIN_PARTIAL`).
Constant memory; not thread-safe (one owner thread).
"""

from __future__ import annotations

import math


MIN_PARTIAL = 0.2
"""A burst shorter than a window still yields a sample, once the next burst starts, if its timed
bytes spanned at least this fraction of a window (a small push on a fast link is one such burst)."""


class RateMeter:
    """Smoothed bytes per second of one direction.

    Args:
        window_s: seconds of a sample window.
        gap_s: a pause longer than this starts a new burst.
        alpha: weight of a new sample in the average.
    """

    def __init__(self, window_s: float = 0.5, gap_s: float = 1.5, alpha: float = 0.3) -> None:
        self.window_s, self.gap_s, self.alpha = window_s, gap_s, alpha
        self.rate: float = 0.0
        """Smoothed bytes per second (0 until one window closed)."""
        self.total: int = 0
        """Every byte counted (cumulative)."""
        self._start = self._last = -math.inf
        self._bytes = 0

    def add(self, n: int, t: float) -> None:
        """Count ``n`` bytes that crossed at monotonic time ``t`` (non-decreasing)."""
        self.total += n
        if t - self._last > self.gap_s:
            # The burst before the gap ended inside its window: its timed bytes are a sample when
            # they span enough time to be the link's (not parts that arrived back to back).
            if self._bytes > 0 and self._last - self._start >= self.window_s * MIN_PARTIAL:
                self._sample(self._bytes / (self._last - self._start))
            self._start, self._bytes = t, 0
        else:
            self._bytes += n
            if t - self._start >= self.window_s:
                self._sample(self._bytes / (t - self._start))
                self._start, self._bytes = t, 0
        self._last = t

    def _sample(self, sample: float) -> None:
        self.rate = sample if self.rate == 0 else (1 - self.alpha) * self.rate + self.alpha * sample

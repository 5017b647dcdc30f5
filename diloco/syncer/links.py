"""Know each island's link: throughput, progress notices, and whether a round fits its window.

Two parts, one concept (what the links can carry and what that means for the schedule):

* :func:`predict_fit`, a pure function: from a fragment's bytes, the wire dtypes, an island's
  measured up/down throughput, its round-trip time, H (``--sync-every``), P (fragments) and the
  step time, does one round's transfer (the push up, the broadcast down) fit in the time
  between two rounds?  If not, what H would, and would q4 pushes?  :func:`advice` words it
  for the operator, naming the fix.
* :class:`LinkWatch`, owned by the syncer's control loop (constant work per island per call,
  nothing grows with bytes, rounds or HELLOs): it measures each island's throughput (uplink:
  data bytes of the parts it sends over the time they take; downlink: data bytes zmq took
  for it while its streams were pending), smoothed; it sends every live island a PROGRESS
  notice every ``every_s`` (what moved that the island may be waiting for: INIT bytes in,
  data bytes in from any island, commits, data bytes out to it, streams queued for it), so a
  waiting island tells a slow link from a dead one; and it warns, once per change of the
  verdict and only while training, when an island's link cannot carry the schedule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.protocol.schedule import Schedule
from diloco.wire import Heartbeat, Progress, bcast_dtype
from diloco.wire.rates import RateMeter

if TYPE_CHECKING:
    from diloco.syncer.core.records import Outgoing
    from diloco.syncer.core.coordinator import Coordinator

log = logging.getLogger(__name__)

BYTES_PER_ELEM: dict[str, float] = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 2.0 / 64, "q4": 0.5 + 2.0 / 64}
"""Wire bytes per element of each push dtype (low-bit: codes plus a bf16 scale per 64-element
block, the default ``--quant-block``)."""


def wire_bytes_per_elem(dtype: str, quant_block: int = 64) -> float:
    """Bytes one element costs on the wire as ``dtype`` (low-bit: codes + a bf16 scale per block)."""
    if dtype == "int8":
        return 1.0 + 2.0 / quant_block
    if dtype == "q4":
        return 0.5 + 2.0 / quant_block
    return BYTES_PER_ELEM[dtype]


@dataclass(frozen=True)
class RoundFit:
    """What :func:`predict_fit` found for one island.

    Attributes:
        up_s: seconds one push of a fragment takes up the island's link (plus half an RTT).
        down_s: seconds one broadcast of a fragment takes down it (plus half an RTT).
        window_s: seconds between two rounds (``H / P`` steps of ``step_s``).
        fits: ``up_s + down_s <= window_s``.
        need_sync_every: the smallest H (rounded up to two significant digits) that fits.
        q4_up_s, q4_down_s: the same with q4 pushes (broadcasts then bf16).
        q4_fits: whether q4 pushes alone would fit at the current H.
        q4_ratio: q4 push bytes over the current push bytes.
        commit_s: the syncer's commit of one fragment, between the two (measured; 0: unknown).
    """

    up_s: float
    down_s: float
    window_s: float
    fits: bool
    need_sync_every: int
    q4_up_s: float
    q4_down_s: float
    q4_fits: bool
    q4_ratio: float
    commit_s: float = 0.0

    @property
    def round_s(self) -> float:
        """One round's transfer as predicted: push up, commit, value down."""
        return self.up_s + self.commit_s + self.down_s


@dataclass(frozen=True)
class LinkFigures:
    """One island's link as the syncer measures it (0: not measured yet).

    Attributes:
        up_bytes_s: data bytes per second of its pushes and INIT parts arriving (smoothed).
        down_bytes_s: value bytes per second reaching it (its own figure, else zmq's hand-off).
        rtt_s: round-trip time as the island measured it.
        round_s: one round's predicted transfer: push up, commit, broadcast down (:func:`predict_fit`).
        window_s: seconds between two rounds at the measured step time.
    """

    up_bytes_s: float = 0.0
    down_bytes_s: float = 0.0
    rtt_s: float = 0.0
    round_s: float = 0.0
    window_s: float = 0.0


def _round_up_2sig(x: float) -> int:
    """Round up to two significant digits: 107.4 -> 110, 9.2 -> 10, 1234 -> 1300."""
    if x <= 10:
        return max(1, math.ceil(x))
    scale = 10 ** (int(math.floor(math.log10(x))) - 1)
    return int(math.ceil(x / scale - 1e-9) * scale)


def predict_fit(fragment_elems: int, push_dtype: str, up_bytes_s: float, down_bytes_s: float, rtt_s: float,
                sync_every: int, n_fragments: int, step_s: float, quant_block: int = 64,
                commit_s: float = 0.0) -> RoundFit:
    """Does one round's transfer fit between two rounds?  Pure; every argument in base units.

    A round syncs one fragment: the island pushes it up (``push_dtype``) and gets the merged
    value down (fp32/bf16, see ``wire.bcast_dtype``), after the syncer's commit (``commit_s``,
    as measured).  Rounds come every ``H / P`` steps, and one island's link carries every round,
    so the push, the commit and the broadcast of a round must be through before the next
    round's start: ``up + commit + down <= H / P * step_s``.

    Raises:
        ValueError: a rate, H, P or the step time is not positive.
    """
    if up_bytes_s <= 0 or down_bytes_s <= 0 or sync_every <= 0 or n_fragments <= 0 or step_s <= 0:
        raise ValueError(f"predict_fit: rates {up_bytes_s}/{down_bytes_s}, H {sync_every}, P {n_fragments}, "
                         f"step {step_s} must be > 0")
    half_rtt = max(0.0, rtt_s) / 2

    def times(dtype: str) -> tuple[float, float]:
        up = fragment_elems * wire_bytes_per_elem(dtype, quant_block) / up_bytes_s + half_rtt
        down = fragment_elems * wire_bytes_per_elem(bcast_dtype(dtype), quant_block) / down_bytes_s + half_rtt
        return up, down

    up, down = times(push_dtype)
    q4_up, q4_down = times("q4")
    window = Schedule(sync_every, n_fragments).spacing_steps * step_s
    commit = max(0.0, commit_s)
    total = up + commit + down
    need = _round_up_2sig(total * n_fragments / step_s)
    return RoundFit(up_s=up, down_s=down, window_s=window, fits=total <= window,
                    need_sync_every=max(need, sync_every) if total > window else sync_every,
                    q4_up_s=q4_up, q4_down_s=q4_down, q4_fits=q4_up + commit + q4_down <= window,
                    q4_ratio=wire_bytes_per_elem("q4", quant_block) / wire_bytes_per_elem(push_dtype, quant_block),
                    commit_s=commit)


def advice(island: int, fit: RoundFit, up_bytes_s: float, down_bytes_s: float, push_dtype: str) -> str:
    """One line for the operator: the link, what a round needs, and the fix."""
    rate = min(up_bytes_s, down_bytes_s)
    text = (f"island {island}'s link carries {rate / 1e6:.3g} MB/s; a fragment takes {fit.up_s:.3g} s up and "
            f"{fit.down_s:.3g} s down{f' (plus {fit.commit_s:.2g} s to merge)' if fit.commit_s >= 0.05 else ''}, rounds come every {fit.window_s:.3g} s: raise --sync-every to "
            f">= {fit.need_sync_every}")
    if push_dtype != "q4":
        q4 = "enough alone" if fit.q4_fits else f"{fit.q4_up_s:.3g} s up and {fit.q4_down_s:.3g} s down"
        text += f" or push q4 (YETO_WIRE_DTYPE=q4, {fit.q4_ratio:.2g} of the bytes: {q4})"
    return text


@dataclass
class _IslandLink:
    up: RateMeter = field(default_factory=RateMeter)
    down: RateMeter = field(default_factory=RateMeter)
    sent: int = 0
    """Data bytes zmq took for this island (cumulative, current and earlier connections)."""
    island_down: float = 0.0
    """Downlink bytes/s as the island measured it (values received), from its heartbeats."""
    rtt_s: float = 0.0
    """Round-trip time as the island measured it, from its heartbeats."""
    step_at: tuple[int, float] | None = None
    step_s: float = 0.0
    verdict: tuple[bool, int] | None = None
    """(fits, H needed) last warned about; a warning goes out only when it changes."""


def _changed(last: tuple[bool, int] | None, fit: RoundFit) -> bool:
    """Worth saying again: the first verdict, a flip between fits and not, or an H needed that
    moved by more than a third since the last warning (measurement noise is not a change)."""
    if last is None or last[0] != fit.fits:
        return True
    return not fit.fits and abs(fit.need_sync_every - last[1]) > last[1] / 3


class LinkWatch:
    """Link measurements, progress notices and the "H too small" warning (control loop only).

    Args:
        n_islands: islands of the run.
        every_s: period of the PROGRESS notices (the syncer's heartbeat rate).
    """

    def __init__(self, n_islands: int, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.links = [_IslandLink() for _ in range(n_islands)]
        self.in_bytes = 0
        """Data bytes received from every island (INIT and PUSH parts), cumulative."""
        self.warnings = 0
        self.last_fit: dict[int, RoundFit] = {}
        """The latest prediction per island (for the status line and benchmarks)."""
        self._next_notice = 0.0
        self._seen: dict[int, tuple[Any, int, bytes]] = {}
        """id(stream) -> (stream, data bytes already counted, peer): value streams in flight."""

    def on_receive(self, island: int, data_bytes: int, now: float, header: object = None) -> None:
        """A message from ``island`` was opened: its payload bytes time the uplink; a HEARTBEAT
        carries the island's own downlink and RTT measurements (negative values are ignored)."""
        if not 0 <= island < len(self.links):
            return
        if isinstance(header, Heartbeat) and header.island == island:
            link = self.links[island]
            if header.down_bytes_s > 0:
                link.island_down = float(header.down_bytes_s)
            if header.rtt_us > 0:
                link.rtt_s = header.rtt_us / 1e6
        if data_bytes <= 0:
            return
        self.in_bytes += data_bytes
        self.links[island].up.add(data_bytes, now)

    def _count_sent(self, state: Coordinator, tracked: Iterable[tuple[Any, Any]], now: float) -> None:
        """Downlink bytes: what each tracked value stream handed to zmq since the last look."""
        current: dict[int, tuple[Any, int, bytes]] = {}
        for stream, o in tracked:
            current[id(stream)] = (stream, self._seen.get(id(stream), (stream, 0, o.peer))[1], o.peer)
        for key, (stream, counted, peer) in {**self._seen, **current}.items():
            delta = stream.data_bytes - counted
            if delta > 0:
                island = state.island_of(peer)
                if island is not None:
                    self.links[island].sent += delta
                    self.links[island].down.add(delta, now)
            if key in current:
                current[key] = (stream, stream.data_bytes, peer)
        self._seen = {k: v for k, v in current.items() if not v[0].done.is_set()}

    def observe(self, state: Coordinator, tracked: Iterable[tuple[Any, Any]], pending: Any,
                now: float) -> list[Outgoing]:
        """Every loop iteration: count sent bytes, step times; every ``every_s`` the notices and
        the schedule check.  ``pending(peer)`` is the number of streams queued for a peer."""
        from diloco.syncer.core.records import Outgoing

        self._count_sent(state, tracked, now)
        for link, isl in zip(self.links, state.islands):
            if link.step_at is None or isl.last_step < link.step_at[0] or link.step_at[0] == 0:
                link.step_at = (isl.last_step, now)  # step time counts from the first step (not start-up)
            elif isl.last_step > link.step_at[0] and not isl.done:
                dt = (now - link.step_at[1]) / (isl.last_step - link.step_at[0])
                if now - link.step_at[1] >= 1.0:
                    link.step_s = dt if link.step_s == 0 else 0.7 * link.step_s + 0.3 * dt
                    link.step_at = (isl.last_step, now)
        if now < self._next_notice:
            return []
        self._next_notice = now + self.every_s
        init = self.init_bytes(state)
        out: list[Outgoing] = []
        for link, isl in zip(self.links, state.islands):
            if not (isl.bound and isl.alive):
                continue
            out.append(Outgoing(isl.peer, Progress(init_bytes=init, in_bytes=self.in_bytes, commits=state.commits,
                                                   sent_bytes=link.sent, queue=pending(isl.peer),
                                                   syncer_id=state.syncer_id)))
        self._check_schedule(state)
        return out

    @staticmethod
    def init_bytes(state: Coordinator) -> int:
        """fp32 bytes of INIT received so far (whole fragments once initialised)."""
        total = 0
        part = state.book.part_elems * 4
        for frag in state.fragments:
            if frag.layout is None:
                continue
            whole = frag.layout.numel * 4
            total += whole if frag.initialised else min(whole, frag.init_next_part * part)
        return total

    def _check_schedule(self, state: Coordinator) -> None:
        """Warn once per change of verdict, while training, when a link cannot carry the rounds."""
        if state.phase != "running" or not state.initialised:
            return
        biggest = max(f.layout.numel for f in state.fragments if f.layout is not None)
        commit_s = max(f.commit_s for f in state.fragments)  # the slowest fragment's latest commit
        log.debug("links: %s", self.summary())
        for i, (link, isl) in enumerate(zip(self.links, state.islands)):
            if not (isl.bound and isl.alive) or isl.done or link.step_s <= 0:
                continue
            down = link.island_down or link.down.rate  # the island's own figure: zmq's hand-off runs ahead
            if link.up.rate <= 0 or down <= 0:
                continue
            fit = predict_fit(biggest, isl.wire_dtype, link.up.rate, down, link.rtt_s, state.config.sync_every,
                              state.n_fragments, link.step_s, state.config.quant_block, commit_s=commit_s)
            self.last_fit[i] = fit
            if not _changed(link.verdict, fit):
                continue
            first = link.verdict is None
            link.verdict = (fit.fits, fit.need_sync_every)
            if fit.fits and not first:
                log.info("island %d's link now carries the schedule (%.3g MB/s up, %.3g MB/s down)", i,
                         link.up.rate / 1e6, down / 1e6)
            elif not fit.fits:
                self.warnings += 1
                log.warning("%s", advice(i, fit, link.up.rate, down, isl.wire_dtype))

    def figures(self, island: int) -> LinkFigures:
        """What the metrics show of one island's link (zeros until measured; an unknown island: zeros)."""
        if not 0 <= island < len(self.links):
            return LinkFigures()
        link = self.links[island]
        fit = self.last_fit.get(island)
        return LinkFigures(up_bytes_s=link.up.rate, down_bytes_s=link.island_down or link.down.rate,
                           rtt_s=link.rtt_s, round_s=fit.round_s if fit else 0.0,
                           window_s=fit.window_s if fit else 0.0)

    def annotated(self, event: dict[str, Any]) -> dict[str, Any]:
        """An event-log record, a commit (``pushed``, not ``dropped``) with ``predicted_s`` added: per pushing island
        (a JSON key), one round's predicted transfer (push up, commit, value down), seconds, rounded
        to ms; islands without a prediction yet are left out. Other records are returned as they are."""
        if "pushed" not in event or "dropped" in event:
            return event
        fits = self.last_fit
        return {**event, "predicted_s": {str(i): round(fits[i].round_s, 3) for i in event["pushed"] if i in fits}}

    def summary(self) -> str:
        """Per island: measured up/down MB/s and step time, for the status line."""
        return " ".join(f"i{i}:{lk.up.rate / 1e6:.3g}/{lk.down.rate / 1e6:.3g}MB/s,{lk.step_s * 1e3:.0f}ms/step"
                        for i, lk in enumerate(self.links))


__all__ = ["LinkFigures", "LinkWatch", "RateMeter", "RoundFit", "advice", "predict_fit", "wire_bytes_per_elem"]

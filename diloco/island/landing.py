"""The one install path of the island: every received global value lands through it.

Three kinds of value reach an island: the **initial cut** (before the first step), a
**round's BCAST** (a commit, or a cut sent to a member that fell behind) and the **final
cut** (after the last step). Each goes the same two steps on every rank, in the same order:

1. **stage** (:meth:`diloco.island.datapath.DataPath.stage`): the sync rank scatters the
   value into every holder's fp32 **anchor** (hop 1 to the primary holders, hop 2 to the
   replicas); with the progress correction the snapshot slot becomes ``global − θ_push``;
2. **install** (:meth:`diloco.island.datapath.DataPath.install`): each rank writes its masters
   from the anchor (``cut``, ``blend``, or ``progress``), then one model-copy refresh covers
   every fragment installed at that boundary.

What differs is a :class:`Landing`: whether staging runs on the background worker over the
data group while training goes on (a round) or at once on the island group while no step
runs (the two cuts); whether the progress correction may apply (only a round); whether the
value is installed one fragment at a time, its digest taken before its install (the final
cut). The memory rules the path keeps: a received fp32 value may land in the anchors on
arrival only while its fragment is quiet (``diloco.island.quiet``), else in one pooled buffer;
the final cut's install leaves the fragment busy, and a resent FINAL of a fragment whose final
value is in is dropped part by part (``diloco.island.inbox``), so the final cut costs no
fragment-sized buffer when its fragments are quiet.

Methods of :class:`diloco.island.boundary.Island` (a mixin, like ``diloco.island.lifecycle``).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from diloco import wire
from diloco.config import IslandConfig
from diloco.digest import tensor_digest
from diloco.island.background import Background
from diloco.island.client import SyncClient, SyncError
from diloco.island.datapath import DataPath
from diloco.island.exchange import broadcast_orders
from diloco.island.orders import Orders, Value
from diloco.island.planner import Planner
from diloco.island.transfer import FragmentTransfer
from diloco.plan import FragmentPlan

log = logging.getLogger("diloco.island.boundary")

Tensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Landing:
    """How one kind of received value goes through the install path."""

    kind: str
    """What the value is: ``initial_cut``, ``round`` or ``final_cut``."""
    background: bool
    """Staged by the background worker on the data group (training goes on; installed at a later
    boundary once staged on every rank); else staged and installed at once on the island group."""
    progress: bool
    """The progress correction ``θ_now + (global − θ_push)`` may apply (planner's staging mode)."""
    final: bool
    """Installed one fragment at a time with its digest taken first; its install leaves the
    fragment busy (no later value lands in the anchors)."""
    fused_blend: bool
    """A ``blend`` install is one in-place multiply-add; else each term is rounded on its own."""
    record_mode: bool
    """The step log's install event names the install mode."""


INITIAL_CUT = Landing("initial_cut", background=False, progress=False, final=False, fused_blend=False,
                      record_mode=False)
ROUND = Landing("round", background=True, progress=True, final=False, fused_blend=True, record_mode=True)
FINAL_CUT = Landing("final_cut", background=False, progress=False, final=True, fused_blend=False,
                    record_mode=False)


class Landings:
    """The install path (methods of ``Island``)."""

    # Provided by Island.
    cfg: IslandConfig
    group: dist.ProcessGroup
    is_sync: bool
    plan: FragmentPlan
    transfer: FragmentTransfer
    data: DataPath
    bg: Background
    client: SyncClient | None
    planner: Planner
    step: int
    _stage_span: dict[int, tuple[float, float]]

    if TYPE_CHECKING:
        @property
        def versions(self) -> list[int]: ...
        def _raise_if(self, orders: Orders) -> None: ...
        def _fail(self, why: str) -> NoReturn: ...
        def _check_values(self, f: int, tensors: Tensors) -> str | None: ...

    # ------------------------------------------------------------------ the path
    def _stage(self, landing: Landing, value: Value, values: Tensors | None, arrival: int, mode: str) -> int:
        """Step 1 of every install, collective: ``value``'s global tensors (sync rank; None
        elsewhere) into every holder's anchors. A background landing submits it to the worker
        and returns its job number; any other is staged now on the island group and installed
        at once (returns 0)."""
        f = value.fragment
        if landing.final:
            arrival = -1  # its install leaves f busy: nothing lands in the anchors after the final cut
        if landing.background:
            return self.bg.submit("stage", f"staging of fragment {f} version {value.version}",
                                  functools.partial(self._timed_stage, f, values, mode == "progress", arrival))
        self.data.stage_now(f, values, self.group, self.cfg.transfer_timeout_s, arrival)
        self._install(landing, f, mode)
        return 0

    def _timed_stage(self, f: int, values: Tensors | None, progress: bool, arrival: int) -> int:
        """Background: :meth:`DataPath.stage`, its span kept for the apply event (``stage_s``)."""
        t0 = time.time()
        handed = self.data.stage(f, values, progress, self.cfg.transfer_timeout_s, arrival)
        self._stage_span[f] = (t0, time.time())
        return handed

    def _install(self, landing: Landing, f: int, mode: str) -> None:
        """Step 2 of every install: the masters of ``f`` from its staged anchor (the caller
        refreshes the model copies once per boundary)."""
        if mode == "progress" and not landing.progress:
            raise ValueError(f"install({f}): a {landing.kind} never keeps local progress")
        self.data.install(f, mode, self.cfg.alpha, fused=landing.fused_blend)

    def _installed(self, landing: Landing, value: Value, mode: str, events: list[dict], data_bytes: int) -> None:
        """Record an install in the planner and the boundary's events."""
        progress = mode == "progress"
        lag = self.planner.installed(value, progress, self.step)
        f = value.fragment
        extra: dict = {"data_bytes": data_bytes, "mode": mode} if landing.record_mode else {"data_bytes": data_bytes}
        if value.cut:
            held = {"held": True} if value.held else {}
            events.append({"type": "cut", "fragment": f, "version": value.version, **extra, **held})
        else:
            # When its last part arrived, in wall time (the step log's clock): push → arrival is the round's latency.
            arrived = {"arrived_at": time.time() - (time.monotonic() - value.arrived)} if value.arrived else {}
            # When this rank's background staging began and how long it took (the round's latency
            # is arrival → staged → the next boundary).
            span = self._stage_span.pop(f, None)
            staged = {"staged_from": span[0], "stage_s": round(span[1] - span[0], 4)} if span else {}
            events.append({"type": "apply", "fragment": f, "version": value.version, "round": value.round, **extra,
                           "lag_steps": lag, "commit_s": value.commit_us / 1e6, **arrived, **staged})

    # ------------------------------------------------------------------ rounds (step boundary)
    def _install_all(self, orders: Orders, events: list[dict]) -> float:
        """Install the round values staged on every rank: the masters in place, then one refresh."""
        t0 = time.monotonic()
        for value in orders.applies:
            st = self.planner.take_staged(value.fragment)
            self._install(ROUND, value.fragment, st.mode)
            self._installed(ROUND, value, st.mode, events, st.data_bytes)
        if orders.applies:
            # One model-copy refresh (DP all-gather of the applied fragments' buckets) per boundary.
            self.transfer.refresh(v.fragment for v in orders.applies)
        return time.monotonic() - t0

    def _stage_all(self, orders: Orders) -> None:
        """Start the background staging of newly received round values."""
        self.planner.mark_stale(orders.stale)
        for value in orders.stages:
            f = value.fragment
            pending = self.planner.take_pending(f) if self.is_sync else None
            values, arrival = (pending.tensors, pending.arrival) if pending is not None else (None, 0)
            data_bytes = pending.data_bytes() if pending is not None else 0
            del pending
            mode = self.planner.staging_mode(value, self.data.holds_snapshot(f))
            seq = self._stage(ROUND, value, values, arrival, mode)
            del values
            self.planner.staged(value, mode, seq, data_bytes)

    # ------------------------------------------------------------------ the initial cut (start-up)
    def _install_initial(self, orders: Orders, events: list[dict]) -> float:
        """Start-up only (nothing in the background yet): install the ordered values at once.
        Returns the seconds spent."""
        t0 = time.monotonic()
        for value in orders.applies:
            if value.held:  # the island's own value is this cut: anchor it, nothing moves
                if self.is_sync:
                    self.planner.take_pending(value.fragment)
                self.data.anchor_own(value.fragment)
                self._installed(INITIAL_CUT, value, "cut", events, 0)
                continue
            values = None
            data_bytes = 0
            arrival = 0
            if self.is_sync:
                pending = self.planner.take_pending(value.fragment)
                values, arrival = pending.tensors, pending.arrival
                data_bytes = pending.data_bytes()  # as it came, wire dtype
                del pending
            mode = "cut" if value.cut else "blend"
            self._stage(INITIAL_CUT, value, values, arrival, mode)
            del values
            self._installed(INITIAL_CUT, value, mode, events, data_bytes)
        if any(not v.held for v in orders.applies):
            self.transfer.refresh(v.fragment for v in orders.applies if not v.held)
        return time.monotonic() - t0

    # ------------------------------------------------------------------ the final cut (finalization)
    def _install_final(self, events: list[dict]) -> float:
        """Install the final cut fragment by fragment as each arrives (collective): the sync rank
        digests each fragment as received (in its anchors, or a pooled buffer it lets go of once
        staged) before installing it; a held FINAL whose value the anchors already hold is
        installed from them, with the digest taken as that value arrived. Then acknowledge
        with the digests."""
        t0 = time.monotonic()
        deadline = time.monotonic() + self.cfg.final_timeout_s
        data_bytes = 0
        digests: list[str] = []
        versions: list[int] = [0] * self.plan.n_fragments
        held = 0
        for f in range(self.plan.n_fragments):
            values, error, anchored = None, None, ""
            if self.is_sync:
                values, header, error, anchored = self._take_final(f, deadline)
                if header is not None:
                    versions = list(header.versions)
                if values is not None and header is not None:
                    if not header.held:  # a held FINAL's bytes came as a BCAST
                        data_bytes += sum(t.numel() * t.element_size() for _, t in values)
                    values = _fp32(values)
                    digests.append(tensor_digest(values))  # what we install: the syncer checks it
                elif anchored:
                    digests.append(anchored)  # taken as the value arrived, before it was staged
            keep = [Value(f, versions[f], 0, True, held=True)] if anchored else []
            orders = broadcast_orders(Orders(error=error, applies=keep) if self.is_sync else None, self.group,
                                      self.cfg.sync_rank)
            self._raise_if(orders)
            if orders.applies:
                self.data.install_anchor(f)
                held += 1
            else:
                self._stage(FINAL_CUT, Value(f, -1, 0, True), values, 0, "cut")
            del values
        self.transfer.refresh(range(self.plan.n_fragments))
        # Every rank learns the final versions from one broadcast (the manifest).
        vers = torch.tensor(versions, dtype=torch.int64)
        dist.broadcast(vers, group=self.group, group_src=self.cfg.sync_rank)
        self.planner.final_installed([int(v) for v in vers])
        if self.is_sync and self.client is not None:
            self.client.send_final_ack(self.versions, digests)
            self.client.pool.clear()
        events.append({"type": "final", "versions": list(self.versions), "data_bytes": data_bytes, "held": held})
        if self.is_sync:
            log.info("island %d installed the final cut, versions %s (%d fragments from values already here)",
                     self.cfg.island_id, self.versions, held)
        return time.monotonic() - t0

    def _take_final(self, f: int, deadline: float) -> tuple[Tensors | None, wire.Final | None, str | None, str]:
        """Sync rank: fragment ``f`` of the final cut, waiting for it until ``deadline``:
        (values, header, None, "") to stage; (None, header, None, digest) for a held FINAL
        whose value the anchors hold; or (None, None, why not, "")."""
        assert self.client is not None
        try:
            while True:
                got = self.client.take_final(f)
                if got is not None:
                    header, values = got
                    if header.held and not values:
                        values, anchored = self._held_value(f, header)
                        if values is None and not anchored:
                            log.warning("island %d: the syncer says we hold fragment %d version %d of the final "
                                        "cut, but we do not: asking for its bytes (a new session)",
                                        self.cfg.island_id, f, header.version)
                            self.client.refetch_final(f)
                            continue
                        if values is None:
                            return None, header, None, anchored
                    problem = self._check_values(f, values)
                    if problem:
                        return None, None, f"the syncer's final cut does not match our plan: {problem}", ""
                    return values, header, None, ""
                if time.monotonic() > deadline:
                    return None, None, (f"fragment {f} of the final cut did not arrive within "
                                        f"{self.cfg.final_timeout_s:.0f}s"), ""
                self.client.wait_event(0.05)
        except SyncError as exc:
            return None, None, str(exc), ""

    def _held_value(self, f: int, header: wire.Final) -> tuple[Tensors | None, str]:
        """Sync rank, after the drain: where the value a held FINAL names is. (tensors, "") of a
        parked BCAST of that version; (None, digest) when the anchors hold it (staged or
        installed last, and hashed as it arrived); (None, "") when we do not hold it."""
        assert self.client is not None
        if wire.bcast_dtype(self.cfg.wire_dtype) != "float32":
            return None, ""  # our values are rounded: never the syncer's fp32 value
        slot = self.planner.slots[f]
        if slot.pending is not None and slot.pending.version == header.version and slot.pending.tensors \
                and not slot.pending.held:
            return self.planner.take_pending(f).tensors, ""
        if slot.anchor_version == header.version:
            return None, self.client.received_digest(f, header.version)
        return None, ""


def _fp32(tensors: Tensors) -> Tensors:
    return [(name, t if t.dtype == torch.float32 else t.to(torch.float32)) for name, t in tensors]

"""Start-up and finalization of the island's DiLoCo driver (see ``diloco.island.boundary``).

A mixin of :class:`diloco.island.boundary.Island`, kept apart so the boundary's module reads
as the step boundary (orders, install, stage, push) and this one as the two ends of a run:
``start`` (HELLO, INIT streamed while the next fragment is gathered, the initial cut installed
fragment by fragment as it lands) and ``finish`` (the flush rounds answered with each
fragment's real remaining delta, the final cut installed unblended and acknowledged with the
digests of what was installed, SHUTDOWN).  Both are collective: the sync rank decides, every
rank executes the same orders, and every wait is bounded (a lost cut makes the client rejoin,
a silent syncer ends in IslandError on every rank).
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from diloco import wire
from diloco.config import IslandConfig
from diloco.digest import tensor_digest
from diloco.hostmem import trim_heap
from diloco.island.background import Background
from diloco.island.client import SyncClient, SyncError
from diloco.island.datapath import DataPath
from diloco.island.exchange import broadcast_orders
from diloco.island.liveness import CutWatch
from diloco.island.orders import Orders
from diloco.island.planner import Planner
from diloco.island.transfer import FragmentTransfer
from diloco.plan import FragmentPlan
from diloco.steplog import BoundaryRecord, StepLog

log = logging.getLogger("diloco.island.boundary")

Tensors = list[tuple[str, torch.Tensor]]

_INIT_INFLIGHT = 2
"""Fragments the sync rank may hold during INIT: one being sent, one being gathered."""

_CLAIM_THREADS = 4
"""Threads hashing the fragments an island claims at start-up (one fragment each at a time)."""


class StartFinish:
    """``start`` and ``finish`` (methods of ``Island``)."""

    # Provided by Island.
    cfg: IslandConfig
    group: dist.ProcessGroup
    is_sync: bool
    plan: FragmentPlan
    fingerprint: str
    transfer: FragmentTransfer
    data: DataPath
    sync_buffers: dict[str, int]
    bg: Background
    client: SyncClient | None
    planner: Planner
    step: int
    _tokens_given: bool
    _steplog: StepLog | None

    if TYPE_CHECKING:
        @property
        def versions(self) -> list[int]: ...
        def _raise_if(self, orders: Orders) -> None: ...
        def _fail(self, why: str) -> NoReturn: ...
        def _collect(self) -> None: ...
        def _install_initial(self, orders: Orders, events: list[dict]) -> float: ...
        def _install_final(self, events: list[dict]) -> float: ...
        def _exchange(self, orders: Orders | None) -> Orders: ...
        def _execute(self, orders: Orders, events: list[dict]) -> tuple[float, float]: ...
        def _decide(self, finishing: bool) -> Orders: ...
        def _check_values(self, f: int, tensors: Tensors) -> str | None: ...
        def _end_boundary(self, phase: str, step: int, t0: float, step_s: float, export_s: float, apply_s: float,
                          wait_s: float, events: list[dict], loss: float | None) -> BoundaryRecord: ...

    def start(self) -> BoundaryRecord:
        """Connect, stream INIT if asked, install the initial cut (collective).

        Returns what start-up did (phase ``"start"``; also the step log's first record)."""
        t0 = time.monotonic()
        events: list[dict] = []
        need_init = False
        to_init: list[int] = []
        error: str | None = None
        # The anchors and the snapshot slot first (pinned on accelerators): received values land
        # straight in the anchors, and no step pays for an allocation.
        ta = time.monotonic()
        budget = self.data.preallocate()
        alloc_s = time.monotonic() - ta
        claims = self._claims() if self.cfg.skip_matching_cut and self.cfg.initial_cut_timeout_s > 0 else None
        if self.is_sync:
            self.client = SyncClient(self.cfg, self.fingerprint, fragment_layouts(self.plan),
                                     receive_target=self.data.receive_views, claims=claims)
            try:
                welcome = self.client.wait_welcome(self.cfg.connect_timeout_s)
                need_init = welcome.need_init and self.cfg.island_id == 0
                held = welcome.initialised or (False,) * self.plan.n_fragments
                to_init = [f for f in range(self.plan.n_fragments) if need_init and not held[f]]
                self.planner.schedule = (welcome.sync_every, welcome.total_steps)
                if welcome.weighting == "tokens" and not self._tokens_given:
                    raise SyncError("the syncer weighs pushes by tokens (--weighting tokens) but this island does "
                                    "not know its tokens per step: pass Island(tokens_per_step=...) or set "
                                    "YETO_DILOCO_TOKENS_PER_STEP, or run the syncer with --weighting steps")
                log.info("island %d joined the syncer: %d fragments, versions %s%s", self.cfg.island_id,
                         self.plan.n_fragments, list(welcome.versions), ", streaming INIT" if need_init else "")
            except (TimeoutError, SyncError) as exc:
                error = str(exc)
        orders = broadcast_orders(Orders(init=need_init, init_fragments=to_init, error=error) if self.is_sync
                                  else None, self.group, self.cfg.sync_rank)
        self._raise_if(orders)
        if orders.init:
            self._stream_init(events, orders.init_fragments)
        apply_s = 0.0
        if self.cfg.initial_cut_timeout_s > 0:
            apply_s = self._install_initial_cut(self.cfg.initial_cut_timeout_s, events)
        if self.client is not None:
            # Training moves the masters from here on: nothing we hold may be claimed any more.
            late = self.client.drop_claims()
            if late:
                log.warning("island %d: HELD of fragments %s came too late; they come with a later cut",
                            self.cfg.island_id, late)
        held = [e["fragment"] for e in events if e.get("type") == "cut" and e.get("held")]
        if held and self.is_sync:
            log.info("island %d: fragments %s already held the syncer's values: no cut downloaded for them",
                     self.cfg.island_id, held)
        if self.is_sync and self.client is not None and not self.data.gathers_whole():
            budget["export_pool_max"] = self.transfer.pool_max_idle()
        else:
            self.transfer.drop_pool()  # INIT's buffers: nothing exports through the pool any more
        if self.client is not None:
            budget["receive_pool_max"] = self.client.pool.max_idle_bytes
            budget.update(self.client.part_budget())
        log.info("island %d rank %d sync buffers (%.2fs): %s", self.cfg.island_id, self.rank,
                 alloc_s, ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in budget.items()))
        self.sync_buffers = budget
        return self._end_boundary("start", 0, t0, 0.0, 0.0, apply_s, 0.0, events, None)

    def _claims(self) -> list[str] | None:
        """Collective: per fragment, ``tensor_digest`` of the fp32 value this island starts from
        (the sync rank's list; None elsewhere), what its HELLO claims. One fragment at a time: the
        sync rank's own masters read in place where it holds a fragment whole on the host, else
        that one fragment gathered (the same gather as INIT), so no copy of the model is made.
        Values read in place are hashed by a few threads while the next fragment is copied down
        (xxh3 releases the GIL); a gathered fragment is hashed before the next is gathered."""
        t0 = time.monotonic()
        hashes: list[Future[str]] = []
        with ThreadPoolExecutor(max_workers=_CLAIM_THREADS, thread_name_prefix="yeto-claim") as pool:
            for f in range(self.plan.n_fragments):
                self.data.anchor_own(f, mark=False)  # one copy down; the claim, INIT and a HELD read it
                values, gathered = self._starting_values(f)
                if values is not None:
                    hashes.append(pool.submit(tensor_digest, values))
                    if gathered:
                        hashes[-1].result(self.cfg.transfer_timeout_s)  # a gathered copy lives only while hashed
                del values
            digests = [h.result(self.cfg.transfer_timeout_s) for h in hashes]
        if not self.is_sync:
            return None
        log.info("island %d: digests of the %d fragments we start from, to claim in HELLO (%.2fs)",
                 self.cfg.island_id, len(digests), time.monotonic() - t0)
        return digests

    def _starting_values(self, f: int) -> tuple[Tensors | None, bool]:
        """Collective: ``f``'s fp32 value as this island starts from it, global tensors on the sync
        rank (None elsewhere), and whether it was gathered into a copy. Without a copy where the
        sync rank holds ``f`` whole (its anchors after ``anchor_own``, or host masters; then no
        rank sends), else ``f`` gathered."""
        values = self.data.own_views(f) or self.data.master_views(f)
        if values is not None:
            return values, False
        return self.transfer.export_fragment(f, delta=False), True

    def _stream_init(self, events: list[dict], fragments: list[int]) -> None:
        """Send these fragments' fp32 values (collective); gather the next while one is on the wire."""
        inflight: collections.deque = collections.deque()
        t0 = time.monotonic()
        total = sum(self.plan.nbytes(f) for f in fragments)
        sent = 0
        for n, f in enumerate(fragments):
            error = None
            if self.is_sync:
                while len(inflight) >= _INIT_INFLIGHT:
                    if not inflight.popleft().wait(self.cfg.connect_timeout_s):
                        error = f"INIT fragment send timed out after {self.cfg.connect_timeout_s:.0f}s"
                        break
            self._raise_if(broadcast_orders(Orders(error=error) if self.is_sync else None, self.group,
                                            self.cfg.sync_rank))
            values, _ = self._starting_values(f)
            if self.is_sync:
                assert self.client is not None and values is not None
                inflight.append(self.client.send_init(f, values))
                events.append({"type": "init", "fragment": f,
                               "data_bytes": sum(t.numel() * t.element_size() for _, t in values)})
                del values
                sent += self.plan.nbytes(f)
                log.info("INIT %d/%d fragments (fragment %d), %.1f/%.1f MiB, %.1fs", n + 1, len(fragments), f,
                         sent / 2**20, total / 2**20, time.monotonic() - t0)
        error = None
        if self.is_sync:
            for ev in inflight:
                if not ev.wait(self.cfg.connect_timeout_s):
                    error = "INIT send did not complete"
        self._raise_if(broadcast_orders(Orders(error=error) if self.is_sync else None, self.group,
                                        self.cfg.sync_rank))

    def _install_initial_cut(self, timeout_s: float, events: list[dict]) -> float:
        """Before the first step: install each cut fragment as it lands, collectively.
        Returns the seconds spent applying."""
        deadline = time.monotonic() + timeout_s
        apply_s = 0.0
        # A lost cut message (a connection reset) is never resent on its own: the watch rejoins,
        # and the syncer sends the whole cut again. Not while the cut's bytes (or island 0's INIT
        # before it) still move, nor while another island's INIT is what we wait for.
        watch = None if self.client is None else CutWatch(
            self.client.liveness, self.cfg.island_id, self.cfg.sync_timeout_s,
            sum(self.plan.nbytes(f) for f in range(self.plan.n_fragments)), time.monotonic())
        while True:
            orders = None
            if self.is_sync:
                assert self.client is not None and watch is not None
                try:
                    have = [s for s in self.planner.slots if s.version >= 0 or s.pending is not None]
                    if watch.rejoin_now(len(have), time.monotonic()):
                        self.client.rejoin()
                    if len(have) < self.plan.n_fragments:
                        self.client.wait_bcast(min(0.5, max(0.0, deadline - time.monotonic())))
                    self._collect()
                    lost = self.client.take_init_lost()
                    if lost:
                        log.warning("island %d: the syncer lost INIT of fragments %s with a connection: "
                                    "streaming them again", self.cfg.island_id, lost)
                    orders = Orders(applies=self.planner.pending_values(), init_fragments=lost)
                    got = {v.fragment for v in orders.applies} | {s.fragment for s in self.planner.slots
                                                                 if s.version >= 0}
                    if len(got) == self.plan.n_fragments:
                        orders.stop = "cut installed"
                    elif time.monotonic() >= deadline:
                        orders.stop = "initial cut timeout"
                        waits = watch.waiting_on()
                        log.warning("initial cut: %d of %d fragments after %.0fs%s; the rest is applied at the "
                                    "step boundaries", len(got), self.plan.n_fragments, timeout_s,
                                    f" ({waits})" if waits else "")
                except SyncError as exc:
                    orders = Orders(error=str(exc))
            orders = broadcast_orders(orders, self.group, self.cfg.sync_rank)
            self._raise_if(orders)
            if orders.init_fragments:
                self._stream_init(events, orders.init_fragments)
                if watch is not None:
                    watch.moved(time.monotonic())
            apply_s += self._install_initial(orders, events)
            if self.is_sync and orders.applies:
                done = sum(s.version >= 0 for s in self.planner.slots)
                log.info("initial cut: %d/%d fragments installed (%.1fs)", done, self.plan.n_fragments,
                         timeout_s - max(0.0, deadline - time.monotonic()))
            if orders.stop:
                return apply_s

    def finish(self) -> list[int]:
        """After the last step: keep answering rounds (the syncer's flush rounds take each
        fragment's real remaining delta and step count) until the final cut arrives, install
        it unblended, acknowledge, and wait for SHUTDOWN. Returns the final versions. Gives up
        after ``final_timeout_s`` in which nothing moved at the syncer or on our link (a slow
        link still carrying flush rounds or the final cut keeps it waiting)."""
        deadline = time.monotonic() + self.cfg.final_timeout_s
        if self.is_sync:
            assert self.client is not None
            self.client.report_step(self.step, done=True)
        acked = False
        while True:
            t0 = time.monotonic()
            orders = None
            if self.is_sync:
                orders = self._finish_orders(deadline, acked)
            orders = self._exchange(orders)
            events: list[dict] = []
            apply_s, export_s = self._execute(orders, events)
            if orders.final:
                self._drain("the final cut")
                apply_s += self._install_final(events)
                acked = True
            if events:
                self._end_boundary("finish", self.step, t0, 0.0, export_s, apply_s, 0.0, events, None)
            if orders.stop:
                break
        self._drain("shutdown")
        self.bg.close()
        if self.client is not None:
            self.client.close()  # first: its I/O thread lands values in the anchors freed next
        # The run is over: give the sync buffers back (anchors, slot, pools) to the kernel.
        self.data.free()
        if self.client is not None:
            self.client.pool.clear()
        trim_heap()
        if self._steplog is not None:
            self._steplog.close()
        return list(self.versions)

    def _drain(self, why: str) -> None:
        """Collective: wait for every background job on every rank, and agree that none failed.

        The final cut writes masters and anchors the background may still read, and the
        client must have every push before it closes."""
        if not self.bg.drain():
            self.bg.fail(f"background jobs did not finish within {self.cfg.transfer_timeout_s:.0f}s before {why}")
        self._exchange(Orders() if self.is_sync else None)
        self.planner.drained()
        if not self.data.release_all(self.cfg.transfer_timeout_s):
            log.warning("island %d: a push was still being sent before %s", self.cfg.island_id, why)

    def _finish_orders(self, deadline: float, acked: bool) -> Orders:
        assert self.client is not None
        deadline = max(deadline, self.client.liveness.any_progress_at + self.cfg.final_timeout_s)
        try:
            self.client.wait_event(0.05)
            if acked:
                if self.client.shutdown_reason is not None:
                    return Orders(stop=self.client.shutdown_reason)
                if time.monotonic() > deadline:
                    return Orders(error=f"no SHUTDOWN from the syncer, and no progress, for {self.cfg.final_timeout_s:.0f}s")
                return Orders()  # the final cut is installed: nothing is applied or pushed after it
            elif self.client.final_received() > 0:
                return Orders(final=True)  # installed fragment by fragment as they arrive
            if time.monotonic() > deadline:
                what = "SHUTDOWN" if acked else "the final cut"
                return Orders(error=f"no {what} from the syncer, and no progress, for {self.cfg.final_timeout_s:.0f}s")
            if self.client.shutdown_reason is not None and not acked:
                return Orders(error=f"the syncer shut down before sending the final cut: "
                                    f"{self.client.shutdown_reason}")
            self._collect()
            return self._decide(finishing=True)
        except SyncError as exc:
            return Orders(error=str(exc))

def fragment_layouts(plan: FragmentPlan) -> list[wire.FragmentLayout]:
    """The flat stream of every fragment (names and global shapes in plan order)."""
    return [wire.FragmentLayout.of([(s.name, s.shape) for s in plan.specs_of(f)]) for f in range(plan.n_fragments)]


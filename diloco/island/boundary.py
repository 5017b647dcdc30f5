"""The island's executor: start-up (INIT, initial cut), the step boundary, finalization.

Every rank of an island builds one :class:`Island` and calls, in this order:

* :meth:`Island.start` once before the first training step — plan, fingerprint, HELLO,
  INIT when the syncer asks for it (streamed, overlapping the gather of fragment k+1 with
  the send of fragment k), then the initial cut;
* :meth:`Island.step_end` right after every ``optimizer.step()`` — the step boundary;
* :meth:`Island.finish` once after the last step — the flush rounds, the final cut, shutdown.

Only the sync rank talks to the syncer (through :class:`SyncClient`); its planner
(``diloco.island.planner``, no I/O) turns what the client parked into :class:`Orders`, and
every rank executes the same orders in the same order and records them in its own planner
(whose shared fields stay identical on every rank). This module owns the collectives and
the data path; the planner owns every fragment's state and the rules. Inside a boundary the order is fixed: **install** the fragments staged on every
rank (the in-place master write and the model-copy refresh), **stage** newly received
global values (a background scatter), then **push** (snapshot on the training thread, the
delta and the gather in the background). The training loop never waits on a transfer:
see ``diloco/island/datapath.py`` for what runs where. Start-up and finalization are
``diloco/island/lifecycle.py`` (methods of the same class).

Apply keeps local progress (``YETO_DILOCO_APPLY=progress``, the default): when the commit
of a round this island pushed is installed, ``θ ← θ_now + (global − θ_push)`` with
``θ_push`` the snapshot of that push; the raw global becomes the anchor, so the next push
carries exactly the steps not merged yet. A cut installs the value as is; with no push of
the fragment outstanding the value is ``α``-blended (0 = replace).

Two process groups, and the order rules that keep them from deadlocking:

* the **island group** (``group``: the layout's CPU group) carries the boundary: the order
  exchange (one small all-reduce + the orders broadcast), the layout's model-copy refresh,
  and the synchronous INIT / initial-cut / final-cut transfers. Only the training thread
  uses it, in the order the orders dictate, identical on every rank;
* the **data group** (``data_group``: a gloo group over the same ranks, created in
  ``Island.__init__`` on every rank in the same order, right after the layout) carries the
  background jobs only: push gathers and apply staging. Only the background worker uses
  it, running jobs strictly in submit order (FIFO, one thread), and jobs are submitted
  only from orders, so every rank runs the same data-group traffic in the same order. The
  two groups never share a collective; neither thread ever waits for the other while
  inside a collective, except the bounded local waits of the training thread for a job
  (a push waiting for the push in flight, a re-snapshot of a fragment still being sent,
  the drain before the final cut).

Failure semantics: anything fatal seen by the sync rank (a refusal, a timeout) becomes
``Orders.error``; a background job that fails on any rank raises its flag in the next
order exchange; a rank that died makes the exchange itself fail. In every case every
surviving rank raises :class:`IslandError` at the same boundary, and no rank is left
waiting in a collective the others skipped (every wait is bounded by
``YETO_DILOCO_TRANSFER_TIMEOUT_S``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from diloco import quant, wire
from diloco.config import IslandConfig
from diloco.hostmem import tune_island_malloc
from diloco.island.background import Background
from diloco.island.client import SyncClient, SyncError
from diloco.island.datapath import DataPath
from diloco.island.exchange import Status, agree_status, exchange_orders
from diloco.island.landing import Landings
from diloco.island.lifecycle import StartFinish
from diloco.island.orders import Orders
from diloco.island.planner import Planner
from diloco.island.transfer import FragmentTransfer
from diloco.layout.base import LayoutAdapter, group_rank
from diloco.plan import Assignment, FragmentPlan, layout_fingerprint, make_plan
from diloco.steplog import BoundaryRecord, StepLog, StepRecord
from diloco.steplog_scalars import island_scalars

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

class IslandError(RuntimeError):
    """Raised on every rank of the island together when syncing cannot go on."""


class Island(StartFinish, Landings):
    """DiLoCo for one island; build on every rank (collective).

    Args:
        config: the island configuration (``IslandConfig.from_env()``).
        layout: how this rank's parameters map onto canonical global tensors.
        group: a CPU (gloo) group over every rank of the island; the layout's group when None
            (the adapter's collectives and ours must run on one group, in one order).
        tokens_per_step: tokens one optimizer step consumes (weights pushes); falls back to
            ``config.tokens_per_step``, then to 1 (pushes weigh by steps).
        assignment: an explicit fragment cut, ``{name: fragment}`` or ``fn(name) -> fragment``
            over the layout's canonical names (see :func:`diloco.plan.make_plan`); None = the
            default cut. It is part of the layout fingerprint: every island must give the same.

    A one-process island needs no ``init_process_group``: ``TorchLayout(model)`` makes a
    private 1-rank gloo group when torch.distributed is not initialised.
    """

    def __init__(self, config: IslandConfig, layout: LayoutAdapter, *, group: dist.ProcessGroup | None = None,
                 tokens_per_step: int | None = None, assignment: Assignment | None = None) -> None:
        self.cfg = config
        if config.tune_malloc:
            tune_island_malloc()
        self.group = group if group is not None else layout.group
        self.rank = group_rank(self.group)
        self.is_sync = self.rank == config.sync_rank
        self.plan: FragmentPlan = make_plan(layout.specs(), config.fragments, assignment)
        self.fingerprint = layout_fingerprint(self.plan)
        timeout = timedelta(seconds=config.transfer_timeout_s)
        self.transfer = FragmentTransfer(layout, self.plan, self.group, sync_rank=config.sync_rank, timeout=timeout)
        self.data_group = _data_group(self.group, timeout)
        self.data = DataPath(self.transfer, self.data_group, slots=config.snapshot_slots,
                             slot_device=config.snapshot_on_device)
        self.bg = Background(f"yeto-data-{self.rank}", config.pushes_in_flight, config.transfer_timeout_s)
        self._tokens_given = bool(tokens_per_step or config.tokens_per_step)
        self.tokens_per_step = tokens_per_step or config.tokens_per_step or 1
        n = self.plan.n_fragments
        self.plan_numel = [sum(s.numel for s in self.plan.specs_of(f)) for f in range(n)]
        """Elements per fragment (a push moves ``numel x wire itemsize`` payload bytes)."""
        self.planner = Planner(n, apply_mode=config.apply_mode, sync_rounds=config.sync_rounds,
                               sync_timeout_s=config.sync_timeout_s, island=config.island_id)
        """Every fragment's slot; the sync rank plans with it, every rank records what it carried out."""
        self.step = 0
        self._push_seq: dict[int, int] = {}
        """Fragment -> background job number of its newest push (at most one entry per fragment)."""
        self._done_everywhere = 0
        # Sync rank only.
        self.client: SyncClient | None = None
        self._sent: collections.deque[tuple[int, int, int, int, int, bool]] = collections.deque()
        """(fragment, round, attempt, local_steps, data_bytes, accepted) of background pushes
        handed to the client (appended by the worker, taken by the training thread)."""
        self._late_events: list[dict] = []
        """Events learned after their boundary (a push the client dropped), for the next record."""
        self._stage_span: dict[int, tuple[float, float]] = {}
        """Fragment -> (start, end) wall time of its latest background staging, for its apply event."""
        self._steplog = StepLog(config.step_log_path(), island_scalars(config.writers(), config.log_interval)) \
            if self.is_sync else None
        self._last_end = time.monotonic()
        self._ctrl0 = (0, 0, 0)
        self._wire_nbytes = _wire_nbytes_of(config)

    @property
    def versions(self) -> list[int]:
        """Version of the global value installed last, per fragment (-1: none yet)."""
        return self.planner.versions

    @property
    def unmerged_steps(self) -> list[int]:
        """Local steps in ``master − anchor`` per fragment (what the next push carries)."""
        return [s.unmerged_steps for s in self.planner.slots]

    # ------------------------------------------------------------------ step boundary (start-up
    # and finalization: diloco/island/lifecycle.py)
    def step_end(self, step: int, loss: float | None = None) -> BoundaryRecord:
        """The step boundary (every rank, right after ``optimizer.step()``).

        Returns what the boundary did: fragments pushed and applied, versions, seconds the
        loop was blocked, payload bytes (the same values the step log records)."""
        t0 = time.monotonic()
        step_s = t0 - self._last_end
        self.step = step
        self.planner.stepped()
        tb = time.monotonic()
        self._agree_staged()
        agree_s = time.monotonic() - tb
        orders = self._train_orders()
        tb = time.monotonic()
        orders = self._exchange(orders)
        wait_s = agree_s + time.monotonic() - tb
        events: list[dict] = []
        apply_s, export_s = self._execute(orders, events)
        while orders.hold:
            # Synchronous rounds: more boundaries, no step in between, until this step's round is
            # installed (or the hold times out); every rank loops on the same orders.
            tb = time.monotonic()
            self._agree_staged()
            orders = self._exchange(self._train_orders(wait_s=0.01))
            wait_s += time.monotonic() - tb
            more_apply_s, more_export_s = self._execute(orders, events)
            apply_s += more_apply_s
            export_s += more_export_s
        return self._end_boundary("train", step, t0, step_s, export_s, apply_s, wait_s, events, loss)

    def _train_orders(self, wait_s: float = 0.0) -> Orders | None:
        """The sync rank's orders at a training boundary (None on the other ranks).

        ``wait_s`` 0: the boundary right after a step (the syncer is told the step); > 0: a
        synchronous-rounds hold, which first waits that long for the client to park something."""
        if not self.is_sync:
            return None
        assert self.client is not None
        try:
            if wait_s > 0:
                self.client.wait_event(wait_s)
            else:
                self.client.report_step(self.step)
            self._collect()
            return self._decide(finishing=False)
        except SyncError as exc:
            return Orders(error=str(exc))

    def _execute(self, orders: Orders, events: list[dict]) -> tuple[float, float]:
        """Every rank's part of a boundary, in its fixed order: install, stage, push. Returns the
        seconds spent installing and exporting."""
        apply_s = self._install_all(orders, events)
        self._stage_all(orders)
        return apply_s, self._push_all(orders, events)

    def _agree_staged(self) -> None:
        """Before the sync rank decides: while a staging is in flight (the planner's table, the
        same on every rank), agree on which background jobs finished, so that a value staged
        since the last boundary is installed at this one, not one step later
        (``exchange.agree_status``: free on a one-rank island, one small all-reduce otherwise)."""
        if not any(s.staging is not None and s.staging.seq > self._done_everywhere for s in self.planner.slots):
            return
        try:
            status = agree_status(self.group, self.bg.done, self.bg.error is not None)
        except RuntimeError as exc:  # gloo: a peer died (connection closed) or stopped answering
            self._fail(f"the island's status exchange failed, a rank died or is stuck: {exc}")
        self._take_status(status)

    def _take_status(self, status: Status) -> None:
        """Every rank: the agreed background state; a failure anywhere fails the island."""
        self._done_everywhere = status.done_everywhere
        if status.failed_rank >= 0:
            own = self.bg.error
            self._fail(f"a background transfer failed on rank {status.failed_rank}" + (f": {own}" if own else ""))

    def _exchange(self, orders: Orders | None) -> Orders:
        """Orders from the sync rank, and agreement on the background workers (collective)."""
        try:
            out, status = exchange_orders(orders, self.group, self.cfg.sync_rank, self.bg.done,
                                          self.bg.error is not None)
        except RuntimeError as exc:  # gloo: a peer died (connection closed) or stopped answering
            self._fail(f"the island's order exchange failed, a rank died or is stuck: {exc}")
        self._take_status(status)
        self._raise_if(out)
        return out

    def _collect(self) -> None:
        """Sync rank: hand what the client parked to the planner; received values are checked
        against the plan first (one that does not fit is refused with a warning)."""
        assert self.client is not None
        bcasts = []
        for b in self.client.take_bcasts():
            problem = None if b.held else self._check_values(b.fragment, b.tensors)
            if problem:
                log.warning("island %d: BCAST of fragment %d version %d refused: %s", self.cfg.island_id,
                            b.fragment, b.version, problem)
                continue
            bcasts.append(b)
        self.planner.park(bcasts, self.client.take_ready_pulls(), self.client.take_stale())
        self._take_sent()

    def _take_sent(self) -> None:
        """Sync rank: the outcome of background pushes handed to the client since last time.

        A push's event is written at its boundary, before the client has it (the bytes it
        will send: numel x wire itemsize, 0 for a zero-weight push). One the send queue
        refused is reported by a ``push_dropped`` event in the next record, carrying the
        ``data_bytes`` that did not move, and its steps are unmerged again (the syncer re-pulls)."""
        while self._sent:
            f, rnd, attempt, steps, data_bytes, accepted = self._sent.popleft()
            if accepted:
                self.planner.push_handed(f)
                continue
            self.planner.push_dropped(f, rnd, steps)
            self._late_events.append({"type": "push_dropped", "fragment": f, "round": rnd, "attempt": attempt,
                                      "local_steps": steps, "data_bytes": data_bytes})

    def _decide(self, finishing: bool) -> Orders:
        """The sync rank's orders (the planner's rules: ``diloco.island.planner``)."""
        return self.planner.plan(self.step, finishing=finishing, done_everywhere=self._done_everywhere,
                                 slot_holders=self.data.slot_holders(),
                                 free_slots=self.data.free_slots(), now=time.monotonic(),
                                 progress_at=self.client.liveness.any_progress_at if self.client else -1.0)

    def _push_all(self, orders: Orders, events: list[dict]) -> float:
        """Snapshot each pushed fragment (training thread) and hand the rest to the background."""
        t0 = time.monotonic()
        for order in orders.pushes:
            f, rnd, attempt = order.fragment, order.round, order.attempt
            prev = self._push_seq.get(f)
            if prev is not None and not self.bg.wait(prev):
                self.bg.fail(f"the previous push of fragment {f} did not finish within "
                             f"{self.cfg.transfer_timeout_s:.0f}s")
                continue  # flagged: every rank raises at the next exchange
            # After the last step the masters no longer move: a push then needs no snapshot slot.
            self.data.snapshot(f, slotless=not self.data.slot_free_for(f))
            steps = self.planner.snapshot_taken(order, self.step)
            base = self.versions[f]
            # What the client will put on the wire: the payload in the wire dtype (a zero-weight
            # push travels bare); counted by the sync rank, which queues it.
            data_bytes = self._wire_nbytes(self.plan_numel[f]) if self.is_sync and steps else 0
            self._push_seq[f] = self.bg.submit("push", f"push of fragment {f} round {rnd}", functools.partial(
                self._push_job, f, wire.Pull(fragment=f, round=rnd, attempt=attempt), base, steps, data_bytes))
            events.append({"type": "push", "fragment": f, "round": rnd, "attempt": attempt, "base_version": base,
                           "local_steps": steps, "data_bytes": data_bytes, "dropped": False,
                           "fp32_bytes": 4 * self.plan_numel[f] if self.is_sync and steps else 0,
                           "snapshot_bytes": self.data.share_nbytes(f)})
        return time.monotonic() - t0

    def _push_job(self, f: int, pull: wire.Pull, base_version: int, steps: int, data_bytes: int) -> None:
        """Background: the delta of the snapshot, gathered to the sync rank, handed to the client.

        The delta lives in pooled buffers that return to the pool only when the last
        reference dies, so the client may keep reading it after this job ended (the event
        ``push`` returns is not needed to guard a reuse)."""
        delta = self.data.gather_delta(f)
        if not self.is_sync:
            return
        assert self.client is not None and delta is not None
        accepted = self.client.push(pull, base_version, steps, steps * self.tokens_per_step, delta)
        self.data.push_sent(f, accepted)
        del delta
        self._sent.append((f, pull.round, pull.attempt, steps, data_bytes, accepted is not None))

    def _end_boundary(self, phase: str, step: int, t0: float, step_s: float, export_s: float, apply_s: float,
                      wait_s: float, events: list[dict], loss: float | None) -> BoundaryRecord:
        """Close a boundary: the record every rank returns, and the sync rank's step-log line."""
        end = time.monotonic()
        self._last_end = end
        if self.is_sync:
            self._take_sent()
            if self._late_events:
                events[:0] = self._late_events
                self._late_events = []
        record = BoundaryRecord(
            step=step, phase=phase,
            pushed=tuple(e["fragment"] for e in events if e["type"] == "push"),
            applied=tuple(e["fragment"] for e in events if e["type"] == "apply"),
            installed=tuple(e["fragment"] for e in events if e["type"] == "cut")
            + (tuple(range(self.plan.n_fragments)) if any(e["type"] == "final" for e in events) else ()),
            versions=tuple(self.versions), blocked_s=end - t0,
            data_bytes_sent=sum(e["data_bytes"] for e in events if e["type"] in ("push", "init")),
            data_bytes_recv=sum(e["data_bytes"] for e in events if e["type"] in ("apply", "cut", "final")),
            pushes=self.planner.pushes, applies=self.planner.applies)
        if self._steplog is None or self.client is None:
            return record
        st = self.client.stats
        ctrl = (st.control_bytes_sent, st.control_bytes_recv, st.refused)
        if ctrl[2] > self._ctrl0[2]:
            events.append({"type": "refused", "count": ctrl[2] - self._ctrl0[2], "data_bytes": 0})
        if record.pushed or record.applied:  # the link as the client measures it, where it mattered
            events.append({"type": "link", **self.client.liveness.snapshot(), "data_bytes": 0})
        self._steplog.record(StepRecord(
            **{f.name: getattr(record, f.name) for f in dataclasses.fields(record)},
            time=time.time(), step_s=step_s, export_s=export_s, apply_s=apply_s, wait_s=wait_s,
            control_bytes_sent=ctrl[0] - self._ctrl0[0], control_bytes_recv=ctrl[1] - self._ctrl0[1],
            round=self.planner.newest_pull[0], attempt=self.planner.newest_pull[1], events=events, loss=loss,
            island=self.cfg.island_id))
        self._ctrl0 = ctrl
        return record

    # ------------------------------------------------------------------ helpers
    def _check_values(self, f: int, tensors: Tensors) -> str | None:
        """Why a received global value of fragment ``f`` does not fit our plan (None if it does)."""
        specs = self.plan.specs_of(f)
        if len(specs) != len(tensors):
            return f"{len(tensors)} tensors, the plan has {len(specs)}"
        for spec, (name, t) in zip(specs, tensors):
            if name != spec.name or tuple(t.shape) != tuple(spec.shape):
                return f"got {name} {tuple(t.shape)}, the plan has {spec.name} {tuple(spec.shape)}"
        return None

    def _raise_if(self, orders: Orders) -> None:
        if orders.error:
            self._fail(orders.error)

    def _fail(self, why: str) -> NoReturn:
        """Raise IslandError (every rank reaches this at the same boundary); stop talking first."""
        if self.client is not None:
            self.client.close(linger_s=0.5)
        self.bg.close()
        raise IslandError(f"island {self.cfg.island_id} rank {self.rank}: {why}")


def _data_group(group: dist.ProcessGroup, timeout: timedelta) -> dist.ProcessGroup:
    """The background data path's own gloo group over the island's ranks (same group ranks).

    Collective: every rank of the job calls it, in the same order (``Island.__init__``).
    A one-process island gets a private 1-rank gloo group (no default group needed, none
    touched: see :func:`diloco.layout.base.island_group`)."""
    size = dist.get_world_size(group)
    if size == 1:
        return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout)
    world = dist.get_world_size()
    ranks = None if size == world else [dist.get_global_rank(group, r) for r in range(size)]
    new = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    assert new is not None
    return new


def _wire_nbytes_of(config: IslandConfig) -> Callable[[int], int]:
    """Payload bytes of a push of ``n`` elements in the island's wire dtype (codes and scales
    for low-bit pushes: what the client puts on the wire)."""
    if config.wire_dtype in wire.QUANT_KINDS:
        return lambda n: quant.wire_nbytes(config.wire_dtype, n, config.quant_block)
    itemsize = torch.empty((), dtype=getattr(torch, config.wire_dtype)).element_size()
    return lambda n: n * itemsize

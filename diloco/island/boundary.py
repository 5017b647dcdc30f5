"""The island's DiLoCo driver: start-up (INIT, initial cut), the step boundary, finalization.

Every rank of an island builds one :class:`Island` and calls, in this order:

* :meth:`Island.start` once before the first training step — plan, fingerprint, HELLO,
  INIT when the syncer asks for it (streamed, overlapping the gather of fragment k+1 with
  the send of fragment k), then the initial cut;
* :meth:`Island.step_end` right after every ``optimizer.step()`` — the step boundary;
* :meth:`Island.finish` once after the last step — the flush rounds, the final cut, shutdown.

Only the sync rank talks to the syncer (through :class:`SyncClient`); it turns what the
client parked into :class:`Orders` and every rank executes the same orders in the same
order. Inside a boundary the order is fixed: **install** the fragments staged on every
rank (the in-place master write and the model-copy refresh), **stage** newly received
global values (a background scatter), then **push** (snapshot on the training thread, the
delta and the gather in the background). The training loop never waits on a transfer:
see ``diloco/island/datapath.py`` for what runs where. Start-up and finalization are
``diloco/island/lifecycle.py`` (methods of the same class).

Apply keeps local progress (``YETO_DILOCO_APPLY=progress``, the default): when the commit
of a round this island pushed is installed, ``θ ← θ_now + (global − θ_push)`` with
``θ_push`` the snapshot of that push; the raw global becomes the anchor, so the next push
carries exactly the steps not merged yet. A cut installs the value as is; with no push of
the fragment outstanding the value is installed as before (``α``-blend, 0 = replace).

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
from dataclasses import dataclass
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from diloco import quant, wire
from diloco.config import IslandConfig
from diloco.island.client import PendingBcast, SyncClient, SyncError
from diloco.island.background import Background
from diloco.island.datapath import DataPath
from diloco.hostmem import tune_island_malloc
from diloco.protocol.schedule import Schedule
from diloco.island.lifecycle import StartFinish, _fp32
from diloco.island.orders import Orders, exchange_orders
from diloco.island.transfer import FragmentTransfer
from diloco.layout.base import LayoutAdapter, group_rank
from diloco.plan import Assignment, FragmentPlan, layout_fingerprint, make_plan
from diloco.steplog import BoundaryRecord, StepLog, StepRecord
from diloco.steplog_scalars import island_scalars

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

class IslandError(RuntimeError):
    """Raised on every rank of the island together when syncing cannot go on."""


@dataclass(frozen=True)
class _Staged:
    """A fragment being staged in the background, to be installed once done on every rank."""

    version: int
    round: int
    cut: bool
    mode: str
    """How the install writes the masters: cut, progress or blend (see DataPath.install)."""
    seq: int
    """Background job number of the staging."""
    data_bytes: int
    """Payload bytes of the received value, as it came (wire dtype; sync rank, 0 elsewhere)."""


@dataclass
class _Counters:
    pushes: int = 0
    applies: int = 0
    round: int = 0
    attempt: int = -1


class Island(StartFinish):
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
        self.data = DataPath(self.transfer, self.data_group)
        self.bg = Background(f"yeto-data-{self.rank}", config.pushes_in_flight, config.transfer_timeout_s)
        self._tokens_given = bool(tokens_per_step or config.tokens_per_step)
        self.tokens_per_step = tokens_per_step or config.tokens_per_step or 1
        n = self.plan.n_fragments
        self.plan_numel = [sum(s.numel for s in self.plan.specs_of(f)) for f in range(n)]
        """Elements per fragment (a push moves ``numel x wire itemsize`` payload bytes)."""
        # Identical on every rank: updated only from exchanged orders.
        self.versions = [-1] * n
        self.applied_round = [0] * n
        self.unmerged_steps = [0] * n
        """Local steps in ``master − anchor`` per fragment (what the next push carries)."""
        self.step = 0
        self._snap_round: dict[int, int] = {}
        """Fragment -> round of its outstanding push snapshot (θ_push), until that commit is installed."""
        self._snap_steps: dict[int, int] = {}
        """Fragment -> local steps its outstanding snapshot's push carried (given back if never merged)."""
        self._push_seq: dict[int, int] = {}
        self._staging: dict[int, _Staged] = {}
        self._stale: set[int] = set()
        """Fragments whose outstanding push was refused ``stale_base`` (from orders: every rank)."""
        self._done_everywhere = 0
        # Sync rank only.
        self.client: SyncClient | None = None
        self._pulls: dict[int, wire.Pull] = {}
        self._parked_at: dict[int, int] = {}
        self._decisions = 0
        self._pending: dict[int, PendingBcast] = {}
        self._stale_new: list[int] = []
        self._pushed_at: dict[tuple[int, int], int] = {}
        self._sent: collections.deque[tuple[int, int, int, int, int, bool]] = collections.deque()
        """(fragment, round, attempt, local_steps, data_bytes, accepted) of background pushes
        handed to the client (appended by the worker, taken by the training thread)."""
        self._late_events: list[dict] = []
        """Events learned after their boundary (a push the client dropped), for the next record."""
        self._steplog = StepLog(config.step_log_path(), island_scalars(config.writers(), config.log_interval)) \
            if self.is_sync else None
        self._schedule = (0, 0)
        """The syncer's (H, total steps), from WELCOME: when rounds open (synchronous rounds)."""
        self._held_at = (-1, 0.0)
        """(step, clock) of the hold in progress (synchronous rounds), to bound it."""
        self._counters = _Counters()
        self._last_end = time.monotonic()
        self._ctrl0 = (0, 0, 0)
        self._wire_nbytes = _wire_nbytes_of(config)

    @property
    def steps_since_apply(self) -> list[int]:
        """Old name of :attr:`unmerged_steps`."""
        return self.unmerged_steps

    # ------------------------------------------------------------------ step boundary (start-up
    # and finalization: diloco/island/lifecycle.py)
    def step_end(self, step: int, loss: float | None = None) -> BoundaryRecord:
        """The step boundary (every rank, right after ``optimizer.step()``).

        Returns what the boundary did: fragments pushed and applied, versions, seconds the
        loop was blocked, payload bytes (the same values the step log records)."""
        t0 = time.monotonic()
        step_s = t0 - self._last_end
        self.step = step
        for f in range(self.plan.n_fragments):
            self.unmerged_steps[f] += 1
        orders = self._train_orders()
        tb = time.monotonic()
        orders = self._exchange(orders)
        wait_s = time.monotonic() - tb
        events: list[dict] = []
        apply_s, export_s = self._execute(orders, events)
        while orders.hold:
            # Synchronous rounds: more boundaries, no step in between, until this step's round is
            # installed (or the hold times out); every rank loops on the same orders.
            tb = time.monotonic()
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

    def _exchange(self, orders: Orders | None) -> Orders:
        """Orders from the sync rank, and agreement on the background workers (collective)."""
        try:
            out, status = exchange_orders(orders, self.group, self.cfg.sync_rank, self.bg.done,
                                          self.bg.error is not None)
        except RuntimeError as exc:  # gloo: a peer died (connection closed) or stopped answering
            self._fail(f"the island's order exchange failed, a rank died or is stuck: {exc}")
        self._done_everywhere = status.done_everywhere
        if status.failed_rank >= 0:
            own = self.bg.error
            self._fail(f"a background transfer failed on rank {status.failed_rank}" + (f": {own}" if own else ""))
        self._raise_if(out)
        return out

    def _collect(self) -> None:
        """Move what the client parked into the sync rank's pending tables."""
        assert self.client is not None
        for b in self.client.take_bcasts():
            problem = self._check_values(b.fragment, b.tensors)
            if problem:
                log.warning("island %d: BCAST of fragment %d version %d refused: %s", self.cfg.island_id,
                            b.fragment, b.version, problem)
                continue
            self._pending[b.fragment] = b
            if b.cut:
                # A cut redefines the fragment (after a rejoin, possibly from a syncer that
                # resumed an older checkpoint and re-runs rounds we saw): pulls parked from
                # before it are void; the syncer pulls again after the cut.
                self._pulls.pop(b.fragment, None)
        for p in self.client.take_ready_pulls():
            have = self._pulls.get(p.fragment)
            if have is None or (p.round, p.attempt) > (have.round, have.attempt):
                self._pulls[p.fragment] = p
                self._parked_at[p.fragment] = self._decisions
            self._counters.round, self._counters.attempt = max(
                (self._counters.round, self._counters.attempt), (p.round, p.attempt))
        for f, rnd in self.client.take_stale():
            if self._snap_round.get(f) == rnd and f not in self._stale_new:
                log.warning("island %d: push of fragment %d round %d refused (it missed a value): installing "
                            "the syncer's current value, then answering the pull again", self.cfg.island_id, f, rnd)
                self._stale_new.append(f)
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
                continue
            self.unmerged_steps[f] += steps
            self._pushed_at.pop((f, rnd), None)
            self._late_events.append({"type": "push_dropped", "fragment": f, "round": rnd, "attempt": attempt,
                                      "local_steps": steps, "data_bytes": data_bytes})

    def _decide(self, finishing: bool) -> Orders:
        """The sync rank's orders: install what is staged everywhere, stage what arrived, push."""
        installs = [(f, s.version, s.round, s.cut) for f, s in sorted(self._staging.items())
                    if s.seq <= self._done_everywhere]
        installing = {f for f, *_ in installs}
        stages = [(f, b.version, b.round, b.cut) for f, b in sorted(self._pending.items())
                  if f not in self._staging or f in installing]
        orders = Orders(applies=installs, stages=stages, stale=self._stale_new)
        self._stale_new = []
        orders.pushes = self._take_pushes(orders, finishing)
        orders.hold = self.cfg.sync_rounds and not finishing and self._holding(orders)
        self._decisions += 1
        return orders

    def _holding(self, orders: Orders) -> bool:
        """Synchronous rounds: does a round that opens at this very step still lack its install?

        Round ``t`` syncs fragment ``(t − 1) mod P`` and opens at step ``ceil(t·H/P)`` (the
        syncer's schedule, from WELCOME). Holding only at that step (never for a round already
        passed) keeps a late joiner or a resumed syncer, whose rounds restart elsewhere, from
        waiting for rounds that will not come; a hold longer than ``YETO_SYNC_TIMEOUT_S`` is
        given up with a warning (the run goes on, that round asynchronously)."""
        h, total = self._schedule
        p = self.plan.n_fragments
        if h <= 0 or (total > 0 and self.step > total):
            return False
        installing = {(f, r) for f, _, r, _ in orders.applies}
        sched = Schedule(h, p, total)
        waiting = [t for t in sched.rounds_opening_at(self.step)
                   if self.applied_round[sched.fragment_of(t)] < t and (sched.fragment_of(t), t) not in installing]
        if not waiting:
            return False
        now = time.monotonic()
        if self._held_at[0] != self.step:
            self._held_at = (self.step, now)
        elif now - self._held_at[1] > self.cfg.sync_timeout_s:
            log.warning("island %d: round %s of step %d not installed after %.0fs: training on without it",
                        self.cfg.island_id, waiting, self.step, now - self._held_at[1])
            return False
        return True

    def _take_pushes(self, orders: Orders, finishing: bool = False) -> list[tuple[int, int, int]]:
        """Pulls to answer now. A push carries ``master − anchor``, so it waits until every
        newer global value of the fragment is installed, and until the commit of our own
        previous push of it is (else the same steps would be pushed twice). While training
        it also waits for one local step (a zero delta would drag the mean). After the last
        step it is answered with what is left, and its real step count (possibly 0, which the
        syncer weighs 0), so the flush rounds take every island's last steps."""
        installs = {f: (r, cut) for f, _, r, cut in orders.applies}
        replaced = {f for f, *_ in orders.applies if self._staging[f].mode != "progress"}
        busy = {f for f in self._staging if f not in installs} | set(self._pending)
        pushes = []
        for f, p in sorted(self._pulls.items()):
            # The newest round of f known committed; a cut resets it (a resumed syncer re-runs rounds).
            floor = 0 if installs.get(f, (0, False))[1] else self.applied_round[f]
            known = [floor] + [r for g, (r, cut) in installs.items() if g == f and not cut]
            known += [s.round for g, s in self._staging.items() if g == f and not s.cut]
            known += [b.round for g, b in self._pending.items() if g == f and not b.cut]
            if p.round <= max(known):
                del self._pulls[f]  # that round committed without us
                continue
            if f in busy:
                continue  # a newer global value is on its way: push on top of it
            if self.versions[f] < 0 and f not in installs:
                continue  # never installed: nothing to push against yet
            snap = self._snap_round.get(f)
            if snap is not None and snap < p.round and f not in installs and \
                    self._parked_at.get(f, self._decisions) >= self._decisions:
                # Our previous push's commit is not installed yet. Rounds of a fragment commit
                # in order and the BCAST precedes the next PULL on the connection, so once this
                # pull has waited a whole boundary with no BCAST of f, that round committed
                # without a BCAST (nothing merged): push from the anchor then.
                continue
            if not finishing and (self.unmerged_steps[f] < 1 or f in replaced):
                continue  # wait for a local step on top of the value installed now
            if not finishing and not self.data.slot_free_for(f) and self.data.slot_holder() not in installs:
                continue  # the snapshot slot holds another fragment's push until its commit is installed
            pushes.append((f, p.round, p.attempt))
            del self._pulls[f]
        return pushes

    def _install_all(self, orders: Orders, events: list[dict]) -> float:
        """Install fragments staged on every rank: the masters in place, then one refresh."""
        t0 = time.monotonic()
        for f, version, rnd, cut in orders.applies:
            st = self._staging.pop(f)
            self.data.install(f, st.mode, self.cfg.alpha)
            self._snap_round.pop(f, None)
            self._after_apply(f, version, rnd, cut, st.mode == "progress", events,
                              {"data_bytes": st.data_bytes, "mode": st.mode})
        if orders.applies:
            # One model-copy refresh (DP all-gather of the applied fragments' buckets) per boundary.
            self.transfer.refresh(f for f, *_ in orders.applies)
        return time.monotonic() - t0

    def _after_apply(self, f: int, version: int, rnd: int, cut: bool, progress: bool, events: list[dict],
                     extra: dict) -> None:
        self.versions[f] = version
        # A cut (round 0) resets the round floor: a resumed syncer re-runs later rounds.
        self.applied_round[f] = rnd if cut else max(self.applied_round[f], rnd)
        if not progress:
            self.unmerged_steps[f] = 0  # the local value was replaced (or blended): nothing unmerged
        if cut:
            events.append({"type": "cut", "fragment": f, "version": version, **extra})
        else:
            self._counters.applies += 1
            pushed = self._pushed_at.pop((f, rnd), None)
            events.append({"type": "apply", "fragment": f, "version": version, "round": rnd, **extra,
                           "lag_steps": None if pushed is None else self.step - pushed})

    def _stage_all(self, orders: Orders) -> None:
        """Start the background scatter of newly received global values."""
        self._stale.update(orders.stale)
        for f, version, rnd, cut in orders.stages:
            values = self._pending.pop(f).tensors if self.is_sync else None
            data_bytes = sum(t.numel() * t.element_size() for _, t in values) if values is not None else 0
            snap = self._snap_round.get(f)
            # After a stale_base refusal the resent value is older than our refused push's round, but
            # that push merged nothing: keep the progress since its snapshot (steps between the
            # missed commit's snapshot and it are lost, never counted twice).
            stale = f in self._stale
            self._stale.discard(f)
            progress = (not cut and self.cfg.apply_mode == "progress" and snap is not None
                        and (snap <= rnd or stale) and self.data.holds_snapshot(f))
            mode = "cut" if cut else "progress" if progress else "blend"
            seq = self.bg.submit("stage", f"staging of fragment {f} version {version}",
                                 functools.partial(self.data.stage, f, values, progress,
                                                   self.cfg.transfer_timeout_s))
            del values
            self._staging[f] = _Staged(version, rnd, cut, mode, seq, data_bytes)

    def _push_all(self, orders: Orders, events: list[dict]) -> float:
        """Snapshot each pushed fragment (training thread) and hand the rest to the background."""
        t0 = time.monotonic()
        for f, rnd, attempt in orders.pushes:
            prev = self._push_seq.get(f)
            if prev is not None and not self.bg.wait(prev):
                self.bg.fail(f"the previous push of fragment {f} did not finish within "
                             f"{self.cfg.transfer_timeout_s:.0f}s")
                continue  # flagged: every rank raises at the next exchange
            if f in self._snap_round:
                # A snapshot whose push was never merged (its attempt was dropped, or its round
                # committed nothing): the anchor did not move, so those steps are still unmerged.
                self.unmerged_steps[f] += self._snap_steps.get(f, 0)
            # After the last step the masters no longer move: a push then needs no snapshot slot.
            self.data.snapshot(f, slotless=not self.data.slot_free_for(f))
            self._counters.pushes += 1
            steps, self.unmerged_steps[f] = self.unmerged_steps[f], 0
            self._snap_round[f], self._snap_steps[f] = rnd, steps
            base = self.versions[f]
            # What the client will put on the wire: the payload in the wire dtype (a zero-weight
            # push travels bare); counted by the sync rank, which queues it.
            data_bytes = self._wire_nbytes(self.plan_numel[f]) if self.is_sync and steps else 0
            if self.is_sync:
                self._pushed_at[(f, rnd)] = self.step
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

    def _apply_sync(self, orders: Orders, events: list[dict]) -> float:
        """Start-up only (nothing in the background yet): install cut fragments synchronously.
        Returns the seconds spent."""
        t0 = time.monotonic()
        for f, version, rnd, cut in orders.applies:
            values = None
            data_bytes = 0
            if self.is_sync:
                received = self._pending.pop(f).tensors
                data_bytes = sum(t.numel() * t.element_size() for _, t in received)  # as it came, wire dtype
                values = _fp32(received)
                del received
            self.transfer.apply_fragment(f, values, alpha=0.0 if cut else self.cfg.alpha, refresh=False)
            del values
            self._snap_round.pop(f, None)
            self._after_apply(f, version, rnd, cut, False, events, {"data_bytes": data_bytes})
        if orders.applies:
            self.transfer.refresh(f for f, *_ in orders.applies)
        return time.monotonic() - t0

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
            pushes=self._counters.pushes, applies=self._counters.applies)
        if self._steplog is None or self.client is None:
            return record
        st = self.client.stats
        ctrl = (st.control_bytes_sent, st.control_bytes_recv, st.refused)
        if ctrl[2] > self._ctrl0[2]:
            events.append({"type": "refused", "count": ctrl[2] - self._ctrl0[2], "data_bytes": 0})
        self._steplog.record(StepRecord(
            **{f.name: getattr(record, f.name) for f in dataclasses.fields(record)},
            time=time.time(), step_s=step_s, export_s=export_s, apply_s=apply_s, wait_s=wait_s,
            control_bytes_sent=ctrl[0] - self._ctrl0[0], control_bytes_recv=ctrl[1] - self._ctrl0[1],
            round=self._counters.round, attempt=self._counters.attempt, events=events, loss=loss,
            island=self.cfg.island_id))
        self._ctrl0 = ctrl
        return record

    # ------------------------------------------------------------------ finalization


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

    def _take_applies(self) -> list[tuple[int, int, int, bool]]:
        return [(f, b.version, b.round, b.cut) for f, b in sorted(self._pending.items())]

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

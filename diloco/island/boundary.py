"""The island's DiLoCo driver: start-up (INIT, initial cut), the step boundary, finalization.

Every rank of an island builds one :class:`Island` and calls, in this order:

* :meth:`Island.start` once before the first training step — plan, fingerprint, HELLO,
  INIT when the syncer asks for it (streamed, overlapping the gather of fragment k+1 with
  the send of fragment k), then the initial cut;
* :meth:`Island.step_end` right after every ``optimizer.step()`` — the step boundary;
* :meth:`Island.finish` once after the last step — the final cut and shutdown.

Only the sync rank talks to the syncer (through :class:`SyncClient`); it turns what the
client parked into :class:`Orders` and broadcasts them, and every rank executes the same
collectives in the same order. Inside a boundary the order is fixed: **apply** every
received fragment first (blend, new anchor), then **answer pulls** (export ``local −
anchor``); a pull of a fragment is answered only after at least one local step since that
fragment's last apply, so a push never carries a zero delta that would drag the mean.

Failure semantics: anything fatal seen by the sync rank (a refusal, a timeout) is turned
into ``Orders.error`` and raised on every rank together, so no rank is left waiting in a
collective the others skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diloco import wire
from diloco.config import IslandConfig
from diloco.island.client import PendingBcast, SyncClient, SyncError
from diloco.island.orders import Orders, broadcast_orders
from diloco.island.transfer import FragmentTransfer
from diloco.layout.base import LayoutAdapter, group_rank
from diloco.plan import Assignment, FragmentPlan, layout_fingerprint, make_plan
from diloco.steplog import BoundaryRecord, StepLog, StepRecord

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

_INIT_INFLIGHT = 2
"""Fragments the sync rank may hold during INIT: one being sent, one being gathered."""


class IslandError(RuntimeError):
    """Raised on every rank of the island together when syncing cannot go on."""


@dataclass
class _Counters:
    pushes: int = 0
    applies: int = 0
    round: int = 0
    attempt: int = -1


class Island:
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
        self.group = group if group is not None else layout.group
        self.rank = group_rank(self.group)
        self.is_sync = self.rank == config.sync_rank
        self.plan: FragmentPlan = make_plan(layout.specs(), config.fragments, assignment)
        self.fingerprint = layout_fingerprint(self.plan)
        self.transfer = FragmentTransfer(layout, self.plan, self.group, sync_rank=config.sync_rank)
        self.tokens_per_step = tokens_per_step or config.tokens_per_step or 1
        n = self.plan.n_fragments
        # Identical on every rank: updated only from broadcast orders.
        self.versions = [-1] * n
        self.applied_round = [0] * n
        self.steps_since_apply = [0] * n
        self.step = 0
        # Sync rank only.
        self.client: SyncClient | None = None
        self._pulls: dict[int, wire.Pull] = {}
        self._pending: dict[int, PendingBcast] = {}
        self._pushed_at: dict[tuple[int, int], int] = {}
        self._steplog = StepLog(config.step_log_path()) if self.is_sync else None
        self._counters = _Counters()
        self._last_end = time.monotonic()
        self._ctrl0 = (0, 0)
        self._wire_itemsize = torch.empty((), dtype=getattr(torch, config.wire_dtype)).element_size()

    # ------------------------------------------------------------------ start-up
    def start(self) -> BoundaryRecord:
        """Connect, stream INIT if asked, install the initial cut (collective).

        Returns what start-up did (phase ``"start"``; also the step log's first record)."""
        t0 = time.monotonic()
        events: list[dict] = []
        need_init = False
        error: str | None = None
        if self.is_sync:
            self.client = SyncClient(self.cfg, self.fingerprint, fragment_layouts(self.plan))
            try:
                welcome = self.client.wait_welcome(self.cfg.connect_timeout_s)
                need_init = welcome.need_init and self.cfg.island_id == 0
                log.info("island %d joined the syncer: %d fragments, versions %s%s", self.cfg.island_id,
                         self.plan.n_fragments, list(welcome.versions), ", streaming INIT" if need_init else "")
            except (TimeoutError, SyncError) as exc:
                error = str(exc)
        orders = broadcast_orders(Orders(init=need_init, error=error) if self.is_sync else None, self.group,
                                  self.cfg.sync_rank)
        self._raise_if(orders)
        if orders.init:
            self._stream_init(events)
        apply_s = 0.0
        if self.cfg.initial_cut_timeout_s > 0:
            apply_s = self._install_initial_cut(self.cfg.initial_cut_timeout_s, events)
        return self._end_boundary("start", 0, t0, 0.0, 0.0, apply_s, 0.0, events, None)

    def _stream_init(self, events: list[dict]) -> None:
        """Send every fragment's fp32 value; gather k+1 while k is on the wire."""
        inflight: collections.deque = collections.deque()
        t0 = time.monotonic()
        total = sum(self.plan.nbytes(f) for f in range(self.plan.n_fragments))
        sent = 0
        for f in range(self.plan.n_fragments):
            error = None
            if self.is_sync:
                while len(inflight) >= _INIT_INFLIGHT:
                    if not inflight.popleft().wait(self.cfg.connect_timeout_s):
                        error = f"INIT fragment send timed out after {self.cfg.connect_timeout_s:.0f}s"
                        break
            self._raise_if(broadcast_orders(Orders(error=error) if self.is_sync else None, self.group,
                                            self.cfg.sync_rank))
            values = self.transfer.export_fragment(f, delta=False)
            if self.is_sync:
                assert self.client is not None and values is not None
                inflight.append(self.client.send_init(f, values))
                events.append({"type": "init", "fragment": f,
                               "data_bytes": sum(t.numel() * t.element_size() for _, t in values)})
                del values
                sent += self.plan.nbytes(f)
                log.info("INIT %d/%d fragments, %.1f/%.1f MiB, %.1fs", f + 1, self.plan.n_fragments,
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
        while True:
            orders = None
            if self.is_sync:
                assert self.client is not None
                try:
                    have = [f for f in range(self.plan.n_fragments) if self.versions[f] >= 0 or f in self._pending]
                    if len(have) < self.plan.n_fragments:
                        self.client.wait_bcast(min(0.5, max(0.0, deadline - time.monotonic())))
                    self._collect()
                    orders = Orders(applies=self._take_applies())
                    got = {f for f, *_ in orders.applies} | {f for f in range(self.plan.n_fragments)
                                                            if self.versions[f] >= 0}
                    if len(got) == self.plan.n_fragments:
                        orders.stop = "cut installed"
                    elif time.monotonic() >= deadline:
                        orders.stop = "initial cut timeout"
                        log.warning("initial cut: %d of %d fragments after %.0fs; the rest is applied at the "
                                    "step boundaries", len(got), self.plan.n_fragments, timeout_s)
                except SyncError as exc:
                    orders = Orders(error=str(exc))
            orders = broadcast_orders(orders, self.group, self.cfg.sync_rank)
            self._raise_if(orders)
            apply_s += self._apply_all(orders, events)
            if self.is_sync and orders.applies:
                done = sum(v >= 0 for v in self.versions)
                log.info("initial cut: %d/%d fragments installed (%.1fs)", done, self.plan.n_fragments,
                         timeout_s - max(0.0, deadline - time.monotonic()))
            if orders.stop:
                return apply_s

    # ------------------------------------------------------------------ step boundary
    def step_end(self, step: int, loss: float | None = None) -> BoundaryRecord:
        """The step boundary (every rank, right after ``optimizer.step()``).

        Returns what the boundary did: fragments pushed and applied, versions, seconds the
        loop was blocked, payload bytes (the same values the step log records)."""
        t0 = time.monotonic()
        step_s = t0 - self._last_end
        self.step = step
        for f in range(self.plan.n_fragments):
            self.steps_since_apply[f] += 1
        orders = None
        wait_s = 0.0
        if self.is_sync:
            assert self.client is not None
            try:
                self.client.report_step(step)
                self._collect()
                orders = Orders(applies=self._take_applies())
                orders.pushes = self._take_pushes(orders)
            except SyncError as exc:
                orders = Orders(error=str(exc))
        tb = time.monotonic()
        orders = broadcast_orders(orders, self.group, self.cfg.sync_rank)
        wait_s += time.monotonic() - tb
        self._raise_if(orders)
        events: list[dict] = []
        apply_s = self._apply_all(orders, events)
        export_s = self._push_all(orders, events)
        return self._end_boundary("train", step, t0, step_s, export_s, apply_s, wait_s, events, loss)

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
            self._counters.round, self._counters.attempt = max(
                (self._counters.round, self._counters.attempt), (p.round, p.attempt))

    def _take_applies(self) -> list[tuple[int, int, int, bool]]:
        applies = [(f, b.version, b.round, b.cut) for f, b in sorted(self._pending.items())]
        return applies

    def _take_pushes(self, orders: Orders, finishing: bool = False) -> list[tuple[int, int, int]]:
        """Pulls to answer now. While training, a pull waits for one local step on top of the
        newest value (a zero delta would drag the mean). After the last step no step will come:
        the pull is answered anyway, with ``local_steps = 0``, which the syncer weighs 0 — so a
        round opened late (e.g. by a syncer that resumed from a checkpoint) still closes."""
        applied_now = {f for f, *_ in orders.applies}
        cut_now = {f for f, _, _, cut in orders.applies if cut}
        pushes = []
        for f, p in sorted(self._pulls.items()):
            # The newest round of f already committed, counting this boundary's applies; a
            # cut resets it (a resumed syncer re-runs rounds we had seen committed).
            floor = 0 if f in cut_now else self.applied_round[f]
            round_done = max(floor, max((r for g, _, r, cut in orders.applies if g == f and not cut), default=0))
            if p.round <= round_done:
                del self._pulls[f]  # that round committed without us
                continue
            if self.versions[f] < 0 and f not in applied_now:
                continue  # never installed: nothing to push against yet
            if not finishing and (f in applied_now or self.steps_since_apply[f] < 1):
                continue  # wait for a local step on top of the newest value
            pushes.append((f, p.round, p.attempt))
            del self._pulls[f]
        return pushes

    def _apply_all(self, orders: Orders, events: list[dict]) -> float:
        t0 = time.monotonic()
        for f, version, rnd, cut in orders.applies:
            values = None
            data_bytes = 0
            if self.is_sync:
                received = self._pending.pop(f).tensors
                data_bytes = sum(t.numel() * t.element_size() for _, t in received)  # as it came, wire dtype
                values = _fp32(received)
                del received
            alpha = 0.0 if cut else self.cfg.alpha
            self.transfer.apply_fragment(f, values, alpha=alpha, refresh=False)
            del values
            self.versions[f] = version
            # A cut (round 0) resets the round floor: a resumed syncer re-runs later rounds.
            self.applied_round[f] = rnd if cut else max(self.applied_round[f], rnd)
            self.steps_since_apply[f] = 0
            if cut:
                events.append({"type": "cut", "fragment": f, "version": version, "data_bytes": data_bytes})
            else:
                self._counters.applies += 1
                pushed = self._pushed_at.pop((f, rnd), None)
                events.append({"type": "apply", "fragment": f, "version": version, "round": rnd,
                               "data_bytes": data_bytes, "lag_steps": None if pushed is None else self.step - pushed})
        if orders.applies:
            # One model-copy refresh (DP all-gather of the applied fragments' buckets) per boundary.
            self.transfer.refresh(f for f, *_ in orders.applies)
        return time.monotonic() - t0

    def _push_all(self, orders: Orders, events: list[dict]) -> float:
        t0 = time.monotonic()
        for f, rnd, attempt in orders.pushes:
            delta = self.transfer.export_fragment(f, delta=True)
            self._counters.pushes += 1
            steps = self.steps_since_apply[f]
            data_bytes, dropped = 0, False
            if self.is_sync:
                assert self.client is not None and delta is not None
                pull = wire.Pull(fragment=f, round=rnd, attempt=attempt)
                if self.client.push(pull, self.versions[f], steps, steps * self.tokens_per_step, delta):
                    self._pushed_at[(f, rnd)] = self.step
                    # What the client will put on the wire: payload in the wire dtype.
                    data_bytes = sum(t.numel() for _, t in delta) * self._wire_itemsize if steps else 0
                else:
                    dropped = True
            events.append({"type": "push", "fragment": f, "round": rnd, "attempt": attempt,
                           "base_version": self.versions[f], "local_steps": steps, "data_bytes": data_bytes,
                           "dropped": dropped})
        return time.monotonic() - t0

    def _end_boundary(self, phase: str, step: int, t0: float, step_s: float, export_s: float, apply_s: float,
                      wait_s: float, events: list[dict], loss: float | None) -> BoundaryRecord:
        """Close a boundary: the record every rank returns, and the sync rank's step-log line."""
        end = time.monotonic()
        self._last_end = end
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
        ctrl = (st.control_bytes_sent, st.control_bytes_recv)
        self._steplog.record(StepRecord(
            **{f.name: getattr(record, f.name) for f in dataclasses.fields(record)},
            time=time.time(), step_s=step_s, export_s=export_s, apply_s=apply_s, wait_s=wait_s,
            control_bytes_sent=ctrl[0] - self._ctrl0[0], control_bytes_recv=ctrl[1] - self._ctrl0[1],
            round=self._counters.round, attempt=self._counters.attempt, events=events, loss=loss,
            island=self.cfg.island_id))
        self._ctrl0 = ctrl
        return record

    # ------------------------------------------------------------------ finalization
    def finish(self) -> list[int]:
        """After the last step: keep answering rounds until the syncer's final cut arrives,
        install it unblended, acknowledge, and wait for SHUTDOWN. Returns the final versions."""
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
            orders = broadcast_orders(orders, self.group, self.cfg.sync_rank)
            self._raise_if(orders)
            events: list[dict] = []
            apply_s = self._apply_all(orders, events)
            export_s = self._push_all(orders, events)
            if orders.final:
                apply_s += self._install_final(events)
                acked = True
            if events:
                self._end_boundary("finish", self.step, t0, 0.0, export_s, apply_s, 0.0, events, None)
            if orders.stop:
                break
        if self._steplog is not None:
            self._steplog.close()
        if self.client is not None:
            self.client.close()
        return list(self.versions)

    def _finish_orders(self, deadline: float, acked: bool) -> Orders:
        assert self.client is not None
        try:
            self.client.wait_event(0.05)
            if acked:
                if self.client.shutdown_reason is not None:
                    return Orders(stop=self.client.shutdown_reason)
            else:
                finals = self.client.final_fragments()
                if finals is not None:
                    problems = [p for f, (_, t) in finals.items() if (p := self._check_values(f, t))]
                    if problems:
                        return Orders(error=f"the syncer's final cut does not match our plan: {problems[0]}")
                    return Orders(final=True)
            if time.monotonic() > deadline:
                what = "SHUTDOWN" if acked else "the final cut"
                return Orders(error=f"no {what} from the syncer within {self.cfg.final_timeout_s:.0f}s")
            if self.client.shutdown_reason is not None and not acked:
                return Orders(error=f"the syncer shut down before sending the final cut: "
                                    f"{self.client.shutdown_reason}")
            self._collect()
            orders = Orders(applies=self._take_applies())
            orders.pushes = self._take_pushes(orders, finishing=True)
            return orders
        except SyncError as exc:
            return Orders(error=str(exc))

    def _install_final(self, events: list[dict]) -> float:
        t0 = time.monotonic()
        finals = self.client.final_fragments() if self.is_sync and self.client is not None else None
        data_bytes = 0
        for f in range(self.plan.n_fragments):
            values = None
            if finals is not None:
                data_bytes += sum(t.numel() * t.element_size() for _, t in finals[f][1])
                values = _fp32(finals[f][1])
            self.transfer.apply_fragment(f, values, alpha=0.0, refresh=False)
        self.transfer.refresh(range(self.plan.n_fragments))
        # Every rank learns the final versions from one broadcast (the manifest).
        vers = torch.tensor(list(finals[0][0].versions) if finals is not None else [0] * self.plan.n_fragments,
                            dtype=torch.int64)
        dist.broadcast(vers, group=self.group, group_src=self.cfg.sync_rank)
        self.versions = [int(v) for v in vers]
        if self.is_sync and self.client is not None:
            self.client.send_final_ack(self.versions)
        events.append({"type": "final", "versions": list(self.versions), "data_bytes": data_bytes})
        if self.is_sync:
            log.info("island %d installed the final cut, versions %s", self.cfg.island_id, self.versions)
        return time.monotonic() - t0

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
            if self.client is not None:
                self.client.close(linger_s=0.5)
            raise IslandError(f"island {self.cfg.island_id}: {orders.error}")


def fragment_layouts(plan: FragmentPlan) -> list[wire.FragmentLayout]:
    """The flat stream of every fragment (names and global shapes in plan order)."""
    return [wire.FragmentLayout.of([(s.name, s.shape) for s in plan.specs_of(f)]) for f in range(plan.n_fragments)]


def _fp32(tensors: Tensors) -> Tensors:
    return [(name, t if t.dtype == torch.float32 else t.to(torch.float32)) for name, t in tensors]

"""The island's planner: one :class:`FragmentSlot` per fragment, and the rules that turn what the
syncer sent into :class:`~diloco.island.orders.Orders` for every rank. No I/O.

Nothing here touches a socket, a process group, a thread or a clock: the caller passes the
step, what the client parked, which fragment the data path's snapshot slot holds, and ``now``.
Two kinds of callers:

* the **sync rank** feeds the syncer's messages in (:meth:`Planner.park`,
  :meth:`Planner.push_dropped`) and asks :meth:`Planner.plan` for the boundary's orders;
* **every rank** (the executor, ``diloco.island.boundary``) records what it carried out
  (:meth:`Planner.stepped`, :meth:`Planner.staged`, :meth:`Planner.installed`,
  :meth:`Planner.snapshot_taken`, ...), in the order of the orders, so the slots' shared fields
  are identical on every rank. The sync-rank fields (``pull``, ``pending``, ``pushed_at``) are
  only ever set on the sync rank.

A fragment's life (:class:`SlotState`): **new** (never installed) → **anchored** (a global value
installed; ``master − anchor`` is the local progress) → **pushing** (snapshot ``θ_push`` taken,
the push being exported) → **awaiting commit** (the client has the push) → **staging** (a
received global value being scattered in the background) → installed at a later boundary
(anchored again). A staging value is ordered installed once its background job is done on every
rank.

The rules, each a promise of :meth:`Planner.plan`:

* a push carries ``master − anchor``, so it waits until every newer global value of its fragment
  is installed, and until the commit of our own previous push of it is (else the same steps would
  be pushed twice) — unless that pull has waited a whole boundary with no value of the fragment,
  which means its round committed without one (rounds of a fragment commit in order and a value
  precedes the next pull on the connection);
* a pull whose round is known committed (installed, staging or pending) is dropped: that round
  committed without us. A cut resets that floor (a resumed syncer re-runs rounds);
* while training, a push waits for one local step on top of the value installed now (a zero
  delta would drag the mean), and waits while every snapshot slot of the data path
  (``YETO_DILOCO_SNAPSHOT_SLOTS``, 1 by default) holds another fragment whose commit is not
  installed at this same boundary; after the last step
  (``finishing``) a push goes at once with what is left (possibly 0 steps) and needs no slot;
* slots go to pulls oldest round first, and a pull that must wait keeps its claim on one: the
  syncer commits rounds in order, so a later round holding the last slot would wait on a commit
  that needs the earlier round's push, which would wait on that slot;
* a ``stale_base`` refusal of our outstanding push is passed to every rank: the value the syncer
  resends is installed keeping the progress since that push's snapshot;
* synchronous rounds: a boundary whose step opens a round not yet installed holds (another
  boundary, no step) until it is installed, or for at most ``sync_timeout_s``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from diloco import wire
from diloco.island.orders import Orders, PendingBcast, PushOrder, Value
from diloco.protocol.schedule import Schedule

log = logging.getLogger("diloco.island.boundary")

MODES = ("cut", "progress", "blend")
"""How an install writes the masters (``DataPath.install``): the value as it is; the value plus
the local progress since the push's snapshot; or an ``α``-blend (0 = replace)."""


class SlotState(enum.Enum):
    """The named phases of one fragment (see the module docstring)."""

    NEW = "new"
    ANCHORED = "anchored"
    PUSHING = "pushing"
    AWAITING_COMMIT = "awaiting commit"
    STAGING = "staging"


@dataclass(frozen=True)
class Staged:
    """A fragment's global value being staged in the background, installed once done everywhere."""

    value: Value
    mode: str
    """How the install writes the masters: one of :data:`MODES`."""
    seq: int
    """Background job number of the staging."""
    data_bytes: int
    """Payload bytes of the received value, as it came (wire dtype; sync rank, 0 elsewhere)."""


@dataclass
class FragmentSlot:
    """Everything the island knows about one fragment's synchronisation; owned by the planner."""

    fragment: int
    version: int = -1
    """Version of the global value installed last (-1: none yet)."""
    anchor_version: int = -1
    """Version of the global value the anchors hold: the one staged last, or installed last
    (-1: none). A held FINAL of this version is installed from them."""
    applied_round: int = 0
    """Newest round installed (a cut resets it to its own round)."""
    unmerged_steps: int = 0
    """Local steps in ``master − anchor`` (what the next push carries)."""
    snap_round: int | None = None
    """Round of the outstanding push snapshot (``θ_push``), until that round's value is installed."""
    snap_steps: int = 0
    """Local steps the outstanding snapshot's push carried (given back if it is never merged)."""
    staging: Staged | None = None
    stale: bool = False
    """The outstanding push was refused ``stale_base`` (from orders: every rank)."""
    # Sync rank only.
    pull: wire.Pull | None = None
    """The newest pull of this fragment not answered yet."""
    parked_at: int = 0
    """Planner decision number at which ``pull`` was parked."""
    pending: PendingBcast | None = None
    """The newest received value not staged yet (holds its tensors until staged)."""
    pushed_at: tuple[int, int] | None = None
    """(round, step) of the outstanding push, for the lag of its commit's install."""
    handed: bool = False
    """The client has the outstanding push (it is on its way to the syncer)."""

    @property
    def state(self) -> SlotState:
        """The phase this slot is in (``PUSHING`` vs ``AWAITING_COMMIT``: as the sync rank knows it)."""
        if self.staging is not None:
            return SlotState.STAGING
        if self.snap_round is not None:
            return SlotState.AWAITING_COMMIT if self.handed else SlotState.PUSHING
        return SlotState.NEW if self.version < 0 else SlotState.ANCHORED

    def known_committed(self, installs: dict[int, Value]) -> int:
        """The newest round of this fragment known committed: installed (now or before),
        staging, or pending; a cut installed now resets the floor to 0."""
        now = installs.get(self.fragment)
        known = [0 if now is not None and now.cut else self.applied_round]
        if now is not None and not now.cut:
            known.append(now.round)
        if self.staging is not None and not self.staging.value.cut:
            known.append(self.staging.value.round)
        if self.pending is not None and not self.pending.cut:
            known.append(self.pending.round)
        return max(known)


class Planner:
    """The slots of every fragment and the rules of :meth:`plan` (see the module docstring).

    Args:
        n_fragments: fragments of the plan.
        apply_mode: ``"progress"`` (keep local progress on install) or anything else (blend).
        sync_rounds: hold boundaries until the round a step opens is installed.
        sync_timeout_s: the longest such hold, then the run goes on without that round.
        island: the island's id, for the log.
    """

    def __init__(self, n_fragments: int, *, apply_mode: str = "progress", sync_rounds: bool = False,
                 sync_timeout_s: float = 60.0, island: int = 0) -> None:
        self.island = island
        self.slots = [FragmentSlot(f) for f in range(n_fragments)]
        self.apply_mode = apply_mode
        self.sync_rounds = sync_rounds
        self.sync_timeout_s = sync_timeout_s
        self.schedule = (0, 0)
        """The syncer's (H, total steps), from WELCOME: when rounds open (synchronous rounds)."""
        self.pushes = 0
        self.applies = 0
        """Pushes snapshotted and commits installed so far (every rank)."""
        self.newest_pull = (0, -1)
        """(round, attempt) of the newest pull seen (sync rank; for the step log)."""
        self.decisions = 0
        self._stale_new: list[int] = []
        self._held_at = (-1, 0.0)
        """(step, clock) of the hold in progress (synchronous rounds), to bound it."""

    @property
    def versions(self) -> list[int]:
        return [s.version for s in self.slots]

    # ------------------------------------------------------------------ sync rank: what came in
    def park(self, bcasts: Iterable[PendingBcast] = (), pulls: Iterable[wire.Pull] = (),
             stale: Iterable[tuple[int, int]] = ()) -> None:
        """Take what the client parked: received values (already checked against the plan),
        pulls (deduplicated by the client) and ``stale_base`` refusals ``(fragment, round)``."""
        for b in bcasts:
            slot = self.slots[b.fragment]
            slot.pending = b
            if b.cut:
                # A cut redefines the fragment (after a rejoin, possibly from a syncer that resumed
                # an older checkpoint and re-runs rounds we saw): pulls parked before it are void.
                slot.pull = None
        for p in pulls:
            slot = self.slots[p.fragment]
            have = slot.pull
            if have is None or (p.round, p.attempt) > (have.round, have.attempt):
                slot.pull = p
                slot.parked_at = self.decisions
            self.newest_pull = max(self.newest_pull, (p.round, p.attempt))
        for f, rnd in stale:
            if self.slots[f].snap_round == rnd and f not in self._stale_new:
                log.warning("island %d: push of fragment %d round %d refused (it missed a value): installing "
                            "the syncer's current value, then answering the pull again", self.island, f, rnd)
                self._stale_new.append(f)

    def push_dropped(self, f: int, rnd: int, steps: int) -> None:
        """The client's send queue refused our push of ``f`` for round ``rnd``: its steps are
        unmerged again (the syncer pulls again), and only once: the snapshot no longer carries them."""
        slot = self.slots[f]
        slot.unmerged_steps += steps
        if slot.snap_round == rnd:
            slot.snap_steps = 0
        slot.handed = False
        if slot.pushed_at is not None and slot.pushed_at[0] == rnd:
            slot.pushed_at = None

    def push_handed(self, f: int) -> None:
        """The client took our outstanding push of ``f``."""
        self.slots[f].handed = True

    def pending_values(self) -> list[Value]:
        """Received values not staged yet, by fragment (sync rank)."""
        return [_value_of(s.pending) for s in self.slots if s.pending is not None]

    def take_pending(self, f: int) -> PendingBcast:
        """Hand over fragment ``f``'s pending value (its tensors) to be staged or installed."""
        slot = self.slots[f]
        assert slot.pending is not None, f"no pending value of fragment {f}"
        out, slot.pending = slot.pending, None
        return out

    # ------------------------------------------------------------------ sync rank: the decision
    def plan(self, step: int, *, finishing: bool, done_everywhere: int, slot_holders: frozenset[int],
             free_slots: int, now: float, progress_at: float = -1.0) -> Orders:
        """The boundary's orders: install what is staged everywhere (background job
        ``<= done_everywhere``), stage what arrived, answer pulls, and (synchronous rounds) hold.

        ``slot_holders``: the fragments whose snapshot a slot of the data path holds;
        ``free_slots``: how many slots are free (``YETO_DILOCO_SNAPSHOT_SLOTS`` in all);
        ``progress_at``: when anything at the syncer or on our link last moved (a hold gives up
        only after ``sync_timeout_s`` with no progress anywhere)."""
        installs = [s.staging.value for s in self.slots if s.staging is not None and s.staging.seq <= done_everywhere]
        installing = {v.fragment for v in installs}
        stages = [_value_of(s.pending) for s in self.slots
                  if s.pending is not None and (s.staging is None or s.fragment in installing)]
        orders = Orders(applies=installs, stages=stages, stale=self._stale_new)
        self._stale_new = []
        orders.pushes = self._take_pushes(orders, finishing, slot_holders, free_slots)
        orders.hold = self.sync_rounds and not finishing and self._holding(orders, step, now, progress_at)
        self.decisions += 1
        return orders

    def _take_pushes(self, orders: Orders, finishing: bool, slot_holders: frozenset[int],
                     free_slots: int) -> list[PushOrder]:
        installs = {v.fragment: v for v in orders.applies}
        # Slots this boundary can hand out: the free ones and those its installs give back first.
        available = free_slots + len(slot_holders & set(installs))
        replaced = {f for f in installs if self._staging_mode(f) != "progress"}
        pushes = []
        # Oldest round first, and a pull that must wait keeps its claim on a slot: rounds commit in
        # round order, so a later round's push holding the last slot would wait for a commit that
        # needs the earlier push, which would wait for that slot.
        for slot in sorted((s for s in self.slots if s.pull is not None), key=lambda s: s.pull.round):  # type: ignore[union-attr]
            f, p = slot.fragment, slot.pull
            assert p is not None
            if p.round <= slot.known_committed(installs):
                slot.pull = None  # that round committed without us
                continue
            needs_slot = not finishing and (f not in slot_holders or f in installs)
            if self._waits(slot, p, installs, replaced, finishing):
                available -= 1 if needs_slot else 0  # its slot stays reserved for it
                continue
            if needs_slot and available < 1:
                available -= 1  # every snapshot slot holds another push until that commit is installed
                continue
            available -= 1 if needs_slot else 0
            pushes.append(PushOrder(f, p.round, p.attempt))
            slot.pull = None
        return pushes

    def _waits(self, slot: FragmentSlot, p: wire.Pull, installs: dict[int, Value], replaced: set[int],
               finishing: bool) -> bool:
        """Whether the pull ``p`` of ``slot`` must wait for a later boundary (slots aside)."""
        f = slot.fragment
        if slot.pending is not None or (slot.staging is not None and f not in installs):
            return True  # a newer global value is on its way: push on top of it
        if slot.version < 0 and f not in installs:
            return True  # never installed: nothing to push against yet
        if slot.snap_round is not None and slot.snap_round < p.round and f not in installs \
                and slot.parked_at >= self.decisions:
            return True  # our previous push's commit may still come: wait one boundary for it
        return not finishing and (slot.unmerged_steps < 1 or f in replaced)  # a local step on top of the install

    def _staging_mode(self, f: int) -> str:
        staging = self.slots[f].staging
        assert staging is not None
        return staging.mode

    def _holding(self, orders: Orders, step: int, now: float, progress_at: float) -> bool:
        """Does a round that opens at this very step still lack its install?

        Holding only at that step (never for a round already passed) keeps a late joiner or a
        resumed syncer, whose rounds restart elsewhere, from waiting for rounds that will not
        come; a hold is given up with a warning after ``sync_timeout_s`` in which nothing moved
        (a slow link that is making progress keeps it)."""
        h, total = self.schedule
        if h <= 0 or (total > 0 and step > total):
            return False
        installing = {(v.fragment, v.round) for v in orders.applies}
        sched = Schedule(h, len(self.slots), total)
        waiting = [t for t in sched.rounds_opening_at(step)
                   if self.slots[sched.fragment_of(t)].applied_round < t and (sched.fragment_of(t), t) not in installing]
        if not waiting:
            return False
        if self._held_at[0] != step:
            self._held_at = (step, now)
        elif now - max(self._held_at[1], progress_at) > self.sync_timeout_s:
            log.warning("island %d: round %s of step %d not installed after %.0fs: training on without it",
                        self.island, waiting, step, now - self._held_at[1])
            return False
        return True

    # ------------------------------------------------------------------ every rank: what was done
    def stepped(self) -> None:
        """One local optimizer step: every fragment has one more unmerged step."""
        for slot in self.slots:
            slot.unmerged_steps += 1

    def mark_stale(self, fragments: Iterable[int]) -> None:
        """``Orders.stale``: these fragments' outstanding pushes were refused ``stale_base``."""
        for f in fragments:
            self.slots[f].stale = True

    def staging_mode(self, value: Value, holds_snapshot: bool) -> str:
        """How ``value`` will be installed: ``cut`` for a cut; ``progress`` when keeping local
        progress is asked and the data path holds this fragment's push snapshot of a round not
        after ``value``'s (or one the syncer refused stale, whose push merged nothing: the
        steps since its snapshot are kept, those before it are lost, never counted twice);
        else ``blend``."""
        if value.cut:
            return "cut"
        slot = self.slots[value.fragment]
        snap = slot.snap_round
        if self.apply_mode == "progress" and snap is not None and (snap <= value.round or slot.stale) \
                and holds_snapshot:
            return "progress"
        return "blend"

    def staged(self, value: Value, mode: str, seq: int, data_bytes: int) -> None:
        """``value`` is being staged by background job ``seq``, to be installed with ``mode``."""
        assert mode in MODES, mode
        slot = self.slots[value.fragment]
        slot.stale = False
        slot.staging = Staged(value, mode, seq, data_bytes)
        slot.anchor_version = value.version

    def take_staged(self, f: int) -> Staged:
        """The staged value of ``f`` ordered installed now (it leaves the slot)."""
        slot = self.slots[f]
        assert slot.staging is not None, f"fragment {f} is not staged"
        out, slot.staging = slot.staging, None
        return out

    def installed(self, value: Value, progress: bool, step: int) -> int | None:
        """``value`` is written into the masters (its anchor is the raw value); ``progress``: the
        local progress since the push snapshot was kept. Returns the commit's lag in steps since
        our push of that round (None for a cut or a round we did not push)."""
        slot = self.slots[value.fragment]
        slot.version = slot.anchor_version = value.version
        slot.applied_round = value.round if value.cut else max(slot.applied_round, value.round)
        slot.snap_round, slot.handed = None, False
        if not progress:
            slot.unmerged_steps = 0  # the local value was replaced (or blended): nothing unmerged
        if value.cut:
            return None
        self.applies += 1
        pushed, slot.pushed_at = slot.pushed_at, None
        if pushed is None or pushed[0] != value.round:
            slot.pushed_at = pushed
            return None
        return step - pushed[1]

    def snapshot_taken(self, order: PushOrder, step: int) -> int:
        """The push snapshot of ``order`` is taken; returns the local steps it carries (then 0
        unmerged). A previous snapshot whose push was never merged gives its steps back first:
        the anchor did not move, so they are still unmerged."""
        slot = self.slots[order.fragment]
        if slot.snap_round is not None:
            slot.unmerged_steps += slot.snap_steps
        steps, slot.unmerged_steps = slot.unmerged_steps, 0
        slot.snap_round, slot.snap_steps, slot.handed = order.round, steps, False
        slot.pushed_at = (order.round, step)
        self.pushes += 1
        return steps

    def drained(self) -> None:
        """Every background job is done and the data path let go of its snapshots (finalization):
        nothing is staging, no snapshot is outstanding."""
        for slot in self.slots:
            slot.staging, slot.snap_round, slot.handed = None, None, False

    def final_installed(self, versions: list[int]) -> None:
        """The syncer's final cut is installed with these versions."""
        for slot, v in zip(self.slots, versions, strict=True):
            slot.version = slot.anchor_version = v


def _value_of(b: PendingBcast) -> Value:
    return Value(b.fragment, b.version, b.round, b.cut, b.commit_us, b.held, b.arrived)

"""The island's planner against scripted syncer messages: no process, no socket, no clock.

``Boundary`` plays the executor of ``diloco.island.boundary`` on one rank with plain values: it
carries the planner's orders out in their fixed order (install, stage, push), records them in
the planner, and models the data path's snapshot slots as ``DataPath`` keeps them (taken by a
snapshot while free, slotless otherwise; let go when its fragment is installed).
"""

from __future__ import annotations

import msgspec
import pytest

from diloco import wire
from diloco.island.orders import Orders, PendingBcast, PushOrder, Value
from diloco.island.planner import Planner, SlotState

pytestmark = pytest.mark.timeout(10)


def bcast(f: int, version: int, rnd: int, cut: bool = False) -> PendingBcast:
    return PendingBcast(f, version, rnd, cut, [])


def pull(f: int, rnd: int, attempt: int = 0) -> wire.Pull:
    return wire.Pull(fragment=f, round=rnd, attempt=attempt)


class Boundary:
    """One rank's executor over plain values (see the module docstring)."""

    def __init__(self, planner: Planner, slots: int = 1) -> None:
        self.p = planner
        self.slots = slots
        self.step = 0
        self.seq = 0
        self.done = 0
        """Background jobs done everywhere (the test decides when staging finishes)."""
        self.holders: set[int] = set()
        self.pushed: list[tuple[PushOrder, int]] = []
        self.modes: dict[int, str] = {}
        self.now = 0.0
        self.progress_at = -1.0
        """When anything last moved at the syncer or on the link (the client's liveness)."""

    def train_step(self) -> None:
        self.step += 1
        self.p.stepped()

    def run(self, *, bcasts: list[PendingBcast] = (), pulls: list[wire.Pull] = (),  # type: ignore[assignment]
            stale: list[tuple[int, int]] = (), finishing: bool = False, staged_done: bool = True) -> Orders:
        """Park what the client parked, plan, execute. ``staged_done``: every staging job
        submitted before this boundary has finished everywhere."""
        if staged_done:
            self.done = self.seq
        self.p.park(bcasts, pulls, stale)
        orders = self.p.plan(self.step, finishing=finishing, done_everywhere=self.done,
                             slot_holders=frozenset(self.holders), free_slots=self.slots - len(self.holders),
                             now=self.now, progress_at=self.progress_at)
        orders = Orders.from_json(orders.to_json()) if not orders.is_idle() else orders  # as the other ranks see it
        for v in orders.applies:
            st = self.p.take_staged(v.fragment)
            self.holders.discard(v.fragment)
            self.p.installed(v, st.mode == "progress", self.step)
        self.p.mark_stale(orders.stale)
        for v in orders.stages:
            self.p.take_pending(v.fragment)
            mode = self.p.staging_mode(v, holds_snapshot=v.fragment in self.holders)
            self.seq += 1
            self.p.staged(v, mode, self.seq, 0)
            self.modes[v.fragment] = mode
        for order in orders.pushes:
            if order.fragment in self.holders or len(self.holders) < self.slots:
                self.holders.add(order.fragment)  # else slotless (only after the last step)
            steps = self.p.snapshot_taken(order, self.step)
            self.pushed.append((order, steps))
            self.p.push_handed(order.fragment)
        return orders

    def install_cut(self, f: int, version: int = 0) -> None:
        """A fragment's initial cut, staged and installed over two boundaries."""
        self.run(bcasts=[bcast(f, version, 0, cut=True)])
        self.run()
        assert self.p.slots[f].version == version


def anchored(n: int = 1, slots: int = 1, **kw: object) -> Boundary:
    b = Boundary(Planner(n, **kw), slots)  # type: ignore[arg-type]
    for f in range(n):
        b.install_cut(f)
    return b


def test_state_walk_of_one_fragment() -> None:
    b = Boundary(Planner(1))
    slot = b.p.slots[0]
    assert slot.state is SlotState.NEW
    b.install_cut(0)
    assert slot.state is SlotState.ANCHORED
    b.train_step()
    orders = b.run(pulls=[pull(0, 1)])
    assert orders.pushes == [PushOrder(0, 1, 0)] and b.pushed[-1][1] == 1
    assert slot.state is SlotState.AWAITING_COMMIT
    b.train_step()
    b.run(bcasts=[bcast(0, 1, 1)], staged_done=False)
    assert slot.state is SlotState.STAGING and b.modes[0] == "progress"
    b.train_step()
    orders = b.run()
    assert orders.applies == [Value(0, 1, 1, False)]
    assert slot.state is SlotState.ANCHORED and slot.version == 1 and slot.applied_round == 1
    assert slot.unmerged_steps == 2, "progress mode keeps the steps taken since the snapshot"
    assert b.p.applies == 1 and b.p.pushes == 1


def test_a_push_waits_for_the_installed_commit_of_the_previous_push() -> None:
    b = anchored()
    b.train_step()
    b.run(pulls=[pull(0, 1)])
    b.train_step()
    # The next round's pull arrives before round 1's value: its commit may still come.
    assert b.run(pulls=[pull(0, 2)]).pushes == []
    b.train_step()
    orders = b.run(bcasts=[bcast(0, 1, 1)], staged_done=False)
    assert orders.stages == [Value(0, 1, 1, False)] and orders.pushes == [], "a newer value is on its way"
    b.train_step()
    orders = b.run()
    assert orders.applies == [Value(0, 1, 1, False)]
    assert orders.pushes == [PushOrder(0, 2, 0)], "pushed on top of the commit installed at this boundary"
    assert b.pushed[-1][1] == 3, "the steps since round 1's snapshot, not those it carried"


def test_a_pull_that_waited_a_whole_boundary_without_a_value_is_answered() -> None:
    b = anchored()
    b.train_step()
    b.run(pulls=[pull(0, 1)])
    b.train_step()
    assert b.run(pulls=[pull(0, 2)]).pushes == []
    b.train_step()
    # No BCAST of fragment 0 came with or after that pull: round 1 committed without a value.
    orders = b.run()
    assert orders.pushes == [PushOrder(0, 2, 0)]
    assert b.pushed[-1][1] == 3, "round 1 merged nothing: its step is given back, with the two since"


def test_a_newer_value_pending_blocks_a_push() -> None:
    b = anchored()
    b.train_step()
    b.run(bcasts=[bcast(0, 1, 1)], staged_done=False)  # staging, its job not done
    b.train_step()
    orders = b.run(bcasts=[bcast(0, 2, 2)], pulls=[pull(0, 3)], staged_done=False)
    assert orders.stages == [], "one staging per fragment at a time: version 2 stays pending"
    assert orders.pushes == []
    b.train_step()
    orders = b.run()
    assert orders.applies == [Value(0, 1, 1, False)] and orders.stages == [Value(0, 2, 2, False)]
    assert orders.pushes == [], "version 2 is still on its way"
    b.train_step()
    orders = b.run()
    assert orders.applies == [Value(0, 2, 2, False)]
    assert orders.pushes == [], "a blended install replaced the local value: wait for a local step"
    b.train_step()
    assert b.run().pushes == [PushOrder(0, 3, 0)]


def test_a_round_committed_without_us_drops_the_pull() -> None:
    b = anchored()
    b.train_step()
    b.run(bcasts=[bcast(0, 3, 3)])
    b.run()
    assert b.p.slots[0].applied_round == 3
    b.train_step()
    orders = b.run(pulls=[pull(0, 2)])
    assert orders.pushes == [] and b.p.slots[0].pull is None
    # Known committed while still pending or staging counts too.
    b.run(bcasts=[bcast(0, 5, 5)], pulls=[pull(0, 4)], staged_done=False)
    assert b.p.slots[0].pull is None


def test_a_stale_refusal_installs_the_resent_value_keeping_progress_then_pushes_again() -> None:
    b = anchored()
    b.train_step()
    b.run(pulls=[pull(0, 2)])
    b.train_step()
    # The syncer refused the push stale_base (it missed round 1), resends round 1's value and the pull.
    orders = b.run(stale=[(0, 2)], bcasts=[bcast(0, 1, 1)], staged_done=False)
    assert orders.stale == [0] and orders.stages == [Value(0, 1, 1, False)]
    assert b.modes[0] == "progress", "the refused push merged nothing: keep the progress since its snapshot"
    assert b.run(stale=[(0, 1)]).stale == [], "a refusal of a round we hold no snapshot of is ignored"
    b.train_step()
    orders = b.run(pulls=[pull(0, 2, attempt=1)])
    assert orders.pushes == [PushOrder(0, 2, 1)]


def test_synchronous_rounds_hold_until_installed_or_timeout() -> None:
    b = anchored(2, sync_rounds=True, sync_timeout_s=5.0)
    b.p.schedule = (4, 0)  # H 4, two fragments: round t opens at step ceil(2t)
    b.train_step()
    assert not b.run().hold, "no round opens at step 1"
    b.train_step()
    assert b.run().hold, "round 1 (fragment 0) opens at step 2 and is not installed"
    b.now = 3.0
    assert b.run().hold
    b.now = 5.5
    assert not b.run().hold, "held longer than the timeout: train on without it"
    b.train_step()
    b.train_step()  # step 4: round 2 (fragment 1)
    b.now = 10.0
    assert b.run(bcasts=[bcast(1, 2, 2)], staged_done=False).hold
    orders = b.run()
    assert orders.applies == [Value(1, 2, 2, False)] and not orders.hold, "installing it now ends the hold"
    assert not b.run(finishing=True).hold


def test_finishing_pushes_at_once_even_with_zero_steps() -> None:
    b = anchored()
    assert b.p.slots[0].unmerged_steps == 0
    assert b.run(pulls=[pull(0, 1)]).pushes == [], "while training a push waits for a local step"
    orders = b.run(finishing=True)
    assert orders.pushes == [PushOrder(0, 1, 0)] and b.pushed[-1][1] == 0


def test_a_cut_resets_the_round_floor() -> None:
    b = anchored()
    b.run(bcasts=[bcast(0, 5, 5)])
    b.run()
    assert b.p.slots[0].applied_round == 5
    b.train_step()
    # A resumed syncer sends its cut (round 0) and re-runs round 2.
    b.run(bcasts=[bcast(0, 2, 0, cut=True)], staged_done=False)
    orders = b.run(pulls=[pull(0, 2)])
    assert orders.applies == [Value(0, 2, 0, True)] and orders.pushes == [], "the cut replaced the value"
    assert b.p.slots[0].pull is not None, "round 2 is above the cut's floor: kept"
    assert b.p.slots[0].applied_round == 0
    b.train_step()
    assert b.run().pushes == [PushOrder(0, 2, 0)]


def test_a_cut_voids_the_pulls_parked_before_it() -> None:
    b = anchored()
    b.run(pulls=[pull(0, 7)])  # no local step yet: it waits
    assert b.p.slots[0].pull is not None
    b.run(bcasts=[bcast(0, 3, 0, cut=True)], staged_done=False)
    assert b.p.slots[0].pull is None


def test_the_single_snapshot_slot_defers_another_fragments_push() -> None:
    b = anchored(2)
    b.train_step()
    b.run(pulls=[pull(0, 1)])
    assert b.holders == {0}
    b.train_step()
    assert b.run(pulls=[pull(1, 2)]).pushes == [], "the slot holds fragment 0's push until its commit"
    b.train_step()
    b.run(bcasts=[bcast(0, 1, 1)], staged_done=False)
    b.train_step()
    orders = b.run()
    assert orders.applies == [Value(0, 1, 1, False)]
    assert orders.pushes == [PushOrder(1, 2, 0)], "fragment 0's commit is installed at this boundary"
    assert b.holders == {1}


def test_after_the_last_step_a_push_needs_no_slot() -> None:
    b = anchored(2)
    b.train_step()
    b.run(pulls=[pull(0, 1)])
    orders = b.run(pulls=[pull(1, 2)], finishing=True)
    assert orders.pushes == [PushOrder(1, 2, 0)] and b.holders == {0}


def test_a_dropped_push_gives_its_steps_back_once() -> None:
    b = anchored()
    b.train_step()
    b.train_step()
    b.run(pulls=[pull(0, 1)])
    b.p.push_dropped(0, 1, 2)
    assert b.p.slots[0].unmerged_steps == 2 and b.p.slots[0].state is SlotState.PUSHING
    b.train_step()
    b.run(pulls=[pull(0, 1, attempt=1)])
    b.run()
    assert b.pushed[-1] == (PushOrder(0, 1, 1), 3)


def test_newest_pull_attempt_wins_and_is_reported() -> None:
    b = anchored()
    b.train_step()
    b.p.park(pulls=[pull(0, 1, attempt=2)])
    orders = b.run(pulls=[pull(0, 1, attempt=1)])
    assert orders.pushes == [PushOrder(0, 1, 2)] and b.p.newest_pull == (1, 2)


def test_orders_travel_as_named_validated_json() -> None:
    orders = Orders(applies=[Value(0, 3, 2, False)], stages=[Value(1, 4, 3, True)], pushes=[PushOrder(2, 5, 1)],
                    stale=[1], hold=True, stop="done")
    raw = orders.to_json()
    assert b'"fragment"' in raw and Orders.from_json(raw) == orders
    with pytest.raises(msgspec.ValidationError):
        Orders.from_json(b'{"applies": [[0, 3, 2, false]]}')
    assert Orders().is_idle() and not orders.is_idle()


def test_two_snapshot_slots_let_two_fragments_push_before_either_commit() -> None:
    b = anchored(3, slots=2)
    b.train_step()
    assert b.run(pulls=[pull(0, 1)]).pushes == [PushOrder(0, 1, 0)]
    b.train_step()
    assert b.run(pulls=[pull(1, 2)]).pushes == [PushOrder(1, 2, 0)], "a second slot is free"
    b.train_step()
    assert b.run(pulls=[pull(2, 3)]).pushes == [], "both slots hold a push awaiting its commit"
    assert b.holders == {0, 1}


def test_the_slot_goes_to_the_oldest_round_and_a_waiting_one_keeps_its_claim() -> None:
    """Rounds commit in round order. With one slot, pulls of round 4 (fragment 3) and round 5
    (fragment 0) outstanding: round 4 must push first; round 5 taking the slot would wait for a
    commit that needs round 4's push, which would wait for the slot (a deadlock seen at 2.7B)."""
    b = anchored(4)
    b.train_step()
    b.run(pulls=[pull(2, 3)])
    assert b.holders == {2}
    b.train_step()
    assert b.run(pulls=[pull(3, 4), pull(0, 5)]).pushes == [], "the slot holds fragment 2's push"
    b.train_step()
    b.run(bcasts=[bcast(2, 1, 3)], staged_done=False)
    b.train_step()
    orders = b.run()
    assert orders.pushes == [PushOrder(3, 4, 0)], "the oldest round gets the freed slot"
    assert b.holders == {3}


def test_a_later_round_does_not_take_the_slot_an_earlier_waiting_pull_needs() -> None:
    b = anchored(4)
    b.p.slots[3].pending = bcast(3, 1, 2)  # a newer value of fragment 3 is on its way: round 4 waits
    b.train_step()
    orders = b.run(pulls=[pull(3, 4), pull(0, 5)], staged_done=False)
    assert PushOrder(0, 5, 0) not in orders.pushes and 0 not in b.holders


def test_a_hold_lasts_while_anything_moves_and_ends_after_the_timeout_without_progress() -> None:
    b = anchored(2, sync_rounds=True, sync_timeout_s=5.0)
    b.p.schedule = (4, 0)
    b.train_step()
    b.train_step()
    assert b.run().hold, "round 1 opens at step 2 and is not installed"
    b.now, b.progress_at = 20.0, 18.0  # a slow link: the value is still streaming in
    assert b.run().hold, "progress 2 s ago: still holding after 20 s"
    b.now = 23.5
    assert not b.run().hold, "nothing moved for 5.5 s: train on without it"

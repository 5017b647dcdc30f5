"""The round schedule (diloco.protocol.schedule) against a step-by-step loop reference and numpy."""

from __future__ import annotations

import numpy as np
import pytest

from diloco.protocol.schedule import Schedule

pytestmark = pytest.mark.timeout(30)


def reference(h: int, p: int, steps: int) -> list[tuple[int, int, int]]:
    """(round, fragment, opening step) of every round that opens by ``steps``, found by walking the
    clock one step at a time: round t opens at the first step s with s * P >= t * H (t * H / P
    steps have passed), and fragments take turns."""
    out, t, fragment = [], 1, 0
    for s in range(1, steps + 1):
        while t * h <= s * p:
            out.append((t, fragment, s))
            t += 1
            fragment = (fragment + 1) % p
    return out


GRID = [(h, p) for h in range(1, 13) for p in range(1, 7)]


@pytest.mark.parametrize(("h", "p"), GRID)
def test_schedule_matches_the_loop_reference(h: int, p: int) -> None:
    total = 37
    sched = Schedule(h, p, total)
    ref = reference(h, p, total)
    assert [(t, sched.fragment_of(t), sched.opening_step(t)) for t, _, _ in ref] == ref
    assert sched.scheduled_rounds == len(ref)
    assert all(sched.in_training(t) for t, _, _ in ref)
    assert not sched.in_training(len(ref) + 1)
    for s in range(0, total + 1):
        opening = [t for t, _, step in ref if step == s]
        assert list(sched.rounds_opening_at(s)) == opening, s
        assert sched.rounds_opened_by(s) == sum(1 for _, _, step in ref if step <= s)
    assert list(sched.flush_fragments()) == list(range(p))
    assert sched.spacing_steps == h / p


def test_each_fragment_is_synced_every_h_steps_numpy() -> None:
    h, p = 10, 4
    sched = Schedule(h, p)
    rounds = np.arange(1, 4001)
    steps = np.array([sched.opening_step(int(t)) for t in rounds])
    frags = np.array([sched.fragment_of(int(t)) for t in rounds])
    assert np.array_equal(steps, np.ceil(rounds * h / p).astype(int))
    assert np.array_equal(frags, (rounds - 1) % p)
    for f in range(p):  # the same fragment comes back exactly H steps later
        assert set(np.diff(steps[frags == f]).tolist()) == {h}


def test_unbounded_run_never_ends_and_bounds_are_checked() -> None:
    sched = Schedule(8, 2)
    assert sched.scheduled_rounds == 0 and sched.in_training(10**9)
    assert list(sched.rounds_opening_at(0)) == []
    for bad in [dict(sync_every=0, n_fragments=1), dict(sync_every=1, n_fragments=0),
                dict(sync_every=1, n_fragments=1, total_steps=-1), dict(sync_every=True, n_fragments=1)]:
        with pytest.raises(ValueError):
            Schedule(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="from 1"):
        sched.fragment_of(0)

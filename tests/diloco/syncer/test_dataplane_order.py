"""The data plane's scheduling: while commit parts are queued, folds run one at a time (commits first,
and the backlog still drains).

The kernels are replaced by a recorder here: what is under test is which worker runs what,
and when, not the arithmetic (``test_outer.py`` checks that against numpy).
"""

from __future__ import annotations

import queue
import threading
import time
import types

import pytest
import torch

from diloco.syncer import dataplane
from diloco.syncer.core.work import CommitPart, FoldPart, InitPart, Result, RoundSum, Work

pytestmark = pytest.mark.timeout(30)


def _fold(part: int) -> FoldPart:
    s = RoundSum(round=2, attempt=0, fragment=1, flat=torch.zeros(4), n_parts=1)
    return FoldPart(sum=s, part=part, lo=0, opened=types.SimpleNamespace(nbytes=16, release=lambda: None), weight=1, island=0)  # type: ignore[arg-type]


def _commit(part: int) -> CommitPart:
    s = RoundSum(round=1, attempt=0, fragment=0, flat=torch.zeros(4), n_parts=1)
    return CommitPart(round=1, fragment=0, part=part, value=torch.zeros(4), momentum=None,
                      new_momentum=None, sum=s, total_weight=1, hyper=None, layout=None, part_elems=4,  # type: ignore[arg-type]
                      encode_dtypes=(), version=1)


def _init(part: int) -> InitPart:
    return InitPart(fragment=0, part=part, lo=0, opened=types.SimpleNamespace(nbytes=16, release=lambda: None),  # type: ignore[arg-type]
                    value=torch.zeros(4))


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    """A two-worker data plane whose work items record when they start and end; a commit, and a
    fold of part 0, run until released."""
    events: list[tuple[str, str]] = []
    release = {"commit": threading.Event(), "fold0": threading.Event()}
    lock = threading.Lock()

    def run_work(work: Work, scratch: object = None) -> Result:
        kind = "commit" if isinstance(work, CommitPart) else f"fold{work.part}"
        with lock:
            events.append(("start", kind))
        if kind in release:
            assert release[kind].wait(10)
        with lock:
            events.append(("end", kind))
        return Result(work)

    monkeypatch.setattr(dataplane, "run_work", run_work)
    results: queue.SimpleQueue[Result] = queue.SimpleQueue()
    plane = dataplane.DataPlane(2, results.put)
    yield plane, events, release, results
    for ev in release.values():
        ev.set()
    plane.close()


def _names(results: queue.SimpleQueue, n: int) -> list[str]:
    """The next ``n`` results, as work kind and part, in the order they came."""
    done = [results.get(timeout=5) for _ in range(n)]
    return [f"{type(r.work).__name__}{r.work.part}" for r in done]


def _started(events: list[tuple[str, str]], kind: str) -> None:
    """Wait (5 s at most) until ``kind`` started on its worker."""
    deadline = time.monotonic() + 5
    while ("start", kind) not in events:
        assert time.monotonic() < deadline, f"{kind} never started"
        time.sleep(0.005)


def _commit_then_two_folds(plane: dataplane.DataPlane, events: list[tuple[str, str]]) -> None:
    """Submit a (held) commit, then a (held) fold of part 0 once the commit runs, then a fold of part 1
    once fold 0 runs beside the commit (the backlog must keep draining)."""
    plane.submit(_commit(0))
    _started(events, "commit")
    plane.submit(_fold(0))
    _started(events, "fold0")
    plane.submit(_fold(1))


def test_while_a_commit_is_queued_folds_run_one_at_a_time(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    plane, events, release, results = recorded
    monkeypatch.setattr(dataplane, "FOLD_YIELD_S", 30.0)
    _commit_then_two_folds(plane, events)  # fold 1's worker is free, yet fold 1 waits for fold 0
    time.sleep(0.2)  # time enough for a worker that does not wait to start fold 1
    release["fold0"].set()
    assert sorted(_names(results, 2)) == ["FoldPart0", "FoldPart1"]
    assert events.index(("end", "fold0")) < events.index(("start", "fold1"))
    release["commit"].set()
    assert _names(results, 1) == ["CommitPart0"]
    assert plane.backlog_bytes == 0


def test_the_last_commit_part_lets_waiting_folds_go(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    plane, events, release, results = recorded
    monkeypatch.setattr(dataplane, "FOLD_YIELD_S", 30.0)
    _commit_then_two_folds(plane, events)
    release["commit"].set()  # fold 0 still runs, but no commit is queued any more
    assert _names(results, 2) == ["CommitPart0", "FoldPart1"]


def test_folds_run_side_by_side_without_commits(recorded) -> None:
    plane, events, release, results = recorded
    plane.submit(_fold(0))
    plane.submit(_fold(1))
    assert _names(results, 1) == ["FoldPart1"]  # beside the held fold 0
    release["fold0"].set()
    assert _names(results, 1) == ["FoldPart0"]


def test_a_fold_waits_at_most_the_yield_bound(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    plane, events, release, results = recorded
    monkeypatch.setattr(dataplane, "FOLD_YIELD_S", 0.2)
    _commit_then_two_folds(plane, events)
    assert _names(results, 1) == ["FoldPart1"]  # a stuck fold never starves the others
    release["fold0"].set()
    release["commit"].set()
    assert sorted(_names(results, 2)) == ["CommitPart0", "FoldPart0"]


def test_init_parts_go_to_idle_workers_not_behind_their_lane(recorded) -> None:
    """INIT parts 2 and 4 share worker 0's lane, where a fold of part 0 is stuck: each runs at once
    on worker 1, the idler one."""
    plane, events, release, results = recorded
    plane.submit(_fold(0))
    _started(events, "fold0")
    for part in (2, 4):
        plane.submit(_init(part))
        assert _names(results, 1) == [f"InitPart{part}"]  # the fold still holds worker 0
    assert ("end", "fold0") not in events
    release["fold0"].set()
    assert _names(results, 1) == ["FoldPart0"]
    assert plane.backlog_bytes == 0


def test_init_parts_run_on_idle_commit_workers_too(recorded) -> None:
    """With both data workers held by folds, INIT parts still run at once: on the commit workers,
    idle while fragments are still being initialised."""
    plane, events, release, results = recorded
    release["fold1"] = threading.Event()
    plane.submit(_fold(0))
    plane.submit(_fold(1))
    _started(events, "fold0")
    _started(events, "fold1")
    for parts in ((2, 3), (4,)):  # (the recorder holds work by kind and part: parts 0 and 1 are the folds')
        for part in parts:
            plane.submit(_init(part))
        assert sorted(_names(results, len(parts))) == [f"InitPart{k}" for k in parts]
    assert ("end", "fold0") not in events and ("end", "fold1") not in events
    release["fold0"].set()
    release["fold1"].set()
    assert sorted(_names(results, 2)) == ["FoldPart0", "FoldPart1"]
    assert plane.backlog_bytes == 0

"""The data plane's scheduling: a fold waits while commit parts are queued (commits first).

The kernels are replaced by a recorder here: what is under test is which worker runs what,
and when, not the arithmetic (``test_outer.py`` checks that against numpy).
"""

from __future__ import annotations

import queue
import threading
import types

import pytest
import torch

from diloco.syncer import dataplane
from diloco.syncer.core.work import CommitPart, FoldPart, Result, RoundSum, Work

pytestmark = pytest.mark.timeout(30)


def _fold(part: int) -> FoldPart:
    s = RoundSum(round=2, attempt=0, fragment=1, flat=torch.zeros(4), n_parts=1)
    return FoldPart(sum=s, part=part, lo=0, opened=types.SimpleNamespace(nbytes=16), weight=1, island=0)  # type: ignore[arg-type]


def _commit(part: int) -> CommitPart:
    s = RoundSum(round=1, attempt=0, fragment=0, flat=torch.zeros(4), n_parts=1)
    return CommitPart(round=1, fragment=0, part=part, lo=0, hi=4, value=torch.zeros(4), momentum=None,
                      new_momentum=None, sum=s, total_weight=1, hyper=None, layout=None, part_elems=4,  # type: ignore[arg-type]
                      encode_dtypes=(), version=1)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    """A data plane whose work items record when they start and end; a commit runs until released."""
    events: list[tuple[str, str]] = []
    release = threading.Event()
    lock = threading.Lock()

    def run_work(work: Work, scratch: object = None) -> Result:
        kind = "commit" if isinstance(work, CommitPart) else "fold"
        with lock:
            events.append(("start", kind))
        if kind == "commit":
            assert release.wait(10)
        with lock:
            events.append(("end", kind))
        return Result(work)

    monkeypatch.setattr(dataplane, "run_work", run_work)
    results: queue.SimpleQueue[Result] = queue.SimpleQueue()
    plane = dataplane.DataPlane(1, results.put)
    yield plane, events, release, results
    release.set()
    plane.close()


def test_a_fold_waits_for_the_queued_commit_parts(recorded) -> None:
    plane, events, release, results = recorded
    plane.submit(_commit(0))
    plane.submit(_fold(0))
    with pytest.raises(queue.Empty):
        results.get(timeout=0.3)
    assert events == [("start", "commit")]  # the fold worker is free, yet holds its fold back
    release.set()
    done = [results.get(timeout=5), results.get(timeout=5)]
    assert [type(r.work).__name__ for r in done] == ["CommitPart", "FoldPart"]
    assert events == [("start", "commit"), ("end", "commit"), ("start", "fold"), ("end", "fold")]
    assert plane.backlog_bytes == 0


def test_a_fold_runs_at_once_without_commits(recorded) -> None:
    plane, events, _release, results = recorded
    plane.submit(_fold(0))
    assert type(results.get(timeout=5).work).__name__ == "FoldPart"
    assert events == [("start", "fold"), ("end", "fold")]


def test_a_fold_waits_at_most_the_yield_bound(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    plane, events, release, results = recorded
    monkeypatch.setattr(dataplane, "FOLD_YIELD_S", 0.2)
    plane.submit(_commit(0))
    plane.submit(_fold(0))
    assert type(results.get(timeout=5).work).__name__ == "FoldPart"  # a stuck commit never starves folds
    assert events[:3] == [("start", "commit"), ("start", "fold"), ("end", "fold")]
    release.set()
    assert type(results.get(timeout=5).work).__name__ == "CommitPart"

"""A consuming commit lends its old value's buffer to the next round's sum (``work.PageLoan``): the
pages it passes stay for that sum instead of being released and zeroed anew, a fold of a part waits
until the commit passed it, and a loan nobody took releases every page as consumption always did."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from diloco.outer import OuterHyper
from diloco.syncer.core.work import CommitPart, FoldPart, PageLoan, RoundSum
from diloco.syncer.dataplane import run_work
from diloco.wire.parts import FragmentLayout

from state_driver import opened, push_parts

pytestmark = pytest.mark.timeout(30)

E = 4096  # elements per part


def _releases() -> tuple[list[tuple[int, int]], object]:
    seen: list[tuple[int, int]] = []
    return seen, lambda buf, lo, hi: seen.append((lo, hi))


def test_a_loan_is_lent_only_once_offered_and_never_twice_or_too_small() -> None:
    loan = PageLoan(torch.zeros(3 * E), E)
    assert loan.n_parts == 3
    assert loan.take(E) is None  # the loop has not decided the commit consumes
    loan.offer()
    assert loan.take(4 * E) is None  # a larger fragment's sum does not fit
    assert loan.take(2 * E + 5) is None  # nor one more than 1/64 smaller (the reuse slack bounds the budget)
    flat = loan.take(3 * E - 100)
    assert flat is not None and flat.numel() == 3 * E - 100 and flat.data_ptr() == loan.buffer.data_ptr()
    assert loan.take(E) is None  # taken


def test_an_untaken_loan_releases_each_part_and_a_taken_one_keeps_the_rest() -> None:
    seen, release = _releases()
    loan = PageLoan(torch.zeros(3 * E), E)
    loan.offer()
    loan.pass_part(0, 0, E, release)  # nobody took it yet: released as consumption always did
    assert seen == [(0, E)] and not loan.all_passed
    assert loan.take(3 * E) is not None
    loan.pass_part(1, E, 2 * E, release)
    loan.pass_part(2, 2 * E, 3 * E, release)
    assert seen == [(0, E)] and loan.all_passed  # the taker's parts keep their pages
    assert loan.wait_passed(0, 0.0) and loan.wait_passed(2, 0.0) and loan.wait_passed(7, 0.0)


def test_a_keep_loan_releases_nothing_and_is_the_spare_only_whole_offered_and_untaken() -> None:
    seen, release = _releases()
    loan = PageLoan(torch.zeros(2 * E), E, keep=True)
    loan.pass_part(0, 0, E, release)
    assert seen == [] and loan.spare is None  # part 1 is not passed yet
    loan.pass_part(1, E, 2 * E, release)
    assert seen == [] and loan.spare is None  # never offered: the loop kept the old value for a reader
    loan.offer()
    assert loan.spare is loan.buffer
    assert loan.take(2 * E) is not None and loan.spare is None  # a taken loan is the taker's sum


def test_a_fold_into_a_lent_sum_waits_for_the_commit_and_equals_a_fold_into_fresh_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real consuming commit of fragment A (two parts) and a fold of fragment B's round into A's
    old value: the fold of part 1 waits until the commit passed part 1, both results are exact, and
    the lent pages were never released."""
    n = 2 * E
    gen = torch.Generator().manual_seed(11)
    value, total = torch.randn(n, generator=gen), 7
    sum_a = RoundSum(round=3, attempt=0, fragment=0, flat=torch.randn(n, generator=gen) * total, n_parts=2)
    sum_a.started = [True, True]
    layout = FragmentLayout.of([("w", (n,))])
    hyper = OuterHyper(lr=0.5, momentum=0.0)
    ref = RoundSum(round=3, attempt=0, fragment=0, flat=sum_a.flat.clone(), n_parts=2)
    ref.started = [True, True]
    for k in range(2):  # the same commit without a loan, into memory of its own
        assert run_work(CommitPart(3, 0, k, value.clone(), None, None, ref, total, hyper, layout, E, (), 2,
                                   check=False)).error is None
    seen, release = _releases()
    old = value.clone()
    loan = PageLoan(old, E)
    loan.offer()
    flat = loan.take(n)
    assert flat is not None
    sum_b = RoundSum(round=4, attempt=0, fragment=1, flat=flat, n_parts=2, loan=loan)
    delta = torch.randn(n, generator=gen)
    (h0, t0), (h1, t1) = push_parts(1, 4, 0, 2, [("w", delta)], E)
    folds = [FoldPart(sum_b, 0, 0, opened(h0, t0), 3, 0), FoldPart(sum_b, 1, E, opened(h1, t1), 3, 0)]
    done = threading.Event()
    errors: list[str | None] = []

    def fold_both() -> None:
        for f in folds:
            errors.append(run_work(f).error)
        done.set()

    def commit(k: int) -> None:
        res = run_work(CommitPart(3, 0, k, old, None, None, sum_a, total, hyper, layout, E, (), 2, check=False,
                                  consume=True, loan=loan))
        assert res.error is None
        loan_part_passed = loan.wait_passed(k, 0.0)
        assert loan_part_passed

    import diloco.syncer.dataplane as dp
    monkeypatch.setattr(dp, "release_pages", release)
    worker = threading.Thread(target=fold_both, daemon=True)
    worker.start()
    assert not done.wait(0.3)  # part 0 is not passed: its first fold waits
    commit(0)
    assert not done.wait(0.3) and errors == [None]  # part 0 folded; part 1 still waits
    commit(1)
    assert done.wait(10) and errors == [None, None]
    worker.join(10)
    assert seen == []  # the loan was taken before the commit passed anything: no page released
    assert torch.equal(sum_a.flat, ref.flat)  # the commit wrote A's new value where A's sum was, as without a loan
    want_sum = (np.float32(3) * delta.numpy()).astype(np.float32)
    assert np.array_equal(sum_b.flat.numpy().view(np.uint32), want_sum.view(np.uint32))

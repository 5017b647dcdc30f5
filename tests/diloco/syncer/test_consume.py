"""A commit gives the old value's pages back as it passes them, only when nothing else reads it
(``consume.py``, ``CommitPart.consume``, ``hostmem.sole_owner`` / ``release_pages``).

Through the pure state with the loop's own check (``state_driver``: ``Consumption``), real wire
messages and the real data-plane kernels: the commit stays bitwise the numpy reference, a reader
holding a view keeps the old value whole, and a cut or resend of the fragment waits for the commit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from diloco.hostmem import release_pages, sole_owner
from diloco.syncer.dataplane import run_work
from diloco.syncer.core.records import OutStream
from diloco.syncer.encoded import EncodedCache
from diloco.syncer.payloads import lease, payload_source

import test_parts_state as one  # one fragment of 7 parts, momentum 0.9, three islands, quorum 2
import test_state as two  # two fragments (3 parts and 1), three islands

pytestmark = pytest.mark.timeout(60)


def _commit_round_1(d, v0: np.ndarray, m0: np.ndarray) -> None:
    one.open_round(d, 1)
    out = []
    for i in range(3):
        out += d.send_all(one.peer(i), one.pushes(i, 1), now=1.0)
    assert d.st.versions() == (1,)
    event = [e for e in d.st.take_events() if e.get("round") == 1][-1]
    d.last_event = event
    one.check_commit(d, v0, m0, {i: one.delta(i, 1) for i in range(3)}, event)


def event_consumed(d) -> bool:
    """What the commit's event says (the event log's ``consumed``)."""
    return bool(d.last_event["consumed"])


def test_sole_owner_sees_views_and_arrays() -> None:
    t = torch.from_numpy(np.ones(1 << 16, dtype=np.float32))
    assert sole_owner(t) is True
    v = lease(t)
    assert sole_owner(t) is False
    del v
    a = t.numpy()
    assert sole_owner(t) is False  # an array over it reads it too
    del a
    assert sole_owner(t) is True


def test_release_pages_frees_whole_pages_inside_the_range_only() -> None:
    n = 1 << 20  # 4 MiB: its own mapping
    t = torch.from_numpy(np.ones(n, dtype=np.float32))
    lo, hi = 1000, n - 1000  # neither end on a page boundary
    released = release_pages(t, lo, hi)
    page = 4096
    assert released > 0 and released % page == 0
    assert released <= (hi - lo) * 4 and released >= (hi - lo) * 4 - 2 * page
    flat = t.numpy()
    assert (flat[:lo] == 1).all() and (flat[hi:] == 1).all()  # outside: untouched
    zeros = int((flat[lo:hi] == 0).sum())
    assert zeros * 4 == released  # inside: exactly the whole pages, now zero-filled
    assert release_pages(t, 10, 20) == 0  # no whole page inside


def test_a_commit_nobody_else_reads_keeps_its_old_value_as_the_spare_for_the_next_sum() -> None:
    """No other round holds a sum when round 1 commits: the consumed old value keeps every page (the
    book's spare, counted as free by the budget), round 2's sum lies in it, and both commits are
    bitwise the numpy reference."""
    d = one.started()
    old = d.st.fragments[0].value  # the same tensor object (no view: the check cannot see it)
    v0, m0 = one.frag_state(d)
    _commit_round_1(d, v0, m0)  # bitwise the numpy reference
    assert d.consumption.consumed == 1 and d.consumption.kept == 0 and event_consumed(d)
    book = d.st.book
    assert book.spare is not None and book.spare.data_ptr() == old.data_ptr() and book.spare_bytes == one.NUMEL * 4
    assert np.array_equal(old.numpy().view(np.uint32), v0.view(np.uint32))  # no page was given back
    assert not d.st.fragments[0].consuming and d.st.roundbook.fits(0)
    v1, m1 = one.frag_state(d)
    round1 = d.st.fragments[0].value
    one.open_round(d, 2)
    for i in range(3):
        d.send_all(one.peer(i), one.pushes(i, 2, base=1), now=2.0)
    assert d.st.versions() == (2,) and d.st.fragments[0].value.data_ptr() == old.data_ptr()
    event = [e for e in d.st.take_events() if e.get("round") == 2][-1]
    assert event["sum_spare"] and not event["sum_lent"] and event["consumed"]
    one.check_commit(d, v1, m1, {i: one.delta(i, 2) for i in range(3)}, event)
    assert book.spare is not None and book.spare.data_ptr() == round1.data_ptr() and book.spares_taken == 1


def test_a_commit_while_another_round_holds_a_sum_keeps_no_spare() -> None:
    """Two fragments: round 2 (fragment 1) has its sum when round 1 (fragment 0) commits, so the old
    value of fragment 0 goes page by page; values + two sums, never a third buffer."""
    d = two.started(dataclasses.replace(two.CFG, checkpoint_every=0))
    old = d.st.fragments[0].value
    v0, m0 = two.value(d, 0), two.momentum(d, 0)
    for i in range(2):
        d.send(two.peer(i), two.hb(i, 4), now=1.0)  # rounds 1 and 2 open
    assert {1, 2} <= set(d.st.rounds)
    d.send_all(two.peer(0), two.pushes(0, 2, 1), now=1.0)  # round 2's sum exists
    assert d.st.rounds[2].sum is not None
    for i in range(3):
        d.send_all(two.peer(i), two.pushes(i, 1, 0), now=1.0)
    event = [e for e in d.st.take_events() if e.get("round") == 1][-1]
    two.check_commit(d, 0, v0, m0, {i: two.delta(0, i * 100 + 1) for i in range(3)}, event)
    assert event["consumed"] and d.st.book.spare is None
    assert int((old.numpy() == 0).sum()) > 0  # whole pages inside its parts went back


def test_a_reader_with_a_view_keeps_the_old_value_whole() -> None:
    d = one.started()
    held = lease(d.st.fragments[0].value)  # a BCAST stream of version 0 still sending
    before = held.clone()
    v0, m0 = one.frag_state(d)
    _commit_round_1(d, v0, m0)
    assert d.consumption.consumed == 0 and d.consumption.kept == 1 and not event_consumed(d)
    assert torch.equal(held, before)


def test_an_unproven_or_pinned_commit_never_consumes() -> None:
    d = one.started()
    d.st.book.pin_all()  # a checkpoint in flight reads every fragment
    old = d.st.fragments[0].value
    before = old.clone()
    v0, m0 = one.frag_state(d)
    _commit_round_1(d, v0, m0)
    assert torch.equal(old, before) and d.consumption.consumed == 0
    d.st.book.unpin_all()
    # A sum whose magnitude is unknown (inf) cannot prove the step finite: the commit is checked,
    # may fail, and so keeps the old value whole.
    d2 = one.started()
    old2 = d2.st.fragments[0].value
    before2 = old2.clone()
    one.open_round(d2, 1)
    for i in range(3):
        for header, t in one.pushes(i, 1):
            d2.send(one.peer(i), header, t, now=1.0, run=False)
    results = [run_work(w) for w in d2.st.take_work()]  # every fold, none handed back yet
    d2.st.rounds[1].sum.absmax = [float("inf")] * one.N_PARTS
    for res in results:
        d2.st.on_result(res, 1.0)  # the last one starts the commit
    d2.run(1.0)
    assert d2.st.versions() == (1,)
    assert torch.equal(old2, before2) and d2.consumption.consumed == 0


def test_cuts_and_resends_of_a_consuming_fragment_wait_for_its_commit() -> None:
    d = one.started()
    frag = d.st.fragments[0]
    isl = d.st.islands[2]
    isl.cut_sent = False
    isl.cut_given.discard(0)  # island 2 is owed fragment 0 of its cut
    frag.committing = frag.consuming = True
    out: list = []
    d.st.cuts.deliver(out)
    assert not [o for o in out if isinstance(o, OutStream)]  # waits for the commit
    frag.committing = frag.consuming = False
    d.st.cuts.deliver(out)
    assert [o for o in out if isinstance(o, OutStream) and o.cut and o.fragment == 0]


def test_no_stream_starts_of_a_version_being_consumed() -> None:
    d = one.started()
    frag = d.st.fragments[0]
    o = OutStream(one.peer(1), "BCAST", 0, frag.version, 0, True, "float32")
    submitted: list = []
    cache = EncodedCache()
    assert payload_source(o, frag, d.E, 0, cache, submitted.append, {(0, frag.version)}) is None
    assert not submitted
    assert payload_source(o, frag, d.E, 0, cache, submitted.append, set()) is not None
    assert submitted and all(w.value is not frag.value for w in submitted)  # each job holds a view
    assert sole_owner(frag.value) is False


def test_cached_payloads_nobody_streams_are_dropped_and_a_streamed_list_keeps_the_value_whole() -> None:
    d = one.started()
    frag = d.st.fragments[0]
    key = (0, frag.version, "float32")
    d.consumption.cache.entries[key] = [lease(frag.value)]  # payload views in the cache only
    v0, m0 = one.frag_state(d)
    _commit_round_1(d, v0, m0)
    assert d.consumption.consumed == 1 and key not in d.consumption.cache.entries

    d = one.started()
    frag = d.st.fragments[0]
    key = (0, frag.version, "float32")
    streamed = d.consumption.cache.entries[key] = [lease(frag.value)]  # a stream holds this list
    before = frag.value.clone()
    old = frag.value
    v0, m0 = one.frag_state(d)
    _commit_round_1(d, v0, m0)
    assert d.consumption.kept == 1 and torch.equal(old, before)
    assert streamed is not None


def test_a_consuming_commit_lends_its_old_value_to_the_next_sum_and_stays_bitwise() -> None:
    """Round 1's commit is held until the loop's check passed (``Consumption``), then a new sum asked
    for meanwhile (``Merge.sum_buffer``, as a next round's first part does) lies in the old value's
    buffer; the commit then passes its parts to that sum instead of releasing them, and stays bitwise
    the numpy reference. Asked for before the check, or once the commit landed, a sum is fresh memory."""
    d = one.started()
    old = d.st.fragments[0].value
    v0, m0 = one.frag_state(d)
    one.open_round(d, 1)
    msgs = [m for i in range(3) for m in one.pushes(i, 1)]
    for i, m in zip([i for i in range(3) for _ in one.pushes(i, 1)], msgs):
        d.send(one.peer(i), *m, now=1.0, run=False)
        while (w := d.st.take_work()):  # folds run; the commit is held back for the loop's check
            queued: list = []
            d.consumption.route(w, queued.append)
            for item in queued:
                d.st.on_result(run_work(item), 1.0)
    assert d.consumption.held, "the commit is marked consume and waits for the loop's check"
    flat, loan, _spare = d.st.merge.sum_buffer(one.NUMEL)
    assert loan is None  # not offered before the check
    del flat
    released: list = []
    d.consumption.release(released.append)
    assert d.consumption.consumed == 1 and all(w.consume and w.loan is not None for w in released)
    flat, loan, _spare = d.st.merge.sum_buffer(one.NUMEL)
    assert loan is not None and flat.data_ptr() == old.data_ptr()
    before = old.clone()
    for item in released:
        d.st.on_result(run_work(item), 1.0)
    assert d.st.versions() == (1,)
    event = [e for e in d.st.take_events() if e.get("round") == 1][-1]
    one.check_commit(d, v0, m0, {i: one.delta(i, 1) for i in range(3)}, event)
    assert event["consumed"] and loan.all_passed
    assert torch.equal(old, before)  # no page of the lent buffer was given back (they would read as zeros)
    fresh, none, spare = d.st.merge.sum_buffer(one.NUMEL)
    assert none is None and not spare and fresh.data_ptr() != old.data_ptr()

"""The syncer's memory budget, through the pure state: fragment buffers are counted while anything
holds them, a round opens only when its sum fits, and a checkpoint lets go of each fragment once
it is on disk (docs/ARCHITECTURE.md, "Memory"; ``book.FragmentBook``, ``rounds._sum_fits``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.syncer.core import roundbook as round_rules
from diloco.syncer.core.coordinator import Coordinator
from diloco.syncer.payloads import lease
from diloco.syncer.store import CheckpointStore

import test_parts_state as one  # one fragment, momentum 0.9, three islands, quorum 2
import test_state as two  # two fragments, three islands

pytestmark = pytest.mark.timeout(60)


def _round_ready(d, rnd: int, now: float) -> None:
    for i in range(d.st.config.islands):
        d.send(one.peer(i), one.hb(i, 2 * rnd), now=now)


def test_a_round_waits_while_a_superseded_value_is_held(monkeypatch) -> None:
    monkeypatch.setattr(round_rules, "OVER_BUDGET_WAIT_S", 5.0)
    d = one.started(dataclasses.replace(one.CFG, max_open_rounds=1, max_gathering_rounds=1, outer_momentum=0.0))
    frag_bytes = d.st.fragments[0].layout.numel * 4
    assert d.st.book.live_bytes == frag_bytes  # the value
    one.open_round(d, 1)
    held = lease(d.st.fragments[0].value)  # as a BCAST stream of version 0 would (its own view)
    held_bytes = held.clone()
    for i in range(3):
        d.send_all(one.peer(i), one.pushes(i, 1), now=1.0)
    assert d.st.versions() == (1,) and d.st.fragments[0].value is not held
    # No torn value: a published value is never written again, so a reader of version 0 (a stream
    # part not yet sent, a checkpoint) reads exactly version 0 while version 1 is made.
    assert torch.equal(held, held_bytes)
    # value 1 + the held value 0 fill the budget (value + one sum): round 2 waits for the held one.
    assert d.st.book.live_bytes == 2 * frag_bytes == d.st.book.limit_bytes()
    _round_ready(d, 2, now=2.0)
    assert 2 not in d.st.rounds
    del held  # the stream finished: its buffer is freed, and the round opens at once
    assert d.st.book.live_bytes == frag_bytes
    d.tick(2.1)
    assert 2 in d.st.rounds
    for i in range(3):
        d.send_all(one.peer(i), one.pushes(i, 2, base=1), now=2.2)
    assert d.st.versions() == (2,)
    # A superseded buffer held for good (a stalled reader) delays the next round at most OVER_BUDGET_WAIT_S.
    stuck = lease(d.st.fragments[0].value)  # a reader holds a view: the commit keeps version 2 whole
    _round_ready(d, 3, now=3.0)
    for i in range(3):
        d.send_all(one.peer(i), one.pushes(i, 3, base=2), now=3.0)
    assert d.st.versions() == (3,)
    _round_ready(d, 4, now=4.0)
    assert 4 not in d.st.rounds
    d.tick(8.0)
    assert 4 not in d.st.rounds
    _round_ready(d, 4, now=9.5)
    assert 4 in d.st.rounds and stuck is not None


def test_the_checkpoint_writer_lets_go_of_each_fragment_once_written(tmp_path) -> None:
    d = two.started()
    snap = d.st.snapshot()
    values = [f.value.clone() for f in snap.fragments]
    frags = list(snap.fragments)
    head = dataclasses.replace(snap, fragments=())
    del snap
    seen: list[int] = []

    def on_written(idx: int) -> None:
        assert frags[idx] is None and all(f is not None for f in frags[idx + 1:])
        seen.append(idx)
        d.st.unpin({idx})

    path = CheckpointStore(tmp_path).save(head, frags, on_written)
    assert seen == [0, 1] and d.st.book.pinned == set()
    loaded = CheckpointStore(tmp_path).load(path)
    assert all(torch.equal(f.value, v) for f, v in zip(loaded.fragments, values))
    assert [f.version for f in loaded.fragments] == list(d.st.versions())


def test_buffers_are_counted_until_the_last_view_dies() -> None:
    d = one.started()
    book = d.st.book
    before = book.live_bytes
    t = book.fresh(1 << 16)
    view = t[100:200]  # a payload view of a value outlives the state's reference
    assert book.live_bytes == before + (1 << 18)
    del t
    assert book.live_bytes == before + (1 << 18)
    del view
    assert book.live_bytes == before


def test_a_resumed_state_knows_its_magnitudes_so_its_first_commit_updates_momentum_in_place(tmp_path) -> None:
    d = one.started()
    one.open_round(d, 1)
    for i in range(3):
        d.send_all(one.peer(i), one.pushes(i, 1), now=1.0)
    assert d.st.versions() == (1,) and d.st.fragments[0].momentum is not None
    store = CheckpointStore(tmp_path)
    snap = store.load(store.save(d.st.snapshot()))
    st = Coordinator(d.st.config, snapshot=snap)
    f = st.fragments[0]
    E = st.book.part_elems
    for k in range(f.layout.n_parts(E)):
        lo, hi = f.layout.part_range(k, E)
        assert f.value_absmax[k] == float(f.value[lo:hi].abs().max())
        assert f.momentum_absmax[k] == float(f.momentum[lo:hi].abs().max())
    assert st.book.live_bytes == 2 * f.layout.numel * 4  # value and momentum, counted

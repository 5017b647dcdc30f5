"""Checkpoint writes that hold superseded values briefly: the fragment the next commit supersedes is
written first, and zero momenta are holes in the file, not written bytes (``store.py``,
``checkpoint.write_order``)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from diloco.syncer.core.book import zeros
from diloco.syncer.core.records import FragmentSnapshot, Snapshot
from diloco.syncer.store import CheckpointStore

from state_driver import bitwise  # noqa: E402
from test_state import open_round1, peer, pushes, started  # noqa: E402

pytestmark = pytest.mark.timeout(60)

N = 1 << 20  # elements per fragment: 4 MiB, large enough that a hole is visible in st_blocks


def _snap(order: tuple[int, ...]) -> Snapshot:
    frags = tuple(
        FragmentSnapshot(version=i, schema=((f"w{i}", "float32", (N,)),), value=torch.full((N,), float(i + 1)),
                         momentum=zeros(N) if i != 1 else torch.full((N,), -1.0), momentum_is_zero=i != 1)
        for i in range(3))
    return Snapshot(fingerprint="fp", n_fragments=3, fragments=frags, next_round=4,
                    ledgers={0: {"merges": 1, "steps": 2, "tokens": 3}}, hyper={}, order=order)


def test_fragments_are_written_in_the_snapshots_order_and_load_in_place(tmp_path) -> None:
    snap = _snap((2, 0, 1))
    written: list[int] = []
    path = CheckpointStore(tmp_path).save(replace(snap, fragments=()), list(snap.fragments), written.append)
    assert written == [2, 0, 1]
    back = CheckpointStore(tmp_path).load(path)
    for want, got in zip(snap.fragments, back.fragments):
        assert got.version == want.version and bitwise(got.value, want.value) and bitwise(got.momentum, want.momentum)


def test_zero_momenta_are_holes_that_read_back_as_zeros(tmp_path) -> None:
    path = CheckpointStore(tmp_path).save(_snap(()))
    st = os.stat(path / "momentum.safetensors")
    assert st.st_size == os.stat(path / "values.safetensors").st_size
    # Two of three momenta are zero: only one fragment's bytes (and the header) are on disk.
    assert st.st_blocks * 512 < 2 * N * 4, (st.st_blocks * 512, st.st_size)
    back = CheckpointStore(tmp_path).load(path)
    assert [float(f.momentum.abs().max()) for f in back.fragments] == [0.0, 1.0, 0.0]


def test_a_write_order_that_is_not_a_permutation_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        CheckpointStore(tmp_path).save(_snap((0, 0, 1)))


def test_the_fragment_of_the_open_round_is_written_first_then_the_round_clocks_order() -> None:
    d = started()
    assert d.st.snapshot().order == (0, 1)  # round 1 (fragment 0) opens next
    d.st.release_snapshot()
    open_round1(d)
    assert d.st.snapshot().order == (0, 1)  # round 1 is open: its fragment first
    d.st.release_snapshot()
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0), now=1.0)
    assert d.st.versions() == (1, 0)
    assert d.st.snapshot().order == (1, 0)  # round 2 (fragment 1) is the next to commit
    d.st.release_snapshot()

"""SnapshotSlots: the slot table, θ_push copies and the progress correction, on the host and (CUDA) on the device."""

from __future__ import annotations

import pytest
import torch

from diloco.island.slots import DEVICE_CHUNK_ELEMS, SnapshotSlots

pytestmark = pytest.mark.timeout(60)


def _masters(device: str, sizes: tuple[int, ...] = (1000, 300, 700, 50)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=g).to(device) for n in sizes]


def test_a_slot_holds_theta_push_until_installed_and_the_table_refuses_a_third_fragment() -> None:
    masters = _masters("cpu")
    slots = SnapshotSlots(masters, 2, pinned=False, on_device=True)  # host masters: on_device is ignored
    assert slots.device is None
    sizes = slots.allocate(4 * 1000)
    assert sizes == {"snapshot_slots": 2 * 4000, "pinned": 0, "device_snapshot_slots": 0}
    before = [m.clone() for m in masters]
    slots.take(0, [0], [1000])
    slots.take(1, [1, 2], [300, 700])
    with pytest.raises(ValueError, match="every slot is taken"):
        slots.take(2, [3], [50])
    for m in masters:
        m.add_(1.0)  # training moves on
    view0 = slots.view(0)
    assert view0 is not None and torch.equal(view0, before[0])
    assert slots.holders() == frozenset({0, 1}) and slots.free_count() == 0 and slots.free_for(1)
    glob = [torch.full_like(m, 0.5) for m in masters]
    slots.correct(1, [(1, 0, 300), (2, 100, 600)], lambda p: glob[p])
    v1, v2 = slots.view(1), slots.view(2)
    assert v1 is not None and v2 is not None
    assert torch.equal(v1, glob[1] - before[1])
    assert torch.equal(v2[100:], glob[2][100:] - before[2][100:]) and torch.equal(v2[:100], before[2][:100])
    slots.installed(1, [1, 2], None)
    assert slots.view(1) is None and slots.free_for(2) and not slots.holds(1)
    slots.take(2, [3], [50])
    with pytest.raises(ValueError, match="does not hold"):
        slots.correct(1, [(1, 0, 300)], lambda p: glob[p])
    slots.free()
    assert slots.holders() == frozenset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_slots_give_the_same_bits_as_pinned_host_slots() -> None:
    """The whole cycle a progress install makes of a slot (snapshot, train on, correction from a host
    global, master += correction), with device slots and with pinned host slots: equal bits."""
    n_big = DEVICE_CHUNK_ELEMS + 12345  # the device correction crosses a chunk boundary
    results = []
    for on_device in (True, False):
        masters = _masters("cuda", (n_big, 4096))
        slots = SnapshotSlots(masters, 1, pinned=True, on_device=on_device)
        assert (slots.device is not None) == on_device
        sizes = slots.allocate(4 * (n_big + 4096))  # one slot: the fragment's share of both pieces
        assert sizes["device_snapshot_slots" if on_device else "snapshot_slots"] == 4 * (n_big + 4096)
        slots.take(0, [0, 1], [n_big, 4096])
        for m in masters:
            m.mul_(1.001).add_(0.25)  # the optimizer steps on, on the compute stream
        torch.cuda.synchronize()
        glob = [torch.randn(m.numel(), generator=torch.Generator().manual_seed(7 + i)) for i, m in enumerate(masters)]
        slots.correct(0, [(0, 0, n_big), (1, 100, 3996)], lambda p: glob[p])
        for p, off, n in ((0, 0, n_big), (1, 100, 3996)):
            work = slots.view(p)
            assert work is not None
            masters[p][off : off + n].add_(work[off : off + n].to("cuda", non_blocking=True))
        slots.installed(0, [0, 1], torch.cuda.current_stream().record_event())
        torch.cuda.synchronize()
        results.append([m.cpu() for m in masters])
        slots.free()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_upload_is_refused_where_no_pinned_block_or_device_master_serves_it() -> None:
    """Host masters or an unpinned block: ``upload`` does nothing and says so (the caller copies)."""
    masters = _masters("cpu")
    src = torch.randn(1000)
    slots = SnapshotSlots(masters, 1, pinned=False, on_device=False)
    assert not slots.upload(masters[0], src)  # not allocated
    slots.allocate(4 * 1000)
    assert not slots.upload(masters[0], src)  # host master, unpinned block
    assert not torch.equal(masters[0], src)


def test_copy_in_parallel_is_the_one_copy_across_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco import hostmem
    monkeypatch.setattr(hostmem, "_FAULT_SLICE_ELEMS", 1000)
    src = torch.randn(4567)
    src[5] = -0.0
    dst = torch.empty_like(src)
    hostmem.copy_in_parallel(src, dst)
    assert torch.equal(dst.view(torch.int32), src.view(torch.int32))
    with pytest.raises(ValueError, match="differ"):
        hostmem.copy_in_parallel(src, dst[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_upload_through_the_free_pinned_block_lands_every_bit_and_never_while_a_slot_is_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A master several halves of the block long (and not a multiple of one) comes up bit for bit
    from a pageable host tensor; while a snapshot holds the block, upload refuses."""
    from diloco.island import slots as slots_mod
    monkeypatch.setattr(slots_mod, "UPLOAD_CHUNK_ELEMS", 1 << 16)
    n = 5 * (1 << 16) + 777
    masters = _masters("cuda", (n,))
    slots = SnapshotSlots(masters, 1, pinned=True, on_device=False)
    slots.allocate(4 * n)
    src = torch.randn(n)
    src[3] = -0.0
    assert slots.upload(masters[0], src)
    assert torch.equal(masters[0].cpu().view(torch.int32), src.view(torch.int32))
    slots.take(0, [0], [n])
    assert not slots.upload(masters[0], torch.zeros(n))
    slots.installed(0, [0], None)
    assert slots.upload(masters[0], torch.zeros(n)) and torch.count_nonzero(masters[0]).item() == 0

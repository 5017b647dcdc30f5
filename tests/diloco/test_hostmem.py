"""Host-side helpers for gigabyte-sized background work (``diloco.hostmem``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diloco import hostmem

from diloco.hostmem import _FAULT_SLICE_ELEMS, sub_in_parallel, zero_in_parallel

pytestmark = pytest.mark.timeout(60)


def test_sub_in_parallel_is_bitwise_one_torch_sub_also_in_place() -> None:
    n = 2 * _FAULT_SLICE_ELEMS + 12345  # three slices, the last one short
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    want = torch.sub(a, b)
    out = torch.empty(n)
    sub_in_parallel(a, b, out)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    sub_in_parallel(a, b, b)  # out aliasing an input, as the slot's correction does
    assert torch.equal(b.view(torch.int32), want.view(torch.int32))


def test_sub_in_parallel_refuses_tensors_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="differ"):
        sub_in_parallel(torch.zeros(4), torch.zeros(5), torch.zeros(4))


def test_zero_in_parallel_zeroes_every_slice() -> None:
    ts = [torch.full((_FAULT_SLICE_ELEMS + 7,), 3.0), torch.full((11,), -1.0)]
    zero_in_parallel(ts)
    assert all(int(t.count_nonzero()) == 0 for t in ts)


def test_advise_huge_covers_the_aligned_huge_pages_and_keeps_the_contents() -> None:
    """``advise_huge`` advises whole 2 MiB pages inside the buffer (none for one smaller than a huge
    page) and changes nothing in it; where the kernel offers THP at all, it advises something."""
    small = np.arange(1 << 17, dtype=np.float32)  # 512 KiB
    assert hostmem.advise_huge(small) == 0 and small[-1] == (1 << 17) - 1
    big = np.empty(7 << 20, dtype=np.uint8)
    advised = hostmem.advise_huge(big)
    assert advised % hostmem.HUGE_PAGE_BYTES == 0 and advised <= big.nbytes
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert advised >= 2 * hostmem.HUGE_PAGE_BYTES  # 7 MiB holds at least two aligned huge pages
    big[:] = 7
    assert int(big.min()) == int(big.max()) == 7

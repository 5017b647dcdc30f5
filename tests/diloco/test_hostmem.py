"""Host-side helpers for gigabyte-sized background work (``diloco.hostmem``)."""

from __future__ import annotations

import pytest
import torch

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

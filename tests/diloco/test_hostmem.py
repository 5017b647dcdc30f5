"""Host-side helpers for gigabyte-sized background work (``diloco.hostmem``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco.hostmem import _FAULT_SLICE_ELEMS, PAGE_BYTES, populate_pages, sub_in_parallel, zero_in_parallel

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


def _rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_populate_pages_maps_fresh_pages_and_keeps_what_was_written() -> None:
    n = 16 << 20  # 64 MiB of fp32, fresh (its own mapping)
    t = torch.from_numpy(np.empty(n, dtype=np.float32))
    t[: n // 8] = 2.5  # written before: must read the same afterwards
    before = _rss_bytes()
    got = populate_pages(t, 0, n)
    if got == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert n * 4 - 2 * PAGE_BYTES <= got <= n * 4  # whole pages inside the buffer only
    assert _rss_bytes() - before >= 0.8 * (n * 4 - n // 2)  # the unwritten 7/8 came in now
    assert bool((t[: n // 8] == 2.5).all())
    assert populate_pages(t, 5, 6) == 0  # no whole page inside: nothing

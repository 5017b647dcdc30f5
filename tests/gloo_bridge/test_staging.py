"""Host staging: buffer reuse, copy-in/copy-out, deferred copy-back on wait()."""

from __future__ import annotations

import pytest
import torch

from gloo_bridge.staging import BridgedWork, HostBufferCache, StagedCall

pytestmark = pytest.mark.timeout(30)


def test_cache_reuses_by_size_and_respects_cap() -> None:
    cache = HostBufferCache(pinned=False, max_cached_bytes=64)
    a = cache.acquire(32)
    cache.release(a)
    assert cache.cached_bytes == 32
    b = cache.acquire(32)
    assert b.data_ptr() == a.data_ptr() and cache.allocations == 1 and cache.cached_bytes == 0
    big = cache.acquire(100)
    cache.release(big)  # over the cap: dropped, not kept
    assert cache.cached_bytes == 0
    cache.release(b)
    cache.clear()
    assert cache.cached_bytes == 0


def test_two_calls_in_flight_never_share_a_buffer() -> None:
    cache = HostBufferCache(pinned=False)
    t1, t2 = torch.ones(4), torch.full((4,), 2.0)
    s1, s2 = StagedCall(cache, stage=True), StagedCall(cache, stage=True)
    h1, h2 = s1.host_inout(t1), s2.host_inout(t2)
    assert h1.data_ptr() != h2.data_ptr()
    h1.add_(10)
    h2.add_(20)
    s1.finish()
    s2.finish()
    assert torch.equal(t1, torch.full((4,), 11.0)) and torch.equal(t2, torch.full((4,), 22.0))
    assert cache.allocations == 2 and cache.cached_bytes == 32


def test_direct_mode_passes_dense_cpu_tensors_through() -> None:
    cache = HostBufferCache(pinned=False)
    sc = StagedCall(cache, stage=False)
    t = torch.zeros(3, dtype=torch.bfloat16)
    assert sc.host_inout(t) is t
    strided = torch.zeros(4, 2)[:, 0]
    h = sc.host_inout(strided)
    assert h is not strided and h.is_contiguous()
    h.fill_(5)
    scratch = sc.host_in(t, scratch=True)
    assert scratch is not t
    sc.finish()
    assert torch.equal(strided, torch.full((4,), 5.0))


def test_work_copies_back_on_wait_once() -> None:
    cache = HostBufferCache(pinned=False)
    sc = StagedCall(cache, stage=True)
    out = torch.zeros(2, 3)
    host = sc.host_out(out)
    host.fill_(7)
    sc.then(lambda: host.mul_(2))
    work = BridgedWork("all_reduce", None, sc, [out])
    assert not work.is_completed() and torch.equal(out, torch.zeros(2, 3))
    assert work.wait()
    assert work.is_completed() and torch.equal(out, torch.full((2, 3), 14.0))
    work.wait()  # a second wait must not apply the post-processing again
    assert torch.equal(work.result()[0], torch.full((2, 3), 14.0))
    with pytest.raises(RuntimeError, match="get_future.*all_reduce"):
        work.get_future()

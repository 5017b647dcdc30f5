"""INIT values allocated at island 0's HELLO and faulted in ahead of the stream (``Admission``,
``syncer/prefault.py``): which HELLO allocates them, that INIT fills exactly those buffers, that
nothing is allocated twice, and that the prefault threads fault pages in without writing them.

Real wire messages through the codec; data-plane work inline (``state_driver``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from diloco.syncer.core.work import InitPart, Prefault
from diloco.syncer.prefault import Prefaulter

from state_driver import Driver, flat, init_parts

import test_parts_state as one  # fragments of 27295 elements, 7 parts each

pytestmark = pytest.mark.timeout(60)

FRAGMENT_BYTES = one.NUMEL * 4


def hello0(d: Driver, gen: int | None = None) -> list:
    """Island 0's HELLO of two fragments; the work it queued (not run)."""
    d.send(one.peer(0), one.hello(0, gen=gen, n=2, numel=(one.NUMEL, one.NUMEL)), run=False)
    return d.st.take_work()


def test_island_0s_hello_allocates_each_init_value_once_and_queues_it_in_fragment_order() -> None:
    d = Driver(one.CFG)
    work = hello0(d)
    assert [(type(w), w.fragment, w.value.numel()) for w in work] == [(Prefault, 0, one.NUMEL), (Prefault, 1, one.NUMEL)]
    assert [d.st.fragments[f].init_buffer is work[f].value for f in (0, 1)] == [True, True]
    assert d.st.book.live_bytes == 2 * FRAGMENT_BYTES
    # A redial (new generation) and the other islands' HELLOs allocate nothing more.
    assert hello0(d, gen=11) == []
    d.send(one.peer(1), one.hello(1, n=2, numel=(one.NUMEL, one.NUMEL)), run=False)
    assert d.st.take_work() == []
    assert d.st.book.live_bytes == 2 * FRAGMENT_BYTES


def test_init_fills_the_buffers_allocated_at_hello_and_a_restarted_stream_gets_a_fresh_one() -> None:
    d = Driver(one.CFG)
    ready = [w.value for w in hello0(d)]
    t0, t1 = one.tensors(0), one.tensors(1)
    d.send_all(one.peer(0), init_parts(0, 2, t0, d.E, generation=one.GEN[0]))
    f0, f1 = d.st.fragments
    assert f0.initialised and f0.value is ready[0] and f0.init_buffer is None
    assert torch.equal(f0.value, flat(t0))
    assert d.st.book.live_bytes == 2 * FRAGMENT_BYTES  # nothing allocated beside them
    # Fragment 1: two parts, then the stream starts again at part 0 (a redialed island 0): the first
    # stream's copies may still be queued on its buffer, so the new stream writes a fresh one.
    parts = init_parts(1, 2, t1, d.E, generation=one.GEN[0])
    d.send_all(one.peer(0), parts[:2])
    assert f1.value is ready[1]
    d.send_all(one.peer(0), parts)
    assert f1.initialised and f1.value is not ready[1] and torch.equal(f1.value, flat(t1))
    assert d.st.initialised


def test_a_hello_after_init_or_for_an_initialised_fragment_allocates_nothing() -> None:
    d = Driver(one.CFG)
    hello0(d)
    d.send_all(one.peer(0), init_parts(0, 2, one.tensors(0), d.E, generation=one.GEN[0]))
    assert hello0(d, gen=12) == []  # fragment 0 holds its value, fragment 1 its buffer
    d.send_all(one.peer(0), init_parts(1, 2, one.tensors(1), d.E, generation=12))
    assert d.st.initialised
    assert hello0(d, gen=13) == []  # WELCOME asks for no INIT


def test_init_parts_copied_inline_after_the_prefault_hold_the_sent_bytes() -> None:
    """The inline data plane (tests, ``run_work``) faults the buffer in, then copies: same bytes."""
    d = Driver(one.CFG)
    d.send(one.peer(0), one.hello(0, n=2, numel=(one.NUMEL, one.NUMEL)))  # runs the Prefault items
    for f in (0, 1):
        d.send_all(one.peer(0), init_parts(f, 2, one.tensors(f), d.E, generation=one.GEN[0]))
        assert torch.equal(d.st.fragments[f].value, flat(one.tensors(f)))


def test_prefault_threads_fault_values_in_without_writing_them() -> None:
    n = 8 << 20  # 32 MiB each, fresh mappings
    values = [torch.from_numpy(np.empty(n, dtype=np.float32)) for _ in range(3)]
    for v in values:
        v[:1000] = 7.0  # an INIT copy that got there first
    pf = Prefaulter(threads=2)
    try:
        for f, v in enumerate(values):
            pf.submit(Prefault(f, v))
        deadline = time.monotonic() + 30
        while pf.faulted_bytes < 3 * (n * 4 - 2 * 4096) and time.monotonic() < deadline:
            time.sleep(0.01)
        if pf.faulted_bytes == 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert pf.faulted_bytes >= 3 * (n * 4 - 2 * 4096)
    finally:
        pf.close()
    assert all(bool((v[:1000] == 7.0).all()) for v in values)


def test_the_core_queues_no_init_copy_into_a_prefault_buffer_it_replaced() -> None:
    """Every InitPart of a restarted stream targets the new value, never the buffer it replaced."""
    d = Driver(one.CFG)
    ready = [w.value for w in hello0(d)]
    parts = init_parts(0, 2, one.tensors(0), d.E, generation=one.GEN[0])
    for header, t in parts[:3]:
        d.send(one.peer(0), header, t, run=False)
    first = [w for w in d.st.take_work() if isinstance(w, InitPart)]
    assert [w.value is ready[0] for w in first] == [True, True, True]
    d.send(one.peer(0), *parts[0], run=False)
    again = [w for w in d.st.take_work() if isinstance(w, InitPart)]
    assert len(again) == 1 and again[0].value is not ready[0] and again[0].value is d.st.fragments[0].value

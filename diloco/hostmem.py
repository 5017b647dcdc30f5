"""glibc heap thresholds (``mallopt``), set once per process at start: one mechanism, two profiles.

glibc moves its mmap and trim thresholds *dynamically*: after a process frees a large mapped
block, later blocks of that size come from the heap, and freed heap memory is kept (or the top of
the heap is trimmed and mapped again). Pinning the thresholds disables the dynamic moves. The two
kinds of process want opposite things:

* the **syncer** receives GB of parts through zmq, whose I/O thread mallocs every received
  frame (4 MiB) and reads the socket into it: with frames above the mmap threshold each one is
  mapped, faulted in page by page and unmapped again on that one thread, which capped a bare
  loopback ROUTER at 2.0 GB/s on the device host (5.3 GB/s from one sender and 7.9 from two
  with frames reused from the heap; ``scripts/probe_recv.py``, docs/PERFORMANCE.md). So blocks
  up to ``SYNCER_MMAP_BYTES`` (8 MiB: twice a frame) come from the heap and are reused, while
  part-sized and larger buffers are still mapped and given back when freed; the heap is trimmed
  once more than ``SYNCER_TRIM_BYTES`` (8 MiB) lies free at its top, and once per commit
  (``malloc_trim``, ``dataplane.py``), so freed frames stay resident only between commits
  (:func:`tune_syncer_malloc`). A mmap threshold of 64 MiB read the same speed but kept 0.28 x a
  512 MiB model more resident, and a trim threshold of 64 MiB kept 0.06-0.08 x (freed frames
  at the top of every thread's heap; ``bench_memory.py``);
* an **island** runs a training loop whose parameter-sized temporaries (AdamW's
  ``exp_avg_sq.sqrt()``, ``grad * lr``, ...) must stay on the heap and be reused, never freshly
  mapped each step: ``ISLAND_MMAP_BYTES`` = 32 MiB (glibc's maximum on 64-bit) and
  ``ISLAND_TRIM_BYTES`` = 1 GiB (:func:`tune_island_malloc`; ``YETO_DILOCO_TUNE_MALLOC=0``
  turns it off in the island's config). Measurements: docs/PERFORMANCE.md.

A user who set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` keeps their values.
Non-glibc systems: nothing happens (the functions return False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

SYNCER_MMAP_BYTES = 8 << 20
SYNCER_TRIM_BYTES = 8 << 20
ISLAND_MMAP_BYTES = 32 << 20
ISLAND_TRIM_BYTES = 1 << 30

_island_done = False


def set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Pin glibc's mmap and trim thresholds; True when both were set (or left to the user)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = True
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        ok &= mallopt(M_MMAP_THRESHOLD, mmap_bytes) == 1
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        ok &= mallopt(M_TRIM_THRESHOLD, trim_bytes) == 1
    if not ok:
        log.warning("mallopt refused the heap thresholds (%d, %d)", mmap_bytes, trim_bytes)
    return ok


def tune_syncer_malloc() -> bool:
    """The syncer's profile: received frames are reused from the heap, larger buffers are mapped (see
    the module docstring)."""
    return set_malloc_thresholds(SYNCER_MMAP_BYTES, SYNCER_TRIM_BYTES)


def tune_island_malloc() -> bool:
    """The island's profile, once per process: step temporaries stay on the heap; True when set."""
    global _island_done
    if not _island_done:
        _island_done = set_malloc_thresholds(ISLAND_MMAP_BYTES, ISLAND_TRIM_BYTES)
    return _island_done


def _libc(name: str, argtypes: list[Any], restype: Any = None) -> Any:
    """glibc's function ``name``, looked up once (find_library runs ldconfig, and the syncer calls
    these per commit); None off Linux/glibc or when it is missing."""
    if name not in _LIBC:
        fn = None
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
                fn.argtypes, fn.restype = argtypes, restype
            except (OSError, AttributeError):
                fn = None
        _LIBC[name] = fn
    return _LIBC[name]


_LIBC: dict[str, Any] = {}


def trim_heap() -> bool:
    """Give freed heap memory back to the kernel now (``malloc_trim(0)``); True when it ran.

    For the end of a process's big phase (an island after its final cut): the raised trim
    threshold otherwise keeps every freed byte resident."""
    fn = _libc("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
    if fn is None:
        return False
    fn(0)
    return True


MADV_DONTNEED = 4
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def sole_owner(t: torch.Tensor) -> bool | None:
    """Whether ``t`` is the only tensor over its storage: no view of it lives anywhere (a payload
    frame zmq still sends, a stream's part list, an encode or digest job holding a view), and no
    ``.numpy()`` array of it either (each holds a storage reference of its own). None when this
    torch cannot tell (then nothing may assume it)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = t.untyped_storage()  # one reference of its own while it lives
    return int(count(storage._cdata)) == 2


def release_pages(t: torch.Tensor, lo: int, hi: int) -> int:
    """Give the pages lying wholly inside elements ``[lo, hi)`` of the flat buffer ``t`` back to the
    kernel now (``madvise(MADV_DONTNEED)``); returns the bytes released (0 where it cannot).

    The caller promises that nothing reads those elements again: afterwards they read as zeros
    (anonymous memory) or as the file's bytes (a file mapping). Pages shared with elements outside
    the range are kept."""
    madvise = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
    if madvise is None:
        return 0
    size = t.element_size()
    start = t.data_ptr() + lo * size
    end = t.data_ptr() + hi * size
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    last = end // PAGE_BYTES * PAGE_BYTES
    if last <= first:
        return 0
    if madvise(first, last - first, MADV_DONTNEED) != 0:
        return 0
    return last - first


FAULT_IN_THREADS = 8
"""Most threads :func:`zero_in_parallel` uses (never more than the CPUs this process may run on)."""
_FAULT_SLICE_ELEMS = 16 << 20
"""Elements per slice handed to one thread (64 MiB of fp32)."""


def _run_sliced(jobs: Sequence[Callable[[], object]], name: str) -> None:
    """Run independent GIL-releasing slice jobs on up to :data:`FAULT_IN_THREADS` threads (never more
    than the CPUs this process may run on), inline when one thread would do."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    workers = max(1, min(FAULT_IN_THREADS, cpus, len(jobs)))
    if workers == 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        list(pool.map(lambda job: job(), jobs))


def sub_in_parallel(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a - b`` for flat host tensors of one length, by several threads over disjoint
    slices of :data:`_FAULT_SLICE_ELEMS` (torch releases the GIL in each), each element computed
    exactly as one ``torch.sub`` would. For gigabyte-sized background work (a snapshot slot's
    progress correction) in a process whose torch runs one intra-op thread (torchrun's default)."""
    n = out.numel()
    if a.numel() != n or b.numel() != n:
        raise ValueError(f"sub_in_parallel: lengths {a.numel()}, {b.numel()}, {n} differ")
    e = _FAULT_SLICE_ELEMS
    _run_sliced([functools.partial(torch.sub, a[lo:lo + e], b[lo:lo + e], out=out[lo:lo + e])
                 for lo in range(0, n, e)], "yeto-host-sub")


def copy_in_parallel(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` for flat host tensors of one length, by several threads over disjoint
    slices of :data:`_FAULT_SLICE_ELEMS` (bit for bit the one copy; torch releases the GIL in each).
    Inline for a tensor of one slice or less."""
    n = dst.numel()
    if src.numel() != n:
        raise ValueError(f"copy_in_parallel: lengths {src.numel()} and {n} differ")
    e = _FAULT_SLICE_ELEMS
    _run_sliced([functools.partial(dst[lo:lo + e].copy_, src[lo:lo + e]) for lo in range(0, n, e)],
                "yeto-host-copy")


def zero_in_parallel(tensors: Sequence[torch.Tensor]) -> None:
    """Zero freshly allocated host tensors with several threads, so their pages are faulted in
    (the kernel zeroes each page on first touch) in parallel rather than by one thread: a
    10 GiB anchor table costs about 5 s zeroed on one thread. Each thread fills disjoint slices
    (torch's fill releases the GIL); the tensors are zero and resident when this returns."""
    slices = [t.reshape(-1)[a : a + _FAULT_SLICE_ELEMS] for t in tensors
              for a in range(0, t.numel(), _FAULT_SLICE_ELEMS)]
    _run_sliced([s.zero_ for s in slices], "yeto-fault-in")

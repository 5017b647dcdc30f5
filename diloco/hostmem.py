"""glibc heap thresholds (``mallopt``), set once per process at start.

glibc moves its mmap and trim thresholds *dynamically*: after a process frees a large
mapped block, later blocks of that size come from the heap, and freed heap memory is kept.
For a syncer that receives tens of MiB of parts per second through zmq (whose frames
libzmq mallocs and frees), that turns transient receive buffers into resident memory that
is never given back, and the syncer's RSS drifts far above its state.  Pinning the
thresholds disables the dynamic moves: blocks above ``mmap_bytes`` are always mapped and
unmapped on free, and the heap is trimmed above ``trim_bytes``.

A user who set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` keeps their values.
Non-glibc systems: nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


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

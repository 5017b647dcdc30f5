"""Receive-buffer pool: reuse freed host buffers for decoded tensors.

Why: a fresh large allocation is backed by new pages, and touching them
(first-touch page faults) costs more than the copy that fills them — measured
~0.5-1 GB/s on our sandboxed CPU hosts, i.e. ~250+ ms per 256 MiB fragment,
against ~35 ms for the copy.  Fragments arrive with the same tensor sizes every
round (PUSH deltas at the syncer, BCAST values at the islands), so a buffer
freed after one round is exactly what the next round needs.

How: :meth:`HostBufferPool.empty` hands out a tensor that views a pooled numpy
byte array through a per-allocation *handle* (a numpy view).  The tensor's
storage holds the handle; when the last tensor (or view) of it dies, CPython
drops the handle at once and a ``weakref.finalize`` returns the base array to
the pool.  Nothing is ever returned while any tensor still references it, so
reuse is as safe as ordinary freeing.  Buffers are matched by exact byte size;
idle bytes are capped (``max_idle_bytes``), beyond which freed buffers really
are freed.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import defaultdict

import numpy as np
import torch

__all__ = ["HostBufferPool", "default_receive_pool"]


class HostBufferPool:
    """A size-keyed pool of host byte buffers backing decoded tensors.

    Use one per process (see :func:`default_receive_pool`) unless a component
    wants its own cap.  Thread-safe: tensors may die on any thread.

    Args:
        max_idle_bytes: most bytes kept idle for reuse (default 2 GiB); 0
            disables pooling (every tensor is a plain ``torch.empty``).
        min_bytes: tensors smaller than this (default 1 MiB) bypass the pool;
            the allocator serves small sizes from reused memory anyway.
    """

    def __init__(self, max_idle_bytes: int = 2 << 30, min_bytes: int = 1 << 20) -> None:
        if max_idle_bytes < 0 or min_bytes < 0:
            raise ValueError(f"HostBufferPool: sizes must be >= 0, got {max_idle_bytes=}, {min_bytes=}")
        self.max_idle_bytes = max_idle_bytes
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._idle: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._idle_bytes = 0
        self.hits = 0
        """Allocations served from an idle buffer (for tests and stats)."""
        self.misses = 0
        """Pooled-size allocations that needed fresh memory."""

    @property
    def idle_bytes(self) -> int:
        """Bytes currently held idle for reuse."""
        return self._idle_bytes

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor, from an idle buffer when one fits exactly."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if self.max_idle_bytes == 0 or nbytes < max(self.min_bytes, 1):
            return torch.empty(shape, dtype=dtype)
        base: np.ndarray | None = None
        with self._lock:
            stack = self._idle.get(nbytes)
            if stack:
                base = stack.pop()
                self._idle_bytes -= nbytes
                self.hits += 1
            else:
                self.misses += 1
        if base is None:
            base = np.empty(nbytes, dtype=np.uint8)
        # The handle is a distinct numpy object viewing ``base``; the tensor's
        # storage keeps it alive, so its death means "no tensor uses these bytes".
        handle = base[:]
        finalizer = weakref.finalize(handle, self._release, base)
        finalizer.atexit = False  # at interpreter exit just let memory go
        return torch.from_numpy(handle).view(dtype).reshape(shape)

    def _release(self, base: np.ndarray) -> None:
        """Called when the last tensor over ``base`` died: keep it idle, or drop it over the cap."""
        nbytes = base.nbytes
        with self._lock:
            if self._idle_bytes + nbytes <= self.max_idle_bytes:
                self._idle[nbytes].append(base)
                self._idle_bytes += nbytes

    def clear(self) -> None:
        """Free every idle buffer (e.g. after finalization)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


_DEFAULT_POOL = HostBufferPool()


def default_receive_pool() -> HostBufferPool:
    """The process-wide pool :func:`diloco.wire.decode` uses when given none."""
    return _DEFAULT_POOL

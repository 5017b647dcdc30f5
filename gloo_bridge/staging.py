"""Host staging for bridged collectives: reusable host buffers and deferred copy-back.

Why: gloo reads and writes host memory only (handing it a CUDA pointer
crashes the process with ``writev ... Bad address``). A bridged call copies
device tensors into host buffers, runs gloo on them and copies results back.
Page-locked (pinned) buffers copy several times faster than pageable ones, but
pinning is slow and scarce, so buffers are cached by size and reused.

Failure and ordering semantics:
- Buffers belong to exactly one call from ``acquire`` until ``finish``; an
  async call keeps them until its work handle is waited, so two calls in
  flight never share a buffer.
- Copy-back happens on ``wait()`` for async handles (as NCCL users expect:
  results are valid after ``wait``), and before returning for sync calls.
- The current stream is synchronized after the copies into host memory (gloo
  must not read a buffer the device is still writing) and after the copies
  back (the buffer must not be reused while the device is still reading it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from gloo_bridge import device as dev

logger = logging.getLogger(__name__)

__all__ = ["BridgedWork", "HostBufferCache", "StagedCall"]

DEFAULT_CACHE_BYTES = 1 << 30


class HostBufferCache:
    """A small pool of flat host buffers keyed by byte size.

    Use one per process (the bridge owns it). Buffers are uint8 and viewed as
    the caller's dtype and shape, so an fp32 and a bf16 tensor of the same byte
    size share entries.

    Args:
        pinned: allocate page-locked memory (only meaningful with an accelerator).
        max_cached_bytes: bytes kept in the free pool; a released buffer that
            would exceed it is dropped (freed) instead. Default 1 GiB.
    """

    def __init__(self, pinned: bool, max_cached_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_cached_bytes < 0:
            raise ValueError(f"max_cached_bytes must be >= 0, got {max_cached_bytes}")
        self.pinned = pinned
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.allocations = 0

    @property
    def cached_bytes(self) -> int:
        """Bytes currently held in the free pool."""
        return self._cached_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of exactly ``nbytes``, reused when one is free."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._cached_bytes -= nbytes
                return free.pop()
            self.allocations += 1
        return dev.host_buffer(nbytes, self.pinned)

    def release(self, raw: torch.Tensor) -> None:
        """Give ``raw`` back to the pool; when the pool is full it is freed (a registered buffer
        unregistered: ``device.free_host_buffer``)."""
        nbytes = raw.numel()
        with self._lock:
            keep = self._cached_bytes + nbytes <= self.max_cached_bytes
            if keep:
                self._free.setdefault(nbytes, []).append(raw)
                self._cached_bytes += nbytes
        if not keep:
            dev.free_host_buffer(raw)

    def clear(self) -> None:
        """Free every cached buffer (registered ones unregistered)."""
        with self._lock:
            dropped = [b for bufs in self._free.values() for b in bufs]
            self._free.clear()
            self._cached_bytes = 0
        for raw in dropped:
            dev.free_host_buffer(raw)


class StagedCall:
    """The host-side working set of one bridged call.

    ``stage`` decides whether tensors are copied at all: False for CPU tensors
    (they go to gloo as they are, unless non-contiguous or the operation needs
    a scratch copy), True for accelerator tensors (and for CPU tensors in
    tests that force the staging path).
    """

    def __init__(self, cache: HostBufferCache, stage: bool) -> None:
        self._cache = cache
        self._stage = stage
        self._held: list[torch.Tensor] = []
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._after: list[Callable[[], None]] = []
        self._devices: set[torch.device] = set()
        self._finished = False

    def _buffer_like(self, tensor: torch.Tensor) -> torch.Tensor:
        raw = self._cache.acquire(tensor.numel() * tensor.element_size())
        self._held.append(raw)
        if dev.is_accelerator(tensor):
            self._devices.add(tensor.device)
        return raw.view(tensor.dtype).view(tensor.shape)

    def _needs_copy(self, tensor: torch.Tensor) -> bool:
        return self._stage or dev.is_accelerator(tensor) or not tensor.is_contiguous()

    def host_in(self, tensor: torch.Tensor, scratch: bool = False) -> torch.Tensor:
        """Host version of an input; ``scratch`` forces a copy gloo may overwrite."""
        if not (scratch or self._needs_copy(tensor)):
            return tensor
        buf = self._buffer_like(tensor)
        buf.copy_(tensor, non_blocking=buf.is_pinned())
        return buf

    def host_out(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host version of an output; copied back into ``tensor`` on finish."""
        if not self._needs_copy(tensor):
            return tensor
        buf = self._buffer_like(tensor)
        self._copy_back.append((tensor, buf))
        return buf

    def host_inout(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host version of an in-place operand: copied in now, back on finish."""
        if not self._needs_copy(tensor):
            return tensor
        buf = self.host_in(tensor)
        self._copy_back.append((tensor, buf))
        return buf

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on host results after gloo finished, before copy-back."""
        self._after.append(fn)

    def ready(self) -> None:
        """Wait until every device-to-host copy landed; call before gloo runs."""
        for device in self._devices:
            dev.synchronize_stream(device)

    def finish(self) -> None:
        """Post-process, copy results back, return buffers. Runs once."""
        if self._finished:
            return
        self._finished = True
        for fn in self._after:
            fn()
        for target, buf in self._copy_back:
            target.copy_(buf, non_blocking=buf.is_pinned())
        # Ordering hazard: the copies back are async from pinned memory; the
        # buffers go back to the pool only once the device has read them.
        for device in self._devices:
            dev.synchronize_stream(device)
        for raw in self._held:
            self._cache.release(raw)
        self._held.clear()
        self._copy_back.clear()


class BridgedWork:
    """The work handle of an async bridged call: ``wait()`` also copies back.

    It mirrors the parts of ``torch.distributed.Work`` that training code uses
    (``wait``, ``is_completed``, ``is_success``, ``synchronize``, ``result``).
    ``get_future`` is refused with a clear error: a future would complete before
    the copy-back, which would hand out stale device tensors.
    """

    def __init__(self, op: str, inner: Any, staged: StagedCall, outputs: list[torch.Tensor]) -> None:
        self._op = op
        self._inner = inner
        self._staged = staged
        self._outputs = outputs
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for gloo (bounded by ``timeout`` or the group's timeout), then copy back."""
        if not self._done:
            if self._inner is not None:
                if timeout is None:
                    self._inner.wait()
                else:
                    self._inner.wait(timeout)
            self._staged.finish()
            self._done = True
        return True

    def synchronize(self) -> None:
        """Same as ``wait()``: host staging leaves nothing to enqueue on a stream."""
        self.wait()

    def is_completed(self) -> bool:
        """True once ``wait()`` ran (copy-back is part of completion)."""
        return self._done

    def is_success(self) -> bool:
        """True once completed without error (errors raise from ``wait``)."""
        return self._done

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors (valid after ``wait``)."""
        return list(self._outputs)

    def get_future(self) -> Any:
        """Refused: see the class docstring."""
        raise RuntimeError(
            f"gloo_bridge: get_future() is not supported on a bridged {self._op}; call wait() instead"
        )

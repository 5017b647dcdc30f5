"""One small device helper for the whole project: CUDA, Ascend NPU or CPU.

Why: the project runs on NVIDIA GPUs (NCCL), Ascend NPUs (HCCL, through
``torch_npu``) and plain CPUs (gloo, for tests and demos). Every place that
would otherwise write ``torch.cuda...`` asks this module instead, so adding or
changing a device kind is a change here only. ``torch_npu`` is imported only
when it is installed, and only on first use, so CPU and CUDA hosts never pay
for it or fail on it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "accelerator_type",
    "current_device",
    "current_stream",
    "event_synchronize",
    "new_stream",
    "record_event",
    "stream_wait_event",
    "use_stream",
    "default_backend",
    "host_buffer",
    "is_accelerator",
    "pinning_available",
    "free_host_buffer",
    "set_current_device",
    "synchronize",
    "synchronize_stream",
]


@functools.lru_cache(maxsize=1)
def _npu_available() -> bool:
    """True when ``torch_npu`` is installed and sees an NPU (imported lazily)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # a broken CANN install must not break CPU runs
        logger.warning("torch_npu is installed but failed to import: %s", exc)
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def accelerator_type() -> str | None:
    """``"cuda"``, ``"npu"`` or ``None`` (CPU only) for this process."""
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return None


def default_backend() -> str:
    """The job's collective backend for this device: nccl, hccl or gloo."""
    kind = accelerator_type()
    if kind == "cuda":
        return "nccl"
    if kind == "npu":
        return "hccl"
    return "gloo"


def _module(kind: str):  # type: ignore[no-untyped-def]
    """``torch.cuda`` or ``torch.npu``: the two share the calls we use."""
    return torch.cuda if kind == "cuda" else getattr(torch, kind)


def current_device() -> torch.device:
    """The device this process computes on (its current accelerator, else CPU)."""
    kind = accelerator_type()
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, _module(kind).current_device())


def set_current_device(index: int) -> torch.device:
    """Make accelerator ``index`` current (no-op on CPU); returns the device."""
    kind = accelerator_type()
    if kind is None:
        return torch.device("cpu")
    _module(kind).set_device(index)
    return torch.device(kind, index)


def is_accelerator(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives in accelerator memory (gloo cannot read it)."""
    return tensor.device.type not in ("cpu", "meta")


def synchronize(device: torch.device | None = None) -> None:
    """Wait for all work on ``device`` (default: the current one); CPU: no-op."""
    dev = device if device is not None else current_device()
    if dev.type == "cpu" or dev.type == "meta":
        return
    _module(dev.type).synchronize(dev)


def synchronize_stream(device: torch.device) -> None:
    """Wait for the current stream of ``device`` only (cheaper than a device sync).

    Staged copies are issued on the current stream, so waiting for that stream
    is exactly what makes a host buffer safe to read (after a device-to-host
    copy) or to reuse (after a host-to-device copy).
    """
    if device.type == "cpu" or device.type == "meta":
        return
    _module(device.type).current_stream(device).synchronize()


def pinning_available() -> bool:
    """Pinned (page-locked) host memory only makes sense with an accelerator."""
    return accelerator_type() is not None


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A flat uint8 host buffer of exactly ``nbytes``, page-locked when ``pinned``.

    Pinned memory lets device copies run at full link speed and asynchronously;
    it is a scarce OS resource, so callers cache and reuse these buffers. On CUDA the
    buffer is one plain allocation registered with ``cudaHostRegister`` (exact size;
    unregistered when the tensor dies), never torch's caching host
    allocator, which rounds every block up to a power of two and keeps it for the life of
    the process. Elsewhere, or if registering fails, ``pin_memory=True``.
    """
    if nbytes < 0:
        raise ValueError(f"host_buffer: nbytes must be >= 0, got {nbytes}")
    if pinned and nbytes > 0 and accelerator_type() == "cuda":
        registered = _registered_buffer(nbytes)
        if registered is not None:
            return registered
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


_REGISTERED: dict[int, torch.Tensor] = {}
"""Buffers page-locked by cudaHostRegister, by address: kept alive until free_host_buffer."""


DONT_FORK_MIN_BYTES = 64 << 20
"""Registered buffers at least this large are left out of forked children (``MADV_DONTFORK``).
glibc maps every block above 32 MiB on its own, so the advice dies with the buffer's mapping
and never reaches memory the heap hands out later."""

_MADV_DONTFORK = 10
_MADV_DOFORK = 11


def _fork_advice(ptr: int, nbytes: int, advice: int) -> bool:
    """``madvise`` the whole pages inside ``[ptr, ptr + nbytes)``; True when it was applied."""
    if nbytes < DONT_FORK_MIN_BYTES or not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    start, end = -(-ptr // page) * page, (ptr + nbytes) // page * page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return end > start and libc.madvise(start, end - start, advice) == 0


def _registered_buffer(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of plain host memory page-locked in place by cudaHostRegister (None if refused).

    A large one is also marked ``MADV_DONTFORK``: the kernel copies page-locked pages into a
    forked child at ``fork()`` (they cannot be shared copy-on-write), so a training job that forks
    (checkpoint writers, data-loader workers) would otherwise copy the island's snapshot slot and
    staging buffers. No child needs them: the data path runs in the process that allocated them."""
    cudart = torch.cuda.cudart()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
    if int(err) != 0:
        return None
    _fork_advice(buf.data_ptr(), nbytes, _MADV_DONTFORK)
    _REGISTERED[buf.data_ptr()] = buf
    return buf


def free_host_buffer(buf: torch.Tensor) -> None:
    """Give back a :func:`host_buffer` (or any view of one) registered with cudaHostRegister:
    unregister it and let it go. A buffer that was not registered is left to refcounting."""
    ptr = buf.untyped_storage().data_ptr()
    held = _REGISTERED.pop(ptr, None)
    if held is not None:
        torch.cuda.cudart().cudaHostUnregister(ptr)
        _fork_advice(ptr, held.numel(), _MADV_DOFORK)


# ---------------------------------------------------------------------------
# Streams and events (the island's background data path). On the CPU every
# call is a no-op and "streams" / "events" are None, so callers need no branch.
# ---------------------------------------------------------------------------


def current_stream(device: torch.device) -> object | None:
    """The current stream of ``device`` (None on CPU)."""
    if device.type in ("cpu", "meta"):
        return None
    return _module(device.type).current_stream(device)


def new_stream(device: torch.device) -> object | None:
    """A new side stream on ``device`` (None on CPU): copies on it overlap the compute stream."""
    if device.type in ("cpu", "meta"):
        return None
    return _module(device.type).Stream(device=device)


def use_stream(stream: object | None):  # type: ignore[no-untyped-def]
    """Context manager making ``stream`` current (a null context for None)."""
    import contextlib

    if stream is None:
        return contextlib.nullcontext()
    kind = str(getattr(stream, "device", "cuda")).split(":")[0]
    return _module(kind).stream(stream)


def record_event(stream: object | None) -> object | None:
    """Record an event on ``stream`` (None on CPU); see :func:`event_synchronize`."""
    if stream is None:
        return None
    return stream.record_event()  # type: ignore[attr-defined]


def stream_wait_event(stream: object | None, event: object | None) -> None:
    """Make ``stream`` wait (on the device, the host does not block) for ``event``."""
    if stream is not None and event is not None:
        stream.wait_event(event)  # type: ignore[attr-defined]


def event_synchronize(event: object | None) -> None:
    """Block the calling host thread until ``event`` completed (no-op for None)."""
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]

"""Chunk work of the wire: byte views of tensors, keyed chunk digests, and the threads that run them.

Everything here grows with payload bytes and releases the GIL (xxhash, numpy copies), so large
messages are digested and copied on a small shared pool (:data:`CHUNK_THREADS`). Owns that pool
(created on first use, shared by every socket thread of the process).
"""

from __future__ import annotations

import hmac
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import numpy as np
import torch
import xxhash


def wire_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor, sharing its memory.

    The memoryview's exporter (a numpy array) holds a reference to the tensor,
    so the frames keep the tensor alive until zmq is done sending them.
    """
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # numpy arrays export the buffer protocol


def digest_seed(key: bytes) -> int:
    """The xxh3 seed of chunk digests: secret, derived from the shared key (0 without one).

    The header MAC covers the digests; seeding them with a key-derived secret means an
    on-path attacker cannot compute the digest of a chunk it altered, so in HMAC mode
    (no transport encryption) a tampered payload is caught too.  xxh3 is not a proven MAC:
    links you do not own should run Curve mode, whose AEAD authenticates every frame."""
    if not key:
        return 0
    return int.from_bytes(hmac.digest(key, b"yeto-diloco chunk digest seed v1", "sha256")[:8], "little")


def check_and_copy(job: tuple[memoryview, int, np.ndarray, int]) -> bool:
    """Digest one received chunk and, if it matches, copy it into its tensor (the one copy).

    ``dest``: the chunk's bytes in its tensor (a uint8 array), or, when the chunk holds bf16 and
    its tensor is fp32, the chunk's elements as the uint32 bits of that fp32 tensor: each bf16 is
    upcast as it is copied (its bits shifted up by 16: exact, as torch's upcast). Hash first, then
    copy: the chunk is still in cache for the copy, and a forged chunk is never written anywhere.
    Every call releases the GIL.
    """
    chunk, digest, dest, seed = job
    if xxhash.xxh3_64_intdigest(chunk, seed=seed) != digest:
        return False
    if dest.dtype == np.uint32:
        np.copyto(dest, np.frombuffer(chunk, dtype=np.uint16))
        np.left_shift(dest, 16, out=dest)
    else:
        np.copyto(dest, np.frombuffer(chunk, dtype=np.uint8))
    return True


CHUNK_THREADS: int = max(1, min(4, os.cpu_count() or 1))
"""Threads that digest (and on receive, copy) the chunks of one large message.

xxhash and numpy's copy release the GIL, so a 256 MiB fragment is hashed and
copied ~3x faster with 4 threads on a host with spare cores; 1 disables it."""

_PARALLEL_MIN_CHUNKS = 4  # below this, handing work to threads costs more than it saves
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


_In = TypeVar("_In")
_Out = TypeVar("_Out")


def map_chunks(fn: Callable[[_In], _Out], items: list[_In], parallel: bool = True) -> list[_Out]:
    """``[fn(x) for x in items]``, on the chunk threads when the message is large.

    The executor is shared by every socket thread of the process; ``map``
    waits for all items, so callers see complete results (or the first
    exception, after the others finished).
    """
    global _executor
    if not parallel or CHUNK_THREADS <= 1 or len(items) < _PARALLEL_MIN_CHUNKS:
        return [fn(x) for x in items]
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=CHUNK_THREADS, thread_name_prefix="wire-chunks")
    return list(_executor.map(fn, items))

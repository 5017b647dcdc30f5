"""Wire codec: headers plus tensors to zmq frames and back, validated.

Every message is one zmq multipart message::

    frame 0   MAC     HMAC-SHA256(key, header bytes), 32 bytes
    frame 1   header  msgpack of an ``Envelope`` (protocol, typed header, chunk size, tensor metas)
    frame 2.. chunks  raw little-endian tensor bytes, tensors in header order, each cut into
                      chunks of ``chunk_bytes`` (the last one of a tensor may be shorter)

Why this shape: the header is small and typed, so a receiver can authenticate
it, decode it and check every declared size against :class:`Limits` *before*
it allocates a single tensor byte.  The header lists one xxh3-64 digest per
chunk, so the MAC over the header also authenticates every payload byte
without running HMAC over gigabytes.  Tensor bytes travel as separate frames
that are zero-copy views of the sender's tensors, and the receiver copies each
chunk exactly once, into a tensor from the receive pool (see
:mod:`diloco.wire.hostpool`).

This module knows nothing of torch.distributed, Megatron or the round rules.
Any malformed, oversized, unauthenticated or wrong-version message makes
:func:`decode` raise :class:`WireError` with a one-line reason; the caller logs
it and keeps serving.
"""

from __future__ import annotations

import functools
import hmac
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple, Sequence, TypeVar

import msgspec
import numpy as np
import torch
import xxhash
import zmq

from diloco.wire.hostpool import HostBufferPool, default_receive_pool
from diloco.wire.schema import (
    DEFAULT_CHUNK_BYTES,
    DTYPE_NAMES,
    ENVELOPE_DECODER,
    ENVELOPE_ENCODER,
    HEADER_TYPES,
    ITEMSIZE,
    MAC_BYTES,
    PROBE_DECODER,
    PROTOCOL_VERSION,
    PUSH_DTYPES,
    WIRE_DTYPES,
    Envelope,
    Header,
    Hello,
    Limits,
    TensorMeta,
    Welcome,
    WireError,
    kind_of,
)

class Message(NamedTuple):
    """A decoded message: the typed header and its tensors (CPU, float32/bfloat16, header order)."""

    header: Header
    tensors: list[tuple[str, torch.Tensor]]


def _wire_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor, sharing its memory.

    The memoryview's exporter (a numpy array) holds a reference to the tensor,
    so the frames keep the tensor alive until zmq is done sending them.
    """
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # numpy arrays export the buffer protocol


class Payload(NamedTuple):
    """Tensor metas and chunk frames of a message, without header or MAC.

    Building a payload is the work that grows with bytes (dtype conversion, one
    xxh3 pass); :func:`seal` then adds a header and its MAC in time independent of
    the payload size.  So a sender can encode on a worker thread and seal on a
    latency-sensitive one, and reuse one payload under many headers (the same
    broadcast part to every island)."""

    metas: tuple[TensorMeta, ...]
    frames: tuple[memoryview, ...]
    chunk_bytes: int
    nbytes: int


EMPTY_PAYLOAD = Payload((), (), DEFAULT_CHUNK_BYTES, 0)


def encode_payload(
    tensors: Sequence[tuple[str, torch.Tensor]] = (),
    *,
    wire_dtype: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    parallel: bool = True,
    seed: int = 0,
) -> Payload:
    """Chunk and digest ``tensors`` (see :func:`encode` for the arguments and their rules).

    ``parallel=False`` digests on the calling thread (a caller that is itself one of
    several workers does not want the shared chunk threads on top)."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"encode: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    target: torch.dtype | None = None
    if wire_dtype is not None:
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"encode: wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {wire_dtype!r}")
        target = WIRE_DTYPES[wire_dtype]

    metas: list[TensorMeta] = []
    chunk_frames: list[memoryview] = []
    seen: set[str] = set()
    nbytes = 0
    for name, tensor in tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"encode: tensor names must be non-empty str, got {name!r}")
        if name in seen:
            raise ValueError(f"encode: duplicate tensor name {name!r}")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"encode: tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        t = tensor.detach()
        # Convert before moving to CPU: on an accelerator the cast is cheap and
        # halves the device-to-host bytes for bf16.  Both calls return ``t``
        # itself when nothing changes, which keeps the fp32 hot path copy-free.
        if target is not None:
            t = t.to(target)
        elif t.dtype not in DTYPE_NAMES:
            raise ValueError(f"encode: tensor {name!r} has dtype {t.dtype}; pass wire_dtype or use float32/bfloat16")
        t = t.cpu().contiguous()
        data = _wire_bytes(t)
        nbytes += data.nbytes
        chunks = [data[offset : offset + chunk_bytes] for offset in range(0, data.nbytes, chunk_bytes)]
        chunk_frames.extend(chunks)
        metas.append(TensorMeta(name=name, dtype=DTYPE_NAMES[t.dtype], shape=tuple(t.shape), chunks=(len(chunks),)))

    # Digest every chunk of the message at once, in parallel when it is large
    # (xxhash releases the GIL); then put each tensor's digests into its meta.
    all_digests = _map_chunks(functools.partial(xxhash.xxh3_64_intdigest, seed=seed), chunk_frames, parallel)
    start = 0
    for i, meta in enumerate(metas):
        count = meta.chunks[0]
        metas[i] = TensorMeta(meta.name, meta.dtype, meta.shape, tuple(all_digests[start : start + count]))
        start += count
    return Payload(tuple(metas), tuple(chunk_frames), chunk_bytes, nbytes)


def seal(
    header: Header, payload: Payload = EMPTY_PAYLOAD, *, key: bytes = b"", nonce: int = 0, seq: int = 0
) -> list[bytes | memoryview]:
    """Frames of ``header`` plus an encoded payload: the envelope and its MAC (cheap).

    ``nonce``/``seq``: the connection's session nonce and this message's sequence number
    (see :class:`Envelope`); seal at send time, so sequence numbers follow the send order."""
    if not isinstance(header, HEADER_TYPES):
        raise TypeError(f"encode: header must be one of the header Structs, got {type(header).__name__}")
    body = ENVELOPE_ENCODER.encode(
        Envelope(protocol=PROTOCOL_VERSION, header=header, chunk_bytes=payload.chunk_bytes, tensors=payload.metas,
                 nonce=nonce, seq=seq)
    )
    mac = hmac.digest(key, body, "sha256")
    return [mac, body, *payload.frames]


def encode(
    header: Header,
    tensors: Sequence[tuple[str, torch.Tensor]] = (),
    *,
    key: bytes = b"",
    wire_dtype: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    nonce: int = 0,
    seq: int = 0,
) -> list[bytes | memoryview]:
    """Frames ready for ``socket.send_multipart(frames, copy=False)``.

    Args:
        header: one of the header Structs.
        tensors: ``(name, tensor)`` pairs in the order the receiver expects
            (a fragment's plan order). Names must be unique.
        key: shared HMAC key (``b""`` when the deployment sets none).
        wire_dtype: ``"float32"`` or ``"bfloat16"`` to convert every tensor
            (torch's round-to-nearest-even for fp32 -> bf16); ``None`` means
            every tensor must already be float32 or bfloat16.
        chunk_bytes: maximum payload bytes per chunk frame (default 4 MiB);
            the receiver refuses chunks above its ``Limits.max_chunk_bytes``.

    A contiguous CPU tensor already in the wire dtype is not copied: its chunks
    are memoryviews of its storage, and the returned list keeps it alive, so do
    not modify such tensors until the send has completed.  Other tensors are
    converted/moved/made contiguous once.  Equal to
    ``seal(header, encode_payload(tensors, ...), key=key)``.

    Raises:
        TypeError / ValueError: for local misuse (not a header, unknown dtype,
        duplicate names, bad chunk size); never ``WireError``.
    """
    if not isinstance(header, HEADER_TYPES):
        raise TypeError(f"encode: header must be one of the header Structs, got {type(header).__name__}")
    return seal(header, encode_payload(tensors, wire_dtype=wire_dtype, chunk_bytes=chunk_bytes,
                                       seed=digest_seed(key)), key=key,
                nonce=nonce, seq=seq)


# --------------------------------------------------------------------------- decode


def _as_bytes_view(frame: object, index: int) -> memoryview:
    """A flat unsigned-byte view of one received frame (bytes, memoryview or zmq.Frame)."""
    try:
        if isinstance(frame, zmq.Frame):
            view = frame.buffer
        else:
            view = memoryview(frame)  # type: ignore[arg-type]
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise WireError(f"frame {index} is not a contiguous byte buffer ({type(frame).__name__}): {exc}") from None
    return view


def _decode_envelope(body: memoryview) -> Envelope:
    """msgspec-decode frame 1, turning any schema failure into a one-line reason."""
    try:
        return ENVELOPE_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        # A peer speaking another protocol version may have a differently shaped
        # envelope; say so instead of reporting a confusing field error.
        try:
            probe = PROBE_DECODER.decode(body)
        except msgspec.DecodeError:
            probe = None
        if probe is not None and probe.protocol != PROTOCOL_VERSION:
            raise WireError(f"protocol version {probe.protocol}, expected {PROTOCOL_VERSION}") from None
        raise WireError(f"malformed header: {exc}") from None


class _Planned(NamedTuple):
    """A tensor whose declared sizes passed the limits, not yet allocated."""

    meta: TensorMeta
    nbytes: int


def _check_header(env: Envelope, limits: Limits) -> None:
    """Version and per-kind checks that do not depend on the payload."""
    if env.protocol != PROTOCOL_VERSION:
        raise WireError(f"protocol version {env.protocol}, expected {PROTOCOL_VERSION}")
    header = env.header
    if isinstance(header, (Hello, Welcome)) and header.protocol != PROTOCOL_VERSION:
        raise WireError(f"{kind_of(header)} declares protocol {header.protocol}, expected {PROTOCOL_VERSION}")
    if isinstance(header, Hello) and header.wire_dtype not in PUSH_DTYPES:
        raise WireError(f"HELLO wire_dtype {header.wire_dtype[:40]!r} not in {list(PUSH_DTYPES)}")
    if len(env.tensors) > limits.max_tensors:
        raise WireError(f"{len(env.tensors)} tensors, limit {limits.max_tensors}")
    if not 0 < env.chunk_bytes <= limits.max_chunk_bytes:
        raise WireError(f"chunk_bytes {env.chunk_bytes} outside [1, {limits.max_chunk_bytes}]")
    if not (0 <= env.nonce < 2**63 and 0 <= env.seq < 2**63):
        raise WireError(f"nonce {env.nonce} / seq {env.seq} outside [0, 2**63)")


def _plan_tensors(env: Envelope, limits: Limits) -> list[_Planned]:
    """Check every declared name, dtype, shape and size; allocate nothing."""
    planned: list[_Planned] = []
    names: set[str] = set()
    total = 0
    for i, meta in enumerate(env.tensors):
        where = f"tensor {i} ({meta.name[:80]!r})"
        if not meta.name:
            raise WireError(f"tensor {i} has an empty name")
        if meta.name in names:
            raise WireError(f"duplicate tensor name {meta.name[:80]!r}")
        names.add(meta.name)
        itemsize = ITEMSIZE.get(meta.dtype)
        if itemsize is None:
            raise WireError(f"{where}: dtype {meta.dtype[:40]!r} not in {sorted(WIRE_DTYPES)}")
        if len(meta.shape) > limits.max_ndim:
            raise WireError(f"{where}: {len(meta.shape)} dims, limit {limits.max_ndim}")
        if any(d < 0 for d in meta.shape):
            raise WireError(f"{where}: negative dimension in shape {meta.shape}")
        # Bound every dimension too: (0, 2**63) declares 0 bytes, yet torch refuses to
        # allocate it with an error that is not a WireError.
        if any(d > limits.max_tensor_bytes for d in meta.shape):
            raise WireError(f"{where}: dimension above {limits.max_tensor_bytes} in shape {meta.shape[:8]}")
        # Python ints do not overflow, so an absurd shape is caught here, not wrapped.
        nbytes = math.prod(meta.shape) * itemsize
        if nbytes > limits.max_tensor_bytes:
            raise WireError(f"{where}: {nbytes} bytes declared, limit {limits.max_tensor_bytes}")
        total += nbytes
        if total > limits.max_message_bytes:
            raise WireError(f"message declares more than {limits.max_message_bytes} tensor bytes")
        expected_chunks = -(-nbytes // env.chunk_bytes)
        if len(meta.chunks) != expected_chunks:
            raise WireError(
                f"{where}: {len(meta.chunks)} chunk digests for {nbytes} bytes, "
                f"expected {expected_chunks} at chunk_bytes {env.chunk_bytes}"
            )
        planned.append(_Planned(meta, nbytes))
    return planned


class Opened:
    """A message whose MAC, header and declared sizes were checked; payload not yet read.

    :func:`open_message` does the part of decoding whose cost does not depend on the
    payload size, so a latency-sensitive thread (the syncer's control loop) can run it
    and hand the payload work (digests, copies, arithmetic) to another thread.  The
    object keeps the received frames alive, so its chunk views stay valid as long as it
    does.
    """

    __slots__ = ("header", "chunk_bytes", "metas", "nbytes", "nonce", "seq", "seed", "_chunks", "_sizes")

    def __init__(self, header: Header, chunk_bytes: int, planned: list[_Planned], chunks: list[memoryview],
                 nonce: int = 0, seq: int = 0, seed: int = 0) -> None:
        self.header = header
        self.seed = seed
        """Seed of the chunk digests (:func:`digest_seed` of the receiver's key)."""
        self.nonce = nonce
        """Session nonce from the envelope (under the MAC); the receiver checks it."""
        self.seq = seq
        """Per-connection sequence number from the envelope (under the MAC)."""
        self.chunk_bytes = chunk_bytes
        self.metas: tuple[TensorMeta, ...] = tuple(p.meta for p in planned)
        self._sizes = [p.nbytes for p in planned]
        self.nbytes: int = sum(self._sizes)
        self._chunks = chunks

    def _jobs(self) -> list[tuple[int, int, int, memoryview, int]]:
        """(tensor index, chunk index in tensor, byte offset in tensor, chunk, digest) for every chunk."""
        jobs = []
        j = 0
        for i, meta in enumerate(self.metas):
            offset = 0
            for c, digest in enumerate(meta.chunks):
                chunk = self._chunks[j]
                jobs.append((i, c, offset, chunk, digest))
                offset += chunk.nbytes
                j += 1
        return jobs

    def verify(self, parallel: bool = True) -> None:
        """Check every chunk's digest (on the chunk threads); raise :class:`WireError` on the first bad one."""
        jobs = self._jobs()
        seed = self.seed
        verdicts = _map_chunks(lambda job: xxhash.xxh3_64_intdigest(job[3], seed=seed) == job[4], jobs, parallel)
        for ok, (i, c, _o, _ch, _d) in zip(verdicts, jobs):
            if not ok:
                raise WireError(f"chunk {c} of {self.metas[i].name[:80]!r} fails its digest (corrupted or tampered)")

    def chunk_views(self) -> list[tuple[int, int, torch.Tensor]]:
        """Zero-copy 1-D tensors over every chunk: ``(tensor index, element offset, view)``.

        Call :meth:`verify` first.  The views alias the received frames: read them
        while this object is alive, never write them."""
        out = []
        for i, _c, offset, chunk, _d in self._jobs():
            dtype = WIRE_DTYPES[self.metas[i].dtype]
            itemsize = ITEMSIZE[self.metas[i].dtype]
            if chunk.nbytes == 0:
                continue
            arr = np.frombuffer(chunk, dtype=np.uint8)
            with warnings.catch_warnings():  # received frames are read-only; we never write them
                warnings.simplefilter("ignore", UserWarning)
                view = torch.from_numpy(arr).view(dtype)
            out.append((i, offset // itemsize, view))
        return out

    def copy_into(self, dests: Sequence[torch.Tensor], parallel: bool = True) -> None:
        """Verify and copy every tensor into ``dests`` (contiguous CPU tensors of the declared
        dtype and element count, one per tensor): the one copy decoding makes."""
        if len(dests) != len(self.metas):
            raise ValueError(f"copy_into: {len(dests)} destinations for {len(self.metas)} tensors")
        flat = []
        for d, meta, size in zip(dests, self.metas, self._sizes):
            if d.dtype != WIRE_DTYPES[meta.dtype] or d.numel() * d.element_size() != size or not d.is_contiguous():
                raise ValueError(f"copy_into: destination for {meta.name!r} does not match its declaration")
            flat.append(d.reshape(-1).view(torch.uint8).numpy())
        jobs = [(chunk, digest, flat[i][offset : offset + chunk.nbytes], self.seed)
                for i, _c, offset, chunk, digest in self._jobs()]
        # Every job runs to completion before we report the first bad chunk, so no
        # worker is still writing into a tensor the caller might see.
        verdicts = _map_chunks(_check_and_copy, jobs, parallel)
        for ok, (i, c, _o, _ch, _d) in zip(verdicts, self._jobs()):
            if not ok:
                raise WireError(f"chunk {c} of {self.metas[i].name[:80]!r} fails its digest (corrupted or tampered)")

    def tensors(self, pool: HostBufferPool | None = None) -> list[tuple[str, torch.Tensor]]:
        """Allocate (from ``pool``), verify and copy every tensor: the classic decode result."""
        receive_pool = default_receive_pool() if pool is None else pool
        out = [(m.name, receive_pool.empty(m.shape, WIRE_DTYPES[m.dtype])) for m in self.metas]
        self.copy_into([t for _, t in out])
        return out


def open_message(
    frames: Sequence[bytes | memoryview | zmq.Frame],
    *,
    key: bytes = b"",
    limits: Limits = Limits(),
) -> Opened:
    """Authenticate a message and check every declared size; read no payload byte.

    Checks, in this order (each before anything it guards is touched): frame
    count, MAC frame length, header length, MAC (constant-time, before the
    header is parsed), strict msgspec decode, protocol version, per-kind
    fields, tensor count, chunk size, every tensor's name/dtype/ndim/dims/bytes
    and the message total against ``limits``, the number and length of chunk
    frames.  Cost: proportional to the header, not to the payload.

    Raises:
        WireError: with a one-line ``reason`` on anything malformed, oversized,
        unauthenticated or of another protocol version.
    """
    n_frames = len(frames)
    if n_frames < 2:
        raise WireError(f"{n_frames} frames, need at least 2 (MAC, header)")
    mac = _as_bytes_view(frames[0], 0)
    if mac.nbytes != MAC_BYTES:
        raise WireError(f"MAC frame is {mac.nbytes} bytes, expected {MAC_BYTES}")
    body = _as_bytes_view(frames[1], 1)
    if body.nbytes > limits.max_header_bytes:
        raise WireError(f"header is {body.nbytes} bytes, limit {limits.max_header_bytes}")
    if not hmac.compare_digest(hmac.digest(key, body, "sha256"), mac):
        raise WireError("bad MAC (wrong or missing key, or tampered header)")

    env = _decode_envelope(body)
    _check_header(env, limits)
    planned = _plan_tensors(env, limits)

    n_chunks = sum(len(p.meta.chunks) for p in planned)
    if n_frames - 2 != n_chunks:
        raise WireError(f"{n_frames - 2} chunk frames, header declares {n_chunks}")
    chunks = [_as_bytes_view(frames[2 + j], 2 + j) for j in range(n_chunks)]
    # Check every chunk length before anything is allocated, so a truncated message costs nothing.
    j = 0
    for p in planned:
        for c in range(len(p.meta.chunks)):
            want = min(env.chunk_bytes, p.nbytes - c * env.chunk_bytes)
            if chunks[j].nbytes != want:
                raise WireError(f"chunk {c} of {p.meta.name[:80]!r} is {chunks[j].nbytes} bytes, expected {want}")
            j += 1
    return Opened(env.header, env.chunk_bytes, planned, chunks, env.nonce, env.seq, digest_seed(key))


def decode(
    frames: Sequence[bytes | memoryview | zmq.Frame],
    *,
    key: bytes = b"",
    limits: Limits = Limits(),
    pool: HostBufferPool | None = None,
) -> Message:
    """Validate and decode one multipart message: :func:`open_message`, then every chunk's
    xxh3-64 digest checked as it is copied into a tensor from ``pool`` (the one copy).

    Tensors come from ``pool`` (default: :func:`default_receive_pool`), so a
    fragment's buffers freed after one round are reused by the next one
    instead of page-faulting fresh memory; pass ``HostBufferPool(0)`` for
    plain ``torch.empty`` tensors.

    Raises:
        WireError: with a one-line ``reason`` on anything malformed, oversized,
        unauthenticated or of another protocol version.
    """
    opened = open_message(frames, key=key, limits=limits)
    return Message(header=opened.header, tensors=opened.tensors(pool))


def digest_seed(key: bytes) -> int:
    """The xxh3 seed of chunk digests: secret, derived from the shared key (0 without one).

    The header MAC covers the digests; seeding them with a key-derived secret means an
    on-path attacker cannot compute the digest of a chunk it altered, so in HMAC mode
    (no transport encryption) a tampered payload is caught too.  xxh3 is not a proven MAC:
    links you do not own should run Curve mode, whose AEAD authenticates every frame."""
    if not key:
        return 0
    return int.from_bytes(hmac.digest(key, b"yeto-diloco chunk digest seed v1", "sha256")[:8], "little")


def _check_and_copy(job: tuple[memoryview, int, np.ndarray, int]) -> bool:
    """Digest one received chunk and, if it matches, copy it into its tensor (the one copy).

    Hash first, then copy: the chunk is still in cache for the copy, and a
    forged chunk is never written anywhere.  Both calls release the GIL.
    """
    chunk, digest, dest, seed = job
    if xxhash.xxh3_64_intdigest(chunk, seed=seed) != digest:
        return False
    np.copyto(dest, np.frombuffer(chunk, dtype=np.uint8))
    return True


# --------------------------------------------------------------------------- chunk workers

CHUNK_THREADS: int = max(1, min(4, os.cpu_count() or 1))
"""Threads that digest (and on receive, copy) the chunks of one large message.

xxhash and numpy's copy release the GIL, so a 256 MiB fragment is hashed and
copied ~3x faster with 4 threads on a host with spare cores; 1 disables it."""

_PARALLEL_MIN_CHUNKS = 4  # below this, handing work to threads costs more than it saves
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


_In = TypeVar("_In")
_Out = TypeVar("_Out")


def _map_chunks(fn: Callable[[_In], _Out], items: list[_In], parallel: bool = True) -> list[_Out]:
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


def payload_bytes(msg: Message) -> int:
    """Total tensor bytes of a decoded message (for byte counters and logs)."""
    return sum(t.numel() * t.element_size() for _, t in msg.tensors)

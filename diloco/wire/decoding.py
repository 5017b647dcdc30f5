"""Decoding: zmq frames into a typed header and tensors, every declared size checked first.

:func:`open_message` authenticates and checks a message in time proportional to its header (no
payload byte read, nothing allocated); :class:`Opened` then verifies digests and copies chunks,
once, into tensors from the receive pool; :func:`decode` is both. Any malformed, oversized,
unauthenticated or wrong-version message raises :class:`~diloco.wire.schema.WireError` with a
one-line reason; the caller logs it and keeps serving. The frame layout is described in
:mod:`diloco.wire`.
"""

from __future__ import annotations

import hmac
import math
import warnings
from typing import Callable, NamedTuple, Sequence

import msgspec
import numpy as np
import torch
import xxhash
import zmq

from diloco.wire.chunks import check_and_copy, digest_seed, map_chunks
from diloco.wire.hostpool import HostBufferPool, default_receive_pool
from diloco.wire.schema import (ENVELOPE_DECODER, ITEMSIZE, MAC_BYTES, PROBE_DECODER, PROTOCOL_VERSION, PUSH_DTYPES,
                                WIRE_DTYPES, Envelope, Header, Hello, Limits, TensorMeta, Welcome, WireError, kind_of)


class Message(NamedTuple):
    """A decoded message: the typed header and its tensors (CPU, float32/bfloat16, header order)."""

    header: Header
    tensors: list[tuple[str, torch.Tensor]]


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
        self._chunks: list[memoryview] | None = chunks

    def release(self) -> None:
        """Let go of the received frames once the payload was read: reading the payload after this
        raises (the header, metas and sizes stay)."""
        self._chunks = None

    @property
    def released(self) -> bool:
        """Whether :meth:`release` let go of the frames."""
        return self._chunks is None

    def _jobs(self) -> list[tuple[int, int, int, memoryview, int]]:
        """(tensor index, chunk index in tensor, byte offset in tensor, chunk, digest) for every chunk."""
        if self._chunks is None:
            raise RuntimeError("the payload of this message was released")
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
        verdicts = map_chunks(lambda job: xxhash.xxh3_64_intdigest(job[3], seed=seed) == job[4], jobs, parallel)
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

    def copy_into(self, dests: Sequence[torch.Tensor], parallel: bool = True,
                  inspect: Callable[[np.ndarray], float] | None = None) -> float:
        """Verify and copy every tensor into ``dests`` (contiguous CPU tensors of the declared
        element count, one per tensor): the one copy decoding makes. A destination has the
        declared dtype, or float32 for a bfloat16 tensor: each chunk is then upcast as it is
        copied (exact), so a bf16 value lands in fp32 memory without a bf16 copy of it.

        ``inspect``, when given, is called on each chunk's destination right after its copy (a
        uint8 array of its bytes, or for an upcast chunk the uint32 bits of its fp32 elements),
        while the chunk is still in cache; returns the largest figure it gave (0.0 without it, or
        without chunks)."""
        if len(dests) != len(self.metas):
            raise ValueError(f"copy_into: {len(dests)} destinations for {len(self.metas)} tensors")
        flat: list[np.ndarray] = []
        for d, meta, size in zip(dests, self.metas, self._sizes):
            upcast = meta.dtype == "bfloat16" and d.dtype == torch.float32
            if upcast and self.chunk_bytes % 2:
                raise ValueError(f"copy_into: {meta.name!r} is bf16 in chunks of {self.chunk_bytes} bytes (odd): "
                                 "it cannot be upcast chunk by chunk")
            if (d.dtype != WIRE_DTYPES[meta.dtype] and not upcast) or not d.is_contiguous() \
                    or d.numel() * ITEMSIZE[meta.dtype] != size or d.device.type != "cpu":
                raise ValueError(f"copy_into: destination for {meta.name!r} does not match its declaration")
            data = d.reshape(-1).view(torch.uint8).numpy()
            flat.append(data.view(np.uint32) if upcast else data)  # upcast: the fp32 bits, one per element
        jobs = [(chunk, digest, _dest_of(flat[i], offset, chunk.nbytes), self.seed)
                for i, _c, offset, chunk, digest in self._jobs()]
        # Every job runs to completion before we report the first bad chunk, so no
        # worker is still writing into a tensor the caller might see.
        if inspect is None:
            verdicts: list[float | None] = [0.0 if ok else None for ok in map_chunks(check_and_copy, jobs, parallel)]
        else:
            verdicts = map_chunks(lambda job: inspect(job[2]) if check_and_copy(job) else None, jobs, parallel)
        for got, (i, c, _o, _ch, _d) in zip(verdicts, self._jobs()):
            if got is None:
                raise WireError(f"chunk {c} of {self.metas[i].name[:80]!r} fails its digest (corrupted or tampered)")
        return max((v for v in verdicts if v is not None), default=0.0)

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


def payload_bytes(msg: Message) -> int:
    """Total tensor bytes of a decoded message (for byte counters and logs)."""
    return sum(t.numel() * t.element_size() for _, t in msg.tensors)


def _dest_of(flat: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """Where the chunk at byte ``offset`` of a tensor lands: that byte range of its destination,
    or (a uint32 view: the fp32 bits of a bf16 tensor's destination) that element range."""
    if flat.dtype == np.uint32:
        return flat[offset // 2 : (offset + nbytes) // 2]
    return flat[offset : offset + nbytes]

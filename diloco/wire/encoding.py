"""Encoding: a typed header plus tensors into zmq frames (sending side of the wire).

:func:`encode_payload` does the work that grows with bytes (dtype conversion, one keyed xxh3 pass
per chunk); :func:`seal` adds the envelope and its MAC in time independent of the payload; and
:func:`encode` is both. The frame layout is described in :mod:`diloco.wire`. Local misuse raises
TypeError / ValueError, never :class:`~diloco.wire.schema.WireError`.
"""

from __future__ import annotations

import functools
import hmac
from typing import NamedTuple, Sequence

import torch
import xxhash

from diloco.wire.chunks import digest_seed, map_chunks, wire_bytes
from diloco.wire.schema import (DEFAULT_CHUNK_BYTES, DTYPE_NAMES, ENVELOPE_ENCODER, HEADER_TYPES, PROTOCOL_VERSION,
                                WIRE_DTYPES, Envelope, Header, TensorMeta)


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
        data = wire_bytes(t)
        nbytes += data.nbytes
        chunks = [data[offset : offset + chunk_bytes] for offset in range(0, data.nbytes, chunk_bytes)]
        chunk_frames.extend(chunks)
        metas.append(TensorMeta(name=name, dtype=DTYPE_NAMES[t.dtype], shape=tuple(t.shape), chunks=(len(chunks),)))

    # Digest every chunk of the message at once, in parallel when it is large
    # (xxhash releases the GIL); then put each tensor's digests into its meta.
    all_digests = map_chunks(functools.partial(xxhash.xxh3_64_intdigest, seed=seed), chunk_frames, parallel)
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

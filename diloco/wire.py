"""Wire format: typed, authenticated zmq multipart messages carrying tensors.

Every message between an island and the syncer is one zmq multipart message::

    frame 0   MAC     HMAC-SHA256(key, header bytes), 32 bytes
    frame 1   header  msgpack of an ``_Envelope`` (protocol, typed header, chunk size, tensor metas)
    frame 2.. chunks  raw little-endian tensor bytes, tensors in header order, each cut into
                      chunks of ``chunk_bytes`` (the last one of a tensor may be shorter)

Why this shape: the header is small and typed (msgspec, never pickle), so a
receiver can authenticate it, decode it and check every declared size against
:class:`Limits` *before* it allocates a single tensor byte.  The header lists
one xxh3-64 digest per chunk, so the MAC over the header also authenticates
every payload byte without running HMAC over gigabytes.  Tensor bytes travel as
separate frames that are zero-copy views of the sender's tensors, and the
receiver copies each chunk exactly once, into a freshly allocated tensor.

This module knows nothing of torch.distributed, Megatron or the round rules;
the syncer and the island client give the headers their meaning (see
``docs/PROTOCOL.md``).  Any malformed, oversized, unauthenticated or
wrong-version message makes :func:`decode` raise :class:`WireError` with a
one-line reason; the caller logs it and keeps serving.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import msgspec
import torch
import xxhash
import zmq

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_CHUNK_BYTES",
    "WIRE_DTYPES",
    "MAC_BYTES",
    "WireError",
    "Limits",
    "TensorMeta",
    "Hello",
    "Welcome",
    "Init",
    "Pull",
    "Push",
    "Bcast",
    "Heartbeat",
    "Final",
    "FinalAck",
    "Shutdown",
    "Error",
    "Header",
    "Message",
    "encode",
    "decode",
    "payload_bytes",
    "kind_of",
]

PROTOCOL_VERSION: int = 1
"""Bumped on any incompatible change of the envelope or of a header kind."""

DEFAULT_CHUNK_BYTES: int = 4 << 20
"""Chunk size used by :func:`encode`: large enough that per-frame overhead is
negligible, small enough that a chunk stays in cache between hashing and copying."""

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The only tensor dtypes that may travel; keys are the names used in headers."""

_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in WIRE_DTYPES.items()}
_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2}

MAC_BYTES: int = 32
"""Length of frame 0 (an HMAC-SHA256 digest)."""


class WireError(Exception):
    """A received message was refused; ``reason`` is one line, suitable for a log.

    Raised only by :func:`decode` (and never for local programming errors, which
    raise ``ValueError``/``TypeError`` from :func:`encode`), so a receive loop
    can catch exactly this, log ``reason`` and go on serving.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason: str = reason


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces on every declared size before allocating.

    The defaults admit a 8 GiB tensor and a 32 GiB message, far above any
    fragment we plan, while refusing absurd declarations (e.g. ``2**40``
    elements) without touching memory.  Sizes are in bytes unless noted.
    """

    max_header_bytes: int = 64 << 10
    """Length of frame 1 (the msgpack header)."""
    max_tensors: int = 4096
    """Number of tensors in one message."""
    max_tensor_bytes: int = 8 << 30
    """Bytes of one tensor (numel * itemsize)."""
    max_message_bytes: int = 32 << 30
    """Sum of tensor bytes in one message."""
    max_chunk_bytes: int = 64 << 20
    """Declared chunk size (every chunk frame is at most this long)."""
    max_ndim: int = 8
    """Number of dimensions of one tensor."""

    def __post_init__(self) -> None:
        for name in (
            "max_header_bytes",
            "max_tensors",
            "max_tensor_bytes",
            "max_message_bytes",
            "max_chunk_bytes",
            "max_ndim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Limits.{name} must be a non-negative int, got {value!r}")


# --------------------------------------------------------------------------- headers
# Headers are frozen, tagged msgspec Structs: the ``kind`` field names the message
# and the decoder refuses unknown kinds, unknown fields and wrong field types.


class TensorMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One tensor of a message: canonical name, wire dtype name, shape, and one
    xxh3-64 digest per chunk (so the header MAC covers the payload).

    Encoded as a msgpack array (not a map) to keep headers of fragments with
    many tensors well under ``Limits.max_header_bytes``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]


class _HeaderBase(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """Common config of every header kind (the ``kind`` tag is the UPPERCASE name)."""


class Hello(_HeaderBase, tag="HELLO"):
    """island -> syncer at (re)connect: binds ``island`` to a fresh ``generation``."""

    protocol: int
    island: int
    generation: int
    fingerprint: str
    n_fragments: int
    wire_dtype: str


class Welcome(_HeaderBase, tag="WELCOME"):
    """syncer -> island: answer to HELLO; ``need_init`` asks island 0 to stream INIT."""

    protocol: int
    syncer_id: int
    need_init: bool
    versions: tuple[int, ...]
    sync_every: int
    total_steps: int


class Init(_HeaderBase, tag="INIT"):
    """island 0 -> syncer: initial fp32 value of one fragment."""

    island: int
    generation: int
    fragment: int
    n_fragments: int


class Pull(_HeaderBase, tag="PULL"):
    """syncer -> island: push your delta of ``fragment`` for this round/attempt."""

    fragment: int
    round: int
    attempt: int


class Push(_HeaderBase, tag="PUSH"):
    """island -> syncer: ``local - anchor`` of one fragment, answering a PULL."""

    island: int
    generation: int
    fragment: int
    round: int
    attempt: int
    base_version: int
    local_steps: int
    tokens: int


class Bcast(_HeaderBase, tag="BCAST"):
    """syncer -> island: the global value of a fragment at ``version``."""

    fragment: int
    version: int
    round: int
    cut: bool


class Heartbeat(_HeaderBase, tag="HEARTBEAT"):
    """Both ways: liveness; island fields from islands, ``syncer_id`` from the syncer."""

    island: int = -1
    generation: int = 0
    step: int = 0
    done: bool = False
    syncer_id: int = 0


class Final(_HeaderBase, tag="FINAL"):
    """syncer -> island: fp32 final value of one fragment plus the version manifest."""

    fragment: int
    version: int
    n_fragments: int
    versions: tuple[int, ...]


class FinalAck(_HeaderBase, tag="FINAL_ACK"):
    """island -> syncer: the versions the island installed at finalization."""

    island: int
    generation: int
    versions: tuple[int, ...]


class Shutdown(_HeaderBase, tag="SHUTDOWN"):
    """syncer -> island: stop; ``reason`` is for the log."""

    reason: str


class Error(_HeaderBase, tag="ERROR"):
    """syncer -> island: a refusal the island should know about (``code`` is stable)."""

    code: str
    reason: str


Header = Hello | Welcome | Init | Pull | Push | Bcast | Heartbeat | Final | FinalAck | Shutdown | Error
_HEADER_TYPES: tuple[type, ...] = (
    Hello,
    Welcome,
    Init,
    Pull,
    Push,
    Bcast,
    Heartbeat,
    Final,
    FinalAck,
    Shutdown,
    Error,
)


class _Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What frame 1 holds: the header plus everything needed to size the payload."""

    protocol: int
    header: Header
    chunk_bytes: int
    tensors: tuple[TensorMeta, ...]


class _VersionProbe(msgspec.Struct):
    """Lenient view of an envelope, used only to explain a decode failure by version."""

    protocol: int


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Envelope)  # strict=True by default: no int<->str/bool coercion
_PROBE_DECODER = msgspec.msgpack.Decoder(_VersionProbe)


def kind_of(header: Header) -> str:
    """The wire tag of a header (``"HELLO"``, ``"FINAL_ACK"``, ...), for logs and dispatch."""
    return type(header).__struct_config__.tag  # type: ignore[return-value]


class Message(NamedTuple):
    """A decoded message: the typed header and its tensors (CPU, float32/bfloat16, header order)."""

    header: Header
    tensors: list[tuple[str, torch.Tensor]]


# --------------------------------------------------------------------------- encode


def _wire_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor, sharing its memory.

    The memoryview's exporter (a numpy array) holds a reference to the tensor,
    so the frames keep the tensor alive until zmq is done sending them.
    """
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def encode(
    header: Header,
    tensors: Sequence[tuple[str, torch.Tensor]] = (),
    *,
    key: bytes = b"",
    wire_dtype: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
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
    converted/moved/made contiguous once.

    Raises:
        TypeError / ValueError: for local misuse (not a header, unknown dtype,
        duplicate names, bad chunk size); never ``WireError``.
    """
    if not isinstance(header, _HEADER_TYPES):
        raise TypeError(f"encode: header must be one of the header Structs, got {type(header).__name__}")
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
        elif t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"encode: tensor {name!r} has dtype {t.dtype}; pass wire_dtype or use float32/bfloat16")
        t = t.cpu().contiguous()
        data = _wire_bytes(t)
        digests: list[int] = []
        for offset in range(0, data.nbytes, chunk_bytes):
            chunk = data[offset : offset + chunk_bytes]
            digests.append(xxhash.xxh3_64_intdigest(chunk))
            chunk_frames.append(chunk)
        metas.append(TensorMeta(name=name, dtype=_DTYPE_NAMES[t.dtype], shape=tuple(t.shape), chunks=tuple(digests)))

    body = _ENCODER.encode(
        _Envelope(protocol=PROTOCOL_VERSION, header=header, chunk_bytes=chunk_bytes, tensors=tuple(metas))
    )
    mac = hmac.digest(key, body, "sha256")
    return [mac, body, *chunk_frames]


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


def _decode_envelope(body: memoryview) -> _Envelope:
    """msgspec-decode frame 1, turning any schema failure into a one-line reason."""
    try:
        return _DECODER.decode(body)
    except msgspec.DecodeError as exc:
        # A peer speaking another protocol version may have a differently shaped
        # envelope; say so instead of reporting a confusing field error.
        try:
            probe = _PROBE_DECODER.decode(body)
        except msgspec.DecodeError:
            probe = None
        if probe is not None and probe.protocol != PROTOCOL_VERSION:
            raise WireError(f"protocol version {probe.protocol}, expected {PROTOCOL_VERSION}") from None
        raise WireError(f"malformed header: {exc}") from None


class _Planned(NamedTuple):
    """A tensor whose declared sizes passed the limits, not yet allocated."""

    meta: TensorMeta
    nbytes: int


def _check_header(env: _Envelope, limits: Limits) -> None:
    """Version and per-kind checks that do not depend on the payload."""
    if env.protocol != PROTOCOL_VERSION:
        raise WireError(f"protocol version {env.protocol}, expected {PROTOCOL_VERSION}")
    header = env.header
    if isinstance(header, (Hello, Welcome)) and header.protocol != PROTOCOL_VERSION:
        raise WireError(f"{kind_of(header)} declares protocol {header.protocol}, expected {PROTOCOL_VERSION}")
    if isinstance(header, Hello) and header.wire_dtype not in WIRE_DTYPES:
        raise WireError(f"HELLO wire_dtype {header.wire_dtype!r} not in {sorted(WIRE_DTYPES)}")
    if len(env.tensors) > limits.max_tensors:
        raise WireError(f"{len(env.tensors)} tensors, limit {limits.max_tensors}")
    if not 0 < env.chunk_bytes <= limits.max_chunk_bytes:
        raise WireError(f"chunk_bytes {env.chunk_bytes} outside [1, {limits.max_chunk_bytes}]")


def _plan_tensors(env: _Envelope, limits: Limits) -> list[_Planned]:
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
        itemsize = _ITEMSIZE.get(meta.dtype)
        if itemsize is None:
            raise WireError(f"{where}: dtype {meta.dtype[:40]!r} not in {sorted(WIRE_DTYPES)}")
        if len(meta.shape) > limits.max_ndim:
            raise WireError(f"{where}: {len(meta.shape)} dims, limit {limits.max_ndim}")
        if any(d < 0 for d in meta.shape):
            raise WireError(f"{where}: negative dimension in shape {meta.shape}")
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


def decode(
    frames: Sequence[bytes | memoryview | zmq.Frame],
    *,
    key: bytes = b"",
    limits: Limits = Limits(),
) -> Message:
    """Validate and decode one multipart message.

    Checks, in this order (each before anything it guards is touched): frame
    count, MAC frame length, header length, MAC (constant-time, before the
    header is parsed), strict msgspec decode, protocol version, per-kind
    fields, tensor count, chunk size, every tensor's name/dtype/ndim/dims/bytes
    and the message total against ``limits``, the number and length of chunk
    frames; only then are tensors allocated, and each chunk's xxh3-64 digest is
    checked as it is copied in (the one copy decoding makes).

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
    # Check every chunk length before allocating, so a truncated message costs nothing.
    j = 0
    for p in planned:
        for c in range(len(p.meta.chunks)):
            want = min(env.chunk_bytes, p.nbytes - c * env.chunk_bytes)
            if chunks[j].nbytes != want:
                raise WireError(f"chunk {c} of {p.meta.name[:80]!r} is {chunks[j].nbytes} bytes, expected {want}")
            j += 1

    out: list[tuple[str, torch.Tensor]] = []
    j = 0
    for p in planned:
        tensor = torch.empty(p.meta.shape, dtype=WIRE_DTYPES[p.meta.dtype])
        dest = _wire_bytes(tensor)
        offset = 0
        for c, digest in enumerate(p.meta.chunks):
            chunk = chunks[j]
            j += 1
            # Hash first, then copy: the chunk is then still in cache for the copy,
            # and a forged chunk is never written anywhere.
            if xxhash.xxh3_64_intdigest(chunk) != digest:
                raise WireError(f"chunk {c} of {p.meta.name[:80]!r} fails its digest (corrupted or tampered)")
            dest[offset : offset + chunk.nbytes] = chunk
            offset += chunk.nbytes
        out.append((p.meta.name, tensor))
    return Message(header=env.header, tensors=out)


def payload_bytes(msg: Message) -> int:
    """Total tensor bytes of a decoded message (for byte counters and logs)."""
    return sum(t.numel() * t.element_size() for _, t in msg.tensors)

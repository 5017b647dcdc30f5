"""The wire protocol between islands and the syncer (see ``docs/PROTOCOL.md``).

Every message is one zmq multipart message::

    frame 0   MAC     HMAC-SHA256(key, header bytes), 32 bytes
    frame 1   header  msgpack of an ``Envelope`` (protocol, typed header, chunk size, tensor metas)
    frame 2.. chunks  raw little-endian tensor bytes, tensors in header order, each cut into
                      chunks of ``chunk_bytes`` (the last one of a tensor may be shorter)

Why this shape: the header is small and typed (msgspec, never pickle), so a receiver can
authenticate it, decode it and check every declared size against :class:`Limits` *before* it
allocates a single tensor byte.  The header lists one keyed xxh3-64 digest per chunk, so the MAC
over the header also authenticates every payload byte without running HMAC over gigabytes.
Tensor bytes travel as separate frames that are zero-copy views of the sender's tensors, and the
receiver copies each chunk exactly once, into a tensor from the receive pool.

Rooms: :mod:`.schema` (constants, limits, headers), :mod:`.encoding` (header + tensors -> frames),
:mod:`.decoding` (frames -> validated header + tensors, :class:`WireError` on anything wrong),
:mod:`.chunks` (digests and the chunk threads), :mod:`.parts` (a fragment cut into parts),
:mod:`.hostpool` (reuse of receive buffers), :mod:`.pacing`.  This package knows nothing of
torch.distributed, Megatron or the round rules.  Import everything from here:
``from diloco import wire``.
"""

from diloco.wire.chunks import digest_seed
from diloco.wire.decoding import Message, Opened, decode, open_message, payload_bytes
from diloco.wire.encoding import EMPTY_PAYLOAD, Payload, encode, encode_payload, seal
from diloco.wire.parts import FragmentLayout, check_part_elems
from diloco.wire.hostpool import HostBufferPool, default_receive_pool
from diloco.wire.schema import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PART_ELEMS,
    MAC_BYTES,
    MAX_DIGEST_CHARS,
    PART_ALIGN_ELEMS,
    PROTOCOL_VERSION,
    PUSH_DTYPES,
    QUANT_KINDS,
    WIRE_DTYPES,
    bcast_dtype,
    Bcast,
    Error,
    Final,
    FinalAck,
    Header,
    Held,
    Heartbeat,
    Hello,
    Init,
    Lane,
    LaneOk,
    Limits,
    Progress,
    Pull,
    Push,
    Shutdown,
    TensorMeta,
    Welcome,
    WireError,
    kind_of,
)

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_CHUNK_BYTES",
    "WIRE_DTYPES",
    "PUSH_DTYPES",
    "QUANT_KINDS",
    "bcast_dtype",
    "MAC_BYTES",
    "MAX_DIGEST_CHARS",
    "WireError",
    "Limits",
    "TensorMeta",
    "Hello",
    "Welcome",
    "Init",
    "Lane",
    "LaneOk",
    "Pull",
    "Push",
    "Bcast",
    "Held",
    "Heartbeat",
    "Final",
    "FinalAck",
    "Shutdown",
    "Progress",
    "Error",
    "Header",
    "Message",
    "encode",
    "decode",
    "encode_payload",
    "digest_seed",
    "seal",
    "open_message",
    "Opened",
    "Payload",
    "EMPTY_PAYLOAD",
    "DEFAULT_PART_ELEMS",
    "PART_ALIGN_ELEMS",
    "payload_bytes",
    "kind_of",
    "FragmentLayout",
    "check_part_elems",
    "HostBufferPool",
    "default_receive_pool",
]

"""The wire protocol between islands and the syncer (see ``docs/PROTOCOL.md``).

One zmq multipart message per protocol message: an HMAC frame, a typed msgpack
header (msgspec, never pickle) and raw tensor chunks with one xxh3-64 digest
each listed in the header.  :func:`encode` builds the frames zero-copy;
:func:`decode` authenticates, checks every declared size against
:class:`Limits` before allocating, and refuses anything wrong with a
:class:`WireError` whose ``reason`` is one log line.

Split in three small modules: :mod:`.schema` (constants, limits, headers),
:mod:`.codec` (frames <-> messages) and :mod:`.hostpool` (reuse of receive
buffers).  Import everything from here: ``from diloco import wire``.
"""

from diloco.wire.codec import EMPTY_PAYLOAD, Message, Opened, Payload, decode, digest_seed, encode, encode_payload, open_message, payload_bytes, seal
from diloco.wire.parts import FragmentLayout, check_part_elems
from diloco.wire.hostpool import HostBufferPool, default_receive_pool
from diloco.wire.schema import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_PART_ELEMS,
    MAC_BYTES,
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
    Heartbeat,
    Hello,
    Init,
    Limits,
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

"""Wire schema: protocol constants, limits, and the typed message headers.

The headers are frozen, tagged msgspec Structs (``kind`` = the UPPERCASE kind
name) decoded strictly from msgpack: unknown kinds, unknown fields and wrong
field types are refused by the decoder itself, never coerced, and nothing is
ever unpickled.  The meaning of each kind and the round rules live in
``docs/PROTOCOL.md``; :mod:`diloco.wire.encoding` and :mod:`diloco.wire.decoding` turn headers plus tensors into
zmq frames and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

PROTOCOL_VERSION: int = 6
"""Bumped on any incompatible change of the envelope or of a header kind (2: parted fragments;
3: session nonce and sequence number in the envelope, WELCOME echoes the generation; 4: PROGRESS
notices, BCAST carries the commit's duration; 5: HELLO claims the values it holds, HELD notices,
WELCOME says which fragments hold a value)."""

MAX_DIGEST_CHARS: int = 64
"""Longest digest string a HELLO may claim per fragment (``tensor_digest`` is 32 hex chars)."""

DEFAULT_PART_ELEMS: int = 8 << 20
"""Elements per part of a fragment stream at most under the syncer's ``--part-mib auto`` (32 MiB of
fp32), and an island's assumption until WELCOME tells it the run's size.  A multiple of
``PART_ALIGN_ELEMS``."""

PART_ALIGN_ELEMS: int = 4096
"""Part boundaries are multiples of this many elements, so block-quantized payloads never
straddle two parts."""

DEFAULT_CHUNK_BYTES: int = 1 << 20
"""Chunk size used by :func:`encode`: large enough that per-frame overhead is
negligible, small enough that a chunk stays in cache between hashing and copying."""

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
"""The only tensor dtypes that may travel; keys are the names used in headers (``uint8``
only for the codes of low-bit pushes)."""

DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in WIRE_DTYPES.items()}
ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "uint8": 1}

PUSH_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "int8", "q4")
"""What an island's pushes may travel as (HELLO ``wire_dtype``): plain fp32/bf16 segments, or
block-quantized codes + bf16 scales (``diloco.quant``, docs/PROTOCOL.md "Low-bit pushes")."""

QUANT_KINDS: tuple[str, ...] = ("int8", "q4")


def bcast_dtype(push_dtype: str) -> str:
    """The dtype of the broadcasts an island gets: its push dtype, bf16 for low-bit pushes
    (broadcasts are values, not pseudo-gradients: they stay fp32 or bf16)."""
    return "bfloat16" if push_dtype in QUANT_KINDS else push_dtype

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

    The defaults admit parts of 128 MiB and fragments of 32 GiB, while refusing
    absurd declarations (e.g. ``2**40`` elements) without touching memory.
    Sizes are in bytes unless noted.
    """

    max_header_bytes: int = 2 << 20
    """Length of frame 1 (the msgpack header). A tensor costs ~70 bytes of header plus
    9 bytes per 4 MiB chunk; 2 MiB admits the 16k-tensor fragments of large MoE models
    (hundreds of experts x layers) while staying trivially cheap to refuse."""
    max_tensors: int = 16384
    """Number of tensors in one message."""
    max_tensor_bytes: int = 128 << 20
    """Bytes of one tensor (numel * itemsize) of one message: a segment of a part."""
    max_message_bytes: int = 128 << 20
    """Sum of tensor bytes in one message.  Fragments travel as parts of a few tens of MiB
    (``Welcome.part_elems``), so neither zmq nor our code ever holds a multi-GB message."""
    max_chunk_bytes: int = 64 << 20
    """Declared chunk size (every chunk frame is at most this long)."""
    max_ndim: int = 8
    """Number of dimensions of one tensor."""
    max_fragment_bytes: int = 32 << 30
    """fp32 bytes of one fragment.  A HELLO whose plan exceeds it is refused with the fix
    (more fragments) instead of failing later at the wire level."""

    def __post_init__(self) -> None:
        for name in (
            "max_header_bytes",
            "max_tensors",
            "max_tensor_bytes",
            "max_message_bytes",
            "max_chunk_bytes",
            "max_ndim",
            "max_fragment_bytes",
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
    fragment_numel: tuple[int, ...] = ()
    quant_block: int = 0
    """Elements per scale of ``int8`` / ``q4`` pushes (0 for fp32 / bf16); must match the syncer."""
    """Elements of each fragment of the island's plan, checked against the syncer's limits."""
    instance: int = 0
    """Random per island process, the same across its redials: a HELLO for a bound island id
    from another instance while the binding is live is a second process (``island_in_use``),
    not a reconnect. 0: unknown (an older island; the routing id decides)."""
    holds: tuple[str, ...] = ()
    """Per fragment, ``diloco.digest.tensor_digest`` of the fp32 value the island holds now and
    would install a cut over (``""``: no claim for that fragment; ``()``: none at all). A
    fragment whose claim equals the digest of the syncer's current value is answered with HELD
    instead of its cut (docs/PROTOCOL.md, "Initial cut")."""


class Welcome(_HeaderBase, tag="WELCOME"):
    """syncer -> island: answer to HELLO; ``need_init`` asks island 0 to stream INIT."""

    protocol: int
    syncer_id: int
    need_init: bool
    versions: tuple[int, ...]
    sync_every: int
    total_steps: int
    part_elems: int = DEFAULT_PART_ELEMS
    """Elements per part of every fragment stream (see ``diloco.wire.parts``)."""
    generation: int = 0
    """The generation of the HELLO this answers: a WELCOME of another connection is refused."""
    nonce: int = 0
    """The session nonce: every later message of this connection, both ways, carries it (and an
    increasing sequence number) in its envelope, under the MAC (see docs/SECURITY.md)."""
    weighting: str = ""
    """The syncer's ``--weighting`` (``tokens``, ``steps``, ``equal``); empty from an older syncer."""
    initialised: tuple[bool, ...] = ()
    """Per fragment, whether the syncer holds a value for it (INIT complete, or resumed): island 0
    streams INIT only for the others, so a redial mid-INIT resumes instead of restarting."""
    lanes: int = 0
    """Second connections (``Lane``) the syncer takes for INIT beside this one: 0 or 1
    (``--init-lanes``); one TCP stream carries about 5 GB/s on loopback, two about 8."""


class Lane(_HeaderBase, tag="LANE"):
    """island -> syncer, on a second connection of the island's session: it carries INIT parts
    beside the first (``Welcome.lanes``). Sealed with the lane's nonce (``protocol.session.lane_nonce``
    of the session's) and the lane's own sequence numbers (this message takes 1), it binds the lane
    to the island's current generation, once per session (``LaneOk`` answers on the first
    connection); only INIT travels on it, and nothing comes back on it."""

    island: int
    generation: int


class LaneOk(_HeaderBase, tag="LANE_OK"):
    """syncer -> island 0, on the first connection: the lane of this session is bound; INIT streams
    may go on it from now on (until then, and if this never comes, INIT stays on the first)."""

    generation: int


class Init(_HeaderBase, tag="INIT"):
    """island 0 -> syncer: one part of the initial fp32 value of one fragment.

    Part 0 carries the fragment's ``schema`` (canonical names and global shapes, plan
    order); the other parts carry ``()``."""

    island: int
    generation: int
    fragment: int
    n_fragments: int
    part: int = 0
    n_parts: int = 1
    schema: tuple[tuple[str, tuple[int, ...]], ...] = ()


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
    part: int = 0
    n_parts: int = 1
    """0 for a zero-weight push (``local_steps == 0``): it carries no tensors."""


class Bcast(_HeaderBase, tag="BCAST"):
    """syncer -> island: the global value of a fragment at ``version``."""

    fragment: int
    version: int
    round: int
    cut: bool
    part: int = 0
    n_parts: int = 1
    commit_us: int = 0
    """How long the syncer's commit of this version took, microseconds (0: a cut, or unknown)."""


class Held(_HeaderBase, tag="HELD"):
    """syncer -> island, instead of a cut fragment: the value the island claimed in its HELLO is
    the syncer's value of ``fragment`` at ``version`` (bit for bit): install it as that cut."""

    fragment: int
    version: int
    round: int


class Heartbeat(_HeaderBase, tag="HEARTBEAT"):
    """Both ways: liveness; island fields from islands, ``syncer_id`` from the syncer."""

    island: int = -1
    generation: int = 0
    step: int = 0
    done: bool = False
    syncer_id: int = 0
    down_bytes_s: int = 0
    """island -> syncer: the island's measured downlink throughput, bytes/s (0: not measured yet)."""
    rtt_us: int = 0
    """island -> syncer: the island's measured round-trip time to the syncer, microseconds (0: unknown)."""


class Final(_HeaderBase, tag="FINAL"):
    """syncer -> island: fp32 final value of one fragment plus the version manifest; or, with
    ``held``, a notice without bytes (``part`` 0, ``n_parts`` 0): the final value is the fp32
    BCAST of ``version`` the syncer streamed to this session after the island said it is done
    (the island installs that value, or redials for the bytes if it does not hold it)."""

    fragment: int
    version: int
    n_fragments: int
    versions: tuple[int, ...]
    part: int = 0
    n_parts: int = 1
    held: bool = False


class FinalAck(_HeaderBase, tag="FINAL_ACK"):
    """island -> syncer: the versions the island installed at finalization."""

    island: int
    generation: int
    versions: tuple[int, ...]
    digests: tuple[str, ...] = ()
    """Per fragment, ``diloco.digest.tensor_digest`` of the fp32 global value the island
    installed (computed on its sync rank from the FINAL it received); the syncer checks it
    against its own. Empty: not checked (an older island), logged."""


class Progress(_HeaderBase, tag="PROGRESS"):
    """syncer -> island, every second or so: what moved that the island may be waiting for.

    Counters are cumulative on the syncer (an island compares two notices: a change is
    progress, the same values again are not), so a waiting island tells a slow link from a
    dead one and rejoins only when nothing it waits for moves (docs/PROTOCOL.md, "Liveness
    on slow links")."""

    init_bytes: int = 0
    """fp32 bytes of INIT received from island 0 so far."""
    in_bytes: int = 0
    """Data bytes received from every island (INIT and PUSH parts)."""
    commits: int = 0
    """Rounds committed."""
    sent_bytes: int = 0
    """Data bytes of value streams (BCAST, cut, FINAL) handed to the network for this island."""
    queue: int = 0
    """Value streams queued for this island (its position: how many are ahead of a new one)."""
    syncer_id: int = 0


class Shutdown(_HeaderBase, tag="SHUTDOWN"):
    """syncer -> island: stop; ``reason`` is for the log."""

    reason: str


class Error(_HeaderBase, tag="ERROR"):
    """syncer -> island: a refusal the island should know about (``code`` is stable)."""

    code: str
    reason: str
    fragment: int = -1
    """The fragment of the refused PUSH (``stale_base``), else -1."""
    round: int = 0
    """The round of the refused PUSH (``stale_base``), else 0."""


Header = (Hello | Welcome | Lane | LaneOk | Init | Pull | Push | Bcast | Held | Heartbeat | Final | FinalAck | Shutdown | Error
          | Progress)
HEADER_TYPES: tuple[type, ...] = (
    Hello,
    Welcome,
    Lane,
    LaneOk,
    Init,
    Pull,
    Push,
    Bcast,
    Held,
    Heartbeat,
    Final,
    FinalAck,
    Shutdown,
    Error,
    Progress,
)


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What frame 1 holds: the header plus everything needed to size the payload.

    ``nonce`` and ``seq`` bind a message to one connection and one place in it: the session
    nonce from WELCOME (0 on HELLO, on WELCOME itself it is the new nonce, and on replies to
    an unbound peer) and a per-connection sequence number that strictly increases in each
    direction.  Both are under the MAC, so a captured message cannot be replayed elsewhere or
    later (see docs/SECURITY.md)."""

    protocol: int
    header: Header
    chunk_bytes: int
    tensors: tuple[TensorMeta, ...]
    nonce: int = 0
    seq: int = 0


class VersionProbe(msgspec.Struct):
    """Lenient view of an envelope, used only to explain a decode failure by version."""

    protocol: int


ENVELOPE_ENCODER = msgspec.msgpack.Encoder()
ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)  # strict=True by default: no int<->str/bool coercion
PROBE_DECODER = msgspec.msgpack.Decoder(VersionProbe)


def kind_of(header: Header) -> str:
    """The wire tag of a header (``"HELLO"``, ``"FINAL_ACK"``, ...), for logs and dispatch."""
    return type(header).__struct_config__.tag  # type: ignore[return-value]

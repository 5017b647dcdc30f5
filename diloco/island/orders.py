"""The records between the island's client, its planner and its executor.

* :class:`PendingBcast` — a global value of one fragment the client received and parked (in);
* :class:`Orders` — what the sync rank's planner decided for one boundary, which every rank of
  the island carries out in the same order (out). Its parts are named records: :class:`Value`
  (a fragment's global value to stage or install) and :class:`PushOrder` (a pull to answer).

Pure records: nothing here does I/O. Orders travel between the ranks as JSON with named
fields (``msgspec``), decoded with type validation (``Orders.from_json``), never pickle; the
collectives that carry them are ``diloco.island.exchange``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

Tensors = list[tuple[str, torch.Tensor]]


@dataclass
class PendingBcast:
    """The newest not-yet-applied global value of one fragment (sync rank; owns ``tensors``)."""

    fragment: int
    version: int
    round: int
    cut: bool
    tensors: Tensors
    arrival: int = 0
    """Which arrival of a value of this fragment it was (the data path's receive count): an
    install of it frees the anchors for received values only if no later value has begun."""
    commit_us: int = 0
    """The syncer's commit time of this version (BCAST ``commit_us``; 0: a cut, unknown)."""
    held: bool = False
    """A HELD notice (``tensors`` empty): the island's own value is this cut, bit for bit."""
    arrived: float = 0.0
    """Monotonic time (the connection's clock) its last part arrived; 0: unknown."""
    wire_nbytes: int | None = None
    """Payload bytes as received (a bf16 value may have landed upcast in fp32 anchors); None:
    the tensors' own bytes."""

    def data_bytes(self) -> int:
        """Payload bytes of this value as it came over the wire (the step log's ``data_bytes``)."""
        if self.wire_nbytes is not None:
            return self.wire_nbytes
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


class Value(msgspec.Struct, frozen=True):
    """A global value of one fragment: staged now, or installed (written into the masters)."""

    fragment: int
    version: int
    round: int
    cut: bool
    """A cut (initial, rejoin): installed as it is, and it resets the fragment's round floor."""
    commit_us: int = 0
    """The syncer's commit time of this version, microseconds (0: a cut, or unknown)."""
    held: bool = False
    """A cut the island already holds (HELD): every rank anchors its own masters, no bytes move."""
    arrived: float = 0.0
    """Monotonic time on the sync rank's clock its last part arrived (0: unknown, or a HELD)."""


class PushOrder(msgspec.Struct, frozen=True):
    """Snapshot fragment ``fragment`` now and push ``master − anchor`` answering this pull."""

    fragment: int
    round: int
    attempt: int


class Orders(msgspec.Struct):
    """One boundary's decisions, identical on every rank after the exchange."""

    applies: list[Value] = msgspec.field(default_factory=list)
    """Values to install, in this order, before any push. At a step boundary these are
    fragments already staged on every rank (background scatter done)."""

    stages: list[Value] = msgspec.field(default_factory=list)
    """Values whose background scatter to the ranks starts now (installed at a later boundary,
    by ``applies``)."""

    pushes: list[PushOrder] = msgspec.field(default_factory=list)
    """Pulls to answer: snapshot, then export and push in the background."""

    stale: list[int] = msgspec.field(default_factory=list)
    """Fragments whose outstanding push the syncer refused as ``stale_base`` (it missed a value):
    the value it resends is installed keeping the progress since that push's snapshot."""

    hold: bool = False
    """Synchronous rounds (``YETO_DILOCO_SYNC_ROUNDS``): run another boundary before the next
    step, because the round this step opened is not installed yet."""

    init: bool = False
    """Start-up only: the syncer asked this island to stream INIT (of ``init_fragments``)."""

    init_fragments: list[int] = msgspec.field(default_factory=list)
    """Start-up only: the fragments whose INIT to stream (those the syncer holds no value of; after
    a redial, those it lost with the old connection)."""

    final: bool = False
    """Install the syncer's final cut (every fragment, fp32, unblended) and acknowledge it."""

    stop: str | None = None
    """Leave the loop (finalization done, or shutdown)."""

    error: str | None = None
    """Raise this on every rank: the sync rank hit something fatal (refusal, timeout)."""

    def is_idle(self) -> bool:
        """Nothing to do: broadcast as an empty payload (the common case, one small broadcast)."""
        return not (self.applies or self.stages or self.pushes or self.stale or self.hold or self.init
                    or self.init_fragments or self.final
                    or self.stop or self.error)

    def to_json(self) -> bytes:
        """The JSON bytes broadcast to the other ranks (named fields; never pickle)."""
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, raw: bytes) -> Orders:
        """Parse what :meth:`to_json` wrote; raises ``msgspec.ValidationError`` on a field of the
        wrong type or an unknown shape."""
        return msgspec.json.decode(raw, type=cls)

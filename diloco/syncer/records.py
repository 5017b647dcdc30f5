"""Plain records the syncer state machine keeps: islands, fragments, rounds, outputs.

Kept apart from ``state.py`` so the transition logic reads as protocol rules and
these classes read as the data the rules touch. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# (name, dtype name, shape) of one tensor of a fragment, in the plan's order.
TensorSpec = tuple[str, str, tuple[int, ...]]


@dataclass
class Ledger:
    """What an island contributed: merged pushes, local steps and tokens behind them."""

    merges: int = 0
    steps: int = 0
    tokens: int = 0

    def to_json(self) -> dict[str, int]:
        return {"merges": self.merges, "steps": self.steps, "tokens": self.tokens}


@dataclass
class IslandRecord:
    """One island's binding and progress.

    ``generation`` and ``peer`` change together at HELLO; every other message
    must carry the current generation. ``cut_sent`` is per generation: a
    reconnect (or a revival after being declared dead) clears it so the island
    receives the full current cut again before it is asked to push.
    """

    island: int
    generation: int = -1
    peer: bytes = b""
    wire_dtype: str = "float32"
    bound: bool = False
    joined: bool = False
    """Said HELLO at least once to this syncer instance (never reset)."""
    alive: bool = False
    last_step: int = 0
    done: bool = False
    last_seen: float = 0.0
    cut_sent: bool = False
    final_acked: bool = False
    retired_generations: set[int] = field(default_factory=set)
    ledger: Ledger = field(default_factory=Ledger)


@dataclass
class FragmentRecord:
    """Global fp32 value, outer momentum and version of one fragment.

    ``published`` is an immutable clone of ``values`` at ``version``: outgoing
    BCAST/FINAL frames may be zero-copy views of it that zmq still holds after
    the next commit has updated ``values`` in place.
    """

    index: int
    schema: tuple[TensorSpec, ...] = ()
    values: list[torch.Tensor] = field(default_factory=list)
    momentum: list[torch.Tensor] = field(default_factory=list)
    published: list[torch.Tensor] = field(default_factory=list)
    version: int = 0

    @property
    def initialised(self) -> bool:
        return bool(self.values)

    def named_published(self) -> list[tuple[str, torch.Tensor]]:
        return [(spec[0], t) for spec, t in zip(self.schema, self.published)]


@dataclass
class PushRecord:
    """An accepted push, held with its decoded delta tensors until commit."""

    island: int
    base_version: int
    local_steps: int
    tokens: int
    deltas: list[torch.Tensor]


@dataclass
class RoundRecord:
    """An open round: its fragment, current attempt, frozen members and pushes.

    ``closed`` means the quorum rule fired; the round then waits for every
    earlier round to commit (commits are strictly in round order).
    """

    round: int
    fragment: int
    attempt: int
    members: frozenset[int]
    attempt_started: float
    pushes: dict[int, PushRecord] = field(default_factory=dict)
    grace_deadline: float | None = None
    closed: bool = False


@dataclass(frozen=True)
class Outgoing:
    """One message the loop must send.

    Attributes:
        peer: zmq routing id of the receiver.
        header: a ``diloco.wire`` header struct.
        tensors: ``(name, tensor)`` pairs; never mutated after being handed out.
        wire_dtype: dtype to encode tensors in (None: as they are).
        cache_key: equal keys mean byte-identical frames, so the loop encodes
            once and reuses the frames for every island (BCAST, FINAL).
    """

    peer: bytes
    header: Any
    tensors: tuple[tuple[str, torch.Tensor], ...] = ()
    wire_dtype: str | None = None
    cache_key: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class FragmentSnapshot:
    """Checkpointable state of one fragment (tensors are references, not copies)."""

    version: int
    schema: tuple[TensorSpec, ...]
    values: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Snapshot:
    """Everything a checkpoint holds (see docs/PROTOCOL.md, "Checkpoint").

    Attributes:
        fingerprint: layout fingerprint fixed by the first HELLO.
        n_fragments: number of fragments of the plan.
        fragments: per fragment version, schema, value and momentum.
        next_round: the first round not yet committed; resumes start there.
        ledgers: per island id, its ledger as a dict.
        hyper: outer hyper-parameters and weighting, for the record.
    """

    fingerprint: str
    n_fragments: int
    fragments: tuple[FragmentSnapshot, ...]
    next_round: int
    ledgers: dict[int, dict[str, int]]
    hyper: dict[str, Any]

"""Orders: what the sync rank tells every rank of its island to do at one boundary.

Only the sync rank talks to the syncer, but applies and exports are collectives: every
rank must run the same ones in the same order, or the island deadlocks. So the sync rank
decides, encodes the decision as :class:`Orders`, and broadcasts it over the island's CPU
group; every rank then executes exactly that list.

The broadcast is two-step so that an idle boundary costs one 16-byte broadcast: a fixed
``int64[2]`` header ``(payload length, 0)`` and, only when the length is non-zero, the JSON
payload as a ``uint8`` tensor. JSON, not pickle: the payload is plain numbers and strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from diloco.layout.base import group_rank

_MAX_ORDERS_BYTES = 1 << 20


@dataclass
class Orders:
    """One boundary's decisions, identical on every rank after :func:`broadcast_orders`."""

    applies: list[tuple[int, int, int, bool]] = field(default_factory=list)
    """(fragment, version, round, cut) to install, in this order, before any push. At a step
    boundary these are fragments already staged on every rank (background scatter done)."""

    stages: list[tuple[int, int, int, bool]] = field(default_factory=list)
    """(fragment, version, round, cut) whose global value the background starts scattering
    to the ranks now (installed at a later boundary, by ``applies``)."""

    pushes: list[tuple[int, int, int]] = field(default_factory=list)
    """(fragment, round, attempt) to export and push."""

    stale: list[int] = field(default_factory=list)
    """Fragments whose outstanding push the syncer refused as ``stale_base`` (it missed a value):
    the value it resends is installed keeping the progress since that push's snapshot."""

    hold: bool = False
    """Synchronous rounds (``YETO_DILOCO_SYNC_ROUNDS``): run another boundary before the next
    step, because the round this step opened is not installed yet."""

    init: bool = False
    """Start-up only: the syncer asked this island to stream INIT."""

    final: bool = False
    """Install the syncer's final cut (every fragment, fp32, unblended) and acknowledge it."""

    stop: str | None = None
    """Leave the loop (finalization done, or shutdown)."""

    error: str | None = None
    """Raise this on every rank: the sync rank hit something fatal (refusal, timeout)."""

    def is_idle(self) -> bool:
        """Nothing to do: broadcast as an empty payload (the common case, one small broadcast)."""
        return not (self.applies or self.stages or self.pushes or self.stale or self.hold or self.init or self.final
                    or self.stop or self.error)

    def to_json(self) -> bytes:
        """The JSON bytes broadcast to the other ranks (never pickle)."""
        return json.dumps({"a": self.applies, "g": self.stages, "p": self.pushes, "t": self.stale, "h": self.hold,
                           "i": self.init, "f": self.final, "s": self.stop, "e": self.error}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Orders:
        """Parse what :meth:`to_json` wrote, converting every field to its type."""
        d = json.loads(raw)
        return cls(applies=[(int(f), int(v), int(r), bool(c)) for f, v, r, c in d["a"]],
                   stages=[(int(f), int(v), int(r), bool(c)) for f, v, r, c in d["g"]],
                   pushes=[(int(f), int(r), int(a)) for f, r, a in d["p"]],
                   stale=[int(f) for f in d.get("t", [])], hold=bool(d.get("h", False)),
                   init=bool(d["i"]), final=bool(d["f"]), stop=d["s"], error=d["e"])


@dataclass(frozen=True)
class Status:
    """What every rank learns about the background worker at one exchange (identical everywhere)."""

    done_everywhere: int
    """Highest background job number completed on every rank."""
    failed_rank: int
    """Highest rank whose background worker reported a failure; -1 when none did."""


def exchange_orders(orders: Orders | None, group: dist.ProcessGroup, src: int, done: int,
                    failed: bool) -> tuple[Orders, Status]:
    """Like :func:`broadcast_orders`, and agree on the background workers' state, in one
    all-reduce of an ``int64[4]`` header (an idle boundary costs that one small collective).

    Every field is reduced with MAX: ``(payload length, -done, failed rank + 1, 0)``, where
    only ``src`` contributes a length, so MAX of ``-done`` is ``-min(done)``.
    """
    me = group_rank(group)
    is_src = me == src
    head = torch.zeros(4, dtype=torch.int64)
    payload = _payload(orders) if is_src else b""
    head[0] = len(payload)
    head[1] = -done
    head[2] = me + 1 if failed else 0
    dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    status = Status(done_everywhere=-int(head[1]), failed_rank=int(head[2]) - 1)
    n = int(head[0])
    if n == 0:
        return Orders(), status
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_src else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, group=group, group_src=src)
    out = orders if is_src and orders is not None else Orders.from_json(buf.numpy().tobytes())
    return out, status


def _payload(orders: Orders | None) -> bytes:
    """The JSON of the source's orders (empty when idle), bounded."""
    assert orders is not None
    if orders.is_idle():
        return b""
    payload = orders.to_json()
    if len(payload) > _MAX_ORDERS_BYTES:
        raise ValueError(f"orders of {len(payload)} bytes exceed {_MAX_ORDERS_BYTES}")
    return payload


def broadcast_orders(orders: Orders | None, group: dist.ProcessGroup, src: int) -> Orders:
    """Send ``orders`` from group rank ``src`` to every rank of ``group``; return them everywhere.

    ``orders`` is only read on ``src``. Idle orders cost one small broadcast.
    """
    is_src = group_rank(group) == src
    head = torch.zeros(2, dtype=torch.int64)
    payload = _payload(orders) if is_src else b""
    head[0] = len(payload)
    dist.broadcast(head, group=group, group_src=src)
    n = int(head[0])
    if n == 0:
        return Orders()
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_src else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, group=group, group_src=src)
    return orders if is_src and orders is not None else Orders.from_json(buf.numpy().tobytes())

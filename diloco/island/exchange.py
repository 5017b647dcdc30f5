"""The collectives that carry :class:`~diloco.island.orders.Orders` from the sync rank to every
rank of its island (the island's CPU group).

Only the sync rank talks to the syncer, but applies and exports are collectives: every rank
must run the same ones in the same order, or the island deadlocks. So the sync rank decides,
and these functions hand its decision to every rank.

An idle boundary costs one small collective: a fixed ``int64`` header whose first field is the
payload length and, only when it is non-zero, the JSON payload as a ``uint8`` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from diloco.island.orders import Orders
from diloco.layout.base import group_rank

_MAX_ORDERS_BYTES = 1 << 20


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


def agree_status(group: dist.ProcessGroup, done: int, failed: bool) -> Status:
    """The background workers' state alone, agreed by every rank (one all-reduce of an
    ``int64[2]``, nothing on a one-rank group): called before the sync rank decides, so that a
    job finished since the last exchange counts at this boundary rather than the next. Every
    rank must call it at the same boundaries (the caller's condition is one all ranks share)."""
    me = group_rank(group)
    if dist.get_world_size(group) == 1:
        return Status(done_everywhere=done, failed_rank=me if failed else -1)
    head = torch.tensor([-done, me + 1 if failed else 0], dtype=torch.int64)
    dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    return Status(done_everywhere=-int(head[0]), failed_rank=int(head[1]) - 1)


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

"""The layout adapter interface: how one rank's parameters map onto canonical global tensors.

The syncer and the wire speak *canonical* tensors: one fp32 tensor per
parameter, named with global layer / expert indices and shaped as if there
were no model parallelism (true vocabulary size, no padding). An island holds
those tensors cut up by its own layout. A `LayoutAdapter` tells the transfer
module (`diloco.island.transfer`), per rank, which *pieces* of which canonical
tensors it owns and how each piece maps into the global tensor, so export
(gather to the sync rank) and apply (scatter from it) need no knowledge of the
training stack.

The mapping of one piece, in two steps:

1. **Shard** (TP / expert-TP): the local tensor (`local_shape`) is shard
   `shard_rank` of `shard_count` of the global tensor along `partition_dim`
   with `partition_stride` (megatron's convention: the global dimension is cut
   into `stride` equal parts, e.g. SwiGLU's [all gate ; all up]; each part into
   `shard_count` chunks; the shard is the concatenation of chunk `shard_rank`
   of every part: [gate_r ; up_r]). Fused QKV is stride 1 (query groups are
   contiguous). `partition_dim == -1` means replicated (the local tensor is the
   whole global tensor). PP stage and EP expert are already resolved in the
   canonical name; several ranks holding the same shard (TP-replicated
   layernorms, DP replicas without a distributed optimizer, the tied output
   copy on the last PP stage) are *replicas*: export takes one, apply writes
   all.
2. **Range**: the piece covers elements `[start, end)` of the flattened local
   tensor; `master` is that range as a 1-D fp32 tensor, writable in place (the
   distributed optimizer's fp32 master shard, the mixed-precision optimizer's
   fp32 master, or the parameter itself when it is fp32 with no separate
   master). A distributed optimizer splits one parameter across DP ranks.

**Padding**: when the shard's rows go past the canonical dim-0 size (megatron
pads the vocabulary to a multiple of 128 * TP), the extra rows exist only
locally: export drops them and apply never touches them. Only dim-0 padding
with stride 1 is supported (that is what megatron does).

Lifecycle: build the adapter on every rank of the island (its constructor may
be collective), read `specs()` and `local_pieces()`, write masters through the
transfer module, then call `refresh_model_params()` (collective) so the model
copy (e.g. bf16) and the DP replicas follow the masters in place.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParamSpec:
    """One canonical parameter: global name and GLOBAL shape; its value is always fp32."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the fp32 canonical tensor."""
        return 4 * self.numel


@dataclass(frozen=True)
class ShardInfo:
    """How a rank's local tensor is cut out of the global tensor (see the module docstring)."""

    local_shape: tuple[int, ...]
    partition_dim: int = -1
    """Dimension split across shards; -1 for a replicated tensor."""
    partition_stride: int = 1
    """megatron's partition_stride (2 for SwiGLU linear_fc1)."""
    shard_rank: int = 0
    shard_count: int = 1

    def key(self) -> tuple[int, int, int]:
        """Identity of the shard: ranks with equal keys for a name hold replicas."""
        if self.partition_dim < 0:
            return (-1, 0, 1)
        return (self.partition_dim, self.shard_rank, self.shard_count)

    @property
    def local_numel(self) -> int:
        """Elements of the local (possibly padded) tensor."""
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def valid_numel(self, global_shape: tuple[int, ...]) -> int:
        """Elements of the flattened local tensor that exist in the canonical tensor (padding excluded).

        Padding rows are always at the end of the flattened shard (dim-0 padding), so the
        valid part is the prefix `[0, valid_numel)`.
        """
        rows_local = self.local_shape[0] if self.local_shape else 1
        row_numel = self.local_numel // max(rows_local, 1) if self.local_shape else 1
        if not self.local_shape:
            return 1
        if self.partition_dim == 0:
            first = self.shard_rank * rows_local
            valid_rows = max(0, min(rows_local, global_shape[0] - first))
        else:
            valid_rows = min(rows_local, global_shape[0])
        return valid_rows * row_numel

    def padded(self, global_shape: tuple[int, ...]) -> bool:
        """Whether the local tensor has rows the canonical tensor lacks (megatron's vocab padding)."""
        return self.valid_numel(global_shape) != self.local_numel


@dataclass(frozen=True)
class LocalPiece:
    """A range of one local tensor that this rank owns, and the fp32 tensor holding it."""

    name: str
    shard: ShardInfo
    start: int
    end: int
    master: torch.Tensor
    """1-D fp32 tensor of `end - start` elements, written in place by apply."""

    def describe(self) -> dict[str, Any]:
        """JSON-able description (everything but the tensor), what other ranks route on."""
        s = self.shard
        return {
            "name": self.name,
            "local_shape": list(s.local_shape),
            "dim": s.partition_dim,
            "stride": s.partition_stride,
            "srank": s.shard_rank,
            "scount": s.shard_count,
            "start": self.start,
            "end": self.end,
        }


def shard_from_description(d: dict[str, Any]) -> ShardInfo:
    """Inverse of :meth:`LocalPiece.describe` for the shard part (what other ranks route on)."""
    return ShardInfo(
        local_shape=tuple(int(x) for x in d["local_shape"]),
        partition_dim=int(d["dim"]),
        partition_stride=int(d["stride"]),
        shard_rank=int(d["srank"]),
        shard_count=int(d["scount"]),
    )


class LayoutAdapter(abc.ABC):
    """Interface between the island's sync core and a training stack (see the module docstring).

    A subclass's constructor (collective) sets ``_group``, ``_specs`` and ``_pieces``; the
    accessors below serve them, and the subclass implements the model-copy refresh.
    """

    _group: dist.ProcessGroup
    _specs: dict[str, ParamSpec]
    _pieces: list[LocalPiece]

    @property
    def group(self) -> dist.ProcessGroup:
        """The island's CPU (gloo) group the adapter's collectives run on."""
        return self._group

    def specs(self) -> dict[str, ParamSpec]:
        """The canonical table: every parameter of the island; identical on every rank."""
        return dict(self._specs)

    def local_pieces(self) -> list[LocalPiece]:
        """The pieces this rank owns (possibly none), in a deterministic order."""
        return list(self._pieces)

    @abc.abstractmethod
    def refresh_model_params(self, names: Collection[str] | None = None) -> None:
        """Collective: after masters were written, bring the model copy (and DP replicas) up to date in place.

        ``names`` (canonical) limits the DP traffic to what changed — the parameters of the
        fragments just applied; None refreshes everything. Every rank passes the same names.
        """


def world_group() -> dist.ProcessGroup:
    """The default group (typed: ``dist.group.WORLD`` is Optional to type checkers)."""
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("torch.distributed is not initialised")
    return world


def island_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The island's CPU group: ``group`` if given, else the default group, else a private one.

    A one-process island (a notebook, a test, a plain training script) should not have to
    call ``init_process_group``: when torch.distributed is not initialised this returns a
    private 1-rank gloo group over an in-memory store. It is not registered as the default
    group, so a program that initialises torch.distributed later is not disturbed. Our
    collectives on it are no-ops in effect (one rank), but they run the same code path as a
    real island.
    """
    if group is not None:
        return group
    if dist.is_initialized():
        return world_group()
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(minutes=5))


def group_rank(group: dist.ProcessGroup) -> int:
    """This process's rank in ``group``; works for the private group of :func:`island_group`
    too (``dist.get_rank`` needs a registered group and a default group)."""
    return int(group.rank())


def all_gather_json(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """All-gather a JSON-able object from every rank (group rank order), without pickle.

    Two collectives: lengths (int64), then the UTF-8 bytes padded to the
    longest as uint8 tensors. Every rank must call it.
    """
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64)
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    longest = max(int(x.item()) for x in lens)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return [json.loads(bytes(o[: int(l.item())].tolist())) for o, l in zip(outs, lens)]


def merge_specs(per_rank: list[list[list[Any]]]) -> dict[str, ParamSpec]:
    """Union of every rank's [name, shape] lists, checked for agreement, in sorted canonical order."""
    table: dict[str, tuple[int, ...]] = {}
    for rank, items in enumerate(per_rank):
        for name, shape in items:
            shape_t = tuple(int(x) for x in shape)
            old = table.setdefault(name, shape_t)
            if old != shape_t:
                raise ValueError(f"rank {rank} reports {name} with global shape {shape_t}, another rank {old}")
    return {n: ParamSpec(n, table[n]) for n in sorted(table, key=natural_key)}


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders 'layers.10' after 'layers.9'."""
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


# ---------------------------------------------------------------------------
# Shard <-> global conversions (pure tensor code, used by the transfer module)
# ---------------------------------------------------------------------------


def _part_slices(shard: ShardInfo, global_dim: int) -> list[tuple[int, int, int]]:
    """(global offset, local offset, length) along partition_dim for each stride part."""
    s = shard.partition_stride
    part = global_dim // s
    chunk = part // shard.shard_count
    return [(k * part + shard.shard_rank * chunk, k * chunk, chunk) for k in range(s)]


def shard_of_global(global_t: torch.Tensor, shard: ShardInfo) -> torch.Tensor:
    """The valid part of this shard, flattened (1-D, contiguous), taken from the canonical tensor."""
    g_shape = tuple(global_t.shape)
    if shard.partition_dim < 0:
        return global_t.reshape(-1)
    d = shard.partition_dim
    if shard.padded(g_shape):
        rows = shard.local_shape[0]
        first = shard.shard_rank * rows
        n_valid = shard.valid_numel(g_shape) // max(shard.local_numel // rows, 1)
        return global_t[first : first + n_valid].reshape(-1)
    if shard.partition_stride == 1:
        chunk = shard.local_shape[d]
        return global_t.narrow(d, shard.shard_rank * chunk, chunk).contiguous().view(-1)
    parts = [global_t.narrow(d, g0, n) for g0, _, n in _part_slices(shard, g_shape[d])]
    return torch.cat(parts, dim=d).view(-1)


def place_shard(global_t: torch.Tensor, shard: ShardInfo, flat_valid: torch.Tensor) -> None:
    """Inverse of shard_of_global: write the shard's valid elements into the canonical tensor."""
    g_shape = tuple(global_t.shape)
    if shard.partition_dim < 0:
        global_t.view(-1).copy_(flat_valid)
        return
    d = shard.partition_dim
    if shard.padded(g_shape):
        rows = shard.local_shape[0]
        row_numel = shard.local_numel // rows
        first = shard.shard_rank * rows
        n_valid = flat_valid.numel() // row_numel
        global_t[first : first + n_valid].copy_(flat_valid.view(n_valid, *shard.local_shape[1:]))
        return
    local = flat_valid.view(shard.local_shape)
    for g0, l0, n in _part_slices(shard, g_shape[d]):
        global_t.narrow(d, g0, n).copy_(local.narrow(d, l0, n))


def global_shape_of(shard: ShardInfo, dim0_override: int | None = None) -> tuple[int, ...]:
    """Global shape implied by a shard (dim 0 replaced by the true size for padded tensors)."""
    shape = list(shard.local_shape)
    if shard.partition_dim >= 0:
        shape[shard.partition_dim] *= shard.shard_count
    if dim0_override is not None and shape:
        shape[0] = dim0_override
    return tuple(shape)

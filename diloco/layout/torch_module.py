"""Layout adapter for a plain torch module with no model parallelism (tests, demo fallback).

Every rank of a DP-only island holds every parameter in full; the parameter
is its own fp32 master (optimizers such as torch.optim.AdamW keep no separate
copy). Export reads rank 0's copy (the transfer module prefers the sync rank
among replicas); apply writes every rank's copy in place, so optimizer state
and hooks keep pointing at the same tensors.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist

from diloco.layout.base import LayoutAdapter, LocalPiece, ShardInfo, all_gather_json, world_group, merge_specs


class TorchLayout(LayoutAdapter):
    """Adapter over one torch module, replicated on every rank of `group`; build it on every rank (collective).

    Args:
        module: the model; canonical names are its `named_parameters()` names.
        optimizer: unused (kept so callers can pass what they have); the params must be fp32.
        group: the island's CPU group (default: the default group).
    """

    def __init__(
        self, module: torch.nn.Module, optimizer: Any = None, group: dist.ProcessGroup | None = None
    ) -> None:
        self._group = group if group is not None else world_group()
        self._module = module
        pieces: list[LocalPiece] = []
        for name, p in module.named_parameters():
            if p.dtype != torch.float32:
                raise TypeError(f"TorchLayout needs fp32 params (the param is the master); {name} is {p.dtype}")
            if not p.is_contiguous():
                raise ValueError(f"TorchLayout needs contiguous params; {name} is not")
            shard = ShardInfo(local_shape=tuple(p.shape))
            pieces.append(LocalPiece(name=name, shard=shard, start=0, end=p.numel(), master=p.data.view(-1)))
        per_rank = all_gather_json(sorted([pc.name, list(pc.shard.local_shape)] for pc in pieces), self._group)
        if any(r != per_rank[0] for r in per_rank):
            raise ValueError("TorchLayout: ranks hold different modules (names or shapes differ)")
        self._specs = merge_specs(per_rank)
        self._pieces = pieces

    def refresh_model_params(self, names: Collection[str] | None = None) -> None:
        """Nothing to do: the masters are the params, written in place."""

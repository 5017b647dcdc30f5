"""Layout adapter for a plain torch module with no model parallelism (plain PyTorch loops, tests).

Every rank of a DP-only island holds every parameter in full; the parameter
is its own fp32 master (optimizers such as torch.optim.AdamW keep no separate
copy). Export reads rank 0's copy (the transfer module prefers the sync rank
among replicas); apply writes every rank's copy in place, so optimizer state
and hooks keep pointing at the same tensors.

A one-process island needs no ``init_process_group``: without a default group the
adapter makes a private 1-rank gloo group (:func:`diloco.layout.base.island_group`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist

from diloco.layout.base import LayoutAdapter, LocalPiece, ShardInfo, all_gather_json, island_group, merge_specs


class TorchLayout(LayoutAdapter):
    """Adapter over one torch module, replicated on every rank of `group`; build it on every rank (collective).

    Args:
        module: the model; canonical names are its `named_parameters()` names.
        optimizer: the optimizer stepping the module (optional). When given, it is checked to
            step exactly the module's own parameter tensors: an optimizer built over a copy
            (or another module) would never see the merged values the island writes, and
            training would silently diverge from the syncer. The params must be fp32.
        group: the island's CPU group (default: the default group if torch.distributed is
            initialised, else a private 1-rank gloo group).
    """

    def __init__(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._group = island_group(group)
        self._module = module
        pieces: list[LocalPiece] = []
        for name, p in module.named_parameters():
            if p.dtype != torch.float32:
                raise TypeError(f"TorchLayout needs fp32 params (the param is the master); {name} is {p.dtype}")
            if not p.is_contiguous():
                raise ValueError(f"TorchLayout needs contiguous params; {name} is not")
            shard = ShardInfo(local_shape=tuple(p.shape))
            pieces.append(LocalPiece(name=name, shard=shard, start=0, end=p.numel(), master=p.data.view(-1)))
        if optimizer is not None:
            _check_optimizer(module, optimizer)
        per_rank = all_gather_json(sorted([pc.name, list(pc.shard.local_shape)] for pc in pieces), self._group)
        if any(r != per_rank[0] for r in per_rank):
            raise ValueError("TorchLayout: ranks hold different modules (names or shapes differ)")
        self._specs = merge_specs(per_rank)
        self._pieces = pieces

    def refresh_model_params(self, names: Collection[str] | None = None) -> None:
        """Nothing to do: the masters are the params, written in place."""


def _check_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that steps tensors the module does not hold (see TorchLayout)."""
    own = {id(p) for p in module.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in own:
                raise ValueError(f"TorchLayout: the optimizer's param_groups[{g}]['params'][{i}] (shape "
                                 f"{tuple(p.shape)}) is not a parameter of the module: build the optimizer over "
                                 "module.parameters(), or the island's merged values never reach it")

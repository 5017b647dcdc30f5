"""Layout adapter for megatron-core models (GPTModel chunks wrapped in DDP, megatron optimizers).

megatron-core is imported lazily, inside this module only, so the rest of the
sync core runs without it. The adapter reads what megatron already records:
TP metadata on each parameter (`tensor_model_parallel`, `partition_dim`,
`partition_stride`), global layer numbers on the transformer layers, local
expert offsets from the EP rank, the tied output copy (`shared_embedding`)
on the last PP stage, and the optimizer's fp32 masters (distributed-optimizer
ranges, mixed-precision fp32 copies, or the fp32 params themselves).

Canonical names are GPTModel parameter names with global indices:
`decoder.layers.{global layer}.…`, `….mlp.experts.local_experts.{global expert}.…`;
the tied output copy maps to `embedding.word_embeddings.weight`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist

from diloco.layout.base import (
    world_group,
    LayoutAdapter,
    LocalPiece,
    ShardInfo,
    all_gather_json,
    global_shape_of,
    merge_specs,
)

log = logging.getLogger(__name__)

_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers down to the GPTModel."""
    while hasattr(m, "module") and isinstance(getattr(m, "module"), torch.nn.Module):
        m = m.module  # type: ignore[assignment]
    return m


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class MegatronLayout(LayoutAdapter):
    """Adapter over megatron model chunks and their optimizer; build it on every rank (collective).

    Args:
        model_chunks: the DDP-wrapped model chunks (a list; virtual PP gives several).
        optimizer: the megatron optimizer (ChainedOptimizer or a single one).
        vocab_size: the TRUE vocabulary size (before megatron's padding), so islands with
            different TP agree on the canonical shape. None: the model's size is not padded.
        group: the island's CPU group (default: the default group). The canonical table is
            all-gathered over it as JSON bytes, so every rank ends with the same table.
    """

    def __init__(
        self,
        model_chunks: list[torch.nn.Module],
        optimizer: Any,
        vocab_size: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        self._group = group if group is not None else world_group()
        self._chunks = list(model_chunks)
        self._optimizer = optimizer
        masters = self._master_map()
        tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
        etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
        ep_rank = ps.get_expert_model_parallel_rank()
        pieces: list[LocalPiece] = []
        local_specs: dict[str, tuple[int, ...]] = {}
        self._param_ids: dict[str, set[int]] = {}
        """Canonical name -> ids of this rank's model params holding it (tied copies included)."""
        for chunk in self._chunks:
            gpt = _unwrap(chunk)
            layer_offsets = self._layer_numbers(gpt)
            local_experts = self._num_local_experts(gpt)
            for pname, p in gpt.named_parameters():
                name = self._canonical(pname, p, layer_offsets, local_experts, ep_rank)
                self._param_ids.setdefault(name, set()).add(id(p))
                is_expert = getattr(p, "allreduce", True) is False
                if getattr(p, "tensor_model_parallel", False):
                    srank, scount = etp if is_expert else tp
                    shard = ShardInfo(
                        local_shape=tuple(p.shape),
                        partition_dim=int(getattr(p, "partition_dim")),  # megatron's TP metadata
                        partition_stride=int(getattr(p, "partition_stride", 1)),
                        shard_rank=srank,
                        shard_count=scount,
                    )
                else:
                    shard = ShardInfo(local_shape=tuple(p.shape))
                dim0 = vocab_size if (name in _VOCAB_PARAMS and vocab_size is not None) else None
                local_specs[name] = global_shape_of(shard, dim0)
                entry = masters.get(id(p))
                if entry is None:
                    continue  # this DP rank owns no part of p's master
                master, start, end = entry
                pieces.append(LocalPiece(name=name, shard=shard, start=start, end=end, master=master))
        per_rank = all_gather_json(sorted([n, list(s)] for n, s in local_specs.items()), self._group)
        self._specs = merge_specs(per_rank)
        self._pieces = pieces
        log.debug("MegatronLayout: %d canonical params, %d local pieces", len(self._specs), len(pieces))

    # -- discovery ---------------------------------------------------------

    @staticmethod
    def _layer_numbers(gpt: torch.nn.Module) -> dict[int, int]:
        """Stage-local layer index -> global 0-based layer index."""
        out: dict[int, int] = {}
        decoder = getattr(gpt, "decoder", None)
        for i, layer in enumerate(getattr(decoder, "layers", [])):
            out[i] = int(layer.layer_number) - 1
        return out

    @staticmethod
    def _num_local_experts(gpt: torch.nn.Module) -> int:
        for m in gpt.modules():
            n = getattr(m, "num_local_experts", None)
            if n is not None and hasattr(m, "local_experts"):
                return int(n)
        return 0

    @staticmethod
    def _canonical(
        pname: str, p: torch.nn.Parameter, layers: dict[int, int], local_experts: int, ep_rank: int
    ) -> str:
        if pname == "output_layer.weight" and getattr(p, "shared_embedding", False):
            return "embedding.word_embeddings.weight"
        m = _LAYER_RE.match(pname)
        if m:
            pname = f"decoder.layers.{layers[int(m.group(1))]}.{m.group(2)}"
        e = _EXPERT_RE.match(pname)
        if e:
            pname = f"{e.group(1)}{ep_rank * local_experts + int(e.group(2))}{e.group(3)}"
        return pname

    def _master_map(self) -> dict[int, tuple[torch.Tensor, int, int]]:
        """id(model param) -> (1-D fp32 master, start, end) for the part this rank owns."""
        out: dict[int, tuple[torch.Tensor, int, int]] = {}
        for sub in _sub_optimizers(self._optimizer):
            if hasattr(sub, "model_param_gbuf_map"):  # DistributedOptimizer
                pairs = list(zip(sub.model_float16_groups, sub.shard_fp32_from_float16_groups))
                pairs += list(zip(sub.model_fp32_groups, sub.shard_fp32_groups))
                for model_group, shard_group in pairs:
                    for p, shard in zip(model_group, shard_group):
                        r = sub._get_model_param_range_map(p)["param"]
                        if shard is None or r.end <= r.start:
                            continue
                        if shard.dtype != torch.float32 or shard.numel() != r.end - r.start:
                            raise TypeError(f"unexpected master shard for a param of shape {tuple(p.shape)}")
                        out[id(p)] = (shard.view(-1), int(r.start), int(r.end))
            elif hasattr(sub, "float16_groups"):  # mixed precision, full fp32 copy per rank
                for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                    for p, main in zip(model_group, main_group):
                        out[id(p)] = (main.data.view(-1), 0, p.numel())
                for group in sub.fp32_from_fp32_groups:
                    for p in group:
                        out[id(p)] = (p.data.view(-1), 0, p.numel())
            else:  # fp32 optimizer: the param is its own master
                for g in sub.param_groups:
                    for p in g["params"]:
                        out[id(p)] = (p.data.view(-1), 0, p.numel())
        return out

    # -- LayoutAdapter -----------------------------------------------------

    def refresh_model_params(self, names: Collection[str] | None = None) -> None:
        """Copy fp32 masters into the model params in place, then DP all-gather (distributed optimizer).

        Collective over the DP groups of every chunk: every rank of the island
        must call it at the same point (the transfer module does, after each apply).
        With ``names``, only the DDP bucket groups holding those parameters are
        all-gathered: one fragment's bytes instead of the whole model's, which is what
        matters when DP runs over slow links. DP peers hold the same buckets, so they
        make the same choice.
        """
        distributed = False
        for sub in _sub_optimizers(self._optimizer):
            if hasattr(sub, "model_param_gbuf_map"):
                distributed = True
                sub._copy_main_params_to_model_params()
            elif hasattr(sub, "float16_groups"):
                sub._copy_main_params_to_model_params()
        if distributed:
            # The model copy of a param is only written by its DP owner above;
            # the all-gather brings every DP rank's copy up to date in place.
            wanted = None if names is None else {i for n in names for i in self._param_ids.get(n, ())}
            for chunk in self._chunks:
                if wanted is None:
                    chunk.start_param_sync(force_sync=True)  # type: ignore[operator]
                    continue
                groups = list(getattr(chunk, "bucket_groups", [])) + list(
                    getattr(chunk, "expert_parallel_bucket_groups", []))
                for bucket_group in groups:
                    if any(id(p) in wanted for p in bucket_group.params):
                        bucket_group.start_param_sync(force_sync=True)

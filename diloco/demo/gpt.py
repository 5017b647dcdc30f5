"""The demo's model: a small megatron-core GPT (GPTModel + DDP + DistributedOptimizer) on CPU or GPU.

:class:`ModelSpec` describes the GPT, :func:`build_island_model` builds it on the ranks of the
current default process group with TP / PP / EP / DP (fused QKV, SwiGLU, padded vocab, tied
embeddings, distributed-optimizer shards), and :class:`BuiltModel` trains it one optimizer step
at a time. On ``device='cpu'`` the CPU patches (:mod:`diloco.demo.megatron_cpu`) are installed
first; ``device='cuda'`` builds on the current CUDA device with megatron's own RNG tracker.
The tests, examples and benchmarks use it as "an ordinary megatron job".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from diloco.demo.megatron_cpu import install_cpu_patches, seed_cpu_tracker

_VOCAB_DIVISOR = 128
"""Megatron-LM pads the vocabulary to a multiple of 128 * TP; we do the same so padding is exercised."""


@dataclass(frozen=True)
class ModelSpec:
    """A small GPT for CPU runs; every field maps onto a megatron TransformerConfig / GPTModel argument."""

    vocab: int = 100
    """True vocabulary size; the model pads it to a multiple of 128 * TP (canonical shapes use this value)."""
    hidden: int = 64
    """hidden_size."""
    layers: int = 2
    """num_layers (divisible by PP)."""
    heads: int = 4
    """num_attention_heads (divisible by TP)."""
    query_groups: int = 2
    """num_query_groups (GQA; divisible by TP)."""
    ffn: int = 128
    """ffn_hidden_size (divisible by TP)."""
    seq: int = 16
    """Sequence length of training batches and max_sequence_length."""
    swiglu: bool = True
    """gated_linear_unit with SiLU (linear_fc1 becomes [gate; up], partition_stride 2)."""
    tied_embeddings: bool = True
    """share_embeddings_and_output_weights (under PP the last stage holds a second copy)."""
    moe_experts: int = 0
    """num_moe_experts; 0 means a dense MLP."""
    dtype: str = "bf16"
    """'bf16' (bf16 model, fp32 master in the optimizer) or 'fp32'."""
    seed: int = 1234
    """torch seed before building; TP>1 reproduces TP=1 weights with the same seed (PP does not)."""
    micro_batch: int = 2
    """Micro-batch size used by train_step."""
    vocab_pad_to: int = 0
    """Pad the vocabulary to a multiple of this (divisible by TP); 0: megatron-LM's rule, 128 * TP.
    Init draws the whole padded table from the RNG, so a TP1 reference reproduces TP2 weights bit for
    bit only when both pad to the same size."""

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"ModelSpec.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.heads % self.query_groups:
            raise ValueError("ModelSpec.heads must be a multiple of query_groups")

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary size the model is built with under TP degree `tp`."""
        step = self.vocab_pad_to or _VOCAB_DIVISOR * tp
        if step % tp:
            raise ValueError(f"ModelSpec.vocab_pad_to={step} is not divisible by tp={tp}")
        return int(math.ceil(self.vocab / step) * step)


@dataclass
class BuiltModel:
    """What build_island_model returns; `train_step` runs one optimizer step on every rank."""

    spec: ModelSpec
    model: list[torch.nn.Module]
    """The DDP-wrapped chunks (what the schedule and refresh use)."""
    unwrapped: list[torch.nn.Module]
    """The GPTModel chunks inside (what a layout adapter walks)."""
    optimizer: Any
    """megatron ChainedOptimizer."""
    tp: int
    pp: int
    ep: int
    dp: int
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    """Where the model lives: 'cpu' (patched megatron) or 'cuda' (a real GPU run)."""

    def layout(self, group: dist.ProcessGroup | None = None) -> Any:
        """A MegatronLayout over this model (collective over `group`, default world)."""
        from diloco.layout.megatron import MegatronLayout

        return MegatronLayout(self.model, self.optimizer, vocab_size=self.spec.vocab, group=group)

    def make_batch(self, step: int, n_micro: int = 1) -> dict[str, torch.Tensor]:
        """Deterministic tokens for `step` (same on all ranks of the island; DP ranks offset by rank)."""
        from megatron.core import parallel_state as ps

        g = torch.Generator().manual_seed(self.spec.seed * 1000 + step * 17 + ps.get_data_parallel_rank())
        tokens = torch.randint(0, self.spec.vocab, (n_micro * self.spec.micro_batch, self.spec.seq + 1), generator=g)
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    def train_step(self, batch: dict[str, torch.Tensor] | None = None, n_micro: int = 1) -> float:
        """One forward/backward (megatron's schedule, PP-aware) and optimizer step; returns the mean loss.

        Collective over the whole world: the loss is summed over the PP group
        from the last stage so every rank returns the same value.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if batch is None:
            batch = self.make_batch(self.steps, n_micro)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        mb = self.spec.micro_batch
        seq = self.spec.seq
        micro = [
            {k: v[i * mb : (i + 1) * mb] for k, v in batch.items()} for i in range(n_micro)
        ]
        it = iter(micro)
        position_ids = torch.arange(seq, device=self.device).unsqueeze(0).expand(mb, seq)
        loss_mask = torch.ones(mb, seq, device=self.device)

        def loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = (output.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"loss": loss.detach()}

        def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
            data = next(data_iterator) if ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage() else None
            tokens = data["tokens"] if data is not None else None
            labels = data["labels"] if data is not None else None
            if data is None:
                next(data_iterator, None)
            out = model(tokens, position_ids, None, labels=labels)
            return out, lambda o: loss_func(loss_mask, o)

        for chunk in self.model:
            chunk.zero_grad_buffer()  # type: ignore[operator]
        self.optimizer.zero_grad()
        fwd_bwd = get_forward_backward_func()
        losses = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=it,
            model=self.model,
            num_microbatches=n_micro,
            seq_length=seq,
            micro_batch_size=mb,
            forward_only=False,
        )
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (inf/nan grads)")
        self.steps += 1
        value = 0.0
        if ps.is_pipeline_last_stage() and losses:
            value = float(sum(float(x["loss"]) for x in losses) / len(losses))
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        return float(t.item())


def build_island_model(
    spec: ModelSpec,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    use_distributed_optimizer: bool = True,
    lr: float = 1e-3,
    device: str = "cpu",
) -> BuiltModel:
    """Initialise model parallelism on the existing default group and build GPTModel + DDP + optimizer.

    Collective over the whole world. On ``device='cpu'`` calls `install_cpu_patches()`;
    ``device='cuda'`` builds on the current CUDA device with megatron's own RNG tracker (GPU
    runs of the demo and benchmarks). A second call in the same process tears the previous
    model-parallel state down first (the old model must not be used afterwards).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cpu":
        install_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    if not dist.is_initialized():
        raise RuntimeError("build_island_model needs an initialised default process group")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world {world} not divisible by tp*pp={tp * pp}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        create_gloo_process_groups=False,
    )
    if device == "cpu":
        seed_cpu_tracker(
            spec.seed,
            ps.get_tensor_model_parallel_rank(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank(),
        )
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(spec.seed)
        model_parallel_cuda_manual_seed(spec.seed)
    bf16 = spec.dtype == "bf16"
    cfg = TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        num_query_groups=spec.query_groups,
        ffn_hidden_size=spec.ffn,
        gated_linear_unit=spec.swiglu,
        activation_func=torch.nn.functional.silu if spec.swiglu else torch.nn.functional.gelu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=device == "cpu",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        num_moe_experts=spec.moe_experts or None,
        moe_router_topk=2 if spec.moe_experts else 2,
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.moe_experts or None, moe_grouped_gemm=False)
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab(tp),
        max_sequence_length=spec.seq,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
    )
    inner: torch.nn.Module = Float16Module(cfg, gpt) if bf16 else gpt
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=inner)
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        clip_grad=1.0,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False)
    return BuiltModel(
        spec=spec,
        model=[ddp],
        unwrapped=[gpt],
        optimizer=optimizer,
        tp=tp,
        pp=pp,
        ep=ep,
        dp=ps.get_data_parallel_world_size(),
        device=device,
    )

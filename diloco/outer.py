"""Outer optimizer: weighted mean of island deltas followed by an fp32 Nesterov step.

The syncer merges the deltas that islands pushed for one fragment and moves the
global value with Nesterov momentum (DiLoCo's outer optimizer). The arithmetic is
spelled out one operation at a time, in fp32, islands in increasing id order, so a
plain numpy reference reproduces it bit for bit (see docs/PROTOCOL.md, "Commit")::

    s = 0;  for i: s = s + (delta_i * w_i)        # delta upcast to fp32
    d = s / sum(w)
    g = -d
    m = mu * m + g
    value = value - lr * (g + mu * m)

Why blocks: the formula is ~16 element-wise passes; running all of them over one
cache-sized block before moving on keeps the work in cache instead of streaming
the fragment from memory 16 times (element-wise ops, so bit-identical).
Why no fused ops: ``add(alpha=...)``/``addcmul`` round once instead of twice and
would break the bitwise match with the reference. Why in place with preallocated
scratch: a fragment of a large model is gigabytes; every temporary is an
allocation plus a page-faulting pass over memory, and the merge is memory bound.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BLOCK_ELEMS = 1 << 16
"""Elements per cache block (256 KiB per fp32 buffer; the ~8 buffers of a block stay in L2)."""


@dataclass(frozen=True)
class OuterHyper:
    """Hyper-parameters of the outer Nesterov step.

    Attributes:
        lr: outer learning rate (``--outer-lr``), default 0.7 as in DiLoCo.
        momentum: Nesterov momentum ``mu`` (``--outer-momentum``), default 0.9.
    """

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not (self.lr > 0.0 and self.lr == self.lr and self.lr != float("inf")):
            raise ValueError(f"outer lr must be a finite positive number, got {self.lr}")
        if not (0.0 <= self.momentum < 1.0):
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")


class MergeScratch:
    """Two fp32 block buffers (accumulator, temporary) reused across commits.

    One instance per syncer is enough: commits run one at a time on the loop
    thread. Buffers grow to the largest block seen (``BLOCK_ELEMS``) and are
    then reused, so a steady-state commit allocates nothing.
    """

    def __init__(self) -> None:
        self._acc = torch.empty(0, dtype=torch.float32)
        self._tmp = torch.empty(0, dtype=torch.float32)

    def views(self, numel: int, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(acc, tmp)`` fp32 views of ``shape`` backed by the reusable buffers."""
        if self._acc.numel() < numel:
            # Grow both at once; the old buffers are released here, never mid-op.
            self._acc = torch.empty(numel, dtype=torch.float32)
            self._tmp = torch.empty(numel, dtype=torch.float32)
        return self._acc[:numel].view(shape), self._tmp[:numel].view(shape)


def merge_weights(
    tokens: Sequence[int], local_steps: Sequence[int], weighting: str
) -> list[int]:
    """Integer weights per push, per the protocol's weighting rules.

    ``tokens`` weighting uses each push's token count, falling back to equal
    weights when every count is 0; ``equal`` gives 1 each. Pushes that made no
    local step get weight 0 whatever the rule (their delta is stale by
    construction). Weights stay integers so their sum is exact before it is
    rounded to fp32 once.
    """
    if weighting not in ("tokens", "equal"):
        raise ValueError(f"unknown weighting {weighting!r}")
    if weighting == "tokens" and any(t > 0 for t in tokens):
        weights = [int(t) for t in tokens]
    else:
        weights = [1 for _ in tokens]
    return [0 if s == 0 else w for w, s in zip(weights, local_steps)]


def outer_step_tensor(
    value: torch.Tensor,
    momentum: torch.Tensor,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[int],
    hyper: OuterHyper,
    scratch: MergeScratch,
) -> bool:
    """Merge ``deltas`` into ``value`` and ``momentum`` in place (one tensor of a fragment).

    Args:
        value: fp32 global value, updated in place.
        momentum: fp32 outer momentum, same shape, updated in place.
        deltas: one delta per pushing island, in increasing island id order,
            fp32 or bf16 (upcast exactly to fp32 before the multiply).
        weights: integer weight per delta (see :func:`merge_weights`).
        hyper: outer lr and momentum.
        scratch: reusable fp32 buffers.

    Returns:
        False when every weight is 0 (nothing changed), else True.
    """
    if value.dtype != torch.float32 or momentum.dtype != torch.float32:
        raise TypeError("outer state must be fp32")
    if len(deltas) != len(weights):
        raise ValueError("one weight per delta")
    total = sum(int(w) for w in weights)
    if total == 0:
        return False
    for d in deltas:
        if d.shape != value.shape:
            raise ValueError(f"delta shape {tuple(d.shape)} != value shape {tuple(value.shape)}")
    if not (value.is_contiguous() and momentum.is_contiguous()):
        raise ValueError("outer state must be contiguous (it is updated in place through flat views)")
    flat_v, flat_m = value.view(-1), momentum.view(-1)
    flat_d = [d.reshape(-1) for d in deltas]
    n = flat_v.numel()
    # Cache blocking: every operation of the formula runs over one block before
    # the next block starts, so the block's bytes stay in cache across the ~16
    # passes instead of streaming the whole fragment from memory each time.
    # Element-wise ops on disjoint blocks give bit-identical results.
    for lo in range(0, n, BLOCK_ELEMS):
        hi = min(n, lo + BLOCK_ELEMS)
        acc, tmp = scratch.views(hi - lo, torch.Size([hi - lo]))
        _step_block(
            flat_v[lo:hi], flat_m[lo:hi], [d[lo:hi] for d in flat_d], weights, total, hyper, acc, tmp
        )
    return True


def _step_block(
    value: torch.Tensor,
    momentum: torch.Tensor,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[int],
    total: int,
    hyper: OuterHyper,
    acc: torch.Tensor,
    tmp: torch.Tensor,
) -> None:
    """The commit formula on one 1-D block, one operation at a time (see module docstring)."""
    first = True
    for delta, weight in zip(deltas, weights):
        if weight == 0:
            # delta * 0 adds only a signed zero; skipping it leaves s unchanged
            # (0 + x == x exactly), so the reference still matches.
            continue
        # The python scalar is rounded to fp32 by the kernel, like np.float32(w).
        w = float(weight)
        dst = acc if first else tmp
        if delta.dtype == torch.float32:
            torch.mul(delta, w, out=dst)
        else:
            # Upcast first: mul on bf16 would round the product to bf16.
            dst.copy_(delta)
            dst.mul_(w)
        if not first:
            acc.add_(tmp)
        first = False
    mu = float(hyper.momentum)
    lr = float(hyper.lr)
    acc.div_(float(total))  # d = s / sum(w)
    acc.neg_()  # g = -d
    momentum.mul_(mu)  # m = mu * m
    momentum.add_(acc)  # m = m + g
    torch.mul(momentum, mu, out=tmp)  # mu * m
    tmp.add_(acc)  # g + mu * m
    tmp.mul_(lr)  # lr * (...)
    value.sub_(tmp)  # value - lr * (...)


def outer_step(
    values: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    deltas_per_island: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[int],
    hyper: OuterHyper,
    scratch: MergeScratch,
) -> bool:
    """Apply :func:`outer_step_tensor` to every tensor of a fragment.

    ``deltas_per_island[i][j]`` is island ``i``'s delta for tensor ``j``; islands
    must already be sorted by id. Returns False when all weights are 0.
    """
    changed = False
    for j, (value, mom) in enumerate(zip(values, momenta)):
        changed = outer_step_tensor(
            value, mom, [d[j] for d in deltas_per_island], weights, hyper, scratch
        ) or changed
    return changed

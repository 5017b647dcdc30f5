"""The syncer's arithmetic on one part: fold a push into the running sum, and the outer step.

Both run on a data-plane worker over cache blocks of :data:`BLOCK` elements (512 KiB per fp32
buffer, so the three or four buffers of a block stay in L2), as numpy ufuncs on views of the
torch buffers: each call is one kernel that releases the GIL and costs about a microsecond to
dispatch, and each element is read from and written to memory once (block sizes and the
measurements behind them: docs/PERFORMANCE.md, session 10). Every operation is one fp32
operation (never a fused multiply-add) in the order of ``diloco.outer``'s formula, so a numpy
reference matches bit for bit. Floating-point warnings are silenced: an overflow is found by the
checks below, not reported by a warning on a worker thread.

Finiteness is checked with ``torch.aminmax`` (NaN and Inf propagate into it) or a norm bound
(:func:`magnitude_bound`), which also bound the largest magnitude of each pushed chunk: the
state keeps bounds of ``|sum|``,
``|value|`` and ``|momentum|`` per part, so it proves before a commit that the step cannot
overflow (``step_bounds``; then the commit checks nothing and may update the momentum in
place) or else has the commit measured (``check``). A sum reduced in float64 is no check to
use here: torch runs it at 0.7 GB/s on blocks of 1 Mi elements and more (fp32 reductions run at
15-25 GB/s).
"""

from __future__ import annotations

import math

import numpy as np
import torch

BLOCK = 1 << 17
"""Elements per cache block of the fold and of the commit (512 KiB per fp32 buffer)."""


class Scratch:
    """One fp32 buffer per worker, grown to the largest block seen (at most :data:`BLOCK`), then reused."""

    def __init__(self) -> None:
        self.arr = np.empty(0, dtype=np.float32)

    def array(self, n: int) -> np.ndarray:
        """The first ``n`` elements."""
        if self.arr.size < n:
            self.arr = np.empty(n, dtype=np.float32)
        return self.arr[:n]


def absmax(t: torch.Tensor) -> float:
    """``max |t|`` in one pass; ``inf`` when any element is NaN or infinite (0.0 when empty)."""
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t)
    a, b = float(lo), float(hi)
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return max(-a, b)


NORM_MARGIN = 1.01
"""Headroom over the chunk's L2 norm (the fp32 sum of non-negative squares is never below the largest square)."""
UNDERFLOW_SLACK = 1e-18
"""Covers elements whose fp32 squares underflow (``|x| < 1e-19``)."""


def magnitude_bound(t: torch.Tensor) -> float:
    """An upper bound of ``max |t|`` in one fast pass; ``inf`` when any element is NaN or infinite.

    For fp32: the chunk's L2 norm (``torch.dot``, about 5x faster than ``aminmax`` on a cache-hot
    block) times :data:`NORM_MARGIN`, plus :data:`UNDERFLOW_SLACK`; NaN and Inf propagate into it.
    Squares that overflow on finite elements fall back to :func:`absmax`, which tells them apart.
    Other dtypes: :func:`absmax`."""
    if t.dtype != torch.float32 or t.numel() == 0:
        return absmax(t)
    sumsq = float(torch.dot(t, t))
    if math.isfinite(sumsq):
        return math.sqrt(sumsq) * NORM_MARGIN + UNDERFLOW_SLACK
    return absmax(t)


def fold_chunk(src: torch.Tensor, dst: torch.Tensor, weight: float, first: bool, scratch: Scratch) -> None:
    """``dst = w * src`` (``first``) or ``dst = dst + w * src``, over cache blocks, ``w`` rounded to
    fp32. ``src`` is fp32 or bf16 (upcast first: a bf16 multiply would round to bf16), already
    checked finite; ``dst`` is a contiguous fp32 view."""
    n = src.numel()
    w = np.float32(weight)
    d_all = dst.numpy()
    s_all = src.numpy() if src.dtype == torch.float32 else None
    with np.errstate(all="ignore"):
        for a in range(0, n, BLOCK):
            b = min(n, a + BLOCK)
            d = d_all[a:b]
            target = d if first else scratch.array(b - a)
            if s_all is not None:
                np.multiply(s_all[a:b], w, out=target)
            else:
                torch.from_numpy(target).copy_(src[a:b])
                np.multiply(target, w, out=target)
            if not first:
                np.add(d, target, out=d)


def outer_step(s: torch.Tensor, value: torch.Tensor, momentum: torch.Tensor | None, out_momentum: torch.Tensor | None,
               lo: int, hi: int, total: float, lr: float, mu: float, scratch: Scratch,
               check: bool) -> tuple[float, float]:
    """The outer step on elements ``[lo, hi)``, the new value written where the sum ``s`` was.

    With ``mu > 0`` (``diloco.outer``)::

        g = s / -W;  m = mu * m + g;  value' = value - lr * (g + mu * m)

    (``s / -W`` is ``-(s / W)`` bit for bit: IEEE division is sign-symmetric). ``m`` is updated in
    place in ``momentum``, or written to ``out_momentum`` when that is given (a checkpoint still
    reads the old one). With ``mu == 0`` there is no momentum: ``value' = value - lr * g``.
    ``lr == 1`` skips its multiply (exact).

    ``check``: also measure ``(max |value'|, max |m|)`` over the range (``inf`` when anything is not
    finite), one cache-hot reduction per block; otherwise return ``(nan, nan)`` (not measured).
    """
    vmax = mmax = 0.0
    neg_total, f_lr, f_mu = np.float32(-total), np.float32(lr), np.float32(mu)
    sums, values = s.numpy(), value.numpy()
    old_m = None if momentum is None else momentum.numpy()
    new_m = old_m if out_momentum is None else out_momentum.numpy()
    with np.errstate(all="ignore"):
        for a in range(lo, hi, BLOCK):
            b = min(hi, a + BLOCK)
            acc = sums[a:b]
            np.divide(acc, neg_total, out=acc)  # g
            if mu == 0.0:
                if lr != 1.0:
                    np.multiply(acc, f_lr, out=acc)
                np.subtract(values[a:b], acc, out=acc)
            else:
                assert old_m is not None and new_m is not None
                m = new_m[a:b]
                np.multiply(old_m[a:b], f_mu, out=m)
                np.add(m, acc, out=m)  # m = mu * m + g
                tmp = scratch.array(b - a)
                np.multiply(m, f_mu, out=tmp)
                np.add(tmp, acc, out=tmp)  # g + mu * m
                if lr != 1.0:
                    np.multiply(tmp, f_lr, out=tmp)
                np.subtract(values[a:b], tmp, out=acc)
                if check:
                    mmax = max(mmax, absmax(torch.from_numpy(m)))
            if check:
                vmax = max(vmax, absmax(torch.from_numpy(acc)))
    return (vmax, mmax) if check else (math.nan, math.nan)


def step_bounds(smax: float, total: float, vmax: float, mmax: float, lr: float, mu: float) -> tuple[float, float]:
    """Upper bounds of ``(|value'|, |m'|)`` after the outer step on a part whose sum, value and
    momentum are bounded by ``smax``, ``vmax``, ``mmax`` (float64, with a margin for fp32 rounding).
    Below ``FLT_MAX`` the step's result is finite: the commit then needs no check, and the bounds
    carry over to the next commit without measuring anything."""
    g = smax / total
    m = mu * mmax + g
    v = vmax + lr * (g + mu * m)
    return 1.001 * v, 1.001 * m


FLT_MAX = float(torch.finfo(torch.float32).max)

__all__ = ["BLOCK", "FLT_MAX", "Scratch", "absmax", "fold_chunk", "magnitude_bound", "outer_step", "step_bounds"]

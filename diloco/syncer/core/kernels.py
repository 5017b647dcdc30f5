"""The syncer's arithmetic on one part: fold a push into the running sum, and the outer step.

Both run on a data-plane worker over cache blocks of :data:`BLOCK` elements (1 MiB per fp32
buffer, so the three or four buffers of a block stay in L2): each torch call is one large
kernel that releases the GIL, and each element is read from and written to memory once.
Every operation is one fp32 operation, in the order of ``diloco.outer``'s formula, so a
numpy reference matches bit for bit.

Finiteness is checked with ``torch.aminmax`` (NaN and Inf propagate into it), which also
gives the largest magnitude of each pushed chunk: the state keeps bounds of ``|sum|``,
``|value|`` and ``|momentum|`` per part, so it proves before a commit that the step cannot
overflow (``step_bounds``; then the commit checks nothing and may update the momentum in
place) or else has the commit measured (``check``). A sum
reduced in float64 is no check to use here: torch runs it at 0.7 GB/s on blocks of 1 Mi
elements and more (measured; fp32 reductions run at 15-25 GB/s), and it was most of the
time of every fold and of every commit beside a pinned momentum.
"""

from __future__ import annotations

import math

import torch

BLOCK = 1 << 18
"""Elements per cache block of the fold and of the commit (1 MiB per fp32 buffer)."""


class Scratch:
    """One fp32 buffer per worker, grown to the largest block seen (at most :data:`BLOCK`), then reused."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    def get(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=torch.float32)
        return self.buf[:n]


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
    block) times :data:`NORM_MARGIN`, plus :data:`UNDERFLOW_SLACK`; NaN and Inf propagate into it. Squares that overflow on
    finite elements fall back to :func:`absmax`, which tells them apart. Other dtypes: :func:`absmax`."""
    if t.dtype != torch.float32 or t.numel() == 0:
        return absmax(t)
    sumsq = float(torch.dot(t, t))
    if math.isfinite(sumsq):
        return math.sqrt(sumsq) * NORM_MARGIN + UNDERFLOW_SLACK
    return absmax(t)


def fold_chunk(src: torch.Tensor, dst: torch.Tensor, weight: float, first: bool, scratch: Scratch) -> None:
    """``dst = w * src`` (``first``) or ``dst = dst + w * src``, over cache blocks. ``src`` is fp32 or
    bf16 (upcast first: a bf16 multiply would round to bf16), already checked finite."""
    n = src.numel()
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        s, d = src[a:b], dst[a:b]
        target = d if first else scratch.get(b - a)
        if s.dtype == torch.float32:
            torch.mul(s, weight, out=target)
        else:
            target.copy_(s)
            target.mul_(weight)
        if not first:
            d.add_(target)


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
    for a in range(lo, hi, BLOCK):
        b = min(hi, a + BLOCK)
        acc = s[a:b]
        acc.div_(-total)  # g
        if mu == 0.0:
            if lr != 1.0:
                acc.mul_(lr)
            torch.sub(value[a:b], acc, out=acc)
        else:
            assert momentum is not None
            m = momentum[a:b] if out_momentum is None else out_momentum[a:b]
            torch.mul(momentum[a:b], mu, out=m)
            m.add_(acc)  # m = mu * m + g
            tmp = scratch.get(b - a)
            torch.mul(m, mu, out=tmp)
            tmp.add_(acc)  # g + mu * m
            if lr != 1.0:
                tmp.mul_(lr)
            torch.sub(value[a:b], tmp, out=acc)
            if check:
                mmax = max(mmax, absmax(m))
        if check:
            vmax = max(vmax, absmax(acc))
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

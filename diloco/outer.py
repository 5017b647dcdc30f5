"""Outer optimizer settings and merge weights.

The syncer merges the deltas that islands pushed for one fragment and moves the
global value with Nesterov momentum (DiLoCo's outer optimizer).  The arithmetic
runs on the syncer's data plane (``diloco.syncer.dataplane``), one fp32 operation
at a time so that a plain numpy reference reproduces it bit for bit (see
docs/PROTOCOL.md, "Commit")::

    s = w_a * d_a;  s = s + w_b * d_b; ...        # per part, in fold order; delta upcast to fp32
    d = s / sum(w)
    g = -d
    m = mu * m + g
    value = value - lr * (g + mu * m)

Why no fused ops: ``add(alpha=...)``/``addcmul`` round once instead of twice and
would break the bitwise match with the reference.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OuterHyper:
    """Hyper-parameters of the outer Nesterov step.

    Attributes:
        lr: outer learning rate (``--outer-lr``), default 1.0.
        momentum: Nesterov momentum ``mu`` (``--outer-momentum``), default 0.0.

    The defaults are plain averaging: the merged value is the weighted mean of the islands'
    values. It was the best setting of every run of ``benchmarks/bench_quality.py`` (up to 24
    outer steps per fragment), where DiLoCo's published 0.7 / 0.9 overshoots (4-14 % worse
    held-out loss); 0.7 / 0.9 is meant for runs of hundreds of outer steps per fragment
    (docs/PERFORMANCE.md, "Quality").
    """

    lr: float = 1.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if not (self.lr > 0.0 and self.lr == self.lr and self.lr != float("inf")):
            raise ValueError(f"outer lr must be a finite positive number, got {self.lr}")
        if not (0.0 <= self.momentum < 1.0):
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")


def push_weight(local_steps: int, tokens: int, weighting: str) -> int:
    """The integer weight of one push under ``weighting`` (docs/PROTOCOL.md, "Commit").

    A push that made no local step weighs 0 whatever the rule (its delta is stale by
    construction, and it carries no tensors).  ``tokens``: its token count, which must
    then be positive (returns -1 for the caller to refuse: a silent fallback to weighting
    by steps would weigh a misconfigured island ~1e-6 of its peers); ``steps``: its local
    steps; ``equal``: 1.  Weights are known when a push's first part arrives, so every
    part can be folded into the round's running sum at once; they stay integers so
    their sum is exact before it is rounded to fp32 once.
    """
    if weighting not in ("tokens", "steps", "equal"):
        raise ValueError(f"unknown weighting {weighting!r}")
    if local_steps == 0:
        return 0
    if weighting == "tokens":
        return int(tokens) if tokens > 0 else -1
    if weighting == "steps":
        return int(local_steps)
    return 1

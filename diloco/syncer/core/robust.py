"""Robust aggregation rules: one island can only spoil its own share of a round.

Pure rules, used by the core (``robustrules.py``) when a push's first part arrives and by the data plane
when a part is folded; tested with plain values.

* **Counts are clamped** (:func:`clamp_counts`): a push's local steps to
  ``max_steps_factor x H``, its tokens to ``--max-tokens-per-step`` x those steps.
* **Weights are capped** (:func:`cap_weight`) at ``--max-weight-factor`` x the lower median
  weight of the other pushes of the attempt, or, before any, of the latest round seen.
  Self-reported tokens cannot be verified; this bounds what a liar gains to that factor.  The
  lower median of two weights is the smaller, so a liar is never its own reference.
* **An attempt judged by nothing is judged at its end** (:func:`unjudged_excess`): a push that
  arrives first with no weight seen before it cannot be capped when it is folded; if, once the
  attempt is complete, its weight exceeds the cap against the others, the attempt is dropped
  and re-pulled, and the next attempt caps it (its claims are now the reference).  Honest runs
  never pay this; a liar costs one re-pull.
* **Deltas are bounded per part** (:class:`PartBound`): any element beyond ``max_abs``
  refuses the part before that chunk is folded (so ``weight x max|delta|`` summed over
  islands stays far below the fp32 range: accumulation cannot overflow); once a fragment has a
  reference RMS (the median per-island RMS of its previous round, :class:`Reference`), a part
  (fp32, bf16, or low-bit once dequantized) whose L2 norm is above ``--refuse-factor`` x reference x sqrt(elements) is refused.
  (Scaling a part down instead would need its norm before the first chunk is folded, a second
  pass over every part; the fold streams chunk by chunk, so bounds refuse, they do not clip.)
* A refused part is charged to the island that sent it (``--max-refusals`` evicts): the
  attempt is re-pulled without it, so the round commits with the others.

Memory: per fragment one float and one round's per-island sums; per island a few counters.
"""

from __future__ import annotations

import math
import statistics
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from diloco.outer import push_weight
from diloco.wire import WireError

FP32_MAX = 3.0e38
MAX_ABS_DELTA = 1.0e4
"""Largest |element| of a pushed fp32/bf16 delta (a DiLoCo delta is a few inner steps of a
model's weights; anything near this is garbage or an attack)."""


BOUND_MARK = "above the bound"
"""In every refusal reason of these bounds (the state leaves the island out of the next attempt)."""


def clamp_counts(local_steps: int, tokens: int, sync_every: int, steps_factor: int,
                 max_tokens_per_step: int) -> tuple[int, int, str | None]:
    """(steps, tokens, why or None): the counts a push may claim."""
    steps = min(local_steps, steps_factor * sync_every)
    toks = min(tokens, max_tokens_per_step * max(steps, 1))
    why = None
    if (steps, toks) != (local_steps, tokens):
        why = (f"counts clamped: local_steps {local_steps} -> {steps}, tokens {tokens} -> {toks} "
               f"(<= {steps_factor} x H steps, <= --max-tokens-per-step x steps)")
    return steps, toks, why


def cap_weight(weight: int, others: Sequence[int], factor: float) -> tuple[int, str | None]:
    """``weight`` capped at ``factor`` x the lower median of ``others`` (positive weights); no cap
    without any."""
    ref = [w for w in others if w > 0]
    if weight <= 0 or not ref:
        return weight, None
    med = statistics.median_low(ref)
    cap = max(1, int(factor * med))
    if weight <= cap:
        return weight, None
    return cap, f"weight {weight} capped at {cap} ({factor:g} x the round's lower median {med:g})"


def unjudged_excess(weights: dict[int, int], factor: float) -> tuple[int, str] | None:
    """(island, why) of the first push of a complete attempt whose weight exceeds ``factor`` x the
    lower median of the others' (None: every weight passes; a lone push passes)."""
    for island in sorted(weights):
        others = [w for i, w in weights.items() if i != island]
        _w, why = cap_weight(weights[island], others, factor)
        if why:
            return island, why
    return None


@dataclass
class PartBound:
    """What one part of a push may hold.  The fold calls :func:`check_chunk` on each chunk before
    folding it and :func:`finish_part` after the last; ``sink`` learns the part's norm."""

    max_abs: float = MAX_ABS_DELTA
    hard_norm: float = math.inf
    sink: Callable[[float], None] | None = None
    sumsq: float = 0.0


def check_chunk(bound: PartBound, amax: float, view: torch.Tensor) -> None:
    """Refuse a chunk holding an element beyond ``max_abs`` (before it is folded); add its squares."""
    if amax > bound.max_abs:
        raise WireError(f"delta element of magnitude {amax:.3g} {BOUND_MARK} {bound.max_abs:.3g}")
    if view.dtype == torch.float32:  # |d| <= max_abs: the fp32 dot of one chunk cannot overflow
        bound.sumsq += float(torch.dot(view, view))
    else:  # bf16 segments: squares summed in fp32 without an fp32 copy of the chunk
        bound.sumsq += float(torch.linalg.vector_norm(view, dtype=torch.float32)) ** 2


def finish_part(bound: PartBound) -> None:
    """Refuse a part whose L2 norm is beyond ``hard_norm`` (it voids its attempt); report the norm."""
    norm = math.sqrt(bound.sumsq)
    if norm > bound.hard_norm:
        raise WireError(f"delta norm {norm:.3g} {BOUND_MARK} {bound.hard_norm:.3g} "
                        f"(--refuse-factor x the fragment's reference)")
    if bound.sink is not None:
        bound.sink(norm)


def overflow_safe(weights: Sequence[int], max_abs: float = MAX_ABS_DELTA) -> bool:
    """True when ``sum(weights) x max_abs`` stays below the fp32 range (the running sum cannot overflow)."""
    return sum(weights) * max_abs < FP32_MAX


class Reference:
    """Per-fragment reference RMS, the last round's weights, per-island tallies (fixed size).

    Norms arrive from the data plane's workers (:meth:`sink`), so updates take a lock.  The
    reference of a fragment is the median per-island RMS of the latest *earlier* round of that
    fragment: a new round's first part moves the running one into it."""

    def __init__(self) -> None:
        self.rms: dict[int, float] = {}
        self.last_weights: dict[int, tuple[int, ...]] = {}
        self.benched: set[int] = set()
        """Islands charged with a refused part: left out of the attempt that replaces it."""
        self.tally: dict[int, dict[str, int]] = {}
        """Per island: clamped counts, capped weights, clipped and refused parts."""
        self._acc: dict[int, tuple[int, dict[int, tuple[float, int]]]] = {}
        self._lock = threading.Lock()

    def count(self, island: int, what: str) -> None:
        with self._lock:
            t = self.tally.setdefault(island, {})
            t[what] = t.get(what, 0) + 1

    def sink(self, fragment: int, round_: int, island: int, n: int) -> Callable[[float], None]:
        """A callback for :class:`PartBound`: the norm of one folded part of this push."""
        def add(norm: float) -> None:
            with self._lock:
                cur, acc = self._acc.get(fragment, (round_, {}))
                if round_ > cur:
                    self._finish(fragment, acc)
                    cur, acc = round_, {}
                if round_ == cur:
                    sq, count = acc.get(island, (0.0, 0))
                    acc[island] = (sq + norm * norm, count + n)
                self._acc[fragment] = (cur, acc)
        return add

    def _finish(self, fragment: int, acc: dict[int, tuple[float, int]]) -> None:
        rms = [math.sqrt(sq / n) for sq, n in acc.values() if n > 0]
        if rms and statistics.median(rms) > 0:
            self.rms[fragment] = statistics.median(rms)

    def weights_seen(self, fragment: int, weights: Sequence[int]) -> None:
        """Weights of a round of ``fragment`` as it closes (the next rounds' fallback reference)."""
        if any(w > 0 for w in weights):
            self.last_weights[fragment] = tuple(w for w in weights if w > 0)

    def bound(self, fragment: int, round_: int, island: int, n: int, refuse_factor: float) -> PartBound:
        with self._lock:
            ref = self.rms.get(fragment)
        b = PartBound(sink=self.sink(fragment, round_, island, n))
        if ref is not None:
            b.hard_norm = refuse_factor * ref * math.sqrt(n)
        return b

    def summary(self) -> str:
        """``i<island>:<what><count>,...`` for the status line (empty: nothing happened)."""
        with self._lock:
            return " ".join(f"i{i}:" + ",".join(f"{k}{v}" for k, v in sorted(t.items()))
                            for i, t in sorted(self.tally.items()))


def robust_weight(local_steps: int, tokens: int, weighting: str, sync_every: int, steps_factor: int,
                  max_tokens_per_step: int, others: Sequence[int], weight_factor: float) -> tuple[int, list[str]]:
    """The weight a push gets (counts clamped, then capped against ``others``) and why it changed."""
    steps, toks, why = clamp_counts(local_steps, tokens, sync_every, steps_factor, max_tokens_per_step)
    notes = [why] if why else []
    weight = push_weight(steps, toks, weighting)
    weight, capped = cap_weight(weight, others, weight_factor)
    if capped:
        notes.append(capped)
    return weight, notes


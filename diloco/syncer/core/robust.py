"""Robust aggregation rules: one island can only spoil its own share of a round.

Pure rules, used by the core (``robustrules.py``) when a push's first part arrives and by the data plane
when a part is folded; tested with plain values.

* **Counts are clamped** (:func:`clamp_counts`): a push's local steps to
  ``max_steps_factor x H``, its tokens to ``--max-tokens-per-step`` x those steps.
* **Weights are capped** (:func:`cap_weight`) per local step: at ``--max-weight-factor`` x the
  lower median weight per step of the other pushes of the attempt (or, before any, of the
  latest attempt seen) x the push's clamped steps.  Self-reported tokens cannot be verified;
  this bounds a liar's weight per step to that factor of the honest islands' (and its steps to
  ``max_steps_factor x H``), while honest islands that pushed after different numbers of steps
  are never capped.  The lower median of two is the smaller: a liar is never its own reference.
* **An attempt judged by nothing is judged at its end** (:func:`unjudged_excess`): a push that
  arrives first with no weight seen before it cannot be capped when it is folded; if, once the
  attempt is complete, its weight exceeds the cap against the others, the attempt is dropped
  and re-pulled, and the next attempt caps it (its claims are now the reference).  Honest runs
  never pay this; a liar costs one re-pull.
* **Deltas are bounded per part** (:class:`PartBound`): any element beyond ``max_abs``
  refuses the part before that chunk is folded (so ``weight x max|delta|`` summed over
  islands stays far below the fp32 range: accumulation cannot overflow); once a fragment has a
  reference RMS per local step (the median per-island RMS of its previous round, each over that
  push's local steps, :class:`Reference`), each part's L2 norm is summed as it is folded: above
  ``--norm-clip-factor`` x reference x the push's local steps x sqrt(elements) the part is folded
  a second time with its weight times ``scale - 1``, which
  leaves it scaled down to that norm (clipped, counted per island: only such parts cost the
  second pass); above ``--norm-refuse-factor`` x the same it is refused and its attempt voided.
  This holds for fp32, bf16 and (once dequantized) low-bit parts.  A delta grows with the steps
  it covers, and rounds of one fragment cover different numbers of them (the first round of a
  staggered fragment, the flush), so the reference is per step and each push's bound is scaled
  by its own steps, clamped like its weight (``max_steps_factor x H``): a liar claiming more
  steps gains at most that factor of norm room.
* A refused part is charged to the island that sent it (``--max-refusals`` evicts): the
  attempt is re-pulled without it, so the round commits with the others.

Memory: per fragment one float and one round's per-island sums; per island a few counters.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from diloco.outer import push_weight
from diloco.wire import WireError

log = logging.getLogger("diloco.syncer.core")

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


def cap_weight(weight: int, steps: int, other_rates: Sequence[float], factor: float) -> tuple[int, str | None]:
    """``weight`` capped at ``factor`` x the lower median of ``other_rates`` (weight per local
    step of the other pushes) x this push's ``steps`` (clamped); no cap without any rate.

    Per step, so honest islands that pushed after different numbers of steps (a flush round, a
    push deferred by a busy snapshot slot) are never capped; the lower median of two rates is the
    smaller, so a liar is never its own reference."""
    ref = [r for r in other_rates if r > 0]
    if weight <= 0 or not ref:
        return weight, None
    med = statistics.median_low(ref)
    cap = max(1, int(factor * med * max(steps, 1)))
    if weight <= cap:
        return weight, None
    return cap, (f"weight {weight} capped at {cap} ({factor:g} x the lower median weight per step {med:g} "
                 f"x {steps} steps)")


def unjudged_excess(pushes: dict[int, tuple[int, int]], factor: float) -> tuple[int, str] | None:
    """(island, why) of the first push of a complete attempt, ``island -> (weight, clamped
    steps)``, whose weight exceeds its cap against the others' rates (None: every weight passes;
    a lone push passes)."""
    for island in sorted(pushes):
        weight, steps = pushes[island]
        others = [w / max(s, 1) for i, (w, s) in pushes.items() if i != island and w > 0]
        _w, why = cap_weight(weight, steps, others, factor)
        if why:
            return island, why
    return None


@dataclass
class PartBound:
    """What one part of a push may hold.  The fold calls :func:`check_chunk` on each chunk before
    folding it (elements; squares summed), then :func:`clip_scale` (with a reference: the part's
    norm refused beyond ``hard_norm``, or the factor to fold it with above ``clip_norm``, the fold
    then adding the difference in a second pass over that part only) and :func:`finish_part`.
    ``sink`` learns the norm folded; ``on_clip`` hears ``(norm, clip_norm)`` of a clipped part (it
    runs on a data-plane worker)."""

    max_abs: float = MAX_ABS_DELTA
    hard_norm: float = math.inf
    clip_norm: float = math.inf
    sink: Callable[[float], None] | None = None
    on_clip: Callable[[float, float], None] | None = None
    sumsq: float = 0.0


def chunk_sumsq(view: torch.Tensor) -> float:
    """Sum of squares of one fp32 or bf16 chunk, accumulated in fp32 (no fp32 copy of a bf16 chunk)."""
    if view.dtype == torch.float32:
        return float(torch.dot(view, view))
    return float(torch.linalg.vector_norm(view, dtype=torch.float32)) ** 2


def check_chunk(bound: PartBound, amax: float, view: torch.Tensor) -> None:
    """Refuse a chunk holding an element beyond ``max_abs`` (before it is folded); add its squares
    (|d| <= max_abs: the fp32 squares of one chunk cannot overflow)."""
    if amax > bound.max_abs:
        raise WireError(f"delta element of magnitude {amax:.3g} {BOUND_MARK} {bound.max_abs:.3g}")
    bound.sumsq += chunk_sumsq(view)


def clip_scale(bound: PartBound) -> float:
    """Once every chunk of a part passed :func:`check_chunk`: 1, or ``clip_norm / norm`` when the
    part's norm is above the clip (reported to ``on_clip``; the caller folds the part again with
    its weight times ``scale - 1``); refuses a norm beyond ``hard_norm`` (the attempt is void)."""
    norm = math.sqrt(bound.sumsq)
    if not norm <= bound.hard_norm:  # also NaN
        raise WireError(f"delta norm {norm:.3g} {BOUND_MARK} {bound.hard_norm:.3g} "
                        f"(--norm-refuse-factor x the fragment's reference)")
    if norm <= bound.clip_norm:
        return 1.0
    if bound.on_clip is not None:
        bound.on_clip(norm, bound.clip_norm)
    bound.sumsq = bound.clip_norm ** 2
    return bound.clip_norm / norm


def finish_part(bound: PartBound) -> None:
    """Refuse a part whose L2 norm is beyond ``hard_norm`` (it voids its attempt); report the norm."""
    norm = math.sqrt(bound.sumsq)
    if norm > bound.hard_norm:
        raise WireError(f"delta norm {norm:.3g} {BOUND_MARK} {bound.hard_norm:.3g} "
                        f"(--norm-refuse-factor x the fragment's reference)")
    if bound.sink is not None:
        bound.sink(norm)


def overflow_safe(weights: Sequence[int], max_abs: float = MAX_ABS_DELTA) -> bool:
    """True when ``sum(weights) x max_abs`` stays below the fp32 range (the running sum cannot overflow)."""
    return sum(weights) * max_abs < FP32_MAX


class Reference:
    """Per-fragment reference RMS per local step, the last round's weights, per-island tallies (fixed size).

    Norms arrive from the data plane's workers (:meth:`sink`), so updates take a lock.  The
    reference of a fragment is the median over islands of the RMS of their pushes in the latest
    *earlier* round of that fragment, each divided by that push's (clamped) local steps: a new
    round's first part moves the running one into it."""

    def __init__(self) -> None:
        self.rms: dict[int, float] = {}
        """Per fragment: the reference RMS per local step."""
        self.last_rates: dict[int, tuple[float, ...]] = {}
        """Per fragment: the weights per step of its latest attempt's pushes."""
        self.benched: set[int] = set()
        """Islands charged with a refused part: left out of the attempt that replaces it."""
        self.tally: dict[int, dict[str, int]] = {}
        """Per island: clamped counts, capped weights, clipped and refused parts."""
        self._acc: dict[int, tuple[int, dict[int, tuple[float, int, int]]]] = {}
        """Per fragment: the round being accumulated and, per island, (sum of squared part norms,
        elements, the push's steps)."""
        self._lock = threading.Lock()

    def count(self, island: int, what: str) -> None:
        with self._lock:
            t = self.tally.setdefault(island, {})
            t[what] = t.get(what, 0) + 1

    def sink(self, fragment: int, round_: int, island: int, n: int, steps: int = 1) -> Callable[[float], None]:
        """A callback for :class:`PartBound`: the norm of one folded part (``n`` elements) of this
        push, which covers ``steps`` local steps (clamped; at least 1)."""
        def add(norm: float) -> None:
            with self._lock:
                cur, acc = self._current(fragment, round_)
                if round_ == cur:
                    sq, count, _ = acc.get(island, (0.0, 0, 1))
                    acc[island] = (sq + norm * norm, count + n, max(1, steps))
        return add

    def _current(self, fragment: int, round_: int) -> tuple[int, dict[int, tuple[float, int, int]]]:
        """(round, per-island sums) being accumulated for ``fragment``, moved on to ``round_`` when
        that is later: the earlier round's sums become the reference (caller holds the lock)."""
        cur, acc = self._acc.setdefault(fragment, (round_, {}))
        if round_ > cur:
            self._finish(fragment, acc)
            cur, acc = self._acc[fragment] = (round_, {})
        return cur, acc

    def _finish(self, fragment: int, acc: dict[int, tuple[float, int, int]]) -> None:
        rms = [math.sqrt(sq / n) / steps for sq, n, steps in acc.values() if n > 0]
        if rms and statistics.median(rms) > 0:
            self.rms[fragment] = statistics.median(rms)

    def rates_seen(self, fragment: int, rates: Sequence[float]) -> None:
        """Weights per step of an attempt of ``fragment`` (the next attempts' fallback reference)."""
        if any(r > 0 for r in rates):
            self.last_rates[fragment] = tuple(r for r in rates if r > 0)

    def bound(self, fragment: int, round_: int, island: int, n: int, refuse_factor: float,
              clip_factor: float = math.inf, steps: int = 1) -> PartBound:
        """The bounds of one part (``n`` elements) of ``island``'s push over ``steps`` local steps
        (clamped; at least 1): refused beyond ``refuse_factor``, clipped beyond ``clip_factor`` x
        the fragment's reference RMS per step x ``steps`` x sqrt(n) (no norm bound before the
        fragment has a reference)."""
        steps = max(1, steps)
        with self._lock:
            self._current(fragment, round_)  # a later round: the earlier one's folds are all in
            ref = self.rms.get(fragment)
        b = PartBound(sink=self.sink(fragment, round_, island, n, steps))
        if ref is not None:
            b.hard_norm = refuse_factor * ref * steps * math.sqrt(n)
            b.clip_norm = clip_factor * ref * steps * math.sqrt(n)

            def clipped(norm: float, clip: float) -> None:
                self.count(island, "clipped")
                log.warning("island %d round %d: a part of norm %.3g clipped to %.3g (--norm-clip-factor x "
                            "the fragment's reference)", island, round_, norm, clip)
            b.on_clip = clipped
        return b

    def totals(self, kinds: tuple[str, ...] = ("clipped", "capped", "clamped")) -> dict[str, int]:
        """Counts of ``kinds`` summed over islands (the metrics' "clipped by reason")."""
        with self._lock:
            return {k: n for k in kinds if (n := sum(t.get(k, 0) for t in self.tally.values()))}

    def summary(self) -> str:
        """``i<island>:<what><count>,...`` for the status line (empty: nothing happened)."""
        with self._lock:
            return " ".join(f"i{i}:" + ",".join(f"{k}{v}" for k, v in sorted(t.items()))
                            for i, t in sorted(self.tally.items()))


def robust_weight(local_steps: int, tokens: int, weighting: str, sync_every: int, steps_factor: int,
                  max_tokens_per_step: int, other_rates: Sequence[float], weight_factor: float) -> tuple[int, int, list[str]]:
    """(weight, clamped steps, why either changed) of a push: counts clamped, then the weight
    capped against ``other_rates`` (weights per step of the other pushes)."""
    steps, toks, why = clamp_counts(local_steps, tokens, sync_every, steps_factor, max_tokens_per_step)
    notes = [why] if why else []
    weight = push_weight(steps, toks, weighting)
    weight, capped = cap_weight(weight, steps, other_rates, weight_factor)
    if capped:
        notes.append(capped)
    return weight, steps, notes

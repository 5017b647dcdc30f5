"""The core's side of the robust aggregation rules (``robust.py``): the weight of a push, clamped
and capped when its first part is accepted (logged, counted per island, and recorded in the event
log), the judgement at commit time of an attempt whose first push could not be capped, and the
bounds each part is checked against. Functions of the round, the push and the
:class:`~diloco.syncer.core.robust.Reference` they update; no I/O."""

from __future__ import annotations

import logging

from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.effects import Journal
from diloco.syncer.core.records import RoundRecord
from diloco.syncer.core.robust import PartBound, Reference, robust_weight, unjudged_excess
from diloco.wire import Push

log = logging.getLogger("diloco.syncer.core")


def push_weight_of(cfg: SyncerConfig, reference: Reference, journal: Journal, r: RoundRecord, h: Push,
                   now: float) -> int:
    """The weight of a push accepted at its part 0: counts clamped, weight capped, both logged."""
    if not r.pushes:  # the attempt's first push: judged by nothing when no weight was seen yet
        r.unjudged = not reference.last_rates
    rates = [p.weight / max(clamped_steps(cfg, p.local_steps), 1) for p in r.pushes.values() if p.weight > 0]
    others = rates or list(reference.last_rates.get(r.fragment, ())) or [
        x for fragment_rates in reference.last_rates.values() for x in fragment_rates]
    weight, steps, notes = robust_weight(h.local_steps, h.tokens, cfg.weighting, cfg.sync_every,
                                         cfg.max_steps_factor, cfg.max_tokens_per_step, others, cfg.weight_factor)
    for note in notes:
        what = "capped" if note.startswith("weight") else "clamped"
        reference.count(h.island, what)
        log.warning("island %d round %d: %s", h.island, r.round, note)
        journal.events.append({"time": now, "round": r.round, "island": h.island, what: note})
    reference.rates_seen(r.fragment, [*rates, weight / max(steps, 1)])
    return weight


def clamped_steps(cfg: SyncerConfig, local_steps: int) -> int:
    """A push's local steps as clamped for its weight (``robust.clamp_counts``)."""
    return min(local_steps, cfg.max_steps_factor * cfg.sync_every)


def judge_unjudged(cfg: SyncerConfig, reference: Reference, journal: Journal, r: RoundRecord,
                   now: float) -> str | None:
    """Before a commit: an attempt whose first push could not be capped (``r.unjudged``) must be
    dropped and re-pulled when a weight exceeds the cap against the others (the next attempt caps
    it). Returns why (the round is reopened: ``closed`` cleared; counted, logged, recorded) for the
    caller to restart the attempt, or None when the attempt may commit."""
    if not r.unjudged:
        return None
    r.unjudged = False
    found = unjudged_excess({i: (p.weight, clamped_steps(cfg, p.local_steps)) for i, p in r.pushes.items()
                             if p.weight > 0}, cfg.weight_factor)
    if found is None:
        return None
    island, why = found
    reference.count(island, "capped")
    log.warning("island %d round %d: %s (first push of an attempt with no reference)", island, r.round, why)
    journal.events.append({"time": now, "round": r.round, "island": island, "capped": why})
    r.closed = False
    return f"island {island}'s weight could not be judged when it was folded"


def part_bound(cfg: SyncerConfig, reference: Reference, r: RoundRecord, island: int, n: int) -> PartBound:
    """The element and norm bounds (clip and refuse) of one part of ``island``'s push to ``r`` (``n``
    elements), scaled by the push's local steps as clamped for its weight."""
    push = r.pushes.get(island)
    steps = clamped_steps(cfg, push.local_steps) if push is not None else 1
    return reference.bound(r.fragment, r.round, island, n, cfg.norm_hard_factor, cfg.norm_clip_factor, steps)

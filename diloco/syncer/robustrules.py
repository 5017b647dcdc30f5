"""The state machine's side of the robust aggregation rules (``robust.py``): a mixin of
``SyncerState`` that clamps a push's counts and caps its weight when its first part is accepted
(logged, counted per island, and recorded in the event log), and gives each part its bounds."""

from __future__ import annotations

import logging

from diloco.syncer.effects import Out
from diloco.syncer.fields import StateFields
from diloco.syncer.records import RoundRecord
from diloco.syncer.robust import PartBound, Reference, robust_weight, unjudged_excess
from diloco.wire import Push

log = logging.getLogger("diloco.syncer.state")


class RobustRules(StateFields):
    """The state machine's side of these rules (a mixin of ``SyncerState``)."""

    reference: Reference

    def _robust_weight(self, r: RoundRecord, h: Push, now: float) -> int:
        """The weight of a push accepted at its part 0: counts clamped, weight capped, both logged."""
        cfg = self.config
        if not r.pushes:  # the attempt's first push: judged by nothing when no weight was seen yet
            r.unjudged = not self.reference.last_rates
        others = [p.weight / max(self._steps(p.local_steps), 1) for p in r.pushes.values() if p.weight > 0]
        if not others:
            others = list(self.reference.last_rates.get(r.fragment, ())) or [
                x for rates in self.reference.last_rates.values() for x in rates]
        weight, steps, notes = robust_weight(h.local_steps, h.tokens, cfg.weighting, cfg.sync_every,
                                             cfg.max_steps_factor, cfg.max_tokens_per_step, others, cfg.weight_factor)
        for note in notes:
            what = "capped" if note.startswith("weight") else "clamped"
            self.reference.count(h.island, what)
            log.warning("island %d round %d: %s", h.island, r.round, note)
            self.events.append({"time": now, "round": r.round, "island": h.island, what: note})
        rates = [p.weight / max(self._steps(p.local_steps), 1) for p in r.pushes.values() if p.weight > 0]
        self.reference.rates_seen(r.fragment, [*rates, weight / max(steps, 1)])
        return weight

    def _steps(self, local_steps: int) -> int:
        """A push's local steps as clamped for its weight (``robust.clamp_counts``)."""
        return min(local_steps, self.config.max_steps_factor * self.config.sync_every)

    def _refuse_unjudged(self, r: RoundRecord, now: float, out: list[Out]) -> bool:
        """Before a commit: an attempt whose first push could not be capped (``r.unjudged``) is
        dropped and re-pulled when a weight exceeds the cap against the others (the next attempt
        caps it); True when it was."""
        if not r.unjudged:
            return False
        r.unjudged = False
        found = unjudged_excess({i: (p.weight, self._steps(p.local_steps)) for i, p in r.pushes.items()
                                 if p.weight > 0}, self.config.weight_factor)
        if found is None:
            return False
        island, why = found
        self.reference.count(island, "capped")
        log.warning("island %d round %d: %s (first push of an attempt with no reference)", island, r.round, why)
        self.events.append({"time": now, "round": r.round, "island": island, "capped": why})
        r.closed = False
        self._restart_attempt(r, now, out, f"island {island}'s weight could not be judged when it was folded")
        return True

    def _part_bound(self, r: RoundRecord, island: int, n: int) -> PartBound:
        return self.reference.bound(r.fragment, r.round, island, n, self.config.norm_hard_factor)

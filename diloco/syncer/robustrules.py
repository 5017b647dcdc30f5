"""The state machine's side of the robust aggregation rules (``robust.py``): a mixin of
``SyncerState`` that clamps a push's counts and caps its weight when its first part is accepted
(logged, counted per island, and recorded in the event log), and gives each part its bounds."""

from __future__ import annotations

import logging

from diloco.syncer.fields import StateFields
from diloco.syncer.core.records import RoundRecord
from diloco.syncer.core.robust import PartBound, Reference, robust_weight
from diloco.wire import Push

log = logging.getLogger("diloco.syncer.state")


class RobustRules(StateFields):
    """The state machine's side of these rules (a mixin of ``SyncerState``)."""

    reference: Reference

    def _robust_weight(self, r: RoundRecord, h: Push, now: float) -> int:
        """The weight of a push accepted at its part 0: counts clamped, weight capped, both logged."""
        cfg = self.config
        others = [p.weight for p in r.pushes.values() if p.weight > 0]
        if not others:
            others = list(self.reference.last_weights.get(r.fragment, ())) or [
                w for ws in self.reference.last_weights.values() for w in ws]
        weight, notes = robust_weight(h.local_steps, h.tokens, cfg.weighting, cfg.sync_every, cfg.max_steps_factor,
                                      cfg.max_tokens_per_step, others, cfg.weight_factor)
        for note in notes:
            what = "capped" if note.startswith("weight") else "clamped"
            self.reference.count(h.island, what)
            log.warning("island %d round %d: %s", h.island, r.round, note)
            self.events.append({"time": now, "round": r.round, "island": h.island, what: note})
        self.reference.weights_seen(r.fragment, [*(p.weight for p in r.pushes.values()), weight])
        return weight

    def _part_bound(self, r: RoundRecord, island: int, n: int) -> PartBound:
        return self.reference.bound(r.fragment, r.round, island, n, self.config.norm_hard_factor)

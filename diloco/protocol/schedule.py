"""The round schedule of Streaming DiLoCo: which fragment a round syncs and at which step it opens.

With ``P`` fragments synced every ``H`` inner steps each (docs/PROTOCOL.md, "Rounds"):

* round ``t`` (``t >= 1``) syncs fragment ``(t - 1) mod P``;
* round ``t`` opens when the clock (the K-th fastest training island's step) reaches
  ``ceil(t * H / P)``, so rounds are spaced ``H / P`` steps apart and each fragment is synced
  every ``H`` steps;
* with ``total_steps > 0`` the rounds of training are those that open at or before the last
  step: ``t <= floor(total * P / H)``; after every island finished, one **flush round** per
  fragment (fragment order, numbered on from the last round opened) merges the last steps.

:class:`Schedule` is the one definition: the syncer's round clock, the island's synchronous-round
hold, the syncer's summary and the link check all ask it. Pure and immutable; every method is
O(1) (``rounds_opening_at`` returns a ``range``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """The round schedule of one run.

    Args:
        sync_every: ``H``, inner steps between two syncs of the same fragment (>= 1).
        n_fragments: ``P``, fragments in the plan (>= 1).
        total_steps: inner steps of the run; 0 means unbounded (no end of the schedule).
    Raises ValueError naming the bad argument.
    """

    sync_every: int
    n_fragments: int
    total_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("sync_every", "n_fragments"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Schedule.{name} must be an int >= 1, got {v!r}")
        t = self.total_steps
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"Schedule.total_steps must be an int >= 0, got {t!r}")

    def fragment_of(self, round_: int) -> int:
        """The fragment round ``round_`` (>= 1) syncs: ``(round_ - 1) mod P``."""
        _check_round(round_)
        return (round_ - 1) % self.n_fragments

    def opening_step(self, round_: int) -> int:
        """The clock step at which round ``round_`` (>= 1) opens: ``ceil(round_ * H / P)``."""
        _check_round(round_)
        return -(-round_ * self.sync_every // self.n_fragments)

    def rounds_opened_by(self, step: int) -> int:
        """How many rounds open at or before clock step ``step`` (>= 0): ``floor(step * P / H)``
        (the schedule's end is not applied; see :meth:`in_training`)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step * self.n_fragments // self.sync_every

    def rounds_opening_at(self, step: int) -> range:
        """The rounds whose opening step is exactly ``step`` (>= 1); empty for most steps when H > P.

        ``ceil(t * H / P) == step``  <=>  ``(step - 1) * P / H < t <= step * P / H``."""
        if step < 1:
            return range(0)
        return range(self.rounds_opened_by(step - 1) + 1, self.rounds_opened_by(step) + 1)

    def in_training(self, round_: int) -> bool:
        """Whether round ``round_`` belongs to training: it opens at or before ``total_steps``
        (always, when the run is unbounded). Later rounds are only flush rounds."""
        return self.total_steps <= 0 or self.opening_step(round_) <= self.total_steps

    @property
    def scheduled_rounds(self) -> int:
        """Rounds of training, ``floor(total * P / H)``; 0 when the run is unbounded."""
        return self.rounds_opened_by(self.total_steps) if self.total_steps > 0 else 0

    @property
    def spacing_steps(self) -> float:
        """Inner steps between two consecutive rounds, ``H / P`` (a round's transfer window)."""
        return self.sync_every / self.n_fragments

    def flush_fragments(self) -> range:
        """The fragments of the flush rounds, in the order they open: every fragment once."""
        return range(self.n_fragments)


def _check_round(round_: int) -> None:
    if round_ < 1:
        raise ValueError(f"rounds are numbered from 1, got {round_}")

"""Syncer configuration: one frozen, validated object per syncer process.

Built by the CLI from flags (``diloco.syncer.cli``) or directly by tests; the
core and the loop receive it and never read flags or the environment.
A bad value fails here, at start, with a message naming the flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from diloco.wire.parts import auto_part_elems
from diloco.wire.schema import DEFAULT_PART_ELEMS

WEIGHTINGS = ("tokens", "steps", "equal")
FLUSH_MERGES = ("mean", "outer")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


@dataclass(frozen=True)
class SyncerConfig:
    """Round, quorum and outer-optimizer settings of one syncer.

    Attributes:
        islands: number of islands; ids are ``0 .. islands-1`` (``--islands``).
        quorum: K, the number of pushes that may close a round after the grace
            window (``--quorum``); 0 means "all islands".
        sync_every: H, inner steps between two syncs of the same fragment
            (``--sync-every``).
        outer_lr: outer Nesterov learning rate (``--outer-lr``).
        outer_momentum: outer Nesterov momentum (``--outer-momentum``).
        quorum_timeout_s: seconds an attempt may wait for K pushes before it is
            dropped and re-pulled with ``attempt + 1`` (``--quorum-timeout-s``).
        grace_ms: milliseconds a round with at least K (but not all) pushes waits
            for the stragglers (``--grace-ms``).
        total_steps: last inner step; rounds beyond it are not opened; 0 means
            "no limit, finalize only when islands report done" (``--total-steps``).
        checkpoint_every: write a checkpoint every N commits; 0 only writes the
            final one (``--checkpoint-every``).
        weighting: ``tokens`` (default: a push weighs its tokens, which must then be > 0),
            ``steps`` (its local steps) or ``equal`` (1 each) (``--weighting``).
        dead_after_s: an island silent this long leaves the live set
            (``--dead-after-s``).
        final_timeout_s: seconds to wait for every FINAL_ACK (``--final-timeout-s``).
        join_timeout_s: finalization waits for every island id to have joined at least
            once, up to this many seconds after the syncer started; a fast island must not
            finish the run before a slow one has even connected (``--join-timeout-s``).
        max_fragments: upper bound on ``n_fragments`` a HELLO may declare; keeps
            a hostile HELLO from making the syncer allocate per-fragment state.
        part_elems: elements per part of every fragment stream (``--part-mib`` x 2**18), a
            multiple of 4096; 0 (the default, ``--part-mib auto``): chosen from the plan's
            fragment sizes when the first HELLO fixes the layout (:meth:`parts_for`).
        max_fragment_bytes: fp32 bytes one fragment may hold (``--max-fragment-gib``); a
            plan above it is refused at HELLO with the fix.
        max_refusals: an island whose pushes are refused this many times in a row is
            evicted from rounds until it says HELLO again (``--max-refusals``).
        max_open_rounds: rounds open at once, committing ones included (``--max-open-rounds``):
            each holds one fragment's running sum, so this bounds the sums' memory; the round
            clock opens no further round (no PULL, so no push arrives for it) until one commits.
        max_gathering_rounds: open rounds still gathering pushes (not yet closed) at once
            (``--max-gathering-rounds``, at most ``max_open_rounds``): the next round opens only
            once the rounds before it have all their pushes (are committing, or wait to), so the
            sums filling at once hold this many fragments, while a committing round's sum is
            already the fragment's next value. Islands with one snapshot slot never push two
            training rounds at once anyway; the flush's rounds then stream one after another.
        quant_block: elements per scale of ``int8`` / ``q4`` pushes (``--quant-block``); an
            island with another block size is refused at HELLO.
        flush_merge: how flush rounds merge (``--flush-merge``): ``mean`` (default) moves the
            value by the weighted mean of the final deltas, so the final cut is exactly the
            islands' weighted mean whatever the outer optimizer; ``outer`` takes the same outer
            step as a training round. No inner step follows a flush to correct an outer
            step's extrapolation (lr > 1, momentum): it would land in the final model as is.
    """

    islands: int
    quorum: int = 0
    sync_every: int = 100
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    quorum_timeout_s: float = 600.0
    grace_ms: float = 2000.0
    total_steps: int = 0
    checkpoint_every: int = 1
    weighting: str = "tokens"
    dead_after_s: float = 120.0
    final_timeout_s: float = 600.0
    join_timeout_s: float = 600.0
    max_fragments: int = 4096
    part_elems: int = 0
    max_fragment_bytes: int = 32 << 30
    quant_block: int = 64
    max_refusals: int = 5
    max_open_rounds: int = 2
    max_gathering_rounds: int = 1
    init_lanes: int = 1
    """Second connections island 0 may open for INIT (``--init-lanes``, 0 or 1; WELCOME says it)."""
    flush_merge: str = "mean"
    island_keys: tuple[tuple[int, str], ...] = ()
    """Curve mode: fixed ``(island id, Z85 public key)`` bindings (``--island-keys``); empty: first use."""
    max_tokens_per_step: int = 1 << 24
    """Tokens one local step may claim; a push's tokens are clamped to it times its (clamped) local steps
    (``--max-tokens-per-step``)."""
    max_steps_factor: int = 4
    """A push's local steps are clamped to this many times H (``--sync-every``)."""
    weight_factor: float = 4.0
    """A push weighs at most this many times the lower median weight per local step of the round's
    other pushes (or of the latest attempt's), times its own clamped steps (``--max-weight-factor``)."""
    norm_clip_factor: float = 8.0
    """A push part whose RMS is above this many times the fragment's reference RMS is folded scaled
    down to it (clipped; ``robust.py``, ``--norm-clip-factor``)."""
    norm_hard_factor: float = 64.0
    """A push part (fp32, bf16, or low-bit once dequantized) whose RMS is above this many times the
    fragment's reference RMS (the median of the previous round) is refused (``robust.py``,
    ``--norm-refuse-factor``)."""

    def __post_init__(self) -> None:
        def need(ok: bool, flag: str, what: str) -> None:
            if not ok:
                raise ConfigError(f"{flag}: {what}")

        need(isinstance(self.islands, int) and self.islands >= 1, "--islands", f"must be >= 1, got {self.islands}")
        need(
            isinstance(self.quorum, int) and 0 <= self.quorum <= self.islands,
            "--quorum",
            f"must be in [1, --islands={self.islands}] (or 0 for all), got {self.quorum}",
        )
        need(isinstance(self.sync_every, int) and self.sync_every >= 1, "--sync-every", f"must be >= 1, got {self.sync_every}")
        need(math.isfinite(self.outer_lr) and self.outer_lr > 0, "--outer-lr", f"must be finite and > 0, got {self.outer_lr}")
        need(0.0 <= self.outer_momentum < 1.0, "--outer-momentum", f"must be in [0, 1), got {self.outer_momentum}")
        need(math.isfinite(self.quorum_timeout_s) and self.quorum_timeout_s > 0, "--quorum-timeout-s", f"must be > 0, got {self.quorum_timeout_s}")
        need(math.isfinite(self.grace_ms) and self.grace_ms >= 0, "--grace-ms", f"must be >= 0, got {self.grace_ms}")
        need(isinstance(self.total_steps, int) and self.total_steps >= 0, "--total-steps", f"must be >= 0, got {self.total_steps}")
        need(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0, "--checkpoint-every", f"must be >= 0, got {self.checkpoint_every}")
        need(self.flush_merge in FLUSH_MERGES, "--flush-merge", f"must be one of {FLUSH_MERGES}, got {self.flush_merge!r}")
        need(self.weighting in WEIGHTINGS, "--weighting", f"must be one of {WEIGHTINGS}, got {self.weighting!r}")
        need(math.isfinite(self.dead_after_s) and self.dead_after_s > 0, "--dead-after-s", f"must be > 0, got {self.dead_after_s}")
        need(math.isfinite(self.final_timeout_s) and self.final_timeout_s > 0, "--final-timeout-s", f"must be > 0, got {self.final_timeout_s}")
        need(math.isfinite(self.join_timeout_s) and self.join_timeout_s >= 0, "--join-timeout-s", f"must be >= 0, got {self.join_timeout_s}")
        need(self.max_fragments >= 1, "max_fragments", "must be >= 1")
        need(self.init_lanes in (0, 1) and not isinstance(self.init_lanes, bool), "--init-lanes",
             f"must be 0 or 1, got {self.init_lanes!r}")
        need(isinstance(self.part_elems, int) and not isinstance(self.part_elems, bool) and (self.part_elems == 0 or (
             self.part_elems > 0 and self.part_elems % 4096 == 0 and self.part_elems * 4 <= (128 << 20))),
             "--part-mib", f"must be auto or give whole 16 KiB parts of at most 128 MiB, got {self.part_elems} elements")
        need(self.quant_block in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), "--quant-block",
             f"must be a power of two in [8, 4096], got {self.quant_block}")
        need(isinstance(self.max_refusals, int) and self.max_refusals >= 1, "--max-refusals",
             f"must be >= 1, got {self.max_refusals}")
        need(isinstance(self.max_open_rounds, int) and self.max_open_rounds >= 1, "--max-open-rounds",
             f"must be >= 1, got {self.max_open_rounds}")
        need(isinstance(self.max_gathering_rounds, int) and 1 <= self.max_gathering_rounds <= self.max_open_rounds,
             "--max-gathering-rounds", f"must be in [1, --max-open-rounds ({self.max_open_rounds})], "
             f"got {self.max_gathering_rounds}")
        need(isinstance(self.max_tokens_per_step, int) and self.max_tokens_per_step >= 1, "--max-tokens-per-step",
             f"must be >= 1, got {self.max_tokens_per_step}")
        need(self.max_steps_factor >= 1, "max_steps_factor", f"must be >= 1, got {self.max_steps_factor}")
        need(math.isfinite(self.weight_factor) and self.weight_factor >= 1, "--max-weight-factor",
             f"must be >= 1, got {self.weight_factor}")
        need(math.isfinite(self.norm_hard_factor) and self.norm_hard_factor >= 1, "--norm-refuse-factor",
             f"must be >= 1, got {self.norm_hard_factor}")
        need(1 <= self.norm_clip_factor <= self.norm_hard_factor, "--norm-clip-factor",
             f"must be in [1, --norm-refuse-factor {self.norm_hard_factor:g}], got {self.norm_clip_factor}")
        need(self.max_fragment_bytes >= 4096, "--max-fragment-gib", f"must be > 0, got {self.max_fragment_bytes} bytes")

    @property
    def max_part_elems(self) -> int:
        """The largest part of this run: the fixed ``--part-mib``, or the automatic size's cap
        (what budgets and wire limits use before the layout is known)."""
        return self.part_elems or DEFAULT_PART_ELEMS

    def parts_for(self, fragment_numel: Sequence[int]) -> int:
        """The run's part size for a plan of these fragment sizes: the fixed ``--part-mib``, or
        :func:`diloco.wire.parts.auto_part_elems` under the default cap (the cap itself when no
        size is known)."""
        if self.part_elems or not any(fragment_numel):
            return self.max_part_elems
        return auto_part_elems(fragment_numel, DEFAULT_PART_ELEMS)

    @property
    def effective_quorum(self) -> int:
        """K with the "0 means all islands" default resolved."""
        return self.quorum if self.quorum > 0 else self.islands

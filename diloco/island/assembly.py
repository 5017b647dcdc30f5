"""A value from the syncer arriving part by part: where it lands, how far it is, its digest.

Owned by the island client's I/O thread (``diloco.island.inbox``); no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco import wire
from diloco.digest import FragmentDigest

__all__ = ["Assembly", "ReceiveTarget"]

ReceiveTarget = Callable[[int, str, bool], "tuple[list[torch.Tensor] | None, int]"]
"""``(fragment, dtype, busy) -> (flat views or None, arrival)``, called on the I/O thread at
the first part of every value of a fragment: where it may land directly (the island's anchors:
one flat view per tensor in plan order; never when ``busy``, another stream of the fragment
arriving), or None for a pooled buffer; and the value's arrival number for that fragment."""


@dataclass
class Assembly:
    """A BCAST or FINAL arriving part by part into one flat view per tensor."""

    header: wire.Bcast | wire.Final
    views: list[torch.Tensor] | None
    """Where the parts land; None: a FINAL of a fragment whose final value is already in (a resend):
    its parts are checked and dropped, so a resend costs no buffer and never writes a value in use."""
    arrival: int = 0
    next_part: int = 0
    digest: FragmentDigest | None = None
    """The fp32 BCAST's digest as its parts land (only once we said we are done: a held FINAL
    may name this value, ``diloco.island.inbox``); None otherwise."""

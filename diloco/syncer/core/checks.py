"""Validation helpers of the syncer's core: the refusal value and schema checks.

Separate from the rules (``admission.py``, ``pushes.py``...) so those read as protocol
transitions. A check raises :class:`Refused` before any state is touched; the coordinator
turns it into one log line and an ERROR to the sender.
"""

from __future__ import annotations

import math

from diloco.syncer.core.records import TensorSpec

__all__ = ["Dropped", "Refused", "check_schema"]


class Refused(Exception):
    """A message broke a protocol rule; raised before any state is changed.

    Attributes:
        code: short machine-readable reason, sent in ERROR (e.g. ``stale_attempt``).
        reason: one human-readable line for the log and the ERROR.
    """

    def __init__(self, code: str, reason: str, *, fragment: int = -1, round: int = 0, quiet: bool = False) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.fragment = fragment
        """The fragment / round of a refused PUSH the island must act on (``stale_base``)."""
        self.round = round
        self.quiet = quiet
        """Not logged above DEBUG nor answered: a later part of a push whose part 0 was refused."""


class Dropped(Refused):
    """A refusal answered with nothing: replays and messages from a foreign routing id.

    Telling a replayer why (or anything at all) would only help it; the log line stays."""


MAX_NAME_CHARS = 1024
MAX_NDIM = 8


def check_schema(schema: object, max_fragment_bytes: int, what: str) -> tuple[TensorSpec, ...]:
    """Validate the schema an INIT part 0 declares: non-empty, unique non-empty names, sane shapes,
    and a total within ``max_fragment_bytes`` of fp32; returns it as ``(name, "float32", shape)``."""
    if not isinstance(schema, tuple) or not schema:
        raise Refused("bad_schema", f"{what}: part 0 must declare the fragment's schema")
    names: set[str] = set()
    total = 0
    out: list[TensorSpec] = []
    for entry in schema:
        name, shape = entry
        if not name or len(name) > MAX_NAME_CHARS or name in names:
            raise Refused("bad_schema", f"{what}: bad or duplicate tensor name {name[:80]!r}")
        names.add(name)
        if len(shape) > MAX_NDIM or any(d < 0 or d > max_fragment_bytes for d in shape):
            raise Refused("bad_schema", f"{what}: tensor {name[:80]!r} has shape {tuple(shape)[:10]}")
        numel = math.prod(shape)
        total += numel
        if total * 4 > max_fragment_bytes:
            raise Refused("fragment_too_large", f"{what}: more than {max_fragment_bytes} bytes of fp32")
        out.append((name, "float32", tuple(int(d) for d in shape)))
    if total == 0:
        raise Refused("bad_schema", f"{what}: the fragment holds no elements")
    return tuple(out)

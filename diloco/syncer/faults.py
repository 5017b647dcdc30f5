"""A test-only fault hook of the syncer loop: lose chosen outgoing messages on purpose.

Off unless ``YETO_TEST_FAULTS`` is set (never in production; the loop logs a warning
when it is). The value is a comma-separated list of rules ``MODE:KIND:N``:

* ``KIND`` is ``BCAST``, ``CUT`` (a BCAST of an initial cut), ``FINAL``, ``PULL`` or
  ``BCAST_DONE`` (a BCAST to an island that said it is done: the value a held FINAL names; such
  a BCAST counts as a ``BCAST`` too);
* ``N`` (1-based) picks the N-th message of that kind the loop sends;
* ``MODE`` ``drop`` loses it silently (as a TCP reset loses what the kernel still held:
  no send error, the syncer never learns), ``fail`` makes it look like a send error
  (``EHOSTUNREACH``: the loop abandons it and reports it to the state).

So the tests and ``scripts/soak`` exercise both recovery paths: the state's resend after
a reported loss, and the protocol's own repair of a silent one (``stale_base``, the
value resent at a quorum-timeout re-pull).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from diloco.syncer.core.records import Outgoing, OutStream
from diloco.wire import Pull

log = logging.getLogger(__name__)

ENV = "YETO_TEST_FAULTS"
KINDS = ("BCAST", "CUT", "FINAL", "PULL", "BCAST_DONE")
MODES = ("drop", "fail")


@dataclass
class FaultHook:
    """Counts outgoing messages per kind and says which to lose (``None``: send it)."""

    rules: dict[tuple[str, int], str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    fired: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str) -> FaultHook:
        rules: dict[tuple[str, int], str] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            parts = item.split(":")
            if len(parts) != 3 or parts[0] not in MODES or parts[1] not in KINDS or not parts[2].isdigit():
                raise ValueError(f"{ENV}: bad rule {item!r}, expected MODE:KIND:N with MODE in {MODES}, "
                                 f"KIND in {KINDS}")
            rules[(parts[1], int(parts[2]))] = parts[0]
        return cls(rules)

    @classmethod
    def from_env(cls) -> FaultHook | None:
        spec = os.environ.get(ENV, "")
        if not spec:
            return None
        hook = cls.parse(spec)
        log.warning("%s=%s: the syncer will lose chosen messages ON PURPOSE (tests only)", ENV, spec)
        return hook

    def pick(self, kinds: list[str]) -> str | None:
        """Count one message of each of ``kinds`` (it is all of them); the mode of the first rule
        that fires, or None (send it)."""
        modes = [self.take(k) for k in kinds]
        return next((m for m in modes if m is not None), None)

    def take(self, kind: str) -> str | None:
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        mode = self.rules.get((kind, n))
        if mode is not None:
            self.fired.append(f"{mode}:{kind}:{n}")
            log.warning("fault hook: %s %s #%d", mode, kind, n)
        return mode


def kinds_of(o: OutStream | Outgoing, after_done: bool) -> list[str]:
    """The fault kinds an outgoing message counts as (none: never lost on purpose).
    ``after_done``: a BCAST whose value a held FINAL would name (``BCAST_DONE``)."""
    if isinstance(o, OutStream):
        return ["CUT" if o.cut else o.kind] + (["BCAST_DONE"] if o.kind == "BCAST" and after_done else [])
    return ["PULL"] if isinstance(o.header, Pull) else []

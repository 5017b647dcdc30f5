"""Who may claim an island id, and how often anyone may say HELLO: the syncer's admission gate.

Pure rules, no I/O, used by ``sessions.py`` (a HELLO is checked against them before any state
changes) and tested with plain values:

* **Keys own island ids** (Curve mode, where every message carries the client's
  authenticated public key).  An id is bound to one key, either by an allow-list file
  (``--island-keys``: lines ``ID = Z85-PUBLIC-KEY``) or by first use; first-use bindings are
  saved in the checkpoint and restored on ``--resume``.  A HELLO for an id from another key,
  and a key that already owns another id, are refused.  In HMAC and insecure modes there is
  no per-island key: every key holder is trusted with every id (docs/SECURITY.md).
* **HELLO rate limit**: each sender (its key in Curve mode, else its routing id) may say
  HELLO ``burst`` times at once and then once per ``1 / rate`` seconds; beyond that the
  HELLO is dropped unanswered.  The table of senders has a fixed size (least recently seen
  senders are forgotten first), so a HELLO flood costs a bounded amount of memory.
"""

from __future__ import annotations

import logging
from collections import OrderedDict


log = logging.getLogger(__name__)

MAX_SENDERS = 4096
"""Senders whose HELLO budget is remembered (fixed memory under a flood)."""


class Gate:
    """Key bindings and HELLO budgets of one syncer.

    Args:
        allow_list: fixed bindings (``--island-keys``); None: first-use binding.
        rate: HELLOs per second a sender earns; burst: HELLOs it may send at once.
    """

    def __init__(self, allow_list: dict[int, str] | None = None, rate: float = 0.5, burst: int = 4) -> None:
        self.fixed = allow_list is not None
        self.bindings: dict[int, str] = dict(allow_list or {})
        self.rate, self.burst = rate, burst
        self._budgets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self.rate_limited = 0

    def key_problem(self, island: int, key: str) -> str | None:
        """Why ``key`` may not claim ``island`` (None: it may). ``key`` empty: no per-island keys."""
        if not key:
            return None
        owner = self.bindings.get(island)
        if owner is not None and owner != key:
            how = "--island-keys" if self.fixed else "first use"
            return f"island id {island} belongs to another key (bound by {how}); this key is {key[:8]}..."
        if owner is None and self.fixed:
            return f"island id {island} is not in --island-keys"
        for other, k in self.bindings.items():
            if k == key and other != island:
                return f"this key ({key[:8]}...) owns island id {other}, not {island}"
        return None

    def bind(self, island: int, key: str) -> None:
        """Record a first-use binding (after an accepted HELLO)."""
        if key and island not in self.bindings:
            self.bindings[island] = key
            log.info("island id %d bound to key %s... (first use)", island, key[:8])

    def allow_hello(self, sender: bytes, now: float) -> bool:
        """Spend one HELLO of ``sender``'s budget; False when it has none left."""
        tokens, last = self._budgets.pop(sender, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self._budgets[sender] = (tokens - 1.0 if ok else tokens, now)
        while len(self._budgets) > MAX_SENDERS:
            self._budgets.popitem(last=False)
        if not ok:
            self.rate_limited += 1
        return ok

    def restore(self, saved: dict[str, str]) -> None:
        """First-use bindings from a checkpoint (an allow-list file takes precedence)."""
        if self.fixed:
            return
        for ident, key in saved.items():
            self.bindings.setdefault(int(ident), str(key))

    def to_json(self) -> dict[str, str]:
        return {str(i): k for i, k in sorted(self.bindings.items())}

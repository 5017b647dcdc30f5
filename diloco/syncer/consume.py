"""Whether a commit may give the old value's pages back as it passes them (``CommitPart.consume``).

A commit writes the next value where the round's sum was, so the old value lives until the
commit lands and dies then: for that moment the syncer holds the fragment twice, and the next
round's sum fills beside both. When nothing but the commit reads the old value, each part's old
pages can go as soon as that part's new value is written (``hostmem.release_pages``), and the
syncer never holds more than values plus the sums.

The core says when it may (``Merge.start_commit``: no part can fail, no checkpoint pins the value,
no digest or final cut reads it, and it holds back cuts and resends of that fragment until the
commit lands). This driver makes the last check, on the loop thread, after the turn's streams have
started (so every reader that exists holds a view of the value): the value's storage must have no
other tensor or array over it (``hostmem.sole_owner``), the fp32 payloads of that version being
dropped from the shared cache first (a stream already holding their list keeps the value whole).
Then no stream of that version starts until the commit lands (``payloads.payload_source`` refuses
it; the new version follows to every island).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from diloco.hostmem import sole_owner
from diloco.syncer.core.work import CommitPart, Work
from diloco.syncer.encoded import EncodedCache

log = logging.getLogger(__name__)


class Consumption:
    """The commits waiting for the end of the turn, and the (fragment, version) values being consumed.

    Args:
        cache: the shared fp32 payloads of published values (``encoded.EncodedCache``).
    """

    def __init__(self, cache: EncodedCache) -> None:
        self.cache = cache
        self.held: list[CommitPart] = []
        """Commit items the core marked ``consume``: submitted after the turn's streams started."""
        self.versions: set[tuple[int, int]] = set()
        """(fragment, version) of old values their commit gives back: no stream of them may start."""
        self._decided: dict[tuple[int, int], bool] = {}
        self.consumed = 0
        self.kept = 0
        """Commits that consumed their old value, and those the check kept it for (someone read it)."""

    def route(self, work: Iterable[Work], submit: Callable[[Work], None]) -> None:
        """Submit ``work``, holding back commit items marked ``consume`` for :meth:`release`."""
        for w in work:
            if isinstance(w, CommitPart) and w.consume:
                self.held.append(w)
            else:
                submit(w)

    def release(self, submit: Callable[[Work], None]) -> None:
        """Decide and submit the held commit items; call once the turn's streams have started."""
        held, self.held = self.held, []
        for w in held:
            key = (w.fragment, w.version - 1)
            if key not in self._decided:
                self._decided[key] = self._decide(w, key)
            w.consume = self._decided[key]
            if w.consume and w.loan is not None:
                w.loan.offer()  # nothing else reads the old value: its buffer may hold the next sum
            submit(w)

    def _decide(self, w: CommitPart, key: tuple[int, int]) -> bool:
        # The shared payloads go either way: held here, they would be a reader themselves. A stream
        # that holds their list keeps the value whole, and one that starts meanwhile encodes anew.
        self.cache.drop(*key)
        if sole_owner(w.value):
            self.versions.add(key)
            self.consumed += 1
            return True
        self.kept += 1
        log.debug("commit of fragment %d keeps version %d whole: a stream or job still reads it", *key)
        return False

    def prune(self, versions: tuple[int, ...]) -> None:
        """Forget the values whose fragment has moved past them (``versions``: the current ones)."""
        for key in [k for k in self._decided if k[0] >= len(versions) or versions[k[0]] > k[1]]:
            del self._decided[key]
            self.versions.discard(key)


__all__ = ["Consumption"]

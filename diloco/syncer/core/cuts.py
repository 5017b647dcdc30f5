"""Cuts, fragment by fragment, and the values islands claim to hold (docs/PROTOCOL.md, "Initial cut").

Every live island that has not received the current cut gets each fragment as soon as that
fragment holds a value, so a cut overlaps island 0's INIT at fragment granularity: a
BCAST(cut=True) stream of the fragment's current value, or a HELD notice instead of the bytes
when the island's HELLO claimed exactly that value (``Hello.holds``: the ``tensor_digest`` of the
fp32 value it holds, equal to the digest of the syncer's value at the current version). The
syncer's digest of a value is computed once per (fragment, version) on the data plane
(:class:`~.work.DigestFragment` with ``claim``), and only when an island claims something; until
it is known, that fragment of that island's cut waits.

Why a claim is as safe as the cut: a matching claim tells the island that its own value is the
one the cut would carry (for a bf16 broadcast, the exact fp32 value instead of its rounding).
A claim decides only whether bytes travel to the claimant: one that lies, or collides, leaves
the liar with its own weights and changes nothing at the syncer (its pushes are deltas against
its own anchor, checked like any other). A claim that does not match gets the cut as before,
which is what happens once rounds have changed the value.

:class:`Cuts` owns no table: it reads the islands (``Sessions``), the fragments
(``FragmentBook``: a fragment's cached value digest is the book's) and the open rounds, and
appends what to send to ``out``. No I/O.
"""

from __future__ import annotations

import logging

from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.effects import Journal, Out, bcast, pull
from diloco.syncer.core.records import FragmentRecord, IslandRecord, Outgoing
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.syncer.core.work import DigestFragment, Result
from diloco.wire import Held

log = logging.getLogger("diloco.syncer.core")


class Cuts:
    """The cut rules: what each island still owed a cut gets now, and the digests claims need.

    Args:
        sessions, book, rounds: the tables a cut reads (and the islands' cut progress it changes).
        journal: where the data-plane digests of claimed values are queued.
    """

    def __init__(self, sessions: Sessions, book: FragmentBook, rounds: RoundBook, journal: Journal) -> None:
        self.sessions = sessions
        self.book = book
        self.rounds = rounds
        self.journal = journal

    def deliver(self, out: list[Out]) -> None:
        """Give every live island the fragments of its cut that hold a value (stream or HELD);
        once its whole cut is given, the pulls of open rounds it is a member of follow."""
        fragments = self.book.fragments
        if not fragments:
            return
        for isl in self.sessions.live():
            if isl.cut_sent:
                continue
            for frag in fragments:
                if frag.index in isl.cut_given or not frag.initialised or frag.consuming:
                    continue  # a value being consumed by its commit: this fragment of the cut gets the next one
                claim = isl.claim(frag.index)
                if claim:
                    known = self._digest_of(frag)
                    if known is None:
                        continue  # being computed: this fragment of the cut waits for it
                    if known == claim:
                        # A cut carries the fragment's last committed round (0: none yet), so an
                        # island that joins late knows which rounds went by without it.
                        out.append(Outgoing(isl.peer, Held(fragment=frag.index, version=frag.version,
                                                           round=frag.round)))
                        isl.cut_held.append(frag.index)
                        isl.cut_given.add(frag.index)
                        continue
                out.append(bcast(isl, frag, frag.round, cut=True))
                isl.cut_given.add(frag.index)
            if len(isl.cut_given) < len(fragments):
                continue
            isl.cut_sent = True
            self._log_claims(isl)
            # A member that reconnected (or revived) mid-round is asked again,
            # after its cut so that it pushes against the current anchor.
            for r in self.rounds.in_order():
                if isl.island in r.members and isl.island not in r.pushes and not r.closed:
                    out.append(pull(isl.peer, r))

    def _digest_of(self, frag: FragmentRecord) -> str | None:
        """The digest of ``frag``'s current value if known (``""``: it could not be computed);
        None while the data plane computes it (queued here on first need)."""
        known = frag.value_digest
        if known is not None and known[0] == frag.version:
            return known[1]
        if frag.digesting != frag.version:
            assert frag.value is not None and frag.layout is not None
            frag.digesting = frag.version
            self.journal.work.append(DigestFragment(frag.index, frag.value, frag.layout, frag.version, claim=True))
        return None

    def on_digest(self, work: DigestFragment, result: Result) -> None:
        """The data plane's digest of a claimed-about value: cached for its version unless the
        value moved on meanwhile (a commit, a restarted INIT: the next cut asks again)."""
        frag = self.book.fragments[work.fragment]
        if frag.digesting == work.version:
            frag.digesting = -1
        if frag.value is not work.value or frag.version != work.version:
            return
        if result.error:
            log.error("digest of fragment %d version %d failed (claims of it get the cut): %s", work.fragment,
                      work.version, result.error)
        frag.value_digest = (work.version, result.digest or "")

    @staticmethod
    def _log_claims(isl: IslandRecord) -> None:
        """One line per completed cut of an island that claimed values: which matched."""
        claimed = [f for f, d in enumerate(isl.claims) if d]
        if not claimed:
            return
        held = sorted(isl.cut_held)
        differ = [f for f in claimed if f not in isl.cut_held]
        if held:
            log.info("island %d: fragments %s match the syncer's values, no cut needed%s", isl.island,
                     spans(held), f"; fragments {spans(differ)} differ: cut" if differ else "")
        else:
            log.info("island %d: fragments %s differ from the syncer's values: cut", isl.island, spans(differ))


def spans(fragments: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``."""
    runs: list[list[int]] = []
    for f in sorted(fragments):
        if runs and f == runs[-1][1] + 1:
            runs[-1][1] = f
        else:
            runs.append([f, f])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)

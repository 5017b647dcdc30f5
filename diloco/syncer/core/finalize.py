"""The end of a run: flush rounds, the final cut, its acknowledgements (docs/PROTOCOL.md,
"Flush rounds", "Finalization").

:class:`Finalize` owns the run's phase (``running`` -> ``final`` -> ``done``), the flush
fragments still to merge once every island finished training, and the finalization's clock:
which islands must acknowledge the final cut, when it is sent again to those that have not, when
it times out, and the exit code. It decides from the records it is handed (islands, fragments)
and changes only its own fields; the coordinator sends what it decides. No I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from diloco.protocol.schedule import Schedule
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.records import FragmentRecord, IslandRecord

log = logging.getLogger("diloco.syncer.core")


class Finalize:
    """Phase, flush rounds left, and the final cut's expected acknowledgements.

    Args:
        config: ``--total-steps``, ``--final-timeout-s``, ``--quorum-timeout-s``, ``--join-timeout-s``.
    """

    def __init__(self, config: SyncerConfig) -> None:
        self.config = config
        self.phase = "running"  # running -> final -> done
        self.flush_left: set[int] | None = None
        """Fragments still to flush once every island finished (None: not started)."""
        self.final_deadline = 0.0
        self.final_expected: frozenset[int] = frozenset()
        """Islands that were sent the final cut and must acknowledge it."""
        self.final_resend_at = 0.0
        self.exit_code: int | None = None

    @property
    def finished(self) -> bool:
        return self.phase == "done"

    def finished_training(self, isl: IslandRecord) -> bool:
        """Whether ``isl`` said it is done, or reached ``--total-steps``."""
        total = self.config.total_steps
        return isl.done or (total > 0 and isl.last_step >= total)

    def start_flush(self, sched: Schedule) -> None:
        """Every island finished training: one flush round per fragment is left (once)."""
        if self.flush_left is None:
            self.flush_left = set(sched.flush_fragments())
            log.info("every island finished training: one flush round per fragment merges their last steps")

    def flushed(self, fragment: int) -> None:
        """The flush round of ``fragment`` committed."""
        if self.flush_left is not None:
            self.flush_left.discard(fragment)

    def due(self, now: float, initialised: bool, rounds_open: bool, live: Sequence[IslandRecord],
            islands: Sequence[IslandRecord], started_at: float | None) -> list[IslandRecord] | None:
        """Whether finalization begins now: every fragment initialised, no round open, every flush
        round committed, every live island (evicted ones aside) finished, and every island joined
        (or ``--join-timeout-s`` passed since ``started_at``). Returns the live islands not evicted
        (those the final cut waits for), or None while it is not due."""
        if not initialised or rounds_open or self.flush_left is None or self.flush_left:
            return None
        waited = [i for i in live if not i.evicted]
        if not waited or not all(self.finished_training(i) for i in waited):
            return None
        missing = [i.island for i in islands if not i.joined]
        if missing:
            if started_at is None or now - started_at < self.config.join_timeout_s:
                return None  # a slow island may still be starting: let it join the run
            log.warning("finalizing without islands %s: they never joined within --join-timeout-s=%.0fs",
                        missing, self.config.join_timeout_s)
        return waited

    def begin(self, now: float, expected: Sequence[IslandRecord]) -> None:
        """Enter the final phase: ``expected`` must acknowledge the final cut within ``--final-timeout-s``."""
        self.phase = "final"
        self.final_deadline = now + self.config.final_timeout_s
        self.final_resend_at = now + self.resend_s()
        self.final_expected = frozenset(i.island for i in expected)

    def resend_s(self) -> float:
        """Period of the FINAL resend to islands that have not acknowledged it."""
        return min(self.config.quorum_timeout_s, self.config.final_timeout_s / 3)

    def owes_final(self, isl: IslandRecord) -> bool:
        """Whether ``isl`` is waited for and has not acknowledged the final cut yet."""
        return self.phase == "final" and isl.island in self.final_expected and not isl.final_acked

    def resend_to(self, now: float, islands: Sequence[IslandRecord]) -> list[IslandRecord]:
        """Islands to send the final cut again now (its period elapsed, before the deadline): a FINAL
        lost without a send error (a connection reset) is never acknowledged otherwise."""
        if not (self.phase == "final" and now >= self.final_resend_at and now < self.final_deadline):
            return []
        self.final_resend_at = now + self.resend_s()
        out = []
        for i in sorted(self.final_expected):
            isl = islands[i]
            if not isl.final_acked and isl.alive:
                log.warning("island %d has not acknowledged the final cut: FINAL again", i)
                out.append(isl)
        return out

    def timed_out(self, now: float, islands: Sequence[IslandRecord]) -> str | None:
        """The reason to finish with exit code 1 when the deadline passed unacknowledged (else None)."""
        if not (self.phase == "final" and now >= self.final_deadline):
            return None
        missing = sorted(i for i in self.final_expected if not islands[i].final_acked)
        log.error("finalization timed out: no FINAL_ACK from islands %s", missing)
        return f"finalization timed out waiting for islands {missing}"

    def verdict(self, islands: Sequence[IslandRecord], fragments: Sequence[FragmentRecord],
                versions: tuple[int, ...]) -> tuple[int, str] | None:
        """(exit code, reason) once every expected island acknowledged and every digest is known: 0
        when each installed exactly the syncer's final values, else 1 naming who differs. None while
        acknowledgements or digests are missing."""
        if self.phase != "final" or not all(islands[i].final_acked for i in self.final_expected):
            return None
        if any(f.digest is None for f in fragments):
            return None  # the data plane is still hashing the final values
        bad = []
        for i in sorted(self.final_expected):
            got = islands[i].final_digests
            if not got:
                log.warning("island %d acknowledged the final cut without digests: not checked", i)
                continue
            wrong = [f.index for f, d in zip(fragments, got) if d != f.digest]
            if wrong:
                bad.append((i, wrong))
        if bad:
            for i, wrong in bad:
                log.error("island %d installed a final cut different from the syncer's: fragments %s differ",
                          i, wrong[:16])
            return 1, f"final cut mismatch on islands {[i for i, _ in bad]}"
        log.info("every island acknowledged the final cut %s (digests checked)", list(versions))
        return 0, "training finished"

    def finish(self, code: int) -> None:
        """The run is over with exit ``code``."""
        self.phase = "done"
        self.exit_code = code

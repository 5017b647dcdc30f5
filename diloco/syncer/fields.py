"""The attributes and cross-module methods of :class:`diloco.syncer.state.SyncerState`, declared once.

``SyncerState`` is one class whose rules live in several modules (``state``, ``admission``,
``recovery``, ``rounds``), each a mixin. Every mixin derives from :class:`StateFields`, so a
type checker sees, in every module, the same state the constructor in ``state.py`` builds and
the methods the other modules define; nothing here exists at run time beyond the annotations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from diloco.syncer.core.book import FragmentBook
from diloco.syncer.core.config import SyncerConfig
from diloco.outer import OuterHyper
from diloco.syncer.core.work import Work
from diloco.syncer.core.records import FragmentRecord, IslandRecord, Outgoing, OutStream, RoundRecord
from diloco.wire import HostBufferPool

if TYPE_CHECKING:
    from diloco.syncer.core.effects import Out


class StateFields:
    """Declarations only: the values are set in ``SyncerState.__init__``."""

    config: SyncerConfig
    syncer_id: int
    pool: HostBufferPool
    book: FragmentBook
    hyper: OuterHyper
    flush_hyper: OuterHyper
    merge_stats: tuple[float, float] | None
    next_open: int
    commits: int
    changed_training: int
    changed_flush: int
    flush_left: set[int] | None
    checkpoint_due: bool
    digest_seed: int
    islands: list[IslandRecord]
    fingerprint: str | None
    fragments: list[FragmentRecord]
    rounds: dict[int, RoundRecord]
    next_commit: int
    phase: str
    refusals: int
    events: list[dict[str, Any]]
    work: list[Work]
    pinned: set[int]
    over_budget_since: float | None
    peers: dict[bytes, int]
    hellos_seen: dict[tuple[int, int], None]
    superseded: list[bytes]
    final_expected: frozenset[int]
    final_resend_at: float

    if TYPE_CHECKING:
        @property
        def n_fragments(self) -> int: ...
        @property
        def initialised(self) -> bool: ...
        def versions(self) -> tuple[int, ...]: ...
        def live(self) -> list[IslandRecord]: ...
        def merged_summary(self) -> dict[str, int]: ...
        def _bcast(self, isl: IslandRecord, frag: FragmentRecord, round_: int, cut: bool) -> OutStream: ...
        def _pull(self, r: RoundRecord, island: int) -> Outgoing: ...
        def _final(self, isl: IslandRecord, frag: FragmentRecord) -> OutStream: ...
        def _finals(self, isl: IslandRecord) -> list[Out]: ...
        def _size_pool(self) -> None: ...
        def _restart_attempt(self, r: RoundRecord, now: float, out: list[Out], why: str,
                             resend: bool = False) -> None: ...
        def _count_refusal(self, rec: IslandRecord, why: str, now: float, out: list[Out]) -> None: ...
        def _drop_commit(self, r: RoundRecord, now: float, out: list[Out]) -> None: ...
        def _maybe_start_grace(self, r: RoundRecord, now: float) -> None: ...
        def _start_commits(self, now: float, out: list[Out]) -> None: ...
        def _drop_laggards(self, r: RoundRecord, now: float, out: list[Out]) -> bool: ...
        def ready(self) -> list[IslandRecord]: ...
        def _fits(self, fragment: int) -> bool: ...

"""Where the syncer's memory goes: the buffers of the fragments' state, allocated and accounted here.

Every buffer that grows with the model is one of these kinds, each with a budget
(docs/ARCHITECTURE.md, "Memory"), logged with its size once the fragments are known:

* ``values``: one fp32 value per fragment (4 B/param), always; a published value is never
  written again (a commit writes the next value where the round's sum was);
* ``momentum``: one fp32 buffer per fragment, only with ``--outer-momentum > 0``, allocated
  zero (lazily mapped pages) by the first commit that needs it and updated in place;
* ``sums``: one running fp32 sum per open round, at most ``--max-open-rounds`` fragments;
* ``spare``: at most one old value a consuming commit gave up while no other round had a sum,
  kept resident for the next round's sum instead of being released (:meth:`FragmentBook.keep_spare`):
  a sum in resident pages folds 3-8 x faster than one in fresh, kernel-zeroed pages
  (``scripts/probe_fold.py``). It stands in for that sum, so it costs no more than the sums' budget;
* ``reuse``: a sum may lie in an old buffer up to 1/64 larger than its fragment (:func:`reusable`),
  so a value may too: at most ``min(largest - size, size // 64)`` bytes more per fragment.

Beyond these, only parts: received parts held for the data plane (two per worker, plus zmq's
``RCVHWM`` per island) and a few bf16 parts per stream encoded on demand (``payloads.py``).

The budget is kept by counting, not by trusting every reader: each buffer counts in
:attr:`FragmentBook.live_bytes` until the last tensor over it dies, so a superseded value a
BCAST stream or the checkpoint writer still reads counts too, and the next round opens only
when its sum fits (``RoundBook.sum_fits``). Buffers are ``numpy`` arrays of their own (never
pooled): above glibc's mmap threshold (8 MiB in the syncer, `hostmem.py`) each is its own mapping, given back to the OS when freed.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref

import numpy as np
import torch

from diloco.syncer.core.checks import Refused
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.records import FragmentRecord
from diloco.syncer.core.work import REUSE_SLACK, reusable
from diloco.wire import HostBufferPool

log = logging.getLogger(__name__)

OVER_BUDGET_WAIT_S = 30.0
"""Longest a round waits to open for superseded fragment buffers to be let go (``RoundBook.sum_fits``)."""

IDLE_PARTS = 4
"""Idle part-sized buffers the state's pool may keep (``--part-mib`` each); fragment buffers never go there."""


class FragmentBook:
    """The fragments table (value, momentum, version per fragment, and the layout fingerprint that
    fixed them); allocates their value, momentum and sum buffers and says what they cost.

    Args:
        config: the syncer's settings (momentum, part size, open rounds).
        pool: the state's pool of part-sized buffers; its idle bytes are capped at
            :data:`IDLE_PARTS` parts (set here).
    """

    def __init__(self, config: SyncerConfig, pool: HostBufferPool) -> None:
        self.config = config
        self.pool = pool
        self.part_elems = config.max_part_elems
        """Elements per part of every stream: fixed with the layout (:meth:`fix_layout`), the largest
        this run may use until then."""
        self.pool.max_idle_bytes = IDLE_PARTS * self.part_elems * 4
        self._logged = False
        self._lock = threading.Lock()
        self.live_bytes = 0
        """Bytes of fragment-sized buffers (values, sums, momenta) alive now, whoever holds them:
        a buffer counts until the last tensor over it dies (a stream or checkpoint may outlive
        the state's own reference)."""
        self.live_buffers = 0
        self.peak_bytes = 0
        self.fingerprint: str | None = None
        """Layout fingerprint fixed by the first HELLO (or the checkpoint)."""
        self.declared_numel: tuple[int, ...] = ()
        """Fragment sizes the HELLO that fixed the layout declared (empty: none, or resumed); INIT
        must match them, so the part size chosen from them is the one a resume chooses."""
        self.fragments: list[FragmentRecord] = []
        """One record per fragment of the plan, in fragment order (empty until the layout is fixed)."""
        self.spare: torch.Tensor | None = None
        """An old value kept resident for the next round's sum (:meth:`keep_spare`); None: none."""
        self.spares_taken = 0
        self.pinned: set[int] = set()
        """Fragments an in-flight checkpoint has still to write (``unpin`` as it writes them): a commit
        with momentum does not update theirs in place."""

    # ------------------------------------------------------------------ the table

    @property
    def n_fragments(self) -> int:
        return len(self.fragments)

    @property
    def initialised(self) -> bool:
        """Every fragment has its value (INIT copied in, or restored)."""
        return bool(self.fragments) and all(f.initialised for f in self.fragments)

    def versions(self) -> tuple[int, ...]:
        """The current version of every fragment, in fragment order."""
        return tuple(f.version for f in self.fragments)

    def committing(self) -> bool:
        """Whether a commit is in flight (it swaps a fragment's buffers when it lands)."""
        return any(f.committing for f in self.fragments)

    def fix_layout(self, fingerprint: str, n_fragments: int, fragment_numel: tuple[int, ...] = ()) -> None:
        """The first HELLO fixes the fingerprint, the fragments (records without values) and the part
        size (``SyncerConfig.parts_for`` of the sizes it declared)."""
        self.fingerprint = fingerprint
        self.fragments = [FragmentRecord(index=f) for f in range(n_fragments)]
        self.declared_numel = fragment_numel
        self._fix_parts(fragment_numel)

    def _fix_parts(self, fragment_numel: tuple[int, ...]) -> None:
        self.part_elems = self.config.parts_for(fragment_numel)
        self.pool.max_idle_bytes = IDLE_PARTS * self.part_elems * 4
        log.info("parts of %.2f MiB (%s)", self.part_elems * 4 / 2**20, f"--part-mib {self.part_elems / 2**18:g}"
                 if self.config.part_elems else "--part-mib auto: about 1/128 of the largest fragment, 1-32 MiB")

    def adopt_table(self, fingerprint: str, fragments: list[FragmentRecord]) -> None:
        """Take a resumed run's fingerprint and fragment records (their buffers already adopted)."""
        self.fingerprint = fingerprint
        self.fragments = fragments
        self._fix_parts(tuple(f.layout.numel if f.layout is not None else 0 for f in fragments))
        if self.initialised:
            self.log_budget()

    def pin_all(self) -> None:
        """A checkpoint starts reading every fragment: each stays pinned until it is written."""
        self.pinned = set(range(len(self.fragments)))

    def is_pinned(self, fragment: int) -> bool:
        """Whether the checkpoint in flight has still to write ``fragment``."""
        return fragment in self.pinned

    def unpin(self, fragments: set[int]) -> None:
        """The checkpoint in flight has written (and let go of) these fragments."""
        self.pinned -= fragments

    def unpin_all(self) -> None:
        """The checkpoint in flight is written: no fragment is pinned."""
        self.pinned.clear()

    def check_plan(self, fingerprint: str, n_fragments: int, fragment_numel: tuple[int, ...]) -> None:
        """Refuse a HELLO whose plan is not this run's (fingerprint, fragment count, fragment sizes) or
        whose fragments exceed what this syncer accepts (the refusal names the fix)."""
        if self.fingerprint is not None:
            if fingerprint != self.fingerprint:
                raise Refused(
                    "fingerprint_mismatch",
                    f"layout fingerprint {fingerprint[:64]} != syncer's {self.fingerprint[:64]}",
                )
            if n_fragments != self.n_fragments:
                raise Refused("fragments_mismatch", f"n_fragments {n_fragments} != syncer's {self.n_fragments}")
        if not fragment_numel:
            return
        if len(fragment_numel) != n_fragments or any(n <= 0 for n in fragment_numel):
            raise Refused("bad_fragments", f"{len(fragment_numel)} fragment sizes for {n_fragments} fragments")
        limit = self.config.max_fragment_bytes
        biggest = max(fragment_numel) * 4
        if biggest > limit:
            need = math.ceil(sum(fragment_numel) * 4 / limit)
            raise Refused(
                "fragment_too_large",
                f"a fragment holds {biggest / 2**30:.2f} GiB of fp32, this syncer accepts at most "
                f"{limit / 2**30:.2f} GiB per fragment (--max-fragment-gib): use more fragments "
                f"(YETO_DILOCO_FRAGMENTS >= {max(need, n_fragments + 1)}) or raise --max-fragment-gib",
            )
        if self.fragments and all(f.layout is not None for f in self.fragments):
            have = tuple(f.layout.numel for f in self.fragments if f.layout is not None)
            if have != tuple(fragment_numel):
                raise Refused("fragments_mismatch", f"fragment sizes {list(fragment_numel)[:8]} != {list(have)[:8]}")

    # ------------------------------------------------------------------ buffers

    def fresh(self, numel: int, what: str = "") -> torch.Tensor:
        """An uninitialised flat fp32 buffer of ``numel`` elements (a value or a sum), never pooled:
        its own mapping, given back to the OS when its last tensor dies (counted in ``live_bytes``)."""
        return self._track(np.empty(numel, dtype=np.float32))

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """Count a flat fp32 buffer allocated elsewhere (a resumed checkpoint's) until ``t`` dies."""
        nbytes = t.numel() * 4
        with self._lock:
            self.live_bytes += nbytes
            self.live_buffers += 1
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        fin = weakref.finalize(t, self._freed, nbytes)
        fin.atexit = False
        return t

    def _track(self, base: np.ndarray) -> torch.Tensor:
        nbytes = base.nbytes
        with self._lock:
            self.live_bytes += nbytes
            self.live_buffers += 1
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        handle = base[:]  # the tensor's storage keeps this view alive: its death means "no tensor uses it"
        fin = weakref.finalize(handle, self._freed, nbytes)
        fin.atexit = False
        return torch.from_numpy(handle)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes
            self.live_buffers -= 1

    def keep_spare(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (an old value no one else reads, every page still resident) for the next
        round's sum; it replaces any spare kept before (at most one is ever kept)."""
        self.spare = buffer

    def take_spare(self, numel: int) -> torch.Tensor | None:
        """The spare's first ``numel`` elements for a new sum, when :func:`reusable`; else None, and a
        spare that does not fit this sum is let go (the caller allocates a fresh sum instead of it)."""
        spare, self.spare = self.spare, None
        if spare is None or not reusable(spare.numel(), numel):
            return None
        self.spares_taken += 1
        return spare[:numel]

    def drop_spare(self) -> None:
        """Let the spare go (its mapping goes back to the OS): no further round will open."""
        self.spare = None

    @property
    def spare_bytes(self) -> int:
        """Bytes of the spare (counted in ``live_bytes``; the next sum takes them)."""
        return self.spare.numel() * 4 if self.spare is not None else 0

    def ensure_momentum(self, frag: FragmentRecord) -> None:
        """Give ``frag`` its zero momentum if it has none (the first commit with momentum > 0)."""
        if frag.momentum is not None:
            return
        assert frag.layout is not None
        frag.momentum = self._track(np.zeros(frag.layout.numel, dtype=np.float32))
        frag.momentum_absmax = [0.0] * len(frag.value_absmax)
        log.info("fragment %d: momentum allocated (%.1f MiB, zero)", frag.index, frag.layout.numel * 4 / 2**20)

    def budget(self) -> dict[str, int]:
        """Bytes each buffer kind may hold at most, for the fragments of this run."""
        fragments = self.fragments
        sizes = [f.layout.numel * 4 for f in fragments if f.layout is not None]
        largest = max(sizes, default=0)
        momentum = sum(sizes) if self.config.outer_momentum > 0 else 0
        return {
            "values": sum(sizes),
            "momentum": momentum,
            "sums": min(self.config.max_open_rounds, len(sizes)) * largest,
            "reuse": sum(min(largest - n, n // 4 // REUSE_SLACK * 4) for n in sizes),
        }

    def limit_bytes(self) -> int:
        """Most bytes of fragment-sized buffers alive at once: values, momentum, ``--max-open-rounds`` sums
        (a spare stands in for one of them), and the reuse slack."""
        return sum(self.budget().values())

    def log_budget(self) -> None:
        """Log each buffer kind with its size, once every fragment's size is known."""
        fragments = self.fragments
        if self._logged or not fragments or any(f.layout is None for f in fragments):
            return
        self._logged = True
        b = self.budget()
        log.info("syncer buffers: values %.1f MiB, momentum %.1f MiB%s, sums <= %.1f MiB (--max-open-rounds %d; "
                 "one of them may be a resident spare between rounds), reuse slack <= %.1f MiB; total <= %.1f MiB; "
                 "plus parts of %.1f MiB (about 2 per island and 2 per data-plane worker held at once)",
                 b["values"] / 2**20, b["momentum"] / 2**20, "" if b["momentum"] else " (--outer-momentum 0: none)",
                 b["sums"] / 2**20, self.config.max_open_rounds, b["reuse"] / 2**20, sum(b.values()) / 2**20,
                 self.part_elems * 4 / 2**20)


def zeros(numel: int) -> torch.Tensor:
    """A flat fp32 zero buffer whose pages are mapped only when written (calloc: no resident memory
    until then, so a snapshot of a fragment without momentum costs nothing)."""
    return torch.from_numpy(np.zeros(numel, dtype=np.float32))

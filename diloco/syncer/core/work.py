"""The data plane's work items and their results: what the core asks the workers to do.

The core (:mod:`diloco.syncer.core`) appends these records to its work queue when it accepts a
message that carries bytes (a PUSH or INIT part), when it commits a round, and when it
finalizes; the data plane (``diloco.syncer.dataplane``) runs each one on the worker that owns
its part and hands back a :class:`Result`, which the core takes through
``Coordinator.on_result``. Plain records: nothing here runs a kernel or touches a socket.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.digest import FragmentDigest
from diloco.outer import OuterHyper
from diloco.syncer.core.robust import PartBound
from diloco.wire import Opened, Payload
from diloco.wire.parts import FragmentLayout

__all__ = ["REUSE_SLACK", "reusable", "COMMIT_SPAN_ELEMS", "CommitPart", "commit_span", "DigestFragment", "DigestSpan",
           "EncodePart", "FoldPart", "InitPart", "PageLoan", "Result", "RoundSum", "Work"]


REUSE_SLACK = 64
"""A buffer of ``n`` elements may hold a sum of ``m <= n <= m + m // REUSE_SLACK`` elements (:func:`reusable`)."""


def reusable(have: int, want: int) -> bool:
    """Whether an old buffer of ``have`` elements may hold a new sum of ``want``: large enough and at
    most 1/:data:`REUSE_SLACK` larger, so the bytes a value can hold beyond its own size are bounded
    (``FragmentBook.budget()["reuse"]``)."""
    return want <= have <= want + want // REUSE_SLACK


class PageLoan:
    """The buffer of an old value its commit consumes, lent to the next round's sum: pages the
    commit has passed stay resident for that sum's folds instead of going back to the kernel and
    coming in fresh (each fresh page is zeroed by the kernel: a fold into fresh memory runs 3-8 x
    slower than into resident memory, ``scripts/probe_fold.py``).

    Part ``k`` (elements ``[k E, (k+1) E)``, the part size ``E`` every fragment shares) is
    *passed* once the commit wrote its new value and no longer reads the old one. At that moment
    the commit keeps its pages when a sum has taken the loan or the loan is ``keep`` (no other
    round had a sum when the commit started, so the whole buffer may stay as the book's spare,
    ``FragmentBook.keep_spare``, within the budget of one sum); else it releases them
    (``release``, the data plane's ``hostmem.release_pages``), as consumption always did. The
    first fold of part ``k`` into a sum on this buffer waits until part ``k`` is passed.
    Offered (:meth:`offer`) only once the loop decided the commit consumes (``consume.py``): a kept
    old value is never lent. Thread-safe: the commit's workers pass, the loop takes, folds wait."""

    def __init__(self, buffer: torch.Tensor, part_elems: int, keep: bool = False) -> None:
        self.buffer = buffer
        self.keep = keep
        """Keep every passed part's pages even untaken: the buffer becomes the spare once the commit lands."""
        self.n_parts = -(-buffer.numel() // part_elems) if buffer.numel() else 0
        self.offered = False
        self.taken = False
        self._passed = [False] * self.n_parts
        self._cond = threading.Condition()

    def offer(self) -> None:
        """The loop: the commit consumes the old value, so its buffer may be lent."""
        self.offered = True

    def take(self, numel: int) -> torch.Tensor | None:
        """The loop: the first ``numel`` elements of the buffer for a new sum, or None when it is not
        offered, already taken or not :func:`reusable` for ``numel``. Parts passed before this keep no
        pages unless the loan is ``keep`` (they were released): the sum's folds fault them in."""
        with self._cond:
            if not self.offered or self.taken or not reusable(self.buffer.numel(), numel):
                return None
            self.taken = True
        return self.buffer[:numel]

    def pass_part(self, k: int, lo: int, hi: int, release: Callable[[torch.Tensor, int, int], object]) -> None:
        """A commit worker: part ``k`` (elements ``[lo, hi)``) of the old value is written over and
        read no more. Its pages go (``release``) unless a sum took the loan or it is ``keep``; then
        waiting folds go on."""
        with self._cond:
            if self.taken or self.keep:
                self._passed[k] = True
                self._cond.notify_all()
                return
        release(self.buffer, lo, hi)  # untaken: the pages go, as a consuming commit's always did
        with self._cond:
            self._passed[k] = True  # a sum that took the loan meanwhile writes into fresh pages
            self._cond.notify_all()

    @property
    def spare(self) -> torch.Tensor | None:
        """Once every part is passed: the whole resident buffer when the loan is ``keep``, offered and
        untaken (for ``FragmentBook.keep_spare``); else None."""
        with self._cond:
            whole = self.keep and self.offered and not self.taken and all(self._passed)
        return self.buffer if whole else None

    @property
    def all_passed(self) -> bool:
        """Whether the commit passed every part (nothing is left to lend)."""
        with self._cond:
            return all(self._passed)

    def wait_passed(self, k: int, timeout_s: float) -> bool:
        """A fold worker: block until part ``k`` is passed (at most ``timeout_s``); whether it is.
        Parts beyond the old value's own (a larger fragment never takes the loan) count as passed."""
        if k >= self.n_parts:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self._passed[k], timeout=timeout_s)


@dataclass
class RoundSum:
    """The running weighted fp32 sum of one attempt of one round.

    ``started[k]`` says whether part ``k`` has a first contribution yet (the first fold
    writes ``w * d``, later ones add): touched only by the worker that owns part ``k``.
    ``void`` is set by the loop when the attempt is dropped: queued folds then skip.
    ``fold_order[k]`` is the island order of part ``k``'s folds, recorded at dispatch.
    ``absmax[k]`` is ``max |s|`` over part ``k`` after its latest fold (``inf``: unknown or overflowed),
    written by the worker that owns part ``k``; the commit's overflow bound reads it.
    """

    round: int
    attempt: int
    fragment: int
    flat: torch.Tensor
    n_parts: int
    started: list[bool] = field(default_factory=list)
    fold_order: list[list[int]] = field(default_factory=list)
    void: bool = False
    absmax: list[float] = field(default_factory=list)
    loan: PageLoan | None = None
    """The consumed old value ``flat`` lies in (:class:`PageLoan`): a part's first fold waits until
    its commit passed it. None: ``flat`` is the sum's own memory, or every fold returned."""
    lent: bool = field(default=False, init=False)
    """Whether ``flat`` came from a :class:`PageLoan` (kept for the event log after ``loan`` is cleared)."""
    spare: bool = False
    """Whether ``flat`` is the book's resident spare (``FragmentBook.take_spare``)."""

    def __post_init__(self) -> None:
        self.started = [False] * self.n_parts
        self.fold_order = [[] for _ in range(self.n_parts)]
        self.absmax = [math.inf] * self.n_parts
        self.lent = self.loan is not None


@dataclass
class FoldPart:
    sum: RoundSum
    part: int
    lo: int
    opened: Opened
    weight: int
    island: int
    quant: tuple[str, int] | None = None
    """(kind, block) for an int8 / q4 push part (codes + scales), None for fp32 / bf16 segments."""
    n: int = 0
    """Elements of the part (needed to read a q4 payload, whose codes pack two per byte)."""
    bound: PartBound | None = None
    """Element and norm bounds of an fp32 / bf16 part (``robust.py``); None: finiteness only."""


@dataclass
class InitPart:
    fragment: int
    part: int
    lo: int
    opened: Opened
    value: torch.Tensor


COMMIT_SPAN_ELEMS = 8 << 20
"""Elements one commit work item covers at least (32 MiB of fp32, whole parts): a commit reads
resident buffers, so it is cut for few large kernels and few results to the loop, not by the
wire's part size (``--part-mib auto`` gives parts from 1 MiB)."""


def commit_span(part_elems: int) -> int:
    """Parts per commit work item for parts of ``part_elems`` elements (at least one)."""
    return max(1, COMMIT_SPAN_ELEMS // part_elems)


@dataclass
class CommitPart:
    round: int
    fragment: int
    part: int
    value: torch.Tensor
    momentum: torch.Tensor | None
    """None with momentum 0 (no buffer); else updated in place unless ``new_momentum`` is given."""
    new_momentum: torch.Tensor | None
    """Where the new momentum goes when a checkpoint in flight still reads the old one (or the
    overflow bound could not be proven): the result is then checked finite before it is kept."""
    sum: RoundSum
    total_weight: int
    hyper: OuterHyper
    layout: FragmentLayout
    part_elems: int
    encode_dtypes: tuple[str, ...]
    version: int
    seed: int = 0
    """Chunk-digest seed of the broadcast payloads (``wire.digest_seed`` of the key)."""
    check: bool = True
    """Measure the result (finite, largest magnitudes); False when the state proved it finite
    (``kernels.step_bounds``) and keeps the bounds itself."""
    parts: int = 1
    """Consecutive parts ``[part, part + parts)`` this item commits (each cut by ``layout`` and
    ``part_elems``): one work item covers :data:`COMMIT_SPAN_ELEMS` whatever the part size, and each part still
    gets its own payload and magnitudes (``Result.parts``)."""
    consume: bool = False
    """Give the old value's pages of each part back to the kernel once the part's new value is
    written (``hostmem.release_pages``): the state proved the step finite (``check`` is False, so
    no part can fail) and the loop found no other reader of the value
    (``loop.SyncerLoop._submit_work``). The old value is dead after the commit either way; this
    lets its memory go while the commit runs, instead of at its end."""
    loan: PageLoan | None = None
    """With ``consume``: the old value's buffer as lent to the next round's sum; each part is
    passed to it (kept or released there) instead of released here."""


@dataclass
class EncodePart:
    fragment: int
    version: int
    dtype: str
    part: int
    value: torch.Tensor
    layout: FragmentLayout
    part_elems: int
    seed: int = 0
    sink: dict[int, Payload] | None = None
    """Where the loop puts the payload (one stream's parts, encoded on demand), instead of the
    shared cache of fp32 parts; None: the cache."""


@dataclass
class DigestFragment:
    """Hash a fragment's value (``diloco.digest.tensor_digest`` of its tensors): its final value,
    to check the digests islands send with FINAL_ACK, or (``claim``) its value at ``version``, to
    check what a joining island claims to hold. One sequential xxh3-128 pass over the value in
    place (memory speed, no copy), so it runs on one worker: the one of part ``fragment``."""

    fragment: int
    value: torch.Tensor
    layout: FragmentLayout
    version: int = -1
    claim: bool = False

    @property
    def part(self) -> int:
        return self.fragment


@dataclass
class DigestSpan:
    """Feed elements ``[lo, hi)`` of an INIT value (parts up to ``end``, exclusive) to ``hasher``,
    the fragment's streamed digest (``initdigest.py``); the result's ``digest`` is its hex digest
    once the whole value was fed. The core has at most one span of a fragment out at a time, so
    the hasher sees the stream in order; any worker may run it (the least loaded)."""

    fragment: int
    value: torch.Tensor
    lo: int
    hi: int
    end: int
    hasher: FragmentDigest

    @property
    def part(self) -> int:
        return self.fragment


Work = FoldPart | InitPart | CommitPart | EncodePart | DigestFragment | DigestSpan


@dataclass
class Result:
    """What a work item came to; ``error`` is a one-line refusal reason (None: fine)."""

    work: Work
    error: str | None = None
    payloads: dict[str, Payload] = field(default_factory=dict)
    seconds: float = 0.0
    digest: str | None = None
    absmax: tuple[float, float] = (math.inf, math.inf)
    """``max |value|`` and ``max |momentum|`` over the part written (INIT); ``inf``: not measured."""
    parts: list[tuple[dict[str, Payload], tuple[float, float]]] = field(default_factory=list)
    """A commit: per part of its span, in order, the broadcast payloads and ``(max |value|,
    max |momentum|)`` of the result (``nan``: not measured, an unchecked commit)."""

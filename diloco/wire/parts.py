"""Parts: how one fragment travels as a sequence of bounded messages.

A fragment of a large model is gigabytes.  Sent as one zmq message it would be
held whole by zmq on both ends, block the socket for seconds and make every
piece of work on it (digests, copies, the merge) one long stall.  So every
fragment stream (INIT, PUSH, BCAST, FINAL) is cut into **parts**:

* the fragment's tensors, concatenated in plan order, form one flat *stream*
  of ``numel`` elements;
* part ``k`` carries elements ``[k * E, min((k + 1) * E, numel))``, where
  ``E = part_elems`` is fixed for the whole run (the syncer's ``--part-mib``, by
  default :func:`auto_part_elems` of the plan's fragment sizes, announced in
  WELCOME; a multiple of :data:`PART_ALIGN_ELEMS`); a fragment has
  ``ceil(numel / E)`` parts;
* inside a part the stream is split at tensor boundaries into *segments*, each
  sent as a 1-D tensor named by its canonical tensor, in stream order.

Because every island cuts at the same offsets, part ``k`` of two islands'
pushes covers the same elements, which is what lets the syncer fold each part
into its running sum as it arrives.  A receiver checks a part's segments
against the fragment's schema with :meth:`FragmentLayout.check_part` before it
reads a payload byte.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from diloco.wire.schema import ITEMSIZE, PART_ALIGN_ELEMS, TensorMeta

__all__ = ["AUTO_MIN_PART_ELEMS", "AUTO_PARTS_PER_FRAGMENT", "FragmentLayout", "auto_part_elems", "check_part_elems"]

AUTO_PARTS_PER_FRAGMENT = 128
"""An automatic part is about this fraction of the largest fragment (:func:`auto_part_elems`)."""

AUTO_MIN_PART_ELEMS = 1 << 18
"""The smallest automatic part: 1 MiB of fp32, one chunk frame."""


def check_part_elems(part_elems: int) -> str | None:
    """Why ``part_elems`` is not a valid part size (None if it is)."""
    if isinstance(part_elems, bool) or not isinstance(part_elems, int) or part_elems <= 0:
        return f"part_elems must be a positive int, got {part_elems!r}"
    if part_elems % PART_ALIGN_ELEMS:
        return f"part_elems {part_elems} is not a multiple of {PART_ALIGN_ELEMS}"
    return None


def auto_part_elems(fragment_numel: Sequence[int], cap_elems: int) -> int:
    """The part size a plan of these fragment sizes gets when none is fixed: the largest fragment
    over :data:`AUTO_PARTS_PER_FRAGMENT`, rounded down to a power of two, at least
    :data:`AUTO_MIN_PART_ELEMS` and at most ``cap_elems`` (a valid part size).

    A received part is held a few times per island and per data-plane worker, so part bytes are
    what the syncer holds beyond values and sums: tied to the fragment they stay a fixed small
    share of the model (under 1/128 of a fragment each) at every model size, while the largest
    models keep ``cap_elems``. Deterministic in its inputs: a resumed run gets the same size."""
    if check_part_elems(cap_elems) is not None:
        raise ValueError(check_part_elems(cap_elems))
    want = max(fragment_numel, default=0) // AUTO_PARTS_PER_FRAGMENT
    size = AUTO_MIN_PART_ELEMS
    while size * 2 <= min(want, cap_elems):
        size *= 2
    return min(size, cap_elems)


@dataclass(frozen=True)
class FragmentLayout:
    """The flat stream of one fragment: tensor names, shapes and where each starts.

    Built from a schema ``((name, shape), ...)`` in plan order; pure arithmetic, no
    tensors.  Used by senders to slice parts out of tensors and by receivers to
    check and place them.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        starts, total = [], 0
        for shape in self.shapes:
            starts.append(total)
            total += math.prod(shape)
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "numel", total)

    @classmethod
    def of(cls, schema: Sequence[tuple[str, Sequence[int]]]) -> FragmentLayout:
        return cls(tuple(n for n, _ in schema), tuple(tuple(int(d) for d in s) for _, s in schema))

    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def n_parts(self, part_elems: int) -> int:
        return -(-self.numel // part_elems)

    def part_range(self, k: int, part_elems: int) -> tuple[int, int]:
        lo = k * part_elems
        return lo, min(self.numel, lo + part_elems)

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(tensor index, start, end)`` element ranges (within each tensor) covering stream ``[lo, hi)``."""
        out = []
        i = bisect.bisect_right(self.starts, lo) - 1
        pos = lo
        while pos < hi:
            start = self.starts[i]
            end_t = start + math.prod(self.shapes[i])
            take = min(hi, end_t)
            if take > pos:
                out.append((i, pos - start, take - start))
            pos = take
            i += 1
        return out

    def slice_part(
        self, tensors: Sequence[tuple[str, torch.Tensor]], k: int, part_elems: int
    ) -> list[tuple[str, torch.Tensor]]:
        """The segments of part ``k`` as ``(name, 1-D view)``: zero-copy for contiguous tensors."""
        lo, hi = self.part_range(k, part_elems)
        return [(self.names[i], tensors[i][1].reshape(-1)[a:b]) for i, a, b in self.segments(lo, hi)]

    def flat_views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Named tensors (plan shapes) viewing one flat buffer of the whole stream."""
        return [(n, flat[s : s + math.prod(shape)].view(shape)) for n, s, shape in zip(self.names, self.starts, self.shapes)]

    def _check_index(self, k: int, n_parts: int, part_elems: int) -> str | None:
        want_parts = self.n_parts(part_elems)
        if n_parts != want_parts:
            return f"n_parts {n_parts}, the fragment has {want_parts} parts of {part_elems} elements"
        if not 0 <= k < n_parts:
            return f"part {k} outside [0, {n_parts})"
        return None

    def check_part(self, metas: Sequence[TensorMeta], k: int, n_parts: int, part_elems: int, dtype: str) -> str | None:
        """Why a received part does not fit this stream (None if it does): index, count,
        segment names, lengths and dtype, all before any payload byte is read."""
        problem = self._check_index(k, n_parts, part_elems)
        if problem:
            return problem
        lo, hi = self.part_range(k, part_elems)
        segs = self.segments(lo, hi)
        if len(metas) != len(segs):
            return f"part {k}: {len(metas)} segments, expected {len(segs)}"
        if dtype not in ITEMSIZE:
            return f"unknown dtype {dtype!r}"
        for meta, (i, a, b) in zip(metas, segs):
            if meta.name != self.names[i]:
                return f"part {k}: segment {meta.name[:80]!r} where {self.names[i][:80]!r} was expected"
            if tuple(meta.shape) != (b - a,):
                return f"part {k}: segment {meta.name[:80]!r} has shape {tuple(meta.shape)}, expected ({b - a},)"
            if meta.dtype != dtype:
                return f"part {k}: segment {meta.name[:80]!r} is {meta.dtype}, expected {dtype}"
        return None

    def check_quant_part(self, metas: Sequence[TensorMeta], k: int, n_parts: int, part_elems: int, kind: str,
                         block: int) -> str | None:
        """Why a low-bit push part does not fit (None if it does): exactly ``codes`` (uint8)
        and ``scales`` (bf16) of the sizes the part's element count gives."""
        problem = self._check_index(k, n_parts, part_elems)
        if problem:
            return problem
        lo, hi = self.part_range(k, part_elems)
        n = hi - lo
        codes = n if kind == "int8" else -(-n // 2)
        want = [("codes", "uint8", (codes,)), ("scales", "bfloat16", (-(-n // block),))]
        got = [(m.name, m.dtype, tuple(m.shape)) for m in metas]
        if got != want:
            return f"part {k}: {kind} payload {got[:3]}, expected {want}"
        return None

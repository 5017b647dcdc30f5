"""A push's delta computed part by part while it is sent, instead of held whole.

A fragment of a large model is gigabytes; materialising ``snapshot − anchor`` for a whole
fragment before sending it costs one more fragment of host memory. When the sync rank
holds every element of a fragment itself (a one-rank island, or every tensor whole on the
sync rank), the client asks a :class:`DeltaSource` for part ``k`` just before it encodes
it, and gets freshly computed deltas of that part only: memory is one part per part in
flight.

Contract: the snapshot and anchor views handed in must not change while the client may
still read them, i.e. until the push's ``sent`` event is set. The island guarantees it:
the snapshot slot is reused only after the fragment's commit is installed, and the anchor
of a fragment is rewritten only by the staging of that fragment, which waits for the event.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from diloco.wire.parts import FragmentLayout

__all__ = ["DeltaSource", "PartRing", "host_delta"]

log = logging.getLogger(__name__)


def host_delta(master: torch.Tensor, anchor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``master − anchor`` as a host fp32 tensor, written into ``out`` when given, else new. A
    master on a device is copied down once (into ``out``, or a fresh host tensor) and the anchor
    subtracted in place; a host master takes one pass."""
    if master.device.type == "cpu":
        return torch.sub(master, anchor, out=out)
    host = master.to("cpu") if out is None else out.copy_(master)
    return host.sub_(anchor)


class DeltaSource:
    """``snapshot − anchor`` of one fragment, by part, in plan order.

    Args:
        names: canonical tensor names in plan order.
        snaps: for each tensor, the flat fp32 snapshot (θ_push) of the whole tensor: host memory,
            or a device master that no longer moves (after the last step), copied down one part
            at a time.
        anchors: for each tensor, the flat fp32 anchor of the whole tensor.
    """

    def __init__(self, names: Sequence[str], snaps: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor]) -> None:
        if not len(names) == len(snaps) == len(anchors):
            raise ValueError("DeltaSource: names, snapshots and anchors differ in length")
        for s, a in zip(snaps, anchors):
            if s.dim() != 1 or a.dim() != 1 or s.numel() != a.numel():
                raise ValueError("DeltaSource: snapshots and anchors must be flat and of equal size")
        self.names = tuple(names)
        self._snaps = list(snaps)
        self._anchors = list(anchors)

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self._snaps)

    def slice_part(self, layout: FragmentLayout, k: int, part_elems: int,
                   out: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
        """Part ``k``'s segments (name, flat fp32 delta), computed now; what
        ``FragmentLayout.slice_part`` gives for materialised tensors. With ``out`` (a flat fp32
        buffer of at least the part's length, e.g. one of the client's ring) the segments are
        consecutive views of it, else fresh tensors."""
        if layout.names != self.names:
            raise ValueError("DeltaSource: the layout's tensors differ from the source's")
        lo, hi = layout.part_range(k, part_elems)
        if out is not None and (out.dtype != torch.float32 or out.numel() < hi - lo):
            raise ValueError(f"DeltaSource: out holds {out.numel()} {out.dtype}, part {k} needs {hi - lo} float32")
        segs, pos = [], 0
        for i, a, b in layout.segments(lo, hi):
            dst = None if out is None else out[pos : pos + b - a]
            segs.append((self.names[i], host_delta(self._snaps[i][a:b], self._anchors[i][a:b], dst)))
            pos += b - a
        return segs


    def materialize(self, shapes: Sequence[tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
        """The whole delta as fresh tensors of the given global shapes (plan order): for tests
        and tools; the client never does this (it costs one fragment of memory)."""
        return [(n, torch.sub(s.to("cpu"), a).view(shape))
                for n, s, a, shape in zip(self.names, self._snaps, self._anchors, shapes)]


class PartRing:
    """``size`` flat fp32 buffers of one part each: where the client computes a DeltaSource's
    parts. A buffer whose part was handed to zmq stays *held* (:meth:`hold`, with the part's
    ``MessageTracker``) until zmq released the part's frames; :meth:`take` hands out only a
    buffer no part in flight still reads, the oldest such first. The client computes a part only
    when fewer than ``window`` parts are in flight, so ``size = window`` always leaves one free.

    Parts are not released in the order they were taken (a short part below zmq's copy
    threshold is done at send, while a large part before it may still be queued on a slow
    link), so the next buffer is chosen by release, not by turn.

    Allocated at first use (the part size comes with WELCOME) and again if it changes: one
    budget line, ``size × part bytes``, whatever the model or the number of fragments."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"PartRing: size must be >= 1, got {size}")
        self.size = size
        self._bufs: list[torch.Tensor] = []
        self._held: list[Any] = []
        """Per buffer: the tracker of the part sent from it (anything with ``done``), or None."""
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * 4 for b in self._bufs)

    def take(self, part_elems: int) -> torch.Tensor:
        """A buffer of ``part_elems`` fp32 elements that no part in flight reads: the next one
        round robin whose part zmq released. Should every buffer be held (the caller broke the
        window), a fresh buffer outside the ring: never one zmq may still be sending."""
        if not self._bufs or self._bufs[0].numel() != part_elems:
            self._bufs = [torch.empty(part_elems, dtype=torch.float32) for _ in range(self.size)]
            self._held = [None] * self.size
            self._next = 0
        for i in range(self.size):
            j = (self._next + i) % self.size
            tracker = self._held[j]
            if tracker is None or tracker.done:
                self._held[j] = None
                self._next = (j + 1) % self.size
                return self._bufs[j]
        log.warning("PartRing: all %d part buffers are still in zmq's hands; a fresh one for this part", self.size)
        return torch.empty(part_elems, dtype=torch.float32)

    def hold(self, buf: torch.Tensor, tracker: Any) -> None:
        """``buf`` (from :meth:`take`) was handed to zmq in a part tracked by ``tracker``
        (a ``zmq.MessageTracker``, or anything with ``done``): not handed out again before it is
        done. A buffer not of the ring (or of a ring since reallocated) is ignored."""
        for j, b in enumerate(self._bufs):
            if b is buf:
                self._held[j] = tracker
                return

    def clear(self) -> None:
        self._bufs = []
        self._held = []

"""Where the parts of a value stream (BCAST, cut, FINAL) come from, without a copy of the model.

* fp32: zero-copy views of the published value plus their chunk digests, made once per
  (fragment, version) by the commit (or by :class:`EncodePart` after a resume) and shared by
  every island's stream through ``encoded.EncodedCache``: no memory beyond the value itself.
* bf16 (islands that push bf16 or a low-bit kind): each stream encodes its own parts on the data
  plane as it reaches them, at most :data:`ENCODE_AHEAD` parts ahead, and drops each part once it
  moved past it (zmq holds the frames until they are out). Nothing is cached per fragment, so a
  bf16 island costs a few half-size parts per stream, never half the model.

A stream keeps a reference to the value it reads: a value superseded meanwhile stays alive until
the stream ends, and counts against the fragment buffers' budget (``book.FragmentBook``). That
reference is always a view of its own (a payload's views, or :func:`lease`), so the loop can
tell whether anything still reads a value (``hostmem.sole_owner``) before a commit gives its
pages back (``CommitPart.consume``); a version being consumed starts no new stream.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Callable

import torch

from diloco.syncer.core.work import EncodePart, Work
from diloco.syncer.encoded import EncodedCache
from diloco.syncer.core.records import FragmentRecord, OutStream
from diloco.wire import Payload
from diloco.wire.parts import FragmentLayout

ENCODE_AHEAD = 2
"""Parts of a bf16 stream encoded ahead of the one being sent (each held until the stream passes it)."""

PayloadOf = Callable[[int], "Payload | None"]
"""Payload of part ``k`` of a stream, or None while it is not encoded yet."""


def lease(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` of its own: while it lives, ``hostmem.sole_owner(t)`` is False."""
    return t.view(t.shape)


def payload_source(o: OutStream, frag: FragmentRecord, part_elems: int, seed: int, cache: EncodedCache,
                   submit: Callable[[Work], None], consumed: Collection[tuple[int, int]] = ()) -> PayloadOf | None:
    """The parts of stream ``o`` of fragment ``frag``; None when its version is superseded (the
    island gets the newer one), is being consumed by its commit (``consumed``: (fragment, version)
    pairs; the new version follows) or a FINAL would race a commit."""
    assert frag.layout is not None
    if (o.fragment, o.version) in consumed:
        return None
    n = frag.layout.n_parts(part_elems)
    parts = cache.entries.get((o.fragment, o.version, o.wire_dtype))
    if parts is not None:
        return parts.__getitem__
    if frag.version != o.version or frag.value is None or frag.committing and o.kind == "FINAL":
        return None
    if o.wire_dtype != "float32":
        return on_demand(o, lease(frag.value), frag.layout, n, part_elems, seed, submit)
    parts = cache.entries[(o.fragment, o.version, o.wire_dtype)] = [None] * n
    held = lease(frag.value)
    for k in range(n):
        submit(EncodePart(o.fragment, o.version, o.wire_dtype, k, held, frag.layout, part_elems, seed))
    return parts.__getitem__


def on_demand(o: OutStream, value: torch.Tensor, layout: FragmentLayout, n: int, part_elems: int, seed: int,
              submit: Callable[[Work], None]) -> PayloadOf:
    """Parts of one bf16 stream, encoded as the stream reaches them; the loop files each result
    into the stream's own ``sink`` (``EncodePart.sink``)."""
    ready: dict[int, Payload] = {}
    asked = 0

    def payload_of(k: int) -> Payload | None:
        nonlocal asked
        for j in [j for j in ready if j < k]:
            del ready[j]  # sent: zmq holds its frames until they are out
        while asked < min(n, k + ENCODE_AHEAD):
            submit(EncodePart(o.fragment, o.version, o.wire_dtype, asked, value, layout, part_elems, seed, sink=ready))
            asked += 1
        return ready.get(k)

    return payload_of


__all__ = ["ENCODE_AHEAD", "PayloadOf", "lease", "on_demand", "payload_source"]

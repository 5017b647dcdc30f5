"""Encoded broadcast payloads of the syncer, shared by every island's stream of one value."""

from __future__ import annotations

from diloco.wire import Payload


class EncodedCache:
    """fp32 payload parts per (fragment, version, dtype), shared by every island's stream.

    fp32 parts are zero-copy views of the published value plus their digests, so they cost no
    memory beyond the value; bf16 parts are never cached (each stream encodes its own parts on
    demand, ``loop.SyncerLoop._on_demand``).  Streams keep their own reference to the part list, so pruning an
    old version never pulls bytes from under a send in progress.  Holds at most the current
    and the committing version of each fragment (:meth:`prune`)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, int, str], list[Payload | None]] = {}

    def put(self, fragment: int, version: int, dtype: str, n_parts: int, part: int, payload: Payload) -> None:
        self.entries.setdefault((fragment, version, dtype), [None] * n_parts)[part] = payload

    def drop(self, fragment: int, version: int) -> None:
        """Forget every payload of ``(fragment, version)`` (streams keep the lists they hold)."""
        for key in [k for k in self.entries if k[:2] == (fragment, version)]:
            del self.entries[key]

    def prune(self, current: tuple[int, ...]) -> None:
        """Drop payloads of versions that are neither current nor being committed (current + 1)."""
        for key in [k for k in self.entries if k[0] >= len(current) or k[1] not in (current[k[0]], current[k[0]] + 1)]:
            del self.entries[key]

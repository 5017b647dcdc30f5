"""Digest of an island's global parameters after the final cut, to prove islands ended equal.

After :meth:`diloco.island.boundary.Island.finish` every island holds the syncer's fp32 final
cut. Exporting every fragment again (the same gather the sync core uses for INIT) and hashing
the global fp32 tensors gives one hex string per fragment that must be identical across
islands, whatever their TP / PP / DP layout: a cheap, layout-independent end-to-end check of
export, apply and the final cut on a real run (ms-swift on a GPU, where no test harness can
look inside the ranks).

The export is collective over the island's group: every rank must call :func:`fragment_digests`
at the same point, and only the sync rank gets the result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)


def tensor_digest(tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over each tensor's name, dtype, shape and raw little-endian bytes, in order."""
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fragment_digests(island: Any) -> list[str] | None:
    """Export every fragment (fp32, global shapes) and hash it; collective over the island.

    Returns the per-fragment digests on the sync rank, None on every other rank. Fragments are
    exported one at a time, so the sync rank never holds more than one fragment.
    """
    digests: list[str] = []
    for f in range(island.plan.n_fragments):
        values = island.transfer.export_fragment(f, delta=False)
        if values is not None:
            digests.append(tensor_digest(values))
        del values
    return digests if island.is_sync else None


def write_digest_file(path: str, island_id: int, versions: Sequence[int], digests: Sequence[str]) -> None:
    """Write the digests as one JSON object, atomically (temporary file, then rename)."""
    total = hashlib.sha256("".join(digests).encode()).hexdigest()
    doc = {"island": island_id, "versions": list(versions), "fragments": list(digests), "digest": total}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
        fh.write("\n")
    os.replace(tmp, path)
    log.info("island %d: final digest %s (versions %s) written to %s", island_id, total[:16], list(versions), path)

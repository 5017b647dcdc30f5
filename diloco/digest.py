"""Digests of an island's global parameters, to prove islands (and the syncer) ended equal.

After :meth:`diloco.island.boundary.Island.finish` every island holds the syncer's fp32 final
cut. Exporting every fragment again (the same gather the sync core uses for INIT) and hashing
the global fp32 tensors gives one hex string per fragment that must be identical across
islands, whatever their TP / PP / DP layout, and equal to the same hash over the syncer's
final checkpoint: a cheap, layout-independent end-to-end check of export, apply and the
final cut — on CPU tests, the demo, and real ms-swift runs on GPUs alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


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


def combined_digest(fragment_digests: Sequence[str]) -> str:
    """One hex string for a whole model from its per-fragment digests."""
    return hashlib.sha256("".join(fragment_digests).encode()).hexdigest()


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


def checkpoint_digests(ckpt_dir: str | Path) -> tuple[list[int], list[str]]:
    """Versions and per-fragment digests of one syncer checkpoint directory (no pickle)."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt_dir)
    values = load_file(str(ckpt / "values.safetensors"))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    versions = [int(f["version"]) for f in manifest["fragments"]]
    digests = []
    for i, frag in enumerate(manifest["fragments"]):
        flat, start, named = values[str(i)], 0, []
        for name, _dtype, shape in frag["schema"]:
            n = 1
            for d in shape:
                n *= int(d)
            named.append((name, flat[start : start + n].view(tuple(shape))))
            start += n
        digests.append(tensor_digest(named))
    return versions, digests

"""Digests of an island's global parameters, to prove islands (and the syncer) ended equal.

After :meth:`diloco.island.boundary.Island.finish` every island holds the syncer's fp32 final
cut. Exporting every fragment again (the same gather the sync core uses for INIT) and hashing
the global fp32 tensors gives one hex string per fragment that must be identical across
islands, whatever their TP / PP / DP layout, and equal to the same hash over the syncer's
final checkpoint: a cheap, layout-independent end-to-end check of export, apply and the
final cut — on CPU tests, the demo, and real ms-swift runs on GPUs alike.

The digest of a fragment is xxh3-128 over, for each tensor in plan order, its name, its
dtype (``str(torch.float32)``), ``repr`` of its shape and its raw little-endian bytes. xxh3 is
not cryptographic: it checks that two honest parties hold the same bytes (every part on the
wire is already authenticated). It runs at memory speed (~20 GB/s on one core) and reads the
tensors in place (a ``memoryview`` of a numpy view: no ``.tobytes()`` copy).

Incremental API (the same result as hashing the whole fragment at once):

* :class:`StreamDigest`: ``begin(name, dtype, shape)`` at each tensor, ``update(t)`` with its
  bytes in order, in as many pieces as wanted, ``hexdigest()`` at the end;
* :class:`FragmentDigest`: for a fragment's flat fp32 stream (a ``wire.FragmentLayout``):
  ``update(flat_piece)`` with consecutive pieces of the stream (parts as they are installed);
  it begins each tensor when the stream reaches it. ``hexdigest()`` once all ``numel``
  elements were fed equals ``tensor_digest(layout.flat_views(value))``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash


def _raw(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor, without a copy when it is a contiguous CPU tensor."""
    flat = t.detach()
    if flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.to("cpu").contiguous()
    return memoryview(flat.reshape(-1).view(torch.uint8).numpy())


class StreamDigest:
    """xxh3-128 of tensors fed in order: :meth:`begin` each tensor, :meth:`update` its bytes."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def begin(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
        self._h.update(name.encode())
        self._h.update(str(dtype).encode())
        self._h.update(repr(tuple(int(d) for d in shape)).encode())

    def update(self, t: torch.Tensor) -> None:
        if t.numel():
            self._h.update(_raw(t))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class FragmentDigest:
    """The digest of one fragment's flat fp32 stream, fed piece by piece in stream order.

    Args:
        names: tensor names in plan order (``FragmentLayout.names``).
        shapes: their global shapes (``FragmentLayout.shapes``).
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        self._digest = StreamDigest()
        self._names = list(names)
        self._shapes = [tuple(int(d) for d in s) for s in shapes]
        self._sizes = [int(torch.Size(s).numel()) for s in self._shapes]
        self._tensor = 0  # index of the tensor the stream is in
        self._left = 0  # elements of it still to come (0: not begun)
        self.position = 0
        """Stream elements fed so far."""
        self.numel = sum(self._sizes)

    def update(self, flat: torch.Tensor) -> None:
        """Feed the next ``flat.numel()`` fp32 elements of the stream."""
        if flat.dtype != torch.float32:
            raise ValueError(f"FragmentDigest: the stream is float32, got {flat.dtype}")
        flat = flat.reshape(-1)
        pos, n = 0, flat.numel()
        if self.position + n > self.numel:
            raise ValueError(f"FragmentDigest: {self.position + n} elements fed, the fragment has {self.numel}")
        while pos < n or (self._left == 0 and self._tensor < len(self._sizes) and self._sizes[self._tensor] == 0):
            if self._left == 0:
                i = self._tensor
                self._digest.begin(self._names[i], torch.float32, self._shapes[i])
                self._left = self._sizes[i]
                if self._left == 0:  # an empty tensor: its header only
                    self._tensor += 1
                    continue
            take = min(self._left, n - pos)
            self._digest.update(flat[pos : pos + take])
            pos += take
            self._left -= take
            if self._left == 0:
                self._tensor += 1
        self.position += n

    def hexdigest(self) -> str:
        if self.position != self.numel:
            raise ValueError(f"FragmentDigest: {self.position} of {self.numel} elements fed")
        return self._digest.hexdigest()


def tensor_digest(tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """xxh3-128 over each tensor's name, dtype, shape and raw little-endian bytes, in order."""
    d = StreamDigest()
    for name, t in tensors:
        d.begin(name, t.dtype, tuple(t.shape))
        d.update(t)
    return d.hexdigest()


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

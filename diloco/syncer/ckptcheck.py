"""What a syncer checkpoint must prove before ``--resume`` trusts it: checksums and settings.

Pure functions, used by ``store.py`` (write and verify) and ``resume.py`` (choose and compare):

* **Checksums**: every tensor of a checkpoint (each fragment's value and momentum) has an
  xxh3-64 of its raw little-endian bytes in the manifest. A flipped bit, a truncated or
  swapped file fails :func:`verify_tensor`; so does any non-finite element (a NaN or inf
  written by a bug, or by someone editing the file and its checksum together).
* **Settings**: the manifest records the settings that shaped the state
  (:func:`settings_of`): the fragment plan (count and per-fragment sizes), the layout
  fingerprint, the outer optimizer (lr, momentum), H and the weighting. :func:`changed`
  names each one that differs from this run's configuration.

Hashing and the finiteness check stream through each tensor in bounded chunks (a few MiB of
temporaries whatever the model size); they run on the checkpoint writer's thread or at start,
never on the control loop.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from diloco.syncer.core.config import SyncerConfig

CHUNK_ELEMS = 4 << 20
"""Elements per step of the finiteness check (16 MiB of fp32, 4 MiB of bool temporaries)."""

SETTINGS = ("n_fragments", "fragment_numel", "fingerprint", "outer_lr", "outer_momentum", "sync_every", "weighting")
"""Settings a checkpoint records; the first three come from the islands, the others from flags."""

FLAGS = {"outer_lr": "--outer-lr", "outer_momentum": "--outer-momentum", "sync_every": "--sync-every",
         "weighting": "--weighting"}


def checksum(t: torch.Tensor) -> str:
    """xxh3-64 (hex) of a contiguous fp32 tensor's raw bytes."""
    flat = t.detach().reshape(-1).contiguous()
    return xxhash.xxh3_64_hexdigest(memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]


def first_non_finite(t: torch.Tensor) -> int | None:
    """Index of the first NaN/inf element of a flat tensor (None: all finite); chunked."""
    flat = t.reshape(-1)
    for lo in range(0, flat.numel(), CHUNK_ELEMS):
        ok = torch.isfinite(flat[lo:lo + CHUNK_ELEMS])
        if not bool(ok.all()):
            return lo + int((~ok).nonzero()[0])
    return None


def verify_tensor(what: str, t: torch.Tensor, expected: str) -> str | None:
    """Why ``t`` is not the tensor the manifest recorded (None: it is)."""
    got = checksum(t)
    if got != expected:
        return f"{what}: checksum {got} != manifest's {expected} (the file was altered or damaged)"
    bad = first_non_finite(t)
    if bad is not None:
        return f"{what}: element {bad} is {float(t.reshape(-1)[bad])} (not finite)"
    return None


def settings_of(fingerprint: str, fragment_numel: list[int], hyper: dict[str, Any]) -> dict[str, Any]:
    """The settings recorded with a checkpoint (``hyper``: the snapshot's outer settings)."""
    return {"n_fragments": len(fragment_numel), "fragment_numel": list(fragment_numel), "fingerprint": fingerprint,
            **{k: hyper.get(k) for k in FLAGS}}


def changed(saved: dict[str, Any], config: SyncerConfig) -> list[str]:
    """The flag-set settings that differ between a checkpoint and ``config``, as ``--flag saved -> now``."""
    return [f"{flag} {saved.get(name)!r} -> {getattr(config, name)!r}" for name, flag in FLAGS.items()
            if saved.get(name) != getattr(config, name)]


def check_settings(settings: Any, fingerprint: str, numels: list[int]) -> str | None:
    """Why a manifest's ``settings`` block is malformed or disagrees with its own fragments (None: fine)."""
    if not isinstance(settings, dict) or any(k not in settings for k in SETTINGS):
        return f"settings missing (need {', '.join(SETTINGS)})"
    if settings["fingerprint"] != fingerprint or settings["n_fragments"] != len(numels) \
            or settings["fragment_numel"] != numels:
        return "settings disagree with the manifest's fragments"
    return None

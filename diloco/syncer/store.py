"""Checkpoint store of the syncer: safetensors + a JSON manifest, written atomically.

Layout (docs/PROTOCOL.md, "Checkpoint")::

    DIR/ckpt-00000042/values.safetensors     fp32 global values, one flat tensor per fragment, key "<fragment>"
    DIR/ckpt-00000042/momentum.safetensors   fp32 outer momentum, same keys
    DIR/ckpt-00000042/manifest.json          fingerprint, versions, schemas, next round, ledgers, hyper,
                                             per-tensor xxh3-64 checksums, settings (``ckptcheck.py``)
    DIR/latest                               "ckpt-00000042\n"

Why this way: a crash at any moment must leave a loadable checkpoint. Each one is
written into a temporary directory, fsynced and renamed into place with one
``os.replace``; only then is ``latest`` replaced (also a rename). A reader that
finds ``latest`` missing or pointing at a broken directory falls back to the
newest directory whose manifest and files validate. Loading verifies every tensor
against its checksum and refuses a non-finite value, so a flipped bit or a NaN makes the
reader fall back to an older checkpoint (:attr:`CheckpointStore.skipped` says which and
why) instead of resuming from it. Nothing is ever pickled:
safetensors holds raw tensors, the manifest is plain JSON (its schema names and
shapes each fragment's tensors within the flat stream).

The safetensors files are written here, not by ``safetensors.torch.save_file``:
that builds each file's bytes in memory first, a second copy of the whole model
on the syncer; this writer streams the tensors' own memory to disk.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
from safetensors import safe_open

from diloco.syncer.ckptcheck import check_settings, checksum, settings_of, verify_tensor
from diloco.syncer.core.records import FragmentSnapshot, Snapshot, TensorSpec

log = logging.getLogger(__name__)

FORMAT = "yeto-syncer-checkpoint/3"
"""/3: per-tensor checksums and the settings block (older checkpoints carry neither and are refused)."""
_CKPT_RE = re.compile(r"^ckpt-(\d{8})$")
_MAX_MANIFEST_BYTES = 64 << 20


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or inconsistent."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _safetensors_header(sizes: list[tuple[str, int]]) -> bytes:
    """The length prefix and JSON header of a safetensors file of flat fp32 tensors ``(name, numel)``."""
    header: dict[str, Any] = {}
    offset = 0
    for name, numel in sizes:
        header[name] = {"dtype": "F32", "shape": [numel], "data_offsets": [offset, offset + numel * 4]}
        offset += numel * 4
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _write_tensor(f: BinaryIO, t: torch.Tensor) -> None:
    """Append a flat fp32 tensor's own memory to ``f`` (no copy)."""
    flat = t.detach().reshape(-1).contiguous()
    f.write(memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]


class CheckpointStore:
    """Writes and finds syncer checkpoints under one directory.

    Args:
        root: the checkpoint directory (``--checkpoint-dir``); created if needed.
        keep: how many complete checkpoints to keep (oldest deleted after a
            successful write; at least 1).
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = 3) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)
        self.skipped: list[tuple[Path, str]] = []
        """Checkpoints the last :meth:`load_latest` did not use, newest first, with the reason."""
        # A write killed half-way leaves its temporary directory behind: clean those at start.
        for stale in self.root.glob(".tmp-ckpt-*"):
            log.warning("removing %s left by an interrupted checkpoint write", stale)
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ write

    def _existing(self) -> list[tuple[int, Path]]:
        found = []
        for p in self.root.iterdir():
            m = _CKPT_RE.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def save(self, snap: Snapshot, fragments: list[FragmentSnapshot] | None = None,
             on_written: Callable[[int], None] | None = None) -> Path:
        """Write ``snap`` as the next checkpoint and point ``latest`` at it.

        ``fragments``: the snapshot's fragments as a list the caller lets go of (then ``snap``'s own
        are not read): each entry is dropped (``None``) once written and checksummed, and
        ``on_written(index)`` is called then, so a superseded value is freed while the rest is written."""
        existing = self._existing()
        seq = existing[-1][0] + 1 if existing else 1
        name = f"ckpt-{seq:08d}"
        final = self.root / name
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        frags = list(snap.fragments) if fragments is None else fragments
        meta = [{"version": fs.version, "schema": [[n, d, list(s)] for n, d, s in fs.schema]} for fs in frags]
        numels = [int(fs.value.numel()) for fs in frags]
        sizes = [(str(i), n) for i, n in enumerate(numels)]
        order = list(snap.order) or list(range(len(frags)))
        if sorted(order) != list(range(len(frags))):
            raise ValueError(f"checkpoint write order {order[:8]} is not a permutation of {len(frags)} fragments")
        header = _safetensors_header(sizes)
        offsets = [len(header) + 4 * sum(numels[:i]) for i in range(len(numels))]
        end = len(header) + 4 * sum(numels)
        checksums: dict[str, list[str]] = {"values": [""] * len(frags), "momentum": [""] * len(frags)}
        # Both files are written side by side, one fragment at a time, in ``order`` (the one the next
        # commit supersedes first), each at its place: a fragment's tensors are let go (``on_written``)
        # once on disk and checksummed, not when the whole checkpoint is. Zero momenta are holes (a
        # sparse file reads as zeros), not written bytes.
        with open(tmp / "values.safetensors", "wb") as fv, open(tmp / "momentum.safetensors", "wb") as fm:
            fv.write(header)
            fm.write(header)
            for idx in order:
                fs = frags[idx]
                fv.seek(offsets[idx])
                _write_tensor(fv, fs.value)
                if not fs.momentum_is_zero:
                    fm.seek(offsets[idx])
                    _write_tensor(fm, fs.momentum)
                checksums["values"][idx] = checksum(fs.value)
                checksums["momentum"][idx] = checksum(fs.momentum)
                if fragments is not None:
                    fragments[idx] = None  # type: ignore[call-overload]
                del fs
                if on_written is not None:
                    on_written(idx)
            fv.truncate(end)
            fm.truncate(end)
        manifest = {
            "checksums": checksums,
            "settings": settings_of(snap.fingerprint, numels, snap.hyper),
            "format": FORMAT,
            "fingerprint": snap.fingerprint,
            "n_fragments": snap.n_fragments,
            "fragments": meta,
            "next_round": snap.next_round,
            "ledgers": {str(k): v for k, v in snap.ledgers.items()},
            "hyper": snap.hyper,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for f in ("values.safetensors", "momentum.safetensors", "manifest.json"):
            _fsync_file(tmp / f)
        _fsync_dir(tmp)
        # Ordering: the directory is complete before it gets its final name, and
        # it has its final name before ``latest`` may point at it.
        os.replace(tmp, final)
        pointer_tmp = self.root / f".latest-{os.getpid()}"
        pointer_tmp.write_text(name + "\n")
        _fsync_file(pointer_tmp)
        os.replace(pointer_tmp, self.root / "latest")
        _fsync_dir(self.root)
        for _seq, old in self._existing()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s written (versions %s, next round %d)", final, [m["version"] for m in meta], snap.next_round)
        return final

    # ------------------------------------------------------------------ read

    def _candidates(self) -> list[Path]:
        candidates: list[Path] = []
        pointer = self.root / "latest"
        if pointer.is_file():
            name = pointer.read_text().strip()
            if _CKPT_RE.match(name):
                candidates.append(self.root / name)
        candidates.extend(p for _s, p in reversed(self._existing()) if p not in candidates)
        return candidates

    def latest(self) -> Path | None:
        """The newest checkpoint whose manifest validates: ``latest`` first, then by sequence."""
        for path in self._candidates():
            try:
                self._read_manifest(path)
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                continue
            return path
        return None

    def load_latest(self) -> tuple[Path, Snapshot] | None:
        """Load the newest checkpoint that fully verifies (manifest, checksums, finite tensors), or None;
        the ones passed over are in :attr:`skipped` with the reason."""
        self.skipped = []
        for path in self._candidates():
            try:
                return path, self.load(path)
            except CheckpointError as e:
                why = str(e)
            except Exception as e:  # safetensors raises its own errors on torn files
                why = f"unreadable tensors: {type(e).__name__}: {e}"
            log.warning("skipping checkpoint %s: %s", path, why)
            self.skipped.append((path, why))
        return None

    @staticmethod
    def _read_manifest(path: Path) -> dict[str, Any]:
        mpath = path / "manifest.json"
        for f in ("values.safetensors", "momentum.safetensors", "manifest.json"):
            if not (path / f).is_file():
                raise CheckpointError(f"{f} missing")
        if mpath.stat().st_size > _MAX_MANIFEST_BYTES:
            raise CheckpointError("manifest too large")
        try:
            man = json.loads(mpath.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"manifest unreadable: {e}") from e
        if not isinstance(man, dict) or man.get("format") != FORMAT:
            raise CheckpointError(f"manifest format is {str(man.get('format'))[:40]!r}, not {FORMAT} (an older "
                                  f"checkpoint without checksums, or not a checkpoint)")
        sums = man.get("checksums")
        if not isinstance(sums, dict) or any(
            not isinstance(sums.get(w), list) or len(sums[w]) != man.get("n_fragments")
            or not all(isinstance(x, str) for x in sums[w]) for w in ("values", "momentum")
        ):
            raise CheckpointError("checksums missing or malformed")
        fp, nf, nr = man.get("fingerprint"), man.get("n_fragments"), man.get("next_round")
        frags, ledgers = man.get("fragments"), man.get("ledgers")
        if not isinstance(fp, str) or not fp:
            raise CheckpointError("bad fingerprint")
        if type(nf) is not int or nf < 1 or not isinstance(frags, list) or len(frags) != nf:
            raise CheckpointError("n_fragments does not match the fragment list")
        if type(nr) is not int or nr < 1:
            raise CheckpointError("bad next_round")
        if not isinstance(ledgers, dict) or not isinstance(man.get("hyper"), dict):
            raise CheckpointError("bad ledgers or hyper")
        for k, led in ledgers.items():
            if not k.isdigit() or not isinstance(led, dict) or any(
                type(led.get(f)) is not int or led[f] < 0 for f in ("merges", "steps", "tokens")
            ):
                raise CheckpointError(f"bad ledger for island {k!r}")
        for i, fr in enumerate(frags):
            if not isinstance(fr, dict) or type(fr.get("version")) is not int or fr["version"] < 0:
                raise CheckpointError(f"fragment {i}: bad version")
            schema = fr.get("schema")
            if not isinstance(schema, list) or not schema:
                raise CheckpointError(f"fragment {i}: bad schema")
            for spec in schema:
                if (
                    not isinstance(spec, list)
                    or len(spec) != 3
                    or not isinstance(spec[0], str)
                    or spec[1] not in ("float32", "bfloat16")
                    or not isinstance(spec[2], list)
                    or not all(type(s) is int and s >= 0 for s in spec[2])
                ):
                    raise CheckpointError(f"fragment {i}: bad tensor spec {str(spec)[:80]}")
        numels = [sum(math.prod(spec[2]) for spec in fr["schema"]) for fr in frags]
        problem = check_settings(man.get("settings"), fp, numels)
        if problem:
            raise CheckpointError(problem)
        return man

    def load(self, path: str | os.PathLike[str]) -> Snapshot:
        """Load and validate one checkpoint directory (shapes and dtypes against the manifest)."""
        path = Path(path)
        man = self._read_manifest(path)
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for which in ("values", "momentum"):
            with safe_open(str(path / f"{which}.safetensors"), framework="pt") as f:
                tensors[which] = {k: f.get_tensor(k) for k in f.keys()}
        frags: list[FragmentSnapshot] = []
        expected_keys: set[str] = set()
        for idx, fr in enumerate(man["fragments"]):
            schema: tuple[TensorSpec, ...] = tuple((n, d, tuple(s)) for n, d, s in fr["schema"])
            numel = sum(math.prod(s) for _n, _d, s in schema)
            key = str(idx)
            expected_keys.add(key)
            flat: dict[str, torch.Tensor] = {}
            for which in ("values", "momentum"):
                t = tensors[which].get(key)
                if t is None:
                    raise CheckpointError(f"{which}: fragment {key!r} missing")
                if t.dtype != torch.float32 or tuple(t.shape) != (numel,):
                    raise CheckpointError(f"{which}: fragment {key} is {t.dtype} {tuple(t.shape)}, manifest says ({numel},)")
                problem = verify_tensor(f"{which}.safetensors fragment {key}", t, man["checksums"][which][idx])
                if problem:
                    raise CheckpointError(problem)
                flat[which] = t
            frags.append(FragmentSnapshot(fr["version"], schema, flat["values"], flat["momentum"]))
        for which in ("values", "momentum"):
            extra = set(tensors[which]) - expected_keys
            if extra:
                raise CheckpointError(f"{which}: unexpected tensors {sorted(extra)[:4]}")
        return Snapshot(
            fingerprint=man["fingerprint"],
            n_fragments=man["n_fragments"],
            fragments=tuple(frags),
            next_round=man["next_round"],
            ledgers={int(k): dict(v) for k, v in man["ledgers"].items()},
            hyper=dict(man["hyper"]),
        )

"""``--resume``: pick the checkpoint a restarted syncer continues from, and refuse a silent change.

Contract:

* the newest checkpoint that *verifies* (manifest, per-tensor checksums, finite values;
  ``store.py`` / ``ckptcheck.py``) is used; each newer one passed over is logged as an ERROR
  naming its directory and why, followed by the one used instead;
* when none verifies, :class:`ResumeError` names every directory tried and its reason (or
  says the directory holds none);
* when the checkpoint was written under other settings (``--outer-lr``, ``--outer-momentum``,
  ``--sync-every``, ``--weighting``), :class:`ResumeError` names each change, unless
  ``allow_new_settings`` (``--resume-with-new-settings``), which logs them as a WARNING. The
  fragment plan and layout fingerprint are checked when islands say HELLO (a different plan
  is refused there).
"""

from __future__ import annotations

import logging
from pathlib import Path

from diloco.syncer.ckptcheck import changed
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.records import Snapshot
from diloco.syncer.store import CheckpointStore

log = logging.getLogger("diloco.syncer")


class ResumeError(Exception):
    """``--resume`` cannot go on; the message names the file(s) and the fix."""


def choose(store: CheckpointStore, config: SyncerConfig, allow_new_settings: bool) -> tuple[Path, Snapshot]:
    """The checkpoint to resume from (see the module docstring)."""
    found = store.load_latest()
    tried = "; ".join(f"{p}: {why}" for p, why in store.skipped)
    if found is None:
        if tried:
            raise ResumeError(f"--resume: no checkpoint in {store.root} verifies: {tried}")
        raise ResumeError(f"--resume: no checkpoint in {store.root}")
    path, snap = found
    for p, why in store.skipped:
        log.error("--resume: checkpoint %s is damaged and is not used: %s", p, why)
    if store.skipped:
        log.warning("--resume: falling back to %s, the newest checkpoint that verifies", path)
    diffs = changed(snap.hyper, config)
    if diffs and not allow_new_settings:
        raise ResumeError(f"--resume: {path} was written under other settings ({', '.join(diffs)}); resuming would "
                          f"silently change the run: restore those flags, or pass --resume-with-new-settings")
    if diffs:
        log.warning("--resume-with-new-settings: %s was written under other settings; continuing with: %s", path,
                    ", ".join(diffs))
    return path, snap

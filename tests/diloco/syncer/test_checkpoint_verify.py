"""Rotten checkpoints (issue 23, item 6): a flipped bit, a NaN and changed settings each give a fallback
to the previous good checkpoint or a clear error naming the file; ``--resume`` verifies before it loads."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import xxhash

from diloco.syncer.cli import EXIT_CONFIG, main
from diloco.syncer.resume import ResumeError, choose
from diloco.syncer.core.coordinator import Coordinator
from diloco.syncer.store import CheckpointStore

from state_driver import bitwise  # noqa: E402
from test_state import CFG, open_round1, peer, pushes, started  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def two_checkpoints(tmp_path: Path) -> tuple[CheckpointStore, Path, Path, Coordinator]:
    """ckpt 1 at versions (0, 0), ckpt 2 after round 1 committed (1, 0)."""
    d = started()
    store = CheckpointStore(tmp_path)
    first = store.save(d.st.snapshot())
    d.st.release_snapshot()
    open_round1(d)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0), now=1.0)
    assert d.st.versions() == (1, 0)
    second = store.save(d.st.snapshot())
    d.st.release_snapshot()
    return store, first, second, d.st


def data_offset(path: Path, key: str) -> int:
    """Byte offset of tensor ``key``'s data in a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8:8 + n])[key]["data_offsets"][0]


def test_a_flipped_bit_falls_back_to_the_previous_checkpoint_naming_file_and_why(tmp_path, caplog) -> None:
    store, first, second, st = two_checkpoints(tmp_path)
    f = second / "values.safetensors"
    raw = bytearray(f.read_bytes())
    raw[data_offset(f, "0") + 4 * 1234 + 1] ^= 0x10  # one bit of one element of fragment 0
    f.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        path, snap = choose(store, replace(CFG), allow_new_settings=False)
    assert path == first and [f.version for f in snap.fragments] == [0, 0]
    assert [p for p, _why in store.skipped] == [second] and "checksum" in store.skipped[0][1]
    assert f"{second}" in caplog.text and "falling back to" in caplog.text and str(first) in caplog.text
    # The fallback is the genuine earlier state, bit for bit.
    resumed = Coordinator(CFG, snapshot=snap)
    assert resumed.versions() == (0, 0)


def test_a_nan_with_a_matching_checksum_is_refused_as_not_finite(tmp_path) -> None:
    store, first, second, _st = two_checkpoints(tmp_path)
    f = second / "momentum.safetensors"
    raw = bytearray(f.read_bytes())
    at = data_offset(f, "1")
    raw[at:at + 4] = torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes()
    f.write_bytes(bytes(raw))
    # Re-sign the manifest as a buggy writer would have: only the finiteness check can catch it.
    man = json.loads((second / "manifest.json").read_text())
    numel = man["settings"]["fragment_numel"][1]
    data = bytes(raw[at:at + 4 * numel])
    man["checksums"]["momentum"][1] = xxhash.xxh3_64_hexdigest(data)
    (second / "manifest.json").write_text(json.dumps(man))
    path, _snap = choose(store, CFG, allow_new_settings=False)
    assert path == first
    assert "not finite" in store.skipped[0][1] and "momentum.safetensors fragment 1" in store.skipped[0][1]


def test_no_good_checkpoint_is_a_clear_error_naming_each_file(tmp_path) -> None:
    store, first, second, _st = two_checkpoints(tmp_path)
    for ck in (first, second):
        f = ck / "values.safetensors"
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x01
        f.write_bytes(bytes(raw))
    with pytest.raises(ResumeError) as e:
        choose(store, CFG, allow_new_settings=False)
    assert str(first) in str(e.value) and str(second) in str(e.value) and "checksum" in str(e.value)


def test_changed_settings_refuse_to_resume_unless_told_and_name_what_changed(tmp_path, caplog) -> None:
    store, _first, second, st = two_checkpoints(tmp_path)
    other = replace(CFG, outer_lr=0.5, weighting="steps")
    with pytest.raises(ResumeError) as e:
        choose(store, other, allow_new_settings=False)
    assert "--outer-lr 0.7 -> 0.5" in str(e.value) and "--weighting 'tokens' -> 'steps'" in str(e.value)
    assert "--resume-with-new-settings" in str(e.value) and str(second) in str(e.value)
    with caplog.at_level(logging.WARNING):
        path, snap = choose(store, other, allow_new_settings=True)
    assert path == second and "--outer-lr 0.7 -> 0.5" in caplog.text
    assert bitwise(snap.fragments[0].value, st.fragments[0].value)
    # The same refusal through yeto-syncer: exit 2, naming the flag.
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        code = main(["--islands", "3", "--insecure", "--resume", "--checkpoint-dir", str(store.root), "--quorum",
                     "2", "--sync-every", "4", "--outer-lr", "0.7", "--outer-momentum", "0.5"])
    assert code == EXIT_CONFIG and "--outer-momentum 0.9 -> 0.5" in caplog.text


def test_an_unchanged_checkpoint_round_trips_with_checksums(tmp_path) -> None:
    store, _first, second, st = two_checkpoints(tmp_path)
    man = json.loads((second / "manifest.json").read_text())
    assert len(man["checksums"]["values"]) == 2 and man["settings"]["sync_every"] == CFG.sync_every
    path, snap = choose(store, CFG, allow_new_settings=False)
    assert path == second and not store.skipped
    for f, fs in zip(st.fragments, snap.fragments):
        assert bitwise(f.value, fs.value)

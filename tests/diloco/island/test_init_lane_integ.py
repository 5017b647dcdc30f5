"""INIT on two connections (``wire.Lane``, ``island/lane.py``, ``Sessions.bind_lane``): a real
syncer process (HMAC mode) and a real ``SyncClient`` as island 0 on tcp loopback.

Island 0 claims the digests of its own values in HELLO, so the syncer answers every fragment HELD
only when what it received over the two connections is bit for bit what the island holds.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from diloco import wire
from diloco.config import IslandConfig
from diloco.digest import tensor_digest
from diloco.island.client import SyncClient
from tests.support.syncer_proc import SyncerProc

pytestmark = [pytest.mark.integ, pytest.mark.timeout(120)]

KEY = "lane-test-key"
FRAGMENTS = 4


def _values() -> tuple[list[wire.FragmentLayout], list[list[tuple[str, torch.Tensor]]]]:
    g = torch.Generator().manual_seed(5)
    layouts, values = [], []
    for f in range(FRAGMENTS):
        shapes = [(f"f{f}.w", (300, 257)), (f"f{f}.b", (4099,))]
        layouts.append(wire.FragmentLayout.of(shapes))
        values.append([(n, torch.randn(s, generator=g)) for n, s in shapes])
    return layouts, values


def _init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """Stream INIT of every fragment as island 0 and return the syncer's log once each is held."""
    monkeypatch.setenv("YETO_SYNC_KEY", KEY)
    layouts, values = _values()
    syncer = SyncerProc(tmp_path, ["--key-file", str(_key(tmp_path)), "--islands", "1", "--sync-every", "1",
                                   "--total-steps", "1", "--checkpoint-every", "0", "--part-mib", "0.0625",
                                   *args])
    client = None
    try:
        client = SyncClient(IslandConfig(sync_addr=syncer.endpoint, island_id=0, key=KEY.encode(),
                                         sync_timeout_s=60.0, send_queue=4), "lane-test", layouts,
                            claims=[tensor_digest(v) for v in values])
        client.wait_welcome(30)
        sent = [client.send_init(f, values[f]) for f in range(FRAGMENTS)]
        assert all(ev.wait(60) for ev in sent)
        deadline = time.monotonic() + 60
        while "match the syncer's values" not in syncer.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        return syncer.log()
    finally:
        if client is not None:
            client.close()
        syncer.stop()


def _key(tmp_path: Path) -> Path:
    path = tmp_path / "sync.key"
    path.write_text(KEY)
    path.chmod(0o600)
    return path


def test_init_on_two_connections_lands_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="diloco.island.client")
    log = _init(tmp_path, monkeypatch)
    assert "island 0: a second connection carries INIT" in log
    on_lane = [r.getMessage() for r in caplog.records if "on the lane" in r.getMessage()]
    assert on_lane and len(on_lane) < FRAGMENTS  # both connections carried fragments
    assert log.count("initialised by island 0") == FRAGMENTS
    assert f"fragments 0-{FRAGMENTS - 1} match the syncer's values, no cut needed" in log
    assert " claiming island " not in log and "refused " not in log  # nothing dropped or refused


def test_init_lanes_0_keeps_init_on_one_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _init(tmp_path, monkeypatch, "--init-lanes", "0")
    assert "second connection" not in log
    assert f"fragments 0-{FRAGMENTS - 1} match the syncer's values, no cut needed" in log

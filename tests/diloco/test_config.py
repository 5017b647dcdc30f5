"""IslandConfig.from_env: every bad YETO_* value fails at start, naming the variable."""

from __future__ import annotations

import pytest

from diloco.config import ConfigError, IslandConfig
from diloco.syncer.cli import _read_key
from diloco.syncer.core.config import ConfigError as SyncerConfigError

pytestmark = pytest.mark.timeout(30)

BASE = {"YETO_SYNC_ADDR": "tcp://127.0.0.1:5555", "YETO_ISLAND_ID": "1"}


def test_defaults_and_overrides() -> None:
    cfg = IslandConfig.from_env(dict(BASE, YETO_DILOCO_STEP_LOG="/tmp/s-{island}.jsonl"), tokens_per_step=64)
    assert (cfg.island_id, cfg.fragments, cfg.wire_dtype, cfg.tokens_per_step) == (1, 4, "float32", 64)
    assert cfg.step_log_path() == "/tmp/s-1.jsonl" and cfg.key == b""
    assert (cfg.apply_mode, cfg.pushes_in_flight, cfg.transfer_timeout_s, cfg.tune_malloc) == ("progress", 1, 300.0, True)
    blend = IslandConfig.from_env(dict(BASE, YETO_DILOCO_APPLY="blend", YETO_DILOCO_ALPHA="0.5",
                                       YETO_DILOCO_PUSHES_IN_FLIGHT="2", YETO_DILOCO_TUNE_MALLOC="0"))
    assert (blend.apply_mode, blend.alpha, blend.pushes_in_flight, blend.tune_malloc) == ("blend", 0.5, 2, False)
    assert not cfg.sync_rounds and IslandConfig.from_env(dict(BASE, YETO_DILOCO_SYNC_ROUNDS="1")).sync_rounds


@pytest.mark.parametrize("env, var", [
    ({"YETO_ISLAND_ID": "0"}, "YETO_SYNC_ADDR"),
    ({"YETO_SYNC_ADDR": "tcp://h:1"}, "YETO_ISLAND_ID"),
    (dict(BASE, YETO_ISLAND_ID="x"), "YETO_ISLAND_ID"),
    (dict(BASE, YETO_DILOCO_ALPHA="1.0"), "YETO_DILOCO_ALPHA"),
    (dict(BASE, YETO_WIRE_DTYPE="fp16"), "YETO_WIRE_DTYPE"),
    (dict(BASE, YETO_DILOCO_FRAGMENTS="0"), "YETO_DILOCO_FRAGMENTS"),
    (dict(BASE, YETO_HEARTBEAT_S="nan"), "YETO_HEARTBEAT_S"),
    (dict(BASE, YETO_CROSS_NODE_GLOO="maybe"), "YETO_CROSS_NODE_GLOO"),
    (dict(BASE, YETO_RANKS_PER_NODE="0"), "YETO_RANKS_PER_NODE"),
    (dict(BASE, YETO_SYNC_ADDR="localhost:5555"), "YETO_SYNC_ADDR"),
    (dict(BASE, YETO_DILOCO_APPLY="replace"), "YETO_DILOCO_APPLY"),
    (dict(BASE, YETO_DILOCO_ALPHA="0.5"), "YETO_DILOCO_ALPHA"),  # alpha is a blend parameter
    (dict(BASE, YETO_DILOCO_PUSHES_IN_FLIGHT="0"), "YETO_DILOCO_PUSHES_IN_FLIGHT"),
    (dict(BASE, YETO_DILOCO_TRANSFER_TIMEOUT_S="0"), "YETO_DILOCO_TRANSFER_TIMEOUT_S"),
    (dict(BASE, YETO_DILOCO_TUNE_MALLOC="maybe"), "YETO_DILOCO_TUNE_MALLOC"),
    (dict(BASE, YETO_DILOCO_SYNC_ROUNDS="2"), "YETO_DILOCO_SYNC_ROUNDS"),
])
def test_bad_values_name_the_variable(env: dict, var: str) -> None:
    with pytest.raises(ConfigError, match=var):
        IslandConfig.from_env(env)


def test_key_file_read_alike_by_islands_and_syncer(tmp_path) -> None:
    good, empty = tmp_path / "key", tmp_path / "empty"
    good.write_bytes(b"  secret\n")
    empty.write_bytes(b"\n")
    assert IslandConfig.from_env(dict(BASE, YETO_SYNC_KEY_FILE=str(good))).key == b"secret" == _read_key(str(good))
    for path, why in ((empty, "empty"), (tmp_path / "missing", "cannot be read")):
        with pytest.raises(ConfigError, match=f"YETO_SYNC_KEY_FILE.*{why}"):
            IslandConfig.from_env(dict(BASE, YETO_SYNC_KEY_FILE=str(path)))
        with pytest.raises(SyncerConfigError, match=f"--key-file.*{why}"):
            _read_key(str(path))
    with pytest.raises(ConfigError, match="only one"):
        IslandConfig.from_env(dict(BASE, YETO_SYNC_KEY="k", YETO_SYNC_KEY_FILE=str(good)))


def test_built_in_code_with_the_same_checks() -> None:
    cfg = IslandConfig(sync_addr="tcp://127.0.0.1:5555", island_id=0, fragments=2, heartbeat_s=1, key="k")
    assert (cfg.fragments, cfg.heartbeat_s, cfg.key) == (2, 1.0, b"k")
    assert isinstance(cfg.heartbeat_s, float)
    for bad, var in [(dict(island_id="0"), "YETO_ISLAND_ID"), (dict(alpha=1.5), "YETO_DILOCO_ALPHA"),
                     (dict(fragments=True), "YETO_DILOCO_FRAGMENTS"), (dict(sync_addr="host:1"), "YETO_SYNC_ADDR"),
                     (dict(heartbeat_s=float("nan")), "YETO_HEARTBEAT_S"), (dict(wire_dtype="fp8"), "YETO_WIRE_DTYPE"),
                     (dict(cross_node_gloo=1), "YETO_CROSS_NODE_GLOO")]:
        kwargs = {"sync_addr": "tcp://127.0.0.1:5555", "island_id": 0, **bad}
        with pytest.raises(ConfigError, match=f"{next(iter(bad))} .*{var}"):
            IslandConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="fragments"):
        cfg.replace(fragments=0)


def test_from_env_overrides_apply_before_validation() -> None:
    # The required fields may come from overrides alone...
    cfg = IslandConfig.from_env({}, sync_addr="tcp://10.0.0.5:5555", island_id=3)
    assert (cfg.sync_addr, cfg.island_id, cfg.fragments) == ("tcp://10.0.0.5:5555", 3, 4)
    # ...and win over variables, which are then not parsed at all.
    cfg = IslandConfig.from_env(dict(BASE, YETO_DILOCO_FRAGMENTS="oops"), fragments=2)
    assert (cfg.island_id, cfg.fragments) == (1, 2)
    # Overrides are validated like everything else.
    with pytest.raises(ConfigError, match="YETO_ISLAND_ID"):
        IslandConfig.from_env({}, sync_addr="tcp://h:1", island_id=-1)
    with pytest.raises(ConfigError, match="YETO_ISLAND_ID is not set"):
        IslandConfig.from_env({}, sync_addr="tcp://h:1")
    with pytest.raises(ConfigError, match="no field"):
        IslandConfig.from_env(BASE, fragmnets=2)

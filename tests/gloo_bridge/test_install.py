"""install(): validation errors, idempotence, patching and its full undo (one process)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch.distributed as dist

import gloo_bridge
from gloo_bridge_suite import free_port, init_world, run_ranks

pytestmark = pytest.mark.timeout(60)

_NAMES = ("all_reduce", "broadcast", "new_group", "isend", "batch_isend_irecv", "_coalescing_manager")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("YETO_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    gloo_bridge.uninstall()
    yield
    gloo_bridge.uninstall()


def test_missing_environment_fails_naming_the_variables() -> None:
    with pytest.raises(ValueError, match="YETO_RANKS_PER_NODE.*LOCAL_WORLD_SIZE"):
        gloo_bridge.install()
    assert not gloo_bridge.is_installed()


@pytest.mark.parametrize(("var", "value"), [("YETO_RANKS_PER_NODE", "x"), ("LOCAL_WORLD_SIZE", "0")])
def test_bad_environment_fails_naming_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        gloo_bridge.install()
    assert not gloo_bridge.is_installed()


def test_install_before_init_patches_and_uninstall_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    before = {n: getattr(dist, n) for n in _NAMES}
    c10d_before = {n: getattr(dist.distributed_c10d, n) for n in _NAMES}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    gloo_bridge.install()  # no process group yet: must not need one
    gloo_bridge.install()  # idempotent
    gloo_bridge.install(ranks_per_node=2)  # same value from another source: same install
    assert gloo_bridge.is_installed()
    assert all(getattr(dist, n) is not before[n] for n in _NAMES)
    assert not gloo_bridge.is_bridged(None)  # nothing initialized: nothing to bridge
    with pytest.raises(RuntimeError, match="already installed"):
        gloo_bridge.install(ranks_per_node=4)
    gloo_bridge.uninstall()
    assert {n: getattr(dist, n) for n in _NAMES} == before
    assert {n: getattr(dist.distributed_c10d, n) for n in _NAMES} == c10d_before
    assert not gloo_bridge.is_bridged(None)


def _install_after_init(rank: int, port: int) -> list[str]:
    init_world(rank, 1, port, "gloo")
    try:
        gloo_bridge.install(ranks_per_node=2)
    except ValueError as exc:
        return [] if "ranks_per_node=2 does not divide the world size 1" in str(exc) else [str(exc)]
    finally:
        dist.destroy_process_group()
    return ["install accepted ranks_per_node=2 for a world of 1"]


@pytest.mark.integ
def test_inconsistent_world_size_is_refused(tmp_path: Path) -> None:
    verdicts = run_ranks(1, functools.partial(_install_after_init, port=free_port()), tmp_path, timeout_s=40)
    assert verdicts[0]["ok"], verdicts

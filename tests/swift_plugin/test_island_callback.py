"""Fast checks of the yeto callback's pieces that need no process group or syncer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diloco.config import ConfigError
from swift_plugin import PLUGIN_PATH
from swift_plugin.digest import tensor_digest, write_digest_file
from swift_plugin.island_callback import YetoIslandHooks, tokens_per_step_from_args, true_vocab_size
from swift_plugin.options import BridgeOptions, PluginOptions

ROOT = Path(__file__).resolve().parents[2]


def _trainer() -> SimpleNamespace:
    return SimpleNamespace(args=SimpleNamespace(global_batch_size=16, seq_length=256, max_length=256),
                           state=SimpleNamespace(iteration=0), wrapped_models=[], unwrapped_models=[],
                           optimizer=None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("env, missing", [({}, "YETO_SYNC_ADDR"),
                                          ({"YETO_SYNC_ADDR": "tcp://127.0.0.1:5555"}, "YETO_ISLAND_ID")])
def test_missing_variables_fail_before_any_collective(env: dict[str, str], missing: str) -> None:
    # No process group exists here: reaching dist.new_group would raise a different error.
    hooks = YetoIslandHooks(_trainer(), env=env)
    with pytest.raises(ConfigError, match=missing) as info:
        hooks.on_train_begin()
    assert "--callbacks yeto" in str(info.value)


@pytest.mark.timeout(30)
def test_hooks_refuse_to_run_out_of_order() -> None:
    hooks = YetoIslandHooks(_trainer(), env={})
    with pytest.raises(RuntimeError, match="before on_train_begin"):
        hooks.on_step_end()
    with pytest.raises(RuntimeError, match="before on_train_begin"):
        hooks.on_train_end()


class _Island:
    """The island's side of the hooks: records the calls; ``fail`` makes ``finish`` raise."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail
        self.step = 0
        self.cfg = SimpleNamespace(island_id=0)

    def step_end(self, step: int, loss: float | None) -> None:
        self.calls.append(f"step {step}")
        self.step = step

    def finish(self) -> list[int]:
        self.calls.append("finish")
        if self.fail:
            raise RuntimeError("no final cut")
        return [1, 1]


def _hooks_with(island: _Island, train_iters: object) -> YetoIslandHooks:
    trainer = _trainer()
    trainer.args.train_iters = train_iters
    hooks = YetoIslandHooks(trainer, env={})
    hooks.island, hooks.config = island, SimpleNamespace(island_id=0)
    return hooks


def _train(hooks: YetoIslandHooks, steps: int, saved: list[list[str]]) -> None:
    """ms-swift's loop: on_step_end, then (at the last step) the final save, then on_train_end."""
    for _ in range(steps):
        hooks.trainer.state.iteration += 1
        hooks.on_step_end()
    saved.append(list(hooks.island.calls))  # what the job's final save sees


@pytest.mark.timeout(30)
@pytest.mark.parametrize("train_iters", [2, 2.0, np.int64(2)])
def test_final_cut_is_taken_at_the_last_step_before_the_save(train_iters: object) -> None:
    island, saved = _Island(), []
    hooks = _hooks_with(island, train_iters)
    _train(hooks, 2, saved)
    assert saved == [["step 1", "step 2", "finish"]] and hooks.final_versions == [1, 1]
    hooks.on_train_end()
    hooks.on_step_end()  # a stray call after the final cut does nothing
    assert island.calls == ["step 1", "step 2", "finish"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("train_iters", [None, 2.5, "2", 0])
def test_without_a_known_last_step_the_final_cut_waits_for_train_end(train_iters: object) -> None:
    island, saved = _Island(), []
    hooks = _hooks_with(island, train_iters)
    _train(hooks, 2, saved)
    assert saved == [["step 1", "step 2"]]
    hooks.on_train_end()
    assert island.calls[-1] == "finish" and hooks.final_versions == [1, 1]


@pytest.mark.timeout(30)
def test_a_failed_final_cut_lets_the_save_go_on_and_is_raised_at_train_end() -> None:
    island, saved = _Island(fail=True), []
    hooks = _hooks_with(island, 2)
    _train(hooks, 2, saved)  # the save happens
    assert saved == [["step 1", "step 2", "finish"]]
    with pytest.raises(RuntimeError, match="no final cut"):
        hooks.on_train_end()
    assert island.calls.count("finish") == 1


@pytest.mark.timeout(30)
def test_on_log_keeps_last_finite_training_loss() -> None:
    hooks = YetoIslandHooks(_trainer(), env={})
    hooks.on_log({"grad_norm": 1.0})
    assert hooks._last_loss is None
    hooks.on_log({"loss": 3.5, "learning_rate": 1e-3})
    hooks.on_log({"loss": float("nan")})
    hooks.on_log({"eval_loss": 1.0})
    hooks.on_log({"loss": "n/a"})
    assert hooks._last_loss == 3.5
    hooks.on_log({"loss": torch.tensor(2.25)})
    assert hooks._last_loss == 2.25


@pytest.mark.timeout(30)
def test_tokens_per_step_and_vocab_from_trainer() -> None:
    assert tokens_per_step_from_args(SimpleNamespace(global_batch_size=16, seq_length=256)) == 4096
    assert tokens_per_step_from_args(SimpleNamespace(global_batch_size=8, seq_length=None, max_length=128)) == 1024
    assert tokens_per_step_from_args(SimpleNamespace()) == 0
    cfg = SimpleNamespace(padded_vocab_size=151643)
    assert true_vocab_size(SimpleNamespace(config=cfg)) == 151643
    assert true_vocab_size(SimpleNamespace(unwrapped_models=[SimpleNamespace(config=cfg)])) == 151643
    assert true_vocab_size(SimpleNamespace(unwrapped_models=[SimpleNamespace(config=SimpleNamespace())])) is None


@pytest.mark.timeout(30)
def test_options_parse_and_name_bad_variables() -> None:
    assert BridgeOptions.from_env({}) == BridgeOptions(False, None)
    assert BridgeOptions.from_env({"YETO_CROSS_NODE_GLOO": "1", "YETO_RANKS_PER_NODE": "8"}) == BridgeOptions(True, 8)
    with pytest.raises(ConfigError, match="YETO_CROSS_NODE_GLOO"):
        BridgeOptions.from_env({"YETO_CROSS_NODE_GLOO": "maybe"})
    with pytest.raises(ConfigError, match="YETO_RANKS_PER_NODE"):
        BridgeOptions.from_env({"YETO_RANKS_PER_NODE": "0"})
    opts = PluginOptions.from_env({"YETO_DILOCO_DIGEST_FILE": "/tmp/d-{island}.json"})
    assert opts.digest_path(3) == "/tmp/d-3.json"
    assert PluginOptions.from_env({}).digest_path(0) is None


@pytest.mark.timeout(30)
def test_digest_sees_every_bit_and_name(tmp_path: Path) -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    base = tensor_digest([("w", a)])
    assert tensor_digest([("w", a.clone())]) == base
    b = a.clone()
    b.view(-1).view(torch.int32)[5] ^= 1  # flip the lowest mantissa bit of one element
    assert tensor_digest([("w", b)]) != base
    assert tensor_digest([("v", a)]) != base
    assert tensor_digest([("w", a.reshape(4, 3))]) != base
    assert tensor_digest([("w", a.to(torch.bfloat16))]) != base
    path = tmp_path / "sub" / "digest.json"
    write_digest_file(str(path), 1, [2, 3], [base, base])
    doc = json.loads(path.read_text())
    assert doc["island"] == 1 and doc["versions"] == [2, 3] and doc["fragments"] == [base, base]


@pytest.mark.integ
@pytest.mark.timeout(60)
def test_module_prints_plugin_path() -> None:
    out = subprocess.run([sys.executable, "-m", "swift_plugin"], cwd=ROOT, capture_output=True, text=True,
                         timeout=50, check=True).stdout
    assert out == PLUGIN_PATH + "\n"
    assert Path(PLUGIN_PATH).is_file() and Path(PLUGIN_PATH).is_absolute()

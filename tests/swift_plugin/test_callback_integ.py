"""Two islands driven through the ms-swift callback logic and a real syncer end bit-identical.

Processes: one real syncer (``python -m diloco.syncer``) and two island processes
(``island_proc.py``), each forking 2 ranks that build a real megatron-core GPTModel + DDP +
DistributedOptimizer on CPU/gloo: island 0 is TP2, island 1 is PP2 (different layouts, padded
vocabularies 256 vs 128). Each rank runs ms-swift's trainer loop around
:class:`YetoIslandHooks` (on_train_begin → step/on_step_end/on_log → on_train_end) with the
``YETO_*`` variables in its environment, as under ``megatron pt --callbacks yeto``.

Checked: both islands and every rank finish; at least 3 rounds committed a change; both
islands report the same final versions and the same per-fragment digests of their exported
global parameters, and those equal the digests of the syncer's final checkpoint (the values
it merged); the step logs carry the losses passed through ``on_log``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.digest import checkpoint_digests
from diloco.protocol.schedule import Schedule
from diloco.steplog import read_steplog

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from tbevents import read_scalars  # noqa: E402
from tests.support.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
SYNC_EVERY = 4
FRAGMENTS = 2


def _env(tmp: Path, addr: str, island: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
        "YETO_SYNC_ADDR": addr,
        "YETO_ISLAND_ID": str(island),
        "YETO_SYNC_KEY": "swift-plugin-test-key",
        "YETO_DILOCO_FRAGMENTS": str(FRAGMENTS),
        "YETO_DILOCO_STEP_LOG": str(tmp / "steps-{island}.jsonl"),
        "YETO_DILOCO_DIGEST_FILE": str(tmp / "digest-{island}.json"),
        "YETO_DILOCO_INITIAL_CUT_TIMEOUT": "60",
        "YETO_HEARTBEAT_S": "0.5",
        "YETO_SYNC_TIMEOUT_S": "30",
        "YETO_CONNECT_TIMEOUT_S": "60",
        "YETO_FINAL_TIMEOUT_S": "60",
    })
    return env


def _checkpoint_digests(ckpt_root: Path) -> tuple[list[int], list[str]]:
    return checkpoint_digests(ckpt_root / (ckpt_root / "latest").read_text().strip())


@pytest.mark.integ
@pytest.mark.timeout(180)
def test_two_islands_tp2_pp2_end_identical(tmp_path: Path) -> None:
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    events = tmp_path / "events.jsonl"
    ckpt = tmp_path / "ckpt"
    syncer_env = _env(tmp_path, addr, 0)
    syncer_cmd = [sys.executable, "-m", "diloco.syncer", "--bind", addr, "--islands", "2",
                  "--sync-every", str(SYNC_EVERY), "--total-steps", str(STEPS), "--grace-ms", "200",
                  "--quorum-timeout-s", "60", "--final-timeout-s", "60", "--dead-after-s", "60",
                  "--checkpoint-dir", str(ckpt), "--checkpoint-every", "0", "--event-log", str(events)]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("syncer", "island0", "island1")}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["syncer"] = subprocess.Popen(syncer_cmd, cwd=ROOT, env=syncer_env, stdout=logs["syncer"],
                                           stderr=subprocess.STDOUT)
        for island, (tp, pp) in enumerate([(2, 1), (1, 2)]):
            cmd = [sys.executable, str(ROOT / "tests" / "swift_plugin" / "island_proc.py"), "--world", "2",
                   "--tp", str(tp), "--pp", str(pp), "--steps", str(STEPS), "--log-every", "2",
                   "--timeout-s", "150", "--barrier-dir", str(tmp_path), "--barrier-ranks", "4",
                   "--tensorboard-dir", str(tmp_path / f"tb{island}")]
            procs[f"island{island}"] = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path, addr, island),
                                                        stdout=subprocess.PIPE, stderr=logs[f"island{island}"],
                                                        text=True)
        deadline = time.monotonic() + 165
        outputs: dict[str, str] = {}
        for name in ("island0", "island1", "syncer"):
            p = procs[name]
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running at the deadline; logs in {tmp_path}")
            outputs[name] = out or ""
            if p.returncode != 0:
                for f in logs.values():
                    f.flush()
                tail = (tmp_path / f"{name}.log").read_text()[-4000:]
                syncer = (tmp_path / "syncer.log").read_text()[-3000:]
                pytest.fail(f"{name} exited {p.returncode}:\n{tail}\n--- syncer log tail:\n{syncer}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for f in logs.values():
            f.close()

    results = {i: json.loads(outputs[f"island{i}"].strip().splitlines()[-1]) for i in (0, 1)}
    # Every rank of every island finished and agrees on the final versions.
    versions = {tuple(r["versions"]) for i in (0, 1) for r in results[i]}
    assert len(versions) == 1, versions
    final_versions = list(versions.pop())
    assert all(len(results[i]) == 2 for i in (0, 1))
    assert all(r["finished_at_last_step"] for i in (0, 1) for r in results[i])  # before the job's final save
    assert {r["n_fragments"] for i in (0, 1) for r in results[i]} == {FRAGMENTS}
    # Tokens per step from the job's args: global batch (micro 2 x DP) x seq 16.
    assert results[0][0]["tokens_per_step"] == 2 * 1 * 16  # TP2: DP1
    assert results[1][0]["tokens_per_step"] == 2 * 1 * 16  # PP2: DP1

    # Commit lines only (clamp and cap lines carry a round too).
    commits = [e for line in events.read_text().splitlines()
               if line.strip() and "fold_order" in (e := json.loads(line))]
    changed = [c for c in commits if c["changed"]]
    assert len(changed) >= 3, commits
    assert all(sorted(c["pushed"]) == [0, 1] for c in changed), changed
    assert sum(final_versions) >= len(changed)
    # Every scheduled round opened as a training round (the islands finish inside their last
    # on_step_end, reporting the last step and the end at once, so the round due at that step is
    # not left to the flush), then one flush round per fragment. Every step of every island merged
    # exactly once, and the flush carries only what the schedule leaves to it: fragment f's steps
    # after its last training round opened (an island pushes a round at a boundary at or after its
    # opening step, since the clock is the slowest island). Which round carries which steps depends
    # on timing (an island ahead of the clock pushes more steps in one round and none in the next);
    # these sums and bounds do not.
    sched = Schedule(SYNC_EVERY, FRAGMENTS, STEPS)
    summary = [e["summary"] for line in events.read_text().splitlines() if line.strip()
               and "summary" in (e := json.loads(line))]
    assert len(summary) == 1, summary
    assert summary[0]["scheduled_rounds"] == sched.scheduled_rounds == FRAGMENTS * STEPS // SYNC_EVERY, summary
    training = [c for c in commits if not c["flush"]]
    assert sorted(c["round"] for c in training) == list(range(1, sched.scheduled_rounds + 1)), commits
    assert sorted(c["fragment"] for c in commits if c["flush"]) == list(range(FRAGMENTS)), commits
    for i in (0, 1):
        tokens = results[i][0]["tokens_per_step"]
        for f in range(FRAGMENTS):
            merged = sum(c["weights"][str(i)] for c in commits if c["fragment"] == f)
            assert merged == STEPS * tokens, (i, f, commits)
            last_open = max(sched.opening_step(c["round"]) for c in training if c["fragment"] == f)
            flushed = sum(c["weights"][str(i)] for c in commits if c["fragment"] == f and c["flush"])
            assert flushed <= (STEPS - last_open) * tokens, (i, f, last_open, commits)

    # Only the sync rank (rank 0) holds digests; both islands' digests agree with each other
    # and with the syncer's final checkpoint.
    dig = {i: [r["digests"] for r in results[i] if r["digests"] is not None] for i in (0, 1)}
    assert all(len(dig[i]) == 1 for i in (0, 1)), dig
    assert dig[0][0] == dig[1][0]
    files = {i: json.loads((tmp_path / f"digest-{i}.json").read_text()) for i in (0, 1)}
    assert files[0]["digest"] == files[1]["digest"] and files[0]["fragments"] == dig[0][0]
    assert files[0]["versions"] == final_versions
    ck_versions, ck_digests = _checkpoint_digests(ckpt)
    assert ck_versions == final_versions
    assert ck_digests == dig[0][0]

    # The sync scalars land in the job's TensorBoard directory, beside the job's loss (written by
    # the last rank), at the job's log interval, and agree with the step log (the record of truth).
    for i in (0, 1):
        tb = read_scalars(str(tmp_path / f"tb{i}"))
        assert [s for s, _ in tb["loss"]] == list(range(2, STEPS + 1, 2))
        steps = list(range(2, STEPS + 1, 2))
        for tag in ("diloco/sync_share", "diloco/rounds_merged", "diloco/push_blocked_ms", "diloco/data_bytes_sent",
                    "diloco/version/f0", "diloco/version/f1"):
            assert [s for s, _ in tb[tag]] == steps, (tag, tb[tag])
        records = {r.step: r for r in read_steplog(str(tmp_path / f"steps-{i}.jsonl")) if r.phase == "train"}
        assert [v for _, v in tb["diloco/rounds_merged"]] == [records[s].applies for s in steps]
        assert [v for _, v in tb["diloco/version/f1"]] == [records[s].versions[1] for s in steps]
        assert 0 <= min(v for _, v in tb["diloco/sync_share"]) <= max(v for _, v in tb["diloco/sync_share"]) < 1

    # on_log's loss reaches the step log of the sync rank where that rank sees it (TP2: rank 0 is
    # on the last stage); training really ran (finite, changing losses on every rank).
    steplog = [json.loads(line) for line in (tmp_path / "steps-0.jsonl").read_text().splitlines() if line.strip()]
    assert any(rec.get("loss") is not None for rec in steplog)
    for i in (0, 1):
        for r in results[i]:
            assert len(r["losses"]) == STEPS and len(set(r["losses"])) > 1

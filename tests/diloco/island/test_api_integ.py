"""The Python API as a user meets it: one-process islands with no ``init_process_group``,
config built in code, an explicit fragment assignment refused at HELLO by a real syncer when
islands disagree, the records ``step_end`` returns, and exact step-log byte accounting.

Real processes: a ``python -m diloco.syncer`` subprocess and island subprocesses
(``world1_island.py``); the mismatch test runs its two islands in the test process itself,
which is exactly the notebook case (no process group anywhere).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from diloco.config import IslandConfig
from diloco import quant
from diloco.digest import checkpoint_digests, combined_digest
from diloco.plan import make_plan
from diloco.island.boundary import Island, IslandError
from diloco.layout.torch_module import TorchLayout
from diloco.steplog import read_steplog
from diloco.steplog_report import summarize

pytestmark = [pytest.mark.integ, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))
from world1_island import build_model  # noqa: E402


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


class Syncer:
    """A real syncer on a free port (``--bind tcp://127.0.0.1:*``; the log names the port)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.log_path = tmp / "syncer.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*",
                                      "--insecure", *args],
                                     stderr=self._log, stdout=subprocess.DEVNULL, env=_env(), cwd=tmp)
        deadline = time.monotonic() + 90
        while not (m := re.search(r"bound (tcp://\S+)", self.log_path.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.05)
        self.addr = m.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def test_assignment_mismatch_is_refused_at_hello_by_a_real_syncer(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    syncer = Syncer(tmp_path, "--islands", "2", "--total-steps", "10")
    first = None
    try:
        cfg = IslandConfig(sync_addr=syncer.addr, island_id=0, fragments=2, heartbeat_s=0.5,
                           connect_timeout_s=60, initial_cut_timeout_s=60)
        first = Island(cfg, TorchLayout(build_model()), tokens_per_step=16)
        first.start()  # fixes the syncer's layout: the default cut
        assert first.versions == [0, 0]

        def by_block(name: str) -> int:  # another cut of the same model
            return int(name.split(".")[0]) % 2

        other = Island(cfg.replace(island_id=1), TorchLayout(build_model()), assignment=by_block,
                       tokens_per_step=16)
        assert other.plan.rule == "explicit" and other.fingerprint != first.fingerprint
        with pytest.raises(IslandError, match="fingerprint_mismatch"):
            other.start()
        # The same assignment as the first island's cut is accepted.
        same = {n: first.plan.fragment_of(n) for n in first.plan.specs}
        again = Island(cfg.replace(island_id=1), TorchLayout(build_model()), assignment=same, tokens_per_step=16)
        assert again.fingerprint != first.fingerprint  # explicit vs default: the rule is fingerprinted
        assert not dist.is_initialized()
    finally:
        if first is not None and first.client is not None:
            first.client.close(linger_s=0.2)
        syncer.stop()
    assert "fingerprint_mismatch" in syncer.log_path.read_text() or "mismatch" in syncer.log_path.read_text()


def _run_two_islands(tmp_path: Path, dtypes: tuple[str, str], steps: int,
                     island_env: dict[str, str] | None = None) -> list[dict]:
    """A real syncer and two world-1 island processes on the given wire dtypes; every process
    must exit 0 and both islands must end equal to the syncer's final checkpoint.
    ``island_env``: YETO_* variables the islands read (``--env``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    syncer = Syncer(tmp_path, "--islands", "2", "--sync-every", "8", "--total-steps", str(steps),
                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--quorum-timeout-s", "60")
    procs = []
    try:
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "world1_island.py"), "--addr", syncer.addr, "--island-id", str(i),
                 "--out", str(tmp_path), "--steps", str(steps), "--wire-dtype", dtypes[i],
                 *(["--env", "--start-together", "2"] if island_env else [])],
                stdout=open(tmp_path / f"island{i}.log", "w"), stderr=subprocess.STDOUT,
                env={**_env(), **(island_env or {})}))
        codes = [p.wait(timeout=240) for p in procs]
        assert syncer.proc.wait(timeout=60) == 0, syncer.log_path.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        syncer.stop()
    for i, code in enumerate(codes):
        assert code == 0, (tmp_path / f"island{i}.log").read_text()[-3000:]
    results = [json.loads((tmp_path / f"island{i}.json").read_text()) for i in range(2)]
    ckpt = tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text().strip()
    versions, digests = checkpoint_digests(ckpt)
    for r in results:
        assert r["dist_initialized"] is False  # no process group was ever made visible
        assert r["versions"] == versions and r["digest"] == combined_digest(digests)
    return results


def test_q4_and_bf16_islands_end_equal_to_the_final_cut(tmp_path: Path) -> None:
    """Issue 15: a q4 island (codes + bf16 scales with error feedback) and a bf16 island."""
    results = _run_two_islands(tmp_path, ("q4", "bfloat16"), steps=32)
    log = read_steplog(str(tmp_path / "island0.steplog.jsonl"))
    pushes = [e for rec in log for e in rec.events if e["type"] == "push" and not e["dropped"]]
    assert pushes and sum(e["data_bytes"] for e in pushes) == results[0]["stats"]["push_bytes_sent"]
    # Each weighted push is the q4 payload: half a byte per element plus a bf16 scale per 64.
    plan = make_plan(TorchLayout(build_model()).specs(), 2)
    weighted = [e for e in pushes if e["data_bytes"] > 0]
    assert weighted, "the q4 island never pushed with weight"
    for e in weighted:
        numel = sum(s.numel for s in plan.specs_of(e["fragment"]))
        assert e["data_bytes"] == quant.wire_nbytes("q4", numel, 64) and e["data_bytes"] / (4 * numel) <= 0.14
    # yeto-steplog reports it: fp32 bytes over wire bytes (4 / (0.5 + 2/64) = 7.5 for whole blocks).
    report = summarize(str(tmp_path / "island0.steplog.jsonl"))
    assert report.push_compression is not None and 7.0 < report.push_compression <= 7.53


def test_world1_islands_records_and_exact_byte_accounting(tmp_path: Path) -> None:
    steps = 40
    results = _run_two_islands(tmp_path, ("bfloat16", "float32"), steps)

    for i, r in enumerate(results):
        log = read_steplog(str(tmp_path / f"island{i}.steplog.jsonl"))
        events = [e for rec in log for e in rec.events]
        stats = r["stats"]
        # A push's bytes sit on its push event: their sum is what the client sent as PUSH payload.
        pushes = [e for e in events if e["type"] == "push"]
        assert pushes and sum(e["data_bytes"] for e in pushes) == stats["push_bytes_sent"] > 0
        for e in pushes:
            assert e["data_bytes"] == 0 if e["dropped"] else e["data_bytes"] % r["wire_itemsize"] == 0
        # Every payload byte sent is on a push or init event; received ones on apply / cut / final
        # (a broadcast superseded before it was applied is the only payload no event holds).
        assert sum(e["data_bytes"] for e in events if e["type"] in ("push", "init")) == stats["data_bytes_sent"]
        recv = sum(e["data_bytes"] for e in events if e["type"] in ("apply", "cut", "final"))
        assert 0 < recv <= stats["data_bytes_recv"]
        assert sum(rec.control_bytes_sent for rec in log) <= stats["control_bytes_sent"]
        assert stats["data_bytes_sent"] + stats["control_bytes_sent"] == stats["bytes_sent"]
        assert (i == 0) == any(e["type"] == "init" for e in events)
        # Phases instead of repeated step numbers: start, one train record per step, then finish.
        phases = [rec.phase for rec in log]
        assert phases[0] == "start" and phases.count("start") == 1
        assert [rec.step for rec in log if rec.phase == "train"] == list(range(1, steps + 1))
        assert set(phases[steps + 1:]) == {"finish"} and any(e["type"] == "final" for e in events)
        # step_end returned the same record the log holds.
        returned = r["records"]
        assert len(returned) == steps + 1
        for got, rec in zip(returned, log):
            assert {k: tuple(v) if isinstance(v, list) else v for k, v in got.items()} == \
                {k: v for k, v in vars(rec.boundary()).items()}
        assert returned[-1]["pushes"] == log[steps].pushes and sum(len(g["applied"]) for g in returned) >= 1


def test_synchronous_rounds_push_and_apply_at_fixed_steps_and_repeat_bitwise(tmp_path: Path) -> None:
    """YETO_DILOCO_SYNC_ROUNDS=1: every push is taken at the step that opens its round
    (ceil(t*H/P): H 8, P 2, every 4 steps), its commit is installed before the next step (lag
    0), and two runs of the same islands end bitwise equal: nothing depends on timing."""
    env = {"YETO_DILOCO_SYNC_ROUNDS": "1"}
    digests = []
    for run in range(2):
        results = _run_two_islands(tmp_path / f"run{run}", ("float32", "float32"), steps=26, island_env=env)
        digests.append(results[0]["digest"])
        for i in range(2):
            log = read_steplog(str(tmp_path / f"run{run}" / f"island{i}.steplog.jsonl"))
            pushes = [(rec.step, e) for rec in log for e in rec.events if e["type"] == "push"]
            applies = [(rec.step, e) for rec in log for e in rec.events if e["type"] == "apply"]
            training = [(s, e) for s, e in pushes if s < 26]
            assert [s for s, _ in training] == [4 * t for t in range(1, 7)], pushes
            assert all(e["round"] == s // 4 and e["local_steps"] == (4 if s == 4 else 8) for s, e in training), pushes
            trained = [(s, e) for s, e in applies if s < 26]
            assert [s for s, _ in trained] == [4 * t for t in range(1, 7)] and all(
                e["lag_steps"] == 0 for _, e in trained), applies
    assert digests[0] == digests[1]

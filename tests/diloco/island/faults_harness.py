"""Run a real syncer and real one-process islands (``world1_island.py``) as processes, with
faults: messages lost on purpose (``YETO_TEST_FAULTS``), islands SIGKILLed and restarted.
Shared by ``test_faults_integ.py`` and ``scripts/soak``; every wait is bounded."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from diloco.digest import checkpoint_digests, combined_digest
from tests.support.ports import free_port

HERE = Path(__file__).resolve().parent
ISLAND = HERE / "world1_island.py"
TOKENS_PER_STEP = 16
"""What world1_island.py passes as ``tokens_per_step`` (the ledger check bounds weights by it)."""


@dataclass
class Run:
    """One run's processes and files; ``figures`` collects what happened."""

    out: Path
    islands: int = 3
    steps: int = 40
    faults: str = ""
    wire_dtype: str = "bfloat16"
    syncer_args: tuple[str, ...] = ()
    addr: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_port()}")
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    syncer: subprocess.Popen | None = None
    figures: dict = field(default_factory=lambda: {"island_kills": 0, "syncer_kills": 0})
    _logs: list = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "YETO_SYNC_TIMEOUT_S": "4",
                "YETO_HEARTBEAT_S": "0.3", "YETO_DILOCO_INITIAL_CUT_TIMEOUT": "3", "YETO_CONNECT_TIMEOUT_S": "120",
                "YETO_FINAL_TIMEOUT_S": "200", "YETO_SYNC_KEY": "faults-test-key",
                # Every island starts from one seed: with claims no initial cut would travel, and the
                # fault hook's CUT losses are about streamed cuts.
                "YETO_DILOCO_SKIP_MATCHING_CUT": "0"}

    def syncer_cmd(self) -> list[str]:
        return [sys.executable, "-m", "diloco.syncer", "--bind", self.addr, "--islands", str(self.islands),
                "--sync-every", "4", "--total-steps", str(self.steps), "--checkpoint-dir", str(self.out / "ckpt"),
                "--checkpoint-every", "1", "--event-log", str(self.out / "events.jsonl"), "--quorum-timeout-s", "2",
                "--grace-ms", "0", "--dead-after-s", "3", "--final-timeout-s", "120", "--join-timeout-s", "60",
                "--status-every-s", "1", *self.syncer_args]

    def start_syncer(self, resume: bool = False) -> None:
        env = self.env()
        if self.faults and not resume:
            env["YETO_TEST_FAULTS"] = self.faults
        n = self.figures["syncer_kills"]
        log = open(self.out / f"syncer{n}.log", "w")
        self._logs.append(log)
        self.syncer = subprocess.Popen([*self.syncer_cmd(), *(["--resume"] if resume else [])], stdout=log,
                                       stderr=subprocess.STDOUT, env=env)

    def start_island(self, i: int) -> None:
        n = sum(1 for p in self.out.glob(f"island{i}.*.log"))
        log = open(self.out / f"island{i}.{n}.log", "w")
        self._logs.append(log)
        self.procs[i] = subprocess.Popen(
            [sys.executable, str(ISLAND), "--addr", self.addr, "--island-id", str(i), "--out", str(self.out),
             "--steps", str(self.steps), "--wire-dtype", self.wire_dtype, "--env"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env())

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.start_syncer()
        for i in range(self.islands):
            self.start_island(i)

    def commits(self) -> list[dict]:
        try:
            text = (self.out / "events.jsonl").read_text()
        except FileNotFoundError:
            return []
        lines = [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]
        return [e for e in lines if "pushed" in e and "dropped" not in e]  # commit lines only

    def kill_island(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)
        self.figures["island_kills"] += 1

    def kill_syncer(self) -> None:
        assert self.syncer is not None
        self.syncer.send_signal(signal.SIGKILL)
        self.syncer.wait(10)
        self.figures["syncer_kills"] += 1

    def kill_loop(self, kills: int, rng: random.Random, deadline_s: float = 120.0) -> None:
        """SIGKILL a random island at random points (start-up, INIT, mid-round) and restart it."""
        t_end = time.monotonic() + deadline_s
        for _ in range(kills):
            time.sleep(rng.uniform(0.3, 2.5))
            alive = [i for i, p in self.procs.items() if p.poll() is None]
            if not alive or time.monotonic() > t_end:
                break
            i = rng.choice(alive)
            self.kill_island(i)
            t0 = time.monotonic()
            self.start_island(i)
            self.figures.setdefault("restart_s", []).append(round(time.monotonic() - t0, 3))

    def wait(self, timeout_s: float) -> tuple[int | None, dict[int, int | None]]:
        """Wait for every island, then the syncer; return their exit codes (None: hung)."""
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int | None] = {}
        for i, p in self.procs.items():
            try:
                codes[i] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[i] = None
        assert self.syncer is not None
        try:
            code = self.syncer.wait(timeout=max(1.0, min(60.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            code = None
        return code, codes

    def stop(self) -> None:
        for p in [*self.procs.values(), *([self.syncer] if self.syncer else [])]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for log in self._logs:
            log.close()

    def check(self) -> list[str]:
        """What went wrong (empty: nothing): islands differ from the syncer's final state, a push
        counted twice (the same island in a commit twice, or more merged steps than it trained)."""
        problems = []
        results = {}
        for i in range(self.islands):
            path = self.out / f"island{i}.json"
            if not path.exists():
                problems.append(f"island {i} wrote no result")
                continue
            results[i] = json.loads(path.read_text())
        latest = self.out / "ckpt" / (self.out / "ckpt" / "latest").read_text().strip()
        versions, digests = checkpoint_digests(latest)
        want = combined_digest(digests)
        for i, r in results.items():
            if r["versions"] != versions or r["digest"] != want:
                problems.append(f"island {i} ended at {r['versions']} {r['digest'][:12]}, the syncer at "
                                f"{versions} {want[:12]}")
        commits = self.commits()
        merged: dict[tuple[int, int], int] = {}
        for c in commits:
            if len(set(c["pushed"])) != len(c["pushed"]):
                problems.append(f"round {c['round']} counted a push twice: {c['pushed']}")
            for isl, w in c["weights"].items():
                merged[(int(isl), c["fragment"])] = merged.get((int(isl), c["fragment"]), 0) + int(w)
        rounds = [c["round"] for c in commits]
        if self.figures["syncer_kills"] == 0 and len(set(rounds)) != len(rounds):
            problems.append("a round committed twice")
        # Tokens merged per island and fragment never exceed what its processes trained.
        runs = {i: max(1, len(list(self.out.glob(f"island{i}.*.log")))) for i in range(self.islands)}
        for (isl, f), tokens in merged.items():
            cap = runs[isl] * self.steps * TOKENS_PER_STEP * (1 + self.figures["syncer_kills"])
            if tokens > cap:
                problems.append(f"island {isl} fragment {f}: {tokens} tokens merged > {cap} trained")
        self.figures["commits_checked"] = len(commits)
        self.figures["final_versions"] = versions
        return problems

    def syncer_logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.out.glob("syncer*.log")))

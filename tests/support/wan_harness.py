"""A real syncer and real islands, each island behind its own emulated slow link (test support).

Used by ``tests/diloco/island/test_wan_integ.py`` and ``benchmarks/bench_wan.py``.  The syncer
runs as ``python -m diloco.syncer`` (a subprocess), every island is a forked process driving a
plain PyTorch model through ``diloco.island.boundary.Island`` with ``TorchLayout`` (the
example's API), and every island dials its own :class:`linkemu.LinkEmulator` in front of the
syncer.  Each island writes one JSON result (versions, digest, client counters, start-up and
finish times, training seconds); :func:`run` returns them with the emulators' counters and the
syncer's log, exit code and checkpoint digests.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import linkemu

KEY = "wan-harness-key-0123456789"


@dataclass
class WanRun:
    """One run's settings.

    Attributes:
        model_mib: fp32 size of the model (a stack of square linear layers).
        width: width of the square layers (the model has ``model_mib`` / (4·width²) of them).
        links: one :class:`linkemu.LinkSpec` per island.
        steps, sync_every, fragments: the schedule (``--total-steps``, H, P).
        step_s: extra seconds each step sleeps (emulates a step of real training).
        wire_dtype: the islands' ``YETO_WIRE_DTYPE``.
        part_mib: the syncer's ``--part-mib``.
        heartbeat_s, sync_timeout_s: the islands' ``YETO_HEARTBEAT_S`` / ``YETO_SYNC_TIMEOUT_S``.
        syncer_args: extra syncer flags.
        faults: island index -> callable taking the island's emulator, called once right after
            the islands start (e.g. to arm a reset).
        skip_matching_cut: the islands' ``YETO_DILOCO_SKIP_MATCHING_CUT`` (every island starts
            from the same seed, so with it on no island downloads its initial cut).
    """

    model_mib: float = 8.0
    width: int = 256
    links: list[linkemu.LinkSpec] = field(default_factory=lambda: [linkemu.LinkSpec()] * 2)
    steps: int = 40
    sync_every: int = 10
    fragments: int = 2
    step_s: float = 0.05
    wire_dtype: str = "float32"
    part_mib: float = 0.5
    heartbeat_s: float = 0.5
    sync_timeout_s: float = 4.0
    sync_rounds: bool = False
    syncer_args: list[str] = field(default_factory=list)
    faults: dict[int, Callable[[linkemu.LinkEmulator], None]] = field(default_factory=dict)
    timeout_s: float = 300.0
    skip_matching_cut: bool = True


def build_model(model_mib: float, width: int) -> Any:
    import torch

    layers = max(1, round(model_mib * 2**20 / (4 * (width * width + width))))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _island(i: int, run: WanRun, addr: str, out: str) -> None:
    import logging

    import torch

    from diloco.config import IslandConfig
    from diloco.digest import combined_digest, fragment_digests
    from diloco.island.boundary import Island
    from diloco.layout.torch_module import TorchLayout

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s island{i} %(name)s %(levelname)s %(message)s",
                        stream=open(Path(out, f"island{i}.log"), "a"), force=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(run.model_mib, run.width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = IslandConfig(sync_addr=addr, island_id=i, key=KEY.encode(), fragments=run.fragments,
                       wire_dtype=run.wire_dtype, heartbeat_s=run.heartbeat_s, sync_timeout_s=run.sync_timeout_s,
                       sync_rounds=run.sync_rounds, step_log=f"{out}/island{i}.steplog.jsonl",
                       initial_cut_timeout_s=run.timeout_s, final_timeout_s=run.timeout_s,
                       skip_matching_cut=run.skip_matching_cut)
    island = Island(cfg, TorchLayout(model, opt), tokens_per_step=16)
    t0 = time.monotonic()
    island.start()
    t_start = time.monotonic() - t0
    data = torch.Generator().manual_seed(i)
    t1 = time.monotonic()
    for step in range(1, run.steps + 1):
        x = torch.randn(16, run.width, generator=data)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if run.step_s > 0:
            time.sleep(run.step_s)
        island.step_end(step, loss.item())
    t_train = time.monotonic() - t1
    t2 = time.monotonic()
    versions = island.finish()
    t_finish = time.monotonic() - t2
    assert island.client is not None
    stats = island.client.stats
    Path(out, f"island{i}.json").write_text(json.dumps({
        "versions": versions, "digest": combined_digest(fragment_digests(island)),
        "redials": stats.redials, "refused": stats.refused, "pushes_dropped": stats.pushes_dropped,
        "start_s": t_start, "train_s": t_train, "finish_s": t_finish,
        "bytes_sent": stats.bytes_sent, "bytes_recv": stats.bytes_recv,
    }))


@dataclass
class WanResult:
    islands: list[dict[str, Any]]
    links: list[linkemu.LinkStats]
    syncer_code: int | None
    syncer_log: str
    island_logs: list[str]
    island_codes: list[int | None]
    out: Path
    checkpoint: tuple[list[int], list[str]] | None


def run(run: WanRun, out: Path) -> WanResult:
    """Start the syncer, one emulator per island, the islands; wait for all; collect."""
    from diloco.digest import checkpoint_digests

    out.mkdir(parents=True, exist_ok=True)
    (out / "key").write_text(KEY)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    n = len(run.links)
    slog = open(out / "syncer.log", "w")
    syncer = subprocess.Popen(
        [sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*", "--islands", str(n),
         "--sync-every", str(run.sync_every), "--total-steps", str(run.steps), "--key-file", str(out / "key"),
         "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "0", "--part-mib", str(run.part_mib),
         "--event-log", str(out / "events.jsonl"), "--weighting", "steps", "--data-threads", "1",
         "--quorum-timeout-s", str(run.timeout_s), "--final-timeout-s", str(run.timeout_s),
         "--dead-after-s", str(max(30.0, 4 * run.sync_timeout_s)), *run.syncer_args],
        stdout=slog, stderr=subprocess.STDOUT, env=env)
    emus: list[linkemu.LinkEmulator] = []
    procs: list[Any] = []
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"serving on tcp://([\d.]+):(\d+)", (out / "syncer.log").read_text())):
            if syncer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the syncer did not start: {(out / 'syncer.log').read_text()[-2000:]}")
            time.sleep(0.05)
        target = (m.group(1), int(m.group(2)))
        emus = [linkemu.LinkEmulator(target, spec).start() for spec in run.links]
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_island, args=(i, run, emus[i].address, str(out))) for i in range(n)]
        for p in procs:
            p.start()
        for i, fault in run.faults.items():
            fault(emus[i])
        for p in procs:
            p.join(timeout=max(1.0, run.timeout_s - (time.monotonic() - deadline + 60)))
        code = syncer.wait(timeout=60) if all(p.exitcode == 0 for p in procs) else syncer.poll()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if syncer.poll() is None:
            syncer.kill()
            syncer.wait(timeout=10)
        for e in emus:
            e.close()
        slog.close()
    results = [json.loads((out / f"island{i}.json").read_text()) if (out / f"island{i}.json").exists() else {}
               for i in range(n)]
    ckpt = None
    latest = out / "ckpt" / "latest"
    if latest.exists():
        ckpt = checkpoint_digests(out / "ckpt" / latest.read_text().strip())
    return WanResult(results, [e.stats for e in emus], code, (out / "syncer.log").read_text(),
                     [(out / f"island{i}.log").read_text() if (out / f"island{i}.log").exists() else ""
                      for i in range(n)], [p.exitcode for p in procs], out, ckpt)

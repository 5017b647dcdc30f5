"""A one-process island with no ``init_process_group`` (run as a script by test_api_integ.py).

Trains a small residual MLP (module names without ``layers.<i>.``, so the default plan cuts
contiguous blocks), keeps every record ``start`` / ``step_end`` returned, and writes them
with the client's byte counters, the final versions and a digest to ``OUT/islandN.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import logging
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from diloco.config import IslandConfig
from diloco.digest import combined_digest, fragment_digests
from diloco.island.boundary import Island
from diloco.layout.torch_module import TorchLayout


def build_model() -> torch.nn.Module:
    """Four residual blocks between an input and an output projection (same seed everywhere)."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
              for _ in range(4)]
    return torch.nn.Sequential(torch.nn.Linear(4, 16), *blocks, torch.nn.Linear(16, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--addr", required=True)
    p.add_argument("--island-id", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--wire-dtype", default="bfloat16")
    p.add_argument("--env", action="store_true", help="also read YETO_* variables (timeouts) from the environment")
    p.add_argument("--start-together", type=int, default=0,
                   help="N > 0: after start-up, wait until N islands of --out are ready before the first step")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"island{a.island_id} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # Required fields from overrides only: from_env validates after applying them.
    cfg = IslandConfig.from_env(dict(os.environ) if a.env else {}, sync_addr=a.addr, island_id=a.island_id, fragments=2, wire_dtype=a.wire_dtype,
                                heartbeat_s=0.5, step_log=f"{a.out}/island{{island}}.steplog.jsonl")
    island = Island(cfg, TorchLayout(model, opt), tokens_per_step=16)
    records = [island.start()]
    if a.start_together > 0:  # a file barrier: every island starts training once all are live
        open(f"{a.out}/ready.{a.island_id}", "w").close()
        deadline = time.monotonic() + 120
        while sum(n.startswith("ready.") for n in os.listdir(a.out)) < a.start_together:
            assert time.monotonic() < deadline, "start barrier timed out"
            time.sleep(0.02)
    g = torch.Generator().manual_seed(a.island_id)
    for step in range(1, a.steps + 1):
        x = torch.randn(32, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.prod(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)  # a step that takes time, so both islands take part in rounds
        records.append(island.step_end(step, loss.item()))
    versions = island.finish()
    assert island.client is not None
    result = {"versions": versions, "digest": combined_digest(fragment_digests(island) or []),
              "stats": asdict(island.client.stats), "records": [asdict(r) for r in records],
              "dist_initialized": dist.is_initialized(), "wire_itemsize": 2 if a.wire_dtype == "bfloat16" else 4}
    with open(f"{a.out}/island{a.island_id}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()

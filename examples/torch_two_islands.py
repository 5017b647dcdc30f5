"""Two DiLoCo islands training a plain PyTorch model, meeting at a syncer (CPU, < 1 minute).

    python examples/torch_two_islands.py [--out runs/torch_two_islands]

Starts ``yeto-syncer`` as a subprocess and two island processes. Each island is an ordinary
PyTorch loop (model, AdamW, backward, step) plus three calls: ``start()``, ``step_end()``
after every optimizer step, ``finish()``. No ``init_process_group``: a one-process island
makes its own private group. Both islands end with the syncer's final cut, bit for bit.
"""

import argparse, json, multiprocessing as mp, re, subprocess, sys, time  # noqa: E401
from pathlib import Path
from typing import Any

import torch

from diloco.config import IslandConfig
from diloco.digest import combined_digest, fragment_digests
from diloco.island.boundary import Island
from diloco.layout.torch_module import TorchLayout

STEPS, SYNC_EVERY, FRAGMENTS, KEY = 60, 10, 2, "example-key-please-change"


class Block(torch.nn.Module):
    """A residual MLP block; the default plan keeps each block's tensors in one fragment."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(x)."""
        return x + self.fc2(torch.relu(self.fc1(x)))


def island(island_id: int, addr: str, out: str, together: Any) -> None:
    """One island: a plain training loop with the three DiLoCo calls."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial model everywhere (island 0 sends it to the syncer)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), *[Block(32) for _ in range(4)], torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = IslandConfig(sync_addr=addr, island_id=island_id, key=KEY, fragments=FRAGMENTS,
                       step_log=f"{out}/island{island_id}.steplog.jsonl")
    diloco = Island(cfg, TorchLayout(model, opt), tokens_per_step=64)  # 64 samples per step
    diloco.start()
    together.wait(timeout=120)  # only so this short demo trains both at once; islands may join any time
    data = torch.Generator().manual_seed(island_id)  # each island sees its own data
    for step in range(1, STEPS + 1):
        x = torch.randn(64, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sin().sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        done = diloco.step_end(step, loss.item())
        if done.applied:
            print(f"island {island_id} step {step}: loss {loss.item():.4f}, applied {done.applied}, "
                  f"versions {done.versions}", flush=True)
    versions = diloco.finish()
    digest = combined_digest(fragment_digests(diloco))
    Path(out, f"island{island_id}.json").write_text(json.dumps({"versions": versions, "digest": digest}))


def main() -> int:
    """Start the syncer, run both islands, check they ended identical."""
    p = argparse.ArgumentParser(description="two plain-PyTorch DiLoCo islands and a syncer")
    p.add_argument("--out", default="runs/torch_two_islands", help="logs, step logs, checkpoints")
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "key").write_text(KEY)
    log = open(out / "syncer.log", "w")
    syncer = subprocess.Popen([sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*",
                               "--islands", "2", "--sync-every", str(SYNC_EVERY), "--total-steps", str(STEPS),
                               "--key-file", str(out / "key"), "--checkpoint-dir", str(out / "ckpt")], stderr=log)
    deadline = time.monotonic() + 60
    while not (m := re.search(r"bound (tcp://\S+)", (out / "syncer.log").read_text())):
        if syncer.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the syncer did not start; see {out}/syncer.log")
        time.sleep(0.1)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")  # fork: no re-imports
    together = ctx.Barrier(2)
    procs = [ctx.Process(target=island, args=(i, m.group(1), str(out), together)) for i in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    ok = syncer.wait(timeout=60) == 0 and all(proc.exitcode == 0 for proc in procs)
    results = [json.loads((out / f"island{i}.json").read_text()) for i in range(2)] if ok else []
    ok = ok and results[0] == results[1]
    print("both islands identical after the final cut:", ok, results[0] if ok else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

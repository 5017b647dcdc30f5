"""Two DiLoCo islands on megatron-core GPTs with different layouts (TP1, TP2), on CPU.

    python examples/megatron_two_islands.py [--out runs/megatron_two_islands]

Each island is a megatron-core job (GPTModel + DDP + DistributedOptimizer, gloo); the
DiLoCo part is the same three calls as in any loop: ``start()``, ``step_end()`` after every
``optimizer.step()``, ``finish()``, on every rank. ``MegatronLayout`` maps each rank's
shards onto canonical tensors, so a TP1 and a TP2 island merge into one model and end
bit-identical. ``diloco.demo.gpt`` stands in for your own model set-up and
launcher (torchrun): it builds the model and runs megatron on the CPU.
"""

import argparse, json, multiprocessing as mp, re, subprocess, sys, time  # noqa: E401
from pathlib import Path

import megatron.core.models.gpt  # noqa: F401  (imported once; the forked ranks share it)

from diloco.config import IslandConfig
from diloco.digest import combined_digest, fragment_digests
from diloco.island.boundary import Island
from diloco.layout.megatron import MegatronLayout
from diloco.demo.gpt import ModelSpec, build_island_model
from diloco.demo.ranks import run_ranks

STEPS, SYNC_EVERY, FRAGMENTS, KEY = 24, 6, 2, "example-key-please-change"


def rank_main(rank: int, world: int, island_id: int, addr: str, out: str) -> dict:
    """One rank of an island; the default process group exists (run_ranks / torchrun made it)."""
    spec = ModelSpec(vocab=64, hidden=32, layers=2, seq=16, micro_batch=2)
    built = build_island_model(spec, tp=world)  # your megatron model, DDP and optimizer
    layout = MegatronLayout(built.model, built.optimizer, vocab_size=spec.vocab)
    cfg = IslandConfig(sync_addr=addr, island_id=island_id, key=KEY, fragments=FRAGMENTS,
                       step_log=f"{out}/island{island_id}.steplog.jsonl")
    island = Island(cfg, layout, tokens_per_step=spec.micro_batch * spec.seq * built.dp)
    island.start()
    for step in range(1, STEPS + 1):
        loss = built.train_step()  # forward, backward, optimizer.step() on every rank
        done = island.step_end(step, loss)
        if rank == 0 and done.applied:
            print(f"island {island_id} step {step}: loss {loss:.3f}, applied {done.applied}", flush=True)
    versions = island.finish()
    digests = fragment_digests(island)  # collective; the sync rank gets the digests
    return {"versions": versions, "digest": combined_digest(digests) if digests else None}


def island(island_id: int, tp: int, addr: str, out: str) -> None:
    """Launch one island's ranks and keep the sync rank's result."""
    result = run_ranks(tp, rank_main, island_id, addr, out, timeout_s=300)[0]
    Path(out, f"island{island_id}.json").write_text(json.dumps(result))


def main() -> int:
    """Start the syncer, run a TP1 and a TP2 island, check they ended identical."""
    p = argparse.ArgumentParser(description="two megatron-core DiLoCo islands (TP1, TP2) and a syncer")
    p.add_argument("--out", default="runs/megatron_two_islands", help="logs, step logs, checkpoints")
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "key").write_text(KEY)
    syncer = subprocess.Popen([sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*",
                               "--islands", "2", "--sync-every", str(SYNC_EVERY), "--total-steps", str(STEPS),
                               "--key-file", str(out / "key"), "--checkpoint-dir", str(out / "ckpt")],
                              stderr=open(out / "syncer.log", "w"))
    deadline = time.monotonic() + 60
    while not (m := re.search(r"bound (tcp://\S+)", (out / "syncer.log").read_text())):
        if syncer.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the syncer did not start; see {out}/syncer.log")
        time.sleep(0.1)
    ctx = mp.get_context("fork")  # the islands are forked; each starts its ranks from its own forkserver
    procs = [ctx.Process(target=island, args=(i, tp, m.group(1), str(out))) for i, tp in enumerate((1, 2))]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=400)
    ok = syncer.wait(timeout=60) == 0 and all(proc.exitcode == 0 for proc in procs)
    results = [json.loads((out / f"island{i}.json").read_text()) for i in range(2)] if ok else []
    ok = ok and results[0] == results[1]
    print("TP1 and TP2 islands identical after the final cut:", ok, results[0] if ok else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One demo island: a real multi-process megatron-core GPT on CPU, trained on the shipped corpus.

``python -m diloco.demo.island --island-id 0 --layout tp2 --sync-addr tcp://... --out DIR``
forks the island's ranks (gloo), builds GPTModel + DDP + DistributedOptimizer with the
layout asked for, and trains a character-level language model. With ``--sync-addr`` it is a
DiLoCo island (``diloco.island.Island`` at the step boundary, exactly as the ms-swift
plugin drives it); without, it is the "alone" baseline: the same model and data stream
with no sync. At the end, rank 0 writes ``DIR/<name>.json``: train and held-out loss, the
final versions, and a digest of the global fp32 parameters (equal across islands after the
final cut). Progress goes to ``DIR/<name>.progress.jsonl`` (one line per step) so the demo
driver can show it live, and, when tensorboard is installed, rank 0 writes TensorBoard event
files to ``DIR/tb/<name>``: ``loss`` every step, ``eval_loss`` at the end and, on an island, the
sync scalars (``diloco/…``, handed to the island as its ``writer``) every ``--log-interval`` steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from diloco.corpus import load_corpus
from diloco.digest import combined_digest, fragment_digests
from diloco.demo.gpt import BuiltModel, ModelSpec, build_island_model
from diloco.demo.ranks import run_ranks

log = logging.getLogger(__name__)

EVAL_BATCHES = 16
"""Held-out batches every run is scored on (the same ones on every island and the baselines)."""
EVAL_MICRO_BATCH = 16
"""Rows per held-out batch: 16 x 16 x 64 = 16k tokens, enough that a 1% gap is not noise."""
HEADS = 4
"""Attention heads of the demo GPT: a layout's TP must divide it (and QUERY_GROUPS)."""
QUERY_GROUPS = 2
"""GQA query groups of the demo GPT."""
VOCAB_MULTIPLE = 8
"""The character vocabulary is rounded up to a multiple of this (TP 1, 2, 4, 8 divide it) and the
model is built with exactly that size: no padding rows. Padding rows are local to an island
(not canonical, never synced, seeded differently per TP degree), so with them two islands with
equal digests scored different held-out losses and a TP1 run did not start from a TP2 run's
weights. The extra rows are canonical, synced like any other, and never occur in the data."""


@dataclass(frozen=True)
class IslandRun:
    """Everything one demo island needs (JSON-able: it crosses the fork)."""

    name: str
    island_id: int
    layout: str
    steps: int
    fragments: int
    sync_addr: str | None
    out_dir: str
    hidden: int = 64
    layers: int = 4
    seq: int = 64
    micro_batch: int = 8
    lr: float = 3e-3
    seed: int = 1234
    data_seed: int = 0
    batch_streams: int = 1
    """Data streams per step: K > 1 trains on streams data_seed .. data_seed+K-1 together
    (K x the batch): the data-parallel bound of K islands, which see those streams apart."""
    initial_cut_timeout_s: float = 120.0
    start_together: int = 0
    """> 0: after joining, wait until this many islands joined (``start.<id>.ready`` files in
    out_dir) before the first step. Without it an island whose imports were slower joins
    after the first rounds, from an already trained cut, and the others' first rounds merge
    nothing but their own steps."""
    device: str = "cpu"
    """'cpu', or 'cuda' (every rank on the current visible GPU: a 1-GPU machine can host an island)."""
    ranks_per_node: int = 0
    """> 0: install the gloo bridge with this many ranks per node (1 bridges every group)."""
    log_interval: int = 10
    """Steps between two writes of the sync scalars to TensorBoard."""


def parse_layout(layout: str) -> tuple[int, int, int]:
    """``tp2`` / ``pp2`` / ``tp2dp2`` / ``dp2`` / ``tp1`` → (tp, pp, dp)."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    rest = layout.strip().lower()
    if not rest:
        raise ValueError("empty layout")
    while rest:
        for key in sizes:
            if rest.startswith(key):
                digits = ""
                rest = rest[len(key):]
                while rest and rest[0].isdigit():
                    digits, rest = digits + rest[0], rest[1:]
                if not digits or int(digits) < 1:
                    raise ValueError(f"layout {layout!r}: {key} needs a positive size")
                sizes[key] = int(digits)
                break
        else:
            raise ValueError(f"layout {layout!r}: expected parts like tp2, pp2, dp2")
    return sizes["tp"], sizes["pp"], sizes["dp"]


def check_layout(layout: str, layers: int, hidden: int) -> tuple[int, int, int]:
    """Parse ``layout`` and check it against the demo GPT; ValueError says what does not fit."""
    tp, pp, dp = parse_layout(layout)
    if HEADS % tp or QUERY_GROUPS % tp:
        raise ValueError(f"layout {layout!r}: tp{tp} must divide the model's {HEADS} heads and "
                         f"{QUERY_GROUPS} query groups (tp1 or tp2)")
    if hidden % tp:
        raise ValueError(f"layout {layout!r}: tp{tp} must divide --hidden {hidden}")
    if layers % pp:
        raise ValueError(f"layout {layout!r}: pp{pp} must divide --layers {layers}")
    return tp, pp, dp


class CharData:
    """Character-level tokens of the shipped corpus: a training stream and a held-out tail."""

    def __init__(self) -> None:
        text = load_corpus()
        chars = sorted(set(text))
        self.chars = len(chars)
        self.vocab = -(-self.chars // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        table = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([table[c] for c in text], dtype=torch.int64)
        cut = int(len(ids) * 0.95)
        self.train, self.held_out = ids[:cut], ids[cut:]

    def batch(self, n: int, seq: int, seed: int, held_out: bool = False) -> dict[str, torch.Tensor]:
        """``n`` random windows of ``seq`` tokens (and next-token labels), reproducible from ``seed``."""
        src = self.held_out if held_out else self.train
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(src) - seq - 1, (n,), generator=g)
        rows = torch.stack([src[s:s + seq + 1] for s in starts.tolist()])
        return {"tokens": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}


def _eval_loss(built: BuiltModel, data: CharData, run: IslandRun) -> float:
    """Mean held-out loss over fixed batches (forward only; collective like a train step)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mb, seq = EVAL_MICRO_BATCH, run.seq
    position_ids = torch.arange(seq, device=built.device).unsqueeze(0).expand(mb, seq)
    total = 0.0
    for i in range(EVAL_BATCHES):
        batch = {k: v.to(built.device) for k, v in data.batch(mb, seq, seed=10_000 + i, held_out=True).items()}

        def forward_step(it: Any, model: torch.nn.Module, batch: dict = batch) -> tuple:
            next(it, None)
            out = model(batch["tokens"], position_ids, None, labels=batch["labels"])
            return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

        losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]),
                                             model=built.model, num_microbatches=1, seq_length=seq,
                                             micro_batch_size=mb, forward_only=True)
        value = float(losses[0]["loss"]) if ps.is_pipeline_last_stage() and losses else 0.0
        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        total += float(t)
    return total / EVAL_BATCHES


def _start_barrier(run: IslandRun, rank: int) -> None:
    """Rank 0 announces this island and waits for the others' files; then the island's ranks meet."""
    if rank == 0:
        with open(os.path.join(run.out_dir, f"start.{run.island_id}.ready"), "w") as fh:
            fh.write(run.name)
        deadline = time.monotonic() + run.initial_cut_timeout_s
        while True:
            ready = [n for n in os.listdir(run.out_dir) if n.startswith("start.") and n.endswith(".ready")]
            if len(ready) >= run.start_together:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"start barrier: {len(ready)} of {run.start_together} islands joined within "
                                   f"{run.initial_cut_timeout_s:.0f}s")
            time.sleep(0.05)
        log.info("start barrier: %d islands joined", run.start_together)
    torch.distributed.barrier()


def _train_batch(data: CharData, run: IslandRun, step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch: one stream per island (``data_seed``), K streams side by side for
    the data-parallel bound, so its batch is exactly what K islands see at that step."""
    parts = [data.batch(run.micro_batch, run.seq, seed=s * 1_000_003 + step * 101 + dp_rank)
             for s in range(run.data_seed, run.data_seed + run.batch_streams)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _tensorboard(run: IslandRun, rank: int) -> Any:
    """Rank 0's SummaryWriter in ``DIR/tb/<name>`` (None elsewhere, or without tensorboard)."""
    if rank != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed: no event files (pip install tensorboard)")
        return None
    return SummaryWriter(log_dir=os.path.join(run.out_dir, "tb", run.name))


def _rank_main(rank: int, world: int, run_dict: dict) -> dict | None:
    run = IslandRun(**run_dict)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {run.name} r{rank} %(levelname)s %(message)s")
    for name in ("megatron", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    tp, pp, _ = parse_layout(run.layout)
    if run.device == "cuda":
        # One GPU may host several ranks: each rank takes GPU rank % visible GPUs.
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if run.ranks_per_node > 0:
        import gloo_bridge

        gloo_bridge.install(ranks_per_node=run.ranks_per_node)
    data = CharData()
    spec = ModelSpec(vocab=data.vocab, hidden=run.hidden, layers=run.layers, heads=HEADS, query_groups=QUERY_GROUPS,
                     ffn=2 * run.hidden, seq=run.seq, micro_batch=run.micro_batch * run.batch_streams, dtype="bf16",
                     seed=run.seed, vocab_pad_to=VOCAB_MULTIPLE)
    built = build_island_model(spec, tp=tp, pp=pp, lr=run.lr, device=run.device)
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank()
    tb = _tensorboard(run, rank)
    island = None
    slice_bytes = 0
    if run.sync_addr:
        from diloco.config import IslandConfig
        from diloco.island.boundary import Island

        # The same path a real job takes: YETO_* variables (the key, timeouts) read in one place,
        # with what this launcher decides filled in.
        env = {**os.environ, "YETO_SYNC_ADDR": run.sync_addr, "YETO_ISLAND_ID": str(run.island_id),
               "YETO_DILOCO_FRAGMENTS": str(run.fragments),
               "YETO_DILOCO_INITIAL_CUT_TIMEOUT": str(run.initial_cut_timeout_s),
               "YETO_DILOCO_STEP_LOG": os.path.join(run.out_dir, f"{run.name}.steplog.jsonl")}
        cfg = IslandConfig.from_env(env, writer=tb, log_interval=run.log_interval)
        tokens = run.micro_batch * run.seq * ps.get_data_parallel_world_size()
        layout = built.layout()
        island = Island(cfg, layout, tokens_per_step=tokens)
        slice_bytes = sum(p.master.numel() * 4 for p in layout.local_pieces())
        island.start()
        if run.start_together > 0:
            _start_barrier(run, rank)
    progress = open(os.path.join(run.out_dir, f"{run.name}.progress.jsonl"), "w") if rank == 0 else None
    first_loss = last_loss = math.nan
    t0 = time.time()
    for step in range(1, run.steps + 1):
        loss = built.train_step(_train_batch(data, run, step, dp_rank))
        if step == 1:
            first_loss = loss
        last_loss = loss
        if island is not None:
            island.step_end(step, loss)
        if progress is not None:
            progress.write(json.dumps({"step": step, "loss": loss, "time": time.time() - t0}) + "\n")
        if tb is not None:
            tb.add_scalar("loss", loss, step)
            progress.flush()
    versions = island.finish() if island is not None else []
    eval_loss = _eval_loss(built, data, run)
    if tb is not None:
        tb.add_scalar("eval_loss", eval_loss, run.steps)
        tb.close()
    digests = fragment_digests(island) if island is not None else None
    digest = combined_digest(digests) if digests is not None else None
    buffers = None if island is None else {"rank": rank, "sync_buffers": dict(island.sync_buffers),
                                           "slice_bytes": slice_bytes,
                                           "model_bytes": sum(island.plan.nbytes(f) for f in range(island.plan.n_fragments))}
    if rank != 0:
        return buffers
    assert progress is not None
    progress.close()
    return {"name": run.name, "layout": run.layout, "first_loss": first_loss, "train_loss": last_loss,
            "eval_loss": eval_loss, "versions": versions, "digest": digest, "wall_s": time.time() - t0,
            "steps": run.steps, "data_seed": run.data_seed, "batch_streams": run.batch_streams,
            "ranks": [buffers]}


def run_island(run: IslandRun, timeout_s: float = 1800.0) -> dict:
    """Fork the island's ranks, train, and return rank 0's result (also written to DIR/<name>.json)."""
    tp, pp, dp = parse_layout(run.layout)
    results = run_ranks(tp * pp * dp, _rank_main, asdict(run), timeout_s=timeout_s)
    result = results[0]
    result["ranks"] = [r for r in [result["ranks"][0], *results[1:]] if r is not None]  # each rank's sync buffers
    with open(os.path.join(run.out_dir, f"{run.name}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco.demo.island``: run one demo island (what ``yeto-demo`` launches)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--island-id", type=int, default=0)
    p.add_argument("--layout", default="tp2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--sync-addr", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--batch-streams", type=int, default=1,
                   help="train on this many data streams at once (K x the batch; the data-parallel bound)")
    p.add_argument("--start-together", type=int, default=0,
                   help="> 0: wait after joining until this many islands joined (files in --out)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks-per-node", type=int, default=0, help="> 0: install the gloo bridge")
    a = p.parse_args(argv)
    run = IslandRun(name=a.name, island_id=a.island_id, layout=a.layout, steps=a.steps, fragments=a.fragments,
                    sync_addr=a.sync_addr, out_dir=a.out, hidden=a.hidden, layers=a.layers, seq=a.seq,
                    micro_batch=a.micro_batch, lr=a.lr, data_seed=a.data_seed, batch_streams=a.batch_streams,
                    device=a.device, ranks_per_node=a.ranks_per_node, start_together=a.start_together)
    os.makedirs(a.out, exist_ok=True)
    try:
        run_island(run, timeout_s=a.timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        print(f"{a.name}: failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

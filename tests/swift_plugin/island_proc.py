"""One island for test_callback_integ.py: a real megatron-core job driven like ms-swift drives it.

Run as a script (its own process, so two islands and the syncer are separate processes, as in
production). It forks ``--world`` ranks with :func:`diloco.demo.ranks.run_ranks`;
every rank builds a real GPTModel + DDP + DistributedOptimizer with the requested TP / PP and
runs the loop of ms-swift's ``BaseMegatronTrainer`` around :class:`YetoIslandHooks`:
``on_train_begin`` (then an optional file barrier across islands), then per step
forward/backward + ``optimizer.step()``, ``state.iteration += 1``, ``on_step_end``,
``on_log`` every ``--log-every`` steps, and finally ``on_train_end``. The ``YETO_*`` variables come from the environment, as in a job.
The last stdout line is one JSON object: every rank's result.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from diloco.demo.gpt import ModelSpec, build_island_model
from diloco.demo.ranks import run_ranks


def _spec() -> ModelSpec:
    # vocab 100: TP2 pads it to 256, PP2 (TP1) to 128, so canonical shapes must use the true size.
    return ModelSpec(vocab=100, hidden=64, layers=2, heads=4, query_groups=2, ffn=128, seq=16, dtype="bf16")


def _barrier(directory: str, me: str, total: int, timeout_s: float = 90.0) -> None:
    """Wait until every rank of every island has joined the syncer (a file each).

    Islands start at different speeds on a loaded machine; without this, a fast island can
    finish all its steps (and the syncer finalize with it alone) before the other one says
    HELLO, which the protocol allows but which would leave nothing to test.
    """
    Path(directory, f"ready-{me}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(Path(directory).glob("ready-*"))) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"start barrier: {len(list(Path(directory).glob('ready-*')))} of {total} ranks ready")
        time.sleep(0.05)


def _rank_main(rank: int, world: int, tp: int, pp: int, steps: int, log_every: int, barrier_dir: str,
               n_ranks_total: int, tensorboard_dir: str) -> dict[str, Any]:
    from swift_plugin.island_callback import YetoIslandHooks

    spec = _spec()
    built = build_island_model(spec, tp=tp, pp=pp)
    # What mcore-bridge's ModelConfig carries and ms-swift's trainer exposes as `trainer.config`.
    config = built.unwrapped[0].config
    config.padded_vocab_size = spec.vocab
    trainer = SimpleNamespace(
        args=SimpleNamespace(global_batch_size=spec.micro_batch * built.dp, seq_length=spec.seq,
                             max_length=spec.seq, train_iters=steps, tensorboard_dir=tensorboard_dir or None,
                             log_interval=log_every),
        state=SimpleNamespace(iteration=0),
        wrapped_models=built.model,
        unwrapped_models=built.unwrapped,
        optimizer=built.optimizer,
        config=config,
        callbacks=[],
    )
    tb_writer = None
    if tensorboard_dir and rank == world - 1:
        # As ms-swift's TensorboardCallback: the job's writer lives on the last rank only.
        from torch.utils.tensorboard import SummaryWriter

        tb_writer = SummaryWriter(log_dir=tensorboard_dir)
        trainer.callbacks.append(SimpleNamespace(writer=tb_writer))
    hooks = YetoIslandHooks(trainer)
    hooks.on_train_begin()
    if barrier_dir:
        _barrier(barrier_dir, f"{os.environ['YETO_ISLAND_ID']}-{rank}", n_ranks_total)
    losses = []
    while trainer.state.iteration < steps:
        loss = built.train_step()
        trainer.state.iteration += 1
        hooks.on_step_end()
        if trainer.state.iteration % log_every == 0:
            hooks.on_log({"loss": loss, "grad_norm": 1.0, "learning_rate": 1e-3})
            if tb_writer is not None:
                tb_writer.add_scalar("loss", loss, trainer.state.iteration)
        losses.append(loss)
    # As ms-swift's loop: the last step's on_step_end took the final cut, so the save that follows
    # it in the same iteration writes the merged model; on_train_end has nothing left to do.
    finished_at_last_step = hooks.final_versions is not None
    hooks.on_train_end()
    if tb_writer is not None:
        tb_writer.close()
    return {"rank": rank, "versions": hooks.final_versions, "digests": hooks.final_digests, "losses": losses,
            "finished_at_last_step": finished_at_last_step,
            "tokens_per_step": hooks.config.tokens_per_step if hooks.config else None,
            "n_fragments": hooks.island.plan.n_fragments}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--barrier-dir", default="", help="start barrier shared by all islands (after on_train_begin)")
    p.add_argument("--barrier-ranks", type=int, default=0, help="ranks of all islands that meet at the barrier")
    p.add_argument("--tensorboard-dir", default="", help="the job's TensorBoard directory (writer on the last rank)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    # Import megatron once in the parent, so the forked ranks do not pay for it each.
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    results = run_ranks(a.world, _rank_main, a.tp, a.pp, a.steps, a.log_every, a.barrier_dir, a.barrier_ranks,
                        a.tensorboard_dir, timeout_s=a.timeout_s)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

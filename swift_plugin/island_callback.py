"""The ``yeto`` callback's logic, free of any ms-swift import, so it runs and is tested on CPU.

ms-swift's Megatron trainer calls its callbacks on every rank: ``on_train_begin`` once the
model, the DDP wrappers and the optimizer exist (after Megatron created its process groups),
``on_step_end`` right after ``optimizer.step()`` and ``state.iteration += 1``, ``on_log`` with
the reduced metrics every ``--logging_steps``, ``on_train_end`` after the last step.
:class:`YetoIslandHooks` maps those onto the island core:

* ``on_train_begin`` → read ``YETO_*`` (:meth:`IslandConfig.from_env`), create the island's
  gloo group, build :class:`MegatronLayout` over the trainer's DDP chunks and ChainedOptimizer,
  build :class:`Island` and run :meth:`Island.start` (HELLO, INIT when asked, initial cut);
* ``on_step_end`` → :meth:`Island.step_end` (the step boundary); at the last step
  (``state.iteration`` reaches ``args.train_iters``) also :meth:`Island.finish`, so ms-swift's
  final save, which follows ``on_step_end`` in the same iteration, writes the merged model;
* ``on_log`` → remember the last training loss, written to the step log at the next boundary;
* ``on_train_end`` → :meth:`Island.finish` (final cut) unless the last step took it, then the
  optional final digest.

Sync scalars (``diloco/…``, ``diloco/steplog_scalars.py``) go to the job's own writers, found by
:func:`job_writers`: the ``writer`` of ms-swift's ``tensorboard`` / ``wandb`` callbacks, else
Megatron-LM's ``get_tensorboard_writer()`` / ``get_wandb_writer()``, every ``--log_interval``
(``--logging_steps``) steps unless ``YETO_DILOCO_LOG_INTERVAL`` says otherwise. Those writers live
on the job's last rank; the scalars are written by the sync rank. When the sync rank holds no
writer of its own but the job logs to TensorBoard, the sync rank opens one more event file in the
job's TensorBoard directory, so the scalars show beside the loss in the same run; for wandb, set
``YETO_SYNC_RANK`` to the last rank.

Every hook runs on every rank, in the same order, so every collective inside (group creation,
layout table exchange, boundaries) is entered by all ranks of the island together. A missing
``YETO_SYNC_ADDR`` / ``YETO_ISLAND_ID`` raises :class:`ConfigError` on every rank at once
(they share the environment), before any collective is started.

``plugin.py`` subclasses ms-swift's ``MegatronCallback`` and delegates here; the trainer object
only needs the attributes ms-swift's ``BaseMegatronTrainer`` gives a callback: ``args``
(``global_batch_size``, ``seq_length`` / ``max_length``), ``state`` (``iteration``),
``wrapped_models``, ``unwrapped_models`` and ``optimizer``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from diloco.config import ConfigError, IslandConfig
from diloco.steplog_scalars import is_writer
from swift_plugin.options import PluginOptions

log = logging.getLogger(__name__)


class YetoIslandHooks:
    """DiLoCo for one ms-swift Megatron job (one island); build one per rank with the trainer.

    Args:
        trainer: ms-swift's Megatron trainer (or anything with the same attributes, see the
            module docstring). Read lazily: the model and optimizer only exist by
            ``on_train_begin``.
        env: where ``YETO_*`` variables come from (default ``os.environ``); tests pass a dict.
    """

    def __init__(self, trainer: Any, env: Mapping[str, str] | None = None) -> None:
        self.trainer = trainer
        self.env = env
        self.island: Any = None
        self.config: IslandConfig | None = None
        self.options = PluginOptions.from_env(env)
        self.final_versions: list[int] | None = None
        self.final_digests: list[str] | None = None
        self._last_loss: float | None = None
        self._finish_error: Exception | None = None
        self._last_iteration: int | None = None

    # ------------------------------------------------------------------ hooks
    def on_train_begin(self) -> None:
        """Join the syncer: config, island group, layout, :meth:`Island.start` (collective)."""
        from diloco.island.boundary import Island
        from diloco.layout.megatron import MegatronLayout

        try:
            config = IslandConfig.from_env(self.env)
        except ConfigError as exc:
            # Every rank sees the same environment, so every rank raises here together.
            raise ConfigError(f"the yeto callback is enabled (--callbacks yeto) but its configuration is "
                              f"incomplete: {exc}") from exc
        rank = dist.get_rank()
        writers = job_writers(self.trainer) if rank == config.sync_rank else []
        if rank == config.sync_rank and not writers:
            writers = own_tensorboard_writer(self.trainer.args)
        interval = config.log_interval or int(getattr(self.trainer.args, "log_interval", 0) or
                                              getattr(self.trainer.args, "logging_steps", 0) or 0)
        config = config.replace(writer=writers or None, log_interval=max(0, interval))
        tokens = config.tokens_per_step or tokens_per_step_from_args(self.trainer.args)
        if tokens:
            config = config.replace(tokens_per_step=tokens)
        else:
            log.warning("yeto: tokens per step unknown (no global_batch_size / seq_length in the job's args, "
                        "YETO_DILOCO_TOKENS_PER_STEP unset): this island's pushes weigh by steps")
        self.config = config
        # The island's own CPU group, shared by the layout (canonical table exchange) and the
        # island (orders, export, apply). Created by every rank in the same order: the default
        # group of a GPU job is NCCL, which cannot carry the CPU tensors the sync core uses.
        group = dist.new_group(backend="gloo")
        layout = MegatronLayout(list(self.trainer.wrapped_models), self.trainer.optimizer,
                                vocab_size=true_vocab_size(self.trainer), group=group)
        self.island = Island(config, layout, group=group, tokens_per_step=config.tokens_per_step or None)
        log.info("yeto: island %d rank %d joining %s (%d fragments, %s tokens/step)", config.island_id,
                 dist.get_rank(group), config.sync_addr, self.island.plan.n_fragments,
                 config.tokens_per_step or "unknown")
        self.island.start()

    def on_step_end(self) -> None:
        """The step boundary, right after ``optimizer.step()`` (collective)."""
        if self.island is None:
            raise RuntimeError("yeto: on_step_end before on_train_begin")
        if self.final_versions is not None or self._finish_error is not None:
            log.warning("yeto: on_step_end at iteration %s after the final cut: nothing to do",
                        self.trainer.state.iteration)
            return
        iteration = int(self.trainer.state.iteration)
        self.island.step_end(iteration, self._last_loss)
        if self._last_iteration is None:
            self._last_iteration = _train_iters(self.trainer.args)  # fixed before training starts
        if self._last_iteration > 0 and iteration >= self._last_iteration:
            # Before ms-swift's final save (it follows on_step_end in the same iteration), so the
            # checkpoint it writes is the merged model. A final cut that fails lets that save go on
            # with this island's own model; the error is raised at on_train_end.
            try:
                self._finish()
            except Exception as exc:  # noqa: BLE001 - kept and raised after the job's save
                log.error("yeto: the final cut failed (%s); the job's final save keeps this island's own model, "
                          "and the error is raised at the end of training", exc)
                self._finish_error = exc

    def on_log(self, logs: Mapping[str, Any]) -> None:
        """Remember the last training loss (only ranks of the last PP stage see one)."""
        value = logs.get("loss")
        try:
            loss = float(value) if value is not None else None
        except (TypeError, ValueError):
            loss = None
        if loss is not None and math.isfinite(loss):
            self._last_loss = loss

    def on_train_end(self) -> None:
        """The final cut when the last step's ``on_step_end`` has not taken it already (training
        stopped before ``args.train_iters``, or the job has no such arg)."""
        if self.island is None:
            raise RuntimeError("yeto: on_train_end before on_train_begin")
        if self._finish_error is not None:
            raise self._finish_error
        if self.final_versions is None:
            self._finish()

    def _finish(self) -> None:
        """Final cut (collective), then the optional digest of the final global parameters."""
        from swift_plugin.digest import fragment_digests, write_digest_file

        assert self.island is not None
        self.final_versions = self.island.finish()
        log.info("yeto: island %d finished at step %d, final versions %s", self.island.cfg.island_id,
                 self.island.step, self.final_versions)
        assert self.config is not None
        path = self.options.digest_path(self.config.island_id)
        if path is None:
            return
        # Collective export of every fragment; only the sync rank receives and writes.
        self.final_digests = fragment_digests(self.island)
        if self.final_digests is not None:
            write_digest_file(path, self.config.island_id, self.final_versions, self.final_digests)


def _train_iters(args: Any) -> int:
    """The job's last iteration (``args.train_iters``, any integral number), 0 when unknown."""
    value = getattr(args, "train_iters", None)
    try:
        last = int(value) if value is not None and not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        return 0
    return last if last == value else 0  # 48.0 or numpy's 48, never a fraction


def job_writers(trainer: Any) -> list[object]:
    """The job's scalar writers on this rank: ms-swift's tensorboard / wandb callbacks' ``writer``
    (ms-swift 4), else Megatron-LM's ``get_tensorboard_writer()`` / ``get_wandb_writer()`` (the
    training loop of ms-swift 3); empty when this rank has none (they live on the last rank)."""
    found: list[object] = []
    for cb in list(getattr(trainer, "callbacks", None) or []):
        w = getattr(cb, "writer", None)
        if w is not None and is_writer(w) and all(w is not x for x in found):
            found.append(w)
    if found:
        return found
    try:
        from megatron.training import get_tensorboard_writer, get_wandb_writer  # Megatron-LM, not megatron-core
    except ImportError:
        return []
    return [w for w in (get_tensorboard_writer(), get_wandb_writer()) if w is not None and is_writer(w)]


def own_tensorboard_writer(args: Any) -> list[object]:
    """A SummaryWriter of the sync rank's own in the job's TensorBoard directory (``--tensorboard_dir``,
    ms-swift's default ``<output_dir>/runs`` when it reports to tensorboard); empty when the job
    does not log to TensorBoard or tensorboard is not installed."""
    logdir = getattr(args, "tensorboard_dir", None)
    report_to = getattr(args, "report_to", None) or ()
    if not logdir and "tensorboard" in report_to and getattr(args, "output_dir", None):
        logdir = f"{args.output_dir}/runs"
    if not logdir:
        return []
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("yeto: the job logs to TensorBoard in %s but tensorboard is not installed here: no sync "
                    "scalars", logdir)
        return []
    log.info("yeto: sync scalars (diloco/...) go to %s (an event file of the sync rank's own)", logdir)
    return [SummaryWriter(log_dir=str(logdir), filename_suffix=".yeto")]


def tokens_per_step_from_args(args: Any) -> int:
    """Tokens one optimizer step consumes: ``global_batch_size`` x sequence length (0 if unknown).

    ms-swift sets ``seq_length = packing_length or max_length``; it is an upper bound (padding
    counts), which is what weights need: the same for every step of the island.
    """
    gbs = getattr(args, "global_batch_size", None)
    seq = getattr(args, "seq_length", None) or getattr(args, "max_length", None)
    if not gbs or not seq:
        return 0
    return int(gbs) * int(seq)


def true_vocab_size(trainer: Any) -> int | None:
    """The vocabulary size before Megatron pads it to a multiple of TP (None when unknown).

    mcore-bridge keeps the HF ``vocab_size`` as ``config.padded_vocab_size`` and the GPTModel
    rounds it up to a multiple of TP; islands with different TP must agree on the canonical
    shape, so the layout gets the unrounded value.
    """
    chunks = getattr(trainer, "unwrapped_models", None) or []
    config = getattr(trainer, "config", None) or (getattr(chunks[0], "config", None) if chunks else None)
    value = getattr(config, "padded_vocab_size", None)
    return int(value) if value else None

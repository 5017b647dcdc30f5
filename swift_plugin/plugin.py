"""The file passed to ms-swift's ``--external_plugins``: registers the ``yeto`` Megatron callback.

ms-swift imports this file by path (under a hashed module name) on every rank, while parsing
its arguments, before ``torch.distributed`` is initialised and before Megatron creates its
process groups. That is the one moment where the gloo bridge can still route every group
that spans nodes onto gloo, so with ``YETO_CROSS_NODE_GLOO=1`` it is installed here. Apart
from that and from registering ``yeto`` in ``megatron_callbacks_map`` (enabled by
``--callbacks yeto``), importing this file does nothing: no process group, no socket, no
environment check of the DiLoCo variables (those are read in ``on_train_begin``, so a job
that loads the plugin without enabling the callback is unaffected).

Because the module name is hashed, project code is imported by its absolute package names
(``swift_plugin``, ``diloco``, ``gloo_bridge``): install the project (``pip install -e .``)
or put the repository root on ``PYTHONPATH``. ``python -m swift_plugin`` prints this file's
absolute path for the command line.

This file and nothing else in the project imports ms-swift; the callback's logic lives in
:mod:`swift_plugin.island_callback` so that it runs and is tested without ms-swift.
"""

from __future__ import annotations

import logging
import os
from typing import Any

try:
    from swift_plugin.options import BridgeOptions
except ImportError as exc:  # loaded by path: the package itself must be importable
    raise ImportError("the yeto ms-swift plugin needs the yeto-diloco packages importable: `pip install -e "
                      "<repo>` or add the repository root to PYTHONPATH") from exc

_LOG_PACKAGES = ("diloco", "gloo_bridge", "swift_plugin")


def _ensure_log_handler() -> None:
    """Make the project's INFO lines visible when nothing configured logging (ms-swift only
    configures its own ``swift`` logger). ``YETO_LOG_LEVEL`` picks the level (default INFO)."""
    if logging.getLogger().handlers:
        return
    level = os.environ.get("YETO_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler()
    rank = os.environ.get("RANK", "0")
    handler.setFormatter(logging.Formatter(f"%(asctime)s [yeto rank {rank}] %(levelname)s %(name)s: %(message)s"))
    for name in _LOG_PACKAGES:
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(getattr(logging, level, logging.INFO))
            logger.propagate = False


_ensure_log_handler()

# Before anything below can create a process group (see the module docstring).
_BRIDGE = BridgeOptions.from_env()
if _BRIDGE.enabled:
    import gloo_bridge

    gloo_bridge.install(_BRIDGE.ranks_per_node)

from swift.megatron.callbacks import MegatronCallback, megatron_callbacks_map  # noqa: E402

from swift_plugin.island_callback import YetoIslandHooks  # noqa: E402


class YetoCallback(MegatronCallback):
    """``--callbacks yeto``: this Megatron job is one DiLoCo island (see ``docs/SWIFT.md``)."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.hooks = YetoIslandHooks(trainer)

    def on_train_begin(self) -> None:
        """ms-swift hook: join the syncer (``Island.start``)."""
        self.hooks.on_train_begin()

    def on_step_end(self) -> None:
        """ms-swift hook: the step boundary (``Island.step_end``); at the last step also the final cut,
        before ms-swift's final save."""
        self.hooks.on_step_end()

    def on_log(self, logs: Any) -> None:
        """ms-swift hook: remember the loss for the step log."""
        self.hooks.on_log(logs)

    def on_train_end(self) -> None:
        """ms-swift hook: the final cut (``Island.finish``) when training stopped before its last step."""
        self.hooks.on_train_end()


megatron_callbacks_map["yeto"] = YetoCallback

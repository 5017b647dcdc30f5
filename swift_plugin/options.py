"""Settings of the ms-swift glue that are not part of the island core's ``IslandConfig``.

Two things are read here, outside :class:`diloco.config.IslandConfig`, on purpose:

* the gloo-bridge switch (``YETO_CROSS_NODE_GLOO``, ``YETO_RANKS_PER_NODE``) is needed when
  ``plugin.py`` is imported, long before the callback runs and possibly in a job that never
  enables the ``yeto`` callback, so it must not require ``YETO_SYNC_ADDR`` / ``YETO_ISLAND_ID``;
* the optional final digest file (``YETO_DILOCO_DIGEST_FILE``) is a verification aid of the
  plugin (it proves two islands ended bit-identical), not something the sync core needs.

Bad values fail at start with :class:`~diloco.config.ConfigError` naming the variable, the
same contract as the island config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from diloco.config import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class BridgeOptions:
    """Whether (and how) ``plugin.py`` installs the gloo bridge at import time."""

    enabled: bool = False
    """``YETO_CROSS_NODE_GLOO``: ``1`` routes process groups that span nodes through gloo."""

    ranks_per_node: int | None = None
    """``YETO_RANKS_PER_NODE``: ranks per node; unset = the launcher's ``LOCAL_WORLD_SIZE``."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BridgeOptions:
        """Read ``YETO_CROSS_NODE_GLOO`` / ``YETO_RANKS_PER_NODE`` (``env`` defaults to ``os.environ``)."""
        env = os.environ if env is None else env
        raw = env.get("YETO_CROSS_NODE_GLOO", "").strip().lower()
        if raw not in _TRUE + _FALSE:
            raise ConfigError(f"YETO_CROSS_NODE_GLOO={raw!r} must be 0 or 1")
        rpn_raw = env.get("YETO_RANKS_PER_NODE", "").strip()
        rpn: int | None = None
        if rpn_raw:
            try:
                rpn = int(rpn_raw)
            except ValueError:
                raise ConfigError(f"YETO_RANKS_PER_NODE={rpn_raw!r} is not an integer") from None
            if rpn < 1:
                raise ConfigError(f"YETO_RANKS_PER_NODE={rpn!r} must be >= 1")
        return cls(enabled=raw in _TRUE, ranks_per_node=rpn)


@dataclass(frozen=True)
class PluginOptions:
    """Optional behaviour of the ``yeto`` callback beyond the island core."""

    digest_file: str | None = None
    """``YETO_DILOCO_DIGEST_FILE``: after the final cut, the sync rank exports every fragment
    (fp32 global tensors) and writes their SHA-256 digests as JSON to this path (``{island}``
    is replaced by the island id). Costs one full export at the end; unset = skipped."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginOptions:
        """Read the plugin-only variables (``YETO_DILOCO_DIGEST_FILE``)."""
        env = os.environ if env is None else env
        return cls(digest_file=env.get("YETO_DILOCO_DIGEST_FILE") or None)

    def digest_path(self, island_id: int) -> str | None:
        """The digest path with ``{island}`` filled in (None when unset)."""
        return None if self.digest_file is None else self.digest_file.replace("{island}", str(island_id))

"""Which node a rank is on, and whether a process group spans nodes.

Why: the bridge must decide, identically on every rank, which groups cross a
node boundary (those run on gloo) and which stay inside a node (those keep
NCCL/HCCL). Nodes are contiguous blocks of ``ranks_per_node`` ranks, the
layout every launcher (torchrun, ms-swift, mpirun with ``--map-by node``)
produces. The value comes from the caller, else ``YETO_RANKS_PER_NODE`` (an
override, so a single machine can pretend to be several nodes), else the
launcher's ``LOCAL_WORLD_SIZE``. Bad values fail loudly with the variable's
name: a wrong guess here would silently route groups to the wrong backend.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ENV_RANKS_PER_NODE = "YETO_RANKS_PER_NODE"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

__all__ = [
    "ENV_LOCAL_WORLD_SIZE",
    "ENV_RANKS_PER_NODE",
    "NodeLayout",
    "resolve_node_layout",
]


@dataclass(frozen=True)
class NodeLayout:
    """How ranks map to nodes.

    Attributes:
        ranks_per_node: ranks on each node (>= 1); node of rank r is
            ``r // ranks_per_node``.
        source: where the value came from (``"argument"`` or the variable
            name), quoted in every error so the operator knows what to fix.
    """

    ranks_per_node: int
    source: str

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"{self.source}: ranks per node must be >= 1, got {self.ranks_per_node}")

    def node_of(self, rank: int) -> int:
        """The node index of global ``rank``."""
        return rank // self.ranks_per_node

    def nodes_of(self, ranks: Iterable[int]) -> list[int]:
        """Sorted distinct nodes that ``ranks`` live on."""
        return sorted({self.node_of(r) for r in ranks})

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        """True when ``ranks`` live on more than one node."""
        return len(self.nodes_of(ranks)) > 1

    def check_world(self, world_size: int) -> None:
        """Fail unless ``world_size`` is a whole number of nodes."""
        if world_size % self.ranks_per_node != 0:
            raise ValueError(
                f"gloo_bridge: {self.source}={self.ranks_per_node} does not divide the world size "
                f"{world_size}: every node must hold the same number of ranks"
            )


def _parse(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"gloo_bridge: {name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"gloo_bridge: {name}={value} must be >= 1")
    return value


def resolve_node_layout(ranks_per_node: int | None = None, env: Mapping[str, str] | None = None) -> NodeLayout:
    """Pick ranks-per-node from the argument, ``YETO_RANKS_PER_NODE`` or ``LOCAL_WORLD_SIZE``.

    Args:
        ranks_per_node: explicit value; wins over the environment.
        env: environment to read (default ``os.environ``; tests pass a dict).

    Raises:
        ValueError: the chosen value is missing, not an integer or < 1; the
            message names the argument or variable.
    """
    environ = os.environ if env is None else env
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
            raise ValueError(f"gloo_bridge: ranks_per_node={ranks_per_node!r} is not an integer")
        if ranks_per_node < 1:
            raise ValueError(f"gloo_bridge: ranks_per_node={ranks_per_node} must be >= 1")
        return NodeLayout(ranks_per_node, "ranks_per_node")
    for name in (ENV_RANKS_PER_NODE, ENV_LOCAL_WORLD_SIZE):
        raw = environ.get(name)
        if raw is not None and raw.strip() != "":
            return NodeLayout(_parse(name, raw), name)
    raise ValueError(
        f"gloo_bridge: ranks per node unknown: pass ranks_per_node, set {ENV_RANKS_PER_NODE}, "
        f"or launch with a launcher that sets {ENV_LOCAL_WORLD_SIZE} (torchrun does)"
    )

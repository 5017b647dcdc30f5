"""Installing the gloo bridge: patching torch.distributed group creation and calls.

Why: Megatron (and ms-swift on top of it) create their process groups and call
collectives through ``torch.distributed`` directly; the only way to route the
groups that cross nodes onto gloo, without forking either project, is to wrap
those functions before the job creates its groups. ``install()`` may run
before ``init_process_group`` (the ms-swift plugin is imported first), so
nothing here needs a process group until a group is created or a call is made.

Decisions every rank makes identically (or the job deadlocks):
- a group is bridged iff its ranks span more than one node (pure function of
  the rank list and ranks-per-node); it is then created with backend gloo;
- WORLD is bridged iff the world spans nodes; when the default backend is not
  plain gloo, a shadow gloo group over all ranks is created right after
  ``init_process_group`` (all ranks pass there, in the same order) and calls
  on WORLD / ``group=None`` run on it.
Calls on groups that are not bridged go to torch untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from gloo_bridge import device as dev
from gloo_bridge.ops import BridgedOps
from gloo_bridge.staging import DEFAULT_CACHE_BYTES, BridgedWork, HostBufferCache
from gloo_bridge.topology import NodeLayout, resolve_node_layout

logger = logging.getLogger(__name__)

__all__ = ["BridgeConfig", "install", "is_bridged", "is_installed", "uninstall"]

# Names wrapped on torch.distributed and distributed_c10d (when this torch has them).
_COLLECTIVES: dict[str, str] = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
}
_SPECIAL = ("new_group", "init_process_group", "destroy_process_group", "batch_isend_irecv", "_coalescing_manager")
# Only these packages' module-level references (``from torch.distributed import
# X`` or ``f = torch.distributed.X`` at import time) are rewritten.
_REFERENCE_PACKAGES = ("megatron",)


@dataclass(frozen=True)
class BridgeConfig:
    """What ``install()`` was asked for.

    Attributes:
        layout: ranks-per-node and where it came from.
        stage_cpu_tensors: copy CPU tensors through host staging too (tests only).
        pin_host_buffers: page-locked staging buffers; default on iff an
            accelerator exists.
        max_cached_bytes: bytes of free staging buffers kept for reuse.
    """

    layout: NodeLayout
    stage_cpu_tensors: bool
    pin_host_buffers: bool
    max_cached_bytes: int


class _Bridge:
    """The installed bridge: originals, bridged groups, the WORLD shadow."""

    def __init__(self, config: BridgeConfig, originals: dict[str, Callable[..., Any]]) -> None:
        self.config = config
        self.orig = originals
        self.ops = BridgedOps(originals, HostBufferCache(config.pin_host_buffers, config.max_cached_bytes),
                              config.stage_cpu_tensors)
        self.groups: dict[int, dist.ProcessGroup] = {}
        self.world_shadow: dist.ProcessGroup | None = None
        self.patched: list[tuple[Any, str, Any]] = []
        self.wrappers: dict[str, Callable[..., Any]] = {}
        self.guard_gloo = dev.accelerator_type() is not None
        """Route every gloo group through staging, not only bridged ones (see ``_gloo_guard``)."""

    # -- decisions ------------------------------------------------------------
    def world_spans(self) -> bool:
        world = dist.get_world_size()
        self.config.layout.check_world(world)
        return self.config.layout.spans_nodes(range(world))

    def ensure_world_shadow(self) -> None:
        """Create the WORLD shadow group; every rank must call this at the same point."""
        if self.world_shadow is not None or not dist.is_initialized() or not self.world_spans():
            return
        if dist.get_backend() == "gloo":
            self.world_shadow = c10d._get_default_group()
            reason = "default backend is already gloo"
        else:
            self.world_shadow = self.orig["new_group"](backend="gloo")
            reason = f"shadow gloo group for default backend {dist.get_backend()}"
        logger.info("gloo_bridge: bridged WORLD ranks=0..%d (ranks_per_node=%d from %s): %s",
                    dist.get_world_size() - 1, self.config.layout.ranks_per_node, self.config.layout.source, reason)

    def route(self, group: Any) -> dist.ProcessGroup | None:
        """The gloo group to run a call on through the staging path, or None for torch's own call."""
        bridged = self.bridged_target(group)
        return bridged if bridged is not None else self._gloo_guard(group)

    def bridged_target(self, group: Any) -> dist.ProcessGroup | None:
        """The gloo group a bridged (node-spanning) group runs on, or None when it is not bridged."""
        if group is None or group is c10d.GroupMember.WORLD:
            if not dist.is_initialized():
                return None
            if self.world_shadow is None:
                if not self.world_spans():
                    return None
                raise RuntimeError(
                    "gloo_bridge: WORLD spans nodes but has no gloo shadow group: install() must run on "
                    "every rank before init_process_group or before any group is created"
                )
            return self.world_shadow
        return self.groups.get(id(group))

    def _gloo_guard(self, group: Any) -> dist.ProcessGroup | None:
        """A gloo group that does not span nodes, in a process that has an accelerator.

        Such a group is not bridged (``is_bridged`` is False), but gloo handed a device
        tensor crashes the process (``writev ... Bad address``, or a segfault in the
        coalescing manager): a job whose default backend is gloo on GPUs, or a
        single-rank group of one, must go through the staging path all the same.
        On a CPU-only machine nothing changes.
        """
        if not self.guard_gloo or not dist.is_initialized():
            return None
        target = c10d._get_default_group() if group is None or group is c10d.GroupMember.WORLD else group
        if target is c10d.GroupMember.NON_GROUP_MEMBER:
            return None
        try:
            return target if dist.get_backend(target) == "gloo" else None
        except (RuntimeError, ValueError):
            return None

    # -- group creation ---------------------------------------------------------
    def new_group(self, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(self.orig["new_group"]).bind(*args, **kwargs)
        a = bound.arguments
        if not a.get("use_local_synchronization", False):
            # All ranks pass here in the same order, so this is a safe point for
            # the collective creation of the WORLD shadow (if init bypassed us).
            self.ensure_world_shadow()
        world = dist.get_world_size()
        self.config.layout.check_world(world)
        ranks = sorted(a["ranks"]) if a.get("ranks") else list(range(world))
        if not self.config.layout.spans_nodes(ranks):
            return self.orig["new_group"](*args, **kwargs)
        asked = a.get("backend") or dist.get_backend()
        if str(asked).lower() != "gloo":
            a["backend"] = "gloo"
            a.pop("pg_options", None)  # NCCL/HCCL options mean nothing to gloo
            a.pop("device_id", None)
        group = self.orig["new_group"](*bound.args, **bound.kwargs)
        if group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            self.groups[id(group)] = group
            logger.info("gloo_bridge: bridged group %s ranks=%s spans nodes %s (ranks_per_node=%d from %s): "
                        "created with gloo instead of %s", a.get("group_desc") or "", ranks,
                        self.config.layout.nodes_of(ranks), self.config.layout.ranks_per_node,
                        self.config.layout.source, asked)
        return group

    def init_process_group(self, *args: Any, **kwargs: Any) -> Any:
        result = self.orig["init_process_group"](*args, **kwargs)
        self.ensure_world_shadow()
        return result

    def destroy_process_group(self, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(self.orig["destroy_process_group"]).bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if group is None or group is c10d.GroupMember.WORLD:
            self.groups.clear()  # every group dies with the default group
            self.world_shadow = None
        else:
            self.groups.pop(id(group), None)
        return self.orig["destroy_process_group"](*args, **kwargs)

    # -- calls ---------------------------------------------------------------------
    def make_wrapper(self, name: str, impl_name: str) -> Callable[..., Any]:
        orig = self.orig[name]
        sig = inspect.signature(orig)
        impl = getattr(self.ops, impl_name)
        extra = {} if name == impl_name else {"name": name}

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            target = self.route(bound.arguments.get("group"))
            if target is None:
                return orig(*args, **kwargs)
            bound.apply_defaults()
            return impl(dict(bound.arguments), target, **extra)

        wrapper.__name__ = name
        wrapper.__qualname__ = name
        wrapper.__doc__ = f"gloo_bridge wrapper of torch.distributed.{name} (see gloo_bridge.ops)."
        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        return wrapper

    def batch_isend_irecv(self, p2p_op_list: list[Any]) -> list[Any]:
        routed = [self.route(p.group) is not None for p in p2p_op_list]
        if not any(routed):
            return self.orig["batch_isend_irecv"](p2p_op_list)
        if not all(routed):
            raise RuntimeError("gloo_bridge: batch_isend_irecv mixes bridged and unbridged groups; "
                               "split the batch by group")
        works = []
        for p in p2p_op_list:
            is_send = p.op in (self.wrappers.get("isend"), self.orig["isend"])
            name = "isend" if is_send else "irecv"
            peer_kw = "dst" if is_send else "src"
            group_peer_kw = "group_dst" if is_send else "group_src"
            kwargs: dict[str, Any] = {"group": p.group, "tag": p.tag, peer_kw: p.peer}
            group_peer = getattr(p, "group_peer", None)
            if group_peer is not None:
                kwargs[group_peer_kw] = group_peer
                kwargs[peer_kw] = None
            works.append(self.wrappers[name](p.tensor, **kwargs))
        return works

    def coalescing_manager(self, group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
        if self.route(group) is None:
            return self.orig["_coalescing_manager"](group, device, async_ops)
        return _bridged_coalescing(self.ops, async_ops)


class _BridgedCoalescing:
    """Stands in for torch's ``_CoalescingManager`` on a bridged group."""

    def __init__(self, works: list[BridgedWork]) -> None:
        self.works = works

    def wait(self) -> None:
        """Wait (and copy back) every async call issued inside the block."""
        for work in self.works:
            work.wait()


@contextlib.contextmanager
def _bridged_coalescing(ops: BridgedOps, async_ops: bool) -> Iterator[_BridgedCoalescing]:
    manager = _BridgedCoalescing(ops.push_collector())
    try:
        yield manager
    finally:
        ops.pop_collector()
    if not async_ops:
        manager.wait()


_LOCK = threading.Lock()
_BRIDGE: _Bridge | None = None


def _set(bridge: _Bridge, module: Any, attr: str, value: Any) -> None:
    bridge.patched.append((module, attr, getattr(module, attr)))
    setattr(module, attr, value)


def _rewrite_references(bridge: _Bridge, mapping: dict[int, tuple[Any, Any]]) -> None:
    """Point already-imported package-level references at the wrappers."""
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.split(".")[0] not in _REFERENCE_PACKAGES:
            continue
        for attr, value in list(vars(module).items()):
            hit = mapping.get(id(value))
            if hit is not None and hit[0] is value:
                _set(bridge, module, attr, hit[1])


def install(ranks_per_node: int | None = None, *, stage_cpu_tensors: bool = False,
            pin_host_buffers: bool | None = None, max_cached_bytes: int = DEFAULT_CACHE_BYTES) -> None:
    """Route process groups that span nodes onto gloo (idempotent).

    Call on every rank before the job creates its process groups (before or
    after ``init_process_group``; before is best).

    Args:
        ranks_per_node: ranks per node; else ``YETO_RANKS_PER_NODE``, else
            ``LOCAL_WORLD_SIZE``. Missing or bad values raise ValueError naming
            the variable.
        stage_cpu_tensors: test-only: send CPU tensors through host staging.
        pin_host_buffers: page-locked staging buffers (default: iff an
            accelerator exists).
        max_cached_bytes: free staging bytes kept for reuse (default 1 GiB).

    Raises:
        ValueError: bad ranks-per-node.
        RuntimeError: already installed with a different configuration.
    """
    global _BRIDGE
    layout = resolve_node_layout(ranks_per_node)
    pinned = dev.pinning_available() if pin_host_buffers is None else bool(pin_host_buffers)
    config = BridgeConfig(layout, bool(stage_cpu_tensors), pinned, int(max_cached_bytes))
    with _LOCK:
        if _BRIDGE is not None:
            # Same values from another source (argument vs environment) is the same install.
            if dataclasses.replace(config, layout=_BRIDGE.config.layout) == _BRIDGE.config and \
                    _BRIDGE.config.layout.ranks_per_node == layout.ranks_per_node:
                return
            raise RuntimeError(f"gloo_bridge: already installed with {_BRIDGE.config}; call uninstall() first")
        if dist.is_initialized():
            layout.check_world(dist.get_world_size())
        originals: dict[str, Callable[..., Any]] = {}
        for name in (*_COLLECTIVES, *_SPECIAL):
            fn = getattr(dist, name, None) or getattr(c10d, name, None)
            if fn is not None:
                originals[name] = fn
        bridge = _Bridge(config, originals)
        wrappers: dict[str, Callable[..., Any]] = {
            name: bridge.make_wrapper(name, impl) for name, impl in _COLLECTIVES.items() if name in originals}
        wrappers.update({
            "new_group": bridge.new_group,
            "init_process_group": bridge.init_process_group,
            "destroy_process_group": bridge.destroy_process_group,
            "batch_isend_irecv": bridge.batch_isend_irecv,
            "_coalescing_manager": bridge.coalescing_manager,
        })
        wrappers = {k: v for k, v in wrappers.items() if k in originals}
        bridge.wrappers = wrappers
        for name, wrapper in wrappers.items():
            for module in (dist, c10d):
                if getattr(module, name, None) is originals[name]:
                    _set(bridge, module, name, wrapper)
        _rewrite_references(bridge, {id(originals[n]): (originals[n], w) for n, w in wrappers.items()})
        _BRIDGE = bridge
        logger.info("gloo_bridge: installed (ranks_per_node=%d from %s, pinned=%s, stage_cpu_tensors=%s)",
                    layout.ranks_per_node, layout.source, pinned, stage_cpu_tensors)
        if dist.is_initialized():
            # Installed after init: all ranks are here in the same order.
            bridge.ensure_world_shadow()


def uninstall() -> None:
    """Restore every patched name and forget the bridged groups (for tests)."""
    global _BRIDGE
    with _LOCK:
        bridge = _BRIDGE
        if bridge is None:
            return
        # Restore in reverse so a name patched twice ends at its first value.
        for module, attr, value in reversed(bridge.patched):
            setattr(module, attr, value)
        # Modules imported after install() captured the wrappers themselves.
        back = {id(w): (w, bridge.orig[n]) for n, w in bridge.wrappers.items()}
        for mod_name, module in list(sys.modules.items()):
            if module is None or mod_name.split(".")[0] not in _REFERENCE_PACKAGES:
                continue
            for attr, value in list(vars(module).items()):
                hit = back.get(id(value))
                if hit is not None and hit[0] is value:
                    setattr(module, attr, hit[1])
        bridge.ops.cache.clear()
        _BRIDGE = None
        logger.info("gloo_bridge: uninstalled")


def is_installed() -> bool:
    """True between ``install()`` and ``uninstall()``."""
    return _BRIDGE is not None


def is_bridged(group: Any = None) -> bool:
    """True when calls on ``group`` (None = WORLD) run on gloo through the bridge."""
    bridge = _BRIDGE
    if bridge is None:
        return False
    try:
        return bridge.bridged_target(group) is not None
    except RuntimeError:
        return True  # spans nodes, shadow missing: bridged, though unusable


def bridge_stats() -> dict[str, int]:
    """Staging cache counters (allocations, cached bytes, pinned 0/1) for tests and benchmarks."""
    bridge = _BRIDGE
    if bridge is None:
        return {"allocations": 0, "cached_bytes": 0, "bridged_groups": 0, "pinned": 0}
    cache = bridge.ops.cache
    return {"allocations": cache.allocations, "cached_bytes": cache.cached_bytes,
            "bridged_groups": len(bridge.groups), "pinned": int(cache.pinned)}

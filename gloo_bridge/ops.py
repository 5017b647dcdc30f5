"""The bridged versions of torch.distributed's collectives and point-to-point calls.

Why: on a bridged (gloo) group, device tensors must travel through host
memory and the operations gloo lacks must be emulated, while callers keep
calling plain ``torch.distributed`` functions. Each function here receives the
caller's arguments already bound to torch's own signature (``args``: name ->
value, defaults applied) and the gloo group to run on, and calls torch's
original function with host tensors. ``patching.py`` decides *whether* a call
is bridged; this module only knows *how*.

Emulations (chosen to work on every torch >= 2.4 gloo, whatever its version):
- ``ReduceOp.AVG`` -> SUM then divide by the group size (not every supported
  gloo accepts AVG); integer AVG is refused.
- ``reduce_scatter_tensor`` / ``_reduce_scatter_base`` -> all_reduce of a
  scratch copy, then each rank keeps its slice (group-size times the traffic
  of a real reduce-scatter; correct, and simple to reason about).
- ``all_gather_into_tensor`` / ``_all_gather_base`` -> all_gather into equal
  views of one flat host buffer.
- ``ReduceOp.PREMUL_SUM`` (NCCL only) is refused with an error naming the op.
bf16 and fp16 sums run natively: gloo reduces them.

Every rank runs the same gloo calls in the same order whether its tensors are
on the device or not, so mixed device/CPU callers cannot desynchronize a group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gloo_bridge import device as dev
from gloo_bridge.staging import BridgedWork, HostBufferCache, StagedCall

logger = logging.getLogger(__name__)

__all__ = ["BridgedOps", "UnsupportedBridgedOp"]

Args = dict[str, Any]


class UnsupportedBridgedOp(RuntimeError):
    """An operation or reduce op that the gloo bridge cannot run."""


def _is_avg(op: Any) -> bool:
    return bool(op == dist.ReduceOp.AVG)


def _check_reduce_op(name: str, op: Any) -> None:
    if op == dist.ReduceOp.PREMUL_SUM:
        raise UnsupportedBridgedOp(
            f"gloo_bridge: {name} with ReduceOp.PREMUL_SUM is not supported on a bridged (gloo) group"
        )


def _divider(name: str, tensor: torch.Tensor, size: int) -> Callable[[], None]:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise UnsupportedBridgedOp(
            f"gloo_bridge: {name} with ReduceOp.AVG on {tensor.dtype} is not supported on a bridged group"
        )
    def divide() -> None:
        tensor.div_(size)

    return divide


class BridgedOps:
    """Runs bridged calls on gloo groups through host staging.

    Args:
        originals: torch's own functions by name, captured before patching
            (the bridge must never call its own wrappers).
        cache: host buffer pool shared by all calls of this process.
        stage_cpu_tensors: copy CPU tensors through the staging path too; a
            test-only switch that exercises copy-in/copy-out on CPU machines.
    """

    def __init__(self, originals: dict[str, Callable[..., Any]], cache: HostBufferCache, stage_cpu_tensors: bool) -> None:
        self._orig = originals
        self.cache = cache
        self.stage_cpu_tensors = stage_cpu_tensors
        self._local = threading.local()

    # -- coalescing: Megatron's DDP issues its bucket collectives inside
    # torch.distributed._coalescing_manager and waits on the manager. On a
    # bridged group the ops run one by one; the manager collects their handles.
    def push_collector(self) -> list[BridgedWork]:
        """Start collecting async handles of this thread's bridged calls."""
        stack: list[list[BridgedWork]] = getattr(self._local, "stack", [])
        self._local.stack = stack
        works: list[BridgedWork] = []
        stack.append(works)
        return works

    def pop_collector(self) -> None:
        """Stop the innermost collection started by ``push_collector``."""
        self._local.stack.pop()

    def _staged(self, *tensors: torch.Tensor | None) -> StagedCall:
        stage = self.stage_cpu_tensors or any(t is not None and dev.is_accelerator(t) for t in tensors)
        return StagedCall(self.cache, stage)

    def _complete(self, name: str, sc: StagedCall, call: Callable[[], Any], async_op: bool,
                  outputs: list[torch.Tensor]) -> Any:
        sc.ready()
        result = call()
        if async_op:
            work = BridgedWork(name, result, sc, outputs)
            stack = getattr(self._local, "stack", None)
            if stack:
                stack[-1].append(work)
            return work
        sc.finish()
        return result

    @staticmethod
    def _kw(args: Args, group: dist.ProcessGroup, **replace: Any) -> Args:
        out = dict(args)
        out["group"] = group
        out.update(replace)
        return out

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.all_reduce``; ``args`` are the caller's bound arguments."""
        tensor, op = args["tensor"], args["op"]
        _check_reduce_op("all_reduce", op)
        sc = self._staged(tensor)
        host = sc.host_inout(tensor)
        if _is_avg(op):
            sc.then(_divider("all_reduce", host, group.size()))
            op = dist.ReduceOp.SUM
        kw = self._kw(args, group, tensor=host, op=op)
        return self._complete("all_reduce", sc, lambda: self._orig["all_reduce"](**kw), kw["async_op"], [tensor])

    def broadcast(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.broadcast``; ``args`` are the caller's bound arguments."""
        tensor = args["tensor"]
        group_src = args.get("group_src")
        is_src = group.rank() == group_src if group_src is not None else dist.get_rank() == args["src"]
        sc = self._staged(tensor)
        # The source only reads its tensor; the others only receive into it.
        host = sc.host_in(tensor) if is_src else sc.host_out(tensor)
        kw = self._kw(args, group, tensor=host)
        return self._complete("broadcast", sc, lambda: self._orig["broadcast"](**kw), kw["async_op"], [tensor])

    def reduce(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.reduce``; ``args`` are the caller's bound arguments."""
        tensor, op = args["tensor"], args["op"]
        _check_reduce_op("reduce", op)
        group_dst = args.get("group_dst")
        is_dst = group.rank() == group_dst if group_dst is not None else dist.get_rank() == args["dst"]
        sc = self._staged(tensor)
        host = sc.host_inout(tensor)
        if _is_avg(op):
            if is_dst:
                sc.then(_divider("reduce", host, group.size()))
            op = dist.ReduceOp.SUM
        kw = self._kw(args, group, tensor=host, op=op)
        return self._complete("reduce", sc, lambda: self._orig["reduce"](**kw), kw["async_op"], [tensor])

    def all_gather(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.all_gather``; ``args`` are the caller's bound arguments."""
        tensor, outs = args["tensor"], list(args["tensor_list"])
        sc = self._staged(tensor, *outs)
        host_in = sc.host_in(tensor)
        host_outs = [sc.host_out(t) for t in outs]
        kw = self._kw(args, group, tensor=host_in, tensor_list=host_outs)
        return self._complete("all_gather", sc, lambda: self._orig["all_gather"](**kw), kw["async_op"], outs)

    def all_gather_into_tensor(self, args: Args, group: dist.ProcessGroup, name: str = "all_gather_into_tensor") -> Any:
        """Bridged ``dist.all_gather_into_tensor``; ``args`` are the caller's bound arguments."""
        output, inp = args["output_tensor"], args["input_tensor"]
        size = group.size()
        if output.numel() != size * inp.numel() or output.dtype != inp.dtype:
            raise ValueError(
                f"gloo_bridge: {name}: output ({output.dtype}, {output.numel()} elements) must be "
                f"{size} x input ({inp.dtype}, {inp.numel()} elements)"
            )
        sc = self._staged(output, inp)
        host_in = sc.host_in(inp)
        host_out = sc.host_out(output)
        if not host_out.is_contiguous():  # only a CPU output can be non-contiguous here
            raise ValueError(f"gloo_bridge: {name}: output tensor must be contiguous")
        views = [c.view(inp.shape) for c in host_out.view(-1).chunk(size)] if inp.numel() else [
            host_out.view(-1)[:0].view(inp.shape) for _ in range(size)]
        async_op = bool(args["async_op"])
        kw = {"tensor_list": views, "tensor": host_in, "group": group, "async_op": async_op}
        return self._complete(name, sc, lambda: self._orig["all_gather"](**kw), async_op, [output])

    def reduce_scatter_tensor(self, args: Args, group: dist.ProcessGroup, name: str = "reduce_scatter_tensor") -> Any:
        """Bridged ``dist.reduce_scatter_tensor``; ``args`` are the caller's bound arguments."""
        output, inp, op = args["output"], args["input"], args["op"]
        _check_reduce_op(name, op)
        size, rank = group.size(), group.rank()
        if inp.numel() != size * output.numel() or output.dtype != inp.dtype:
            raise ValueError(
                f"gloo_bridge: {name}: input ({inp.dtype}, {inp.numel()} elements) must be "
                f"{size} x output ({output.dtype}, {output.numel()} elements)"
            )
        sc = self._staged(output, inp)
        scratch = sc.host_in(inp, scratch=True)  # all_reduce works in place: never clobber the input
        host_out = sc.host_out(output)
        n = output.numel()

        def keep_slice() -> None:
            host_out.copy_(scratch.reshape(-1)[rank * n:(rank + 1) * n].view(output.shape))

        sc.then(keep_slice)
        if _is_avg(op):
            sc.then(_divider(name, host_out, size))
            op = dist.ReduceOp.SUM
        async_op = bool(args["async_op"])
        kw = {"tensor": scratch, "op": op, "group": group, "async_op": async_op}
        return self._complete(name, sc, lambda: self._orig["all_reduce"](**kw), async_op, [output])

    def all_to_all_single(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.all_to_all_single``; ``args`` are the caller's bound arguments."""
        output, inp = args["output"], args["input"]
        sc = self._staged(output, inp)
        host_in = sc.host_in(inp)
        host_out = sc.host_out(output)
        kw = self._kw(args, group, output=host_out, input=host_in)
        return self._complete("all_to_all_single", sc, lambda: self._orig["all_to_all_single"](**kw),
                              kw["async_op"], [output])

    def gather(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.gather``; ``args`` are the caller's bound arguments."""
        tensor, glist = args["tensor"], args.get("gather_list")
        outs = list(glist) if glist else []
        sc = self._staged(tensor, *outs)
        host_in = sc.host_in(tensor)
        host_outs = [sc.host_out(t) for t in outs] if glist else glist
        kw = self._kw(args, group, tensor=host_in, gather_list=host_outs)
        return self._complete("gather", sc, lambda: self._orig["gather"](**kw), kw["async_op"], outs)

    def scatter(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.scatter``; ``args`` are the caller's bound arguments."""
        tensor, slist = args["tensor"], args.get("scatter_list")
        ins = list(slist) if slist else []
        sc = self._staged(tensor, *ins)
        host_out = sc.host_out(tensor)
        host_ins = [sc.host_in(t) for t in ins] if slist else slist
        kw = self._kw(args, group, tensor=host_out, scatter_list=host_ins)
        return self._complete("scatter", sc, lambda: self._orig["scatter"](**kw), kw["async_op"], [tensor])

    def barrier(self, args: Args, group: dist.ProcessGroup) -> Any:
        """Bridged ``dist.barrier``; ``args`` are the caller's bound arguments."""
        kw = self._kw(args, group)
        kw.pop("device_ids", None)  # device ids are an NCCL notion; gloo has none
        return self._orig["barrier"](**kw)

    # -- point to point ----------------------------------------------------------
    def send(self, args: Args, group: dist.ProcessGroup, name: str = "send") -> Any:
        """Bridged ``dist.send``; ``args`` are the caller's bound arguments."""
        tensor = args["tensor"]
        sc = self._staged(tensor)
        kw = self._kw(args, group, tensor=sc.host_in(tensor))
        return self._complete(name, sc, lambda: self._orig[name](**kw), name == "isend", [tensor])

    def recv(self, args: Args, group: dist.ProcessGroup, name: str = "recv") -> Any:
        """Bridged ``dist.recv``; ``args`` are the caller's bound arguments."""
        tensor = args["tensor"]
        sc = self._staged(tensor)
        kw = self._kw(args, group, tensor=sc.host_out(tensor))
        return self._complete(name, sc, lambda: self._orig[name](**kw), name == "irecv", [tensor])

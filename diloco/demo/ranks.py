"""Fork the ranks of one island on this machine, each under a gloo default process group.

:func:`run_ranks` is how the demo (and the tests, examples and benchmarks) launch a multi-rank
island without torchrun: it starts workers from a *forkserver* that imported torch and megatron
once (a world-4 launch then costs well under a second instead of seconds of imports per worker),
gives each a gloo default group over a TCPStore the parent owns, collects one JSON-able result per
rank, and turns any hang or crash into an exception naming the rank; no worker outlives the call.

Why a forkserver and not ``fork``: the caller (pytest, a benchmark, the demo) holds threads, and a
child forked while another thread holds a lock (the heap's, logging's, torch's) can block on it
forever, before it ever reaches the gloo rendezvous. The forkserver is single-threaded, so its
children start clean. Each worker gets the caller's environment as it is at the call, and the
caller's root logging level and format; a module that reads the environment *at import* sees the
forkserver's (the one started first), since the worker's modules are imported before ``fn`` runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Collection
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.distributed"]
"""Modules the forkserver imports once, so that workers start without importing them (one missing
is skipped by multiprocessing)."""


def _worker(
    rank: int,
    world: int,
    port: int,
    timeout_s: float,
    conn: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    log_setup: tuple[int, str | None],
) -> None:
    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        level, fmt = log_setup
        if fmt is not None:
            logging.basicConfig(level=level, format=fmt, force=True)
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        result = fn(rank, world, *args)
        conn.send_bytes(json.dumps({"ok": True, "result": result}).encode())
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        code = 1
        with contextlib.suppress(Exception):
            conn.send_bytes(json.dumps({"ok": False, "error": traceback.format_exc()}).encode())
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        # os._exit: skip atexit / destructors (a half-built process group must not block the exit).
        os._exit(code)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
              may_die: Collection[int] = ()) -> list[Any]:
    """Start `world` workers that each run `fn(rank, world, *args)` under a gloo default group.

    `fn` and `args` must pickle (`fn` a module-level function, or a partial of one) and `fn` must
    return something JSON-able. The
    parent must not have created a process group. The parent owns the
    TCPStore server (port 0, so no port races). Returns every rank's result
    in rank order. Raises RuntimeError naming the first rank that failed (with
    its traceback) or TimeoutError naming the ranks still running after
    `timeout_s`; in both cases every worker is killed first, so a rank blocked
    in a collective never outlives the call.
    """
    if dist.is_initialized():
        raise RuntimeError("run_ranks: the parent must not hold a process group")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts (the first call)
    env = dict(os.environ)
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)  # noqa: SLF001
    log_setup = (root.level, fmt)
    procs: list[Any] = []
    conns: list[Any] = []
    for rank in range(world):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(rank, world, store.port, timeout_s, child_conn, fn, args, env, log_setup),
            name=f"rank{rank}",
            daemon=True,
        )
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    results: list[Any] = [None] * world
    pending = set(range(world))
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_ranks: ranks {sorted(pending)} still running after {timeout_s:.0f}s")
            mp.connection.wait([conns[r] for r in pending], timeout=0.2)
            for r in sorted(pending):
                msg = None
                eof = False
                if conns[r].poll():
                    try:
                        msg = json.loads(conns[r].recv_bytes())
                    except EOFError:
                        msg, eof = None, True  # the worker's end closed: it exited without a result
                if eof:
                    procs[r].join(timeout=5)
                if msg is None and not procs[r].is_alive() and (eof or not conns[r].poll()):
                    if r in may_die:
                        pending.discard(r)
                        continue
                    raise RuntimeError(f"run_ranks: rank {r} died (exit code {procs[r].exitcode}) without a result")
                if msg is None:
                    continue
                if not msg["ok"]:
                    raise RuntimeError(f"run_ranks: rank {r} failed:\n{msg['error']}")
                results[r] = msg["result"]
                pending.discard(r)
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                # Ranks blocked in a collective wait for a peer that failed; kill them.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        del store
    return results

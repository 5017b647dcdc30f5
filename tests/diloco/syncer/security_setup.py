"""A live syncer in one security mode with two scripted islands, ready for hostile traffic.

Shared by the fuzz, replay and slow-loris tests and by ``benchmarks/fuzz_syncer.py``:
``curve`` (island key pairs made with ``yeto-keys``, a certificates directory, no HMAC key)
or ``hmac`` (a shared key; Curve keys derived from it).  ``start`` brings both islands to
round 1 (fragment 0) open with nobody pushed, and returns an authenticated third
connection (``evil``: a listed key in Curve mode, the shared key in HMAC mode) that the
tests use to send what islands never would.
"""

from __future__ import annotations

import re
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from diloco.keys_cli import main as yeto_keys
from diloco.security import ClientCurve, load_public, load_secret
from diloco.wire import PROTOCOL_VERSION, Bcast, Heartbeat, Hello, Init, Pull, Push, Welcome
from syncer_harness import Island, SyncerProc

KEY = b"security-test-key-0123456789"
SHAPES = [("w", (64, 80)), ("b", (80,))]  # 5200 elements: two parts of 4096
P = 2


@dataclass
class Setup:
    mode: str
    syncer: SyncerProc
    ctx: zmq.Context[Any]
    key: bytes
    a: Island
    b: Island
    evil: Island
    value: list[list[np.ndarray]]
    mom: list[list[np.ndarray]]
    curves: dict[str, ClientCurve] = field(default_factory=dict)
    fragments: int = P

    def island(self, island: int, name: str | None = None, *, key: bytes | None = None) -> Island:
        curve = self.curves.get(name or f"island-{island}")
        return Island(self.ctx, self.syncer.endpoint, island, key=self.key if key is None else key,
                      schema=[SHAPES] * self.fragments, curve=curve)

    def close(self) -> None:
        for isl in (self.a, self.b, self.evil):
            isl.close()
        self.ctx.term()
        self.syncer.stop()


def tensors(arrays: list[np.ndarray]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.from_numpy(a)) for (n, _s), a in zip(SHAPES, arrays)]


def hello(isl: Island, **kw: Any) -> Hello:
    f: dict[str, Any] = dict(protocol=PROTOCOL_VERSION, island=isl.island, generation=isl.generation,
                             fingerprint="fp", n_fragments=P, wire_dtype="float32")
    f.update(kw)
    return Hello(**f)


def push_header(isl: Island, **kw: Any) -> Push:
    f: dict[str, Any] = dict(island=isl.island, generation=isl.generation, fragment=0, round=1, attempt=0,
                             base_version=0, local_steps=2, tokens=100)
    f.update(kw)
    return Push(**f)


def rss(syncer: SyncerProc) -> int:
    text = Path(f"/proc/{syncer.proc.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def last_status(syncer: SyncerProc, after: float = 0.7) -> str:
    """The newest status line written at least ``after`` seconds from now (the period is 0.5 s)."""
    n = syncer.log().count("status:")
    deadline = time.monotonic() + 30
    while syncer.log().count("status:") < n + 2:
        assert time.monotonic() < deadline and syncer.proc.poll() is None, syncer.log()[-3000:]
        time.sleep(0.05)
    time.sleep(after)
    return [ln for ln in syncer.log().splitlines() if "status:" in ln][-1]


def _curve_files(tmp: Path) -> tuple[list[str], dict[str, ClientCurve]]:
    keys = tmp / "keys"
    assert yeto_keys(["generate", str(keys / "syncer"), "syncer"]) == 0
    names = ["island-0", "island-1", "evil", "late"]
    assert yeto_keys(["generate", str(keys / "islands"), *names]) == 0
    clients = keys / "clients"
    clients.mkdir()
    for name in names[:3]:  # "late" is not admitted (yet)
        shutil.copy(keys / "islands" / f"{name}.key", clients / f"{name}.key")
    server = load_public(str(keys / "syncer" / "syncer.key"))
    curves = {}
    for name in names:
        public, secret = load_secret(str(keys / "islands" / f"{name}.key_secret"))
        curves[name] = ClientCurve(server, public, secret)
    args = ["--curve-secret-file", str(keys / "syncer" / "syncer.key_secret"), "--curve-clients-dir", str(clients)]
    return args, curves


def start(tmp: Path, mode: str, *, seed: int = 3, extra: list[str] | None = None,
          soft_nofile: int | None = None, fragments: int = P, islands: int = 2) -> Setup:
    """A syncer in ``mode`` with islands a (0) and b (1) at round 1 open, and ``evil``; ``soft_nofile``
    starts the syncer under that soft open-file limit; ``islands``: the syncer's ``--islands``."""
    rng = np.random.default_rng(seed)
    if mode == "curve":
        args, curves = _curve_files(tmp)
        key = b""
    elif mode == "hmac":
        (tmp / "key").write_bytes(KEY)
        args, curves, key = ["--key-file", str(tmp / "key")], {}, KEY
    else:
        raise ValueError(mode)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_nofile is not None:  # the syncer inherits it (and must raise it itself)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft_nofile, limits[1]))
    try:
        syncer = SyncerProc(tmp, [
            "--islands", str(islands), "--sync-every", "2", "--total-steps", "2", "--grace-ms", "0", "--quorum-timeout-s",
            "600", "--dead-after-s", "600", "--part-mib", "0.015625", "--event-log", str(tmp / "events.jsonl"), *args,
            *(extra or []),
        ])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    ctx: zmq.Context[Any] = zmq.Context()
    s = Setup(mode, syncer, ctx, key, None, None, None, [], [], curves, fragments)  # type: ignore[arg-type]
    s.a, s.b, s.evil = s.island(0), s.island(1), s.island(1, "evil")
    for isl in (s.a, s.b):
        isl.send(hello(isl, n_fragments=fragments))
        assert isl.expect(Welcome).header.need_init == (isl is s.a)
    s.value = [[rng.standard_normal(sh).astype(np.float32) for _n, sh in SHAPES] for _ in range(fragments)]
    s.mom = [[np.zeros_like(x) for x in fr] for fr in s.value]
    for f in range(fragments):
        s.a.send(Init(island=0, generation=s.a.generation, fragment=f, n_fragments=fragments), tensors(s.value[f]))
    for isl in (s.a, s.b):
        assert [isl.expect(Bcast).header.cut for _ in range(fragments)] == [True] * fragments
        isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=0))  # a HELLO is not membership
    time.sleep(0.2)
    for isl in (s.a, s.b):
        isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=1))
    for isl in (s.a, s.b):
        assert isl.expect(Pull).header == Pull(fragment=0, round=1, attempt=0)
    return s

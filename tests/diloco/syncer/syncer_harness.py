"""Test harness: a real ``python -m diloco.syncer`` process and scripted zmq DEALER islands."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import zmq

from diloco.wire import Heartbeat, Message, decode, encode

REPO = Path(__file__).resolve().parents[3]


class SyncerProc:
    """A syncer subprocess bound to a random localhost port; stderr goes to a log file."""

    def __init__(self, tmp: Path, args: Sequence[str]) -> None:
        self.log_path = tmp / "syncer.log"
        env = {k: v for k, v in os.environ.items() if k != "YETO_SYNC_KEY"}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["OMP_NUM_THREADS"] = "1"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco.syncer", "--bind", "tcp://127.0.0.1:*", "--status-every-s", "0.5", *args],
            stdout=subprocess.DEVNULL, stderr=self._log, env=env, cwd=str(tmp),
        )
        deadline = time.monotonic() + 60
        while True:
            m = re.search(r"bound (tcp://\S+)", self.log())
            if m:
                self.endpoint = m.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"syncer did not start (rc={self.proc.returncode}):\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


class Island:
    """One scripted island: a DEALER socket speaking diloco.wire, driven by the test."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, island: int, *, key: bytes = b"",
                 wire_dtype: str = "float32", generation: int | None = None) -> None:
        self.island = island
        self.key = key
        self.wire_dtype = wire_dtype
        self.generation = generation if generation is not None else random.getrandbits(62)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, header: Any, tensors: Sequence[tuple[str, torch.Tensor]] = (), *,
             wire_dtype: str | None = None, key: bytes | None = None) -> None:
        frames = encode(header, tensors, key=self.key if key is None else key, wire_dtype=wire_dtype)
        self.sock.send_multipart(frames, copy=False)

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 20.0) -> Message:
        """The next message other than a HEARTBEAT reply."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise TimeoutError(f"island {self.island}: nothing from the syncer in {timeout_s}s")
            msg = decode(self.sock.recv_multipart(copy=False), key=self.key)
            if not isinstance(msg.header, Heartbeat):
                return msg

    def expect(self, kind: type, timeout_s: float = 20.0) -> Message:
        msg = self.recv(timeout_s)
        assert isinstance(msg.header, kind), f"island {self.island}: expected {kind.__name__}, got {msg.header}"
        return msg

    def close(self) -> None:
        self.sock.close(0)


def reference_step(value: np.ndarray, mom: np.ndarray, deltas: list[np.ndarray], ws: list[int],
                   lr: float = 0.7, mu: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """The PROTOCOL.md commit formula, one numpy fp32 operation at a time."""
    s = np.zeros_like(value)
    for d, w in zip(deltas, ws):
        s = s + d.astype(np.float32) * np.float32(w)
    d = s / np.float32(sum(ws))
    g = -d
    m = np.float32(mu) * mom + g
    return value - np.float32(lr) * (g + np.float32(mu) * m), m

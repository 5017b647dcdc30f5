"""Test harness: scripted zmq DEALER islands against a real syncer (``SyncerProc``, from tests.support)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import zmq

import msgspec

from diloco.security import ClientCurve, secure_client
from tests.support.syncer_proc import SyncerProc  # noqa: F401  (re-exported: the syncer tests import it from here)
from diloco.wire import (DEFAULT_PART_ELEMS, Bcast, Final, FragmentLayout, Heartbeat, Init, Message, Opened, Progress,
                         Push, Welcome, encode, open_message)


class Island:
    """One scripted island: a DEALER socket speaking diloco.wire (parts included), driven by the test.

    ``schema`` (per fragment, ``[(name, shape), ...]``) lets :meth:`send` cut INIT/PUSH into
    parts and :meth:`recv` reassemble BCAST/FINAL parts into whole tensors of plan shapes.
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, island: int, *, key: bytes = b"",
                 wire_dtype: str = "float32", generation: int | None = None,
                 schema: Sequence[Sequence[tuple[str, tuple[int, ...]]]] | None = None,
                 curve: ClientCurve | None = None) -> None:
        self.island = island
        self.key = key
        self.wire_dtype = wire_dtype
        self.generation = generation if generation is not None else random.getrandbits(62)
        self.layouts = [FragmentLayout.of(f) for f in schema] if schema is not None else None
        self.part_elems = DEFAULT_PART_ELEMS
        self.parts_sent = 0
        self._assembling: dict[tuple[str, int], list[Opened]] = {}
        self._stash: list[Message] = []
        self.nonce = 0
        """Session nonce from WELCOME; every later message carries it and the next ``seq``."""
        self.seq = 0
        self.sent: list[list[bytes]] = []
        """Every message sent, as bytes (for replay tests)."""
        self.received: list[list[bytes]] = []
        """Every message received, as bytes (for replay tests)."""
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is None and key:
            curve = ClientCurve.from_shared_key(key)  # HMAC mode: Curve keys derived from the key
        if curve is not None:
            secure_client(self.sock, curve)
        self.sock.connect(endpoint)

    def stamp(self) -> dict[str, int]:
        """nonce/seq for the next message (HELLO opens the session: nonce 0)."""
        self.seq += 1
        return {"nonce": self.nonce, "seq": self.seq if self.nonce else 0}

    def _send_frames(self, frames: list[Any]) -> None:
        self.sent.append([bytes(memoryview(f)) for f in frames])
        self.sock.send_multipart(frames, copy=False)

    def send(self, header: Any, tensors: Sequence[tuple[str, torch.Tensor]] = (), *,
             wire_dtype: str | None = None, key: bytes | None = None) -> None:
        """Send one message; INIT/PUSH with tensors go as parts (a zero-weight PUSH goes bare)."""
        k = self.key if key is None else key
        if isinstance(header, Push) and header.local_steps == 0:
            header, tensors = msgspec.structs.replace(header, n_parts=0), ()
        if isinstance(header, (Init, Push)) and tensors and self.layouts is not None:
            for frames in self.part_frames(header, tensors, key=k, wire_dtype=wire_dtype):
                self._send_frames(frames)
            return
        frames = encode(header, tensors, key=k, wire_dtype=wire_dtype, **self.stamp())
        self._send_frames(frames)

    def part_frames(self, header: Any, tensors: Sequence[tuple[str, torch.Tensor]], *, key: bytes,
                    wire_dtype: str | None = None) -> list[list[Any]]:
        """The frames of every part of an INIT/PUSH stream (for tests that interleave or mangle them)."""
        assert self.layouts is not None
        layout = self.layouts[header.fragment]
        n = layout.n_parts(self.part_elems)
        out = []
        for p in range(n):
            extra: dict[str, Any] = {"part": p, "n_parts": n}
            if isinstance(header, Init):
                extra["schema"] = tuple(zip(layout.names, layout.shapes)) if p == 0 else ()
            h = msgspec.structs.replace(header, **extra)
            seg = layout.slice_part(list(tensors), p, self.part_elems)
            out.append(encode(h, seg, key=key, wire_dtype=wire_dtype, **self.stamp()))
            self.parts_sent += 1
        return out

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 20.0) -> Message:
        """The next whole message other than a HEARTBEAT reply (BCAST/FINAL parts reassembled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise TimeoutError(f"island {self.island}: nothing from the syncer in {timeout_s}s")
            frames = self.sock.recv_multipart(copy=False)
            self.received.append([f.bytes for f in frames])
            opened = open_message(frames, key=self.key)
            h = opened.header
            if isinstance(h, (Heartbeat, Progress)):  # replies and periodic notices, not protocol steps
                continue
            if isinstance(h, Welcome):
                self.part_elems = h.part_elems
                self.nonce = h.nonce
            if isinstance(h, (Bcast, Final)) and self.layouts is not None:
                got = self._assemble(h, opened)
                if got is None:
                    continue
                return got
            return Message(h, opened.tensors())

    def _assemble(self, h: Any, opened: Opened) -> Message | None:
        assert self.layouts is not None
        key = (type(h).__name__, h.fragment)
        parts = self._assembling.setdefault(key, [])
        assert h.part == len(parts), f"part {h.part} out of order (have {len(parts)})"
        parts.append(opened)
        if len(parts) < h.n_parts:
            return None
        del self._assembling[key]
        layout = self.layouts[h.fragment]
        by_name: dict[str, list[torch.Tensor]] = {}
        for o in parts:
            for name, t in o.tensors():
                by_name.setdefault(name, []).append(t)
        tensors = [(n, torch.cat(by_name[n]).view(shape)) for n, shape in zip(layout.names, layout.shapes)]
        return Message(msgspec.structs.replace(h, part=0, n_parts=1), tensors)

    def expect(self, kind: type, timeout_s: float = 20.0, *, strict: bool = True) -> Message:
        """The next message of ``kind``.  ``strict``: it must be the very next message; else
        messages of other kinds met on the way are kept, in order, for later calls (control
        messages such as PULL are not ordered with data streams of other fragments)."""
        for i, msg in enumerate(self._stash):
            if isinstance(msg.header, kind):
                return self._stash.pop(i)
        while True:
            msg = self.recv(timeout_s)
            if isinstance(msg.header, kind):
                return msg
            assert not strict, f"island {self.island}: expected {kind.__name__}, got {msg.header}"
            self._stash.append(msg)

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


def reference_fragment(value: list[np.ndarray], mom: list[np.ndarray], deltas: dict[int, list[np.ndarray]],
                       weights: dict[int, int], fold_order: list[int] | list[list[int]], part_elems: int,
                       lr: float = 0.7, mu: float = 0.9) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The PROTOCOL.md commit of one whole fragment in numpy, folding each part in its recorded order.

    ``fold_order`` is the event log's: one island list for every part, or a list per part.
    Zero-weight islands are never folded (they carry no tensors)."""
    shapes = [a.shape for a in value]
    flat_v = np.concatenate([a.reshape(-1) for a in value]).astype(np.float32)
    flat_m = np.concatenate([a.reshape(-1) for a in mom]).astype(np.float32)
    flat_d = {i: np.concatenate([d.reshape(-1).astype(np.float32) for d in ds]) for i, ds in deltas.items()}
    n = flat_v.size
    s = np.zeros(n, dtype=np.float32)
    n_parts = -(-n // part_elems)
    for k in range(n_parts):
        lo, hi = k * part_elems, min(n, (k + 1) * part_elems)
        order = fold_order[k] if fold_order and isinstance(fold_order[0], list) else fold_order
        first = True
        for i in order:  # type: ignore[union-attr]
            prod = flat_d[i][lo:hi] * np.float32(weights[i])
            s[lo:hi] = prod if first else s[lo:hi] + prod
            first = False
    d = s / np.float32(sum(weights.values()))
    g = -d
    m = np.float32(mu) * flat_m + g
    v = flat_v - np.float32(lr) * (g + np.float32(mu) * m)
    out_v, out_m, pos = [], [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out_v.append(v[pos : pos + size].reshape(shape))
        out_m.append(m[pos : pos + size].reshape(shape))
        pos += size
    return out_v, out_m


def commit_event(events_path: Path, round_: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """The event-log line of one committed round (the loop flushes it once per iteration)."""
    import json

    deadline = time.monotonic() + timeout_s
    while True:
        if events_path.exists():
            for line in events_path.read_text().splitlines():
                ev = json.loads(line)
                if ev.get("round") == round_ and "fold_order" in ev:  # the commit, not a clamp or a drop
                    return ev
        if time.monotonic() > deadline:
            raise TimeoutError(f"no commit event for round {round_}")
        time.sleep(0.02)

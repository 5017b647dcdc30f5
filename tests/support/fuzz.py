"""Generated malformed messages for fuzzing a live syncer (tests and ``benchmarks/bench_security.py``).

Structure-aware: most messages start from *valid* captured messages (what real islands
sent) and break one thing, re-MACed with the right key where the point is to get past the
MAC (so the header and size checks behind it are exercised, not only the MAC).  Kinds:

``random``      1-4 frames of random bytes
``bitflip``     one flipped bit anywhere in a captured message (MAC, header or a chunk)
``truncate``    frames dropped, or a frame cut short (a truncated multipart message)
``extra``       extra frames appended
``wrong_mac``   a captured header MACed with another key
``mutate``      one envelope/header/tensor field set to a hostile value, re-MACed
``dims``        a tensor declared with zero / huge / absurd dimensions, re-MACed
``replay``      a captured message sent again as is

HELLO mutations always carry a foreign fingerprint, so no generated message can be a
valid HELLO: every message must be refused and the syncer's state must not change.
Incomplete multipart messages cannot be sent through a zmq socket (zmq sends a multipart
message only once it is complete); ``raw_zmtp_flood`` sends them over raw TCP.
"""

from __future__ import annotations

import hmac
import random
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgspec

KINDS = ("random", "bitflip", "truncate", "extra", "wrong_mac", "mutate", "dims", "replay")

_HOSTILE: list[Any] = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), "x", "", None, [], {},
                       1.5, float("nan"), True, b"\x00" * 3, [[1, 2]], "A" * 300]
_SHAPES: list[Any] = [[0, 2**63], [2**62], [0], [], [1] * 9, [-1], [2**40, 0], [2**31, 2**31], [2**64 - 1],
                      [0, 0, 0], "shape", [1.5], [None]]


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.digest(key, body, "sha256")


class Fuzzer:
    """Malformed messages derived from ``captured`` (lists of frames of valid messages)."""

    def __init__(self, rng: random.Random, key: bytes, captured: Sequence[Sequence[bytes]],
                 kinds: Sequence[str] = KINDS) -> None:
        if not captured:
            raise ValueError("need at least one captured message")
        self.rng = rng
        self.key = key
        self.captured = [list(c) for c in captured]
        self.kinds = list(kinds)

    def message(self) -> tuple[str, list[bytes]]:
        kind = self.rng.choice(self.kinds)
        return kind, getattr(self, f"_{kind}")()

    # ------------------------------------------------------------------ kinds
    def _base(self) -> list[bytes]:
        return list(self.rng.choice(self.captured))

    def _random(self) -> list[bytes]:
        n = self.rng.randint(1, 4)
        return [self.rng.randbytes(self.rng.choice((0, 1, 32, self.rng.randint(0, 300)))) for _ in range(n)]

    def _bitflip(self) -> list[bytes]:
        frames = self._base()
        i = self.rng.randrange(len(frames))
        if not frames[i]:
            return frames + [b"\x01"]
        raw = bytearray(frames[i])
        bit = self.rng.randrange(len(raw) * 8)
        raw[bit // 8] ^= 1 << (bit % 8)
        frames[i] = bytes(raw)
        return frames

    def _truncate(self) -> list[bytes]:
        frames = self._base()
        if len(frames) > 1 and self.rng.random() < 0.5:
            return frames[: self.rng.randrange(1, len(frames))]
        i = self.rng.randrange(len(frames))
        frames[i] = frames[i][: self.rng.randrange(len(frames[i]) or 1)]
        return frames

    def _extra(self) -> list[bytes]:
        return self._base() + [self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(self.rng.randint(1, 3))]

    def _wrong_mac(self) -> list[bytes]:
        frames = self._base()
        frames[0] = _mac(self.key + b"-wrong", frames[1])
        return frames

    def _envelope(self, frames: list[bytes]) -> dict[str, Any] | None:
        try:
            env = msgspec.msgpack.decode(frames[1])
        except msgspec.DecodeError:
            return None
        return env if isinstance(env, dict) and isinstance(env.get("header"), dict) else None

    def _seal(self, env: dict[str, Any], frames: list[bytes]) -> list[bytes]:
        header = env.get("header")
        if isinstance(header, dict) and header.get("kind") == "HELLO":
            header["fingerprint"] = f"fuzz-{self.rng.getrandbits(32):x}"  # never a valid HELLO
        body = msgspec.msgpack.encode(env)
        return [_mac(self.key, body), body, *frames[2:]]

    def _mutate(self) -> list[bytes]:
        frames = self._base()
        env = self._envelope(frames)
        if env is None:
            return self._bitflip()
        where = self.rng.random()
        value = self.rng.choice(_HOSTILE)
        if where < 0.5:
            header = env["header"]
            field = self.rng.choice(sorted(header) + ["kind", "unknown_field"])
            if field == "kind":
                value = self.rng.choice(["PUSH", "HELLO", "BCAST", "WELCOME", "NOPE", 7, None])
            header[field] = value
        elif where < 0.75 or not env.get("tensors"):
            env[self.rng.choice(["protocol", "chunk_bytes", "nonce", "seq", "tensors", "header", "extra"])] = value
        else:
            metas = env["tensors"]
            i = self.rng.randrange(len(metas))
            meta = list(metas[i]) if isinstance(metas[i], list) else [metas[i]]
            j = self.rng.randrange(max(1, len(meta)))
            meta[j % len(meta)] = self.rng.choice(_SHAPES + _HOSTILE)
            metas[i] = meta
        return self._seal(env, frames)

    def _dims(self) -> list[bytes]:
        frames = self._base()
        env = self._envelope(frames)
        if env is None or not env.get("tensors"):
            if env is None:
                return self._bitflip()
            env["tensors"] = [["w", "float32", [0], []]]
        metas = env["tensors"]
        i = self.rng.randrange(len(metas))
        if isinstance(metas[i], list) and len(metas[i]) == 4:
            metas[i][2] = self.rng.choice(_SHAPES[:8])
            if self.rng.random() < 0.5:
                metas[i][3] = [0] * self.rng.choice((0, 1, 3, 1000))
        return self._seal(env, frames)

    def _replay(self) -> list[bytes]:
        return self._base()


def raw_zmtp_flood(host: str, port: int, frames: int, frame_bytes: int, *, timeout_s: float = 10.0,
                   keep: list[socket.socket] | None = None) -> int:
    """Speak ZMTP 3.0 with the NULL mechanism over raw TCP and send ``frames`` frames of
    ``frame_bytes`` bytes, every one flagged MORE (an incomplete multipart message that never
    completes: the slow-loris of issue 14).  Returns the bytes the peer let us write before it
    closed the connection (a Curve server closes it at the greeting).  ``keep``: append the
    socket there instead of closing it (zmq frees an incomplete message when its connection
    closes, so a memory measurement must be taken while the connection is open)."""
    sent = 0
    s = socket.create_connection((host, port), timeout=timeout_s)
    try:
        # Greeting: signature, version 3.0, mechanism "NULL", as-server 0, filler.
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
        try:
            s.sendall(greeting)
            # READY command with Socket-Type DEALER.
            prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
            body = b"\x05READY" + prop
            s.sendall(b"\x04" + bytes([len(body)]) + body)
            chunk = b"\x00" * frame_bytes
            head = b"\x03" + struct.pack(">Q", frame_bytes)  # long frame, MORE
            for _ in range(frames):
                s.sendall(head + chunk)
                sent += len(head) + frame_bytes
        except OSError:
            pass
    finally:
        if keep is None:
            s.close()
        else:
            keep.append(s)
    return sent

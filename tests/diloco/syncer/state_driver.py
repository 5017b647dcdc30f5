"""Drive the core's :class:`Coordinator` the way the loop does, without sockets or threads.

A test builds headers plus tensors; the driver encodes them with the real wire codec
(``encode`` then ``open_message``: MAC, header and sizes checked, payload not read),
hands each opened message to ``Coordinator.receive``, runs the payload work the core
queued (``dataplane.run_work``, inline and in dispatch order, which is the order the
real data plane keeps per part) and feeds every result back through
``Coordinator.on_result`` until no work is left.  Everything the core asked to send is
collected in one list, in order.

Also here: the parted messages of INIT and PUSH streams (cut exactly as islands cut
them, with :class:`FragmentLayout`), helpers to pick outputs apart, and the numpy
reference of the commit folded in a recorded fold order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.consume import Consumption
from diloco.syncer.dataplane import run_work
from diloco.syncer.encoded import EncodedCache
from diloco.syncer.core.records import Outgoing, OutStream, Snapshot
from diloco.syncer.core.coordinator import Coordinator
from diloco.wire import DEFAULT_CHUNK_BYTES, Error, FragmentLayout, Hello, Init, Opened, Push, Welcome, encode, open_message

Tensors = Sequence[tuple[str, torch.Tensor]]
Out = Outgoing | OutStream


def opened(header: Any, tensors: Tensors = (), nonce: int = 0, seq: int = 0) -> Any:
    """One message through the real codec: what the loop hands to ``Coordinator.receive``."""
    return open_message(encode(header, list(tensors), nonce=nonce, seq=seq))


def unchecked(header: Any) -> Opened:
    """A tensor-less message the codec would refuse (e.g. a HELLO of another protocol): tests the
    core's own checks, which must hold whatever the loop lets through."""
    return Opened(header, DEFAULT_CHUNK_BYTES, [], [])


def layout_of(tensors: Tensors) -> FragmentLayout:
    return FragmentLayout.of([(n, tuple(t.shape)) for n, t in tensors])


def flat(tensors: Tensors) -> torch.Tensor:
    """The fragment stream of ``tensors`` (plan order), upcast to fp32."""
    return torch.cat([t.reshape(-1).float() for _, t in tensors])


def init_parts(fragment: int, n_fragments: int, tensors: Tensors, part_elems: int, *, island: int = 0,
               generation: int = 0) -> list[tuple[Init, list[tuple[str, torch.Tensor]]]]:
    """The INIT stream of one fragment: part 0 carries the schema."""
    lay = layout_of(tensors)
    n = lay.n_parts(part_elems)
    schema = tuple((name, tuple(t.shape)) for name, t in tensors)
    return [
        (Init(island=island, generation=generation, fragment=fragment, n_fragments=n_fragments, part=k, n_parts=n,
              schema=schema if k == 0 else ()), lay.slice_part(tensors, k, part_elems))
        for k in range(n)
    ]


def push_parts(island: int, generation: int, fragment: int, round_: int, tensors: Tensors, part_elems: int, *,
               attempt: int = 0, base: int = 0, steps: int = 2, tokens: int = 10
               ) -> list[tuple[Push, list[tuple[str, torch.Tensor]]]]:
    """The PUSH stream of one delta; a push without local steps is one header, no tensors."""
    def head(k: int, n: int) -> Push:
        return Push(island=island, generation=generation, fragment=fragment, round=round_, attempt=attempt,
                    base_version=base, local_steps=steps, tokens=tokens, part=k, n_parts=n)

    if steps == 0:
        return [(head(0, 0), [])]
    lay = layout_of(tensors)
    n = lay.n_parts(part_elems)
    return [(head(k, n), lay.slice_part(tensors, k, part_elems)) for k in range(n)]


class Driver:
    """A :class:`Coordinator` plus the loop's work/result plumbing, run inline."""

    def __init__(self, config: SyncerConfig, *, syncer_id: int = 7, snapshot: Snapshot | None = None) -> None:
        self.st = Coordinator(config, syncer_id=syncer_id, snapshot=snapshot)
        self.nonces: dict[bytes, int] = {}
        self.seqs: dict[bytes, int] = {}
        self.consumption = Consumption(EncodedCache())

    @property
    def E(self) -> int:
        """The core's part size (fixed with the layout; the run's largest before)."""
        return self.st.book.part_elems

    def send(self, peer: bytes, header: Any, tensors: Tensors = (), now: float = 0.0, *, run: bool = True) -> list[Out]:
        """Send as the island on ``peer`` would: stamped with that peer's session (HELLO: none)."""
        if isinstance(header, Hello):
            message = opened(header, tensors)
        else:
            message = opened(header, tensors, *self.stamp(peer))
        out = self.st.receive(peer, message, now)
        self._learn(out)
        if run:
            out += self.run(now)
        return out

    def stamp(self, peer: bytes) -> tuple[int, int]:
        """(nonce, next seq) of the session the core opened for ``peer`` (0, 1.. if none)."""
        self.seqs[peer] = self.seqs.get(peer, 0) + 1
        return self.nonces.get(peer, 0), self.seqs[peer]

    def _learn(self, out: Sequence[Out]) -> None:
        for o in out:
            if isinstance(o, Outgoing) and isinstance(o.header, Welcome):
                self.nonces[o.peer] = o.header.nonce

    def handle(self, peer: bytes, message: Opened, now: float = 0.0) -> list[Out]:
        out = self.st.receive(peer, message, now)
        self._learn(out)
        return out + self.run(now)

    def send_all(self, peer: bytes, msgs: Sequence[tuple[Any, Tensors]], now: float = 0.0) -> list[Out]:
        out: list[Out] = []
        for header, tensors in msgs:
            out += self.send(peer, header, tensors, now)
        return out

    def run(self, now: float) -> list[Out]:
        """Run queued work until none is left (results may queue more: a commit after the last fold).
        Commits the core marked ``consume`` pass the loop's own check first (``consume.Consumption``:
        nothing else may hold a view of the old value)."""
        out: list[Out] = []
        while True:
            queued: list[Any] = []
            self.consumption.route(self.st.take_work(), queued.append)
            self.consumption.release(queued.append)
            if not queued:
                return out
            for w in queued:
                out += self.st.on_result(run_work(w), now)
            self.consumption.prune(self.st.versions())

    def tick(self, now: float) -> list[Out]:
        out = self.st.tick(now)
        return out + self.run(now)


# ---------------------------------------------------------------- picking outputs apart


def of(out: Sequence[Out], kind: type) -> list[Outgoing]:
    """Control messages whose header is a ``kind``."""
    return [o for o in out if isinstance(o, Outgoing) and isinstance(o.header, kind)]


def errors(out: Sequence[Out]) -> list[str]:
    return [o.header.code for o in of(out, Error)]


def streams(out: Sequence[Out], kind: str = "BCAST") -> list[OutStream]:
    """Fragment streams (``"BCAST"`` or ``"FINAL"``) the core asked the loop to send."""
    return [o for o in out if isinstance(o, OutStream) and o.kind == kind]


def kinds(out: Sequence[Out]) -> list[str]:
    """``Welcome``, ``Pull``, ... for control messages, ``BCAST`` / ``FINAL`` for streams, in order."""
    return [o.kind if isinstance(o, OutStream) else type(o.header).__name__ for o in out]


# ---------------------------------------------------------------- the numpy reference


def reference_commit(value: np.ndarray, mom: np.ndarray, deltas: dict[int, np.ndarray], weights: dict[int, int],
                     fold_order: Sequence[int] | Sequence[Sequence[int]], part_elems: int,
                     lr: float = 0.7, mu: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """docs/PROTOCOL.md "Commit" in numpy, one fp32 op at a time, each part folded in its recorded order.

    ``deltas``: flat stream per island (any float dtype, upcast first); ``weights``: every push of
    the round (zero weights count in nothing); ``fold_order``: the event's field, one island list
    for every part or one list per part.
    """
    n_parts = -(-value.size // part_elems)
    orders = [list(fold_order)] * n_parts if not fold_order or isinstance(fold_order[0], int) else list(fold_order)
    assert len(orders) == n_parts, (len(orders), n_parts)
    s = np.empty_like(value, dtype=np.float32)
    for k, order in enumerate(orders):
        lo, hi = k * part_elems, min(value.size, (k + 1) * part_elems)
        assert order, f"part {k} has no fold"
        acc = deltas[order[0]][lo:hi].astype(np.float32) * np.float32(weights[order[0]])
        for i in order[1:]:
            acc = acc + deltas[i][lo:hi].astype(np.float32) * np.float32(weights[i])
        s[lo:hi] = acc
    d = s / np.float32(sum(weights.values()))
    g = -d
    m = np.float32(mu) * mom + g
    return value - np.float32(lr) * (g + np.float32(mu) * m), m


def bitwise(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> bool:
    """Equal bit for bit (fp32)."""
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    b = b.numpy() if isinstance(b, torch.Tensor) else b
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))

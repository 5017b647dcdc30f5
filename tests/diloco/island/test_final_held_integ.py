"""The final cut with held notices, on a real 2-rank gloo island against a scripted syncer.

After the island says it is done, the syncer streams fp32 values of fragments 0 and 1, then
sends the final cut: fragments 0 and 1 as HELD notices (the island installs the values it was
just streamed: from its anchors, or from the value still parked), fragment 2 as a HELD notice of
a value the island never got after its done (it has no digest of it: it must redial for the
bytes), fragment 3 as an fp32 stream. Every rank must end with exactly the final values, local
progress overwritten, and the FINAL_ACK must carry each final value's digest.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from diloco import wire
from diloco.config import IslandConfig
from diloco.digest import tensor_digest
from diloco.island.boundary import Island
from diloco.layout.torch_module import TorchLayout
from diloco.demo.ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_syncer import FakeSyncer  # noqa: E402

pytestmark = [pytest.mark.integ, pytest.mark.timeout(180)]

N = 4
WIDTH = 256
VERSIONS = (1, 1, 0, 2)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(N * 2)])


class HeldFinalSyncer(FakeSyncer):
    """INIT, a cut of INIT + 1, then after the island's done: BCASTs, the final cut, SHUTDOWN."""

    def __init__(self) -> None:
        super().__init__()
        self.init: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.final_values: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.acks: list[wire.FinalAck] = []
        self.hellos = 0

    def _recv(self, timeout_s: float = 60.0) -> tuple[bytes, wire.Message]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if self.sock.poll(50):
                peer, *frames = self.sock.recv_multipart(copy=False)
                return peer.bytes, wire.decode(frames)
        raise TimeoutError("the island went silent")

    def _welcome(self, peer: bytes, hello: wire.Hello, need_init: bool) -> None:
        self.hellos += 1
        self.nonce, self.seq = 90 + self.hellos, 0
        self._send(peer, wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=1, need_init=need_init,
                                      versions=(0,) * N, sync_every=4, total_steps=0, generation=hello.generation,
                                      nonce=self.nonce, initialised=() if need_init else (True,) * N))

    def _final(self, peer: bytes, f: int, held: bool) -> None:
        if held:
            self._send(peer, wire.Final(fragment=f, version=VERSIONS[f], n_fragments=N, versions=VERSIONS, part=0,
                                        n_parts=0, held=True))
        else:
            self._send(peer, wire.Final(fragment=f, version=VERSIONS[f], n_fragments=N, versions=VERSIONS),
                       self.final_values[f])

    def _script(self) -> None:
        peer, msg = self._recv()
        assert isinstance(msg.header, wire.Hello)
        self._welcome(peer, msg.header, need_init=True)
        while len(self.init) < N:
            _, msg = self._recv()
            if isinstance(msg.header, wire.Init):
                self.init[msg.header.fragment] = msg.tensors
        cut = {f: [(n, t + 1) for n, t in self.init[f]] for f in range(N)}
        for f in range(N):
            self._send(peer, wire.Bcast(fragment=f, version=0, round=0, cut=True), cut[f])
        self.final_values = {0: [(n, t * 0.5) for n, t in cut[0]], 1: [(n, t - 3) for n, t in cut[1]],
                             2: cut[2], 3: [(n, t + 2) for n, t in cut[3]]}
        while True:  # until the island says it is done
            _, msg = self._recv()
            if isinstance(msg.header, wire.Heartbeat) and msg.header.done:
                break
        self._send(peer, wire.Bcast(fragment=0, version=1, round=1, cut=False), self.final_values[0])
        time.sleep(1.0)  # fragment 0 is staged (and installed) before the final cut comes
        self._send(peer, wire.Bcast(fragment=1, version=1, round=2, cut=False), self.final_values[1])
        for f in range(N):
            self._final(peer, f, held=f < 3)
        while True:
            peer_now, msg = self._recv()
            if isinstance(msg.header, wire.Hello):  # the island asks for the bytes of fragment 2
                self._welcome(peer_now, msg.header, need_init=False)
                for f in range(N):
                    self._final(peer_now, f, held=False)
            elif isinstance(msg.header, wire.FinalAck):
                self.acks.append(msg.header)
                self._send(peer_now, wire.Shutdown(reason="done"))
                return


def _island_rank(rank: int, world: int, addr: str) -> dict:
    torch.set_num_threads(1)
    model = _model()
    layout = TorchLayout(model, group=dist.group.WORLD)
    cfg = IslandConfig(sync_addr=addr, island_id=0, fragments=N, heartbeat_s=0.2, sync_timeout_s=60.0,
                       final_timeout_s=60.0, wire_dtype="float32")
    island = Island(cfg, layout, tokens_per_step=16)
    anchored: list[int] = []
    install_anchor = island.data.install_anchor

    def tracked(f: int) -> None:
        anchored.append(f)
        install_anchor(f)

    island.data.install_anchor = tracked  # type: ignore[method-assign]
    island.start()
    for step in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)  # local progress, which the final cut replaces
        island.step_end(step)
    versions = island.finish()
    return {"versions": versions, "anchored": anchored,
            "params": {n: tensor_digest([(n, p.detach().reshape(-1))]) for n, p in model.named_parameters()}}


def test_held_final_notices_install_what_the_island_holds_and_refetch_what_it_does_not() -> None:
    syncer = HeldFinalSyncer()
    syncer.start()
    try:
        results = run_ranks(2, _island_rank, syncer.addr, timeout_s=150)
    finally:
        syncer.stop.set()
        syncer.join(10)
    assert syncer.error is None, syncer.error
    assert syncer.hellos == 2  # one redial: the bytes of fragment 2
    want = {n: tensor_digest([(n, t.reshape(-1))]) for f in range(N) for n, t in syncer.final_values[f]}
    for r in results:
        assert r["versions"] == list(VERSIONS)
        assert r["params"] == want  # every tensor, on every rank: exactly the final values
        # Fragment 0 was staged before the final cut came: installed from the anchors on every
        # rank (fragment 1 may have been too, or still parked); 2 came as bytes after a redial.
        assert 0 in r["anchored"] and not {2, 3} & set(r["anchored"]), r["anchored"]
    (ack,) = syncer.acks
    shapes = {n: p.shape for n, p in _model().named_parameters()}
    assert list(ack.versions) == list(VERSIONS)
    assert list(ack.digests) == [tensor_digest([(n, t.view(shapes[n])) for n, t in syncer.final_values[f]])
                                 for f in range(N)]

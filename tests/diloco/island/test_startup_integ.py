"""Island start-up against a scripted syncer: INIT streaming with bounded memory, initial cut.

The syncer here is a real ROUTER socket in a thread of the test process, speaking our wire
protocol, scripted so that it reads INIT slowly (a throttled link) and sends the initial
cut one fragment at a time. The island is a real 2-rank gloo job (forked processes) with a
plain-torch layout.
"""

from __future__ import annotations

import sys
import time
import weakref
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

N_FRAGMENTS = 4
WIDTH = 512  # each Linear weight is 1 MiB of fp32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(N_FRAGMENTS * 2)])


class ScriptedSyncer(FakeSyncer):
    """Welcomes island 0 with need_init, reads INIT slowly, then sends a cut of INIT + 1.

    ``cut_fragments`` limits which fragments the cut contains at first (the rest is sent
    once the island reports step ``late_at_step``), to exercise the initial-cut timeout.
    """

    def __init__(self, read_delay_s: float, cut_fragments: int, late_at_step: int = 0,
                 held: frozenset[int] = frozenset()) -> None:
        super().__init__(rcvbuf=1 << 16)
        self.read_delay_s = read_delay_s
        self.cut_fragments = cut_fragments
        self.late_at_step = late_at_step
        self.held = held
        """Fragments answered HELD (version 3, round 2) instead of their cut."""
        self.holds: tuple[str, ...] = ()
        self.init: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self.steps: list[int] = []

    def _recv(self) -> tuple[bytes, wire.Message] | None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                peer, *frames = self.sock.recv_multipart(copy=False)
                return peer.bytes, wire.decode(frames)
        return None

    def _script(self) -> None:
        got = self._recv()
        assert got is not None
        peer, msg = got
        assert isinstance(msg.header, wire.Hello)
        self.holds = msg.header.holds
        self.nonce = 99
        self._send(peer, wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=1, need_init=True,
                                      versions=(0,) * N_FRAGMENTS, sync_every=4, total_steps=0,
                                      generation=msg.header.generation, nonce=self.nonce))
        while len(self.init) < N_FRAGMENTS:
            time.sleep(self.read_delay_s)  # a slow link: the island must not run ahead
            got = self._recv()
            assert got is not None
            _, msg = got
            if isinstance(msg.header, wire.Init):
                self.init[msg.header.fragment] = msg.tensors
        cut = {f: [(n, t + 1) for n, t in self.init[f]] for f in range(N_FRAGMENTS)}
        for f in range(self.cut_fragments):
            time.sleep(0.05)
            if f in self.held:
                self._send(peer, wire.Held(fragment=f, version=3, round=2))
            else:
                self._send(peer, wire.Bcast(fragment=f, version=0, round=0, cut=True), cut[f])
        late_sent = self.cut_fragments == N_FRAGMENTS
        while not self.stop.is_set():
            got = self._recv()
            if got is None:
                return
            _, msg = got
            if isinstance(msg.header, wire.Heartbeat) and msg.header.step:
                self.steps.append(msg.header.step)
            if not late_sent and self.steps and max(self.steps) >= self.late_at_step:
                for f in range(self.cut_fragments, N_FRAGMENTS):
                    self._send(peer, wire.Bcast(fragment=f, version=0, round=0, cut=True), cut[f])
                late_sent = True


def _island_rank(rank: int, world: int, addr: str, cut_timeout_s: float, steps: int) -> dict:
    torch.set_num_threads(1)
    model = _model()
    initial = [p.detach().clone() for p in model.parameters()]
    layout = TorchLayout(model, group=dist.group.WORLD)
    cfg = IslandConfig(sync_addr=addr, island_id=0, fragments=N_FRAGMENTS, initial_cut_timeout_s=cut_timeout_s,
                       heartbeat_s=0.2, sync_timeout_s=60.0)
    island = Island(cfg, layout, tokens_per_step=16)
    params = dict(model.named_parameters())
    digests = [tensor_digest([(s.name, params[s.name].detach()) for s in island.plan.specs_of(f)])
               for f in range(N_FRAGMENTS)]  # what its HELLO must claim: the values it starts from
    # Count the fragments the sync rank holds: each export's tensors are tracked until freed.
    live: set[int] = set()
    max_live = [0]
    export = island.transfer.export_fragment

    def tracked_export(f: int, *, delta: bool):  # noqa: ANN202
        out = export(f, delta=delta)
        if out is not None:
            live.add(f)
            max_live[0] = max(max_live[0], len(live))
            weakref.finalize(out[0][1], live.discard, f)
        return out

    island.transfer.export_fragment = tracked_export  # type: ignore[method-assign]
    island.start()
    after_start = [torch.equal(p, q + 1) for p, q in zip(model.parameters(), initial)]
    for step in range(1, steps + 1):
        time.sleep(0.1)
        island.step_end(step)
    after_steps = [torch.equal(p, q + 1) for p, q in zip(model.parameters(), initial)]
    unchanged = [torch.equal(p, q) for p, q in zip(model.parameters(), initial)]
    # Every fragment's anchor is what the masters hold (held or cut): the next push carries no delta.
    max_before = max_live[0]
    no_delta = True
    for f in range(N_FRAGMENTS):  # collective; one fragment at a time
        d = island.transfer.export_fragment(f, delta=True)
        no_delta = no_delta and (d is None or all(not t.any() for _, t in d))
        del d
    max_live[0] = max_before
    if island.client is not None:
        island.client.close(linger_s=0.5)
    return {"max_live": max_live[0], "after_start": after_start, "after_steps": after_steps, "unchanged": unchanged,
            "no_delta": no_delta, "digests": digests,
            "versions": island.versions,
            "fragment_of": [island.plan.fragment_of(n) for n, _ in model.named_parameters()]}


def _run(syncer: ScriptedSyncer, cut_timeout_s: float, steps: int) -> list[dict]:
    syncer.start()
    try:
        return run_ranks(2, _island_rank, syncer.addr, cut_timeout_s, steps, timeout_s=120)
    finally:
        syncer.stop.set()
        syncer.join(10)
        assert syncer.error is None, syncer.error


def test_init_streams_with_at_most_two_fragments_and_cut_installs_before_first_step() -> None:
    syncer = ScriptedSyncer(read_delay_s=0.3, cut_fragments=N_FRAGMENTS)
    results = _run(syncer, cut_timeout_s=30.0, steps=0)
    model = _model()
    # INIT carried exactly the island's initial values, every fragment once.
    sent = {name: t for f in range(N_FRAGMENTS) for name, t in syncer.init[f]}
    assert sorted(sent) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(sent[name], p.detach().reshape(-1))
    # The sync rank never held more than two fragments while the link was slow.
    assert results[0]["max_live"] <= 2
    # The cut (INIT + 1) was installed on every rank before start() returned.
    for r in results:
        assert all(r["after_start"]) and r["versions"] == [0] * N_FRAGMENTS


def test_initial_cut_timeout_leaves_the_rest_to_the_boundaries() -> None:
    syncer = ScriptedSyncer(read_delay_s=0.0, cut_fragments=2, late_at_step=5)
    results = _run(syncer, cut_timeout_s=1.0, steps=20)
    for r in results:
        # Fragments 0 and 1 were installed at start-up, the rest at a later boundary.
        assert r["after_start"] == [f < 2 for f in r["fragment_of"]]
        assert all(r["after_steps"]) and r["versions"] == [0] * N_FRAGMENTS
    assert syncer.steps and max(syncer.steps) == 20


def test_held_fragments_keep_their_values_and_anchor_them_on_every_rank() -> None:
    # The HELLO claims the digest of every fragment the island starts from; the syncer answers
    # fragments 1 and 3 with HELD (no bytes), 0 and 2 with their cut (INIT + 1).
    syncer = ScriptedSyncer(read_delay_s=0.0, cut_fragments=N_FRAGMENTS, held=frozenset({1, 3}))
    results = _run(syncer, cut_timeout_s=30.0, steps=0)
    assert syncer.holds == tuple(results[0]["digests"])
    for r in results:
        assert r["versions"] == [0, 3, 0, 3]
        assert r["unchanged"] == [f in (1, 3) for f in r["fragment_of"]]
        assert r["after_start"] == [f in (0, 2) for f in r["fragment_of"]]
        assert r["no_delta"]

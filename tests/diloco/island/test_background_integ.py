"""The background data path of a real multi-rank island against a scripted syncer.

* training steps run while a push is in flight, and the pushed delta is the snapshot's,
  not a later state;
* progress-preserving apply: the steps taken between the push and the apply of that
  round's commit survive, and the next push carries exactly that unmerged progress;
* a rank killed while a background transfer is in flight: every other rank raises
  IslandError, none hangs.

The syncer is a real ROUTER socket in a thread of the test process speaking our wire
protocol; the island is a real gloo job of forked processes over a plain-torch layout whose
"optimizer step" is a deterministic in-place update, so every expected value can be
computed from recorded parameters with the same float operations.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from diloco import wire
from diloco.config import IslandConfig
from diloco.island.boundary import Island, IslandError
from diloco.layout.base import ParamSpec
from diloco.layout.torch_module import TorchLayout
from diloco.plan import make_plan
from diloco.demo.ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_syncer import FakeSyncer  # noqa: E402

pytestmark = [pytest.mark.integ, pytest.mark.timeout(180)]

N_FRAGMENTS = 2
WIDTH = 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(2 * N_FRAGMENTS)])


def _initial() -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in _model().named_parameters()}


PLAN = make_plan({n: ParamSpec(n, tuple(t.shape)) for n, t in _initial().items()}, N_FRAGMENTS)
NAMES = list(_initial())
F0 = list(PLAN.names(0))
IDX = [NAMES.index(n) for n in F0]
"""Positions (in ``model.parameters()`` order) of fragment 0's params, in plan order."""


def _train(model: torch.nn.Module, step: int) -> None:
    """A deterministic optimizer step, identical on every replica."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999).add_(1e-3 * step)


class Scripted(FakeSyncer):
    """Welcome + cut of the initial model, then ``script(step) -> [(header, tensors)]`` by island step."""

    def __init__(self, script) -> None:  # noqa: ANN001
        super().__init__()
        self.script = script
        self.pushes: list[tuple[int, wire.Push, list]] = []
        self.step = 0

    def _script(self) -> None:
        peer = None
        fired: set[int] = set()
        model = _model()
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            p, *frames = self.sock.recv_multipart(copy=False)
            msg = wire.decode(frames)
            h = msg.header
            if isinstance(h, wire.Hello):
                peer = p.bytes
                self.nonce, self.seq = self.nonce + 1, 0
                self._send(peer, wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=1, need_init=False,
                                              versions=(0,) * N_FRAGMENTS, sync_every=4, total_steps=0,
                                              generation=h.generation, nonce=self.nonce))
                params = dict(model.named_parameters())
                for f in range(N_FRAGMENTS):
                    self._send(peer, wire.Bcast(fragment=f, version=0, round=0, cut=True),
                               [(n, params[n].detach()) for n in PLAN.names(f)])
            elif isinstance(h, wire.Push):
                # One part of flat segments (small fragments): give them their shapes back.
                assert h.n_parts == 1 and h.part == 0, h
                shapes = {n: t.shape for n, t in _initial().items()}
                self.pushes.append((self.step, h, [(n, t.reshape(shapes[n])) for n, t in msg.tensors]))
            elif isinstance(h, wire.Heartbeat):
                self.step = max(self.step, h.step)
            if peer is None:
                continue
            for key, header, tensors in self.script(self):
                if key not in fired:
                    fired.add(key)
                    self._send(peer, header, tensors)


def _island(rank: int, world: int, addr: str, steps: int, slow_s: float, kill_rank: int, record: bool,
            kill_in: str = "stage") -> dict:
    torch.set_num_threads(1)
    model = _model()
    layout = TorchLayout(model, group=dist.group.WORLD)
    cfg = IslandConfig(sync_addr=addr, island_id=0, fragments=N_FRAGMENTS, initial_cut_timeout_s=30.0,
                       heartbeat_s=0.1, sync_timeout_s=60.0, transfer_timeout_s=20.0)
    island = Island(cfg, layout, tokens_per_step=16)
    gather, stage = island.data.gather_delta, island.data.stage

    def slow_gather(f: int):  # noqa: ANN202 - keeps the push in flight while steps run
        time.sleep(slow_s)
        if rank == kill_rank and kill_in == "gather":
            os.kill(os.getpid(), signal.SIGKILL)  # mid-export: the others are in the gather
        return gather(f)

    def dying_stage(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if rank == kill_rank and kill_in == "stage":
            os.kill(os.getpid(), signal.SIGKILL)
        return stage(*a, **k)

    island.data.gather_delta = slow_gather  # type: ignore[method-assign]
    island.data.stage = dying_stage  # type: ignore[method-assign]
    island.start()
    pre: dict[int, list] = {}
    post: dict[int, list] = {}
    snaps: list[int] = []
    installs: dict[int, int] = {}
    ready: list[int] = []
    try:
        for step in range(1, steps + 1):
            _train(model, step)
            if record:
                pre[step] = [p.detach().clone().tolist() for p in model.parameters()]
            before = dict(island._push_seq)
            versions = list(island.versions)
            staging = island.planner.slots[0].staging
            if staging is not None and staging.seq <= island.bg.done:
                ready.append(step)  # fragment 0's value is staged on this rank before this boundary
            island.step_end(step)
            if record:
                post[step] = [p.detach().clone().tolist() for p in model.parameters()]
            if island._push_seq.get(0) != before.get(0):
                snaps.append(step)
            if island.versions[0] != versions[0]:
                installs[step] = island.versions[0]
            time.sleep(0.05)
    except IslandError as exc:
        return {"error": str(exc)}
    island.bg.drain(30)
    if island.client is not None:
        island.client.close(linger_s=1.0)
    return {"pre": pre, "post": post, "snaps": snaps, "installs": installs, "ready": ready, "error": None}


def test_push_in_flight_carries_the_snapshot_and_apply_keeps_progress() -> None:
    g1: dict[str, torch.Tensor] = {}

    def script(s: Scripted) -> list:
        out = [("pull1", wire.Pull(fragment=0, round=1, attempt=0), None)] if s.step >= 2 else []
        if s.pushes:
            _, h, tensors = s.pushes[0]
            if not g1:
                base = _initial()
                g1.update({n: base[n] + 0.5 * d for n, d in tensors})
            out.append(("commit1", wire.Bcast(fragment=0, version=1, round=1, cut=False), list(g1.items())))
            out.append(("pull2", wire.Pull(fragment=0, round=2, attempt=0), None))
        return out

    syncer = Scripted(script)
    syncer.start()
    try:
        results = run_ranks(2, _island, syncer.addr, 24, 0.6, -1, True, timeout_s=150)
    finally:
        syncer.stop.set()
        syncer.join(10)
    assert syncer.error is None, syncer.error
    r = results[0]
    assert r["error"] is None
    assert len(syncer.pushes) == 2, [h for _, h, _ in syncer.pushes]
    s1, s2 = r["snaps"]
    # 1. The push was in flight while training went on, and it carries the snapshot's delta.
    arrived, h1, d1 = syncer.pushes[0]
    assert arrived > s1, "the slowed push should reach the syncer steps after its snapshot"
    base = _initial()
    snap = [torch.tensor(x) for x in r["post"][str(s1)]]
    assert [n for n, _ in d1] == F0
    for (name, d), i in zip(d1, IDX):
        assert torch.equal(d, snap[i] - base[name]), f"{name}: pushed delta is not snapshot - anchor"
    assert h1.local_steps == s1
    # 2. The commit was installed keeping the steps taken since the snapshot.
    (t_inst,) = [int(t) for t, v in r["installs"].items() if v == 1]
    assert s1 < t_inst <= s2
    # ... at the first boundary both ranks reached with the value staged (not one step later).
    both_ready = sorted(set(r["ready"]) & set(results[1]["ready"]))
    assert both_ready and t_inst <= both_ready[0], (t_inst, r["ready"], results[1]["ready"])
    for name, i in zip(F0, IDX):
        now = torch.tensor(r["pre"][str(t_inst)][i])
        assert torch.equal(torch.tensor(r["post"][str(t_inst)][i]), now + (g1[name] - snap[i])), name
    # 3. The next push carries exactly the progress not merged yet, with its step count.
    _, h2, d2 = syncer.pushes[1]
    assert h2.round == 2 and h2.local_steps == s2 - s1 and h2.base_version == 1
    for (name, d), i in zip(d2, IDX):
        assert torch.equal(d, torch.tensor(r["post"][str(s2)][i]) - g1[name]), name
    # Every rank ends with the same parameters (replicas installed together).
    assert results[1]["post"]["24"] == r["post"]["24"]


@pytest.mark.parametrize("kill_in", ["stage", "gather"])
def test_rank_killed_during_background_transfer_fails_every_other_rank(kill_in: str) -> None:
    """A rank SIGKILLed inside a background transfer: the staging of a received value (apply),
    or the gather of a push's delta (export, the others already in the collective). Every
    surviving rank raises IslandError naming itself, within the transfer timeout."""
    def script(s: Scripted) -> list:
        if s.step < 3:
            return []
        if kill_in == "gather":
            return [("pull", wire.Pull(fragment=0, round=1, attempt=0), None)]
        vals = [(n, _initial()[n] + 1) for n in F0]
        return [("commit", wire.Bcast(fragment=0, version=1, round=1, cut=False), vals)]

    syncer = Scripted(script)
    syncer.start()
    t0 = time.monotonic()
    try:
        results = run_ranks(3, _island, syncer.addr, 200, 0.0, 1, False, kill_in, timeout_s=150, may_die=[1])
    finally:
        syncer.stop.set()
        syncer.join(10)
    assert syncer.error is None, syncer.error
    assert results[1] is None  # killed
    for r in (0, 2):
        assert results[r]["error"] is not None, f"rank {r} trained on after a peer died"
        assert f"island 0 rank {r}:" in results[r]["error"], results[r]["error"]
    assert time.monotonic() - t0 < 150

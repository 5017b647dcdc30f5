"""A real yeto-syncer process and three scripted islands: 20 rounds over 4 fragments, then FINAL.

The syncer's values (as broadcast, in FINAL and in the final checkpoint) must equal
a numpy reference of the weighted mean + Nesterov formula bit for bit.
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest
import torch
import zmq

from diloco.syncer.store import CheckpointStore
from diloco.wire import PROTOCOL_VERSION, Bcast, Final, FinalAck, Heartbeat, Hello, Init, Pull, Push, Shutdown, Welcome
from syncer_harness import Island, SyncerProc, commit_event, reference_fragment

P = 4
SHAPES = [[("w", (96, 64)), ("b", (3000,))], [("w", (40,))], [("w", (8, 8)), ("n", (3,))], [("e", (5, 7))]]


def names(f: int, arrays: list[np.ndarray]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.from_numpy(a)) for (n, _s), a in zip(SHAPES[f], arrays)]


@pytest.mark.integ
@pytest.mark.timeout(180)
def test_twenty_rounds_three_islands_bitwise(tmp_path) -> None:
    rng = np.random.default_rng(1)
    ckpt = tmp_path / "ckpt"
    events = tmp_path / "events.jsonl"
    syncer = SyncerProc(tmp_path, [
        "--islands", "3", "--sync-every", "4", "--total-steps", "20", "--grace-ms", "50",
        "--quorum-timeout-s", "60", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
        "--event-log", str(events), "--final-timeout-s", "30", "--part-mib", "0.015625",
    ])
    ctx = zmq.Context()
    dtypes = ["float32", "float32", "bfloat16"]
    islands = [Island(ctx, syncer.endpoint, i, wire_dtype=dtypes[i], schema=SHAPES) for i in range(3)]
    try:
        for isl in islands:
            isl.send(Hello(protocol=PROTOCOL_VERSION, island=isl.island, generation=isl.generation, fingerprint="fp-integ",
                           n_fragments=P, wire_dtype=isl.wire_dtype))
        welcomes = [isl.expect(Welcome).header for isl in islands]
        assert [w.need_init for w in welcomes] == [True, False, False]
        value = [[rng.standard_normal(s).astype(np.float32) for _n, s in SHAPES[f]] for f in range(P)]
        mom = [[np.zeros_like(a) for a in fr] for fr in value]
        for f in range(P):
            islands[0].send(Init(island=0, generation=islands[0].generation, fragment=f, n_fragments=P), names(f, value[f]))
        for isl in islands:
            got = {}
            for _ in range(P):
                m = isl.expect(Bcast)
                assert m.header.cut and m.header.version == 0
                got[m.header.fragment] = m
            assert sorted(got) == list(range(P))
            assert np.array_equal(got[1].tensors[0][1].float().numpy(),
                                  torch.from_numpy(value[1][0]).to(torch.__dict__[isl.wire_dtype]).float().numpy())

        for isl in islands:  # a HELLO alone is not membership: islands heartbeat after WELCOME
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=0))
        time.sleep(0.3)
        versions = [0] * P
        for step in range(1, 21):
            for isl in islands:
                isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=step))
            f = (step - 1) % P
            deltas, ws = {}, {}
            for isl in islands:
                pull = isl.expect(Pull, strict=False).header
                assert (pull.fragment, pull.round, pull.attempt) == (f, step, 0)
                d = [(rng.standard_normal(s) * 0.01).astype(np.float32) for _n, s in SHAPES[f]]
                tensors = names(f, d)
                if isl.wire_dtype == "bfloat16":
                    tensors = [(n, t.bfloat16()) for n, t in tensors]
                    d = [t.float().numpy() for _n, t in tensors]
                steps = 0 if (step == 7 and isl.island == 1) else 4
                # Round 1 has no reference weight: claims over 4x apart would re-pull it (robust.py).
                tokens = int(rng.integers(1000, 4000)) if step == 1 else int(rng.integers(1, 5000))
                isl.send(Push(island=isl.island, generation=isl.generation, fragment=f, round=step, attempt=0,
                              base_version=versions[f], local_steps=steps, tokens=tokens), tensors)
                if steps:
                    deltas[isl.island], ws[isl.island] = d, tokens
            # Parts fold as they arrive: the event log records the order, the reference replays it.
            ev = commit_event(events, step)
            order = ev["fold_order"]
            assert sorted(order if not order or not isinstance(order[0], list) else order[0]) == sorted(ws)
            # Claimed tokens are weights only up to 4 x the median of the round (robust.py): use the syncer's.
            assert all(int(k) in ws and w <= ws[int(k)] for k, w in ev["weights"].items() if w)
            ws = {int(k): w for k, w in ev["weights"].items() if int(k) in ws}
            value[f], mom[f] = reference_fragment(value[f], mom[f], deltas, ws, order, 4096)
            versions[f] += 1
            for isl in islands:
                b = isl.expect(Bcast, strict=False)
                assert (b.header.fragment, b.header.version, b.header.round, b.header.cut) == (f, versions[f], step, False)
                for (_n, t), ref in zip(b.tensors, value[f]):
                    want = torch.from_numpy(ref).to(torch.__dict__[isl.wire_dtype])
                    assert torch.equal(t, want), f"round {step} island {isl.island}"

        # Every island is at --total-steps: one flush round per fragment merges what is left
        # (here nothing: zero-weight pushes carry no tensors and change nothing).
        for rnd in range(21, 25):
            for isl in islands:
                pull = isl.expect(Pull, strict=False).header
                assert (pull.round, pull.fragment) == (rnd, (rnd - 1) % P)
                isl.send(Push(island=isl.island, generation=isl.generation, fragment=pull.fragment, round=rnd,
                              attempt=0, base_version=versions[pull.fragment], local_steps=0, tokens=0))
        for isl in islands:
            finals = {}
            for _ in range(P):
                m = isl.expect(Final)
                assert m.header.versions == tuple(versions) and m.header.n_fragments == P
                finals[m.header.fragment] = m
            for f in range(P):
                for (_n, t), ref in zip(finals[f].tensors, value[f]):
                    assert t.dtype == torch.float32 and np.array_equal(t.numpy().view(np.uint32), ref.view(np.uint32))
            isl.send(FinalAck(island=isl.island, generation=isl.generation, versions=tuple(versions)))
        for isl in islands:
            assert isl.expect(Shutdown).header.reason
        assert syncer.wait(30) == 0, syncer.log()

        found = CheckpointStore(ckpt).load_latest()
        assert found is not None
        snap = found[1]
        assert snap.next_round == 25 and [fs.version for fs in snap.fragments] == versions
        for f, fs in enumerate(snap.fragments):
            flat_v = np.concatenate([a.reshape(-1) for a in value[f]])
            flat_m = np.concatenate([a.reshape(-1) for a in mom[f]])
            assert np.array_equal(fs.value.numpy().view(np.uint32), flat_v.view(np.uint32))
            assert np.array_equal(fs.momentum.numpy().view(np.uint32), flat_m.view(np.uint32))
        lines = [json.loads(x) for x in events.read_text().splitlines()]
        commits = [e for e in lines if "fold_order" in e]  # (clamp and cap lines carry a round too)
        assert [e["round"] for e in commits] == list(range(1, 25))
        assert [e["flush"] for e in commits] == [False] * 20 + [True] * 4
        assert lines[-1]["summary"] == {"scheduled_rounds": 20, "committed_rounds": 24,
                                        "changed_in_training": 20, "changed_in_flush": 0}
        assert islands[0].parts_sent > P, "fragment 0 must travel as several parts"
        assert commits[6]["weights"]["1"] == 0 and commits[6]["pushed"] == [0, 1, 2]
        assert 1 not in commits[6]["fold_order"]  # a zero-weight push carries nothing to fold
        log = syncer.log()
        assert "UNAUTHENTICATED" in log and "status:" in log
        syncer.stop()

        # A new syncer resumed from the checkpoint welcomes islands with the same versions and cut.
        resumed = SyncerProc(tmp_path, ["--islands", "3", "--sync-every", "4", "--checkpoint-dir", str(ckpt), "--resume"])
        try:
            late = Island(ctx, resumed.endpoint, 1, schema=SHAPES)
            islands.append(late)
            late.send(Hello(protocol=PROTOCOL_VERSION, island=1, generation=late.generation, fingerprint="fp-integ",
                            n_fragments=P, wire_dtype="float32"))
            w = late.expect(Welcome).header
            assert w.need_init is False and w.versions == tuple(versions)
            for _ in range(P):
                m = late.expect(Bcast)
                assert m.header.cut and m.header.version == versions[m.header.fragment]
                for (_n, t), ref in zip(m.tensors, value[m.header.fragment]):
                    assert np.array_equal(t.numpy(), ref)
            # SIGTERM: checkpoint, then exit 130.
            before = sorted(p.name for p in ckpt.glob("ckpt-*"))
            resumed.proc.send_signal(signal.SIGTERM)
            assert resumed.wait(30) == 130, resumed.log()
            after = sorted(p.name for p in ckpt.glob("ckpt-*"))
            assert after[-1] > before[-1] and (ckpt / "latest").read_text().strip() == after[-1]
        finally:
            resumed.stop()
    finally:
        for isl in islands:
            isl.close()
        syncer.stop()
        ctx.term()

"""Every transition of the syncer state machine, driven directly with hand-built parted messages.

Messages go through the real codec and the data-plane work runs inline (``state_driver``).
Fragment 0 is three parts (part size 4096 elements), fragment 1 one part, so every push,
INIT and commit below is parted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import replace

import msgspec
import numpy as np
import pytest
import torch

from diloco.syncer.core import merge as commit_rules
from diloco.syncer.core.config import ConfigError, SyncerConfig
from diloco.syncer.core.coordinator import Coordinator
from diloco.syncer.store import FORMAT, CheckpointStore
from diloco.wire import PROTOCOL_VERSION, Error, Final, FinalAck, Heartbeat, Hello, Pull, Shutdown, Welcome

from state_driver import (  # noqa: E402
    Driver,
    bitwise,
    errors,
    flat,
    init_parts,
    kinds,
    of,
    push_parts,
    reference_commit,
    streams,
    unchecked,
)

pytestmark = pytest.mark.timeout(60)

FP = "f" * 16
E = 4096
CFG = SyncerConfig(
    islands=3, quorum=2, sync_every=4, quorum_timeout_s=10.0, grace_ms=100.0,
    dead_after_s=30.0, final_timeout_s=5.0, checkpoint_every=1, part_elems=E,
    outer_lr=0.7, outer_momentum=0.9,  # DiLoCo's Nesterov step: the references check the momentum path too
    max_gathering_rounds=2,  # rounds that gather side by side (the default, one, in test_core_tables)
)
# fragment 0: a (3,), b (2, 4100): 8203 elements, 3 parts; fragment 1: c (4,), 1 part.
# With H=4, P=2 round t opens when the 2nd fastest island reaches step 2t.
SCHEMA = [[("a", (3,)), ("b", (2, 4100))], [("c", (4,))]]
N_PARTS = [3, 1]
GEN = [100, 200, 300]


def peer(i: int) -> bytes:
    return bytes([i + 1]) * 5


def hello(i: int, gen: int, fp: str = FP, n: int = 2, dtype: str = "float32") -> Hello:
    return Hello(protocol=PROTOCOL_VERSION, island=i, generation=gen, fingerprint=fp, n_fragments=n, wire_dtype=dtype)


def init_values(f: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(f)
    return [(n, torch.randn(s, generator=g)) for n, s in SCHEMA[f]]


def inits(f: int, island: int = 0, gen: int = GEN[0], values: list | None = None) -> list:
    return init_parts(f, 2, init_values(f) if values is None else values, E, island=island, generation=gen)


def delta(f: int, seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [(n, (torch.randn(s, generator=g) * 0.01).to(dtype)) for n, s in SCHEMA[f]]


def pushes(i: int, rnd: int, f: int, attempt: int = 0, *, gen: int | None = None, base: int = 0, steps: int = 2,
           tokens: int = 10, tensors: list | None = None) -> list:
    return push_parts(i, GEN[i] if gen is None else gen, f, rnd, delta(f, i * 100 + rnd) if tensors is None else tensors,
                      E, attempt=attempt, base=base, steps=steps, tokens=tokens)


def hb(i: int, step: int, done: bool = False, gen: int | None = None) -> Heartbeat:
    return Heartbeat(island=i, generation=GEN[i] if gen is None else gen, step=step, done=done)


def started(cfg: SyncerConfig = CFG, dtype: str = "float32") -> Driver:
    d = Driver(cfg)
    for i in range(cfg.islands):
        d.send(peer(i), hello(i, GEN[i], dtype=dtype), now=0.0)
    d.send_all(peer(0), inits(0) + inits(1), 0.0)
    assert d.st.initialised
    for i in range(1, cfg.islands):  # a HELLO alone is not membership: islands heartbeat after WELCOME
        d.send(peer(i), hb(i, 0), now=0.0)
    return d


def open_round1(d: Driver, now: float = 1.0) -> list:
    """Islands 0 and 1 (K = 2) reach step 2: round 1 (fragment 0) opens."""
    return d.send(peer(0), hb(0, 2), now=now) + d.send(peer(1), hb(1, 2), now=now)


def value(d: Driver, f: int) -> np.ndarray:
    return d.st.fragments[f].value.numpy().copy()


def momentum(d: Driver, f: int) -> np.ndarray:
    """The fragment's momentum (zeros before the first commit allocates it)."""
    frag = d.st.fragments[f]
    return frag.momentum.numpy().copy() if frag.momentum is not None else np.zeros(frag.layout.numel, np.float32)


def check_commit(d: Driver, f: int, v0: np.ndarray, m0: np.ndarray, deltas: dict[int, list], event: dict) -> None:
    """The committed value and momentum equal the numpy reference folded in the event's order, bitwise."""
    weights = {int(k): w for k, w in event["weights"].items()}
    ref, mref = reference_commit(v0, m0, {i: flat(t).numpy() for i, t in deltas.items()}, weights,
                                 event["fold_order"], E)
    assert bitwise(value(d, f), ref) and bitwise(momentum(d, f), mref)


# ---------------------------------------------------------------- HELLO / INIT / cut


def test_hello_binds_and_fixes_fingerprint() -> None:
    d = Driver(CFG)
    out = d.send(peer(1), hello(1, 5))
    assert kinds(out) == ["Welcome"]
    w = out[0].header
    assert (w.need_init, w.syncer_id, w.versions, w.sync_every, w.part_elems) == (False, 7, (0, 0), 4, E)
    assert d.st.fingerprint == FP and d.st.islands[1].bound and d.st.islands[1].peer == peer(1)
    assert d.send(peer(0), hello(0, 6))[0].header.need_init is True
    assert errors(d.send(peer(2), hello(2, 1, fp="other"))) == ["fingerprint_mismatch"]
    assert errors(d.send(peer(2), hello(2, 1, n=3))) == ["fragments_mismatch"]
    assert errors(d.send(peer(2), hello(3, 1))) == ["unknown_island"]
    # The codec already refuses these two; the state machine checks them again on its own.
    assert errors(d.handle(peer(2), unchecked(hello(2, 1, dtype="float16")))) == ["bad_dtype"]
    assert errors(d.handle(peer(2), unchecked(msgspec.structs.replace(hello(2, 1), protocol=1)))) == ["protocol"]
    assert not d.st.islands[2].bound and d.st.refusals == 5


def test_init_only_from_island0_once_then_cut_to_everyone() -> None:
    d = Driver(CFG)
    for i in range(3):
        d.send(peer(i), hello(i, GEN[i]))
    assert errors(d.send_all(peer(1), inits(0, island=1, gen=GEN[1]))) == ["init_not_island0"] * 3
    out = d.send_all(peer(0), inits(0))
    # The cut overlaps INIT by fragment: fragment 0 goes to every island as soon as it holds its
    # value, while fragment 1 has none yet; nobody is given its whole cut (no round, no pull).
    first = streams(out)
    assert d.st.fragments[0].initialised and sorted((o.peer, o.fragment) for o in first) == \
        [(peer(i), 0) for i in range(3)]
    assert not any(i.cut_sent for i in d.st.islands)
    assert errors(d.send_all(peer(0), inits(0)[:1])) == ["duplicate_init"]
    out = d.send_all(peer(0), inits(1))
    cuts = first + streams(out)
    assert sorted((o.peer, o.fragment) for o in cuts) == sorted((peer(i), f) for i in range(3) for f in range(2))
    assert all(i.cut_sent for i in d.st.islands)
    assert all(o.cut and o.version == 0 and o.round == 0 and o.wire_dtype == "float32" for o in cuts)
    for f in range(2):  # the cut streams the fragment's flat value: the INIT values, no momentum buffer yet
        assert bitwise(d.st.fragments[f].value, flat(init_values(f)))
        assert d.st.fragments[f].momentum is None
    # A late island gets the cut at once; a re-join (new generation) gets it again.
    d2 = started()
    out = d2.send(peer(1), hello(1, 999), now=1.0)
    assert kinds(out) == ["Welcome", "BCAST", "BCAST"]
    assert errors(d2.send(peer(1), hb(1, 0), now=1.0)) == ["old_generation"]
    # A replayed HELLO of a replaced generation gets nothing at all, and changes nothing.
    assert d2.send(peer(1) + b"r", hello(1, GEN[1]), now=1.0) == []
    assert d2.st.islands[1].generation == 999 and d2.st.islands[1].peer == peer(1)


def test_init_parts_in_order_and_a_restart_from_part_0() -> None:
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    msgs = inits(0)
    # A part ahead of the next expected one means parts were lost: island 0 redials and resumes.
    assert errors(d.send(peer(0), *msgs[1])) == ["init_gap"]  # part 1 before part 0
    d.send(peer(0), *msgs[0])
    assert errors(d.send(peer(0), *msgs[2])) == ["init_gap"]  # part 2 skips part 1
    with_schema = msgspec.structs.replace(msgs[1][0], schema=msgs[0][0].schema)
    assert errors(d.send(peer(0), with_schema, msgs[1][1])) == ["bad_schema"]
    # A redialed island 0 streams INIT again from part 0: the partial stream is dropped,
    # including copies the data plane has not run yet.
    d.send(peer(0), *msgs[1], run=False)
    other = [(n, t + 1) for n, t in init_values(0)]
    d.send_all(peer(0), inits(0, values=other))
    assert d.st.fragments[0].initialised and bitwise(d.st.fragments[0].value, flat(other))


def test_init_schema_and_finiteness_checked(caplog) -> None:
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    bad = init_values(0)
    bad[1] = ("b", bad[1][1].clone())
    bad[1][1][1, 4099] = float("nan")  # in the last part
    with caplog.at_level(logging.WARNING, logger="diloco.syncer.core"):
        out = d.send_all(peer(0), inits(0, values=bad))
    assert errors(out) == ["bad_init"] and [o.peer for o in of(out, Error)] == [peer(0)]
    assert "NaN" in caplog.text and not d.st.fragments[0].initialised and d.st.fragments[0].value is None
    bf = [(n, t.bfloat16()) for n, t in init_values(0)]
    assert errors(d.send(peer(0), *inits(0, values=bf)[0])) == ["bad_part"]  # INIT is fp32
    msgs = inits(0)
    assert errors(d.send(peer(0), msgspec.structs.replace(msgs[0][0], schema=()), msgs[0][1])) == ["bad_schema"]
    renamed = [("z" if n == "a" else n, t) for n, t in msgs[0][1]]
    assert errors(d.send(peer(0), msgs[0][0], renamed)) == ["bad_part"]
    huge = msgspec.structs.replace(msgs[0][0], schema=(("a", (3,)), ("b", (1 << 20, 1 << 20))))
    assert errors(d.send(peer(0), huge, msgs[0][1])) == ["fragment_too_large"]
    assert not d.st.fragments[0].initialised
    d.send_all(peer(0), msgs)  # a good stream after all that
    assert d.st.fragments[0].initialised and bitwise(d.st.fragments[0].value, flat(init_values(0)))


# ---------------------------------------------------------------- rounds


def test_rounds_open_by_the_kth_fastest_island_and_pull_members() -> None:
    d = started()
    out = d.send(peer(0), hb(0, 2), now=1.0)
    assert [o.header for o in of(out, Heartbeat)] == [Heartbeat(syncer_id=7)]
    assert not of(out, Pull)  # only one island (< K = 2) has reached step 2
    out = d.send(peer(1), hb(1, 2), now=1.0)
    pulls = of(out, Pull)
    assert sorted(o.peer for o in pulls) == [peer(0), peer(1), peer(2)]
    assert all(o.header == Pull(fragment=0, round=1, attempt=0) for o in pulls)
    # The fastest island alone does not drive the clock: the 2nd fastest does.
    assert not of(d.send(peer(2), hb(2, 100), now=1.0), Pull)
    # The 2nd fastest at step 6 opens round 2 (fragment 1) but not round 3 (fragment 0 still open).
    out = d.send(peer(0), hb(0, 6), now=1.0)
    assert {o.header for o in of(out, Pull)} == {Pull(fragment=1, round=2, attempt=0)}
    assert sorted(d.st.rounds) == [1, 2] and d.st.roundbook.next_open == 3


def test_push_validation_refuses_without_state_change() -> None:
    d = started(replace(CFG, max_refusals=1000))  # eviction (a counted refusal) is tested apart
    open_round1(d)
    d.send(peer(2), hello(2, 301), now=1.0)  # island 2 reconnects: generation 300 retired
    before = value(d, 0)
    p0, s0 = pushes(1, 1, 0)[0]
    cases = {
        "unknown_round": pushes(1, 5, 0)[0],
        "wrong_fragment": pushes(1, 1, 1)[0],
        "stale_attempt": pushes(1, 1, 0, attempt=1)[0],
        "bad_base_version": pushes(1, 1, 0, base=1)[0],
        "old_generation": pushes(2, 1, 0)[0],
        "bad_counts": pushes(1, 1, 0, tokens=-1)[0],
        "unknown_island": (msgspec.structs.replace(p0, island=7), s0),
    }
    for code, msg in cases.items():
        assert errors(d.send(peer(1), *msg, now=1.0)) == [code], code
    # tokens weighting needs tokens > 0 once an island made local steps (no fallback to steps).
    assert errors(d.send(peer(1), *pushes(1, 1, 0, tokens=0)[0], now=1.0)) == ["bad_counts"]
    bad_parts = [
        (p0, [("b" if n == "a" else "a", t) for n, t in s0]),  # segment names
        (p0, [(n, t[:-1]) for n, t in s0]),  # segment lengths
        (p0, [(n, t.bfloat16()) for n, t in s0]),  # dtype of a float32 island
        (msgspec.structs.replace(p0, n_parts=2), s0),  # wrong part count
        pushes(1, 1, 0)[1],  # part 1 of a push that never started
        (msgspec.structs.replace(p0, local_steps=0, n_parts=0), s0),  # zero weight with tensors
    ]
    for msg in bad_parts:
        # Part 1 after a refused part 0 of the same attempt is dropped quietly (no ERROR storm).
        quiet = msg is bad_parts[4]
        assert errors(d.send(peer(1), *msg, now=1.0)) == ([] if quiet else ["bad_part"])
    r = d.st.rounds[1]
    assert r.pushes == {} and r.sum is None and r.attempt == 0 and not r.closed
    assert bitwise(value(d, 0), before) and d.st.versions() == (0, 0) and d.st.refusals == 13
    assert d.send_all(peer(1), pushes(1, 1, 0), now=1.0) == []
    assert errors(d.send(peer(1), *pushes(1, 1, 0)[0], now=1.0)) == ["duplicate_push"]
    assert list(d.st.rounds[1].pushes) == [1] and d.st.rounds[1].pushes[1].complete


def test_all_pushed_commits_now_with_reference_math_and_broadcast() -> None:
    d = started()
    open_round1(d)
    v0, m0 = value(d, 0), momentum(d, 0)
    tok = [5, 3, 7]
    deltas = {i: delta(0, i * 100 + 1) for i in range(3)}
    for i in (2, 0):
        assert not streams(d.send_all(peer(i), pushes(i, 1, 0, tokens=tok[i]), now=1.0))
    out = d.send_all(peer(1), pushes(1, 1, 0, tokens=tok[1]), now=1.0)  # third push: closes before the grace window
    b = streams(out)
    assert sorted(o.peer for o in b) == [peer(0), peer(1), peer(2)]
    assert {(o.fragment, o.version, o.round, o.cut, o.wire_dtype) for o in b} == {(0, 1, 1, False, "float32")}
    ev = d.st.events[-1]
    assert ev["fold_order"] == [2, 0, 1] and ev["weights"] == {"0": 5, "1": 3, "2": 7} and ev["changed"]
    check_commit(d, 0, v0, m0, deltas, ev)
    assert d.st.fragments[0].version == 1 and d.st.checkpoint_due and 1 not in d.st.rounds
    assert [d.st.islands[i].ledger.tokens for i in range(3)] == tok
    assert d.st.merged_summary()["changed_in_training"] == 1


def test_weights_equal_steps_and_zero_steps() -> None:
    for weighting, want in (("equal", {"0": 1, "1": 0, "2": 1}), ("steps", {"0": 3, "1": 0, "2": 1})):
        d = started(replace(CFG, weighting=weighting))
        open_round1(d)
        v0, m0 = value(d, 0), momentum(d, 0)
        d.send_all(peer(0), pushes(0, 1, 0, steps=3, tokens=99), now=1.0)
        zero = pushes(1, 1, 0, steps=0)
        assert len(zero) == 1 and zero[0][0].n_parts == 0 and zero[0][1] == []  # no tensors
        d.send_all(peer(1), zero, now=1.0)
        d.send_all(peer(2), pushes(2, 1, 0, steps=1, tokens=1), now=1.0)
        ev = d.st.events[-1]
        assert ev["weights"] == want and ev["fold_order"] == [0, 2], weighting
        check_commit(d, 0, v0, m0, {0: delta(0, 1), 2: delta(0, 201)}, ev)
    # Every push without local steps: the round commits and changes nothing.
    d = started()
    open_round1(d)
    v0 = value(d, 0)
    out = []
    for i in range(3):
        out += d.send_all(peer(i), pushes(i, 1, 0, steps=0, tokens=0), now=1.0)
    assert d.st.fragments[0].version == 0 and d.st.roundbook.next_commit == 2 and bitwise(value(d, 0), v0)
    assert not streams(out) and d.st.events[-1]["changed"] is False and d.st.events[-1]["fold_order"] == []
    assert d.st.merged_summary() == {"scheduled_rounds": 0, "committed_rounds": 1, "changed_in_training": 0,
                                     "changed_in_flush": 0}


def test_bf16_pushes_upcast_bitwise() -> None:
    d = Driver(CFG)
    for i in range(3):
        d.send(peer(i), hello(i, GEN[i], dtype="bfloat16"))
    out = d.send_all(peer(0), inits(0) + inits(1))
    assert {o.wire_dtype for o in streams(out)} == {"bfloat16"} and len(streams(out)) == 6
    for i in (1, 2):
        d.send(peer(i), hb(i, 0))
    open_round1(d)
    v0, m0 = value(d, 0), momentum(d, 0)
    deltas = {i: delta(0, i, torch.bfloat16) for i in range(3)}
    # A bf16 island's push must be bf16.
    assert errors(d.send(peer(0), *pushes(0, 1, 0, tensors=delta(0, 0))[0], now=1.0)) == ["bad_part"]
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0, tokens=3 + i, tensors=deltas[i]), now=1.0)
    ev = d.st.events[-1]
    assert ev["weights"] == {"0": 3, "1": 4, "2": 5}
    check_commit(d, 0, v0, m0, deltas, ev)


def test_quorum_grace_and_timeout_retry() -> None:
    d = started()
    open_round1(d)
    d.send_all(peer(0), pushes(0, 1, 0), now=1.0)
    assert not of(d.tick(5.0), Pull) and d.st.rounds[1].attempt == 0  # one push < K, before the timeout
    # Below K at the timeout: pushes dropped, attempt + 1 pulled from every live island.
    out = d.tick(11.5)
    assert {o.header for o in of(out, Pull)} == {Pull(fragment=0, round=1, attempt=1)} and len(of(out, Pull)) == 3
    assert d.st.rounds[1].pushes == {} and d.st.rounds[1].attempt == 1 and d.st.rounds[1].sum is None
    assert errors(d.send(peer(0), *pushes(0, 1, 0)[0], now=12.0)) == ["stale_attempt"]
    # K = 2 pushes: closes only after the grace window (100 ms).
    v0, m0 = value(d, 0), momentum(d, 0)
    d.send_all(peer(0), pushes(0, 1, 0, attempt=1), now=12.0)
    assert not streams(d.send_all(peer(2), pushes(2, 1, 0, attempt=1), now=12.0))
    assert not streams(d.tick(12.05))
    out = d.tick(12.11)
    assert {o.version for o in streams(out)} == {1}
    ev = d.st.events[-1]
    assert ev["pushed"] == [0, 2] and ev["attempt"] == 1 and ev["members"] == [0, 1, 2]
    check_commit(d, 0, v0, m0, {0: delta(0, 1), 2: delta(0, 201)}, ev)


def test_commits_strictly_in_round_order() -> None:
    d = started()
    d.send(peer(0), hb(0, 4), now=1.0)
    d.send(peer(1), hb(1, 4), now=1.0)  # opens rounds 1 (fragment 0) and 2 (fragment 1)
    assert sorted(d.st.rounds) == [1, 2]
    for i in range(3):
        assert not streams(d.send_all(peer(i), pushes(i, 2, 1), now=1.0))
    assert d.st.rounds[2].closed and d.st.fragments[1].version == 0  # waits for round 1
    out = []
    for i in range(3):
        out += d.send_all(peer(i), pushes(i, 1, 0), now=1.0)
    assert [(o.round, o.fragment) for o in streams(out)] == [(1, 0)] * 3 + [(2, 1)] * 3
    assert [e["round"] for e in d.st.events] == [1, 2]
    # Round 3 (fragment 0) opens only when the clock reaches step 6.
    assert 3 not in d.st.rounds
    d.send(peer(0), hb(0, 6), now=2.0)
    d.send(peer(2), hb(2, 6), now=2.0)
    assert 3 in d.st.rounds


def test_dead_island_leaves_live_set_and_reconnect_gets_pull_again() -> None:
    d = started()
    open_round1(d)
    # Island 1 reconnects under a new generation while round 1 is open: cut, then the same PULL.
    out = d.send(peer(1) + b"x", hello(1, 201), now=2.0)
    assert kinds(out) == ["Welcome", "BCAST", "BCAST", "Pull"]
    assert out[-1].header == Pull(fragment=0, round=1, attempt=0) and out[-1].peer == peer(1) + b"x"
    assert d.send_all(peer(1) + b"x", pushes(1, 1, 0, gen=201), now=2.0) == []
    # Past the quorum timeout the attempt is re-pulled from all live islands (island 1's push dropped).
    for p, i, g in ((peer(0), 0, GEN[0]), (peer(1) + b"x", 1, 201)):
        d.send(p, hb(i, 3, gen=g), now=12.0)
    r = d.st.rounds[1]
    assert sorted(r.members) == [0, 1, 2] and r.attempt == 1 and not r.pushes
    # Island 2 stays silent: declared dead, and the next attempt freezes only the live ones.
    out = d.tick(35.0)
    assert [i.island for i in d.st.live()] == [0, 1]
    assert sorted(d.st.rounds[1].members) == [0, 1] and d.st.rounds[1].attempt == 2
    # Pulls go to the routing id of each island's current connection.
    assert sorted(o.peer for o in of(out, Pull)) == [peer(0), peer(1) + b"x"]
    # A dead island that speaks again is live again and gets a fresh cut.
    out = d.send(peer(2), hb(2, 3), now=42.0)
    assert len(streams(out)) == 2 and all(o.cut for o in streams(out)) and d.st.islands[2].alive


def test_resume_from_checkpoint_round_trip(tmp_path) -> None:
    d = started()
    open_round1(d)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0), now=1.0)
    st = d.st
    store = CheckpointStore(tmp_path)
    path = store.save(st.snapshot())
    st.release_snapshot()
    assert (tmp_path / "latest").read_text().strip() == path.name
    assert json.loads((path / "manifest.json").read_text())["format"] == FORMAT == "yeto-syncer-checkpoint/3"
    # A torn newer checkpoint (no manifest) is skipped.
    (tmp_path / "ckpt-00000009").mkdir()
    found = store.load_latest()
    assert found is not None and found[0] == path
    d2 = Driver(CFG, syncer_id=8, snapshot=found[1])
    st2 = d2.st
    assert st2.versions() == (1, 0) and st2.roundbook.next_open == 2 and st2.fingerprint == FP and st2.initialised
    for f in range(2):
        assert bitwise(st.fragments[f].value, st2.fragments[f].value)
        assert bitwise(momentum(d, f), st2.fragments[f].momentum)  # zeros where no commit allocated one
        assert st2.fragments[f].schema == st.fragments[f].schema
    assert st2.islands[2].ledger.tokens == 10
    out = d2.send(peer(0), hello(0, 1))
    assert out[0].header.need_init is False and out[0].header.versions == (1, 0)
    assert errors(d2.send(peer(0), *inits(0, gen=1)[0])) == ["duplicate_init"]
    assert errors(d2.send(peer(1), hello(1, 2, fp="x"))) == ["fingerprint_mismatch"]
    # The resumed syncer carries on: round 2 (fragment 1) commits from the restored value.
    d2.send(peer(1), hello(1, 3))
    d2.send(peer(1), hb(1, 0, gen=3))  # a HELLO alone is not membership
    v0, m0 = value(d2, 1), momentum(d2, 1)
    d2.send(peer(0), hb(0, 4, gen=1), now=1.0)
    d2.send(peer(1), hb(1, 4, gen=3), now=1.0)
    assert 2 in st2.rounds and sorted(st2.rounds[2].members) == [0, 1]
    for i, g in ((0, 1), (1, 3)):
        d2.send_all(peer(i), pushes(i, 2, 1, gen=g), now=1.0)
    assert st2.versions() == (1, 1)
    check_commit(d2, 1, v0, m0, {0: delta(1, 2), 1: delta(1, 102)}, st2.events[-1])


def test_finalization_after_flush_rounds_acks_then_shutdown_and_timeout() -> None:
    d = started(replace(CFG, total_steps=2))
    assert d.st.scheduled_rounds == 1
    open_round1(d)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0), now=1.0)
    assert d.st.versions() == (1, 0)
    # Islands 0 and 1 are at the last step; island 2 says it is done: every island finished,
    # so one flush round per fragment opens (rounds 2 and 3), before any FINAL.
    out = d.send(peer(2), hb(2, 1, done=True), now=2.0)
    assert not streams(out, "FINAL") and d.st.phase == "running"
    assert {(o.header.round, o.header.fragment) for o in of(out, Pull)} == {(2, 0), (3, 1)}
    assert len(of(out, Pull)) == 6 and all(d.st.rounds[r].flush for r in (2, 3))
    out = []
    for i in range(3):
        out += d.send_all(peer(i), pushes(i, 2, 0, base=1, steps=0), now=2.0)
    # Island 2 merges its last local step of fragment 1 in the flush round.
    out += d.send_all(peer(0), pushes(0, 3, 1, steps=0), now=2.0)
    out += d.send_all(peer(1), pushes(1, 3, 1, steps=0), now=2.0)
    assert not streams(out, "FINAL")
    out = d.send_all(peer(2), pushes(2, 3, 1, steps=1, tokens=4), now=2.0)
    # The flush commit of fragment 1 goes at once to island 2, the one that said done (its digest
    # is taken as it lands), so island 2's final cut names that fragment in a held notice; islands
    # 0 and 1 only reached the last step and get every fragment's bytes.
    bcasts = streams(out, "BCAST")
    assert [(o.peer, o.fragment, o.version, o.wire_dtype) for o in bcasts] == [(peer(2), 1, 1, "float32")]
    held = [o.header for o in of(out, Final)]
    assert [(h.fragment, h.version, h.held) for h in held] == [(1, 1, True)]
    finals = streams(out, "FINAL")
    assert len(finals) == 5 and all(o.wire_dtype == "float32" for o in finals)
    assert (peer(2), 1) not in {(o.peer, o.fragment) for o in finals}
    assert {o.versions for o in finals} == {(1, 1)} and d.st.phase == "final"
    assert [e["flush"] for e in d.st.events if "round" in e] == [False, True, True]
    assert d.st.events[-1] == {"time": 2.0, "summary": {"scheduled_rounds": 1, "committed_rounds": 3,
                                                         "changed_in_training": 1, "changed_in_flush": 1}}
    assert errors(d.send(peer(0), FinalAck(island=0, generation=GEN[0], versions=(0, 0)), now=2.0)) == ["bad_versions"]
    for i in range(3):
        out = d.send(peer(i), FinalAck(island=i, generation=GEN[i], versions=(1, 1)), now=2.0)
    assert len(of(out, Shutdown)) == 3 and d.st.finished and d.st.exit_code == 0 and d.st.checkpoint_due
    # Timeout: one island never acks -> exit code 1.
    d = started(replace(CFG, total_steps=1))
    out = []
    for i in range(3):
        out += d.send(peer(i), hb(i, 1, done=True), now=1.0)
    assert d.st.phase == "running" and sorted(d.st.rounds) == [1, 2] and d.st.scheduled_rounds == 0
    for i in range(3):
        for r, f in ((1, 0), (2, 1)):
            d.send_all(peer(i), pushes(i, r, f, steps=0), now=1.0)
    assert d.st.phase == "final"
    d.send(peer(0), FinalAck(island=0, generation=GEN[0], versions=(0, 0)), now=1.0)
    out = d.tick(7.0)
    assert d.st.finished and d.st.exit_code == 1 and len(of(out, Shutdown)) == 3


def test_refusal_is_logged_one_line(caplog) -> None:
    d = started()
    with caplog.at_level(logging.WARNING, logger="diloco.syncer.core"):
        d.send(peer(1), *pushes(1, 9, 0)[0], now=1.0)
    assert len(caplog.records) == 1 and "unknown_round" in caplog.text and "round 9" in caplog.text


def test_config_errors_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="--quorum"):
        SyncerConfig(islands=2, quorum=3)
    with pytest.raises(ConfigError, match="--outer-momentum"):
        SyncerConfig(islands=2, outer_momentum=1.0)
    with pytest.raises(ConfigError, match="--weighting"):
        SyncerConfig(islands=2, weighting="loss")
    with pytest.raises(ConfigError, match="--flush-merge"):
        SyncerConfig(islands=2, flush_merge="median")
    with pytest.raises(ConfigError, match="--part-mib"):
        SyncerConfig(islands=2, part_elems=1000)
    with pytest.raises(ConfigError, match="--part-mib"):
        SyncerConfig(islands=2, part_elems=64 << 20)  # 256 MiB parts
    with pytest.raises(ConfigError, match="--max-fragment-gib"):
        SyncerConfig(islands=2, max_fragment_bytes=0)


def test_snapshot_stays_consistent_while_fragments_commit(monkeypatch) -> None:
    """A background checkpoint shares tensors with the state. A commit with momentum (which it
    updates in place) whose new momentum would not fit the memory budget beside the pinned one
    (``--max-open-rounds 1``) waits until the writer has written its fragment (``unpin``); past
    ``commit.PIN_WAIT_S`` it writes the new momentum beside the pinned one."""
    monkeypatch.setattr(commit_rules, "PIN_WAIT_S", 5.0)
    d = started(dataclasses.replace(CFG, max_open_rounds=1, max_gathering_rounds=1))
    st = d.st
    open_round1(d)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, 0), now=1.0)
    d.send(peer(0), hb(0, 4), now=2.0)
    d.send(peer(1), hb(1, 4), now=2.0)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 2, 1), now=2.0)
    assert st.versions() == (1, 1) and all(f.momentum is not None for f in st.fragments)
    snap = st.snapshot()
    value_at = snap.fragments[0].value.clone()
    momentum_at = snap.fragments[0].momentum.clone()
    v0, m0 = value(d, 0), momentum(d, 0)
    d.send(peer(0), hb(0, 6), now=3.0)
    d.send(peer(1), hb(1, 6), now=3.0)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 3, 0, base=1), now=3.0)
    assert st.versions() == (1, 1) and st.rounds[3].closed and not st.rounds[3].committing  # waits
    d.tick(6.0)
    assert st.versions() == (1, 1)
    d.tick(8.5)  # past PIN_WAIT_S: committed beside the pinned momentum
    assert st.versions() == (2, 1)
    check_commit(d, 0, v0, m0, {i: delta(0, i * 100 + 3) for i in range(3)}, st.events[-1])
    # The state moved on (value and momentum written beside the pinned ones), the snapshot did not.
    assert st.fragments[0].value is not snap.fragments[0].value
    assert st.fragments[0].momentum is not snap.fragments[0].momentum
    assert not torch.equal(st.fragments[0].value, value_at) and not torch.equal(st.fragments[0].momentum, momentum_at)
    assert torch.equal(snap.fragments[0].value, value_at) and torch.equal(snap.fragments[0].momentum, momentum_at)
    # Fragment 1 is still pinned, but it is small: its new momentum fits the budget beside the pinned
    # one (the budget holds one sum of the largest fragment), so its commit does not wait.
    mom = st.fragments[1].momentum
    held = snap.fragments[1]
    held_at = held.momentum.clone()
    assert held.momentum is mom
    del snap  # the writer has written fragment 0 and let go of it (while held, round 4 could not open)
    st.unpin({0})
    d.send(peer(0), hb(0, 8), now=9.0)
    d.send(peer(1), hb(1, 8), now=9.0)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 4, 1, base=1), now=9.0)
    assert st.versions() == (2, 2) and st.fragments[1].momentum is not mom
    assert torch.equal(held.momentum, held_at)
    assert st.book.live_bytes <= st.book.limit_bytes()


def test_finalization_waits_for_islands_that_never_joined() -> None:
    """A fast island must not finish the run before a slow one has even connected."""
    d = Driver(replace(CFG, total_steps=1, join_timeout_s=50.0))
    d.send(peer(0), hello(0, GEN[0]))
    d.send_all(peer(0), inits(0) + inits(1))
    d.send(peer(1), hello(1, GEN[1]))
    for i in range(2):
        d.send(peer(i), hb(i, 1, done=True), now=1.0)
    for i in range(2):  # the flush rounds (nothing left to merge)
        for r, f in ((1, 0), (2, 1)):
            d.send_all(peer(i), pushes(i, r, f, steps=0), now=1.0)
    assert not d.st.rounds and d.st.final.flush_left == set()
    assert d.st.phase == "running" and not streams(d.tick(10.0), "FINAL")  # island 2 has not joined yet
    out = d.send(peer(2), hello(2, GEN[2]), now=11.0)
    assert streams(out)  # it gets its cut and joins the run
    assert not streams(d.tick(12.0), "FINAL")  # ... and now finalization waits for it to be done
    out = d.send(peer(2), hb(2, 1, done=True), now=13.0)
    assert d.st.phase == "final" and len({o.peer for o in streams(out, "FINAL")}) == 3
    # An island that never comes: finalize without it once the join timeout has passed.
    d = Driver(replace(CFG, total_steps=1, join_timeout_s=50.0))
    d.send(peer(0), hello(0, GEN[0]))
    d.send_all(peer(0), inits(0) + inits(1))
    d.send(peer(0), hb(0, 1, done=True), now=1.0)
    for r, f in ((1, 0), (2, 1)):  # flush rounds of island 0 alone
        d.send_all(peer(0), pushes(0, r, f, steps=0), now=1.0)
    d.send(peer(0), hb(0, 1, done=True), now=29.0)  # island 0 stays alive (dead after 30 s of silence)
    assert not streams(d.tick(49.0), "FINAL")
    out = d.send(peer(0), hb(0, 1, done=True), now=50.5)
    assert d.st.phase == "final" and {o.peer for o in streams(out, "FINAL")} == {peer(0)}


def test_state_without_fragments_refuses_checkpoint() -> None:
    st = Coordinator(CFG, syncer_id=7)
    with pytest.raises(RuntimeError):
        st.snapshot()
    assert isinstance(Driver(CFG).send(peer(0), hello(0, 1))[0].header, Welcome)

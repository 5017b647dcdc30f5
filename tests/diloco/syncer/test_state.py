"""Every transition of the syncer state machine, driven directly with hand-built messages."""

from __future__ import annotations

import logging
from dataclasses import replace

import msgspec
import numpy as np
import pytest
import torch

from diloco.syncer.config import ConfigError, SyncerConfig
from diloco.syncer.records import Outgoing
from diloco.syncer.state import SyncerState
from diloco.syncer.store import CheckpointStore
from diloco.wire import (
    Bcast,
    Error,
    Final,
    FinalAck,
    Heartbeat,
    Hello,
    Init,
    Message,
    Pull,
    Push,
    Shutdown,
    Welcome,
)

from syncer_harness import reference_step  # noqa: E402

pytestmark = pytest.mark.timeout(60)

FP = "f" * 16
CFG = SyncerConfig(
    islands=3, quorum=2, sync_every=4, quorum_timeout_s=10.0, grace_ms=100.0,
    dead_after_s=30.0, final_timeout_s=5.0, checkpoint_every=1,
)
# fragment 0: a (3,), b (2, 2); fragment 1: c (4,). With H=4, P=2 round t opens at step 2t.
SCHEMA = [[("a", (3,)), ("b", (2, 2))], [("c", (4,))]]
GEN = [100, 200, 300]


def peer(i: int) -> bytes:
    return bytes([i + 1]) * 5


def hello(i: int, gen: int, fp: str = FP, n: int = 2, dtype: str = "float32") -> Message:
    return Message(Hello(protocol=1, island=i, generation=gen, fingerprint=fp, n_fragments=n, wire_dtype=dtype), [])


def init_values(f: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(f)
    return [(n, torch.randn(s, generator=g)) for n, s in SCHEMA[f]]


def init(f: int, island: int = 0, gen: int = GEN[0]) -> Message:
    return Message(Init(island=island, generation=gen, fragment=f, n_fragments=2), init_values(f))


def delta(f: int, seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [(n, (torch.randn(s, generator=g) * 0.01).to(dtype)) for n, s in SCHEMA[f]]


def push(i: int, rnd: int, f: int, attempt: int = 0, *, gen: int | None = None, base: int = 0,
         steps: int = 2, tokens: int = 10, tensors: list[tuple[str, torch.Tensor]] | None = None) -> Message:
    h = Push(island=i, generation=GEN[i] if gen is None else gen, fragment=f, round=rnd, attempt=attempt,
             base_version=base, local_steps=steps, tokens=tokens)
    return Message(h, delta(f, i * 100 + rnd) if tensors is None else tensors)


def hb(i: int, step: int, done: bool = False, gen: int | None = None) -> Message:
    return Message(Heartbeat(island=i, generation=GEN[i] if gen is None else gen, step=step, done=done), [])


def of(out: list[Outgoing], kind: type) -> list[Outgoing]:
    return [o for o in out if isinstance(o.header, kind)]


def errors(out: list[Outgoing]) -> list[str]:
    return [o.header.code for o in of(out, Error)]


def started(cfg: SyncerConfig = CFG) -> SyncerState:
    st = SyncerState(cfg, syncer_id=7)
    for i in range(cfg.islands):
        st.handle(peer(i), hello(i, GEN[i]), 0.0)
    st.handle(peer(0), init(0), 0.0)
    st.handle(peer(0), init(1), 0.0)
    return st


def values(st: SyncerState, f: int) -> list[np.ndarray]:
    return [v.numpy().copy() for v in st.fragments[f].values]


reference = reference_step  # the PROTOCOL.md commit formula in numpy (syncer_harness)


# ---------------------------------------------------------------- HELLO / INIT / cut


def test_hello_binds_and_fixes_fingerprint() -> None:
    st = SyncerState(CFG, syncer_id=7)
    out = st.handle(peer(1), hello(1, 5), 0.0)
    assert [type(o.header) for o in out] == [Welcome]
    w = out[0].header
    assert (w.need_init, w.syncer_id, w.versions, w.sync_every) == (False, 7, (0, 0), 4)
    assert st.fingerprint == FP and st.islands[1].bound and st.islands[1].peer == peer(1)
    assert st.handle(peer(0), hello(0, 6), 0.0)[0].header.need_init is True
    assert errors(st.handle(peer(2), hello(2, 1, fp="other"), 0.0)) == ["fingerprint_mismatch"]
    assert errors(st.handle(peer(2), hello(2, 1, n=3), 0.0)) == ["fragments_mismatch"]
    assert errors(st.handle(peer(2), hello(3, 1), 0.0)) == ["unknown_island"]
    assert errors(st.handle(peer(2), hello(2, 1, dtype="float16"), 0.0)) == ["bad_dtype"]
    assert not st.islands[2].bound and st.refusals == 4


def test_init_only_from_island0_once_then_cut_to_everyone() -> None:
    st = SyncerState(CFG, syncer_id=7)
    for i in range(3):
        st.handle(peer(i), hello(i, GEN[i]), 0.0)
    assert errors(st.handle(peer(1), init(0, island=1, gen=GEN[1]), 0.0)) == ["init_not_island0"]
    out = st.handle(peer(0), init(0), 0.0)
    assert not of(out, Bcast)  # not every fragment has values yet
    assert errors(st.handle(peer(0), init(0), 0.0)) == ["duplicate_init"]
    out = st.handle(peer(0), init(1), 0.0)
    cuts = of(out, Bcast)
    assert sorted((o.peer, o.header.fragment) for o in cuts) == sorted((peer(i), f) for i in range(3) for f in range(2))
    assert all(o.header.cut and o.header.version == 0 for o in cuts)
    assert torch.equal(cuts[0].tensors[0][1], init_values(cuts[0].header.fragment)[0][1])
    # A late island gets the cut at once; a re-join (new generation) gets it again.
    st2 = started()
    out = st2.handle(peer(1), hello(1, 999), 1.0)
    assert [type(o.header) for o in out] == [Welcome, Bcast, Bcast]
    assert errors(st2.handle(peer(1), hb(1, 0), 1.0)) == ["old_generation"]
    assert errors(st2.handle(peer(1), hello(1, GEN[1]), 1.0)) == ["old_generation"]


def test_init_schema_and_finiteness_checked() -> None:
    st = SyncerState(CFG, syncer_id=7)
    st.handle(peer(0), hello(0, GEN[0]), 0.0)
    bad = init_values(0)
    bad[0] = ("a", torch.tensor([1.0, float("nan"), 0.0]))
    assert errors(st.handle(peer(0), Message(Init(island=0, generation=GEN[0], fragment=0, n_fragments=2), bad), 0.0)) == ["not_finite"]
    bf = [(n, t.bfloat16()) for n, t in init_values(0)]
    assert errors(st.handle(peer(0), Message(Init(island=0, generation=GEN[0], fragment=0, n_fragments=2), bf), 0.0)) == ["bad_dtype"]
    assert not st.fragments[0].initialised


# ---------------------------------------------------------------- rounds


def test_rounds_open_by_step_threshold_and_pull_members() -> None:
    st = started()
    assert not of(st.handle(peer(0), hb(0, 1), 1.0), Pull)
    out = st.handle(peer(0), hb(0, 2), 1.0)
    assert [o.header for o in of(out, Heartbeat)] == [Heartbeat(syncer_id=7)]
    pulls = of(out, Pull)
    assert sorted(o.peer for o in pulls) == [peer(0), peer(1), peer(2)]
    assert all(o.header == Pull(fragment=0, round=1, attempt=0) for o in pulls)
    # A jump to step 6 opens round 2 (fragment 1) but not round 3 (fragment 0 still open).
    out = st.handle(peer(1), hb(1, 6), 1.0)
    assert {o.header for o in of(out, Pull)} == {Pull(fragment=1, round=2, attempt=0)}
    assert sorted(st.rounds) == [1, 2] and st.next_open == 3


def test_push_validation_refuses_without_state_change() -> None:
    st = started()
    st.handle(peer(0), hb(0, 2), 1.0)
    before = values(st, 0)
    cases = {
        "unknown_round": push(1, 5, 0),
        "wrong_fragment": push(1, 1, 1),
        "stale_attempt": push(1, 1, 0, attempt=1),
        "bad_base_version": push(1, 1, 0, base=1),
        "old_generation": None,
        "bad_schema": push(1, 1, 0, tensors=[("a", torch.zeros(3)), ("b", torch.zeros(4))]),
        "bad_dtype": push(1, 1, 0, tensors=[(n, t.bfloat16()) for n, t in delta(0, 1)]),
        "not_finite": push(1, 1, 0, tensors=[("a", torch.tensor([0.0, float("inf"), 0.0])), ("b", torch.zeros(2, 2))]),
        "bad_counts": push(1, 1, 0, tokens=-1),
        "unknown_island": Message(msgspec.structs.replace(push(1, 1, 0).header, island=7), delta(0, 1)),
    }
    names = push(1, 1, 0, tensors=[("b", torch.zeros(2, 2)), ("a", torch.zeros(3))])
    st.handle(peer(2), hello(2, 301), 1.0)  # island 2 reconnects: generation 300 retired
    cases["old_generation"] = push(2, 1, 0)
    for code, msg in cases.items():
        assert errors(st.handle(peer(1), msg, 1.0)) == [code], code
    assert errors(st.handle(peer(1), names, 1.0)) == ["bad_schema"]
    r = st.rounds[1]
    assert r.pushes == {} and r.attempt == 0 and not r.closed
    assert all(np.array_equal(a, b) for a, b in zip(before, values(st, 0)))
    assert st.handle(peer(1), push(1, 1, 0), 1.0) == []
    assert errors(st.handle(peer(1), push(1, 1, 0), 1.0)) == ["duplicate_push"]
    assert list(st.rounds[1].pushes) == [1]


def test_all_pushed_commits_now_with_reference_math_and_broadcast() -> None:
    st = started()
    st.handle(peer(0), hb(0, 2), 1.0)
    v0 = values(st, 0)
    tok = [5, 0, 7]
    msgs = [push(i, 1, 0, tokens=tok[i]) for i in range(3)]
    for i in (2, 0):
        assert not of(st.handle(peer(i), msgs[i], 1.0), Bcast)
    out = st.handle(peer(1), msgs[1], 1.0)  # third push: closes before the grace window
    b = of(out, Bcast)
    assert sorted(o.peer for o in b) == [peer(0), peer(1), peer(2)]
    assert all(o.header == Bcast(fragment=0, version=1, round=1, cut=False) for o in b)
    assert len({o.cache_key for o in b}) == 1
    for j in range(2):
        ref, mref = reference(v0[j], np.zeros_like(v0[j]), [m.tensors[j][1].numpy() for m in msgs], tok)
        assert np.array_equal(values(st, 0)[j], ref) and np.array_equal(st.fragments[0].momentum[j].numpy(), mref)
        assert np.array_equal(b[0].tensors[j][1].numpy(), ref)
    assert st.fragments[0].version == 1 and st.checkpoint_due and 1 not in st.rounds
    assert [st.islands[i].ledger.tokens for i in range(3)] == tok
    assert st.events[-1]["weights"] == {"0": 5, "1": 0, "2": 7}


def test_weights_equal_and_zero_steps() -> None:
    st = started(replace(CFG, weighting="equal"))
    st.handle(peer(0), hb(0, 2), 1.0)
    v0 = values(st, 0)
    msgs = [push(0, 1, 0, steps=3, tokens=99), push(1, 1, 0, steps=0), push(2, 1, 0, steps=1, tokens=1)]
    for i in range(3):
        st.handle(peer(i), msgs[i], 1.0)
    ref, _ = reference(v0[0], np.zeros_like(v0[0]), [msgs[0].tensors[0][1].numpy(), msgs[2].tensors[0][1].numpy()], [1, 1])
    assert np.array_equal(values(st, 0)[0], ref)
    assert st.events[-1]["weights"] == {"0": 1, "1": 0, "2": 1}
    # tokens weighting with all tokens 0 falls back to equal; all steps 0 commits nothing.
    st = started()
    st.handle(peer(0), hb(0, 2), 1.0)
    for i in range(3):
        st.handle(peer(i), push(i, 1, 0, steps=0, tokens=0), 1.0)
    assert st.fragments[0].version == 0 and st.next_commit == 2 and values(st, 0)[0].tolist() == v0[0].tolist()


def test_bf16_pushes_upcast_bitwise() -> None:
    st = SyncerState(CFG, syncer_id=7)
    for i in range(3):
        st.handle(peer(i), hello(i, GEN[i], dtype="bfloat16"), 0.0)
    out = st.handle(peer(0), init(0), 0.0) + st.handle(peer(0), init(1), 0.0)
    assert {o.wire_dtype for o in of(out, Bcast)} == {"bfloat16"}
    st.handle(peer(0), hb(0, 2), 1.0)
    v0 = values(st, 0)
    msgs = [push(i, 1, 0, tokens=3 + i, tensors=delta(0, i, torch.bfloat16)) for i in range(3)]
    for i in range(3):
        st.handle(peer(i), msgs[i], 1.0)
    ref, _ = reference(v0[1], np.zeros_like(v0[1]), [m.tensors[1][1].float().numpy() for m in msgs], [3, 4, 5])
    assert np.array_equal(values(st, 0)[1], ref)


def test_quorum_grace_and_timeout_retry() -> None:
    st = started()
    st.handle(peer(0), hb(0, 2), 1.0)
    st.handle(peer(0), push(0, 1, 0), 1.0)
    assert not of(st.tick(5.0), Pull) and st.rounds[1].attempt == 0  # one push < K, before the timeout
    # Below K at the timeout: pushes dropped, attempt + 1 pulled from every live island.
    out = st.tick(11.5)
    assert {o.header for o in of(out, Pull)} == {Pull(fragment=0, round=1, attempt=1)}
    assert st.rounds[1].pushes == {} and st.rounds[1].attempt == 1
    assert errors(st.handle(peer(0), push(0, 1, 0), 12.0)) == ["stale_attempt"]
    # K = 2 pushes: closes only after the grace window (100 ms).
    st.handle(peer(0), push(0, 1, 0, attempt=1), 12.0)
    assert not of(st.handle(peer(2), push(2, 1, 0, attempt=1), 12.0), Bcast)
    assert not of(st.tick(12.05), Bcast)
    out = st.tick(12.11)
    assert {o.header.version for o in of(out, Bcast)} == {1}
    assert st.events[-1]["pushed"] == [0, 2] and st.events[-1]["attempt"] == 1


def test_commits_strictly_in_round_order() -> None:
    st = started()
    st.handle(peer(0), hb(0, 4), 1.0)  # opens rounds 1 (fragment 0) and 2 (fragment 1)
    for i in range(3):
        assert not of(st.handle(peer(i), push(i, 2, 1), 1.0), Bcast)
    assert st.rounds[2].closed and st.fragments[1].version == 0  # waits for round 1
    out = []
    for i in range(3):
        out += st.handle(peer(i), push(i, 1, 0), 1.0)
    assert [(o.header.round, o.header.fragment) for o in of(out, Bcast)] == [(1, 0)] * 3 + [(2, 1)] * 3
    assert [e["round"] for e in st.events] == [1, 2]
    # Round 3 (fragment 0) opens only now that round 1 is committed.
    assert st.handle(peer(0), hb(0, 6), 2.0) and 3 in st.rounds


def test_dead_island_leaves_live_set_and_reconnect_gets_pull_again() -> None:
    st = started()
    st.handle(peer(0), hb(0, 2), 1.0)
    # Island 1 reconnects under a new generation while round 1 is open: cut, then the same PULL.
    out = st.handle(peer(1) + b"x", hello(1, 201), 2.0)
    assert [type(o.header) for o in out] == [Welcome, Bcast, Bcast, Pull]
    assert out[-1].header == Pull(fragment=0, round=1, attempt=0) and out[-1].peer == peer(1) + b"x"
    assert st.handle(peer(1), push(1, 1, 0, gen=201), 2.0) == []
    # Past the quorum timeout the attempt is re-pulled from all live islands (island 1's push dropped).
    for i, g in ((0, GEN[0]), (1, 201)):
        st.handle(peer(i), hb(i, 3, gen=g), 12.0)
    assert sorted(st.rounds[1].members) == [0, 1, 2] and st.rounds[1].attempt == 1 and not st.rounds[1].pushes
    # Island 2 stays silent: declared dead, and the next attempt freezes only the live ones.
    out = st.tick(35.0)
    assert [i.island for i in st.live()] == [0, 1]
    assert sorted(st.rounds[1].members) == [0, 1] and st.rounds[1].attempt == 2
    assert sorted(o.peer for o in of(out, Pull)) == [peer(0), peer(1)]  # heartbeats re-route
    # A dead island that speaks again is live again and gets a fresh cut.
    out = st.handle(peer(2), hb(2, 3), 42.0)
    assert len(of(out, Bcast)) == 2 and st.islands[2].alive


def test_resume_from_checkpoint_round_trip(tmp_path) -> None:
    st = started()
    st.handle(peer(0), hb(0, 2), 1.0)
    for i in range(3):
        st.handle(peer(i), push(i, 1, 0), 1.0)
    store = CheckpointStore(tmp_path)
    path = store.save(st.snapshot())
    assert (tmp_path / "latest").read_text().strip() == path.name
    # A torn newer checkpoint (no manifest) is skipped.
    (tmp_path / "ckpt-00000009").mkdir()
    found = store.load_latest()
    assert found is not None and found[0] == path
    st2 = SyncerState(CFG, syncer_id=8, snapshot=found[1])
    assert st2.versions() == (1, 0) and st2.next_open == 2 and st2.fingerprint == FP
    for a, b in zip(st.fragments[0].values + st.fragments[0].momentum, st2.fragments[0].values + st2.fragments[0].momentum):
        assert torch.equal(a, b)
    assert st2.islands[2].ledger.tokens == 10
    out = st2.handle(peer(0), hello(0, 1), 0.0)
    assert out[0].header.need_init is False and out[0].header.versions == (1, 0)
    assert errors(st2.handle(peer(0), init(0, gen=1), 0.0)) == ["duplicate_init"]
    assert errors(st2.handle(peer(1), hello(1, 2, fp="x"), 0.0)) == ["fingerprint_mismatch"]


def test_finalization_acks_then_shutdown_and_timeout() -> None:
    st = started(replace(CFG, total_steps=2))
    st.handle(peer(0), hb(0, 2), 1.0)
    for i in range(3):
        st.handle(peer(i), push(i, 1, 0), 1.0)
    st.handle(peer(1), hb(1, 2), 2.0)
    out = st.handle(peer(2), hb(2, 1, done=True), 2.0)
    finals = of(out, Final)
    assert len(finals) == 6 and all(o.wire_dtype == "float32" for o in finals)
    assert {o.header.versions for o in finals} == {(1, 0)} and st.phase == "final"
    assert errors(st.handle(peer(0), Message(FinalAck(island=0, generation=GEN[0], versions=(0, 0)), []), 2.0)) == ["bad_versions"]
    for i in range(3):
        out = st.handle(peer(i), Message(FinalAck(island=i, generation=GEN[i], versions=(1, 0)), []), 2.0)
    assert len(of(out, Shutdown)) == 3 and st.finished and st.exit_code == 0 and st.checkpoint_due
    # Timeout: one island never acks -> exit code 1.
    st = started(replace(CFG, total_steps=1))
    for i in range(3):
        st.handle(peer(i), hb(i, 1, done=True), 1.0)
    assert st.phase == "final"
    st.handle(peer(0), Message(FinalAck(island=0, generation=GEN[0], versions=(0, 0)), []), 1.0)
    out = st.tick(7.0)
    assert st.finished and st.exit_code == 1 and len(of(out, Shutdown)) == 3


def test_refusal_is_logged_one_line(caplog) -> None:
    st = started()
    with caplog.at_level(logging.WARNING, logger="diloco.syncer.state"):
        st.handle(peer(1), push(1, 9, 0), 1.0)
    assert len(caplog.records) == 1 and "unknown_round" in caplog.text and "round 9" in caplog.text


def test_config_errors_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="--quorum"):
        SyncerConfig(islands=2, quorum=3)
    with pytest.raises(ConfigError, match="--outer-momentum"):
        SyncerConfig(islands=2, outer_momentum=1.0)
    with pytest.raises(ConfigError, match="--weighting"):
        SyncerConfig(islands=2, weighting="loss")


def test_snapshot_stays_consistent_while_fragments_commit() -> None:
    """A background checkpoint shares tensors with the state: commits must not change it."""
    st = started()
    snap = st.snapshot()
    values_at = [t.clone() for t in snap.fragments[0].values]
    momentum_at = [t.clone() for t in snap.fragments[0].momentum]
    st.handle(peer(0), hb(0, 2), 1.0)
    for i in range(3):
        st.handle(peer(i), push(i, 1, 0), 1.0)
    assert st.fragments[0].version == 1
    # The state moved on (values and momentum), the snapshot did not.
    assert not torch.equal(st.fragments[0].values[0], values_at[0])
    assert not torch.equal(st.fragments[0].momentum[0], momentum_at[0])
    for t, ref in zip(snap.fragments[0].values, values_at):
        assert torch.equal(t, ref)
    for t, ref in zip(snap.fragments[0].momentum, momentum_at):
        assert torch.equal(t, ref)
    # Only the committed fragment was copied; released pins let commits work in place again.
    assert snap.fragments[1].momentum[0] is st.fragments[1].momentum[0]
    st.release_snapshot()
    mom = st.fragments[1].momentum[0]
    st.handle(peer(0), hb(0, 4), 2.0)
    for i in range(3):
        st.handle(peer(i), push(i, 2, 1), 2.0)
    assert st.fragments[1].version == 1 and st.fragments[1].momentum[0] is mom


def test_finalization_waits_for_islands_that_never_joined() -> None:
    """A fast island must not finish the run before a slow one has even connected."""
    st = SyncerState(replace(CFG, total_steps=1, join_timeout_s=50.0), syncer_id=7)
    st.handle(peer(0), hello(0, GEN[0]), 0.0)
    st.handle(peer(0), init(0), 0.0)
    st.handle(peer(0), init(1), 0.0)
    st.handle(peer(1), hello(1, GEN[1]), 0.0)
    for i in range(2):
        st.handle(peer(i), hb(i, 1, done=True), 1.0)
    assert st.phase == "running" and not of(st.tick(10.0), Final)  # island 2 has not joined yet
    out = st.handle(peer(2), hello(2, GEN[2]), 11.0)
    assert of(out, Bcast)  # it gets its cut and joins the run
    assert not of(st.tick(12.0), Final)  # ... and now finalization waits for it to be done
    out = st.handle(peer(2), hb(2, 1, done=True), 13.0)
    assert st.phase == "final" and len({o.peer for o in of(out, Final)}) == 3
    # An island that never comes: finalize without it once the join timeout has passed.
    st = SyncerState(replace(CFG, total_steps=1, join_timeout_s=50.0), syncer_id=7)
    st.handle(peer(0), hello(0, GEN[0]), 0.0)
    st.handle(peer(0), init(0), 0.0)
    st.handle(peer(0), init(1), 0.0)
    st.handle(peer(0), hb(0, 1, done=True), 1.0)
    st.handle(peer(0), hb(0, 1, done=True), 29.0)  # island 0 stays alive (dead after 30 s of silence)
    assert not of(st.tick(49.0), Final)
    out = st.handle(peer(0), hb(0, 1, done=True), 50.5)
    assert st.phase == "final" and {o.peer for o in of(out, Final)} == {peer(0)}

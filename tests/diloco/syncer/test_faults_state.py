"""Fault rules of the syncer state machine (issue 13): lost messages are resent, stale pushes
refused, a final cut checked by digest, one bad island evicted, a non-finite commit dropped,
a second process refused. Driven inline with hand-built parted messages (``state_driver``)."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import torch

from diloco.digest import tensor_digest
from diloco.syncer.core.records import OutStream
from diloco.wire import Error, FinalAck, Pull, Shutdown

from state_driver import Driver, bitwise, errors, of, streams  # noqa: E402
from test_state import CFG, GEN, delta, hb, hello, open_round1, peer, pushes, started  # noqa: E402


def commit_round1(d: Driver, now: float = 1.0) -> list:
    """Islands 0, 1, 2 push round 1 (fragment 0): version 1."""
    out = open_round1(d, now)
    for i in range(3):
        out += d.send_all(peer(i), pushes(i, 1, 0), now=now)
    assert d.st.fragments[0].version == 1 and d.st.fragments[0].round == 1
    return out


def test_a_stream_lost_on_a_send_error_is_resent_once_the_island_is_heard() -> None:
    d = started()
    commit_round1(d)
    # The loop reports that island 1's BCAST of fragment 0 was abandoned (EHOSTUNREACH).
    d.st.on_lost(peer(1), "BCAST", 0, False, now=2.0)
    assert not streams(d.tick(2.5), "BCAST")  # nothing resent before a message proves it is back
    out = d.send(peer(1), hb(1, 3), now=3.0)
    again = streams(out)
    assert [(o.peer, o.fragment, o.version, o.round, o.cut) for o in again] == [(peer(1), 0, 1, 1, False)]
    assert not streams(d.send(peer(1), hb(1, 3), now=3.5))  # resent once
    # A lost cut is resent as a cut; a lost PULL makes the island's open rounds pulled again.
    d.send(peer(0), hb(0, 4), now=4.0)
    d.send(peer(1), hb(1, 4), now=4.0)  # round 2 (fragment 1) opens
    d.st.on_lost(peer(2), "BCAST", 1, True, now=4.0)
    out = d.send(peer(2), hb(2, 4), now=5.0)
    assert [(o.fragment, o.cut, o.round) for o in streams(out)] == [(1, True, 0)]
    assert [o.header for o in of(out, Pull)] == [Pull(fragment=1, round=2, attempt=0)]
    # An island that reconnected under a new routing id gets a whole new cut instead: ignored.
    d.st.on_lost(b"gone", "BCAST", 0, False, now=6.0)


def test_a_push_against_an_older_version_is_refused_and_the_value_resent() -> None:
    d = started()
    commit_round1(d)
    d.send(peer(0), hb(0, 6), now=2.0)
    d.send(peer(1), hb(1, 6), now=2.0)  # rounds 2 (f1) and 3 (f0) open
    assert 3 in d.st.rounds
    before = d.st.fragments[0].value.clone()
    # Island 2 missed version 1 of fragment 0: it pushes round 3 against version 0.
    out = d.send_all(peer(2), pushes(2, 3, 0, base=0), now=2.0)
    err = of(out, Error)
    assert [(e.header.code, e.header.fragment, e.header.round) for e in err] == [("stale_base", 0, 3)]
    assert len(err) == 1  # the push's later parts are dropped quietly
    value = streams(out)
    assert [(o.peer, o.fragment, o.version, o.round, o.cut) for o in value] == [(peer(2), 0, 1, 1, False)]
    assert out.index(value[0]) < out.index(of(out, Pull)[0])  # the PULL follows the value
    assert of(out, Pull)[0].header == Pull(fragment=0, round=3, attempt=0)
    assert 2 not in d.st.rounds[3].pushes and bitwise(d.st.fragments[0].value, before)
    # Answered against the current version, it is taken.
    assert not errors(d.send_all(peer(2), pushes(2, 3, 0, base=1), now=2.5))
    assert d.st.rounds[3].pushes[2].complete


def test_a_quorum_timeout_resends_the_value_to_members_that_did_not_push() -> None:
    d = started()
    open_round1(d)
    d.send_all(peer(0), pushes(0, 1, 0), now=1.0)  # 1 of K=2: the attempt times out
    out = d.tick(12.0)
    value = streams(out)
    assert sorted(o.peer for o in value) == [peer(1), peer(2)] and {o.fragment for o in value} == {0}
    assert sorted(o.peer for o in of(out, Pull)) == [peer(0), peer(1), peer(2)]
    assert d.st.rounds[1].attempt == 1


def finished_training(d: Driver) -> list:
    out = []
    for i in range(3):
        out += d.send(peer(i), hb(i, 1, done=True), now=1.0)
    for i in range(3):
        for r, f in ((1, 0), (2, 1)):
            out += d.send_all(peer(i), pushes(i, r, f, steps=0), now=1.0)
    assert d.st.phase == "final"
    return out


def digests(d: Driver) -> tuple[str, ...]:
    return tuple(tensor_digest(f.layout.flat_views(f.value)) for f in d.st.fragments)


def test_final_cut_resent_on_rejoin_and_checked_by_digest() -> None:
    d = started(replace(CFG, total_steps=1))
    finished_training(d)
    assert all(f.digest is not None for f in d.st.fragments)  # hashed by the (inline) data plane
    ok = digests(d)
    # Island 1 redials mid-finalization: it gets every FINAL again.
    out = d.send(peer(1) + b"r", hello(1, 201), now=1.5)
    finals = streams(out, "FINAL")
    assert [(o.peer, o.fragment) for o in finals] == [(peer(1) + b"r", 0), (peer(1) + b"r", 1)]
    gens = {0: GEN[0], 1: 201, 2: GEN[2]}
    d.send(peer(0), FinalAck(island=0, generation=gens[0], versions=(0, 0), digests=ok), now=2.0)
    d.send(peer(2), FinalAck(island=2, generation=gens[2], versions=(0, 0), digests=ok), now=2.0)
    assert not d.st.finished
    out = d.send(peer(1) + b"r", FinalAck(island=1, generation=gens[1], versions=(0, 0), digests=ok), now=2.0)
    assert d.st.finished and d.st.exit_code == 0 and len(of(out, Shutdown)) == 3
    # A digest that differs fails the run loudly.
    d = started(replace(CFG, total_steps=1))
    finished_training(d)
    bad = (ok[0], "0" * 64)
    for i in range(3):
        d.send(peer(i), FinalAck(island=i, generation=GEN[i], versions=(0, 0), digests=bad if i == 2 else ok),
               now=2.0)
    assert d.st.finished and d.st.exit_code == 1
    assert errors(Driver(CFG).send(peer(0), FinalAck(island=0, generation=1, versions=()))) == ["not_bound"]


def test_an_island_refused_n_times_in_a_row_is_evicted_until_a_fresh_hello() -> None:
    d = started(replace(CFG, max_refusals=3))
    open_round1(d)
    nan = [(n, torch.full_like(t, float("nan"))) for n, t in delta(0, 0)]
    out = []
    for attempt in range(3):
        out += d.send_all(peer(2), pushes(2, 1, 0, attempt=attempt, tensors=nan), now=1.0)
    assert errors(out) == ["bad_push", "bad_push", "bad_push", "evicted"]  # later parts: quiet
    assert d.st.islands[2].evicted and 2 not in d.st.rounds[1].members
    assert any(e.get("evicted") == 2 for e in d.st.events)
    # The others finish the round without it.
    for i in (0, 1):
        d.send_all(peer(i), pushes(i, 1, 0, attempt=3), now=1.0)
    assert d.st.fragments[0].version == 1
    # A fresh HELLO readmits it (after its new cut).
    d.send(peer(2), hello(2, 301), now=2.0)
    assert not d.st.islands[2].evicted and d.st.islands[2].refusals_in_row == 0


def test_a_3e38_delta_is_refused_charged_to_its_island_and_the_round_commits_without_it() -> None:
    d = started()
    open_round1(d)
    v0 = d.st.fragments[0].value.clone()
    huge = [(n, torch.full_like(t, 3e38)) for n, t in delta(0, 0)]  # finite, but w x d overflows fp32
    out = d.send_all(peer(0), pushes(0, 1, 0, tensors=huge), now=1.0)
    for i in (1, 2):
        out += d.send_all(peer(i), pushes(i, 1, 0), now=1.0)
    f = d.st.fragments[0]
    assert bitwise(f.value, v0) and f.version == 0  # nothing of it reached a commit
    assert [e.header.code for e in of(out, Error)][:1] == ["bad_push"]
    assert d.st.islands[0].refusals_in_row == 1 and d.st.reference.tally[0]["refused"] == 1
    r = d.st.rounds[1]
    assert r.attempt == 1 and r.members == frozenset({1, 2})  # the culprit is left out, not the round
    for i in (1, 2):
        d.send_all(peer(i), pushes(i, 1, 0, attempt=1), now=1.0)
    assert f.version == 1 and torch.isfinite(f.value).all() and float(f.value.abs().max()) < 1e3


def test_a_second_process_claiming_a_live_island_id_is_refused() -> None:
    d = Driver(CFG)
    h = msgspec.structs.replace(hello(1, 5), instance=111)
    d.send(peer(1), h, now=0.0)
    other = msgspec.structs.replace(hello(1, 6), instance=222)
    assert errors(d.send(b"other", other, now=1.0)) == ["island_in_use"]
    assert d.st.islands[1].generation == 5
    # The same process redialing (same instance, new routing id) is a reconnect.
    out = d.send(b"redial", msgspec.structs.replace(hello(1, 7), instance=111), now=2.0)
    assert not errors(out) and d.st.islands[1].generation == 7
    # Once the old binding is silent for --dead-after-s, a new process takes the id over.
    out = d.send(b"new", msgspec.structs.replace(hello(1, 8), instance=333), now=2.0 + CFG.dead_after_s + 1)
    assert not errors(out) and d.st.islands[1].generation == 8


def test_stale_tmp_checkpoint_directories_are_removed_at_start(tmp_path) -> None:
    from diloco.syncer.store import CheckpointStore

    (tmp_path / ".tmp-ckpt-00000007-123").mkdir()
    (tmp_path / ".tmp-ckpt-00000007-123" / "values.safetensors").write_bytes(b"half written")
    (tmp_path / "keep-me").mkdir()
    CheckpointStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep-me"]

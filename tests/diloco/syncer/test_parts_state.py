"""Parted fragment streams at the syncer state machine (issue 10).

Pushes split over many parts (part size 4096 elements), islands' parts interleaved, refused
parts of every kind, voided attempts, zero-weight pushes, the HELLO size check and flush
rounds. Messages go through the real codec; data-plane work runs inline (``state_driver``).
"""

from __future__ import annotations

import dataclasses

import logging
import random
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from diloco.syncer.core.config import SyncerConfig
from diloco.wire import PROTOCOL_VERSION, Error, Final, FinalAck, Heartbeat, Hello, Pull, Shutdown, encode, open_message

from state_driver import Driver, bitwise, errors, flat, init_parts, of, push_parts, reference_commit, streams

pytestmark = pytest.mark.timeout(60)

E = 4096
FP = "p" * 16
CFG = SyncerConfig(
    islands=3, quorum=2, sync_every=2, quorum_timeout_s=10.0, grace_ms=100.0,
    dead_after_s=30.0, final_timeout_s=5.0, checkpoint_every=0, part_elems=E,
    outer_lr=0.7, outer_momentum=0.9,  # DiLoCo's Nesterov step: the references check the momentum path too
    max_gathering_rounds=2,  # rounds that gather side by side (the default, one, in test_core_tables)
)
# One fragment of 27295 elements: 7 parts, segments cut inside and across tensors.
SCHEMA = [("a", (5000,)), ("b", (3, 4096)), ("c", (7,)), ("d", (10000,))]
NUMEL = 27295
N_PARTS = 7
GEN = [10, 20, 30]
LOGGER = "diloco.syncer.core"


def peer(i: int) -> bytes:
    return b"peer-%d" % i


def hello(i: int, gen: int | None = None, n: int = 1, numel: tuple[int, ...] = ()) -> Hello:
    return Hello(protocol=PROTOCOL_VERSION, island=i, generation=GEN[i] if gen is None else gen, fingerprint=FP,
                 n_fragments=n, wire_dtype="float32", fragment_numel=numel)


def hb(i: int, step: int, done: bool = False) -> Heartbeat:
    return Heartbeat(island=i, generation=GEN[i], step=step, done=done)


def tensors(seed: int, scale: float = 1.0, schema: list = SCHEMA) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=g) * scale) for n, s in schema]


def delta(island: int, rnd: int) -> list[tuple[str, torch.Tensor]]:
    return tensors(1000 + 10 * rnd + island, 0.01)


def pushes(i: int, rnd: int, *, attempt: int = 0, steps: int = 2, tokens: int = 10, base: int = 0,
           t: list | None = None, fragment: int = 0) -> list:
    return push_parts(i, GEN[i], fragment, rnd, delta(i, rnd) if t is None else t, E, attempt=attempt, base=base,
                      steps=steps, tokens=tokens)


def started(cfg: SyncerConfig = CFG) -> Driver:
    d = Driver(cfg)
    for i in range(cfg.islands):
        d.send(peer(i), hello(i, numel=(NUMEL,)))
    d.send_all(peer(0), init_parts(0, 1, tensors(0), E, generation=GEN[0]))
    assert d.st.initialised and d.st.fragments[0].layout.n_parts(E) == N_PARTS
    for i in range(1, cfg.islands):  # a HELLO alone is not membership: islands heartbeat after WELCOME
        d.send(peer(i), hb(i, 0))
    return d


def open_round(d: Driver, rnd: int, now: float = 1.0) -> None:
    for i in range(d.st.config.islands):
        d.send(peer(i), hb(i, 2 * rnd), now=now)
    assert rnd in d.st.rounds


def frag_state(d: Driver) -> tuple[np.ndarray, np.ndarray]:
    f = d.st.fragments[0]
    m = f.momentum.numpy().copy() if f.momentum is not None else np.zeros(f.layout.numel, np.float32)
    return f.value.numpy().copy(), m


def check_commit(d: Driver, v0: np.ndarray, m0: np.ndarray, deltas: dict[int, list], event: dict) -> None:
    weights = {int(k): w for k, w in event["weights"].items()}
    ref, mref = reference_commit(v0, m0, {i: flat(t).numpy() for i, t in deltas.items()}, weights,
                                 event["fold_order"], E)
    v, m = frag_state(d)
    assert bitwise(v, ref) and bitwise(m, mref)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern (a sum buffer's unstarted parts hold arbitrary bytes, maybe NaN patterns)."""
    return t.view(torch.int32).clone()


def fingerprint(d: Driver) -> dict[str, Any]:
    """Everything a refused part must leave untouched."""
    st = d.st
    rounds = {}
    for t, r in st.rounds.items():
        rounds[t] = (
            r.attempt, r.closed, sorted(r.members), r.grace_deadline,
            {i: (p.next_part, p.folded, p.n_parts, p.weight, p.last_part_at) for i, p in r.pushes.items()},
            None if r.sum is None else [list(o) for o in r.sum.fold_order],
            None if r.sum is None else list(r.sum.started),
        )
    return {
        "versions": st.versions(), "next_open": st.roundbook.next_open, "next_commit": st.roundbook.next_commit, "rounds": rounds,
        "events": len(st.events), "work": len(st.journal.work),
        "last_seen": [i.last_seen for i in st.islands],
    }


def sums(d: Driver) -> dict[int, torch.Tensor]:
    return {t: bits(r.sum.flat) for t, r in d.st.rounds.items() if r.sum is not None}


# ---------------------------------------------------------------- (a) interleaved parts, bitwise


def test_interleaved_parts_commit_bitwise_in_recorded_fold_order() -> None:
    # Token counts 136x apart test fp32 rounding of the weights: a weight factor that admits them.
    d = started(dataclasses.replace(CFG, weight_factor=1000.0))
    rng = random.Random(5)
    tok = {0: 123457, 1: 9999991, 2: 16777219}  # the last is not an fp32 integer: rounded like np.float32
    for rnd in (1, 2):  # round 2 starts from round 1's momentum
        open_round(d, rnd, now=float(rnd))
        v0, m0 = frag_state(d)
        streams_ = {i: pushes(i, rnd, tokens=tok[i], base=rnd - 1) for i in range(3)}
        if rnd == 1:
            # island 1 part 0, island 0 part 0, island 0 part 1, island 1 part 1, ... then random,
            # with the data plane running at random moments (several folds queued at once).
            schedule = [1, 0, 0, 1, 1, 0, 2, 2, 2]
            left = {i: N_PARTS - schedule.count(i) for i in range(3)}
            rest = [i for i in range(3) for _ in range(left[i])]
            rng.shuffle(rest)
            schedule += rest
        else:
            schedule = [i for _k in range(N_PARTS) for i in (2, 0, 1)]  # lockstep: one order for every part
        expected: list[list[int]] = [[] for _ in range(N_PARTS)]
        nxt = {i: 0 for i in range(3)}
        out = []
        for i in schedule:
            k = nxt[i]
            nxt[i] += 1
            expected[k].append(i)
            out += d.send(peer(i), *streams_[i][k], now=float(rnd), run=rng.random() < 0.4)
            assert not errors(out)
        out += d.run(float(rnd))
        ev = d.st.events[-1]
        assert ev["round"] == rnd and ev["changed"] and d.st.versions() == (rnd,)
        want = expected if any(o != expected[0] for o in expected) else expected[0]
        assert ev["fold_order"] == want
        assert rnd != 1 or isinstance(ev["fold_order"][0], list)  # round 1 folds parts in differing orders
        assert ev["weights"] == {str(i): tok[i] for i in range(3)}
        check_commit(d, v0, m0, {i: delta(i, rnd) for i in range(3)}, ev)
        assert {o.version for o in streams(out)} == {rnd} and len(streams(out)) == 3


# ---------------------------------------------------------------- (b) refused parts


def test_bad_parts_are_refused_logged_and_change_nothing(caplog) -> None:
    d = started(replace(CFG, max_refusals=1000))  # eviction (a counted refusal) is tested apart
    open_round(d, 1)
    v0, m0 = frag_state(d)
    p = {i: pushes(i, 1) for i in range(3)}
    d.send_all(peer(1), p[1], now=1.0)  # island 1 complete
    d.send_all(peer(0), p[0][:3], now=1.0)  # island 0 at part 3 of 7
    h3, s3 = p[0][3]
    rep = msgspec.structs.replace
    cases: list[tuple[str, str, bytes, Any, list, str]] = [
        ("duplicated part", "bad_part", peer(0), p[0][2][0], p[0][2][1], "expected part 3"),
        ("duplicated part 0", "duplicate_push", peer(0), p[0][0][0], p[0][0][1], "already pushed"),
        ("out of order", "bad_part", peer(0), p[0][4][0], p[0][4][1], "expected part 3"),
        ("part >= n_parts", "bad_part", peer(1), rep(p[1][-1][0], part=N_PARTS), p[1][-1][1], "outside [0, 7)"),
        ("wrong n_parts", "bad_part", peer(0), rep(h3, n_parts=N_PARTS + 1), s3, "disagrees with its part 0"),
        ("wrong n_parts at part 0", "bad_part", peer(2), rep(p[2][0][0], n_parts=N_PARTS - 1), p[2][0][1],
         "n_parts 6"),
        ("other counts", "bad_part", peer(0), rep(h3, tokens=11), s3, "disagrees with its part 0"),
        ("segment names", "bad_part", peer(0), h3, [(n + "x", t) for n, t in s3], "where"),
        ("segment lengths", "bad_part", peer(0), h3, [(n, t[:-4]) for n, t in s3], "has shape"),
        ("segment count", "bad_part", peer(0), h3, s3[:-1] if len(s3) > 1 else s3 + [("zz", torch.zeros(1))],
         "segments, expected"),
        ("segment of another part", "bad_part", peer(0), h3, p[0][4][1], "expected"),
        ("other attempt", "stale_attempt", peer(0), rep(h3, attempt=1), s3, "attempt 0"),
        ("other round", "unknown_round", peer(0), rep(h3, round=2), s3, "round 2"),
        ("old round", "unknown_round", peer(0), rep(h3, round=0), s3, "already committed"),
        ("other fragment", "wrong_fragment", peer(0), rep(h3, fragment=1), s3, "fragment"),
        ("other generation", "unknown_generation", peer(0), rep(h3, generation=99), s3, "generation 99"),
    ]
    for what, code, who, header, segs, reason in cases:
        before, sum_before, refusals = fingerprint(d), sums(d), d.st.refusals
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            out = d.send(who, header, segs, now=2.0)
        assert errors(out) == [code], what
        assert of(out, Error)[0].peer == who and reason in of(out, Error)[0].header.reason, (what, out)
        assert len(caplog.records) == 1 and code in caplog.text and reason in caplog.text, what
        assert fingerprint(d) == before, what
        after = sums(d)
        assert after.keys() == sum_before.keys() and all(torch.equal(after[t], sum_before[t]) for t in after), what
        assert d.st.refusals == refusals + 1
    # Nothing was folded twice or out of place: the good rest of the stream commits bitwise.
    d.send_all(peer(0), p[0][3:], now=2.0)
    out = d.send_all(peer(2), p[2], now=2.0)
    assert streams(out) and d.st.versions() == (1,)
    check_commit(d, v0, m0, {i: delta(i, 1) for i in range(3)}, d.st.events[-1])


def test_incomplete_push_holds_the_round_then_completes() -> None:
    d = started()
    open_round(d, 1)
    v0, m0 = frag_state(d)
    d.send_all(peer(0), pushes(0, 1), now=1.0)
    d.send_all(peer(2), pushes(2, 1), now=1.0)
    d.send_all(peer(1), pushes(1, 1)[:2], now=1.0)  # started, not complete
    r = d.st.rounds[1]
    assert r.grace_deadline is not None and not r.closed
    # K = 2 pushes are complete and grace is over, but island 1's push is in the sum already: wait for it.
    assert not streams(d.tick(5.0)) and not r.closed and r.attempt == 0
    assert not streams(d.tick(20.0)) and r.attempt == 0  # past the quorum timeout too: it still streams
    out = d.send_all(peer(1), pushes(1, 1)[2:], now=25.0)
    assert streams(out) and d.st.events[-1]["pushed"] == [0, 1, 2]
    check_commit(d, v0, m0, {i: delta(i, 1) for i in range(3)}, d.st.events[-1])


def test_stalled_push_drops_the_attempt_and_late_parts_are_refused(caplog) -> None:
    d = started()
    open_round(d, 1)
    v0, m0 = frag_state(d)
    d.send_all(peer(0), pushes(0, 1), now=1.0)
    d.send_all(peer(2), pushes(2, 1), now=1.0)
    d.send_all(peer(1), pushes(1, 1)[:3], now=2.0)
    old_sum = d.st.rounds[1].sum
    for t in (10.0, 20.0, 30.0):  # every island keeps sending heartbeats: alive, but island 1's push stalls
        for i in range(3):
            d.send(peer(i), hb(i, 2), now=t)
    assert d.st.rounds[1].attempt == 0 and not d.st.rounds[1].closed
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = d.tick(32.5)  # no part from island 1 for more than dead_after_s
    assert "stalled" in caplog.text
    r = d.st.rounds[1]
    assert r.attempt == 1 and r.pushes == {} and r.sum is None and old_sum.void and not r.closed
    assert {o.header for o in of(out, Pull)} == {Pull(fragment=0, round=1, attempt=1)}
    # Liveness means progress: the staller is dropped from this round (laggards.py), the others re-push.
    assert sorted(o.peer for o in of(out, Pull)) == [peer(0), peer(2)] and r.members == frozenset({0, 2})
    assert d.st.versions() == (0,) and bitwise(frag_state(d)[0], v0)
    assert [e["dropped_islands"] for e in d.st.events] == [[1]] and d.st.reference.tally[1]["lagged"] == 1
    # The stalled push's remaining parts belong to the dropped attempt: dropped quietly.
    before = fingerprint(d)
    assert errors(d.send(peer(1), *pushes(1, 1)[3], now=33.0)) == []
    assert fingerprint(d) == before
    assert errors(d.send(peer(1), *pushes(1, 1, attempt=1)[0], now=33.5)) == ["not_member"]
    for i in (0, 2):
        d.send_all(peer(i), pushes(i, 1, attempt=1, t=delta(i, 7)), now=34.0)
    ev = d.st.events[-1]
    assert ev["attempt"] == 1 and d.st.versions() == (1,) and ev["pushed"] == [0, 2]
    check_commit(d, v0, m0, {i: delta(i, 7) for i in (0, 2)}, ev)
    del old_sum  # a sum buffer still referenced counts against the memory budget: round 2 would wait for it
    # The dropped island is a member of the next round again.
    open_round(d, 2, now=35.0)
    assert d.st.rounds[2].members == frozenset({0, 1, 2})


# ---------------------------------------------------------------- (c) data-plane refusals void the attempt


@pytest.mark.parametrize("fault", ["nan", "digest"])
def test_refused_part_voids_the_attempt_and_repulls(fault: str, caplog) -> None:
    d = started()
    open_round(d, 1)
    v0, m0 = frag_state(d)
    d.send_all(peer(0), pushes(0, 1), now=1.0)
    p1 = pushes(1, 1)
    d.send_all(peer(1), p1[:2], now=1.0)
    header, segs = p1[2]
    if fault == "nan":
        segs = [(n, t.clone()) for n, t in segs]
        segs[-1][1][-1] = float("nan")
        msg = open_message(encode(header, segs, nonce=d.stamp(peer(1))[0], seq=d.stamp(peer(1))[1]))
    else:  # a flipped payload byte: the header's MAC holds, the chunk digest does not
        nonce, seq = d.stamp(peer(1))
        frames = encode(header, segs, nonce=nonce, seq=seq)
        raw = bytearray(frames[2])
        raw[5] ^= 0x40
        msg = open_message([frames[0], frames[1], bytes(raw), *frames[3:]])
    old_sum = d.st.rounds[1].sum
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        # The part passes the control plane; its later parts are queued behind it.
        out = d.st.receive(peer(1), msg, 1.0)
        for h, s in p1[3:]:
            out += d.send(peer(1), h, s, now=1.0, run=False)
        assert not errors(out) and len(d.st.journal.work) == N_PARTS - 2
        out += d.run(1.0)
    assert errors(out) == ["bad_push"] and of(out, Error)[0].peer == peer(1)
    assert ("NaN" if fault == "nan" else "digest") in of(out, Error)[0].header.reason
    assert "dropping the attempt" in caplog.text and "attempt 0 dropped" in caplog.text
    r = d.st.rounds[1]
    assert r.attempt == 1 and r.pushes == {} and r.sum is None and old_sum.void
    assert {o.header for o in of(out, Pull)} == {Pull(fragment=0, round=1, attempt=1)} and len(of(out, Pull)) == 3
    assert d.st.versions() == (0,) and bitwise(frag_state(d)[0], v0) and bitwise(frag_state(d)[1], m0)
    # The re-pulled attempt folds from a fresh sum: nothing of attempt 0 leaks into it.
    for i in (2, 1, 0):
        d.send_all(peer(i), pushes(i, 1, attempt=1), now=2.0)
    ev = d.st.events[-1]
    assert ev["attempt"] == 1 and ev["fold_order"] == [2, 1, 0]
    check_commit(d, v0, m0, {i: delta(i, 1) for i in range(3)}, ev)


# ---------------------------------------------------------------- (d) zero-weight pushes


def test_zero_weight_push_carries_no_tensors() -> None:
    d = started()
    open_round(d, 1)
    v0, m0 = frag_state(d)
    zero = pushes(1, 1, steps=0, tokens=0)
    assert len(zero) == 1 and zero[0][0].n_parts == 0 and zero[0][1] == []
    full = pushes(1, 1)
    rep = msgspec.structs.replace
    refused = [
        (rep(full[0][0], local_steps=0), full[0][1]),  # zero weight with tensors and parts
        (rep(full[0][0], local_steps=0, n_parts=0), full[0][1]),  # n_parts 0 but tensors
        (rep(full[0][0], local_steps=0), []),  # no tensors but n_parts 7
        (rep(full[0][0], n_parts=0), []),  # a weighted push without parts
    ]
    for h, s in refused:
        before = fingerprint(d)
        out = d.send(peer(1), h, s, now=1.0)
        assert errors(out) == ["bad_part"] and fingerprint(d) == before
    assert d.send_all(peer(1), zero, now=1.0) == []
    r = d.st.rounds[1]
    assert r.pushes[1].complete and r.sum is None and r.pushes[1].weight == 0  # complete at once, no sum yet
    d.send_all(peer(0), pushes(0, 1, tokens=7), now=1.0)
    d.send_all(peer(2), pushes(2, 1, tokens=5), now=1.0)
    ev = d.st.events[-1]
    assert ev["weights"] == {"0": 7, "1": 0, "2": 5} and ev["fold_order"] == [0, 2] and ev["pushed"] == [0, 1, 2]
    check_commit(d, v0, m0, {0: delta(0, 1), 2: delta(2, 1)}, ev)
    assert d.st.islands[1].ledger.merges == 0 and d.st.islands[0].ledger.merges == 1


def test_a_round_nobody_pushed_weight_to_took_no_commit_time() -> None:
    d = started()
    open_round(d, 1)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, steps=0, tokens=0), now=5.0)
    ev = d.st.events[-1]
    assert ev["round"] == 1 and not ev["changed"] and ev["weights"] == {"0": 0, "1": 0, "2": 0}
    assert ev["commit_s"] == 0.0  # not the clock's age (the commit never started)


# ---------------------------------------------------------------- (e) the HELLO size check


def test_hello_with_a_fragment_above_the_limit_names_the_fix(caplog) -> None:
    d = Driver(replace(CFG, max_fragment_bytes=1 << 20))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = d.send(peer(0), hello(0, n=2, numel=(100, 300_000)), now=0.0)  # 1.2 MB > 1 MiB
    assert errors(out) == ["fragment_too_large"]
    reason = of(out, Error)[0].header.reason
    assert "YETO_DILOCO_FRAGMENTS" in reason and "--max-fragment-gib" in reason
    assert "fragment_too_large" in caplog.text and "YETO_DILOCO_FRAGMENTS" in caplog.text
    assert d.st.fingerprint is None and not d.st.islands[0].bound  # refused before any state changed
    assert errors(d.send(peer(0), hello(0, n=2, numel=(100,)))) == ["bad_fragments"]
    assert errors(d.send(peer(0), hello(0, n=2, numel=(100, 0)))) == ["bad_fragments"]
    out = d.send(peer(0), hello(0, n=2, numel=(100, 200_000)))  # 800 kB fits
    assert not errors(out) and d.st.islands[0].bound
    # Once the fragments are initialised, a plan with other sizes is refused.
    d2 = started()
    assert errors(d2.send(peer(1), hello(1, gen=21, numel=(NUMEL + 1,)))) == ["fragments_mismatch"]
    assert not errors(d2.send(peer(1), hello(1, gen=22, numel=(NUMEL,))))


# ---------------------------------------------------------------- (f) flush rounds


@pytest.mark.parametrize("total_steps", [9, 0])
def test_rounds_follow_the_slower_island_then_one_flush_round_per_fragment(total_steps: int) -> None:
    """Island 0 finishes first (at the last step, or says done at step 5); island 1 trains on
    to step 9, which does not divide into rounds (H = 4, P = 2: a round every 2 steps)."""
    small = [[("x", (5000,))], [("y", (3,)), ("z", (4100,))]]
    cfg = replace(CFG, islands=2, sync_every=4, total_steps=total_steps)
    d = Driver(cfg)
    for i in range(2):
        d.send(peer(i), hello(i, n=2))
    for f in range(2):
        d.send_all(peer(0), init_parts(f, 2, tensors(f, schema=small[f]), E, generation=GEN[0]))
    d.send(peer(1), hb(1, 0))  # a HELLO alone is not membership
    assert d.st.scheduled_rounds == (4 if total_steps else 0)

    def push_round(rnd: int, f: int, steps: dict[int, int], now: float) -> list:
        out = []
        for i in (1, 0):
            t = tensors(100 * rnd + i, 0.01, small[f])
            out += d.send_all(peer(i), push_parts(i, GEN[i], f, rnd, t, E, steps=steps[i], tokens=3 * steps[i],
                                                  base=d.st.fragments[f].version), now)
        return out

    def heartbeat(i: int, step: int, now: float, done: bool = False) -> list:
        return d.send(peer(i), hb(i, step, done), now=now)

    heartbeat(0, 4, 1.0)
    out = heartbeat(1, 4, 1.0)
    assert {(o.header.round, o.header.fragment) for o in of(out, Pull)} == {(1, 0), (2, 1)}
    push_round(1, 0, {0: 2, 1: 2}, 1.0)
    push_round(2, 1, {0: 4, 1: 4}, 1.0)
    # Island 0 finishes; the clock is now island 1 alone (the K-th fastest of those still training).
    if total_steps:
        heartbeat(0, 9, 2.0)
    else:
        heartbeat(0, 5, 2.0, done=True)
    assert not heartbeat(1, 5, 2.0)[1:]  # a heartbeat reply, no round: step 5 < 6
    out = heartbeat(1, 6, 3.0)
    assert [(o.header.round, o.header.fragment, o.peer) for o in of(out, Pull)] == [(3, 0, peer(0)), (3, 0, peer(1))]
    push_round(3, 0, {0: 3, 1: 2}, 3.0)  # the finished island pushes its last steps of fragment 0
    out = heartbeat(1, 8, 4.0)
    assert {o.header.round for o in of(out, Pull)} == {4}
    push_round(4, 1, {0: 0, 1: 4}, 4.0)
    assert d.st.versions() == (2, 2) and d.st.final.flush_left is None
    # Island 1 at step 9: round 5 would need step 10, so no training round; both finished: flush.
    out = heartbeat(1, 9, 5.0, done=not total_steps)
    assert not streams(out, "FINAL")
    assert sorted((o.header.round, o.header.fragment) for o in of(out, Pull)) == [(5, 0), (5, 0), (6, 1), (6, 1)]
    assert d.st.rounds[5].flush and d.st.rounds[6].flush and "F" in d.st.status()
    out = push_round(5, 0, {0: 0, 1: 3}, 5.0)  # island 1's steps 7..9 of fragment 0
    assert not streams(out, "FINAL") and d.st.phase == "running"
    out += push_round(6, 1, {0: 0, 1: 1}, 5.0)
    finals, held = streams(out, "FINAL"), [o.header for o in of(out, Final)]
    assert d.st.phase == "final" and {o.versions for o in finals} | {h.versions for h in held} == {(3, 3)}
    # Islands that said done get each flush commit at once, and their final cut names it in a held
    # notice; islands that only reached the last step get the final cut's bytes.
    flushed = sorted((o.peer, o.fragment, o.version) for o in streams(out, "BCAST"))
    if total_steps:
        assert len(finals) == 4 and not held and not flushed
    else:
        assert not finals and sorted((h.fragment, h.held) for h in held) == [(0, True), (0, True), (1, True), (1, True)]
        assert flushed == sorted((peer(i), f, 3) for i in range(2) for f in range(2))
    evs = [e for e in d.st.events if "round" in e]
    assert [(e["round"], e["fragment"], e["flush"], e["changed"]) for e in evs] == [
        (1, 0, False, True), (2, 1, False, True), (3, 0, False, True), (4, 1, False, True),
        (5, 0, True, True), (6, 1, True, True),
    ]
    assert d.st.merged_summary() == {"scheduled_rounds": 4 if total_steps else 0, "committed_rounds": 6,
                                     "changed_in_training": 4, "changed_in_flush": 2}
    for i in range(2):
        out = d.send(peer(i), FinalAck(island=i, generation=GEN[i], versions=(3, 3)), now=6.0)
    assert len(of(out, Shutdown)) == 2 and d.st.exit_code == 0


# ---------------------------------------------------------------- liveness by parts


def test_parts_count_as_hearing_from_the_island() -> None:
    """A slow push (one part every 20 s, no heartbeat, dead after 30 s of silence) keeps its island live."""
    d = started()
    open_round(d, 1)
    v0, m0 = frag_state(d)
    p1 = pushes(1, 1)
    d.send(peer(1), *p1[0], now=1.0)  # started first: the round waits for it past the grace window
    d.send_all(peer(0), pushes(0, 1), now=1.0)
    d.send_all(peer(2), pushes(2, 1), now=1.0)
    for k, (h, s) in enumerate(p1[1:], start=1):
        now = 1.0 + 20.0 * k
        for i in (0, 2):
            d.send(peer(i), hb(i, 2), now=now)
        d.tick(now)
        assert d.st.islands[1].alive and d.st.rounds[1].attempt == 0, k
        out = d.send(peer(1), h, s, now=now)
    assert streams(out) and d.st.events[-1]["pushed"] == [0, 1, 2]
    check_commit(d, v0, m0, {i: delta(i, 1) for i in range(3)}, d.st.events[-1])


# ---------------------------------------------------------------- regressions of bugs found while porting


def test_negative_part_index_is_refused() -> None:
    d = started()
    open_round(d, 1)
    p1 = pushes(1, 1)
    d.send_all(peer(1), p1[:2], now=1.0)  # a partial weighted push
    rep = msgspec.structs.replace
    zero_neg = rep(p1[0][0], part=-1, local_steps=0, n_parts=0)
    before = fingerprint(d)
    # Over the partial push: accepted today, and it refreshes the stalled push's last_part_at.
    assert errors(d.send(peer(1), zero_neg, [], now=20.0)) == ["bad_part"]
    assert fingerprint(d) == before
    # A fresh zero-weight push with part -1: accepted today (and so is its duplicate).
    assert errors(d.send(peer(2), rep(zero_neg, island=2, generation=GEN[2]), [], now=1.0)) == ["bad_part"]
    assert 2 not in d.st.rounds[1].pushes


def test_reconnect_mid_push_repulls_at_once() -> None:
    d = started()
    open_round(d, 1)
    v0, m0 = frag_state(d)
    d.send_all(peer(0), pushes(0, 1), now=1.0)
    d.send_all(peer(2), pushes(2, 1), now=1.0)
    d.send_all(peer(1), pushes(1, 1)[:2], now=1.0)
    out = d.send(peer(1), hello(1, gen=21, numel=(NUMEL,)), now=2.0)
    # Expected: the attempt holding the dead stream is dropped now, and everyone is pulled again.
    assert d.st.rounds[1].attempt == 1
    assert Pull(fragment=0, round=1, attempt=1) in {o.header for o in of(out, Pull) if o.peer == peer(1)}
    new_gen = push_parts(1, 21, 0, 1, delta(1, 1), E, attempt=1)
    for i, msgs in ((0, pushes(0, 1, attempt=1)), (2, pushes(2, 1, attempt=1)), (1, new_gen)):
        assert not errors(d.send_all(peer(i), msgs, now=3.0))
    assert d.st.versions() == (1,)
    check_commit(d, v0, m0, {i: delta(i, 1) for i in range(3)}, d.st.events[-1])


@pytest.mark.parametrize("merge", ["mean", "outer"])
def test_flush_round_merges_by_the_plain_mean_unless_told_otherwise(merge: str) -> None:
    """A training round takes the Nesterov step (lr 0.7, momentum 0.9); the flush round after it
    moves the value by exactly the weighted mean of the final deltas (``--flush-merge mean``,
    the default), or by the same Nesterov step (``outer``): bitwise against numpy either way."""
    cfg = replace(CFG, islands=2, quorum=0, sync_every=2, total_steps=3, flush_merge=merge)
    d = started(cfg)
    open_round(d, 1)
    v0, m0 = frag_state(d)
    deltas = {i: delta(i, 1) for i in range(2)}
    for i in range(2):
        d.send_all(peer(i), pushes(i, 1, steps=2, tokens=10 + i), now=1.0)
    ev = [e for e in d.st.events if "round" in e][-1]
    check_commit(d, v0, m0, deltas, ev)  # the training round: Nesterov
    assert not ev["flush"]
    # Both islands at the last step: no training round is left (round 2 would need step 4).
    for i in range(2):
        d.send(peer(i), hb(i, 3), now=2.0)
    assert d.st.rounds[2].flush
    v1, m1 = frag_state(d)
    last = {i: delta(i, 2) for i in range(2)}
    for i in range(2):
        d.send_all(peer(i), pushes(i, 2, steps=1, tokens=5 + 2 * i, base=1), now=2.0)
    ev = [e for e in d.st.events if "round" in e][-1]
    assert ev["flush"] and ev["changed"] and d.st.phase == "final"
    weights = {int(k): w for k, w in ev["weights"].items()}
    lr, mu = (1.0, 0.0) if merge == "mean" else (0.7, 0.9)
    ref, _ = reference_commit(v1, m1, {i: flat(t).numpy() for i, t in last.items()}, weights, ev["fold_order"], E,
                              lr=lr, mu=mu)
    v2, _ = frag_state(d)
    assert bitwise(v2, ref)
    if merge == "mean":
        # The plain weighted mean, computed another way (float64), agrees to fp32 rounding.
        mean = sum(w * flat(last[i]).double().numpy() for i, w in weights.items()) / sum(weights.values())
        assert np.allclose(v2, v1 + mean, atol=1e-6)
        assert not bitwise(v2, reference_commit(v1, m1, {i: flat(t).numpy() for i, t in last.items()}, weights,
                                                ev["fold_order"], E)[0])


def test_a_cut_carries_the_last_committed_round_also_after_resume() -> None:
    """An island that joins (or rejoins) after round 1 committed gets a cut saying round 1, so
    with synchronous rounds it does not wait for a round that went by without it; a resumed
    syncer's cut says the last round before its checkpoint's next round."""
    cfg = replace(CFG, islands=3, quorum=2)
    d = started(cfg)
    open_round(d, 1)
    for i in range(3):
        d.send_all(peer(i), pushes(i, 1, steps=2, tokens=10), now=1.0)
    assert d.st.versions() == (1,) and d.st.fragments[0].round == 1
    out = d.send(peer(2), hello(2, gen=31, numel=(NUMEL,)), now=2.0)  # a redial: a new generation
    cuts = streams(out)
    assert [(o.cut, o.version, o.round) for o in cuts] == [(True, 1, 1)], cuts
    snap = d.st.snapshot()
    d.st.release_snapshot()
    resumed = Driver(cfg, snapshot=snap)
    assert resumed.st.fragments[0].round == 1 and resumed.st.roundbook.next_open == 2
    out = resumed.send(peer(0), hello(0, numel=(NUMEL,)), now=0.0)
    assert [(o.cut, o.round) for o in streams(out)] == [(True, 1)]


def test_a_part_far_above_the_reference_norm_is_clipped_not_folded_whole() -> None:
    """Round 1 sets the fragment's reference RMS; in round 2 island 2 pushes 20x that (above the
    clip, 8x, below the refusal, 64x): each of its parts is folded scaled down to the clip norm,
    counted per island, and the round commits with all three."""
    d = started()
    open_round(d, 1)
    out = []
    for i in range(3):
        out += d.send_all(peer(i), pushes(i, 1), now=1.0)
    out += d.run(1.0)
    assert not errors(out) and d.st.versions() == (1,)
    rms = sorted(float(np.sqrt(np.mean(flat(delta(i, 1)).numpy().astype(np.float64) ** 2))) for i in range(3))[1]
    open_round(d, 2, now=2.0)
    v0, m0 = frag_state(d)
    big = [(n, t * 20.0) for n, t in delta(2, 2)]
    out = []
    for i in range(3):
        out += d.send_all(peer(i), pushes(i, 2, base=1, t=big if i == 2 else None), now=2.0)
    out += d.run(2.0)
    assert not errors(out) and d.st.versions() == (2,)
    ev = d.st.events[-1]
    assert ev["round"] == 2 and sorted(int(k) for k in ev["weights"]) == [0, 1, 2]
    assert f"i2:clipped{N_PARTS}" in d.st.reference.summary()
    # The reference: island 2's parts scaled to 8 x rms x sqrt(elements) each (fp32 rounding aside).
    d2 = flat(big).numpy().astype(np.float64)
    for k in range(N_PARTS):
        lo, hi = k * E, min(NUMEL, (k + 1) * E)
        d2[lo:hi] *= min(1.0, 8.0 * rms * np.sqrt(hi - lo) / np.linalg.norm(d2[lo:hi]))
    deltas = {0: flat(delta(0, 2)).numpy(), 1: flat(delta(1, 2)).numpy(), 2: d2.astype(np.float32)}
    weights = {int(k): w for k, w in ev["weights"].items()}
    ref, _ = reference_commit(v0, m0, deltas, weights, ev["fold_order"], E)
    v, _m = frag_state(d)
    assert np.allclose(v, ref, rtol=1e-5, atol=1e-6)
    unclipped, _ = reference_commit(v0, m0, {**deltas, 2: flat(big).numpy()}, weights, ev["fold_order"], E)
    assert not np.allclose(v, unclipped, rtol=1e-3, atol=1e-4)  # the clip changed the merge

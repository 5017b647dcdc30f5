"""Admitted but lying or silent islands against a live ``yeto-syncer`` (issue 23, items 2-4), written as
the attacks: absurd tokens, a 1e30 and a 3e38 delta, a second key claiming a live id, and an island
that heartbeats but never pushes.  Real processes, real sockets (``security_setup``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diloco.wire import Bcast, Error, Heartbeat, Pull, Welcome
from security_setup import SHAPES, Setup, hello, last_status, push_header, start, tensors
from syncer_harness import Island, reference_fragment

pytestmark = [pytest.mark.integ, pytest.mark.timeout(180)]


def events(s: Setup) -> list[dict[str, Any]]:
    path: Path = s.syncer.log_path.parent / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def commit_of(s: Setup, round_: int, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = [e for e in events(s) if e.get("round") == round_ and "fold_order" in e]
        if got:
            return got[-1]
        assert time.monotonic() < deadline, f"round {round_} did not commit: {s.syncer.log()[-3000:]}"
        time.sleep(0.05)


def new_value(isl: Island, version: int) -> list[np.ndarray]:
    while True:
        m = isl.expect(Bcast, strict=False)
        if (m.header.fragment, m.header.version) == (0, version):
            return [t.numpy() for _n, t in m.tensors]


@pytest.mark.parametrize("attack", ["tokens", "tokens-first", "1e30", "3e38"])
def test_a_lying_island_cannot_move_the_merged_value_beyond_the_honest_range(tmp_path, attack: str) -> None:
    s = start(tmp_path, "hmac")
    try:
        rng = np.random.default_rng(4)
        honest = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
        if attack == "tokens-first":
            # The liar pushes first, before any weight was seen: nothing caps it when it is folded.
            # Once the attempt is complete its weight fails the cap, the attempt is re-pulled, and
            # the next attempt caps it against the claims just seen.
            lie = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
            s.b.send(push_header(s.b, tokens=2**62), tensors(lie))
            time.sleep(0.3)
            s.a.send(push_header(s.a, tokens=100), tensors(honest))
            for isl in (s.a, s.b):
                assert isl.expect(Pull, strict=False).header.attempt == 1
            s.b.send(push_header(s.b, tokens=2**62, attempt=1), tensors(lie))
            s.a.send(push_header(s.a, tokens=100, attempt=1), tensors(honest))
            ev = commit_of(s, 1)
            assert ev["attempt"] == 1 and ev["weights"] == {"0": 100, "1": 400}
            ref, _ = reference_fragment(s.value[0], s.mom[0], {0: honest, 1: lie}, {0: 100, 1: 400},
                                        ev["fold_order"], 4096)
            assert "i1:capped" in last_status(s.syncer)
        else:
            s.a.send(push_header(s.a, tokens=100), tensors(honest))
            time.sleep(0.3)  # the honest push is seen first: the liar is capped when it is folded
        if attack == "tokens-first":
            pass
        elif attack == "tokens":
            lie = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
            s.b.send(push_header(s.b, tokens=2**62), tensors(lie))
            ev = commit_of(s, 1)
            assert ev["weights"] == {"0": 100, "1": 400}  # clamped, then capped at 4 x the median
            ref, _ = reference_fragment(s.value[0], s.mom[0], {0: honest, 1: lie}, {0: 100, 1: 400},
                                        ev["fold_order"], 4096)
            assert "i1:capped1,clamped1" in last_status(s.syncer)
        else:
            big = float(attack)
            s.b.send(push_header(s.b, tokens=100), tensors([np.full(sh, big, np.float32) for _n, sh in SHAPES]))
            assert s.b.expect(Error, strict=False).header.code == "bad_push"
            # The attempt is re-pulled without the liar; the honest island pushes again and it commits.
            assert s.a.expect(Pull, strict=False).header.attempt == 1
            s.a.send(push_header(s.a, tokens=100, attempt=1), tensors(honest))
            ev = commit_of(s, 1)
            assert ev["pushed"] == [0] and ev["attempt"] == 1
            ref, _ = reference_fragment(s.value[0], s.mom[0], {0: honest}, {0: 100}, ev["fold_order"], 4096)
            assert "i1:refused1" in last_status(s.syncer)
        got = new_value(s.a, 1)
        for g, want, v0 in zip(got, ref, s.value[0]):
            assert np.array_equal(g, want)
            # Within what the honest deltas allow: |value - v0| <= lr x (1 + mu) x max|delta|.
            assert float(np.abs(g - v0).max()) <= 0.7 * 1.9 * 0.01 * 6
        # Rounds keep committing: round 2 (fragment 1) with both islands.
        for isl in (s.a, s.b):
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=2))
        for isl in (s.a, s.b):
            assert isl.expect(Pull, strict=False).header.round == 2
            isl.send(push_header(isl, fragment=1, round=2, tokens=100), tensors(honest))
        assert commit_of(s, 2)["pushed"] == [0, 1]
    finally:
        s.close()


def test_a_second_key_claiming_a_live_id_is_refused(tmp_path) -> None:
    s = start(tmp_path, "curve")
    try:
        s.evil.send(hello(s.evil))  # island 1's id, from the "evil" key (admitted, but not island 1's)
        err = s.evil.expect(Error)
        assert err.header.code == "key_not_owner", err.header
        assert "belongs to another key" in err.header.reason
        # Island 1 is untouched: still bound, it pushes and round 1 commits.
        rng = np.random.default_rng(2)
        d = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
        for isl in (s.a, s.b):
            isl.send(push_header(isl, tokens=100), tensors(d))
        assert commit_of(s, 1)["pushed"] == [0, 1]
    finally:
        s.close()


def test_a_heartbeating_island_that_never_pushes_is_dropped_and_rounds_commit(tmp_path) -> None:
    s = start(tmp_path, "hmac", extra=["--islands", "3", "--quorum-timeout-s", "3"])
    c = s.island(2)
    try:
        rng = np.random.default_rng(6)
        d = [(rng.standard_normal(sh) * 0.01).astype(np.float32) for _n, sh in SHAPES]
        for isl in (s.a, s.b):  # round 1 opened before island 2 joined: it is not a member
            isl.send(push_header(isl, tokens=100), tensors(d))
        assert commit_of(s, 1)["pushed"] == [0, 1]
        c.send(hello(c))
        assert c.expect(Welcome, strict=False).header.versions == (1, 0)
        c.send(Heartbeat(island=2, generation=c.generation, step=0))
        time.sleep(0.3)
        for isl in (s.a, s.b, c):  # round 2 (fragment 1): all three are members
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=2))
        for isl in (s.a, s.b, c):
            assert isl.expect(Pull, strict=False).header.round == 2
        for isl in (s.a, s.b):  # island 2 keeps heartbeating but never pushes
            isl.send(push_header(isl, fragment=1, round=2, tokens=100), tensors(d))
        for _ in range(4):
            c.send(Heartbeat(island=2, generation=c.generation, step=2))
            time.sleep(0.5)
        ev = commit_of(s, 2, timeout_s=30)
        assert ev["pushed"] == [0, 1] and ev["attempt"] == 0
        assert [e["dropped_islands"] for e in events(s) if "dropped_islands" in e] == [[2]]
        assert "i2:lagged1" in last_status(s.syncer)
        # The dropped island is a member of the next round.
        for isl in (s.a, s.b, c):
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=3))
        assert c.expect(Pull, strict=False).header.round == 3
    finally:
        c.close()
        s.close()

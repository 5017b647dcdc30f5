"""The INIT value's digest, streamed as its parts are copied in (``syncer/core/initdigest.py``).

Driven like ``test_claims.py``: the real codec and the data plane's work run inline, here also
out of order (workers copy INIT parts in any order) and with a failed span.
"""

from __future__ import annotations

import random

import pytest

from diloco.digest import tensor_digest
from diloco.syncer.core.initdigest import InitDigest
from diloco.syncer.core.work import DigestSpan, Result
from diloco.syncer.dataplane import run_work
from diloco.wire import Held

from state_driver import Driver, of  # noqa: E402
from test_state import CFG, GEN, hello, init_values, inits, peer  # noqa: E402
from test_claims import OWN, claiming  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def kinds(work: list) -> list[str]:
    return [type(w).__name__ for w in work]


def test_next_span_hands_out_the_copied_prefix_one_span_at_a_time() -> None:
    from diloco.wire import FragmentLayout

    state = InitDigest.of(FragmentLayout.of([("a", (10,))]), 4)
    assert state.next_span() is None  # nothing copied
    state.copied_part(1)
    assert state.next_span() is None  # part 0 is not in: the stream cannot go past it
    state.copied_part(0)
    assert state.next_span() == (0, 2)
    state.copied_part(2)
    assert state.next_span() is None  # one span out at a time
    state.hashed_to(2)
    assert state.next_span() == (2, 3)
    state.hashed_to(3)
    state.copied_part(3)
    assert state.next_span() == (3, 4)


def test_next_span_waits_for_min_parts_except_at_the_end() -> None:
    from diloco.wire import FragmentLayout

    state = InitDigest.of(FragmentLayout.of([("a", (10,))]), 5)
    for k in range(2):
        state.copied_part(k)
    assert state.next_span(min_parts=3) is None
    state.copied_part(2)
    assert state.next_span(min_parts=3) == (0, 3)
    state.hashed_to(3)
    state.copied_part(3)
    assert state.next_span(min_parts=3) is None
    state.copied_part(4)
    assert state.next_span(min_parts=3) == (3, 5)  # the stream's rest: fewer is fine


def test_the_digest_streams_with_init_and_a_claim_needs_no_pass_of_its_own() -> None:
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    out = d.send_all(peer(0), inits(0) + inits(1))
    assert d.st.initialised
    for f in range(2):
        frag = d.st.fragments[f]
        assert frag.value_digest == (0, OWN[f]) and frag.init_digest is None and frag.digesting == -1
        assert frag.value_digest[1] == tensor_digest(frag.layout.flat_views(frag.value))  # type: ignore[union-attr]
    # Island 1 claims the values it starts from: answered at once, and no whole value is hashed.
    out = d.send(peer(1), claiming(1, GEN[1], OWN), now=1.0, run=False)
    assert [(o.peer, o.header.fragment) for o in of(out, Held)] == [(peer(1), 0), (peer(1), 1)]
    assert "DigestFragment" not in kinds(d.st.take_work())


@pytest.mark.parametrize("span_elems", [1, 1 << 30])
def test_parts_copied_out_of_order_still_hash_in_stream_order(monkeypatch: pytest.MonkeyPatch,
                                                               span_elems: int) -> None:
    from diloco.syncer.core import admission

    monkeypatch.setattr(admission, "SPAN_ELEMS", span_elems)  # a span per part; one span at the end
    rng = random.Random(3)
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    work: list = []
    for header, tensors in inits(0):  # fragment 0: three parts
        d.send(peer(0), header, tensors, run=False)
        work += d.st.take_work()
    assert kinds(work) == ["InitPart"] * 3
    spans = 0
    while work:
        w = work.pop(rng.randrange(len(work)))  # any order, spans too, as workers finish them
        d.st.on_result(run_work(w), 0.0)
        queued = d.st.take_work()
        assert all(isinstance(q, DigestSpan) for q in queued) and len(queued) <= 1
        spans += len(queued)
        work += queued
    frag = d.st.fragments[0]
    assert frag.initialised and spans >= 1
    assert frag.value_digest == (0, tensor_digest(init_values(0)))


def test_a_failed_span_falls_back_to_hashing_the_value_for_a_claim() -> None:
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    d.send_all(peer(0), inits(1))  # fragment 1 is whole and hashed
    for header, tensors in inits(0):
        d.send(peer(0), header, tensors, run=False)
    out: list = []
    while work := d.st.take_work():
        for w in work:
            result = run_work(w)
            if isinstance(w, DigestSpan):
                result = Result(w, error="disk on fire")  # the span's worker failed
            out += d.st.on_result(result, 0.0)
    frag = d.st.fragments[0]
    assert frag.initialised and frag.init_digest is None and frag.value_digest is None and frag.digesting == -1
    out = d.send(peer(1), claiming(1, GEN[1], OWN), now=1.0, run=False)
    queued = d.st.take_work()
    assert kinds(queued) == ["DigestFragment"] and queued[0].fragment == 0  # fragment 1 needs none
    assert [o.header.fragment for o in of(out, Held)] == [1]
    out = [o for w in queued for o in d.st.on_result(run_work(w), 1.0)]
    assert [o.header.fragment for o in of(out, Held)] == [0]


def test_a_restarted_init_ignores_the_old_streams_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.syncer.core import admission

    monkeypatch.setattr(admission, "SPAN_ELEMS", 1)  # a span per part, so one goes out mid-stream
    d = Driver(CFG)
    d.send(peer(0), hello(0, GEN[0]))
    first = inits(0)
    for header, tensors in first[:2]:
        d.send(peer(0), header, tensors, run=False)
    old = d.st.take_work()
    for w in old:  # both parts copied: a span of the old value goes out
        d.st.on_result(run_work(w), 0.0)
    stale = d.st.take_work()
    assert kinds(stale) == ["DigestSpan"]
    # Island 0 redials and streams fragment 0 again, with other values: a fresh value and hasher.
    other = [(n, t + 1.0) for n, t in init_values(0)]
    d.send(peer(0), hello(0, 4242), now=1.0)
    d.send_all(peer(0), inits(0, gen=4242, values=other), now=1.0)
    for w in stale:  # the old span lands late: ignored
        d.st.on_result(run_work(w), 1.0)
    assert d.st.take_work() == []
    frag = d.st.fragments[0]
    assert frag.initialised and frag.value_digest == (0, tensor_digest(other))


"""The island's side of a held FINAL (``Final.held``): the value it names is taken from the
parked BCAST, or left to the anchors with the digest taken as it arrived; a BCAST that stopped
arriving is dropped; a held notice carrying bytes is refused; one refetch drops every held notice
not taken, so the new session's full FINALs land."""

from __future__ import annotations

import pytest
import torch

from diloco import wire
from diloco.digest import tensor_digest

from test_client_protocol import GEN, Syncer, _protocol  # noqa: E402

pytestmark = pytest.mark.timeout(30)

E = 4 * wire.PART_ALIGN_ELEMS
N = E + 16  # two parts per fragment


def _welcome(p, s: Syncer, gen: int, now: float) -> None:
    p.hello(gen)
    s.nonce, s.seq = 1007 + gen, 0
    p.handle(s.frames(wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=7, need_init=False, versions=(0, 0),
                                   sync_every=10, total_steps=0, generation=gen, nonce=s.nonce,
                                   initialised=(True, True), part_elems=E)), now=now)


def _joined() -> tuple:
    p, s = _protocol(shape=(N,)), Syncer()
    _welcome(p, s, GEN, 0.1)
    return p, s


def _bcast_part(s: Syncer, f: int, version: int, value: torch.Tensor, k: int) -> list:
    lo, hi = k * E, min(N, (k + 1) * E)
    return s.frames(wire.Bcast(fragment=f, version=version, round=version, cut=False, part=k, n_parts=2),
                    [("w", value[lo:hi])])


def _bcast(p, s: Syncer, f: int, version: int, value: torch.Tensor, now: float) -> None:
    for k in range(2):
        p.handle(_bcast_part(s, f, version, value, k), now=now)


def _held(f: int, version: int) -> wire.Final:
    return wire.Final(fragment=f, version=version, n_fragments=2, versions=(version, version), part=0, n_parts=0,
                      held=True)


def _full_final(s: Syncer, f: int, version: int, value: torch.Tensor) -> list[list]:
    return [s.frames(wire.Final(fragment=f, version=version, n_fragments=2, versions=(version, version), part=k,
                                n_parts=2), [("w", value[k * E : min(N, (k + 1) * E)])]) for k in range(2)]


def _value(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def test_a_held_final_takes_the_parked_bcast_it_names() -> None:
    p, s = _joined()
    p.report_step(4, done=True)
    v = _value(1)
    _bcast(p, s, 0, 3, v, now=1.0)
    assert p.received_digest(0, 3) == tensor_digest([("w", v)]) and p.received_digest(0, 2) == ""
    p.handle(s.frames(_held(0, 3)), now=1.1)
    assert p.final_received() == 1 and not p.has_bcasts()
    header, values = p.take_final(0) or (None, [])
    assert header is not None and header.held and torch.equal(values[0][1], v)
    assert p.stats.refused == 0


def test_a_held_final_drops_a_bcast_that_stopped_arriving() -> None:
    # The syncer sends a held notice behind the last value it streams to us: a BCAST still
    # assembling when the notice comes lost its later parts. It is dropped, and the notice
    # comes without a value (no digest of that version): the caller refetches.
    p, s = _joined()
    p.report_step(4, done=True)
    v = _value(2)
    p.handle(_bcast_part(s, 1, 5, v, 0), now=1.0)
    p.handle(s.frames(_held(1, 5)), now=1.1)
    header, values = p.take_final(1) or (None, [1])
    assert header is not None and header.held and values == [] and p.received_digest(1, 5) == ""
    assert not p.has_bcasts() and p.stats.refused == 0


def test_one_refetch_drops_every_held_final_not_taken_and_stale_notices_until_the_new_session() -> None:
    p, s = _joined()
    p.report_step(4, done=True)
    for f in (0, 1):  # neither value ever arrived here
        p.handle(s.frames(_held(f, 3)), now=1.0)
    assert p.final_received() == 2
    assert (p.take_final(0) or (None, [1]))[1] == []
    p.refetch_final(0)
    assert p.final_received() == 0  # fragment 1's notice went too: one redial serves both
    p.handle(s.frames(_held(1, 3)), now=1.1)  # a resend of the session we leave: ignored
    assert p.final_received() == 0
    p.redialing(now=2.0)
    _welcome(p, s, GEN + 1, 2.1)
    values = {f: _value(10 + f) for f in (0, 1)}
    for f in (0, 1):
        for frames in _full_final(s, f, 3, values[f]):
            p.handle(frames, now=2.2)
    for f in (0, 1):
        header, got = p.take_final(f) or (None, [])
        assert header is not None and not header.held and torch.equal(got[0][1], values[f])
    # The new session's notices are heard again (a resend of an installed fragment changes nothing).
    p.handle(s.frames(_held(1, 3)), now=2.3)
    assert p.final_received() == 2 and p.stats.refused == 0


def test_a_replay_of_the_accepted_version_after_done_is_hashed() -> None:
    p, s = _joined()
    v = _value(5)
    _bcast(p, s, 0, 3, v, now=1.0)  # before our done: not hashed
    p.report_step(4, done=True)
    _bcast(p, s, 0, 3, v, now=1.5)  # a replay of that version: the same bytes, now hashed
    assert p.received_digest(0, 3) == tensor_digest([("w", v)])
    assert [b.version for b in p.take_bcasts()] == [3]  # parked once


def test_a_held_final_of_an_applied_value_leaves_it_to_the_anchors_or_is_refetched() -> None:
    p, s = _joined()
    v = _value(3)
    _bcast(p, s, 0, 2, v, now=1.0)  # before our done: not hashed
    assert p.received_digest(0, 2) == ""
    p.report_step(4, done=True)
    _bcast(p, s, 0, 3, v + 1, now=1.5)
    assert [b.version for b in p.take_bcasts()] == [3]  # the training thread took it (staged)
    p.handle(s.frames(_held(0, 3)), now=2.0)
    header, values = p.take_final(0) or (None, [1])
    assert header is not None and header.held and values == []  # install it from the anchors
    assert p.received_digest(0, 3) == tensor_digest([("w", v + 1)])
    # A held notice carrying bytes is refused.
    p.handle(s.frames(_held(1, 3), [("w", v[:E])]), now=2.1)
    assert p.stats.refused == 1 and p.final_received() == 1
    # Fragment 1 is held, but we never got its value: refetched, the full FINAL then lands.
    p.handle(s.frames(_held(1, 3)), now=2.2)
    assert (p.take_final(1) or (None, [1]))[1] == []
    p.refetch_final(1)
    assert p.final_received() == 1
    for frames in _full_final(s, 1, 3, v):
        p.handle(frames, now=2.3)
    header, values = p.take_final(1) or (None, [])
    assert header is not None and not header.held and torch.equal(values[0][1], v)


def test_a_new_syncer_instance_forgets_the_digests_and_the_final_values_not_taken() -> None:
    p, s = _joined()
    p.report_step(4, done=True)
    v = _value(4)
    _bcast(p, s, 0, 3, v, now=1.0)
    assert p.received_digest(0, 3)
    p.handle(s.frames(_held(0, 3)), now=1.5)
    p.handle(s.frames(_held(1, 3)), now=1.5)
    assert p.take_final(0) is not None  # taken (installed): kept, its resends stay dropped
    p.redialing(now=2.0)
    p.hello(GEN + 1)
    p.handle(s.welcome(GEN + 1, syncer_id=99), now=2.1)
    assert p.received_digest(0, 3) == ""
    assert p.final_received() == 1  # fragment 1's notice was the old instance's: forgotten

"""The island's side of a held FINAL (``Final.held``): the value it names is taken from the
parked BCAST, from a BCAST still arriving, or left to the anchors with the digest taken as it
arrived; a held notice carrying bytes is refused, and a refetch lets the full FINAL land."""

from __future__ import annotations

import pytest
import torch

from diloco import wire
from diloco.digest import tensor_digest

from test_client_protocol import GEN, Syncer, _protocol  # noqa: E402

pytestmark = pytest.mark.timeout(30)

E = 4 * wire.PART_ALIGN_ELEMS
N = E + 16  # two parts per fragment


def _joined() -> tuple:
    p, s = _protocol(shape=(N,)), Syncer()
    p.hello(GEN)
    s.nonce, s.seq = 1007, 0
    p.handle(s.frames(wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=7, need_init=False, versions=(0, 0),
                                   sync_every=10, total_steps=0, generation=GEN, nonce=s.nonce,
                                   initialised=(True, True), part_elems=E)), now=0.1)
    return p, s


def _bcast_part(s: Syncer, f: int, version: int, value: torch.Tensor, k: int) -> list:
    lo, hi = k * E, min(N, (k + 1) * E)
    return s.frames(wire.Bcast(fragment=f, version=version, round=version, cut=False, part=k, n_parts=2),
                    [("w", value[lo:hi])])


def _held(f: int, version: int) -> wire.Final:
    return wire.Final(fragment=f, version=version, n_fragments=2, versions=(version, version), part=0, n_parts=0,
                      held=True)


def _value(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def test_a_held_final_takes_the_parked_bcast_it_names() -> None:
    p, s = _joined()
    p.report_step(4, done=True)
    v = _value(1)
    for k in range(2):
        p.handle(_bcast_part(s, 0, 3, v, k), now=1.0)
    assert p.received_digest(0, 3) == tensor_digest([("w", v)]) and p.received_digest(0, 2) == ""
    p.handle(s.frames(_held(0, 3)), now=1.1)
    assert p.final_received() == 1 and not p.has_bcasts()
    header, values = p.take_final(0) or (None, [])
    assert header is not None and header.held and torch.equal(values[0][1], v)
    assert p.stats.refused == 0


def test_a_held_final_waits_for_the_bcast_still_arriving() -> None:
    p, s = _joined()
    p.report_step(4, done=True)
    v = _value(2)
    p.handle(_bcast_part(s, 1, 5, v, 0), now=1.0)
    p.handle(s.frames(_held(1, 5)), now=1.1)  # overtook the BCAST's last part
    assert p.take_final(1) is None  # still arriving: wait for it
    p.handle(_bcast_part(s, 1, 5, v, 1), now=1.2)
    header, values = p.take_final(1) or (None, [])
    assert header is not None and torch.equal(values[0][1], v) and not p.has_bcasts()


def test_a_held_final_of_an_applied_value_leaves_it_to_the_anchors_or_is_refetched() -> None:
    p, s = _joined()
    v = _value(3)
    for k in range(2):  # before our done: not hashed
        p.handle(_bcast_part(s, 0, 2, v, k), now=1.0)
    assert p.received_digest(0, 2) == ""
    p.report_step(4, done=True)
    for k in range(2):
        p.handle(_bcast_part(s, 0, 3, v + 1, k), now=1.5)
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
    final = wire.Final(fragment=1, version=3, n_fragments=2, versions=(3, 3), part=0, n_parts=2)
    p.handle(s.frames(final, [("w", v[:E])]), now=2.3)
    p.handle(s.frames(wire.Final(fragment=1, version=3, n_fragments=2, versions=(3, 3), part=1, n_parts=2),
                      [("w", v[E:])]), now=2.3)
    header, values = p.take_final(1) or (None, [])
    assert header is not None and not header.held and torch.equal(values[0][1], v)


def test_a_new_syncer_instance_forgets_the_digests() -> None:
    p, s = _joined()
    p.report_step(4, done=True)
    v = _value(4)
    for k in range(2):
        p.handle(_bcast_part(s, 0, 3, v, k), now=1.0)
    assert p.received_digest(0, 3)
    p.redialing(now=2.0)
    p.hello(GEN + 1)
    p.handle(s.welcome(GEN + 1, syncer_id=99), now=2.1)
    assert p.received_digest(0, 3) == ""

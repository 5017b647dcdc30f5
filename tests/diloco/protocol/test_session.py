"""The session rules both sides call (diloco.protocol.session), with plain values."""

from __future__ import annotations

import pytest

from diloco.protocol import session

pytestmark = pytest.mark.timeout(30)


def test_ids_are_never_zero() -> None:
    assert session.draw_id(lambda bits: 0) == 1
    assert session.draw_id(lambda bits: 5) == 5
    assert 0 < session.draw_id() < 2 ** session.ID_BITS


def test_a_hello_is_outside_every_session() -> None:
    assert session.opens_session(0, 0)
    assert not session.opens_session(7, 0) and not session.opens_session(0, 1)


def test_nonce_and_sequence_rules() -> None:
    assert session.foreign_nonce(5, 0)  # no session open: everything is foreign
    assert session.foreign_nonce(5, 6) and not session.foreign_nonce(6, 6)
    assert session.replayed(3, 3) and session.replayed(2, 3) and not session.replayed(4, 3)


def test_a_welcome_answers_only_our_hello() -> None:
    assert session.welcome_answers(generation=9, nonce=4, msg_nonce=4, our_generation=9, session_nonce=0)
    assert not session.welcome_answers(9, 4, 4, our_generation=8, session_nonce=0)  # another connection's
    assert not session.welcome_answers(9, 4, 4, our_generation=9, session_nonce=4)  # a session is open already
    assert not session.welcome_answers(9, 0, 0, our_generation=9, session_nonce=0)  # opens no session
    assert not session.welcome_answers(9, 4, 3, our_generation=9, session_nonce=0)  # stamped with another


def test_generations_and_instances() -> None:
    assert session.generation_problem(7, 7, {5}) is None
    assert session.generation_problem(5, 7, {5}) == "old_generation"
    assert session.generation_problem(6, 7, {5}) == "unknown_generation"
    assert session.another_process(instance=2, peer=b"b", bound_instance=1, bound_peer=b"a")
    assert not session.another_process(instance=1, peer=b"b", bound_instance=1, bound_peer=b"a")  # a redial
    assert not session.another_process(instance=2, peer=b"a", bound_instance=1, bound_peer=b"a")  # same socket

"""The session rules both sides apply: HELLO, generations, instances, nonces and sequence numbers
(docs/PROTOCOL.md, "Handshake", "Sessions and replays").

A connection is a **generation**: a fresh random id the island draws for every dial and sends
in its HELLO. The syncer answers with WELCOME, which echoes the generation and opens a
**session** with a random nonce; from then on every message, both ways, carries that nonce and
a strictly increasing sequence number. A HELLO itself carries neither (nonce 0, seq 0). An
island process also sends an **instance** id, drawn once per process and kept across redials,
so the syncer can tell a reconnect from a second process claiming the same island id.

Each rule is a pure function of plain values: the syncer's admission
(``diloco.syncer.core.sessions``) and the island's inbox (``diloco.island.inbox``) both call
these, so the two sides cannot disagree on what belongs to a session. No I/O, no state.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

ID_BITS = 63
"""Bits of a generation and of a session nonce (0 is never drawn: it means "none")."""


def draw_id(getrandbits: Callable[[int], int] = random.getrandbits) -> int:
    """A fresh generation or session nonce: ``ID_BITS`` random bits, never 0."""
    return getrandbits(ID_BITS) or 1


def opens_session(nonce: int, seq: int) -> bool:
    """Whether a HELLO is stamped as one must be: outside any session (nonce 0, seq 0)."""
    return nonce == 0 and seq == 0


def foreign_nonce(nonce: int, session_nonce: int) -> bool:
    """Whether a message carrying ``nonce`` is *not* of the session ``session_nonce`` (0: no session
    is open, so every message is foreign)."""
    return not session_nonce or nonce != session_nonce


LANE_BIT = 1 << (ID_BITS - 1)


def lane_nonce(session_nonce: int) -> int:
    """The nonce of the session's INIT lane (``wire.Lane``): the session's with its top bit flipped, so
    a message of one connection never passes as the other's (each has its own sequence numbers)."""
    return session_nonce ^ LANE_BIT if session_nonce else 0


def replayed(seq: int, last_seq: int) -> bool:
    """Whether sequence number ``seq`` fails to follow ``last_seq``, the last one accepted in the
    session (a replay, or a message overtaken by a later one)."""
    return seq <= last_seq


def welcome_answers(generation: int, nonce: int, msg_nonce: int, our_generation: int, session_nonce: int) -> bool:
    """Whether a WELCOME answers our HELLO: no session is open yet, it echoes our generation, and it
    opens a session (a non-zero nonce, the one it is itself stamped with)."""
    return not session_nonce and generation == our_generation and bool(nonce) and msg_nonce == nonce


def generation_problem(generation: int, current: int, retired: Collection[int]) -> str | None:
    """Why a message of ``generation`` is not of the island's ``current`` connection (None if it is):
    ``old_generation`` for one a later HELLO replaced (``retired``), else ``unknown_generation``."""
    if generation == current:
        return None
    return "old_generation" if generation in retired else "unknown_generation"


def another_process(instance: int, peer: bytes, bound_instance: int, bound_peer: bytes) -> bool:
    """Whether a HELLO (``instance`` from routing id ``peer``) comes from another process than the
    island's current binding: another instance *and* another routing id. A redial of the same
    process keeps its instance; a reused routing id is the same connection."""
    return instance != bound_instance and peer != bound_peer

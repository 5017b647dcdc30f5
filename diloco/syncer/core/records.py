"""Plain records the syncer's core keeps: islands, fragments, rounds, outputs.

Kept apart from the tables that own them (``sessions.py``, ``book.py``, ``roundbook.py``) so
the transition logic reads as protocol rules and these classes read as the data the rules
touch. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.syncer.core.initdigest import InitDigest
from diloco.wire.parts import FragmentLayout

# (name, dtype name, shape) of one tensor of a fragment, in the plan's order.
TensorSpec = tuple[str, str, tuple[int, ...]]


@dataclass
class Ledger:
    """What an island contributed: merged pushes, local steps and tokens behind them."""

    merges: int = 0
    steps: int = 0
    tokens: int = 0

    def to_json(self) -> dict[str, int]:
        return {"merges": self.merges, "steps": self.steps, "tokens": self.tokens}


@dataclass
class IslandRecord:
    """One island's binding and progress.

    ``generation`` and ``peer`` change together at HELLO; every other message
    must carry the current generation. ``cut_sent`` is per generation: a
    reconnect (or a revival after being declared dead) clears it (:meth:`recut`) so the island
    receives the full current cut again before it is asked to push. A cut goes out fragment by
    fragment (``cut_given``): each as soon as it holds a value, as a stream or, when the
    island's HELLO claimed exactly that value, as a HELD notice (``cut_held``).
    """

    island: int
    generation: int = -1
    peer: bytes = b""
    wire_dtype: str = "float32"
    bound: bool = False
    joined: bool = False
    """Said HELLO at least once to this syncer instance (never reset)."""
    alive: bool = False
    last_step: int = 0
    done: bool = False
    last_seen: float = 0.0
    cut_sent: bool = False
    """Every fragment of the current cut was given (streamed or HELD)."""
    cut_given: set[int] = field(default_factory=set)
    """Fragments of the current cut already given (streamed, or answered HELD)."""
    cut_held: list[int] = field(default_factory=list)
    """Fragments of the current cut answered HELD (for the log line when the cut completes)."""
    claims: tuple[str, ...] = ()
    """The current HELLO's ``holds``: per fragment the digest of the value the island holds
    (``""``: no claim); ``()``: no claims."""
    done_values: dict[int, int] = field(default_factory=dict)
    """Per fragment, the version of the last fp32 value streamed to the island in this session
    after it said it is done (``Heartbeat.done``): the island hashed it as it arrived, so a
    FINAL of that version goes as a HELD notice (``Final.held``), not as bytes again. At most
    one entry per fragment; cleared with the cut (a new HELLO, a revival) and on a send error."""
    final_acked: bool = False
    final_digests: tuple[str, ...] = ()
    """Per-fragment digests of what the island says it installed (its FINAL_ACK)."""
    owed: dict[int, bool] = field(default_factory=dict)
    """Fragments whose value stream to this island was abandoned on a send error: resent
    (BCAST, or FINAL while finalizing) once we hear from the island again; the value says
    whether the lost stream was a cut (then the resend is one too)."""
    owe_pulls: bool = False
    """A PULL to this island was lost on a send error: re-pull its open rounds once heard."""
    lost_at: float = -1.0
    """Clock of the last send failure to this island (resends wait for a message after it)."""
    refusals_in_row: int = 0
    """PUSH refusals since its last accepted push (``--max-refusals`` evicts)."""
    evicted: bool = False
    """Left out of rounds after ``--max-refusals`` refusals in a row, until a fresh HELLO."""
    refused_push: tuple[int, int] | None = None
    """(round, attempt) of a push whose part 0 was refused: its later parts are dropped quietly."""
    instance: int = 0
    """The island process's ``Hello.instance`` (0: unknown)."""
    retired_generations: set[int] = field(default_factory=set)
    ledger: Ledger = field(default_factory=Ledger)
    nonce: int = 0
    """Session nonce of the current binding (WELCOME); every later message carries it."""
    recv_seq: int = 0
    """Sequence number of the last accepted message from the island (strictly increasing)."""
    send_seq: int = 0
    """Sequence number of the last message sealed for the island."""
    lane: bytes = b""
    """Routing id of the session's second connection (``Lane``: INIT only), b"" for none; bound once
    per session."""
    lane_seq: int = 0
    """Sequence number of the last accepted message on the lane (its own, strictly increasing)."""
    via_lane: bool = False
    """The message being handled came on the lane (``Sessions.session`` to ``Sessions.touch``)."""

    def recut(self) -> None:
        """The island must receive the whole current cut again (a new HELLO, a revival)."""
        self.cut_sent = False
        self.cut_given = set()
        self.cut_held = []
        self.done_values = {}

    def has_cut(self, fragment: int) -> bool:
        """Whether ``fragment`` of the current cut was given (later versions of it then follow)."""
        return self.cut_sent or fragment in self.cut_given

    def holds_as_final(self, dtype: str, cut: bool = False) -> bool:
        """Whether a value stream in ``dtype`` sent now would stand for the island's final value
        (a held FINAL): an fp32 round value (not a cut: a cut goes to a session that may not have
        said done itself) after the island said it is done (it hashes what it receives then)."""
        return dtype == "float32" and self.done and not cut

    def streamed(self, fragment: int, version: int, dtype: str, cut: bool = False) -> None:
        """A value stream of ``fragment`` at ``version`` in ``dtype`` goes to the island now:
        remembered for a held FINAL when it would stand for the final value (:meth:`holds_as_final`);
        forgotten otherwise (the island's last value is another)."""
        if self.holds_as_final(dtype, cut):
            self.done_values[fragment] = version
        else:
            self.done_values.pop(fragment, None)

    def unsent(self, fragment: int, version: int) -> None:
        """The stream of ``fragment`` at ``version`` was not sent after all (superseded): its
        final value goes as bytes."""
        if self.done_values.get(fragment) == version:
            del self.done_values[fragment]

    def holds_final(self, fragment: int, version: int) -> bool:
        """Whether the island was streamed exactly this fp32 value of ``fragment`` after its done."""
        return self.done_values.get(fragment) == version

    def claim(self, fragment: int) -> str:
        """The digest the current HELLO claims for ``fragment`` (``""``: none)."""
        return self.claims[fragment] if fragment < len(self.claims) else ""


@dataclass
class FragmentRecord:
    """Global fp32 value, outer momentum and version of one fragment, as flat streams.

    ``value`` and ``momentum`` are one flat fp32 tensor each, in the fragment's stream
    order (``layout``); tensors are views of them.  ``value`` is never written in place:
    a commit writes the next value out of place (into the round's sum buffer), so
    broadcast frames and checkpoints may keep referencing a published value while the
    next commit runs.  ``momentum`` exists only with ``--outer-momentum > 0`` (allocated,
    zero, by the first commit that needs it) and is updated in place unless a checkpoint
    pins it.  ``value_absmax[k]`` / ``momentum_absmax[k]`` bound ``|value|`` / ``|momentum|``
    over part ``k`` (``inf``: unknown), for the commit's overflow bound.
    """

    index: int
    schema: tuple[TensorSpec, ...] = ()
    layout: FragmentLayout | None = None
    value: torch.Tensor | None = None
    momentum: torch.Tensor | None = None
    version: int = 0
    initialised: bool = False
    init_next_part: int = 0
    """INIT parts accepted so far (they must arrive in order)."""
    init_done_parts: int = 0
    """INIT parts copied in by the data plane."""
    committing: bool = False
    consuming: bool = False
    """The commit in flight may give the current value's pages back as it passes them
    (``CommitPart.consume``): until it lands, no stream, cut or digest of this version starts."""
    round: int = 0
    """The round whose commit produced ``version`` (0: the INIT value); after ``--resume``, the
    fragment's last round before the checkpoint's next round. Cuts carry it."""
    digest: str | None = None
    """``tensor_digest`` of the final value, computed on the data plane at finalization."""
    value_digest: tuple[int, str] | None = None
    """(version, ``tensor_digest`` of ``value`` at that version), computed on the data plane when
    an island claims to hold a value (``Cuts``); a new version or a restarted INIT voids it."""
    digesting: int = -1
    """The version whose ``value_digest`` the data plane is computing (-1: none); 0 from an INIT's
    first part while ``init_digest`` streams."""
    init_digest: InitDigest | None = None
    """The INIT value's digest as it streams (``initdigest.py``); None once known, or abandoned."""
    value_absmax: list[float] = field(default_factory=list)
    momentum_absmax: list[float] = field(default_factory=list)
    commit_s: float = 0.0
    """Seconds of the fragment's last commit (first part started -> last part done)."""


@dataclass
class PushRecord:
    """A push of one attempt: accepted parts stream in and are folded as they arrive.

    ``complete`` once every part has been folded into the round's running sum (a
    zero-weight push has no parts and is complete at once)."""

    island: int
    base_version: int
    local_steps: int
    tokens: int
    weight: int
    n_parts: int
    next_part: int = 0
    folded: int = 0
    last_part_at: float = 0.0

    @property
    def complete(self) -> bool:
        return self.folded >= self.n_parts


@dataclass
class RoundRecord:
    """An open round: its fragment, current attempt, frozen members and pushes.

    ``closed`` means the quorum rule fired; the round then waits for every
    earlier round to commit (commits are strictly in round order).  ``sum`` is the
    attempt's running weighted fp32 sum (None until a weighted part arrives).
    """

    round: int
    fragment: int
    attempt: int
    members: frozenset[int]
    attempt_started: float
    pushes: dict[int, PushRecord] = field(default_factory=dict)
    grace_deadline: float | None = None
    closed: bool = False
    flush: bool = False
    """Opened after every island finished: merges each island's last steps."""
    sum: Any = None
    commit_parts_left: int = 0
    commit_failed: str | None = None
    """Why a part of the commit was refused (its result not finite): the round is re-pulled."""
    new_momentum: torch.Tensor | None = None
    """The commit's momentum, written beside the old one (a pinned or unbounded commit only)."""
    committing: bool = False
    consumed: bool = False
    """The commit gave the old value's pages back as it passed them (the loop's check agreed)."""
    commit_absmax: list[tuple[float, float]] = field(default_factory=list)
    """Per part ``(max |value'|, max |momentum'|)`` the data plane measured (``nan``: not checked)."""
    commit_bounds: list[tuple[float, float]] = field(default_factory=list)
    """Per part bounds of ``(|value'|, |momentum'|)`` that the commit was started with."""
    commit_started: float = 0.0
    """Clock when the commit of the current attempt started (its event's ``commit_s`` counts from it)."""
    unjudged: bool = False
    """The attempt's first push came before any weight was seen (nothing to cap it against): the
    weights are judged when the attempt is complete (``robustrules.judge_unjudged``)."""
    pin_wait_since: float | None = None
    """Clock since when the closed round waits for a checkpoint in flight to write its fragment
    (with momentum, the commit updates it in place: ``commit.PIN_WAIT_S``)."""


@dataclass(frozen=True)
class Outgoing:
    """One small (control) message the loop must send: sent at once, never behind data.

    Attributes:
        peer: zmq routing id of the receiver.
        header: a ``diloco.wire`` header struct (no tensors).
    """

    peer: bytes
    header: Any


@dataclass(frozen=True)
class OutStream:
    """A parted fragment stream the loop must send: BCAST or FINAL of one version.

    The loop encodes the payload once per (fragment, version, dtype) on the data plane
    and paces the parts (see ``diloco.wire.pacing``)."""

    peer: bytes
    kind: str  # "BCAST" | "FINAL"
    fragment: int
    version: int
    round: int = 0
    cut: bool = False
    wire_dtype: str = "float32"
    versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class FragmentSnapshot:
    """Checkpointable state of one fragment (flat tensors are references, not copies)."""

    version: int
    schema: tuple[TensorSpec, ...]
    value: torch.Tensor
    momentum: torch.Tensor
    """Zeros (lazily mapped, no resident memory) for a fragment that has no momentum buffer."""
    momentum_is_zero: bool = False
    """``momentum`` is such zeros: the store writes a hole, not the bytes."""


@dataclass(frozen=True)
class Snapshot:
    """Everything a checkpoint holds (see docs/PROTOCOL.md, "Checkpoint").

    Attributes:
        fingerprint: layout fingerprint fixed by the first HELLO.
        n_fragments: number of fragments of the plan.
        fragments: per fragment version, schema, value and momentum.
        next_round: the first round not yet committed; resumes start there.
        ledgers: per island id, its ledger as a dict.
        hyper: outer hyper-parameters and weighting, for the record.
        order: the order the writer writes the fragments in (every index once; empty: index order).
    """

    fingerprint: str
    n_fragments: int
    fragments: tuple[FragmentSnapshot, ...]
    next_round: int
    ledgers: dict[int, dict[str, int]]
    hyper: dict[str, Any]
    order: tuple[int, ...] = ()

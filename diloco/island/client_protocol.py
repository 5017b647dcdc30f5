"""The island's side of the syncer protocol, with no I/O: messages and time in, effects out.

:class:`ClientProtocol` holds every rule of the sync rank's conversation with the syncer and
touches no socket, thread or clock of its own (h11's rule): the connection thread
(:class:`diloco.island.client.SyncClient`) hands it each message's frames and the time
(:meth:`ClientProtocol.handle`), asks it what the timers decide (:meth:`ClientProtocol.tick`),
has it seal what goes out (:meth:`ClientProtocol.seal`, streams cut into parts), and carries
out the :class:`Effects` it returns (redial after a delay, wake the training thread, queue a
control message). The training thread's questions (pulls to answer, values to install, the
final cut) are answered from the same state.

The rules live in three places, all methods of this class: the session and the timers here;
what a received message means in :mod:`diloco.island.inbox`; what goes out and how in
:mod:`diloco.island.outbox`. State the training thread also reads is changed only inside
``guard`` (the connection passes its lock; a test needs none), so a message's effect is seen
whole; the expensive part of a message (opening it, copying a part) runs outside it.

Unit-testable with scripted syncer messages: ``tests/diloco/island/test_client_protocol.py``.
"""

from __future__ import annotations

import contextlib
import logging
import random
from contextlib import AbstractContextManager

import torch

from diloco import quant, wire
from diloco.config import IslandConfig
from diloco.island.delta_source import PartRing
from diloco.island.effects import BACKOFF_MAX_S, BACKOFF_START_S, Effects, SyncError
from diloco.island.assembly import Assembly, ReceiveTarget
from diloco.island.inbox import Inbox
from diloco.island.liveness import Liveness
from diloco.island.orders import PendingBcast
from diloco.island.outbox import WINDOW, ClientStats, Outbox

log = logging.getLogger("diloco.island.client")

Tensors = list[tuple[str, torch.Tensor]]

__all__ = ["ClientProtocol", "Effects", "SyncError"]


class ClientProtocol(Inbox, Outbox):
    """The rules of one island's connection to the syncer, without I/O.

    Args:
        config: the island's configuration (id, key, wire dtype, timeouts, heartbeat).
        fingerprint: the layout fingerprint (hex) of this island's fragment plan.
        layouts: the flat stream of every fragment (names and global shapes in plan order).
        now: the current monotonic time (starts the silence and heartbeat clocks).
        receive_target: where received values may land directly (the island's anchors), or
            None: every received value is assembled in a pooled buffer.
        guard: held around every change of state the training thread reads (the
            connection's lock); ``contextlib.nullcontext()`` when one thread drives it.
        instance: this process's random instance number (the same across redials).
        claims: per fragment, ``tensor_digest`` of the fp32 value the island starts from, claimed
            in every HELLO until :meth:`drop_claims` (a fragment the syncer holds the same value
            of is answered HELD, not streamed); None: no claims.
    """

    def __init__(self, config: IslandConfig, fingerprint: str, layouts: list[wire.FragmentLayout], now: float,
                 receive_target: ReceiveTarget | None = None, guard: AbstractContextManager[object] | None = None,
                 instance: int | None = None, claims: list[str] | None = None) -> None:
        self._cfg = config
        self._fingerprint = fingerprint
        self._layouts = list(layouts)
        self._n_fragments = n = len(self._layouts)
        self._guard: AbstractContextManager[object] = guard if guard is not None else contextlib.nullcontext()
        self.stats = ClientStats()
        self.liveness = Liveness(now)
        """Progress clocks (what a waiting island counts as moving) and link measurements."""
        # Received fragments (BCAST, cuts) are assembled here: one fragment's worth kept idle.
        self.pool = wire.HostBufferPool(max_idle_bytes=max((lay.numel * 4 for lay in self._layouts), default=0))
        self.receive_target = receive_target
        """Where received values may land directly (the island's anchors), or None: pooled."""
        self.ring = PartRing(WINDOW)
        """Where pushes computed part by part (DeltaSource) land: ``WINDOW`` parts."""
        # State the training thread reads (changed inside the guard).
        self._welcome: wire.Welcome | None = None
        self._part_elems = wire.DEFAULT_PART_ELEMS
        self._generation = 0
        self._syncer_id: int | None = None
        self._pulls: dict[tuple[int, int], wire.Pull] = {}
        self._pulls_taken: dict[tuple[int, int], int] = {}
        self._bcasts: dict[int, PendingBcast] = {}
        self._accepted_version: list[int] = [-1] * n
        self._final: dict[int, tuple[wire.Final, Tensors]] = {}
        self._final_taken: set[int] = set()
        """Fragments of the final cut the training thread took (installed or installing)."""
        self._refetching = False
        """A held FINAL named a value we lack: held notices are ignored until the next WELCOME."""
        self._shutdown: str | None = None
        self._fatal: str | None = None
        self._instance = instance if instance is not None else random.getrandbits(62) + 1
        """Random per process, the same across redials: the syncer tells a reconnect of this
        process from a second process claiming our island id (``island_in_use``)."""
        self._last_refusal: str | None = None
        self._redial_delay = 0.0
        self._stale: list[tuple[int, int]] = []
        """(fragment, round) of pushes refused as ``stale_base``, for the boundary."""
        self._final_ack: wire.FinalAck | None = None
        """Our FINAL_ACK, resent after a redial during finalization (the syncer forgot it)."""
        self._bcast_digests: dict[int, tuple[int, str]] = {}
        """Per fragment, (version, digest) of the last accepted BCAST when it was hashed as it
        arrived (fp32, after our done): what a held FINAL of that version installed from the
        anchors is acknowledged with. At most one entry per fragment."""
        self._step = 0
        self._done = False
        self._claims: list[str] = list(claims) if claims and len(claims) == n else []
        """Per fragment, the digest of the value we hold and would take a cut over (``""``: none)."""
        self._init_held: tuple[bool, ...] = ()
        """The last WELCOME's ``initialised``: fragments whose INIT the syncer holds complete."""
        self._init_done: set[int] = set()
        """INIT fragments whose every part was handed to a socket (``Outbox.init_sent``)."""
        self._init_lost: set[int] = set()
        """INIT fragments sent whole on an old connection that the syncer lacks, to stream again."""
        # The connection's side only.
        self._seed = wire.digest_seed(config.key)
        self._nonce = 0
        """Session nonce of the current connection (0 until WELCOME)."""
        self._send_seq = 0
        self._recv_seq = 0
        self._lane_seq = 0
        """Sequence number of the last message sealed for the session's lane (``Outbox.lane_open``)."""
        self._lane_ready = False
        """The syncer bound this session's lane (``LaneOk``): INIT streams may go on it."""
        self._feedback = (quant.ErrorFeedback(config.wire_dtype, config.quant_block)
                          if config.wire_dtype in wire.QUANT_KINDS else None)
        """Residuals of low-bit pushes, per fragment, on the host where the gathered delta is."""
        self._assembling: dict[tuple[str, int], Assembly] = {}
        self._last_heard = now
        self._last_beat = 0.0
        self._backoff = BACKOFF_START_S

    # ------------------------------------------------------------------ session and timers
    def hello(self, generation: int) -> list:
        """A new connection under ``generation``: the session starts over; the frames of its
        HELLO (nonce 0, sequence 0: it opens a session), to send before anything else.

        The syncer resends the PULL of every open round we have not pushed to; a push lost
        with the old connection must be answered again, so what was taken is forgotten."""
        self._nonce = self._send_seq = self._recv_seq = self._lane_seq = 0
        self._lane_ready = False
        with self._guard:
            self._generation = generation
        hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, island=self._cfg.island_id, generation=generation,
                           fingerprint=self._fingerprint, n_fragments=self._n_fragments,
                           wire_dtype=self._cfg.wire_dtype, fragment_numel=tuple(lay.numel for lay in self._layouts),
                           quant_block=self._cfg.quant_block if self._feedback is not None else 0,
                           instance=self._instance, holds=tuple(self._claims) if any(self._claims) else ())
        return wire.encode(hello, key=self._cfg.key)

    def connection_lost(self) -> None:
        """The connection is closed (a redial follows): answers of the old one never come."""
        self.stats.redials += 1
        self.liveness.on_redial()

    def redialing(self, now: float) -> None:
        """Just before the new connection's HELLO: forget the old session's tables."""
        with self._guard:
            self._welcome = None
            self._pulls.clear()
            self._pulls_taken.clear()
        self._assembling.clear()
        self._last_heard = now

    def tick(self, now: float, rejoin: bool = False) -> Effects:
        """The timers' decisions at ``now``: redial after a silence longer than the sync timeout
        (with backoff), redial at once when a rejoin was asked, else a heartbeat when one is due."""
        out = Effects()
        if now - self._last_heard > self._cfg.sync_timeout_s:
            log.warning("island %d: no word from the syncer for %.0fs, redialing", self._cfg.island_id,
                        now - self._last_heard)
            out.redial_s = self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        elif rejoin:
            log.warning("island %d: the cut stopped arriving, rejoining", self._cfg.island_id)
            out.redial_s, out.rejoin = 0.0, True
        elif now - self._last_beat >= self._cfg.heartbeat_s:
            out.heartbeat = True
            self._last_beat = now
        return out

    def socket_error(self, exc: Exception) -> Effects:
        """The socket failed: redial with backoff."""
        log.warning("island %d: socket error %s, redialing", self._cfg.island_id, exc)
        out = Effects(redial_s=self._backoff)
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        return out

    def fail(self, why: str) -> None:
        """Something unexpected stopped the connection: every later question raises SyncError."""
        with self._guard:
            self._fatal = why

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise SyncError(self._fatal)

    # ------------------------------------------------------------------ the training thread's questions
    @property
    def generation(self) -> int:
        """The generation of the current connection."""
        with self._guard:
            return self._generation

    @property
    def lane_ready(self) -> bool:
        """Whether the syncer bound this session's INIT lane (its ``LaneOk`` came)."""
        return self._lane_ready

    @property
    def welcome(self) -> wire.Welcome | None:
        """The WELCOME of the current connection (None until it comes; a fatal refusal leaves
        it None and makes :meth:`check` raise)."""
        return self._welcome

    @property
    def part_elems(self) -> int:
        """Elements per part of every stream (the syncer's, from WELCOME; the default before)."""
        return self._part_elems

    @property
    def last_refusal(self) -> str | None:
        """The syncer's last refusal of our HELLO, while no WELCOME came."""
        return self._last_refusal

    @property
    def shutdown_reason(self) -> str | None:
        """Why the syncer sent SHUTDOWN (None: it did not)."""
        with self._guard:
            return self._shutdown

    def check(self) -> None:
        """Raise SyncError if the connection failed for good."""
        with self._guard:
            self._raise_fatal()

    def failed(self) -> bool:
        """Whether the connection failed for good (:meth:`check` raises)."""
        return self._fatal is not None

    def report_step(self, step: int, done: bool) -> bool:
        """Our step (rounds open by step); True when it changed (a heartbeat tells the syncer)."""
        with self._guard:
            changed = step != self._step or done != self._done
            self._step, self._done = step, done
            return changed

    def init_header(self, fragment: int) -> wire.Init:
        """The INIT of ``fragment`` (its parts are stamped again when sent)."""
        return wire.Init(island=self._cfg.island_id, generation=self.generation, fragment=fragment,
                         n_fragments=self._n_fragments)

    def push_header(self, pull: wire.Pull, base_version: int, local_steps: int, tokens: int) -> wire.Push:
        """A PUSH answering ``pull``; one with ``local_steps == 0`` weighs nothing and has no parts."""
        return wire.Push(island=self._cfg.island_id, generation=self.generation, fragment=pull.fragment,
                         round=pull.round, attempt=pull.attempt, base_version=base_version,
                         local_steps=local_steps, tokens=tokens, n_parts=0 if local_steps == 0 else 1)

    def final_ack(self, versions: list[int], digests: list[str] | None = None) -> wire.FinalAck:
        """Our FINAL_ACK of the installed final cut; kept, and resent after a redial."""
        header = wire.FinalAck(island=self._cfg.island_id, generation=self.generation, versions=tuple(versions),
                               digests=tuple(digests or ()))
        with self._guard:
            self._final_ack = header
        return header

    def drop_claims(self) -> list[int]:
        """Start-up is over (training may move the masters): claim nothing in later HELLOs and let
        go of HELD notices not taken yet (their fragments get a value at a later cut). Returns the
        fragments whose HELD was let go of."""
        with self._guard:
            self._claims = []
            dropped = [f for f, b in self._bcasts.items() if b.held]
            for f in dropped:
                del self._bcasts[f]
                self._accepted_version[f] = -1
            return dropped

    def take_stale(self) -> list[tuple[int, int]]:
        """(fragment, round) of our pushes the syncer refused as ``stale_base`` since last asked:
        it sends that fragment's current value and the PULL again."""
        with self._guard:
            out, self._stale = self._stale, []
            return out

    def take_ready_pulls(self) -> list[wire.Pull]:
        """Pulls to answer, oldest round first: per (fragment, round) the newest attempt,
        each (fragment, round, attempt) handed out once."""
        with self._guard:
            self._raise_fatal()
            ready = sorted(self._pulls.values(), key=lambda p: (p.round, p.fragment))
            for p in ready:
                self._pulls_taken[(p.fragment, p.round)] = p.attempt
            self._pulls.clear()
            return ready

    def take_bcasts(self) -> list[PendingBcast]:
        """Global values to apply (at most one per fragment, the newest), by fragment; none once
        the whole final cut is in."""
        with self._guard:
            self._raise_fatal()
            out = [self._bcasts[f] for f in sorted(self._bcasts)] if len(self._final) < self._n_fragments else []
            self._bcasts.clear()
            return out

    def has_bcasts(self) -> bool:
        """Whether a received value waits for :meth:`take_bcasts`."""
        return bool(self._bcasts)

    def final_fragments(self) -> dict[int, tuple[wire.Final, Tensors]] | None:
        """Every fragment of the final cut, once all have arrived; None before."""
        with self._guard:
            self._raise_fatal()
            if len(self._final) < self._n_fragments:
                return None
            return dict(self._final)

    def final_received(self) -> int:
        """How many fragments of the final cut have arrived (taken or not)."""
        with self._guard:
            self._raise_fatal()
            return len(self._final)

    def take_final(self, fragment: int) -> tuple[wire.Final, Tensors] | None:
        """Fragment ``fragment`` of the final cut once it has arrived (else None); its tensors
        are let go of here, so the final cut is held one fragment at a time. A held FINAL comes
        with the tensors of the BCAST it names when we still hold them unapplied; without tensors
        otherwise (the caller installs it from its anchors, or asks for the bytes:
        :meth:`refetch_final`)."""
        with self._guard:
            self._raise_fatal()
            got = self._final.get(fragment)
            if got is None:
                return None
            self._final[fragment] = (got[0], [])
            self._final_taken.add(fragment)
            return got

    def received_digest(self, fragment: int, version: int) -> str:
        """The digest of the BCAST of ``fragment`` at ``version`` we accepted last, taken as it
        arrived; ``""`` when that is not the value we accepted last or it was not hashed."""
        with self._guard:
            got = self._bcast_digests.get(fragment)
            return got[1] if got is not None and got[0] == version else ""

    def refetch_final(self, fragment: int) -> None:
        """Forget the held FINAL of ``fragment`` (we do not hold the value it names) and every held
        FINAL not taken yet, and ignore held notices until the next WELCOME: the FINALs the
        syncer sends the new session (always bytes) land instead, so one redial serves every
        fragment (the caller redials). Fragments already installed keep their entry: their bytes
        are dropped as resends."""
        with self._guard:
            self._final_taken.discard(fragment)
            for f in [g for g, (h, _) in self._final.items() if h.held and g not in self._final_taken]:
                del self._final[f]
            self._refetching = True

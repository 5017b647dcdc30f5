"""Island configuration: one typed object built from ``YETO_*`` variables in one place.

Every island process (every rank of a Megatron job) builds an :class:`IslandConfig`
with :meth:`IslandConfig.from_env` at start. A wrong value fails right there, with a
message naming the variable, instead of surfacing as a hang at the first sync: an
island that cannot reach or authenticate with the syncer should never train for an
hour before anyone notices.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from diloco.keys import read_key_file

WIRE_DTYPE_NAMES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A ``YETO_*`` variable is missing or malformed; the message names it."""


@dataclass(frozen=True)
class IslandConfig:
    """What an island needs to take part in DiLoCo rounds.

    Built by :meth:`from_env`; tests and the demo may construct it directly.
    """

    sync_addr: str
    """``YETO_SYNC_ADDR``: the syncer's zmq address, e.g. ``tcp://10.0.0.5:5555``. Required."""

    island_id: int
    """``YETO_ISLAND_ID``: this island's id, ``0 <= id < --islands`` of the syncer. Island 0
    streams INIT when the syncer starts fresh. Required."""

    key: bytes = b""
    """``YETO_SYNC_KEY`` (the key itself) or ``YETO_SYNC_KEY_FILE`` (a file holding it): the
    shared HMAC key. Empty means unauthenticated (the syncer warns loudly)."""

    fragments: int = 4
    """``YETO_DILOCO_FRAGMENTS``: number of fragments the model is cut into. Every island and
    the syncer must agree (it is part of the layout fingerprint)."""

    alpha: float = 0.0
    """``YETO_DILOCO_ALPHA``: blend on apply, ``θ ← α·local + (1−α)·global``; 0 replaces the
    local value by the merged global one (classic DiLoCo). ``0 <= α < 1``."""

    apply_mode: str = "progress"
    """``YETO_DILOCO_APPLY``: ``progress`` (default) keeps the local steps taken between a push
    and the apply of that round's commit, ``θ ← θ_now + (global − θ_push)`` (docs/PROTOCOL.md);
    ``blend`` applies ``θ ← α·local + (1−α)·global`` with ``YETO_DILOCO_ALPHA``."""

    pushes_in_flight: int = 1
    """``YETO_DILOCO_PUSHES_IN_FLIGHT``: background pushes (gather + hand-off) that may be
    unfinished per rank; another push waits for the oldest. ``>= 1``."""

    transfer_timeout_s: float = 300.0
    """``YETO_DILOCO_TRANSFER_TIMEOUT_S``: bound on every background transfer wait and on the
    data group's collectives; a rank that died shows up as an error within it."""

    tune_malloc: bool = True
    """``YETO_DILOCO_TUNE_MALLOC``: pin glibc's mmap / trim thresholds at start so training
    steps do not pay page faults (``diloco/island/hostmem.py``)."""

    wire_dtype: str = "float32"
    """``YETO_WIRE_DTYPE``: ``float32`` or ``bfloat16`` for pushes and broadcasts (bf16 halves
    the bytes on slow links; the syncer always accumulates in fp32)."""

    initial_cut_timeout_s: float = 300.0
    """``YETO_DILOCO_INITIAL_CUT_TIMEOUT``: seconds to wait before the first step for the
    syncer's initial cut, installing each fragment as it lands; 0 = do not wait (the cut is
    applied at the step boundaries as it arrives)."""

    step_log: str | None = None
    """``YETO_DILOCO_STEP_LOG``: path of the per-step JSON log written by sync rank 0
    (``{island}`` is replaced by the island id). Unset = no log."""

    tokens_per_step: int = 0
    """``YETO_DILOCO_TOKENS_PER_STEP``: tokens one optimizer step consumes, used to weight
    this island's pushes. 0 = let the integration compute it (ms-swift: global batch x
    sequence length); if nothing sets it, pushes weigh by steps."""

    heartbeat_s: float = 2.0
    """``YETO_HEARTBEAT_S``: seconds between heartbeats from the client's I/O thread."""

    sync_timeout_s: float = 30.0
    """``YETO_SYNC_TIMEOUT_S``: silence from the syncer after which the client redials under a
    new generation."""

    connect_timeout_s: float = 300.0
    """``YETO_CONNECT_TIMEOUT_S``: how long start-up waits for the syncer's WELCOME before
    failing the job."""

    final_timeout_s: float = 600.0
    """``YETO_FINAL_TIMEOUT_S``: how long the end of training waits for the syncer's final
    cut before failing loudly."""

    send_queue: int = 16
    """``YETO_SEND_QUEUE``: messages the client may hold unsent; beyond that a push is dropped
    (logged) rather than block training; the syncer re-pulls it with a new attempt."""

    cross_node_gloo: bool = False
    """``YETO_CROSS_NODE_GLOO``: ``1`` routes process groups that span nodes through gloo
    with host-staged device tensors (see ``gloo_bridge``)."""

    ranks_per_node: int | None = None
    """``YETO_RANKS_PER_NODE``: ranks per node for the gloo bridge; unset = the launcher's
    ``LOCAL_WORLD_SIZE``."""

    sync_rank: int = 0
    """``YETO_SYNC_RANK``: the rank (of the island's world) that talks to the syncer."""

    def __post_init__(self) -> None:
        if not self.sync_addr or "://" not in self.sync_addr:
            raise ConfigError(f"YETO_SYNC_ADDR must be a zmq address like tcp://host:5555, got {self.sync_addr!r}")
        _check(self.island_id >= 0, "YETO_ISLAND_ID", self.island_id, "must be >= 0")
        _check(self.fragments >= 1, "YETO_DILOCO_FRAGMENTS", self.fragments, "must be >= 1")
        _check(0.0 <= self.alpha < 1.0, "YETO_DILOCO_ALPHA", self.alpha, "must satisfy 0 <= alpha < 1")
        _check(self.apply_mode in ("progress", "blend"), "YETO_DILOCO_APPLY", self.apply_mode,
               "must be progress or blend")
        _check(self.alpha == 0.0 or self.apply_mode == "blend", "YETO_DILOCO_ALPHA", self.alpha,
               "only applies with YETO_DILOCO_APPLY=blend")
        _check(self.pushes_in_flight >= 1, "YETO_DILOCO_PUSHES_IN_FLIGHT", self.pushes_in_flight, "must be >= 1")
        _check(self.transfer_timeout_s > 0, "YETO_DILOCO_TRANSFER_TIMEOUT_S", self.transfer_timeout_s, "must be > 0")
        _check(self.wire_dtype in WIRE_DTYPE_NAMES, "YETO_WIRE_DTYPE", self.wire_dtype,
               f"must be one of {', '.join(WIRE_DTYPE_NAMES)}")
        _check(self.initial_cut_timeout_s >= 0, "YETO_DILOCO_INITIAL_CUT_TIMEOUT", self.initial_cut_timeout_s,
               "must be >= 0")
        _check(self.tokens_per_step >= 0, "YETO_DILOCO_TOKENS_PER_STEP", self.tokens_per_step, "must be >= 0")
        _check(self.heartbeat_s > 0, "YETO_HEARTBEAT_S", self.heartbeat_s, "must be > 0")
        _check(self.sync_timeout_s > self.heartbeat_s, "YETO_SYNC_TIMEOUT_S", self.sync_timeout_s,
               "must be greater than YETO_HEARTBEAT_S")
        _check(self.connect_timeout_s > 0, "YETO_CONNECT_TIMEOUT_S", self.connect_timeout_s, "must be > 0")
        _check(self.final_timeout_s > 0, "YETO_FINAL_TIMEOUT_S", self.final_timeout_s, "must be > 0")
        _check(self.send_queue >= 2, "YETO_SEND_QUEUE", self.send_queue, "must be >= 2")
        _check(self.ranks_per_node is None or self.ranks_per_node >= 1, "YETO_RANKS_PER_NODE",
               self.ranks_per_node, "must be >= 1")
        _check(self.sync_rank >= 0, "YETO_SYNC_RANK", self.sync_rank, "must be >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> IslandConfig:
        """Build the config from ``YETO_*`` variables (``env`` defaults to ``os.environ``).

        ``overrides`` replace fields after reading (for integrations that know better, e.g.
        tokens per step from the trainer's arguments).
        """
        env = os.environ if env is None else env
        key = env.get("YETO_SYNC_KEY", "").encode()
        key_file = env.get("YETO_SYNC_KEY_FILE", "")
        if key_file:
            if key:
                raise ConfigError("set only one of YETO_SYNC_KEY and YETO_SYNC_KEY_FILE")
            try:
                key = read_key_file(key_file)
            except ValueError as exc:
                raise ConfigError(f"YETO_SYNC_KEY_FILE: {exc}") from exc
        addr = env.get("YETO_SYNC_ADDR", "")
        if not addr:
            raise ConfigError("YETO_SYNC_ADDR is not set (the syncer's address, e.g. tcp://host:5555)")
        if "YETO_ISLAND_ID" not in env:
            raise ConfigError("YETO_ISLAND_ID is not set (this island's id, 0 .. islands-1)")
        rpn = env.get("YETO_RANKS_PER_NODE", "")
        fields: dict[str, object] = dict(
            sync_addr=addr,
            island_id=_int(env, "YETO_ISLAND_ID", 0),
            key=key,
            fragments=_int(env, "YETO_DILOCO_FRAGMENTS", 4),
            alpha=_float(env, "YETO_DILOCO_ALPHA", 0.0),
            apply_mode=env.get("YETO_DILOCO_APPLY", "progress"),
            pushes_in_flight=_int(env, "YETO_DILOCO_PUSHES_IN_FLIGHT", 1),
            transfer_timeout_s=_float(env, "YETO_DILOCO_TRANSFER_TIMEOUT_S", 300.0),
            tune_malloc=_bool(env, "YETO_DILOCO_TUNE_MALLOC", True),
            wire_dtype=env.get("YETO_WIRE_DTYPE", "float32"),
            initial_cut_timeout_s=_float(env, "YETO_DILOCO_INITIAL_CUT_TIMEOUT", 300.0),
            step_log=env.get("YETO_DILOCO_STEP_LOG") or None,
            tokens_per_step=_int(env, "YETO_DILOCO_TOKENS_PER_STEP", 0),
            heartbeat_s=_float(env, "YETO_HEARTBEAT_S", 2.0),
            sync_timeout_s=_float(env, "YETO_SYNC_TIMEOUT_S", 30.0),
            connect_timeout_s=_float(env, "YETO_CONNECT_TIMEOUT_S", 300.0),
            final_timeout_s=_float(env, "YETO_FINAL_TIMEOUT_S", 600.0),
            send_queue=_int(env, "YETO_SEND_QUEUE", 16),
            cross_node_gloo=_bool(env, "YETO_CROSS_NODE_GLOO", False),
            ranks_per_node=_int(env, "YETO_RANKS_PER_NODE", 0) if rpn else None,
            sync_rank=_int(env, "YETO_SYNC_RANK", 0),
        )
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> IslandConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def step_log_path(self) -> str | None:
        """The step-log path with ``{island}`` filled in."""
        return None if self.step_log is None else self.step_log.replace("{island}", str(self.island_id))


def _check(ok: bool, var: str, value: object, why: str) -> None:
    if not ok:
        raise ConfigError(f"{var}={value!r} {why}")


def _int(env: Mapping[str, str], var: str, default: int) -> int:
    raw = env.get(var, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not an integer") from None


def _float(env: Mapping[str, str], var: str, default: float) -> float:
    raw = env.get(var, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{var}={raw!r} is not a finite number")
    return value


def _bool(env: Mapping[str, str], var: str, default: bool) -> bool:
    raw = env.get(var, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{var}={raw!r} must be 0 or 1")

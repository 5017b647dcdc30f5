"""Island configuration: one typed object built from ``YETO_*`` variables in one place.

Every island process (every rank of a Megatron job) builds an :class:`IslandConfig`
with :meth:`IslandConfig.from_env` at start. A wrong value fails right there, with a
message naming the variable, instead of surfacing as a hang at the first sync: an
island that cannot reach or authenticate with the syncer should never train for an
hour before anyone notices.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from diloco.keys import read_key_file
from diloco.security import ClientCurve, load_public, load_secret

WIRE_DTYPE_NAMES = ("float32", "bfloat16", "int8", "q4")


class ConfigError(ValueError):
    """A ``YETO_*`` variable is missing or malformed; the message names it."""


@dataclass(frozen=True)
class IslandConfig:
    """What an island needs to take part in DiLoCo rounds.

    Build it in code (``IslandConfig(sync_addr="tcp://host:5555", island_id=0, fragments=4)``)
    or from ``YETO_*`` variables (:meth:`from_env`); both run the same checks, and a bad value
    raises :class:`ConfigError` naming the field and its variable. Frozen: use :meth:`replace`.
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

    sync_rounds: bool = False
    """``YETO_DILOCO_SYNC_ROUNDS``: at the step that opens a round (``ceil(t·H/P)``), hold the
    training loop until that round's commit is installed: synchronous DiLoCo, every push and
    apply at a fixed step, so a run is reproducible. Off (default): nothing waits, a commit is
    installed at whichever boundary it has arrived by (docs/PROTOCOL.md, "Synchronous rounds")."""

    pushes_in_flight: int = 1
    """``YETO_DILOCO_PUSHES_IN_FLIGHT``: background pushes (gather + hand-off) that may be
    unfinished per rank; another push waits for the oldest. ``>= 1``."""

    snapshot_slots: int = 1
    """``YETO_DILOCO_SNAPSHOT_SLOTS``: pushes of different fragments whose snapshot (θ_push)
    may be held at once, each slot sized to one fragment's share of the rank (host memory:
    ``slots / fragments`` of the model, pinned on GPUs). 1 (default) keeps the island at one
    anchor plus one fragment; a push of another fragment then waits until the outstanding
    one's commit is installed, which costs rounds only when rounds come faster than commits
    land (``H / fragments`` steps below the commit lag). ``1..fragments``."""

    snapshot_on_device: bool = False
    """``YETO_DILOCO_SNAPSHOT_ON_DEVICE``: keep the snapshot slots in the accelerator's memory, beside
    the masters, instead of (pinned) host memory: each slot then costs one fragment's share of the
    rank in device memory and none on the host, so ``YETO_DILOCO_SNAPSHOT_SLOTS`` 2 lets the push of
    the next fragment overlap the outstanding round at the host cost of one slot less. Ignored when
    the rank's masters are in host memory (CPU training)."""

    transfer_timeout_s: float = 300.0
    """``YETO_DILOCO_TRANSFER_TIMEOUT_S``: bound on every background transfer wait and on the
    data group's collectives; a rank that died shows up as an error within it."""

    tune_malloc: bool = True
    """``YETO_DILOCO_TUNE_MALLOC``: pin glibc's mmap / trim thresholds at start so training
    steps do not pay page faults (``diloco/hostmem.py``)."""

    wire_dtype: str = "float32"
    """``YETO_WIRE_DTYPE``: ``float32`` or ``bfloat16`` for pushes and broadcasts (bf16 halves
    the bytes on slow links; the syncer always accumulates in fp32), or ``int8`` / ``q4``:
    block-quantized pushes with error feedback (~1/4 and ~1/7.5 of fp32), broadcasts in bf16."""

    quant_block: int = 64
    """``YETO_QUANT_BLOCK``: elements per bf16 scale of ``int8`` / ``q4`` pushes, a power of two
    in [8, 4096]; must equal the syncer's ``--quant-block``."""

    initial_cut_timeout_s: float = 300.0
    """``YETO_DILOCO_INITIAL_CUT_TIMEOUT``: seconds to wait before the first step for the
    syncer's initial cut, installing each fragment as it lands; 0 = do not wait (the cut is
    applied at the step boundaries as it arrives)."""

    skip_matching_cut: bool = True
    """``YETO_DILOCO_SKIP_MATCHING_CUT``: at start-up, hash every fragment's fp32 value (one
    fragment at a time) and claim it in HELLO; a fragment the syncer holds bit for bit the same
    value of is not downloaded (HELD), which halves start-up when every island starts from the
    same checkpoint or seed. Needs ``initial_cut_timeout_s > 0``. 0: always download the cut."""

    step_log: str | None = None
    """``YETO_DILOCO_STEP_LOG``: path of the per-step JSON log written by sync rank 0
    (``{island}`` is replaced by the island id). Unset = no log."""

    writer: object = field(default=None, compare=False, repr=False)
    """In code only (``IslandConfig(..., writer=SummaryWriter(...))``): the job's scalar writer,
    anything with ``add_scalar(tag, value, step)`` (TensorBoard) or ``log(dict, step)``
    (wandb), or a list of them; sync rank 0 writes the sync scalars under ``diloco/`` to it
    every ``log_interval`` steps (``diloco/steplog_scalars.py``). None = no scalars. The
    ms-swift plugin hands in Megatron's own TensorBoard and wandb writers."""

    log_interval: int = 0
    """``YETO_DILOCO_LOG_INTERVAL``: training steps between two writes of the sync scalars;
    0 = the job's own (Megatron's ``--log-interval``), else 10."""

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

    curve_server_key: str = ""
    """``YETO_CURVE_SERVER_KEY``: the syncer's CurveZMQ public key (40 Z85 characters, or the
    path of its public certificate ``syncer.key``). Set with ``YETO_CURVE_SECRET_FILE`` for
    Curve mode; unset, a shared key (``YETO_SYNC_KEY``) gives Curve keys derived from it."""

    curve_secret_file: str = ""
    """``YETO_CURVE_SECRET_FILE``: this island's CurveZMQ secret certificate (``yeto-keys
    generate``); its public half must be in the syncer's ``--curve-clients-dir``."""

    def __post_init__(self) -> None:
        # Types first, so a config built in code (``IslandConfig(island_id="0")``) fails here
        # naming the field and its variable, just as a bad ``YETO_*`` string does in from_env.
        for f in dataclasses.fields(self):
            _check_type(self, f.name)
        if not self.sync_addr or "://" not in self.sync_addr:
            raise ConfigError(f"sync_addr (YETO_SYNC_ADDR) must be a zmq address like tcp://host:5555, "
                              f"got {self.sync_addr!r}")
        _check(self.island_id >= 0, "island_id", self.island_id, "must be >= 0")
        _check(self.fragments >= 1, "fragments", self.fragments, "must be >= 1")
        _check(0.0 <= self.alpha < 1.0, "alpha", self.alpha, "must satisfy 0 <= alpha < 1")
        _check(self.apply_mode in ("progress", "blend"), "apply_mode", self.apply_mode, "must be progress or blend")
        _check(self.alpha == 0.0 or self.apply_mode == "blend", "alpha", self.alpha,
               "only applies with apply_mode=blend (YETO_DILOCO_APPLY)")
        _check(self.pushes_in_flight >= 1, "pushes_in_flight", self.pushes_in_flight, "must be >= 1")
        _check(1 <= self.snapshot_slots <= max(1, self.fragments), "snapshot_slots", self.snapshot_slots,
               f"must be in 1..fragments ({self.fragments})")
        _check(self.transfer_timeout_s > 0, "transfer_timeout_s", self.transfer_timeout_s, "must be > 0")
        _check(self.wire_dtype in WIRE_DTYPE_NAMES, "wire_dtype", self.wire_dtype,
               f"must be one of {', '.join(WIRE_DTYPE_NAMES)}")
        _check(self.initial_cut_timeout_s >= 0, "initial_cut_timeout_s", self.initial_cut_timeout_s, "must be >= 0")
        _check(self.writer is None or _writers_ok(self.writer), "writer", type(self.writer).__name__,
               "must have add_scalar(tag, value, step) or log(dict, step), or be a list of such")
        _check(self.log_interval >= 0, "log_interval", self.log_interval, "must be >= 0")
        _check(self.tokens_per_step >= 0, "tokens_per_step", self.tokens_per_step, "must be >= 0")
        _check(self.heartbeat_s > 0, "heartbeat_s", self.heartbeat_s, "must be > 0")
        _check(self.sync_timeout_s > self.heartbeat_s, "sync_timeout_s", self.sync_timeout_s,
               "must be greater than heartbeat_s (YETO_HEARTBEAT_S)")
        _check(self.connect_timeout_s > 0, "connect_timeout_s", self.connect_timeout_s, "must be > 0")
        _check(self.final_timeout_s > 0, "final_timeout_s", self.final_timeout_s, "must be > 0")
        _check(self.send_queue >= 2, "send_queue", self.send_queue, "must be >= 2")
        _check(self.quant_block in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), "quant_block",
               self.quant_block, "must be a power of two in [8, 4096]")
        _check(self.ranks_per_node is None or self.ranks_per_node >= 1, "ranks_per_node",
               self.ranks_per_node, "must be >= 1")
        _check(self.sync_rank >= 0, "sync_rank", self.sync_rank, "must be >= 0")
        _check(bool(self.curve_server_key) == bool(self.curve_secret_file), "curve_server_key",
               self.curve_server_key[:60], "and curve_secret_file (YETO_CURVE_SECRET_FILE) must be set together")
        if self.curve_secret_file:
            self.client_curve()  # fails here, at start, naming the variable

    def client_curve(self) -> ClientCurve | None:
        """Transport keys: from the Curve variables, else derived from the shared key, else None (plain)."""
        if self.curve_secret_file:
            try:
                public, secret = load_secret(self.curve_secret_file)
            except ValueError as exc:
                raise ConfigError(f"curve_secret_file (YETO_CURVE_SECRET_FILE): {exc}") from exc
            try:
                server = load_public(self.curve_server_key)
            except ValueError as exc:
                raise ConfigError(f"curve_server_key (YETO_CURVE_SERVER_KEY): {exc}") from exc
            return ClientCurve(server, public, secret)
        if self.key:
            return ClientCurve.from_shared_key(self.key)
        return None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> IslandConfig:
        """Build the config from ``YETO_*`` variables (``env`` defaults to ``os.environ``).

        ``overrides`` are field values (``sync_addr=``, ``island_id=``, ``tokens_per_step=``
        ...) that win over the variables; they are applied *before* anything is validated,
        so a launcher may supply the required address and id in code, and a bad override
        fails like a bad variable. A variable that an override replaces is not parsed.
        """
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"IslandConfig has no field(s) {', '.join(unknown)}")
        fields: dict[str, object] = {}
        for name in [f.name for f in dataclasses.fields(cls) if f.name not in overrides]:  # field order
            var = _ENV_OF[name]
            if name == "key":
                fields[name] = _key_from_env(env)
            elif name in ("sync_addr", "island_id"):
                if not env.get(var, ""):
                    what = ("the syncer's address, e.g. tcp://host:5555" if name == "sync_addr"
                            else "this island's id, 0 .. islands-1")
                    raise ConfigError(f"{var} is not set ({what}; or pass {name}= in code)")
                fields[name] = env[var] if name == "sync_addr" else _int(env, var, 0)
            elif env.get(var, "") == "":
                continue  # the dataclass default
            else:
                fields[name] = _PARSERS[name](env, var)
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> IslandConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def writers(self) -> list[object]:
        """The scalar writers (``writer`` as a list; empty when None)."""
        if self.writer is None:
            return []
        return list(self.writer) if isinstance(self.writer, (list, tuple)) else [self.writer]

    def step_log_path(self) -> str | None:
        """The step-log path with ``{island}`` filled in."""
        return None if self.step_log is None else self.step_log.replace("{island}", str(self.island_id))


_ENV_OF: dict[str, str] = {
    "sync_addr": "YETO_SYNC_ADDR",
    "island_id": "YETO_ISLAND_ID",
    "key": "YETO_SYNC_KEY",
    "fragments": "YETO_DILOCO_FRAGMENTS",
    "alpha": "YETO_DILOCO_ALPHA",
    "apply_mode": "YETO_DILOCO_APPLY",
    "pushes_in_flight": "YETO_DILOCO_PUSHES_IN_FLIGHT",
    "snapshot_slots": "YETO_DILOCO_SNAPSHOT_SLOTS",
    "snapshot_on_device": "YETO_DILOCO_SNAPSHOT_ON_DEVICE",
    "sync_rounds": "YETO_DILOCO_SYNC_ROUNDS",
    "transfer_timeout_s": "YETO_DILOCO_TRANSFER_TIMEOUT_S",
    "tune_malloc": "YETO_DILOCO_TUNE_MALLOC",
    "wire_dtype": "YETO_WIRE_DTYPE",
    "initial_cut_timeout_s": "YETO_DILOCO_INITIAL_CUT_TIMEOUT",
    "skip_matching_cut": "YETO_DILOCO_SKIP_MATCHING_CUT",
    "step_log": "YETO_DILOCO_STEP_LOG",
    "writer": "in code only",
    "log_interval": "YETO_DILOCO_LOG_INTERVAL",
    "tokens_per_step": "YETO_DILOCO_TOKENS_PER_STEP",
    "heartbeat_s": "YETO_HEARTBEAT_S",
    "sync_timeout_s": "YETO_SYNC_TIMEOUT_S",
    "connect_timeout_s": "YETO_CONNECT_TIMEOUT_S",
    "final_timeout_s": "YETO_FINAL_TIMEOUT_S",
    "send_queue": "YETO_SEND_QUEUE",
    "quant_block": "YETO_QUANT_BLOCK",
    "cross_node_gloo": "YETO_CROSS_NODE_GLOO",
    "ranks_per_node": "YETO_RANKS_PER_NODE",
    "sync_rank": "YETO_SYNC_RANK",
    "curve_server_key": "YETO_CURVE_SERVER_KEY",
    "curve_secret_file": "YETO_CURVE_SECRET_FILE",
}
"""Each field's variable: error messages name both, whichever way the value came in."""


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ConfigError(f"{name} ({_ENV_OF[name]})={value!r} {why}")


def _check_type(cfg: IslandConfig, name: str) -> None:
    """Check (and normalise: int -> float, str key -> bytes) one field's type in place."""
    value = getattr(cfg, name)
    kind = _KIND[name]
    ok: bool
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "int?":
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            object.__setattr__(cfg, name, float(value))
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "bytes":
        if isinstance(value, str):
            object.__setattr__(cfg, name, value.encode())
        ok = isinstance(getattr(cfg, name), bytes)
    elif kind == "str?":
        ok = value is None or isinstance(value, str)
    elif kind == "any":
        ok = True
    else:
        ok = isinstance(value, str)
    if not ok:
        shown = "<redacted>" if name == "key" else repr(value)
        raise ConfigError(f"{name} ({_ENV_OF[name]})={shown} must be of type {_KIND_WORDS[kind]}")


_KIND: dict[str, str] = {
    "sync_addr": "str", "island_id": "int", "key": "bytes", "fragments": "int", "alpha": "float",
    "apply_mode": "str", "pushes_in_flight": "int", "snapshot_slots": "int", "snapshot_on_device": "bool", "sync_rounds": "bool", "transfer_timeout_s": "float", "tune_malloc": "bool",
    "wire_dtype": "str", "initial_cut_timeout_s": "float", "skip_matching_cut": "bool", "step_log": "str?", "writer": "any",
    "log_interval": "int", "tokens_per_step": "int",
    "heartbeat_s": "float", "sync_timeout_s": "float", "connect_timeout_s": "float", "final_timeout_s": "float",
    "send_queue": "int", "quant_block": "int", "cross_node_gloo": "bool", "ranks_per_node": "int?", "sync_rank": "int",
    "curve_server_key": "str", "curve_secret_file": "str",
}
_KIND_WORDS = {"int": "int", "int?": "int or None", "float": "a finite number", "bool": "bool",
               "bytes": "bytes (or str)", "str?": "str or None", "str": "str"}


def _writers_ok(writer: object) -> bool:
    items = list(writer) if isinstance(writer, (list, tuple)) else [writer]
    return all(callable(getattr(w, "add_scalar", None)) or callable(getattr(w, "log", None)) for w in items)


def _key_from_env(env: Mapping[str, str]) -> bytes:
    key = env.get("YETO_SYNC_KEY", "").encode()
    key_file = env.get("YETO_SYNC_KEY_FILE", "")
    if key_file:
        if key:
            raise ConfigError("set only one of YETO_SYNC_KEY and YETO_SYNC_KEY_FILE")
        try:
            key = read_key_file(key_file)
        except ValueError as exc:
            raise ConfigError(f"YETO_SYNC_KEY_FILE: {exc}") from exc
    return key


def _str(env: Mapping[str, str], var: str) -> str:
    return env[var]


def _float_of(env: Mapping[str, str], var: str) -> float:
    return _float(env, var, 0.0)


def _int_of(env: Mapping[str, str], var: str) -> int:
    return _int(env, var, 0)


def _bool_of(env: Mapping[str, str], var: str) -> bool:
    return _bool(env, var, False)


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


_PARSERS = {
    "fragments": _int_of, "alpha": _float_of, "apply_mode": _str, "pushes_in_flight": _int_of, "snapshot_slots": _int_of, "snapshot_on_device": _bool_of, "sync_rounds": _bool_of,
    "transfer_timeout_s": _float_of, "tune_malloc": _bool_of, "wire_dtype": _str, "initial_cut_timeout_s": _float_of,
    "skip_matching_cut": _bool_of,
    "step_log": _str, "log_interval": _int_of, "tokens_per_step": _int_of, "heartbeat_s": _float_of, "sync_timeout_s": _float_of,
    "connect_timeout_s": _float_of, "final_timeout_s": _float_of, "send_queue": _int_of, "quant_block": _int_of,
    "cross_node_gloo": _bool_of, "ranks_per_node": _int_of, "sync_rank": _int_of,
    "curve_server_key": _str, "curve_secret_file": _str,
}
"""How each optional field is parsed from its (set, non-empty) variable."""

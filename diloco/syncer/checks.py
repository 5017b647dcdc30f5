"""Validation helpers of the syncer state machine: the refusal value and tensor checks.

Separate from ``state.py`` so the rules there read as protocol transitions. A
check raises :class:`Refused` before any state is touched; the state machine
turns it into one log line and an ERROR to the sender.
"""

from __future__ import annotations

import torch

from diloco.syncer.records import TensorSpec
from diloco.wire import WIRE_DTYPES, Message

__all__ = ["Refused", "spec_of", "check_tensors"]


class Refused(Exception):
    """A message broke a protocol rule; raised before any state is changed.

    Attributes:
        code: short machine-readable reason, sent in ERROR (e.g. ``stale_attempt``).
        reason: one human-readable line for the log and the ERROR.
    """

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    """The ``(name, dtype name, shape)`` of a decoded tensor (wire dtypes only)."""
    dtype = next(k for k, v in WIRE_DTYPES.items() if v == t.dtype)
    return (name, dtype, tuple(int(s) for s in t.shape))


def check_tensors(msg: Message, schema: tuple[TensorSpec, ...], dtype: str, what: str) -> None:
    """Check names, order, shapes, dtype and finiteness of ``msg``'s tensors against a schema.

    Finiteness is checked last: it is the only check that reads every element,
    so cheap structural refusals cost nothing.
    """
    if len(msg.tensors) != len(schema):
        raise Refused("bad_schema", f"{what}: {len(msg.tensors)} tensors, fragment has {len(schema)}")
    want_dtype = WIRE_DTYPES[dtype]
    for (name, t), (sname, _sdtype, sshape) in zip(msg.tensors, schema):
        if name != sname:
            raise Refused("bad_schema", f"{what}: tensor {name[:80]!r} where {sname[:80]!r} was expected")
        if tuple(t.shape) != sshape:
            raise Refused("bad_schema", f"{what}: {name[:80]!r} has shape {tuple(t.shape)}, expected {sshape}")
        if t.dtype != want_dtype:
            raise Refused("bad_dtype", f"{what}: {name[:80]!r} is {t.dtype}, expected {dtype}")
    for name, t in msg.tensors:
        if not bool(torch.isfinite(t).all()):
            raise Refused("not_finite", f"{what}: {name[:80]!r} holds NaN or Inf")

"""The effects of the syncer's state machine: what a transition asks the loop to send.

Contract: :data:`Out` is the one type every rule of :class:`diloco.syncer.state.SyncerState`
appends to its ``out`` list and every entry point (``handle``, ``on_result``, ``tick``) returns:
an :class:`~diloco.syncer.core.records.Outgoing` (one small control message, sent at once) or an
:class:`~diloco.syncer.core.records.OutStream` (a parted BCAST/FINAL stream the loop encodes and paces).
This module sits below ``state``, ``fields`` and the state's mixins so that all of them name the
effect type without importing ``state``; it holds no state and does no I/O.
"""

from __future__ import annotations

from diloco.syncer.core.records import Outgoing, OutStream

Out = Outgoing | OutStream
"""One message the loop must send, in the order of the list that carries it."""

__all__ = ["Out", "Outgoing", "OutStream"]

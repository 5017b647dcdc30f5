"""The background data path of one rank: push = snapshot + background gather, apply = background
staging + short install.

The training thread never carries a fragment's transfer (device copies, host arithmetic, gloo
traffic); it pays only for

* **snapshot** (:meth:`DataPath.snapshot`): a copy of this rank's pieces of the fragment's
  fp32 masters into reused host buffers. On an accelerator it is an async device-to-host
  copy into *pinned* buffers on a side stream, fenced by an event: the compute stream waits
  for that event on the device (so the next optimizer step cannot overwrite a master
  being copied) and the host does not wait at all;
* **install** (:meth:`DataPath.install`): the in-place write of the masters from buffers
  staged in the background (one pass over the rank's share; on an accelerator an async
  host-to-device copy from pinned memory plus one device op).

Everything else runs on the background worker (:mod:`diloco.island.background`), on the
*data group* (its own gloo group): :meth:`gather_delta` (``snapshot − anchor`` on the owning
ranks, gathered to the sync rank into pooled global tensors) and :meth:`stage` (the sync
rank sends every primary holder only its own slice, primaries forward to replicas, each
rank receives into its anchor and precomputes the progress correction ``global − snapshot``).
The two cuts stage through the same :meth:`DataPath.stage` on the island group, at once, while
no step runs (``diloco.island.landing``: the one install path).

Buffers, each with a budget (logged at start by :meth:`DataPath.preallocate`):

* the **anchor** of every piece this rank holds (fp32, owned by the ``FragmentTransfer``):
  one copy of this rank's slice of the model, the only buffer that grows with the model;
* one **snapshot slot** (:mod:`diloco.island.slots`: pinned host memory when the masters live on
  an accelerator, or beside them in its memory with ``YETO_DILOCO_SNAPSHOT_ON_DEVICE``), sized to this
  rank's largest share of one fragment, whatever the number of fragments: it holds θ_push of
  the one fragment whose push is outstanding, from the snapshot until that fragment's commit
  is installed. Staging writes the received global value straight into the anchor and turns
  the slot into the progress correction ``global − θ_push`` in place; the install adds it to
  the masters and frees the slot. A push of another fragment waits (the planner defers it)
  while the slot is taken; after the last training step pushes need no slot (the masters no
  longer move: :meth:`DataPath.snapshot` with ``slotless``);
* transient deltas of one send batch (``_SEND_BATCH_BYTES``) on ranks that send to the sync
  rank, and on the sync rank either nothing (every element of the fragment held whole here:
  the client computes each part's delta as it encodes it, :class:`DeltaSource`) or one
  fragment's global tensors being assembled.

Buffer hazards, and why they cannot happen: jobs run FIFO on one worker, and the island
(``boundary.py``) never snapshots a fragment before the previous commit of that fragment is
installed, never stages a fragment twice before installing it, and installs only what is
staged on every rank. So a push job of ``f`` (reads the slot and the anchor) always finishes
before the staging job of ``f`` (writes the anchor and the slot), which on the sync rank also
waits until the client has stopped reading the push (its ``sent`` event), and which finishes
before the install (reads the anchor or the slot), which precedes the next snapshot into the
slot. Device copies out of pinned memory are fenced by events the next writer waits for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from diloco.island.delta_source import DeltaSource
from diloco.island.quiet import QuietAnchors
from diloco.island.slots import SnapshotSlots
from diloco.island.transfer import _TAG_APPLY, _TAG_EXPORT, _TAG_FORWARD, ExportAssembly, FragmentTransfer
from diloco.layout.base import group_rank
from gloo_bridge import device as dev

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

_SEND_BATCH_BYTES = 64 << 20
"""Most delta bytes a non-sync rank holds in flight to the sync rank at once."""


class DataPath:
    """Background-capable export / apply of one rank; build on every rank after the FragmentTransfer.

    Args:
        xfer: the rank's FragmentTransfer (routes, pieces, anchors are shared with it).
        group: the data group: same ranks, same group ranks as ``xfer``'s group, used only
            by the background worker.
    """

    def __init__(self, xfer: FragmentTransfer, group: dist.ProcessGroup, slots: int = 1,
                 slot_device: bool = False) -> None:
        if group_rank(group) != xfer._me or dist.get_world_size(group) != xfer._world:
            raise ValueError("DataPath: the data group must have the island group's ranks, in its order")
        self._x = xfer
        self._group = group
        self._me = xfer._me
        self._sync = xfer._sync
        pieces = xfer._pieces
        self._mine: list[list[int]] = [
            sorted(p for r, p in route.pieces if r == self._me) for route in xfer._routes
        ]
        # Runs (piece, offset, length) of valid elements this rank holds, per fragment: installs
        # write only these (padding rows of a master are never touched).
        self._held: list[list[tuple[int, int, int]]] = []
        for route in xfer._routes:
            runs = sorted({(h.piece, h.off, seg.n) for seg, h in route.apply.get(self._me, [])}
                          | {(h.piece, h.off, n) for (_, q), items in route.forward.items() if q == self._me
                             for _, n, h in items})
            merged: list[tuple[int, int, int]] = []
            for p, off, n in runs:
                if merged and merged[-1][0] == p and merged[-1][1] + merged[-1][2] == off:
                    merged[-1] = (p, merged[-1][1], merged[-1][2] + n)
                else:
                    merged.append((p, off, n))
            self._held.append(merged)
        self._whole = [self._held_whole(f) for f in range(len(xfer._routes))]
        pinned = any(dev.is_accelerator(p.master) for p in pieces) and dev.pinning_available()
        self._slots = SnapshotSlots([p.master for p in pieces], slots, pinned, slot_device)
        self._slotless: set[int] = set()
        self._install_event: dict[int, object | None] = {}
        self._sent: dict[int, threading.Event] = {}
        self._quiet = QuietAnchors(len(xfer._routes))
        self._own: set[int] = set()  # fragments whose anchors hold this rank's own masters (anchor_own)
        self._staged_arrival: dict[int, int] = {}
        self.bytes_sent = 0
        """Data-group bytes this rank sent (background thread)."""

    def _held_whole(self, f: int) -> list[tuple[str, int, int]] | None:
        """(name, piece, offset) per tensor of ``f`` when this (sync) rank exports every tensor
        of it whole from one piece of its own; None otherwise."""
        x = self._x
        route = x._routes[f]
        if self._me != self._sync or set(route.export) - {self._sync}:
            return None
        by_name = {seg.name: (seg, h) for seg, h in route.export.get(self._sync, [])}
        out = []
        for spec in x._plan.specs_of(f):
            seg, h = by_name.get(spec.name, (None, None))
            # One shard covering every element is the tensor itself, in its own order (TP1 shards of a
            # row- or column-parallel weight included); any real cut across ranks is not whole.
            if seg is None or h is None or seg.a != 0 or seg.b != spec.numel:
                return None
            if len(route.export[self._sync]) != len(x._plan.specs_of(f)):
                return None
            out.append((spec.name, h.piece, h.off))
        return out

    # ------------------------------------------------------------------ buffers
    def slot_nbytes(self) -> int:
        """Bytes of the snapshot slot: this rank's largest share of one fragment."""
        return max((self.share_nbytes(f) for f in range(len(self._mine))), default=0)

    def preallocate(self) -> dict[str, int]:
        """Allocate the snapshot slot and every anchor now (at start-up), not at a fragment's
        first push: pinned memory is slow to allocate and that must not land on a training
        step. Returns the bytes by kind (what the island logs)."""
        slots = self._slots.allocate(self.slot_nbytes())
        self._x.allocate_anchors()
        return {"anchors": self._x.anchor_nbytes(), **slots}

    def share_nbytes(self, f: int) -> int:
        """Bytes of this rank's pieces of fragment ``f`` (what a snapshot copies)."""
        return sum(4 * (self._x._pieces[p].end - self._x._pieces[p].start) for p in self._mine[f])

    def slot_free_for(self, f: int) -> bool:
        """Whether a snapshot of ``f`` may be taken now (the slot is free, or already ``f``'s)."""
        return self._slots.free_for(f)

    def free(self) -> None:
        """Drop the snapshot slot and every anchor (after the final cut)."""
        self.release_all(0.0)
        self._slots.free()
        self._x.free_anchors()

    def receive_views(self, f: int, dtype: str, busy: bool = False) -> tuple[list[torch.Tensor] | None, int]:
        """Client I/O thread: where a received fp32 or bf16 value of ``f`` may land directly, one flat
        view per tensor in plan order: this (sync) rank's anchors, when it holds every tensor of
        ``f`` whole (preallocated); None otherwise (the client assembles into a pooled buffer).

        Called at the first part of every value of ``f`` (it also numbers them: the second
        return). Only while ``f`` is *quiet* (``diloco.island.quiet``: no value of it pending,
        staging or installed since, none begun since the last installed) and no other stream of
        ``f`` arrives (``busy``); a value refused or superseded leaves ``f`` busy, and later
        values take the pooled path. Pushes of ``f`` are read by this same thread (DeltaSource),
        and a commit of ``f`` is sent only after our push was received."""
        whole = self._whole[f]
        # bf16 (broadcasts of bf16 and low-bit islands) is upcast per chunk as it lands (exact).
        ready = whole is not None and dtype in ("float32", "bfloat16") and len(self._x._anchors) == len(self._x._pieces)
        take, arrival = self._quiet.begin(f, ready and not busy)
        if not take or whole is None:
            return None, arrival
        self._own.discard(f)
        sizes = [spec.numel for spec in self._x._plan.specs_of(f)]
        return [self._x._anchors[p][off : off + n] for (_, p, off), n in zip(whole, sizes)], arrival

    def mark_quiet(self, f: int, arrival: int) -> None:
        """Training thread: value number ``arrival`` of ``f`` is installed; if no value of ``f``
        has begun arriving since, nothing of the data path uses its anchor until the next one
        (see :meth:`receive_views`)."""
        self._quiet.installed(f, arrival)

    def master_views(self, f: int) -> Tensors | None:
        """``f``'s fp32 masters as global tensors without a copy (plan order), when this (sync)
        rank holds every tensor of ``f`` whole in host memory; None otherwise. For INIT, which
        is sent before the first step and waited for, so the masters cannot move under it."""
        whole = self._whole[f]
        if whole is None:
            return None
        out = []
        for (name, p, off), spec in zip(whole, self._x._plan.specs_of(f)):
            master = self._x._pieces[p].master
            if master.device.type != "cpu":
                return None
            out.append((name, master[off : off + spec.numel].view(spec.shape)))
        return out

    def gathers_whole(self) -> bool:
        """Whether no push of this rank assembles a fragment (a non-sync rank only sends; a
        sync rank that holds every fragment whole streams deltas through DeltaSource)."""
        return self._me != self._sync or all(w is not None for w in self._whole)

    def free_slots(self) -> int:
        """Snapshot slots no fragment holds."""
        return self._slots.free_count()

    def slot_holders(self) -> frozenset[int]:
        """The fragments whose θ_push a slot holds."""
        return self._slots.holders()

    def release_all(self, timeout_s: float) -> bool:
        """Forget every snapshot (before a final cut, which replaces every value), once the
        client stopped reading every push (bounded wait; False if one was still read)."""
        ok = all(ev.wait(timeout_s) for ev in self._sent.values())
        self._slots.release_all()
        self._slotless.clear()
        self._sent.clear()
        return ok

    def holds_snapshot(self, f: int) -> bool:
        """Whether the slot holds θ_push of ``f`` (a progress install is possible)."""
        return self._slots.holds(f)

    # ------------------------------------------------------------------ training thread
    def snapshot(self, f: int, slotless: bool = False) -> None:
        """Take θ_push of ``f``: copy this rank's pieces of its masters into the slot.

        CPU: a plain copy. Accelerator: async copies ordered after the compute stream's pending
        work (the optimizer step) and before the next write of a master (``slots.SnapshotSlots``:
        a side stream into host slots, the compute stream into device slots).

        ``slotless``: the masters will not move again (after the last step): the push reads
        them directly and no slot is taken. Refuses (ValueError) a snapshot while every slot
        holds another fragment."""
        if slotless:
            self._slotless.add(f)
            self._slots.release(f, self._mine[f])
            return
        if not self._slots.allocated:
            self.preallocate()
        pieces = self._mine[f]
        self._slots.take(f, pieces, [self._x._pieces[p].end - self._x._pieces[p].start for p in pieces])
        self._slotless.discard(f)

    def install(self, f: int, mode: str, alpha: float = 0.0, fused: bool = True) -> None:
        """Write ``f``'s masters from what :meth:`stage` staged (the anchor holds the global).

        ``mode``: ``"cut"`` (master ← global), ``"progress"`` (master ← master + (global −
        θ_push), the correction :meth:`stage` left in the slot), ``"blend"`` (master ←
        α·master + (1−α)·global; exactly the global when α == 0; ``fused``: in place as one
        multiply-add, else each term rounded on its own). Frees the slot if ``f`` held it."""
        if mode not in ("cut", "progress", "blend"):
            raise ValueError(f"install: unknown mode {mode!r}")
        if mode == "progress" and not self._slots.holds(f):
            raise ValueError(f"install({f}, progress): the slot does not hold fragment {f}")
        event = None
        for p, off, n in self._held[f]:
            master = self._x._pieces[p].master[off : off + n]
            anchor = self._x.anchor_of(p)[off : off + n]
            nb = dev.is_accelerator(master)
            if mode == "progress":
                work = self._slots.view(p)
                assert work is not None
                work = work[off : off + n]
                master.add_(work.to(master.device, non_blocking=True) if nb else work)
            elif mode == "cut" or alpha == 0.0:
                if not (nb and self._slots.upload(master, anchor)):  # done through the free pinned block
                    master.copy_(anchor, non_blocking=nb)
            elif fused:
                src = anchor.to(master.device, non_blocking=True) if nb else anchor
                master.mul_(alpha).add_(src, alpha=1.0 - alpha)
            else:
                master.copy_(master * alpha + anchor.to(master.device) * (1.0 - alpha))
            if nb:
                event = dev.record_event(dev.current_stream(master.device))
        self._slots.installed(f, self._mine[f], event)
        self._slotless.discard(f)
        self._install_event[f] = event
        self._x._anchored.add(f)
        self.mark_quiet(f, self._staged_arrival.pop(f, -1))

    def install_anchor(self, f: int) -> None:
        """A held final cut, on every rank: ``f``'s anchors already hold its final value; write the
        masters from them and leave ``f`` busy, as a final install does."""
        self._staged_arrival[f] = -1
        self._own.discard(f)
        self.install(f, "cut")

    def anchor_own(self, f: int, mark: bool = True) -> None:
        """Start-up only (no step taken yet): this rank's anchors of ``f`` become its own masters,
        copied once (no communication: every rank copies the runs it holds). ``mark``: ``f`` is
        anchored (a HELD cut: the syncer's value is these masters bit for bit); else the anchors
        only hold them for :meth:`own_views` (the claims and INIT read them) until a value lands."""
        dev.event_synchronize(self._install_event.pop(f, None))
        if f not in self._own:
            for p, off, n in self._held[f]:
                self._x.anchor_of(p)[off : off + n].copy_(self._x._pieces[p].master[off : off + n])
            self._own.add(f)
        if mark:
            self._x._anchored.add(f)

    def own_views(self, f: int) -> Tensors | None:
        """Sync rank: ``f``'s starting value as host tensors without a copy (plan order): its
        anchors after :meth:`anchor_own`, when it holds ``f`` whole; else None (gather it)."""
        whole = self._whole[f]
        if whole is None or f not in self._own:
            return None
        return [(name, self._x.anchor_of(p)[off : off + spec.numel].view(spec.shape))
                for (name, p, off), spec in zip(whole, self._x._plan.specs_of(f))]

    # ------------------------------------------------------------------ background worker
    def _snap_of(self, p: int, off: int, n: int) -> torch.Tensor:
        """θ_push of a held run: the slot, or the master itself after a slotless snapshot."""
        view = self._slots.view(p)
        if view is not None:
            return view[off : off + n] if view.device.type == "cpu" else view[off : off + n].to("cpu")
        master = self._x._pieces[p].master[off : off + n]
        return master if master.device.type == "cpu" else master.to("cpu")

    def gather_delta(self, f: int) -> Tensors | DeltaSource | None:
        """Background, collective over the data group: ``θ_push − anchor`` of ``f`` for the sync
        rank, in plan order; None elsewhere.

        When the sync rank holds every tensor of ``f`` whole, the result is a
        :class:`DeltaSource` that computes each part as the client sends it; otherwise the
        fragment's global tensors are assembled (one fragment, pooled)."""
        x = self._x
        if f not in x._anchored:
            raise ValueError(f"gather_delta({f}): fragment {f} has no anchor (never applied)")
        if f not in self._slotless and not self._slots.holds(f):
            raise ValueError(f"gather_delta({f}): no snapshot of fragment {f}")
        dev.event_synchronize(self._slots.snap_event)
        route = x._routes[f]
        whole = self._whole[f]
        if whole is not None:
            # After the last step (slotless) the masters themselves are θ_push: they no longer move
            # (on a device, DeltaSource copies them down one part at a time).
            names = [name for name, _, _ in whole]
            sizes = [spec.numel for spec in x._plan.specs_of(f)]
            snaps = [(x._pieces[p].master if f in self._slotless else self._slots.view(p))[off : off + n]  # type: ignore[index]
                     for (_, p, off), n in zip(whole, sizes)]
            anchors = [x.anchor_of(p)[off : off + n] for (_, p, off), n in zip(whole, sizes)]
            return DeltaSource(names, snaps, anchors)

        def delta(p: int, off: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
            return torch.sub(self._snap_of(p, off, n), x.anchor_of(p)[off : off + n], out=out)

        if self._me != self._sync:
            batch: list[tuple[torch.Tensor, dist.Work]] = []
            held = 0
            for seg, h in route.export.get(self._me, []):
                if held and held + 4 * seg.n > _SEND_BATCH_BYTES:
                    x._wait([w for _, w in batch])
                    batch, held = [], 0
                d = delta(h.piece, h.off, seg.n)
                self.bytes_sent += 4 * seg.n
                held += 4 * seg.n
                batch.append((d, x._isend(d, self._sync, _TAG_EXPORT, self._group)))
            x._wait([w for _, w in batch])
            return None
        asm = ExportAssembly(x._plan, f, x._pool)
        works = [
            x._irecv(asm.dest(seg), src, _TAG_EXPORT, self._group)
            for src, items in sorted(route.export.items())
            if src != self._sync
            for seg, _ in items
        ]
        for seg, h in route.export.get(self._sync, []):
            delta(h.piece, h.off, seg.n, out=asm.dest(seg))
        x._wait(works)
        return asm.finish()

    def push_sent(self, f: int, event: threading.Event | None) -> None:
        """Background (sync rank): the client reads ``f``'s push until ``event`` is set."""
        if event is None:
            self._sent.pop(f, None)
        else:
            self._sent[f] = event

    def stage(self, f: int, values: Sequence[tuple[str, torch.Tensor]] | None, progress: bool,
              timeout_s: float = 300.0, arrival: int = 0) -> int:
        """Background, collective over the data group: scatter ``f``'s global values (sync rank
        only; fp32 or bf16, upcast one segment at a time, off the training thread) straight into
        every holder's anchor; with ``progress`` also turn the slot into ``global − θ_push`` in
        place. ``arrival`` numbers the value for :meth:`mark_quiet` at its install.

        Returns the bytes the sync rank handed out (each element once), 0 elsewhere."""
        return self._stage(f, values, progress, timeout_s, arrival, self._group)

    def stage_now(self, f: int, values: Sequence[tuple[str, torch.Tensor]] | None, group: dist.ProcessGroup,
                  timeout_s: float = 300.0, arrival: int = 0) -> int:
        """Training thread, collective over ``group`` (the island group), while no step runs and
        nothing of ``f`` is in the background: what :meth:`stage` does, without the progress
        correction. ``arrival`` -1: the install leaves ``f`` busy (no value lands in its anchor
        on arrival after it)."""
        return self._stage(f, values, False, timeout_s, arrival, group)

    def _stage(self, f: int, values: Sequence[tuple[str, torch.Tensor]] | None, progress: bool,
               timeout_s: float, arrival: int, g: dist.ProcessGroup) -> int:
        x = self._x
        route = x._routes[f]
        self._staged_arrival[f] = arrival
        self._own.discard(f)
        sent = self._sent.pop(f, None)
        if sent is not None and not sent.wait(timeout_s):
            raise TimeoutError(f"stage({f}): the client still reads the push of fragment {f} after {timeout_s:.0f}s")
        dev.event_synchronize(self._install_event.pop(f, None))  # an async copy may still read the anchor
        self._slots.wait_reads(f)

        def slot(h_piece: int, off: int, n: int) -> torch.Tensor:
            return x.anchor_of(h_piece)[off : off + n]

        mine = route.apply.get(self._me, []) if self._me != self._sync else []
        works = [x._irecv(slot(h.piece, h.off, seg.n), self._sync, _TAG_APPLY, g) for seg, h in mine]
        fwd_in = [(p, n, h) for (p, q), items in sorted(route.forward.items()) if q == self._me for _, n, h in items]
        fwd_works = [x._irecv(slot(h.piece, h.off, n), p, _TAG_FORWARD, g) for p, n, h in fwd_in]
        handed = 0
        keep: list[torch.Tensor] = []
        if self._me == self._sync:
            handed, sends, sent_bytes = x.scatter_to_anchors(f, values, g, keep)
            self.bytes_sent += sent_bytes
            works += sends
        x._wait(works)
        sends = [
            x._isend(slot(hp.piece, hp.off, n), q, _TAG_FORWARD, g)
            for (p, q), items in sorted(route.forward.items())
            if p == self._me
            for hp, n, _ in items
        ]
        x._wait(sends)
        x._wait(fwd_works)
        del keep
        if progress:
            self._slots.correct(f, self._held[f], x.anchor_of)
        return handed

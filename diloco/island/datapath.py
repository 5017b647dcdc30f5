"""The background data path of one rank: push = snapshot + background gather, apply = background
staging + short install.

Why: at real model sizes the synchronous export / apply of :mod:`diloco.island.transfer` cost
the training loop most of a second per fragment (device copies, host arithmetic, gloo
traffic, all on the training thread). Here the training thread pays only for

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
rank receives into its staging buffer and precomputes the progress correction
``global − snapshot``).

Buffers (per local piece, allocated once at first use, then reused; pinned when the
masters live on an accelerator): ``snap`` (the snapshot, i.e. θ_push), ``work`` (the delta
being sent, then the progress correction) and ``staged`` (the received global value; after
the install it *becomes* the anchor, and the old anchor buffer is the next staging buffer:
a swap, no copy). Host memory is therefore four fp32 copies of this rank's share of the
model at most, whatever the number of rounds.

Buffer hazards, and why they cannot happen: jobs run FIFO on one worker, and the island
(``boundary.py``) never snapshots a fragment before the previous commit of that fragment is
installed, never stages a fragment twice before installing it, and installs only what is
staged on every rank. So a push job of ``f`` (reads ``snap``, ``anchor``, writes ``work``)
always finishes before the staging job of ``f`` (writes ``staged``, ``work``), which
finishes before the install (reads ``staged``, ``work``; swaps anchor), which precedes the
next snapshot of ``f``. Device copies out of pinned buffers are fenced by events the next
writer of that buffer waits for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from diloco.island.transfer import _TAG_APPLY, _TAG_EXPORT, _TAG_FORWARD, ExportAssembly, FragmentTransfer, ShardSlices
from diloco.layout.base import group_rank
from gloo_bridge import device as dev

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]


class DataPath:
    """Background-capable export / apply of one rank; build on every rank after the FragmentTransfer.

    Args:
        xfer: the rank's FragmentTransfer (routes, pieces, anchors are shared with it).
        group: the data group: same ranks, same group ranks as ``xfer``'s group, used only
            by the background worker.
    """

    def __init__(self, xfer: FragmentTransfer, group: dist.ProcessGroup) -> None:
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
        self._pinned = any(dev.is_accelerator(p.master) for p in pieces) and dev.pinning_available()
        self._snap: dict[int, torch.Tensor] = {}
        self._work: dict[int, torch.Tensor] = {}
        self._staged: dict[int, torch.Tensor] = {}
        self._snap_event: dict[int, object | None] = {}
        self._install_event: dict[int, object | None] = {}
        self._side: dict[str, object | None] = {}
        self.bytes_sent = 0
        """Data-group bytes this rank sent (background thread)."""

    # ------------------------------------------------------------------ buffers
    def _buf(self, table: dict[int, torch.Tensor], p: int) -> torch.Tensor:
        t = table.get(p)
        if t is None:
            piece = self._x._pieces[p]
            n = piece.end - piece.start
            t = table[p] = dev.host_buffer(4 * n, self._pinned).view(torch.float32)
        return t

    def preallocate(self) -> int:
        """Allocate every buffer now (at start-up), not at a fragment's first push: pinned host
        memory is slow to allocate (a 700 MiB fragment's buffers cost ~0.5 s on the GPU host),
        and that must not land on a training step. Returns the bytes allocated."""
        total = 0
        for table in (self._snap, self._work, self._staged):
            for p in range(len(self._x._pieces)):
                total += self._buf(table, p).numel() * 4
        return total

    def _side_stream(self, device: torch.device) -> object | None:
        key = str(device)
        if key not in self._side:
            self._side[key] = dev.new_stream(device)
        return self._side[key]

    def share_nbytes(self, f: int) -> int:
        """Bytes of this rank's pieces of fragment ``f`` (what a snapshot copies)."""
        return sum(4 * (self._x._pieces[p].end - self._x._pieces[p].start) for p in self._mine[f])

    # ------------------------------------------------------------------ training thread
    def snapshot(self, f: int) -> None:
        """Copy this rank's pieces of ``f``'s masters into the snapshot buffers (θ_push).

        CPU: a plain copy. Accelerator: async copies on a side stream after the compute
        stream's pending work (the optimizer step); the compute stream then waits for them on
        the device, so the next write of a master cannot race the copy."""
        by_device: dict[str, list[int]] = {}
        for p in self._mine[f]:
            master = self._x._pieces[p].master
            if dev.is_accelerator(master):
                by_device.setdefault(str(master.device), []).append(p)
            else:
                self._buf(self._snap, p).copy_(master)
        self._snap_event[f] = None
        for name, ps in by_device.items():
            device = torch.device(name)
            side, main = self._side_stream(device), dev.current_stream(device)
            dev.stream_wait_event(side, dev.record_event(main))
            with dev.use_stream(side):
                for p in ps:
                    self._buf(self._snap, p).copy_(self._x._pieces[p].master, non_blocking=True)
            done = dev.record_event(side)
            dev.stream_wait_event(main, done)
            self._snap_event[f] = done

    def install(self, f: int, mode: str, alpha: float = 0.0) -> None:
        """Write ``f``'s masters from what :meth:`stage` staged; the staged global becomes the anchor.

        ``mode``: ``"cut"`` (master ← global), ``"progress"`` (master ← master + (global −
        snapshot), the correction precomputed by :meth:`stage`), ``"blend"`` (master ← α·master +
        (1−α)·global; exactly the global when α == 0)."""
        if mode not in ("cut", "progress", "blend"):
            raise ValueError(f"install: unknown mode {mode!r}")
        event = None
        for p, off, n in self._held[f]:
            master = self._x._pieces[p].master[off : off + n]
            staged = self._staged[p][off : off + n]
            nb = dev.is_accelerator(master)
            if mode == "progress":
                work = self._work[p][off : off + n]
                master.add_(work.to(master.device, non_blocking=True) if nb else work)
            elif mode == "cut" or alpha == 0.0:
                master.copy_(staged, non_blocking=nb)
            else:
                src = staged.to(master.device, non_blocking=True) if nb else staged
                master.mul_(alpha).add_(src, alpha=1.0 - alpha)
            if nb:
                event = dev.record_event(dev.current_stream(master.device))
        for p in self._mine[f]:
            # Swap: the staged global is the new anchor; the old anchor buffer is the next staging one.
            staged_full = self._staged.pop(p)
            old = self._x._anchors.get(p)
            self._x._anchors[p] = staged_full
            if old is not None:
                self._staged[p] = old
        self._install_event[f] = event
        self._x._anchored.add(f)

    # ------------------------------------------------------------------ background worker
    def gather_delta(self, f: int) -> Tensors | None:
        """Background, collective over the data group: ``snapshot − anchor`` of ``f`` gathered to
        the sync rank as global fp32 tensors in plan order (pooled buffers); None elsewhere."""
        x = self._x
        if f not in x._anchored:
            raise ValueError(f"gather_delta({f}): fragment {f} has no anchor (never applied)")
        dev.event_synchronize(self._snap_event.get(f))
        route = x._routes[f]

        def delta_into(out: torch.Tensor, p: int, off: int, n: int) -> torch.Tensor:
            return torch.sub(self._snap[p][off : off + n], x._anchors[p][off : off + n], out=out)

        if self._me != self._sync:
            sends = []
            for seg, h in route.export.get(self._me, []):
                d = delta_into(self._buf(self._work, h.piece)[h.off : h.off + seg.n], h.piece, h.off, seg.n)
                self.bytes_sent += 4 * seg.n
                sends.append(x._isend(d, self._sync, _TAG_EXPORT, self._group))
            x._wait(sends)
            return None
        asm = ExportAssembly(x._plan, f, x._pool)
        works = [
            x._irecv(asm.dest(seg), src, _TAG_EXPORT, self._group)
            for src, items in sorted(route.export.items())
            if src != self._sync
            for seg, _ in items
        ]
        for seg, h in route.export.get(self._sync, []):
            delta_into(asm.dest(seg), h.piece, h.off, seg.n)
        x._wait(works)
        return asm.finish()

    def stage(self, f: int, values: Sequence[tuple[str, torch.Tensor]] | None, progress: bool) -> int:
        """Background, collective over the data group: scatter ``f``'s global values (sync rank
        only; fp32 or bf16, upcast here, off the training thread) into every holder's staging
        buffers; with ``progress`` also precompute ``work = staged − snapshot``.

        Returns the bytes the sync rank handed out (each element once), 0 elsewhere."""
        x = self._x
        route = x._routes[f]
        dev.event_synchronize(self._install_event.pop(f, None))  # an async copy may still read a buffer

        def slot(h_piece: int, off: int, n: int) -> torch.Tensor:
            return self._buf(self._staged, h_piece)[off : off + n]

        mine = route.apply.get(self._me, []) if self._me != self._sync else []
        works = [x._irecv(slot(h.piece, h.off, seg.n), self._sync, _TAG_APPLY, self._group) for seg, h in mine]
        fwd_in = [(p, n, h) for (p, q), items in sorted(route.forward.items()) if q == self._me for _, n, h in items]
        fwd_works = [x._irecv(slot(h.piece, h.off, n), p, _TAG_FORWARD, self._group) for p, n, h in fwd_in]
        handed = 0
        keep: list[torch.Tensor] = []
        if self._me == self._sync:
            handed, sends = self._scatter(f, values, keep)
            works += sends
        x._wait(works)
        sends = [
            x._isend(slot(hp.piece, hp.off, n), q, _TAG_FORWARD, self._group)
            for (p, q), items in sorted(route.forward.items())
            if p == self._me
            for hp, n, _ in items
        ]
        x._wait(sends)
        x._wait(fwd_works)
        del keep
        for p in self._mine[f]:
            self._buf(self._staged, p)  # every held piece gets a staging buffer (swapped in at install)
        if progress:
            for p, off, n in self._held[f]:
                torch.sub(self._staged[p][off : off + n], self._snap[p][off : off + n],
                          out=self._buf(self._work, p)[off : off + n])
        return handed

    def _scatter(self, f: int, values: Sequence[tuple[str, torch.Tensor]] | None,
                 keep: list[torch.Tensor]) -> tuple[int, list[dist.Work]]:
        x = self._x
        route = x._routes[f]
        specs = x._plan.specs_of(f)
        if values is None or len(values) != len(specs):
            raise ValueError(f"stage({f}): expected {len(specs)} tensors on the sync rank")
        table: dict[str, torch.Tensor] = {}
        for (name, t), spec in zip(values, specs):
            if name != spec.name or tuple(t.shape) != spec.shape or t.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"stage({f}): got {name} {tuple(t.shape)} {t.dtype}, want {spec.name} {spec.shape}")
            if t.dtype != torch.float32:  # the bf16 wire: upcast here, into a pooled buffer
                t = x._pool.empty(tuple(t.shape), torch.float32).copy_(t)
            table[name] = t.contiguous()
        flat = ShardSlices(table)

        works, network, own = [], 0, 0
        for dst, items in sorted(route.apply.items()):
            if dst == self._sync:
                continue
            for seg, _ in items:
                network += seg.n * 4
                t = flat(seg)
                keep.append(t)
                self.bytes_sent += 4 * seg.n
                works.append(x._isend(t, dst, _TAG_APPLY, self._group))
        primaries = {(s.name, s.shard.key(), s.a) for d, items in route.apply.items() if d != self._sync
                     for s, _ in items}
        for seg, h in route.apply.get(self._sync, []):
            self._buf(self._staged, h.piece)[h.off : h.off + seg.n].copy_(flat(seg))
            if (seg.name, seg.shard.key(), seg.a) not in primaries:
                own += seg.n * 4
        return network + own, works

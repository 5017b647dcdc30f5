"""The snapshot slots of one rank: where θ_push of an outstanding push lives until its round is installed.

:class:`SnapshotSlots` owns one block of ``n`` slots, each sized to the rank's largest share of
one fragment (whatever the number of fragments), and the table of which fragment holds which
slot. A slot lives in one of two places:

* **host memory** (default; pinned when the masters live on an accelerator): the snapshot is an
  async device-to-host copy on a side stream, fenced by an event the compute stream waits for;
* **the accelerator's memory** (``YETO_DILOCO_SNAPSHOT_ON_DEVICE``, masters on one accelerator):
  the snapshot is a device copy on the compute stream; the push copies the slot down part by
  part; staging copies the global up a chunk at a time to form the correction on the device.

Either way staging turns the slot into the progress correction ``global − θ_push`` in place and
the install adds it to the masters (``datapath.DataPath``); the slot is free again once the
install is recorded. Memory: ``n`` slots, allocated once at start-up (:meth:`allocate`), freed
after the final cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from diloco.hostmem import copy_in_parallel, sub_in_parallel
from gloo_bridge import device as dev

DEVICE_CHUNK_ELEMS = 16 << 20
"""Elements of the global a device slot's staging copies up at once (64 MiB of device memory)."""
UPLOAD_CHUNK_ELEMS = 128 << 20
"""Elements per half of the free block that :meth:`SnapshotSlots.upload` bounces through (512 MiB)."""


class SnapshotSlots:
    """``n`` snapshot slots of one rank and the fragments holding them.

    Args:
        masters: every local piece's master (flat fp32), by piece index.
        n: the number of slots (``YETO_DILOCO_SNAPSHOT_SLOTS``).
        pinned: host slots are page-locked (masters on an accelerator and pinning available).
        on_device: keep the slots beside the masters when they all live on one accelerator.
    """

    def __init__(self, masters: Sequence[torch.Tensor], n: int, pinned: bool, on_device: bool) -> None:
        if n < 1:
            raise ValueError(f"SnapshotSlots: n must be >= 1, got {n}")
        self.n = n
        self._masters = masters
        self._pinned = pinned
        devices = {m.device for m in masters}
        self.device: torch.device | None = None
        """Where the slots live when not in host memory (None: host)."""
        if on_device and len(devices) == 1 and dev.is_accelerator(masters[0]):
            self.device = masters[0].device
        self._block: torch.Tensor | None = None
        self._owners: dict[int, int] = {}
        """Fragment -> index of the slot holding its θ_push."""
        self._views: dict[int, torch.Tensor] = {}
        """Piece -> its θ_push in its fragment's slot (pieces belong to one fragment each)."""
        self._events: dict[int, object | None] = {}
        """Slot index -> the event of the last install that read it (a reuse waits for it)."""
        self.snap_event: object | None = None
        """The event after which the latest snapshot is complete (the push waits for it)."""
        self._side: dict[str, object | None] = {}

    # ------------------------------------------------------------------ buffers
    def allocate(self, slot_bytes: int) -> dict[str, int]:
        """Allocate the block once (start-up): pinned memory is slow to allocate and must not land
        on a training step. Returns the bytes by kind: host, pinned, device."""
        if self._block is None and self.device is not None:
            self._block = torch.empty(self.n * slot_bytes // 4, dtype=torch.float32, device=self.device)
        elif self._block is None:
            self._block = dev.host_buffer(self.n * slot_bytes, self._pinned).view(torch.float32)
        total = self._block.numel() * 4
        host = 0 if self.device is not None else total
        return {"snapshot_slots": host, "pinned": host if self._pinned else 0, "device_snapshot_slots": total - host}

    def free(self) -> None:
        """Forget every snapshot and give the block back (after the final cut)."""
        self.release_all()
        if self._block is not None and self.device is None:
            dev.free_host_buffer(self._block)
        self._block = None

    @property
    def allocated(self) -> bool:
        """Whether the block is allocated (between :meth:`allocate` and :meth:`free`)."""
        return self._block is not None

    # ------------------------------------------------------------------ the table
    def free_for(self, f: int) -> bool:
        """Whether a snapshot of ``f`` may be taken now (a slot is free, or already ``f``'s)."""
        return f in self._owners or len(self._owners) < self.n

    def free_count(self) -> int:
        return self.n - len(self._owners)

    def holders(self) -> frozenset[int]:
        return frozenset(self._owners)

    def holds(self, f: int) -> bool:
        return f in self._owners

    def view(self, p: int) -> torch.Tensor | None:
        """θ_push of piece ``p`` in its slot, or None when no slot holds its fragment."""
        return self._views.get(p)

    def release(self, f: int, pieces: Sequence[int]) -> None:
        """Give ``f``'s slot back (its views go with it)."""
        if self._owners.pop(f, None) is not None:
            for p in pieces:
                self._views.pop(p, None)

    def release_all(self) -> None:
        self._owners, self._views = {}, {}

    def installed(self, f: int, pieces: Sequence[int], event: object | None) -> None:
        """The install of ``f`` read its slot up to ``event``: the next snapshot into it waits; the slot is free."""
        if f in self._owners:
            self._events[self._owners[f]] = event
            self.release(f, pieces)

    def wait_reads(self, f: int) -> None:
        """Block until no device copy still reads ``f``'s slot (before staging writes it)."""
        if f in self._owners:
            dev.event_synchronize(self._events.get(self._owners[f]))

    # ------------------------------------------------------------------ copies
    def upload(self, master: torch.Tensor, src: torch.Tensor) -> bool:
        """``master.copy_(src)`` for a flat device master and a flat pageable host ``src``, through
        the page-locked block while no slot is held: each half of the block in turn is filled by
        several host threads while the device copies the other half up, instead of the driver's
        one-thread pageable copy (about 5 GB/s on the device host: 2 s for a 2.7B final cut).
        Returns once the device holds every byte (the block is free again), True; False, having
        done nothing, when the block is not pinned host memory, is held, or ``master`` is on the
        host (the caller copies as before)."""
        block = self._block
        if block is None or block.numel() < 2 or self.device is not None or not self._pinned or self._owners \
                or not dev.is_accelerator(master) or src.device.type != "cpu" or src.numel() != master.numel() \
                or not master.dtype == src.dtype == block.dtype:
            return False
        for event in self._events.values():  # an earlier install may still read the block
            dev.event_synchronize(event)
        self._events.clear()
        half = min(UPLOAD_CHUNK_ELEMS, block.numel() // 2)
        halves = (block[:half], block[half : 2 * half])
        stream = dev.current_stream(master.device)
        pending: list[object | None] = [None, None]
        for i, lo in enumerate(range(0, master.numel(), half)):
            hi = min(master.numel(), lo + half)
            buf = halves[i % 2][: hi - lo]
            dev.event_synchronize(pending[i % 2])  # the device has read this half's previous chunk
            copy_in_parallel(src[lo:hi], buf)
            master[lo:hi].copy_(buf, non_blocking=True)
            pending[i % 2] = dev.record_event(stream)
        for event in pending:
            dev.event_synchronize(event)
        return True

    def take(self, f: int, pieces: Sequence[int], lengths: Sequence[int]) -> None:
        """Training thread: copy the masters of ``pieces`` (``lengths`` elements each) into a slot for
        ``f``. Refuses (ValueError) when every slot holds another fragment."""
        if not self.free_for(f):
            raise ValueError(f"snapshot({f}): every slot is taken (fragments {sorted(self._owners)})")
        assert self._block is not None, "allocate() the slots first"
        if f not in self._owners:
            self._owners[f] = min(set(range(self.n)) - set(self._owners.values()))
        idx, pos = self._owners[f], 0
        # A device copy out of this slot (an earlier install) is on the compute stream: the copies
        # below are ordered after it by that stream (device slots) or by waiting for it (side stream).
        self._events.pop(idx, None)
        base = self._block[idx * (self._block.numel() // self.n):]
        for p, n in zip(pieces, lengths):
            self._views[p] = base[pos : pos + n]
            pos += n
        if self.device is not None:
            for p in pieces:
                self._views[p].copy_(self._masters[p])
            self.snap_event = dev.record_event(dev.current_stream(self.device))
            return
        by_device: dict[str, list[int]] = {}
        for p in pieces:
            if dev.is_accelerator(self._masters[p]):
                by_device.setdefault(str(self._masters[p].device), []).append(p)
            else:
                self._views[p].copy_(self._masters[p])
        self.snap_event = None
        for name, ps in by_device.items():
            device = torch.device(name)
            side, main = self._side_stream(device), dev.current_stream(device)
            dev.stream_wait_event(side, dev.record_event(main))
            with dev.use_stream(side):
                for p in ps:
                    self._views[p].copy_(self._masters[p], non_blocking=True)
            done = dev.record_event(side)
            dev.stream_wait_event(main, done)
            self.snap_event = done

    def correct(self, f: int, runs: Sequence[tuple[int, int, int]], global_of: Callable[[int], torch.Tensor]) -> None:
        """Background: turn ``f``'s slot into ``global − θ_push`` in place over ``runs`` (piece, offset,
        length), ``global_of(p)`` being piece ``p``'s global (host). A device slot gets the global a
        chunk at a time; this returns once the device is done."""
        if f not in self._owners:
            raise ValueError(f"stage({f}, progress): the slot does not hold fragment {f}")
        for p, off, n in runs:
            work = self._views[p][off : off + n]
            g = global_of(p)[off : off + n]
            if work.device.type == "cpu":
                sub_in_parallel(g, work, work)  # gigabytes on the host: several threads, not torch's one
                continue
            for a in range(0, n, DEVICE_CHUNK_ELEMS):
                b = min(n, a + DEVICE_CHUNK_ELEMS)
                torch.sub(g[a:b].to(work.device, non_blocking=True), work[a:b], out=work[a:b])
        if self.device is not None:
            dev.event_synchronize(dev.record_event(dev.current_stream(self.device)))

    def _side_stream(self, device: torch.device) -> object | None:
        key = str(device)
        if key not in self._side:
            self._side[key] = dev.new_stream(device)
        return self._side[key]

"""Export (gather) and apply (scatter) of one fragment between an island's ranks and its sync rank.

The syncer speaks canonical global fp32 tensors; inside the island they are
cut by TP / PP / EP and the distributed optimizer (see `diloco.layout.base`).
`FragmentTransfer` precomputes, once, for every fragment, which rank sends
which range of which shard to whom, from an all-gather of every rank's piece
descriptions (JSON bytes, no pickle). The payload then travels point to point
into preallocated buffers whose sizes every rank already knows, so no metadata
travels at transfer time and nothing is ever sent to the whole world.

Export: for each element the sync rank's own copy is used when it holds one,
else the lowest rank that holds it sends it (one message per source rank).

Apply, in two hops so that each element leaves the sync rank at most once:
1. the sync rank writes the elements it holds itself and sends every other
   element to its *primary* holder (the lowest non-sync rank that holds it);
2. primaries forward to the other holders (replicas: TP-replicated norms, the
   tied output copy on the last PP stage, DP replicas without a distributed
   optimizer).
Each holder blends its fp32 master (`alpha * master + (1 - alpha) * global`;
exactly `global` when alpha == 0), stores the raw global as the anchor, then
all ranks refresh the model copies (distributed optimizer: DP all-gather).

Ordering hazard: every method here is collective over the island group and
every rank must call them in the same order with the same fragment index, or
point-to-point messages pair up wrongly and the island deadlocks (every wait
has a timeout, so it fails instead of hanging forever).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from diloco.hostmem import zero_in_parallel
from diloco.island.delta_source import host_delta
from diloco.wire.hostpool import HostBufferPool
from diloco.layout.base import (
    LayoutAdapter,
    ShardInfo,
    all_gather_json,
    place_shard,
    shard_from_description,
    shard_of_global,
)
from diloco.plan import FragmentPlan

log = logging.getLogger(__name__)

_TAG_EXPORT = 71
_TAG_APPLY = 72
_TAG_FORWARD = 73


@dataclass(frozen=True)
class _Seg:
    """Elements [a, b) of the flattened valid part of shard `shard` of canonical tensor `name`."""

    name: str
    shard: ShardInfo
    a: int
    b: int

    @property
    def n(self) -> int:
        return self.b - self.a


@dataclass(frozen=True)
class _Hold:
    """Where a holder rank keeps a segment: its piece index and the offset inside that piece's master."""

    rank: int
    piece: int
    off: int


@dataclass
class _Route:
    """Precomputed traffic of one fragment (identical on every rank)."""

    # export: source rank -> [(segment, where the source reads it)], sync rank's own list under its key
    export: dict[int, list[tuple[_Seg, _Hold]]] = field(default_factory=dict)
    # apply hop 1: destination rank -> [(segment, where the destination writes it)], sync's own under its key
    apply: dict[int, list[tuple[_Seg, _Hold]]] = field(default_factory=dict)
    # apply hop 2: (primary, replica) -> [(where the primary holds it, n, where the replica writes it)]
    forward: dict[tuple[int, int], list[tuple[_Hold, int, _Hold]]] = field(default_factory=dict)
    pieces: set[tuple[int, int]] = field(default_factory=set)
    """(rank, piece index) of every piece in the fragment."""


def _contiguous_base(shard: ShardInfo) -> int | None:
    """Flat offset of the shard's valid part in the canonical tensor when it is one contiguous block."""
    if shard.partition_dim < 0:
        return 0
    if shard.partition_dim == 0 and shard.partition_stride == 1:
        return shard.shard_rank * shard.local_numel
    return None


class ShardSlices:
    """Segments of a fragment's global values, as a rank's shard sees them (apply hop 1).

    Each (tensor, shard) is cut out of the global tensor once (``shard_of_global``) and
    reused for every segment of it."""

    def __init__(self, table: dict[str, torch.Tensor]) -> None:
        self._table = table
        self._cache: dict[tuple[str, tuple[int, int, int]], torch.Tensor] = {}

    def __call__(self, seg: _Seg) -> torch.Tensor:
        key = (seg.name, seg.shard.key())
        if key not in self._cache:
            self._cache[key] = shard_of_global(self._table[seg.name], seg.shard)
        return self._cache[key][seg.a : seg.b]


class ExportAssembly:
    """Fragment ``f``'s global fp32 tensors being assembled on the sync rank from segments.

    A segment lands directly in its global tensor when its shard is one contiguous block;
    strided / dim-1 shards are staged whole and placed by :meth:`finish`, once every piece
    has arrived. Buffers come from ``pool`` (the next export needs the same sizes)."""

    def __init__(self, plan: FragmentPlan, f: int, pool: HostBufferPool) -> None:
        self._plan, self._f, self._pool = plan, f, pool
        self.out = {spec.name: pool.empty(tuple(spec.shape), torch.float32) for spec in plan.specs_of(f)}
        self._staged: dict[tuple[str, tuple[int, int, int]], tuple[ShardInfo, torch.Tensor]] = {}

    def dest(self, seg: _Seg) -> torch.Tensor:
        """Where a segment lands."""
        base = _contiguous_base(seg.shard)
        if base is not None:
            return self.out[seg.name].view(-1)[base + seg.a : base + seg.b]
        key = (seg.name, seg.shard.key())
        if key not in self._staged:
            size = seg.shard.valid_numel(tuple(self.out[seg.name].shape))
            self._staged[key] = (seg.shard, self._pool.empty((size,), torch.float32))
        return self._staged[key][1][seg.a : seg.b]

    def finish(self) -> list[tuple[str, torch.Tensor]]:
        """Place the staged shards; the fragment's tensors in plan order."""
        for (name, _), (shard, flat) in self._staged.items():
            place_shard(self.out[name], shard, flat)
        return [(name, self.out[name]) for name in self._plan.names(self._f)]


class FragmentTransfer:
    """Built once per island on every rank. Collective methods: every rank calls them in the same order.

    Args:
        layout: this rank's layout adapter (its group must be `group`).
        plan: the fragment plan (same on every rank and island).
        group: the island's CPU (gloo) group; ranks below are group ranks.
        sync_rank: group rank that talks to the syncer and holds global tensors.
        timeout: bound on every point-to-point wait.
    """

    def __init__(
        self,
        layout: LayoutAdapter,
        plan: FragmentPlan,
        group: dist.ProcessGroup,
        sync_rank: int = 0,
        timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        self._layout = layout
        self._plan = plan
        self._group = group
        self._sync = sync_rank
        self._me = int(group.rank())  # also for a private 1-rank group (layout.base.island_group)
        self._world = dist.get_world_size(group)
        self._timeout = timeout
        self._pieces = layout.local_pieces()
        self._anchors: dict[int, torch.Tensor] = {}
        # Exported global tensors are freed once sent, and the next export needs the same
        # sizes (layers share shapes): reusing their pages avoids first-touch page faults on
        # every export. One fragment's worth idle.
        largest = max((plan.nbytes(f) for f in range(plan.n_fragments)), default=0)
        self._pool = HostBufferPool(max_idle_bytes=largest)
        self._anchored: set[int] = set()
        self.bytes_sent = 0
        """Network bytes this rank sent through this object, all calls."""
        self.last_apply_network_bytes = 0
        """Network bytes the sync rank sent in the last apply (hop 1 only; it never forwards)."""
        specs = layout.specs()
        if specs != plan.specs:
            raise ValueError("FragmentTransfer: the layout's canonical table differs from the plan's")
        descs = all_gather_json([p.describe() for p in self._pieces], group)
        self._routes = self._build_routes(descs)

    # -- routing -------------------------------------------------------------

    def _build_routes(self, descs: list[list[dict]]) -> list[_Route]:
        by_name: dict[str, dict[tuple[int, int, int], list[tuple[int, int, int, int, ShardInfo]]]] = {}
        for rank, pieces in enumerate(descs):
            for idx, d in enumerate(pieces):
                shard = shard_from_description(d)
                by_name.setdefault(d["name"], {}).setdefault(shard.key(), []).append(
                    (rank, idx, int(d["start"]), int(d["end"]), shard)
                )
        unknown = set(by_name) - set(self._plan.specs)
        if unknown:
            raise ValueError(f"pieces of unknown canonical params: {sorted(unknown)[:5]}")
        routes = []
        for f in range(self._plan.n_fragments):
            route = _Route()
            for spec in self._plan.specs_of(f):
                shards = by_name.get(spec.name, {})
                covered = 0
                for key in sorted(shards):
                    holders = shards[key]
                    shard = holders[0][4]
                    if any(h[4] != shard for h in holders):
                        raise ValueError(f"{spec.name}: replicas disagree on the shard layout")
                    valid = shard.valid_numel(spec.shape)
                    cuts = sorted({0, valid} | {min(max(x, 0), valid) for h in holders for x in (h[2], h[3])})
                    for a, b in zip(cuts, cuts[1:]):
                        owners = [
                            _Hold(rank, idx, a - s) for rank, idx, s, e, _ in holders if s <= a and b <= e
                        ]
                        if not owners:
                            raise ValueError(f"{spec.name}: elements [{a},{b}) of shard {key} have no holder")
                        covered += b - a
                        seg = _Seg(spec.name, shard, a, b)
                        for h in owners:
                            route.pieces.add((h.rank, h.piece))
                        mine = [h for h in owners if h.rank == self._sync]
                        others = sorted((h for h in owners if h.rank != self._sync), key=lambda h: h.rank)
                        src = mine[0] if mine else others[0]
                        route.export.setdefault(src.rank, []).append((seg, src))
                        for h in mine:
                            route.apply.setdefault(self._sync, []).append((seg, h))
                        if others:
                            primary = others[0]
                            route.apply.setdefault(primary.rank, []).append((seg, primary))
                            for h in others[1:]:
                                route.forward.setdefault((primary.rank, h.rank), []).append((primary, seg.n, h))
                if covered != spec.numel:
                    raise ValueError(f"{spec.name}: the island holds {covered} of {spec.numel} elements")
            routes.append(route)
        return routes

    # -- helpers -------------------------------------------------------------

    def _wait(self, works: list[dist.Work]) -> None:
        for w in works:
            # A timeout here means a peer did not reach the same call: fail loudly, never hang.
            w.wait(self._timeout)

    @staticmethod
    def _peer_of(group: dist.ProcessGroup, group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank) if group is not dist.group.WORLD else group_rank

    def _isend(self, t: torch.Tensor, dst: int, tag: int, group: dist.ProcessGroup | None = None) -> dist.Work:
        g = self._group if group is None else group
        if group is None:
            self.bytes_sent += t.numel() * t.element_size()
        work = dist.isend(t, dst=self._peer_of(g, dst), group=g, tag=tag)
        assert work is not None  # only None for a rank outside the group, which we never are
        return work

    def _irecv(self, t: torch.Tensor, src: int, tag: int, group: dist.ProcessGroup | None = None) -> dist.Work:
        g = self._group if group is None else group
        work = dist.irecv(t, src=self._peer_of(g, src), group=g, tag=tag)
        assert work is not None
        return work

    def _read(self, h: _Hold, n: int, delta: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """A host (CPU) tensor of the segment's master, or master - anchor; written into ``out``
        when given (copied down once, no temporary), else a view of a host master or a new tensor.

        Masters may live on an accelerator; gloo must only ever see host memory (handed a
        CUDA tensor it crashes the process), and anchors live on the host to spare device
        memory, so the segment is copied down first.
        """
        master = self._pieces[h.piece].master[h.off : h.off + n]
        if delta:
            return host_delta(master, self._anchors[h.piece][h.off : h.off + n], out)
        if out is not None:
            return out.copy_(master)
        return master if master.device.type == "cpu" else master.to("cpu")

    def anchor_of(self, piece: int) -> torch.Tensor:
        """The flat fp32 anchor of one local piece (the global value last installed there),
        allocated on first use: with :meth:`anchor_nbytes`, this rank's only buffer that grows
        with the model."""
        anchor = self._anchors.get(piece)
        if anchor is None:
            p = self._pieces[piece]
            anchor = self._anchors[piece] = torch.zeros(p.end - p.start, dtype=torch.float32)
        return anchor

    def allocate_anchors(self) -> None:
        """Allocate every local piece's anchor now (start-up) as views of **one** flat block,
        zeroed by several threads (:func:`diloco.hostmem.zero_in_parallel`): resident before the
        first value lands. One block is mapped on its own (far above glibc's mmap threshold), so
        the anchors never interleave with the training loop's heap blocks, and it is unmapped
        whole once the last view dies (:meth:`free_anchors`)."""
        missing = [piece for piece in range(len(self._pieces)) if piece not in self._anchors]
        sizes = [self._pieces[piece].end - self._pieces[piece].start for piece in missing]
        block = torch.empty(sum(sizes), dtype=torch.float32)
        zero_in_parallel([block])
        for piece, view in zip(missing, block.split(sizes)):
            self._anchors[piece] = view

    def pool_max_idle(self) -> int:
        """Most bytes the export pool keeps idle (one fragment)."""
        return self._pool.max_idle_bytes

    def drop_pool(self) -> None:
        """Free the export pool's idle buffers and keep none from now on (after INIT, when
        nothing on this rank exports through the pool again; exports then allocate afresh)."""
        self._pool.max_idle_bytes = 0
        self._pool.clear()

    def free_anchors(self) -> None:
        """Drop every anchor (after the final cut: nothing is pushed or blended any more)."""
        self._anchors.clear()
        self._anchored.clear()

    def anchor_nbytes(self) -> int:
        """Bytes of the anchors allocated so far (every piece's once all are)."""
        return sum(a.numel() * 4 for a in self._anchors.values())

    def _anchor(self, h: _Hold, n: int) -> torch.Tensor:
        """The anchor slice of a held segment; apply receives the raw global straight into it."""
        return self.anchor_of(h.piece)[h.off : h.off + n]

    def _install(self, h: _Hold, n: int, alpha: float) -> None:
        """master <- alpha * master + (1 - alpha) * anchor (exactly the anchor when alpha == 0)."""
        master = self._pieces[h.piece].master[h.off : h.off + n]
        anchor = self._anchor(h, n)
        if alpha == 0.0:
            master.copy_(anchor)  # copy_ crosses devices (host anchor -> accelerator master)
        else:
            master.copy_(master * alpha + anchor.to(master.device) * (1.0 - alpha))

    # -- public API ------------------------------------------------------------

    def refresh(self, fragments: Iterable[int]) -> None:
        """Collective: bring the model copies of these fragments' params up to date (after
        applies with ``refresh=False``)."""
        self._layout.refresh_model_params([n for f in fragments for n in self._plan.names(f)])

    def fragment_nbytes(self, f: int) -> int:
        """Bytes of fragment f's fp32 global tensors."""
        return self._plan.nbytes(f)

    def has_anchor(self, f: int) -> bool:
        """Whether fragment f was applied at least once (identical on all ranks: apply is collective)."""
        return f in self._anchored

    def export_fragment(self, f: int, *, delta: bool) -> list[tuple[str, torch.Tensor]] | None:
        """Collective: gather fragment f's global fp32 tensors (plan order) on the sync rank; None elsewhere.

        delta=False gives the masters; delta=True gives master - anchor,
        computed on the owning ranks so only deltas travel. Raises ValueError
        on every rank alike when delta is asked before any apply of f.
        """
        if delta and f not in self._anchored:
            raise ValueError(f"export_fragment({f}, delta=True) before any apply of fragment {f}: no anchor")
        route = self._routes[f]
        if self._me != self._sync:
            # One message per segment, sent straight from the master (no packing copy when delta=False).
            keep = [self._read(h, seg.n, delta) for seg, h in route.export.get(self._me, [])]
            self._wait([self._isend(x, self._sync, _TAG_EXPORT) for x in keep])
            return None
        asm = ExportAssembly(self._plan, f, self._pool)
        # Post every receive first (into its final place), then copy the sync rank's own pieces
        # while the receives are in flight.
        works = [
            self._irecv(asm.dest(seg), src, _TAG_EXPORT)
            for src, items in sorted(route.export.items())
            if src != self._sync
            for seg, _ in items
        ]
        for seg, h in route.export.get(self._sync, []):
            self._read(h, seg.n, delta, out=asm.dest(seg))  # straight into its place
        self._wait(works)
        return asm.finish()

    def apply_fragment(
        self,
        f: int,
        values: Sequence[tuple[str, torch.Tensor]] | None,
        *,
        alpha: float = 0.0,
        refresh: bool = True,
    ) -> int:
        """Collective: install fragment f's global values (given on the sync rank only).

        Returns the fragment bytes the sync rank handed out (each element
        counted once, whether it went over the network to its primary holder
        or into the sync rank's own master; `last_apply_network_bytes` has the
        network part), 0 on other ranks.

        refresh=False skips `layout.refresh_model_params()` (the model copy is
        then stale until the caller refreshes, collectively, e.g. once after
        several applies); every rank must pass the same value.
        """
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        route = self._routes[f]
        handed = 0
        # Receives land straight in the anchor slices (the anchor IS the raw global), then
        # the master is installed from there: no staging buffers, one copy per element.
        mine = route.apply.get(self._me, []) if self._me != self._sync else []
        works = [self._irecv(self._anchor(h, seg.n), self._sync, _TAG_APPLY) for seg, h in mine]
        fwd_in = [
            (p, n, h) for (p, q), items in sorted(route.forward.items()) if q == self._me for _, n, h in items
        ]
        fwd_works = [self._irecv(self._anchor(h, n), p, _TAG_FORWARD) for p, n, h in fwd_in]
        if self._me == self._sync:
            handed, works = self._scatter(f, route, values, alpha)
        self._wait(works)
        # Hop 2 only after hop 1 landed: a primary forwards what it has just received.
        sends = [
            self._isend(self._anchor(hp, n), q, _TAG_FORWARD)
            for (p, q), items in sorted(route.forward.items())
            if p == self._me
            for hp, n, _ in items
        ]
        for seg, h in mine:
            self._install(h, seg.n, alpha)
        self._wait(sends)
        self._wait(fwd_works)
        for _, n, h in fwd_in:
            self._install(h, n, alpha)
        self._anchored.add(f)
        # Every rank reaches this point only after its own receives completed;
        # the refresh is itself a collective, so no rank reads a stale model copy.
        if refresh:
            self.refresh([f])
        return handed

    def _scatter(
        self, f: int, route: _Route, values: Sequence[tuple[str, torch.Tensor]] | None, alpha: float
    ) -> tuple[int, list[dist.Work]]:
        """Sync rank side of apply hop 1 (fp32 values only): :meth:`scatter_to_anchors` on the
        island group, then the sync rank's own masters installed from their anchors."""
        for name, t in values or []:
            if t.dtype != torch.float32:
                raise ValueError(f"apply_fragment({f}): got {name} {t.dtype}, want float32")
        keep: list[torch.Tensor] = []
        handed, works, network = self.scatter_to_anchors(f, values, self._group, keep, what="apply_fragment")
        self.bytes_sent += network
        for seg, h in route.apply.get(self._sync, []):
            self._install(h, seg.n, alpha)
        self.last_apply_network_bytes = network
        return handed, works

    def scatter_to_anchors(self, f: int, values: Sequence[tuple[str, torch.Tensor]] | None,
                           group: dist.ProcessGroup, keep: list[torch.Tensor],
                           what: str = "stage") -> tuple[int, list[dist.Work], int]:
        """Sync rank side of hop 1 of a staged apply, on ``group``: send every primary holder its
        slice of ``values`` (fp32 or bf16, upcast one segment at a time; the upcast copies go
        into ``keep`` until the sends complete) and write the sync rank's own anchors. Writes no
        master. Returns (bytes handed out, each element once; the send works; network bytes).
        Refuses (ValueError, naming ``what``) values that do not match the plan."""
        route = self._routes[f]
        specs = self._plan.specs_of(f)
        if values is None or len(values) != len(specs):
            raise ValueError(f"{what}({f}): expected {len(specs)} tensors on the sync rank")
        table: dict[str, torch.Tensor] = {}
        for (name, t), spec in zip(values, specs):
            if name != spec.name or tuple(t.shape) != spec.shape or t.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{what}({f}): got {name} {tuple(t.shape)} {t.dtype}, want {spec.name} {spec.shape}")
            table[name] = t.contiguous()
        flat = ShardSlices(table)
        works, network, own = [], 0, 0
        for dst, items in sorted(route.apply.items()):
            if dst == self._sync:
                continue
            for seg, _ in items:
                network += seg.n * 4
                t = flat(seg)
                if t.dtype != torch.float32:  # the bf16 wire: upcast here, one segment at a time
                    t = t.float()
                keep.append(t)
                works.append(self._isend(t, dst, _TAG_APPLY, group))
        primaries = {(s.name, s.shard.key(), s.a) for d, items in route.apply.items() if d != self._sync
                     for s, _ in items}
        for seg, h in route.apply.get(self._sync, []):
            dst, src = self._anchor(h, seg.n), flat(seg)
            if dst.data_ptr() != src.data_ptr():  # a value received straight into the anchor
                dst.copy_(src)
            if (seg.name, seg.shard.key(), seg.a) not in primaries:
                own += seg.n * 4
        return network + own, works, network

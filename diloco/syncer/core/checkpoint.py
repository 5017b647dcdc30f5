"""What a checkpoint holds, taken from and restored into the core's tables (docs/PROTOCOL.md,
"Checkpoint").

:func:`snapshot` builds a :class:`~diloco.syncer.core.records.Snapshot` that shares the
fragments' tensors (values are never written in place) and pins every fragment until the writer
has written it; :func:`restore` checks a snapshot and fills a fresh core's fragments table,
ledgers, key bindings and round numbers from it, or raises ValueError naming what is wrong.
No I/O: the store reads and writes the files.
"""

from __future__ import annotations

import logging

import torch

from diloco.syncer.core.book import FragmentBook, zeros
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.kernels import BLOCK, absmax
from diloco.syncer.core.records import FragmentRecord, FragmentSnapshot, Snapshot
from diloco.syncer.core.roundbook import RoundBook
from diloco.syncer.core.sessions import Sessions
from diloco.wire import FragmentLayout

log = logging.getLogger("diloco.syncer.core")


def snapshot(config: SyncerConfig, book: FragmentBook, rounds: RoundBook, sessions: Sessions) -> Snapshot:
    """The checkpointable state, consistent as of now, safe to write on another thread.

    Tensors are shared, not copied: values are never written in place (a commit writes the next
    value elsewhere), and every fragment is *pinned* (``book.pinned``) until the writer has
    written it: a commit with momentum waits for that, since it updates the momentum in place
    (``merge.PIN_WAIT_S``). A superseded value the writer still holds counts against the fragment
    buffers' budget, so the next round opens once it is let go (``RoundBook.sum_fits``): a
    checkpoint costs no extra memory. RuntimeError before every fragment is initialised."""
    if not book.initialised or book.fingerprint is None:
        raise RuntimeError("nothing to checkpoint before every fragment is initialised")
    book.pin_all()
    frags = []
    for f in book.fragments:
        assert f.value is not None and f.layout is not None
        # No momentum buffer (momentum 0, or no commit yet): zeros that occupy no memory.
        zero = f.momentum is None
        frags.append(FragmentSnapshot(f.version, f.schema, f.value, zeros(f.layout.numel) if zero else f.momentum,
                                      momentum_is_zero=zero))
    return Snapshot(
        fingerprint=book.fingerprint,
        n_fragments=book.n_fragments,
        fragments=tuple(frags),
        order=write_order(rounds, book.n_fragments),
        next_round=rounds.next_commit,
        ledgers={i.island: i.ledger.to_json() for i in sessions.islands},
        hyper={
            "outer_lr": config.outer_lr,
            "outer_momentum": config.outer_momentum,
            "weighting": config.weighting,
            "sync_every": config.sync_every,
            "key_bindings": sessions.gate.to_json(),
        },
    )


def write_order(rounds: RoundBook, n_fragments: int) -> tuple[int, ...]:
    """The order a checkpoint writes the fragments in: the one the next commit supersedes first.

    A fragment the writer still holds keeps its superseded value alive after a commit (and, with
    momentum, makes that commit write the momentum out of place): fragments of open rounds come
    first, oldest round first, then the rest in the order the round clock reaches them."""
    order = [r.fragment for r in rounds.in_order()]
    nxt = (rounds.next_open - 1) % n_fragments  # the fragment of the next round to open
    order += [(nxt + k) % n_fragments for k in range(n_fragments)]
    return tuple(dict.fromkeys(order))


def restore(snap: Snapshot, config: SyncerConfig, book: FragmentBook, rounds: RoundBook, sessions: Sessions) -> None:
    """Fill a fresh core's tables from ``snap`` (values and momenta adopted by the book, their
    per-part magnitudes measured once); ValueError when the snapshot is inconsistent."""
    if snap.n_fragments != len(snap.fragments) or not 1 <= snap.n_fragments <= config.max_fragments:
        raise ValueError(f"checkpoint declares {snap.n_fragments} fragments but holds {len(snap.fragments)}")
    if snap.next_round < 1:
        raise ValueError(f"checkpoint next_round {snap.next_round} < 1")
    frags: list[FragmentRecord] = []
    for idx, fs in enumerate(snap.fragments):
        if not fs.schema:
            raise ValueError(f"checkpoint fragment {idx}: empty schema")
        layout = FragmentLayout.of([(n, s) for n, _d, s in fs.schema])
        for t in (fs.value, fs.momentum):
            if t.dtype != torch.float32 or tuple(t.shape) != (layout.numel,):
                raise ValueError(f"checkpoint fragment {idx}: {t.dtype} {tuple(t.shape)}, expected "
                                 f"float32 ({layout.numel},)")
        # Rounds before next_round are committed: fragment idx's last is the largest such
        # t with (t − 1) mod P == idx (rounds run fragments in turn).
        last = snap.next_round - 1 - ((snap.next_round - 2 - idx) % snap.n_fragments)
        momentum = book.adopt(fs.momentum.contiguous()) if config.outer_momentum > 0 else None
        value = book.adopt(fs.value.contiguous())
        frags.append(FragmentRecord(index=idx, schema=fs.schema, layout=layout, value=value,
                                    momentum=momentum, version=fs.version, initialised=True, round=max(0, last)))
    for island, led in snap.ledgers.items():
        if 0 <= island < config.islands:
            ledger = sessions.islands[island].ledger
            ledger.merges, ledger.steps, ledger.tokens = led["merges"], led["steps"], led["tokens"]
    saved = snap.hyper.get("key_bindings", {})
    if isinstance(saved, dict):
        sessions.gate.restore(saved)
    book.adopt_table(snap.fingerprint, frags)  # fixes the part size from the layouts
    # Magnitudes per part measured once here (the commit's overflow bound needs them, or its first
    # commit would write the momentum beside the old one: one more fragment buffer).
    for f in frags:
        assert f.layout is not None and f.value is not None
        f.value_absmax = part_absmax(f.value, f.layout, book.part_elems)
        f.momentum_absmax = (part_absmax(f.momentum, f.layout, book.part_elems) if f.momentum is not None
                             else [0.0] * f.layout.n_parts(book.part_elems))
    rounds.resume_at(snap.next_round)
    log.info("resumed: %d fragments at versions %s, next round %d", len(frags), list(book.versions()),
             snap.next_round)


def part_absmax(t: torch.Tensor, layout: FragmentLayout, part_elems: int) -> list[float]:
    """``max |t|`` over each part of a flat fragment tensor (``inf`` where not finite), block by block."""
    out = []
    for k in range(layout.n_parts(part_elems)):
        lo, hi = layout.part_range(k, part_elems)
        out.append(max((absmax(t[a:min(hi, a + BLOCK)]) for a in range(lo, hi, BLOCK)), default=0.0))
    return out

"""The syncer's data plane: every piece of work that grows with bytes, on worker threads.

The control loop (``loop.py``) must answer a heartbeat within milliseconds while a
round of several GB commits, so it never touches payload bytes.  It opens each
message (MAC and header only), lets the state machine decide, and hands the
payload work to this pool as :class:`Work` items:

* :class:`FoldPart`: verify a PUSH part's chunk digests, check it is finite, and fold
  ``weight * delta`` into the round's running fp32 sum (:class:`RoundSum`);
* :class:`InitPart`: verify an INIT part and copy it into the fragment's value;
* :class:`CommitPart`: the outer Nesterov step on a span of parts (32 MiB or one part),
  written out of place into the sum buffer (which becomes the next published value),
  and the fp32 broadcast payload of each part (zero-copy views and their digests);
* :class:`DigestSpan`: hash the next span of an INIT value for its streamed digest
  (``core/initdigest.py``), and :class:`DigestFragment`: hash a whole value;
* :class:`EncodePart`: encode one part of a value that has no payload yet (an fp32 cut
  after a resume; every bf16 part, on demand as its stream reaches it).

Ordering: work on part ``k`` runs on worker ``k mod threads``, whose queue is
FIFO.  So the folds of one part run in the order the loop dispatched them (the
fold order the event log records, which the numpy reference replays).  An INIT part needs no
order (each writes its own range of a value no other work reads until the fragment is
initialised, except the span of the streamed digest the core hands out only once every part of it is
in; a restarted stream writes a fresh value), so it (and that span) goes to the worker with the least
work queued, data and commit workers alike (no commit runs before the fragments hold values, so
the commit workers are idle during INIT): parts of two INIT streams that share a lane would
otherwise queue behind each other while other workers idle, and the backlog cap would stop the
loop reading meanwhile.  Commits run on
a second set of ``threads`` workers (commit span ``j`` on commit worker ``j mod
threads``): the state starts a commit only once every fold of its round has returned
(``PushRecord.complete``), so a commit needs no ordering against folds, and folds of
other fragments' rounds never queue behind a commit.  A commit is on the critical path
(islands wait for its broadcast) and a fold of a later round is not, so while commit parts are
queued a fold starts only when no other fold runs, or once it has waited :data:`FOLD_YIELD_S`:
the commit gets the cores and the memory bandwidth, and the backlog still drains, so the loop
keeps reading the socket (a heartbeat behind a full backlog would wait for the whole commit).
A waiting fold holds its worker's queue: work behind it there (INIT, encodes) waits with it,
at most :data:`FOLD_YIELD_S` per fold.  Disjoint parts run in parallel without locks.

Threads: torch runs single-threaded here (``torch.set_num_threads(1)``): the pool
*is* the parallelism, set by ``--data-threads``.  torch's own intra-op threads would
otherwise turn each of thousands of element-wise ops into a parallel region that
fights the islands for cores.  Kernels are large (one op per chunk of a part, or
per cache block of the commit), and torch releases the GIL inside them.  Workers run
at a lower scheduling priority than the control loop (:data:`WORKER_NICE`).

Results go back to the loop through a queue plus a wake-up pipe the loop polls.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from typing import Callable

import numpy as np
import torch
import xxhash

from diloco import quant
from diloco.digest import tensor_digest
from diloco.hostmem import release_pages, trim_heap
from diloco.syncer.core.kernels import BLOCK, Scratch, absmax, fold_chunk, magnitude_bound, outer_step
from diloco.syncer.core.robust import check_chunk, clip_scale, finish_part
from diloco.syncer.core.work import (CommitPart, DigestFragment, DigestSpan, EncodePart, FoldPart, InitPart, Result,
                                     RoundSum, Work, commit_span)
from diloco.wire import DEFAULT_CHUNK_BYTES, Opened, Payload, TensorMeta, WireError, encode_payload
from diloco.wire.chunks import wire_bytes
from diloco.wire.parts import FragmentLayout

log = logging.getLogger(__name__)

TEST_DELAY_S = float(os.environ.get("YETO_TEST_DATAPLANE_DELAY_S", "") or 0.0)
"""Test hook, off by default: every work item sleeps this long first (a data plane made
artificially slow, to show the control loop keeps answering while it works)."""

COMMIT_BLOCK = BLOCK
"""Elements per cache block of the fold and the commit (``kernels.BLOCK``)."""

FOLD_YIELD_S = 2.0
"""Longest a fold worker waits for another fold to end while commit parts are queued (commits first)."""


def fold_part(w: FoldPart, scratch: Scratch) -> None:
    """Fold one part, chunk by chunk while the chunk is in cache: verify its digest, check it is
    finite (a bound of its largest magnitude bounds the sum: ``absmax[k] += w * max |d|``) and within the
    part's bounds (a part clipped by its norm is folded again with ``(scale - 1) * w``), then
    ``s = w * d`` for the part's first contribution or ``s = s + w * d``. A refused chunk may
    leave earlier chunks folded: the state then voids the whole attempt (the sum is dropped)."""
    if w.sum.void:
        return
    if w.quant is not None:
        _fold_quant_part(w)
        return
    opened = w.opened
    weight = float(w.weight)  # rounded to fp32 by the kernel, like np.float32(w)
    first = not w.sum.started[w.part]
    if first:
        _wait_for_loan(w)
    starts = _segment_starts(opened, w.lo)
    dmax = 0.0
    for i, off, view in opened.chunk_views():
        meta = opened.metas[i]
        c = off * view.element_size() // opened.chunk_bytes
        raw = memoryview(view.view(torch.uint8).numpy())
        if xxhash.xxh3_64_intdigest(raw, seed=opened.seed) != meta.chunks[c]:
            raise WireError(f"chunk {c} of {meta.name[:80]!r} fails its digest (corrupted or tampered)")
        # The robust bounds compare the true max |d| with their limit; otherwise a bound of it suffices.
        a = absmax(view) if w.bound is not None else magnitude_bound(view)
        if a == math.inf:
            raise WireError(f"segment {meta.name[:80]!r} holds NaN or Inf")
        dmax = max(dmax, a)
        if w.bound is not None:
            check_chunk(w.bound, a, view)  # before folding it: an absurd chunk never reaches the sum
        pos = starts[i] + off
        fold_chunk(view, w.sum.flat[pos : pos + view.numel()], weight, first, scratch)
    w.sum.absmax[w.part] = (0.0 if first else w.sum.absmax[w.part]) + abs(weight) * dmax
    w.sum.started[w.part] = True
    if w.bound is not None:
        scale = clip_scale(w.bound)
        if scale < 1.0:  # clipped: s += (scale - 1) w d leaves the part folded as scale x w x d
            for i, off, view in opened.chunk_views():
                pos = starts[i] + off
                fold_chunk(view, w.sum.flat[pos : pos + view.numel()], (scale - 1.0) * weight, False, scratch)
        finish_part(w.bound)


def _fold_quant_part(w: FoldPart) -> None:
    """Fold a low-bit part: dequantize block by block straight into the running sum (never an
    fp32 copy of the push). The first contribution starts from zeros: ``s = 0 + w * x'``. Each
    dequantized block passes the part's bounds (element and norm) before it is folded."""
    assert w.quant is not None
    kind, block = w.quant
    codes_meta, scales_meta = w.opened.metas
    codes = torch.empty(codes_meta.shape, dtype=torch.uint8)
    scales = torch.empty(scales_meta.shape, dtype=torch.bfloat16)
    w.opened.copy_into([codes, scales], parallel=False)  # the payload is 1/8 of fp32: one small copy
    out = w.sum.flat[w.lo : w.lo + w.n]
    if not w.sum.started[w.part]:
        _wait_for_loan(w)
    try:
        quant.check_payload(codes, scales, kind, block, out.numel())
    except quant.QuantError as exc:
        raise WireError(f"{kind} part {w.part}: {exc}") from None
    bound = w.bound
    weight = float(w.weight)
    if not w.sum.started[w.part]:
        out.zero_()
    inspect = None if bound is None else (lambda deq: check_chunk(bound, absmax(deq), deq))
    quant.dequantize_fold(codes, scales, kind, block, out, weight, inspect)
    if bound is not None:
        scale = clip_scale(bound)
        if scale < 1.0:  # clipped: fold it again with (scale - 1) x its weight
            quant.dequantize_fold(codes, scales, kind, block, out, (scale - 1.0) * weight)
        finish_part(bound)
    w.sum.absmax[w.part] = absmax(out)
    w.sum.started[w.part] = True


LOAN_WAIT_S = 60.0
"""Longest a fold waits for the commit that lends its sum's memory to pass the part (``PageLoan``)."""


def _wait_for_loan(w: FoldPart) -> None:
    """Before the first fold of a part into a sum that lies in a consumed old value: wait until
    that value's commit has passed the part (it runs on the commit workers, ahead of the folds)."""
    loan = w.sum.loan
    if loan is not None and not loan.wait_passed(w.part, LOAN_WAIT_S):
        raise WireError(f"part {w.part}: the commit lending this round's sum did not pass it within {LOAN_WAIT_S:.0f}s")


def _segment_starts(opened: Opened, lo: int) -> list[int]:
    """Stream offset of each segment of a part (segments tile the part in order)."""
    starts, pos = [], lo
    for meta in opened.metas:
        starts.append(pos)
        pos += math.prod(meta.shape)
    return starts


def init_part(w: InitPart) -> float:
    """Copy a verified INIT part into the value; returns a bound of its ``max |value|``
    (``kernels.magnitude_bound`` of each wire chunk, taken as the chunk is copied, while it is in
    cache: no second pass over the part; ``inf`` when it holds NaN or Inf)."""
    starts = _segment_starts(w.opened, w.lo)
    dests = [w.value[s : s + math.prod(m.shape)] for s, m in zip(starts, w.opened.metas)]
    vmax = w.opened.copy_into(dests, parallel=False, inspect=_chunk_bound)
    if vmax == math.inf:
        raise WireError(f"INIT part {w.part} holds NaN or Inf")
    return vmax


def _chunk_bound(dest: np.ndarray) -> float:
    """``kernels.magnitude_bound`` of one copied chunk of an fp32 value (its bytes, or its fp32 bits)."""
    return magnitude_bound(torch.from_numpy(dest.view(np.float32)))


def commit_part(w: CommitPart, scratch: Scratch) -> list[tuple[dict[str, Payload], tuple[float, float]]]:
    """The outer step on the parts ``[w.part, w.part + w.parts)``, part by part (:func:`commit_one`);
    per part its payloads and magnitudes. A part whose result is not finite refuses the whole item
    (WireError): the state drops the commit. With ``w.consume`` each part's old value pages go back
    to the kernel once its new value is written (nothing reads them again: ``consume.py``)."""
    out = []
    for k in range(w.part, w.part + w.parts):
        lo, hi = w.layout.part_range(k, w.part_elems)
        out.append(commit_one(w, k, lo, hi, scratch))
        if w.consume and w.loan is not None:
            w.loan.pass_part(k, lo, hi, release_pages)  # kept for the next round's sum, or released
        elif w.consume:
            release_pages(w.value, lo, hi)
    return out


def commit_one(w: CommitPart, k: int, lo: int, hi: int, scratch: Scratch) -> tuple[dict[str, Payload], tuple[float, float]]:
    """The outer step on part ``k``, elements ``[lo, hi)`` (``kernels.outer_step``), out of place into
    the sum, one wire chunk at a time, each chunk's digest taken while the chunk is still in cache:
    the fp32 broadcast payload of the part comes out of the same pass (bit for bit what
    ``encode_payload`` makes of the part's views). Any other dtype asked for is encoded after it."""
    mu = float(w.hyper.momentum)
    elems = DEFAULT_CHUNK_BYTES // 4
    vmax = mmax = 0.0
    metas: list[TensorMeta] = []
    frames: list[memoryview] = []
    for i, a, b in w.layout.segments(lo, hi):
        start = w.layout.starts[i]
        digests = []
        for p in range(start + a, start + b, elems):
            q = min(start + b, p + elems)
            cv, cm = outer_step(w.sum.flat, w.value, w.momentum if mu > 0 else None, w.new_momentum, p, q,
                                float(w.total_weight), float(w.hyper.lr), mu, scratch, w.check)
            vmax, mmax = max(vmax, cv), max(mmax, cm)
            frame = wire_bytes(w.sum.flat[p:q])
            digests.append(xxhash.xxh3_64_intdigest(frame, seed=w.seed))
            frames.append(frame)
        metas.append(TensorMeta(w.layout.names[i], "float32", (b - a,), tuple(digests)))
    if w.check and (vmax == math.inf or mmax == math.inf or vmax != vmax):
        # A huge (finite) delta can overflow the merged value: refuse the commit. The value (and
        # a pinned momentum) were written out of place, so the state drops it having changed nothing.
        raise WireError(f"the outer step's result is not finite in elements [{lo}, {hi})")
    payloads = {"float32": Payload(tuple(metas), tuple(frames), DEFAULT_CHUNK_BYTES, (hi - lo) * 4)}
    for dtype in w.encode_dtypes:
        if dtype not in payloads:
            payloads[dtype] = encode_part_payload(w.sum.flat, w.layout, k, w.part_elems, dtype, w.seed)
    return payloads, (vmax, mmax) if w.check else (math.nan, math.nan)


def encode_part_payload(value: torch.Tensor, layout: FragmentLayout, k: int, part_elems: int, dtype: str,
                        seed: int = 0) -> Payload:
    """Payload of part ``k`` of a flat value: zero-copy views for fp32, one conversion for bf16."""
    views = layout.flat_views(value)
    return encode_payload(layout.slice_part(views, k, part_elems), wire_dtype=dtype, parallel=False, seed=seed)


class DataPlane:
    """A pool of worker threads, one FIFO queue each, keyed by part index.

    Args:
        threads: worker count (``--data-threads``).
        on_result: called on the worker thread with every :class:`Result` (the loop's
            queue put); must be cheap and thread-safe.
    """

    def __init__(self, threads: int, on_result: Callable[[Result], None]) -> None:
        if threads < 1:
            raise ValueError(f"data plane threads must be >= 1, got {threads}")
        torch.set_num_threads(1)
        self.threads = threads
        self._on_result = on_result
        self._queues: list[queue.SimpleQueue[Work | None]] = [queue.SimpleQueue() for _ in range(threads)]
        self._commit_queues: list[queue.SimpleQueue[Work | None]] = [queue.SimpleQueue() for _ in range(threads)]
        self._pending = 0
        self._queued = [0] * (2 * threads)
        """Work items queued or running on each worker: data workers ``[0, threads)``, then commit
        workers (INIT goes to the least)."""
        self._pending_bytes = 0
        self._commits = 0
        """Commit parts submitted and not yet run to the end (folds yield to them)."""
        self._folding = 0
        """Folds running now."""
        self._closing = False
        """Set by :meth:`close`: folds stop waiting for commits."""
        self._lock = threading.Lock()
        self._fold_turn = threading.Condition(self._lock)
        self._workers = [
            threading.Thread(target=self._run, args=(q, i), name=f"yeto-data-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ] + [
            threading.Thread(target=self._run, args=(q, threads + i), name=f"yeto-commit-{i}", daemon=True)
            for i, q in enumerate(self._commit_queues)
        ]
        for t in self._workers:
            t.start()

    @property
    def backlog_bytes(self) -> int:
        """Received payload bytes queued but not yet processed (the loop throttles on it)."""
        return self._pending_bytes

    def submit(self, work: Work) -> None:
        commit = isinstance(work, CommitPart)
        with self._lock:
            self._pending += 1
            self._pending_bytes += _received_bytes(work)
            self._commits += commit
            if isinstance(work, (InitPart, DigestSpan)):
                worker = self._queued.index(min(self._queued))
            else:
                worker = lane(work) % self.threads + (self.threads if commit else 0)
            self._queued[worker] += 1
        (self._queues + self._commit_queues)[worker].put(work)

    def close(self) -> None:
        with self._fold_turn:
            self._closing = True
            self._fold_turn.notify_all()
        for q in self._queues + self._commit_queues:
            q.put(None)
        for t in self._workers:
            t.join(timeout=10)

    def _run(self, q: queue.SimpleQueue[Work | None], index: int) -> None:
        """Worker loop over ``q``, the queue of worker ``index`` (data workers first, then commit workers)."""
        _yield_to_the_loop()
        scratch = Scratch()
        while True:
            work = q.get()
            if work is None:
                return
            fold = isinstance(work, FoldPart)
            if fold:
                self._take_fold_turn()
            try:
                result = run_work(work, scratch)
            finally:  # run_work never raises; the counters must hold whatever ends this worker
                if isinstance(work, (FoldPart, InitPart)):
                    # The frames go now, not when the loop takes the result: the loop may read more
                    # parts before it does, and the backlog no longer counts these.
                    work.opened.release()
                with self._lock:
                    self._pending -= 1
                    self._pending_bytes -= _received_bytes(work)
                    self._folding -= fold
                    self._commits -= isinstance(work, CommitPart)
                    self._queued[index] -= 1
                    if fold or not self._commits:
                        self._fold_turn.notify_all()
            self._on_result(result)
            # Drop our references now: an idle worker must not keep the last value it read
            # (a whole fragment) alive, or the next round's sum cannot reuse its buffer.
            del work, result

    def _take_fold_turn(self) -> None:
        """Start a fold: at once without commit parts queued (or once closing), else once no other fold
        runs, at most :data:`FOLD_YIELD_S` later. A commit never waits for a fold: the state starts it
        once every fold of its round returned."""
        with self._fold_turn:
            self._fold_turn.wait_for(lambda: not self._commits or not self._folding or self._closing,
                                     timeout=FOLD_YIELD_S)
            self._folding += 1


def lane(work: Work) -> int:
    """Which worker (modulo the pool's size) runs ``work``: part ``k``'s, or for a commit its span's
    index (spans start at multiples of ``commit_span``; a fragment's last one may be shorter)."""
    if isinstance(work, CommitPart):
        return work.part // commit_span(work.part_elems)
    return work.part


def _received_bytes(work: Work) -> int:
    """Received payload bytes a work item holds (the backlog the loop throttles on)."""
    return work.opened.nbytes if isinstance(work, (FoldPart, InitPart)) else 0


WORKER_NICE = 5
"""How much lower than the control loop's the workers' scheduling priority is (Linux: per thread)."""


def _yield_to_the_loop() -> None:
    """Lower the calling worker thread's priority by :data:`WORKER_NICE`, so that on a busy host
    the control loop (heartbeats, PULLs, pacing) gets a core before bulk work does.  Best effort:
    a platform without per-thread priorities keeps the default."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE))
    except (AttributeError, OSError) as exc:
        log.debug("data plane: worker priority unchanged (%s)", exc)


def run_work(work: Work, scratch: Scratch | None = None) -> Result:
    """Run one work item here and now (workers call this; tests call it inline).

    Never raises: a refused payload (bad digest, NaN) is ``Result.error``; a bug is
    logged and reported the same way, so a worker thread never dies.
    """
    scratch = scratch or Scratch()
    if TEST_DELAY_S > 0:
        time.sleep(TEST_DELAY_S)
    t0 = time.perf_counter()
    result = Result(work)
    try:
        if isinstance(work, FoldPart):
            fold_part(work, scratch)
        elif isinstance(work, InitPart):
            result.absmax = (init_part(work), 0.0)
        elif isinstance(work, CommitPart):
            if work.part == 0:
                # Frames come from the heap (``hostmem``): give back the pages of those freed since
                # the last commit before this commit's peak (values + sum), once per commit.
                trim_heap()
            result.parts = commit_part(work, scratch)
        elif isinstance(work, DigestFragment):
            result.digest = tensor_digest(work.layout.flat_views(work.value))
        elif isinstance(work, DigestSpan):
            work.hasher.update(work.value[work.lo : work.hi])
            if work.hasher.position == work.hasher.numel:
                result.digest = work.hasher.hexdigest()
        else:
            result.payloads = {work.dtype: encode_part_payload(work.value, work.layout, work.part, work.part_elems,
                                                               work.dtype, work.seed)}
    except WireError as exc:
        result.error = exc.reason
    except Exception as exc:  # noqa: BLE001 - a bug must not kill the worker
        log.exception("data plane: %s failed", type(work).__name__)
        result.error = f"internal error: {type(exc).__name__}: {exc}"
    result.seconds = time.perf_counter() - t0
    return result


def default_threads() -> int:
    """``--data-threads`` default: up to 4 workers, leaving cores for the islands on a shared host."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


__all__ = [
    "RoundSum", "FoldPart", "InitPart", "CommitPart", "EncodePart", "DigestFragment", "DigestSpan", "Work", "Result", "DataPlane", "run_work",
    "default_threads", "encode_part_payload", "COMMIT_BLOCK",
]


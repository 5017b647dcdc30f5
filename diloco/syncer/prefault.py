"""Fresh INIT values faulted in ahead of their INIT stream, on threads of their own.

Island 0's INIT writes every byte of the fragments' first values into fresh memory, and a write
into a page that was never touched traps while the kernel zeroes it: on the device host a 16 MiB
copy runs at about 3 GB/s into fresh pages against 9 GB/s into resident ones, so the data workers
copying INIT parts spend most of their time in page faults. When island 0's HELLO asks for INIT,
the core allocates every fragment's value at once (``Admission.on_hello``) and asks for each to be
faulted in (``work.Prefault``, in fragment order, the order island 0 streams them). These threads
fault each value in front to back, :data:`SLICE_BYTES` at a time, with
``madvise(MADV_POPULATE_WRITE)`` (``hostmem.populate_pages``): it maps the pages without writing
them, so it never races the INIT copy that writes the same pages, and where the stream is ahead
it only walks pages already there. :data:`THREADS` threads, one per INIT connection (the first and
the lane), so the two fragments streamed at once are each faulted in ahead of their parts.

Best effort: a kernel without ``MADV_POPULATE_WRITE`` (before Linux 5.14) leaves the pages to
fault under the copy, as before. Memory: none of its own (the values are the book's, and each
item holds its value only until it is faulted in). Threads run at the data workers' lower priority.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from diloco.hostmem import populate_pages
from diloco.syncer.core.work import Prefault

log = logging.getLogger(__name__)

THREADS = 2
"""Prefault threads: one per INIT connection (the session's first and its lane)."""

SLICE_BYTES = 64 << 20
"""Bytes faulted in per ``madvise`` call (a stream's part is 16 MiB by default)."""


class Prefaulter:
    """A FIFO of values to fault in and the threads that do it.

    Args:
        threads: how many values are faulted in at once.
        initializer: run first on each thread (the data plane's lower priority).
    """

    def __init__(self, threads: int = THREADS, initializer: Callable[[], None] = lambda: None) -> None:
        self._queue: queue.SimpleQueue[Prefault | None] = queue.SimpleQueue()
        self._initializer = initializer
        self.faulted_bytes = 0
        """Bytes faulted in so far (0 on a kernel without the advice)."""
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, name=f"yeto-prefault-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, work: Prefault) -> None:
        """Queue ``work``; it runs after every item queued before it has started."""
        self._queue.put(work)

    def close(self) -> None:
        """Stop the threads once they finish the item they are on (queued items are dropped)."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def _run(self) -> None:
        self._initializer()
        while True:
            work = self._queue.get()
            if work is None:
                return
            done = fault_in(work)
            with self._lock:
                self.faulted_bytes += done
            del work  # the value is the book's: hold it no longer than this


def fault_in(work: Prefault) -> int:
    """Fault ``work.value`` in, front to back, :data:`SLICE_BYTES` per call; returns the bytes faulted
    in (0 where the kernel lacks the advice). Writes nothing (see the module's docstring)."""
    t0 = time.perf_counter()
    n = work.value.numel()
    step = SLICE_BYTES // work.value.element_size()
    done = 0
    for lo in range(0, n, step):
        got = populate_pages(work.value, lo, min(n, lo + step))
        if got == 0 and lo == 0:
            break  # the kernel lacks the advice (or the buffer is tiny): the copy faults them
        done += got
    log.info("INIT value of fragment %d faulted in ahead of its stream: %.0f MiB in %.2f s",
             work.fragment, done / 2**20, time.perf_counter() - t0)
    return done


__all__ = ["Prefaulter", "fault_in", "THREADS", "SLICE_BYTES"]

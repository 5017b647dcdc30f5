"""glibc heap tuning for island processes (``mallopt`` at Island start).

Why: glibc serves large allocations with ``mmap`` and, by default, moves its mmap threshold
and its heap-trim threshold *dynamically*: after a process frees a big block, later
parameter-sized temporaries (AdamW's ``exp_avg_sq.sqrt()``, ``grad * lr``, ...) may come
from freshly mapped pages, or the top of the heap is returned to the kernel after every
step and mapped again on the next one. Either way each step pays minor page faults on
memory it just used: on the 2-core peer machine the islands' inner steps ran 1.29-1.52x
slower than torchft's with 32,288 minor faults per AdamW step, and matched them with
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set. The island itself used to
trigger the dynamic adjustment by allocating and freeing fragment-sized host buffers every
round; those are pooled now (``datapath.py``, ``wire.hostpool``), and this module pins the
two thresholds so the training loop's own temporaries stay on the heap and the heap is not
trimmed between steps:

* ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's maximum on 64-bit): blocks below it come from the
  heap and are reused, never freshly mapped; setting it also disables the dynamic moves;
* ``M_TRIM_THRESHOLD`` = 1 GiB: freed memory at the top of the heap stays mapped.

A user who set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` keeps their values;
``YETO_DILOCO_TUNE_MALLOC=0`` turns this off. Non-glibc systems: nothing happens.
"""

from __future__ import annotations

from diloco.hostmem import set_malloc_thresholds

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30

_done = False


def tune_malloc() -> bool:
    """Pin glibc's mmap and trim thresholds for an island (once per process); True when set.

    The mechanism is the syncer's (:func:`diloco.hostmem.set_malloc_thresholds`); only the
    values differ: the syncer wants transient receive buffers unmapped at once, an island
    wants its step temporaries kept on the heap."""
    global _done
    if not _done:
        _done = set_malloc_thresholds(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)
    return _done

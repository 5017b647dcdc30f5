"""What writing into fresh memory costs, by how its pages come in (device probe).

    python scripts/probe_fault.py [--gib 4] [--threads 1,4,8]

The syncer copies every INIT part into a fresh fragment value, so each part's first write faults
its pages in (the kernel zeroes each one). This copies 16 MiB parts from a resident source into
``--gib`` GiB of fresh ``np.empty`` memory with N threads (disjoint ranges) three ways:
``plain`` (the pages fault in under the copy, 4 KiB each), ``populate`` (each part's range is
``madvise(MADV_POPULATE_WRITE)`` first: one call per part, no trap per page) and ``huge``
(``madvise(MADV_HUGEPAGE)`` on the buffer first: 2 MiB pages where transparent huge pages allow),
then once more into the same, now resident, memory. Prints the kernel's THP settings and one line
per case; the last line is one JSON object (GB/s per case).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import threading
import time
from pathlib import Path

import numpy as np

PART = 16 << 20
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
HUGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _advise(a: np.ndarray, advice: int) -> None:
    if _libc.madvise(a.ctypes.data, a.nbytes, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice})")


def _copy(dest: np.ndarray, src: np.ndarray, populate: bool) -> None:
    for lo in range(0, dest.nbytes, PART):
        part = dest[lo : lo + PART]
        if populate:
            _advise(part, MADV_POPULATE_WRITE)
        np.copyto(part, src[: part.nbytes])


def case(mode: str, threads: int, nbytes: int) -> tuple[float, float]:
    """GB/s into fresh memory, then into the same memory again."""
    raw = np.empty(nbytes + HUGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % HUGE
    dest = raw[off : off + nbytes]
    if mode == "huge":
        _advise(dest, MADV_HUGEPAGE)
    srcs = [np.random.default_rng(i).integers(0, 255, PART, dtype=np.uint8) for i in range(threads)]
    per = nbytes // threads // PART * PART
    rates = []
    for populate in (mode == "populate", False):
        ts = [threading.Thread(target=_copy, args=(dest[i * per : (i + 1) * per], srcs[i], populate))
              for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rates.append(per * threads / (time.perf_counter() - t0) / 1e9)
    del raw
    return rates[0], rates[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--smoke", action="store_true", help="64 MiB, one and two threads: checks it runs (the suite)")
    a = ap.parse_args()
    if a.smoke:
        a.gib, a.threads = 1 / 16, "1,2"
    for f in ("enabled", "defrag"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / f
        print(f"THP {f}: {p.read_text().strip() if p.exists() else '(none)'}")
    nbytes = int(a.gib * 2**30) // PART * PART
    out: dict[str, float] = {}
    case("plain", 1, min(nbytes, 256 << 20))  # warm the allocator and the source pages
    for threads in (int(t) for t in a.threads.split(",")):
        for mode in ("plain", "populate", "huge"):
            try:
                fresh, again = case(mode, threads, nbytes)
            except OSError as e:
                print(f"{mode:9s} x{threads}: not available ({e})")
                continue
            out[f"{mode}_x{threads}"] = round(fresh, 3)
            print(f"{mode:9s} x{threads}: fresh {fresh:6.2f} GB/s, resident {again:6.2f} GB/s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

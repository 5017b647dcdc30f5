"""fp32 values that are exactly bfloat16: found and packed losslessly, for INIT.

A mixed-precision Megatron job (bf16 parameters, fp32 main parameters) starts with fp32 masters
copied from its bf16 parameters, so every value it streams at INIT is a bf16 value stored in
fp32: its low 16 bits are zero. Such a part travels as bf16, half the bytes, and the receiver's
upcast (``Opened.copy_into``) restores the fp32 bits exactly. A part with any other value
travels as fp32; the first block that is not exact ends the scan, so a model that is not
bf16-exact pays one small block per part.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from diloco.wire.chunks import map_chunks

__all__ = ["BLOCK_ELEMS", "pack_bf16_exact"]

BLOCK_ELEMS = 1 << 18
"""Elements checked and packed per job (1 MiB of fp32: read twice, the second time from cache)."""


def pack_bf16_exact(segments: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor, parallel: bool = True
                    ) -> list[tuple[str, torch.Tensor]] | None:
    """The segments as bf16 views of ``out`` when every element is exactly a bf16, else None.

    ``segments`` are contiguous fp32 CPU tensors; ``out`` is a contiguous fp32 CPU buffer with at
    least half as many elements as the segments hold (it receives their bf16 bits, in order).
    Promises: the returned tensors hold bit for bit the high halves of the inputs, with their
    shapes; ``None`` leaves nothing the caller needs (``out`` may be partly written). Blocks after
    the first are packed on the wire's chunk threads (``parallel=False``: here). Refuses
    (None) any segment that is not a contiguous fp32 CPU tensor, and big-endian hosts."""
    if sys.byteorder != "little":
        return None
    total = sum(t.numel() for _n, t in segments)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu" or 2 * out.numel() < total:
        return None
    packed = out.view(torch.bfloat16)
    dest = packed.view(torch.int16).numpy().view(np.uint16)
    result: list[tuple[str, torch.Tensor]] = []
    jobs: list[tuple[np.ndarray, np.ndarray]] = []
    pos = 0
    for name, t in segments:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            return None
        n = t.numel()
        halves = t.reshape(-1).view(torch.int16).numpy().view(np.uint16)  # (low, high) per element
        jobs += [(halves[2 * a : 2 * min(n, a + BLOCK_ELEMS)], dest[pos + a : pos + min(n, a + BLOCK_ELEMS)])
                 for a in range(0, n, BLOCK_ELEMS)]
        result.append((name, packed[pos : pos + n].view(t.shape)))
        pos += n
    if jobs and not _pack_block(jobs[0]):
        return None  # not a bf16 model: one block checked, nothing more
    return result if all(map_chunks(_pack_block, jobs[1:], parallel)) else None


def _pack_block(job: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether every element of one block is a bf16 number; if so its bf16 bits are written to the
    block's destination (numpy releases the GIL: blocks pack side by side on the chunk threads)."""
    halves, dest = job
    if halves[0::2].max(initial=0):
        return False
    np.copyto(dest, halves[1::2])
    return True

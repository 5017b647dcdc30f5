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

__all__ = ["BLOCK_ELEMS", "pack_bf16_exact"]

BLOCK_ELEMS = 1 << 16
"""Elements checked and packed per step (256 KiB of fp32: each block is read once, from cache)."""


def pack_bf16_exact(segments: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor
                    ) -> list[tuple[str, torch.Tensor]] | None:
    """The segments as bf16 views of ``out`` when every element is exactly a bf16, else None.

    ``segments`` are contiguous fp32 CPU tensors; ``out`` is a contiguous fp32 CPU buffer with at
    least half as many elements as the segments hold (it receives their bf16 bits, in order).
    Promises: the returned tensors hold bit for bit the high halves of the inputs, with their
    shapes; ``None`` leaves nothing the caller needs (``out`` may be partly written). Refuses
    (None) any segment that is not a contiguous fp32 CPU tensor, and big-endian hosts."""
    if sys.byteorder != "little":
        return None
    total = sum(t.numel() for _n, t in segments)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu" or 2 * out.numel() < total:
        return None
    packed = out.view(torch.bfloat16)
    dest = packed.view(torch.int16).numpy().view(np.uint16)
    result: list[tuple[str, torch.Tensor]] = []
    pos = 0
    for name, t in segments:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            return None
        n = t.numel()
        halves = t.reshape(-1).view(torch.int16).numpy().view(np.uint16)  # (low, high) per element
        for a in range(0, n, BLOCK_ELEMS):
            b = min(n, a + BLOCK_ELEMS)
            if halves[2 * a : 2 * b : 2].max(initial=0):
                return None
            np.copyto(dest[pos + a : pos + b], halves[2 * a + 1 : 2 * b : 2])
        result.append((name, packed[pos : pos + n].view(t.shape)))
        pos += n
    return result

"""Low-bit pushes, the format: block-wise absmax quantization (``int8``, ``q4``), sizes and checks.

Islands on slow links are limited by the bytes per round. A push is a
pseudo-gradient (the fragment's delta since the last cut); Streaming DiLoCo
reports no quality loss when it travels in 4 bits, provided the rounding error
is fed back into the next push. The package :mod:`diloco.quant` is the codec:
this module states the format and checks payloads against it; :mod:`diloco.quant.kernels` turns a
flat fp32 range into codes + scales and back; :mod:`diloco.quant.feedback` keeps each fragment's
residual where its masters live. The wire, the island and the syncer call it; it knows nothing of them.

Format (the normative copy is docs/PROTOCOL.md, "Low-bit pushes")
-----------------------------------------------------------------
A push range is a flat 1-D fp32 stream ``x[0:n]`` (a fragment's tensors
concatenated in plan order, or a part of it). It is cut into blocks of ``B``
consecutive elements (``B`` a power of two in ``[8, 4096]``, so every part
boundary, a multiple of 4096 elements, is a block boundary and quantizing a
part alone gives exactly the bytes of quantizing the whole fragment); blocks
run across tensor boundaries; the last block holds ``n mod B`` elements when
that is not 0. Per block ``j`` (elements ``[jB, min(n, (j+1)B))``)::

    qmax  = 127 (int8) | 7 (q4)
    a     = max |x_i| over the block's elements           (fp32, exact)
    t     = fp32(a / qmax)                                 (IEEE division, round to nearest even)
    s_j   = the smallest bfloat16 >= t                     (round UP to bf16; t = 0 gives s_j = 0)
    q_i   = round_half_even(fp32(x_i / s_j))   if s_j > 0  (IEEE division)
    q_i   = 0                                  if s_j = 0
    x'_i  = fp32(q_i) * fp32(s_j)                          (the dequantized value; exact in fp32)

Rounding the scale *up* guarantees ``|x_i / s_j| <= qmax`` (up to one fp32
rounding, which ``round_half_even`` absorbs), so no clamp exists in the
format and the per-element error is at most ``s_j / 2`` (in a block with
``s_j = 0`` it is ``|x_i| < 2^-142``, which error feedback carries on). Every scale must be
finite and at most ``S_max = smallest bf16 >= fp32(2^127 / qmax)`` (``int8``:
``1.3500e36``, bits 0x7B82; ``q4``: ``2.4425e37``, bits 0x7D93), so that
``qmax * s_j`` cannot overflow fp32: any finite input with ``|x| <= 2^127``
(1.7e38) is accepted, :func:`quantize` raises on anything larger or non-finite
and :func:`check_payload` refuses such scales.

Bytes, all little-endian:

* codes, ``int8``: ``n`` bytes, byte ``i`` = ``q_i`` as two's complement int8
  (range ``[-127, 127]``).
* codes, ``q4``: ``ceil(n / 2)`` bytes; byte ``k`` = ``c_{2k} | c_{2k+1} << 4``
  (element ``2k`` in the LOW nibble) with ``c_i = q_i + 8`` in ``[1, 15]``;
  when ``n`` is odd the high nibble of the last byte is 0.
* scales: ``ceil(n / B)`` bfloat16 values ``s_j``, block order.

``wire_nbytes = codes + 2 * ceil(n / B)``; per element ``1 + 2/B`` (int8) or
``0.5 + 2/B`` (q4) bytes against fp32's 4.

Why these choices: absmax blocks need no calibration and a block's outlier
only widens its own block; bf16 scales cost half of fp32 and keep fp32's
exponent range; offset-8 nibbles keep the unpack two integer ops. Every step is an IEEE-exact elementwise op, so a numpy reference gives
identical bytes, and CPU and CUDA give identical bytes too.
"""

from __future__ import annotations

import functools
import sys
from typing import Literal

import torch

Kind = Literal["int8", "q4"]
KINDS: tuple[Kind, ...] = ("int8", "q4")
QMAX: dict[str, int] = {"int8": 127, "q4": 7}
Q4_OFFSET = 8
"""A q4 code is ``q + 8``: codes 1..15 (0 is never produced)."""

DEFAULT_BLOCK = 64
"""Elements per scale (see benchmarks/bench_lowbit.py and docs/PERFORMANCE.md for the choice)."""
PART_ALIGN = 4096
"""Part boundaries are multiples of this many elements; a block size must divide it."""
MIN_BLOCK = 8

if sys.byteorder != "little":  # the byte views below assume the wire's byte order
    raise ImportError("diloco.quant needs a little-endian host")


class QuantError(ValueError):
    """A low-bit payload or input that violates the format (the message says what)."""


@functools.cache
def max_scale(kind: str) -> float:
    """``S_max`` of ``kind``: the largest scale the format admits (see the module docstring)."""
    t = torch.tensor([2.0**127 / QMAX[check_kind(kind)]], dtype=torch.float32)
    return float(ceil_to_bf16(t).float())


def check_kind(kind: str) -> Kind:
    """Return ``kind`` if it is a low-bit kind, else raise naming the allowed values."""
    if kind not in KINDS:
        raise QuantError(f"unknown low-bit kind {kind!r} (expected one of {', '.join(KINDS)})")
    return kind  # type: ignore[return-value]


def check_block(block: int) -> int:
    """Return ``block`` if it is a power of two in [8, 4096] (so it divides every part boundary)."""
    if not isinstance(block, int) or isinstance(block, bool):
        raise QuantError(f"block size must be an int, got {block!r}")
    if block < MIN_BLOCK or block > PART_ALIGN or block & (block - 1):
        raise QuantError(f"block size must be a power of two in [{MIN_BLOCK}, {PART_ALIGN}], got {block}")
    return block


def n_scales(n: int, block: int) -> int:
    """Scales of an ``n``-element range: one per block, the last block possibly short."""
    return -(-n // block)


def code_nbytes(kind: str, n: int) -> int:
    """Bytes of the codes of an ``n``-element range."""
    return n if check_kind(kind) == "int8" else -(-n // 2)


def wire_nbytes(kind: str, n: int, block: int) -> int:
    """Bytes a range of ``n`` elements takes on the wire: codes plus bf16 scales."""
    check_block(block)
    return code_nbytes(kind, n) + 2 * n_scales(n, block)


def ceil_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16 >= each fp32 ``t`` (``t`` >= 0 or NaN), by integer ops on the bits.

    bf16 is the top half of fp32: adding 0xFFFF to the bits carries into the
    kept half unless the dropped half is already zero, then the mask drops it.
    For a non-negative finite ``t`` that is round-toward-+inf; inf stays inf.
    """
    bits = t.view(torch.int32)
    bits = (bits + 0xFFFF).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as int32
    return bits.bitwise_right_shift_(16).to(torch.int16).view(torch.bfloat16)


def check_payload(codes: torch.Tensor, scales: torch.Tensor, kind: str, block: int, n: int) -> None:
    """Validate a received ``(codes, scales)`` pair for an ``n``-element range before decoding.

    Checks dtypes, sizes, that every scale is finite and non-negative, and the
    q4 padding nibble; codes need no range check (any byte decodes to a bounded
    value). Raises :class:`QuantError` naming the violation.
    """
    kind_ = check_kind(kind)
    check_block(block)
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise QuantError(f"codes must be 1-D uint8, got {codes.dtype} of shape {tuple(codes.shape)}")
    if scales.dtype != torch.bfloat16 or scales.dim() != 1:
        raise QuantError(f"scales must be 1-D bfloat16, got {scales.dtype} of shape {tuple(scales.shape)}")
    if codes.numel() != code_nbytes(kind_, n):
        raise QuantError(f"{kind_} codes of {n} elements take {code_nbytes(kind_, n)} bytes, got {codes.numel()}")
    if scales.numel() != n_scales(n, block):
        raise QuantError(f"{n} elements in blocks of {block} take {n_scales(n, block)} scales, got {scales.numel()}")
    # As int16, bf16 bits order like the values for sign-clear values; NaN and
    # inf have larger bits than S_max and negative values (sign set) are < 0.
    bits = scales.view(torch.int16)
    if bool(((bits < 0) | (bits > _max_scale_bits(kind_))).any()):
        raise QuantError(f"a scale is negative, not finite or above the {kind_} maximum {max_scale(kind_):.4e}")
    if kind_ == "q4" and n % 2 and int(codes[-1]) >> 4:
        raise QuantError("the padding nibble of an odd-length q4 range must be 0")


@functools.cache
def _max_scale_bits(kind: Kind) -> int:
    """The bf16 bit pattern of ``S_max`` (as a non-negative int16 value)."""
    t = torch.tensor([max_scale(kind)], dtype=torch.float32)
    return int(t.to(torch.bfloat16).view(torch.int16))

"""Low-bit pushes: block-wise absmax quantization (``int8``, ``q4``) with error feedback.

Islands on slow links are limited by the bytes per round. A push is a
pseudo-gradient (the fragment's delta since the last cut); Streaming DiLoCo
reports no quality loss when it travels in 4 bits, provided the rounding error
is fed back into the next push. This module is the codec: pure functions that
turn a flat fp32 range into codes + scales and back, and one small class,
:class:`ErrorFeedback`, that keeps each fragment's residual where its masters
live. The wire, the island and the syncer call it; it knows nothing of them.

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

Speed: each op runs over one cache-sized chunk (512 Ki elements on CPU) before
the next chunk starts, so the ~8 passes hit cache, not DRAM (smaller chunks
lose more to torch's per-op dispatch than they gain; 64 Ki elements ran at
half the speed of 512 Ki on a 1-core measurement); on CUDA chunks are large
(16 Mi elements) to amortise kernel launches. CPU scratch is cached per
thread (a fresh buffer page-faults on every call); ``out=`` forms avoid
temporaries; error feedback computes its residual from the rounded ``q``
still in scratch instead of decoding the codes again.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Literal

import torch

log = logging.getLogger(__name__)

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

_CPU_CHUNK = 1 << 19  # 2 MiB of fp32: chunk + scratch stay in L3; per-op dispatch (~5 us) amortised
_CUDA_CHUNK = 1 << 24  # 64 MiB of fp32: launches are amortised, scratch stays modest

if sys.byteorder != "little":  # the byte views below assume the wire's byte order
    raise ImportError("diloco.quant needs a little-endian host")


class QuantError(ValueError):
    """A low-bit payload or input that violates the format (the message says what)."""


@functools.cache
def max_scale(kind: str) -> float:
    """``S_max`` of ``kind``: the largest scale the format admits (see the module docstring)."""
    t = torch.tensor([2.0**127 / QMAX[check_kind(kind)]], dtype=torch.float32)
    return float(_ceil_to_bf16(t).float())


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


def _chunk_elems(device: torch.device, block: int) -> int:
    """Elements per processing chunk on ``device`` (a multiple of ``block`` and of 2)."""
    chunk = _CUDA_CHUNK if device.type == "cuda" else _CPU_CHUNK
    return max(chunk, block)


def _ceil_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16 >= each fp32 ``t`` (``t`` >= 0 or NaN), by integer ops on the bits.

    bf16 is the top half of fp32: adding 0xFFFF to the bits carries into the
    kept half unless the dropped half is already zero, then the mask drops it.
    For a non-negative finite ``t`` that is round-toward-+inf; inf stays inf.
    """
    bits = t.view(torch.int32)
    bits = (bits + 0xFFFF).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as int32
    return bits.bitwise_right_shift_(16).to(torch.int16).view(torch.bfloat16)


class _Scratch:
    """Buffers for one chunk: fp32 work, uint8 codes, int16 pack/unpack, per-block max/min."""

    def __init__(self, chunk: int, device: torch.device) -> None:
        self.f32 = torch.empty(chunk, dtype=torch.float32, device=device)
        self.u8 = torch.empty(chunk, dtype=torch.uint8, device=device)
        self.i16 = torch.empty(chunk // 2, dtype=torch.int16, device=device)
        self.absmax = torch.empty(chunk // MIN_BLOCK, dtype=torch.float32, device=device)
        self.absmin = torch.empty(chunk // MIN_BLOCK, dtype=torch.float32, device=device)


def _output(
    given: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device, name: str
) -> torch.Tensor:
    """``given`` checked against the expected size/dtype/device, or a new tensor."""
    if given is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if given.dtype != dtype or given.shape != (numel,) or given.device != device or not given.is_contiguous():
        raise QuantError(
            f"{name} must be a contiguous {dtype} tensor of {numel} elements on {device}, "
            f"got {given.dtype} of shape {tuple(given.shape)} on {given.device}"
        )
    return given


_tls = threading.local()


def _scratch(chunk: int, device: torch.device) -> _Scratch:
    """Scratch for ``chunk`` elements: on CPU one cached set per thread, on CUDA a new one.

    A fresh CPU buffer of a few MiB is an mmap whose pages fault in on first
    write; per call (and ErrorFeedback calls per chunk) that cost as much as
    the quantization. CUDA's caching allocator already reuses freed blocks,
    and caching there would pin ~100 MiB of device memory for good.
    """
    if device.type != "cpu":
        return _Scratch(chunk, device)
    cached: _Scratch | None = getattr(_tls, "scratch", None)
    if cached is None or cached.f32.numel() < chunk:
        cached = _Scratch(max(chunk, min(_CPU_CHUNK, 1 << 16)), device)
        _tls.scratch = cached
    return cached


def _quantize_blocks(
    x: torch.Tensor,
    kind: Kind,
    block: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
    sc: _Scratch,
    feedback: bool,
) -> None:
    """Quantize ``x`` (whole blocks only, ``x.numel() % block == 0``) into ``codes``/``scales``.

    With ``feedback``, ``x`` is then overwritten with ``x - x'`` (the residual):
    ``q`` is at hand in the scratch right after rounding, so the residual
    costs two passes instead of a full decode.
    """
    n = x.numel()
    nb = n // block
    xb = x.view(nb, block)
    work = sc.f32[:n]
    wb = work.view(nb, block)
    amax = sc.absmax[:nb]
    # max(-min, max): two reductions that only read (the first brings the chunk
    # into cache), cheaper than writing |x| and reducing that.
    amin = sc.absmin[:nb]
    torch.amax(xb, dim=1, out=amax)
    torch.amin(xb, dim=1, out=amin)
    torch.maximum(amax, amin.neg_(), out=amax)
    amax.add_(0.0)  # an all-zero block may give -0.0; -0 + 0 = +0 keeps its scale's sign bit clear
    scale16 = _ceil_to_bf16(amax.div_(float(QMAX[kind])))
    scales.copy_(scale16)
    # A zero scale means an all-zero (or all sub-2^-149 * qmax) block whose codes
    # are q = 0: dividing by 1 keeps those values below 0.5, so round gives 0.
    divisor = scale16.float().masked_fill_(scale16 == 0, 1.0).unsqueeze(1)
    torch.div(xb, divisor, out=wb)
    work.round_()  # half to even on CPU and CUDA (nearbyint)
    # q: exact integers in [-qmax, qmax], so the conversion to int8 is exact
    # (and fp32 -> int8 is vectorised on CPU, fp32 -> uint8 is not).
    q8 = codes.view(torch.int8) if kind == "int8" else sc.u8[:n].view(torch.int8)
    q8.copy_(work)
    if feedback:
        wb.mul_(divisor)  # x' = q * s: exact (a zero block has q = 0, so the 1 is harmless)
        # The residual x - x', one rounding. Only the sign of a zero may differ
        # from x + (x' * -1) (round keeps -0.0); a zero's sign never changes a code.
        x.sub_(work)
    if kind == "int8":
        return
    q8.add_(Q4_OFFSET)  # codes c = q + 8 in [1, 15], in int8 (a quarter of an fp32 pass)
    # Pairs as little-endian int16: w = c0 + 256*c1, and w - 15*(w >> 4) = c0 + 16*c1.
    w = q8.view(torch.int16)
    t = sc.i16[: n // 2]
    torch.bitwise_right_shift(w, 4, out=t)
    torch.add(w, t, alpha=-15, out=t)
    codes.copy_(t)  # exact values in [0, 255]


def quantize(
    x: torch.Tensor,
    kind: str,
    block: int = DEFAULT_BLOCK,
    *,
    codes_out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat fp32 range into ``(codes, scales)`` per the module's format.

    Args:
        x: 1-D contiguous fp32 tensor (CPU or CUDA), finite, ``|x| <= 2^127``;
            element 0 must be a block boundary of the fragment stream (any
            part start is).
        kind: ``"int8"`` or ``"q4"``.
        block: elements per scale (power of two in [8, 4096]).
        codes_out, scales_out: optional preallocated outputs on ``x``'s device
            (uint8 of ``code_nbytes(kind, n)``, bf16 of ``ceil(n / block)``),
            e.g. buffers reused part after part: a fresh CPU allocation is
            page-faulted in on first write, which costs as much as the
            quantization itself on one core.

    Returns:
        ``codes`` (uint8, ``code_nbytes(kind, n)``) and ``scales`` (bfloat16,
        ``ceil(n / block)``), on ``x``'s device.

    Raises:
        QuantError: bad arguments, or a non-finite or too large value in ``x``
            (it would poison its block's scale; the syncer would refuse the
            push anyway).
    """
    kind_ = check_kind(kind)
    check_block(block)
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise QuantError(f"quantize wants a contiguous 1-D fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    n = x.numel()
    codes = _output(codes_out, code_nbytes(kind_, n), torch.uint8, x.device, "codes_out")
    scales = _output(scales_out, n_scales(n, block), torch.bfloat16, x.device, "scales_out")
    _encode(x, kind_, block, codes, scales, feedback=False)
    return codes, scales


def _encode(
    x: torch.Tensor, kind: Kind, block: int, codes: torch.Tensor, scales: torch.Tensor, feedback: bool
) -> None:
    """The quantization loop of :func:`quantize`; with ``feedback`` it leaves the residual in ``x``."""
    n = x.numel()
    if n == 0:
        return
    chunk = _chunk_elems(x.device, block)
    sc = _scratch(min(chunk, -(-n // block) * block), x.device)
    per_byte = 1 if kind == "int8" else 2
    full = (n // block) * block
    for lo in range(0, full, chunk):
        hi = min(full, lo + chunk)
        _quantize_blocks(
            x[lo:hi],
            kind,
            block,
            codes[lo // per_byte : hi // per_byte],
            scales[lo // block : hi // block],
            sc,
            feedback,
        )
    if full < n:
        # The short last block: zero padding leaves its absmax unchanged and its
        # padded codes are dropped (q4: the odd element's partner nibble is set to 0).
        tail = torch.zeros(block, dtype=torch.float32, device=x.device)
        tail[: n - full].copy_(x[full:])
        tcodes = torch.empty(code_nbytes(kind, block), dtype=torch.uint8, device=x.device)
        _quantize_blocks(tail, kind, block, tcodes, scales[full // block :], sc, feedback)
        codes[full // per_byte :].copy_(tcodes[: codes.numel() - full // per_byte])
        if kind == "q4" and n % 2:
            codes[-1:].bitwise_and_(0x0F)
        if feedback:
            x[full:].copy_(tail[: n - full])
    # One host sync per call, not per chunk. NaN fails the comparison.
    if not bool((scales <= max_scale(kind)).all()):
        if not bool(torch.isfinite(scales).all()):
            raise QuantError("non-finite value in a low-bit push (NaN or inf in the delta)")
        raise QuantError("a value in a low-bit push exceeds 2^127 in magnitude (its block would overflow)")


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


def _dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, kind: Kind, block: int, n: int, sc: _Scratch
) -> torch.Tensor:
    """Dequantize whole blocks (``n % block == 0``) into ``sc.f32[:n]`` and return that view."""
    work = sc.f32[:n]
    if kind == "int8":
        work.copy_(codes.view(torch.int8))
    else:
        # Unpack by integer ops: w = c0 + 16*c1 becomes c0 + 256*c1, i.e. the two
        # codes as consecutive little-endian bytes.
        w = sc.i16[: n // 2]
        w.copy_(codes)
        c8 = sc.u8[:n]
        w16 = c8.view(torch.int16)
        torch.bitwise_right_shift(w, 4, out=w16)
        torch.add(w, w16, alpha=240, out=w16)
        q8 = c8.view(torch.int8)
        q8.sub_(Q4_OFFSET)  # q = c - 8, in int8 (a quarter of an fp32 pass)
        work.copy_(q8)
    work.view(-1, block).mul_(scales.float().unsqueeze(1))  # q * s: exact (<= 15 significant bits)
    return work


def _blocks_of(
    codes: torch.Tensor, scales: torch.Tensor, kind: Kind, block: int, n: int, device: torch.device
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(lo, hi, fp32 view of x'[lo:hi])`` chunk by chunk (the tail block zero-padded, then cut)."""
    chunk = _chunk_elems(device, block)
    sc = _scratch(min(chunk, -(-n // block) * block), device)
    per_byte = 1 if kind == "int8" else 2
    full = (n // block) * block
    for lo in range(0, full, chunk):
        hi = min(full, lo + chunk)
        yield lo, hi, _dequantize_blocks(
            codes[lo // per_byte : hi // per_byte], scales[lo // block : hi // block], kind, block, hi - lo, sc
        )
    if full < n:
        tcodes = torch.zeros(code_nbytes(kind, block), dtype=torch.uint8, device=device)
        rest = codes[full // per_byte :]
        tcodes[: rest.numel()].copy_(rest)
        yield full, n, _dequantize_blocks(tcodes, scales[full // block :], kind, block, block, sc)[: n - full]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str, block: int, n: int) -> torch.Tensor:
    """Decode ``(codes, scales)`` of an ``n``-element range into a new fp32 tensor (validated first)."""
    kind_ = check_kind(kind)
    check_payload(codes, scales, kind_, block, n)
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    for lo, hi, deq in _blocks_of(codes, scales, kind_, block, n, codes.device):
        out[lo:hi].copy_(deq)
    return out


def dequantize_fold(
    codes: torch.Tensor,
    scales: torch.Tensor,
    kind: str,
    block: int,
    out: torch.Tensor,
    weight: float,
) -> None:
    """``out = out + fp32(x' * weight)`` chunk by chunk, never holding an fp32 copy of the push.

    This is the syncer's merge step for one part of one push: ``out`` is the
    part's range of the fp32 running sum (a 1-D fp32 view, ``n`` elements,
    same device as the codes). The product and the sum are rounded separately,
    in that order (no fused multiply-add), like the merge of fp32 and bf16
    pushes in docs/PROTOCOL.md, so a numpy reference matches bit for bit.
    ``weight`` is rounded to fp32 (as ``np.float32(weight)``); ``weight == 1``
    skips the multiply, which changes nothing. Validates the payload first.
    """
    kind_ = check_kind(kind)
    if out.dtype != torch.float32 or out.dim() != 1:
        raise QuantError(f"fold target must be a 1-D fp32 view, got {out.dtype} of shape {tuple(out.shape)}")
    n = out.numel()
    check_payload(codes, scales, kind_, block, n)
    if codes.device != out.device:
        raise QuantError(f"codes on {codes.device} but fold target on {out.device}")
    w = float(weight)
    for lo, hi, deq in _blocks_of(codes, scales, kind_, block, n, out.device):
        if w != 1.0:
            deq.mul_(w)
        out[lo:hi].add_(deq)


class ErrorFeedback:
    """Per-fragment quantization residuals of one rank, so rounding never biases the model.

    Each push sends ``Q(delta + r)`` and keeps ``r = (delta + r) - deq(Q(...))``
    for the next push of the same fragment: over many rounds the sum of what
    was sent equals the sum of the true deltas up to the last residual, which
    is at most half a quantization step per element. Use one instance per
    rank; the residual lives on the device of the deltas it is given (where
    the fragment's masters live), so encoding happens before the device to
    host copy. Call :meth:`reset` when the fragment gets a cut (the island
    installs a value it did not derive from its own pushes, so the old
    residual no longer refers to anything).

    A push the syncer does not merge (its attempt is superseded, or it has
    weight 0) still updated the residual as if it had arrived. The damage is
    bounded: the next push is off by ``r_new - r_old``, under one step per
    element, like one push without feedback (exactly: ``v - x'`` is exact in
    fp32, Sterbenz, so nothing else is lost). An island with no local step
    since its last apply can push zeros without calling :meth:`encode`.

    Args:
        kind: ``"int8"`` or ``"q4"``.
        block: elements per scale (see :func:`check_block`).
    """

    def __init__(self, kind: str, block: int = DEFAULT_BLOCK) -> None:
        self.kind: Kind = check_kind(kind)
        self.block = check_block(block)
        self._residual: dict[int, torch.Tensor] = {}

    def encode(
        self,
        fragment: int,
        delta: torch.Tensor,
        offset: int = 0,
        fragment_numel: int | None = None,
        *,
        codes_out: torch.Tensor | None = None,
        scales_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``delta + residual`` for elements ``[offset, offset + n)`` of a fragment's stream.

        Args:
            fragment: fragment id.
            delta: contiguous 1-D fp32 range of the fragment's delta (a part,
                or the whole fragment), on the masters' device; not modified.
            offset: the range's first element in the fragment's flat stream; a
                multiple of the block size (part starts are).
            fragment_numel: elements in the whole fragment (default
                ``offset + n``); fixes the residual's size at first use.
            codes_out, scales_out: optional reused outputs (see :func:`quantize`).

        Returns:
            ``(codes, scales)`` as :func:`quantize` returns them.
        """
        if delta.dtype != torch.float32 or delta.dim() != 1:
            raise QuantError(f"a delta range must be 1-D fp32, got {delta.dtype} of shape {tuple(delta.shape)}")
        if offset % self.block:
            raise QuantError(f"offset {offset} is not a multiple of the block size {self.block}")
        n = delta.numel()
        total = offset + n if fragment_numel is None else fragment_numel
        if offset + n > total:
            raise QuantError(f"range [{offset}, {offset + n}) outside a fragment of {total} elements")
        res = self._residual.get(fragment)
        if res is None or res.numel() != total or res.device != delta.device:
            if res is not None:
                log.warning("fragment %d: residual of %d elements dropped (now %d)", fragment, res.numel(), total)
            res = torch.zeros(total, dtype=torch.float32, device=delta.device)
            self._residual[fragment] = res
        codes = _output(codes_out, code_nbytes(self.kind, n), torch.uint8, delta.device, "codes_out")
        scales = _output(scales_out, n_scales(n, self.block), torch.bfloat16, delta.device, "scales_out")
        per_byte = 1 if self.kind == "int8" else 2
        # Chunk by chunk (block-aligned, so the bytes equal one quantize of the
        # range): add, quantize and residual run while the chunk is in cache.
        step = _chunk_elems(delta.device, self.block)
        try:
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                r = res[offset + lo : offset + hi]
                r.add_(delta[lo:hi])  # r now holds v = delta + residual
                c = codes[lo // per_byte : -(-hi // per_byte)]
                sc = scales[lo // self.block : -(-hi // self.block)]
                _encode(r, self.kind, self.block, c, sc, feedback=True)  # r = v - x'(v)
        except BaseException:
            # The residual holds a half-updated sum now; dropping it is the only sound state.
            self.reset(fragment)
            raise
        return codes, scales

    def residual(self, fragment: int) -> torch.Tensor | None:
        """The fragment's current residual (read-only use), or None before its first push."""
        return self._residual.get(fragment)

    def reset(self, fragment: int) -> None:
        """Forget the fragment's residual (on a cut)."""
        self._residual.pop(fragment, None)

    def reset_all(self) -> None:
        """Forget every residual (on a reconnect that installs a full cut)."""
        self._residual.clear()

"""Low-bit pushes, the kernels: quantize, dequantize and fold a flat fp32 range, chunk by chunk.

Pure functions over torch tensors (CPU or CUDA) that implement :mod:`diloco.quant.format` bit for
bit; they own no state but a per-thread CPU scratch buffer (one chunk, see below) and validate
every received payload (:func:`~diloco.quant.format.check_payload`) before decoding it.

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

import threading
from collections.abc import Callable, Iterator

import torch

from diloco.quant.format import (DEFAULT_BLOCK, MIN_BLOCK, Q4_OFFSET, QMAX, Kind, QuantError, ceil_to_bf16,
                                 check_block, check_kind, check_payload, code_nbytes, max_scale, n_scales)

_CPU_CHUNK = 1 << 19  # 2 MiB of fp32: chunk + scratch stay in L3; per-op dispatch (~5 us) amortised
_CUDA_CHUNK = 1 << 24  # 64 MiB of fp32: launches are amortised, scratch stays modest


def chunk_elems(device: torch.device, block: int) -> int:
    """Elements per processing chunk on ``device`` (a multiple of ``block`` and of 2)."""
    chunk = _CUDA_CHUNK if device.type == "cuda" else _CPU_CHUNK
    return max(chunk, block)


class _Scratch:
    """Buffers for one chunk: fp32 work, uint8 codes, int16 pack/unpack, per-block max/min."""

    def __init__(self, chunk: int, device: torch.device) -> None:
        self.f32 = torch.empty(chunk, dtype=torch.float32, device=device)
        self.u8 = torch.empty(chunk, dtype=torch.uint8, device=device)
        self.i16 = torch.empty(chunk // 2, dtype=torch.int16, device=device)
        self.absmax = torch.empty(chunk // MIN_BLOCK, dtype=torch.float32, device=device)
        self.absmin = torch.empty(chunk // MIN_BLOCK, dtype=torch.float32, device=device)


def output_buffer(
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


def scratch(chunk: int, device: torch.device) -> _Scratch:
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
    scale16 = ceil_to_bf16(amax.div_(float(QMAX[kind])))
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
    codes = output_buffer(codes_out, code_nbytes(kind_, n), torch.uint8, x.device, "codes_out")
    scales = output_buffer(scales_out, n_scales(n, block), torch.bfloat16, x.device, "scales_out")
    encode_range(x, kind_, block, codes, scales, feedback=False)
    return codes, scales


def encode_range(
    x: torch.Tensor, kind: Kind, block: int, codes: torch.Tensor, scales: torch.Tensor, feedback: bool
) -> None:
    """The quantization loop of :func:`quantize`; with ``feedback`` it leaves the residual in ``x``."""
    n = x.numel()
    if n == 0:
        return
    chunk = chunk_elems(x.device, block)
    sc = scratch(min(chunk, -(-n // block) * block), x.device)
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
    chunk = chunk_elems(device, block)
    sc = scratch(min(chunk, -(-n // block) * block), device)
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
    inspect: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """``out = out + fp32(x' * weight)`` chunk by chunk, never holding an fp32 copy of the push.

    ``inspect`` sees each dequantized chunk ``x'`` before it is weighted and folded (it may raise
    to refuse the chunk: earlier chunks stay folded).

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
        if inspect is not None:
            inspect(deq)
        if w != 1.0:
            deq.mul_(w)
        out[lo:hi].add_(deq)

"""Low-bit pushes, error feedback: each fragment's rounding residual, carried into its next push.

:class:`ErrorFeedback` owns one residual per fragment (bf16 by default: 2 B/param) (sized by the fragment, on the device
of the deltas it is given); the kernels are :mod:`diloco.quant.kernels`.
"""

from __future__ import annotations

import logging

import torch

from diloco.quant.format import DEFAULT_BLOCK, Kind, QuantError, check_block, check_kind, code_nbytes, n_scales
from diloco.quant.kernels import chunk_elems, encode_range, output_buffer

log = logging.getLogger(__name__)


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

    The residual is kept in ``residual_dtype``: bf16 by default, half the memory of fp32 (the
    island's budget: at most 2 B/param); the sum ``delta + residual`` and the new residual are
    computed in fp32 one chunk at a time, then stored rounded to bf16, a relative error of
    2^-9 on something already under half a quantization step.

    Args:
        kind: ``"int8"`` or ``"q4"``.
        block: elements per scale (see :func:`check_block`).
        residual_dtype: ``torch.bfloat16`` (default) or ``torch.float32`` (exact carry).
    """

    def __init__(self, kind: str, block: int = DEFAULT_BLOCK, residual_dtype: torch.dtype = torch.bfloat16) -> None:
        if residual_dtype not in (torch.bfloat16, torch.float32):
            raise QuantError(f"residual_dtype must be bfloat16 or float32, got {residual_dtype}")
        self.kind: Kind = check_kind(kind)
        self.block = check_block(block)
        self.residual_dtype = residual_dtype
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
            res = torch.zeros(total, dtype=self.residual_dtype, device=delta.device)
            self._residual[fragment] = res
        codes = output_buffer(codes_out, code_nbytes(self.kind, n), torch.uint8, delta.device, "codes_out")
        scales = output_buffer(scales_out, n_scales(n, self.block), torch.bfloat16, delta.device, "scales_out")
        per_byte = 1 if self.kind == "int8" else 2
        # Chunk by chunk (block-aligned, so the bytes equal one quantize of the
        # range): add, quantize and residual run while the chunk is in cache.
        step = chunk_elems(delta.device, self.block)
        work = None if res.dtype == torch.float32 else torch.empty(min(step, n), dtype=torch.float32,
                                                                    device=delta.device)
        try:
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                r = res[offset + lo : offset + hi]
                c = codes[lo // per_byte : -(-hi // per_byte)]
                sc = scales[lo // self.block : -(-hi // self.block)]
                if work is None:
                    r.add_(delta[lo:hi])  # r now holds v = delta + residual
                    encode_range(r, self.kind, self.block, c, sc, feedback=True)  # r = v - x'(v)
                else:
                    v = torch.add(delta[lo:hi], r, out=work[: hi - lo])  # v = delta + residual, in fp32
                    encode_range(v, self.kind, self.block, c, sc, feedback=True)  # v = v - x'(v)
                    r.copy_(v)
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

"""Low-bit pushes: block-wise absmax quantization (``int8``, ``q4``) with error feedback.

One face for the codec; the rooms behind it:

* :mod:`diloco.quant.format`: the byte format (normative copy: docs/PROTOCOL.md, "Low-bit
  pushes"), sizes, and the checks a received payload must pass.
* :mod:`diloco.quant.kernels`: quantize / dequantize / fold a flat fp32 range, chunk by chunk.
* :mod:`diloco.quant.feedback`: :class:`ErrorFeedback`, each fragment's rounding residual.

The wire, the island and the syncer call it (``from diloco import quant``); it knows nothing of them.
"""

from diloco.quant.feedback import ErrorFeedback
from diloco.quant.format import (DEFAULT_BLOCK, KINDS, MIN_BLOCK, PART_ALIGN, Q4_OFFSET, QMAX, Kind, QuantError,
                                 check_block, check_kind, check_payload, code_nbytes, max_scale, n_scales,
                                 wire_nbytes)
from diloco.quant.kernels import dequantize, dequantize_fold, quantize

__all__ = [
    "DEFAULT_BLOCK", "KINDS", "MIN_BLOCK", "PART_ALIGN", "Q4_OFFSET", "QMAX", "ErrorFeedback", "Kind", "QuantError",
    "check_block", "check_kind", "check_payload", "code_nbytes", "dequantize", "dequantize_fold", "max_scale",
    "n_scales", "quantize", "wire_nbytes",
]

"""Quantize and dequantize whole tensors, bit-identical to GGML.

``quantize(t, x)`` gives exactly the bytes of GGML's ``ggml_quantize_chunk(t, x, ..., imatrix=NULL)``
(the reference quantizers, docs/quant-formats.md §4); ``dequantize(t, data, n_per_row)`` gives
exactly GGML's ``dequantize_row_*`` floats. The kernels live in ``backends/cpu/type_<family>.py``, these
drivers in ``backends/cpu/convert.py``; this module is their public home.

Supported types (``SUPPORTED_TYPES``): F32 and every type with a reference quantizer in the CPU
traits table (``backends/cpu/traits.py``): F16, BF16 and every quantized type lazyggml has.

NaN and Inf inputs:

* F16 / BF16 conversions are fully defined and match GGML: Inf stays Inf, finite values too large
  for fp16 become Inf, NaN becomes ``sign | 0x7E00`` in F16 and a quiet NaN in BF16.
* For the quantized types GGML does not define the result (its C float-to-int conversions of NaN
  and out-of-range values are undefined behaviour). We reproduce what an x86-64 build of GGML
  does (``cvttss2si``: NaN or out of range -> INT_MIN, of which C keeps the low byte) and the
  ``nearest_int`` bit trick exactly; the tests find x86 GGML's bytes for NaN and +-Inf inputs in
  every type, but other platforms' GGML may differ there.
* One intentional difference: an all-zero Q8_K block gets zero ``bsums``; GGML leaves them as
  they were in the destination buffer.
"""
from .backends.cpu.convert import SUPPORTED_TYPES, dequantize, quantize

__all__ = ["SUPPORTED_TYPES", "quantize", "dequantize"]

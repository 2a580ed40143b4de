"""bfloat16 <-> float32 on bit patterns.

numpy has no bfloat16 dtype, so moepack carries every bf16 value as its 16-bit pattern in a
``numpy.uint16`` array: the upper half of the float32 with the same sign, exponent and top 7
mantissa bits.

``f32_to_bf16`` rounds exactly as MLX's float32 -> bfloat16 cast does (checked bit for bit
against ``mx.array(x).astype(mx.bfloat16)`` on random bit patterns, see tests):

* round to nearest, ties to even, on the 16 dropped bits; subnormals are kept (no flush to
  zero), values that round past the largest finite bf16 become +-inf;
* every NaN (either sign, any payload) becomes the canonical quiet NaN 0x7FC0.

``bf16_to_f32`` is exact (every bf16 value is a float32).
"""

from __future__ import annotations

import numpy as np

from ..errors import QuantizationError

BF16_NAN = np.uint16(0x7FC0)


def f32_to_bf16(x) -> np.ndarray:
    """float32 array -> uint16 array of bf16 bit patterns (same shape), round-to-nearest-even."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise QuantizationError(
            f"f32_to_bf16 expects a float32 array, got {x.dtype}",
            hint="convert with .astype(np.float32) first (a float64 value would be rounded twice)",
        )
    u = x.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit, then truncating, rounds half to even. The sum
    # cannot wrap for a non-NaN input (the largest non-NaN pattern is -inf = 0xFF800000).
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    out = ((u + (np.uint32(0x7FFF) + lsb)) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(x), BF16_NAN, out).astype(np.uint16, copy=False)


def bf16_to_f32(u) -> np.ndarray:
    """uint16 array of bf16 bit patterns -> float32 array (same shape), exact."""
    u = np.asarray(u)
    if u.dtype != np.uint16:
        raise QuantizationError(
            f"bf16_to_f32 expects a uint16 array of bf16 bit patterns, got {u.dtype}",
            hint="bf16 tensors are carried as numpy uint16 bit patterns (e.g. arr.view(np.uint16))",
        )
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)

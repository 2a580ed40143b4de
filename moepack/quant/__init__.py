"""MLX affine quantization: bf16 helpers, the numpy reference codec, numba fast paths, requantization.

``quantize``/``dequantize`` here are the numba versions; the numpy references, which are the
spec, are ``quantize_ref``/``dequantize_ref`` (module ``affine_ref``). Both are bit-exact with
MLX's ``mx.quantize``/``mx.dequantize`` (see ``affine_ref`` for the algorithm).
"""

from .affine_fast import dequantize, quantize
from .affine_ref import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, pack, unpack
from .affine_ref import dequantize as dequantize_ref
from .affine_ref import quantize as quantize_ref
from .bf16 import bf16_to_f32, f32_to_bf16
from .requant import quant_error, quant_error_ref, requantize_minmax, requantize_minmax_ref

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "bf16_to_f32",
    "dequantize",
    "dequantize_ref",
    "f32_to_bf16",
    "pack",
    "quant_error",
    "quant_error_ref",
    "quantize",
    "quantize_ref",
    "requantize_minmax",
    "requantize_minmax_ref",
    "unpack",
]

"""MLX affine quantization in plain numpy: the readable reference (the spec of moepack's codec).

A weight matrix ``w`` of shape ``[..., out, in]`` is cut, row by row, into groups of
``group_size`` consecutive input values. Each group stores one ``scale`` and one ``bias`` (bf16)
and one code ``q`` in ``[0, 2**bits - 1]`` per value; it decodes as ``w ~ scale * q + bias``.

Packing (``pack``/``unpack``)
    The codes of a row form one little-end-first bit stream: code ``i`` of the row occupies
    stream bits ``i*bits .. i*bits + bits - 1``, and stream bit ``k`` is bit ``k % 32`` of
    uint32 word ``k // 32`` (words are little-endian in memory). So at 4 bits code ``i`` of a
    word sits in bits ``4i..4i+3`` (8 codes per word), at 2 bits 16 codes per word, at 8 bits
    4 codes per word. At 3 bits codes straddle words: 32 codes fill exactly 3 words (``96``
    bits) and code 10 is split over bits 30-31 of word 0 and bit 0 of word 1. This is the same
    as MLX's 3-bit layout (8 codes in 3 bytes, bytes in order), verified against
    ``mx.quantize``.

Quantization (``quantize``) -- exactly what MLX's CPU ``affine_quantize`` computes, every
step in float32 (bit-exact with ``mx.quantize`` for float32 input and for bf16 input given
here as the same values in float32). Per group, with ``n_bins = 2**bits - 1``::

    w_min, w_max = min(group), max(group)
    scale = max((w_max - w_min) / n_bins, 1e-7)
    if |w_min| > |w_max|:  scale, edge = +scale, w_min   # code 0 lands on w_min
    else:                  scale, edge = -scale, w_max   # NEGATIVE scale: code 0 on w_max
    q0 = rint(edge / scale)                               # the code of 0.0, negated
    if q0 != 0:  scale, bias = edge / q0, edge           # nudge scale so 0.0 is on the grid
    else:        bias = 0                                 # (possible only at the 1e-7 floor)
    q = clip(rint((w - bias) / scale), 0, n_bins)         # rint = round half to even
    store bf16(scale), bf16(bias)                         # rounded only when stored

Consequences worth knowing: the scale is negative whenever ``|max| >= |min|`` (most groups);
the edge value of larger magnitude is reproduced exactly by code 0 (before the bf16 rounding
of the bias); an all-zero group stores ``scale = bf16(-1e-7)``, ``bias = 0``, codes 0; a
constant group ``c`` stores ``bias = bf16(c)``, a scale of about -1e-7 and codes 0 (but if
``|c| < 5e-8``, ``q0`` rounds to 0 and the group decodes as 0); ties (``|min| == |max|``) take
the negative-scale branch. The codes are computed against the float32 scale and
bias, *not* the bf16-rounded ones (that is MLX's choice; ``requant`` does better).

Dequantization (``dequantize``) -- ``w = scale * q + bias`` in float32 from the bf16 scale and
bias: a float32 multiply then a float32 add, each rounded (no fused multiply-add), exactly as
MLX's CPU dequantize does with float32 scales. (With bf16 scales the product of a scale and
a code of at most 8 bits is exact in float32, so fma and mul+add agree anyway.)

Only finite inputs are accepted by ``quantize``: MLX's treatment of NaN/inf is
implementation-defined garbage, so they are rejected.

Which MLX: the CPU backend (what the tests compare against, with ``stream=mx.cpu``). MLX's
Metal kernel, per its source (mlx 0.32 ``affine_quantize`` in ``quantized.h``; not checked on
hardware here), differs in two corners: it starts the running max at 0, so a group whose values
are all negative is quantized over ``[min, 0]``, and it rounds codes half away from zero
(``round``) instead of half to even. Checkpoints converted on a Mac GPU can therefore differ
from ``quantize`` in those groups.
"""

from __future__ import annotations

import numpy as np

from ..errors import QuantizationError
from .bf16 import bf16_to_f32, f32_to_bf16

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)  # what MLX's kernels accept
_EPS = np.float32(1e-7)  # MLX's floor on |scale|


# ----------------------------------------------------------------------------- validation


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise QuantizationError(f"unsupported bit width {bits!r}: expected one of {SUPPORTED_BITS}")
    return int(bits)


def check_group_size(group_size, in_dim: int | None = None) -> int:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, (int, np.integer))
        or int(group_size) not in SUPPORTED_GROUP_SIZES
    ):
        raise QuantizationError(
            f"unsupported group size {group_size!r}: expected one of {SUPPORTED_GROUP_SIZES}"
        )
    group_size = int(group_size)
    if in_dim is not None and in_dim <= 0:
        raise QuantizationError(f"the input dimension is {in_dim}: expected a positive multiple of {group_size}")
    if in_dim is not None and in_dim % group_size != 0:
        raise QuantizationError(
            f"group size {group_size} does not divide the input dimension {in_dim}: "
            f"expected a last dimension that is a multiple of {group_size}"
        )
    return group_size


def check_weights(w, bits, group_size) -> tuple[np.ndarray, int, int]:
    """Validate a float weight tensor ``[..., out, in]``; returns (w, bits, group_size)."""
    bits = check_bits(bits)
    w = np.asarray(w)
    if w.dtype != np.float32:
        raise QuantizationError(
            f"quantize expects float32 weights, got {w.dtype}",
            hint="bf16 weights: convert the uint16 bit patterns with bf16_to_f32 first",
        )
    if w.ndim < 2:
        raise QuantizationError(f"quantize expects weights of shape [..., out, in], got shape {w.shape}")
    group_size = check_group_size(group_size, w.shape[-1])
    return w, bits, group_size


def check_quantized(packed, scales, biases, bits, group_size, what="dequantize"):
    """Validate a quantized triple; returns (packed, scales, biases, bits, group_size, in_dim).

    packed: uint32 [..., out, in*bits/32]; scales, biases: uint16 (bf16) [..., out, in/group_size].
    """
    bits = check_bits(bits)
    packed, scales, biases = np.asarray(packed), np.asarray(scales), np.asarray(biases)
    if packed.dtype != np.uint32:
        raise QuantizationError(f"{what}: packed weights must be uint32, got {packed.dtype}")
    for name, arr in (("scales", scales), ("biases", biases)):
        if arr.dtype != np.uint16:
            raise QuantizationError(
                f"{what}: {name} must be uint16 bf16 bit patterns, got {arr.dtype}",
                hint="view bf16 tensors as np.uint16; convert float32 with f32_to_bf16",
            )
    if packed.ndim < 2:
        raise QuantizationError(f"{what}: packed weights must have shape [..., out, words], got {packed.shape}")
    words = packed.shape[-1]
    if (words * 32) % bits != 0:
        raise QuantizationError(
            f"{what}: {words} words per row do not hold a whole number of {bits}-bit codes: "
            f"expected a multiple of {bits // np.gcd(bits, 32)} words"
        )
    in_dim = words * 32 // bits
    group_size = check_group_size(group_size, in_dim)
    expected = packed.shape[:-1] + (in_dim // group_size,)
    for name, arr in (("scales", scales), ("biases", biases)):
        if arr.shape != expected:
            raise QuantizationError(
                f"{what}: {name} have shape {arr.shape}, expected {expected} for packed shape "
                f"{packed.shape} at {bits} bits, group size {group_size}"
            )
    return packed, scales, biases, bits, group_size, in_dim


# ----------------------------------------------------------------------------- packing


def pack(codes, bits) -> np.ndarray:
    """uint8 codes [..., n] -> uint32 words [..., n*bits/32], little-end-first bit stream per row."""
    bits = check_bits(bits)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise QuantizationError(f"pack expects uint8 codes, got {codes.dtype}")
    if codes.ndim < 1 or (codes.shape[-1] * bits) % 32 != 0:
        raise QuantizationError(
            f"pack: a row of {codes.shape[-1] if codes.ndim else 0} {bits}-bit codes does not fill whole "
            f"uint32 words: expected a multiple of {32 // np.gcd(bits, 32)} codes"
        )
    if codes.size and int(codes.max()) >= (1 << bits):
        raise QuantizationError(f"pack: code {int(codes.max())} does not fit in {bits} bits")
    lead, n = codes.shape[:-1], codes.shape[-1]
    planes = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)  # [..., n, bits] LSB first
    stream = planes.reshape(lead + (n * bits,))  # [..., n*bits]: stream bit k = bit k%bits of code k//bits
    as_bytes = np.packbits(stream, axis=-1, bitorder="little")  # [..., n*bits/8]: stream bit k -> byte k//8, bit k%8
    return np.ascontiguousarray(as_bytes).view("<u4").astype(np.uint32)  # [..., n*bits/32]


def unpack(packed, bits) -> np.ndarray:
    """uint32 words [..., w] -> uint8 codes [..., w*32/bits]; inverse of ``pack``."""
    bits = check_bits(bits)
    packed = np.asarray(packed)
    if packed.dtype != np.uint32:
        raise QuantizationError(f"unpack expects uint32 words, got {packed.dtype}")
    if packed.ndim < 1 or (packed.shape[-1] * 32) % bits != 0:
        raise QuantizationError(
            f"unpack: {packed.shape[-1] if packed.ndim else 0} words per row do not hold whole {bits}-bit "
            f"codes: expected a multiple of {bits // np.gcd(bits, 32)} words"
        )
    lead, words = packed.shape[:-1], packed.shape[-1]
    as_bytes = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8)  # [..., words*4]
    stream = np.unpackbits(as_bytes, axis=-1, bitorder="little")  # [..., words*32]
    planes = stream.reshape(lead + (words * 32 // bits, bits))  # [..., n, bits] LSB first
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)  # [..., n]


# ----------------------------------------------------------------------------- quantize


def quantize_groups_f32(g: np.ndarray, bits: int):
    """The MLX algorithm on groups ``g`` [..., group_size] (float32).

    Returns (codes uint8 [..., group_size], scale float32 [...], bias float32 [...]) with the
    scale and bias NOT yet rounded to bf16.
    """
    n_bins = np.float32((1 << bits) - 1)
    w_min = g.min(axis=-1)  # [...]
    w_max = g.max(axis=-1)  # [...]
    side = np.abs(w_min) > np.abs(w_max)  # True: anchor code 0 on w_min with a positive scale
    scale = np.maximum((w_max - w_min) / n_bins, _EPS)  # float32
    scale = np.where(side, scale, -scale)
    edge = np.where(side, w_min, w_max)
    q0 = np.rint(edge / scale)  # float32, round half to even (std::rint)
    nudge = q0 != 0
    scale = np.where(nudge, edge / np.where(nudge, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(nudge, edge, np.float32(0)).astype(np.float32)
    q = np.rint((g - bias[..., None]) / scale[..., None])  # [..., group_size] float32
    codes = np.clip(q, np.float32(0), n_bins).astype(np.uint8)
    return codes, scale, bias


def quantize(w, bits, group_size=64):
    """float32 w [..., out, in] -> (packed uint32 [..., out, in*bits/32],
    scales uint16-bf16 [..., out, in/group_size], biases uint16-bf16 [..., out, in/group_size]).

    Bit-exact with ``mx.quantize(mx.array(w), group_size, bits)`` (scales/biases of a float32
    input rounded to bf16 as MLX's ``astype(bfloat16)`` does) and with ``mx.quantize`` of the
    bf16 array when ``w`` holds bf16 values.
    """
    w, bits, group_size = check_weights(w, bits, group_size)
    if not np.isfinite(w).all():
        raise QuantizationError("quantize: the weights contain NaN or inf", hint="the source tensor is damaged")
    lead, n = w.shape[:-1], w.shape[-1]  # lead = [..., out]
    g = w.reshape(lead + (n // group_size, group_size))  # [..., out, groups, group_size]
    codes, scale, bias = quantize_groups_f32(g, bits)
    packed = pack(codes.reshape(lead + (n,)), bits)  # [..., out, in*bits/32]
    return packed, f32_to_bf16(scale), f32_to_bf16(bias)


# ----------------------------------------------------------------------------- dequantize


def dequantize(packed, scales, biases, bits, group_size=64) -> np.ndarray:
    """(packed uint32 [..., out, w], scales/biases uint16-bf16 [..., out, groups]) -> float32 [..., out, in].

    ``w = scale * q + bias`` in float32 (multiply, round, add, round -- no fma), like MLX.
    """
    packed, scales, biases, bits, group_size, n = check_quantized(packed, scales, biases, bits, group_size)
    lead = packed.shape[:-1]  # [..., out]
    codes = unpack(packed, bits).astype(np.float32)  # [..., out, in]
    q = codes.reshape(lead + (n // group_size, group_size))  # [..., out, groups, group_size]
    s = bf16_to_f32(scales)[..., None]  # [..., out, groups, 1]
    b = bf16_to_f32(biases)[..., None]
    w = q * s  # float32 product (exact: bf16 scale x code <= 8 bits)
    w += b  # float32 add
    return w.reshape(lead + (n,))

"""Requantize an affine-quantized tensor to another bit width, and measure quantization error.

Min-max requantization (the seed's 2-bit method, for any target width). Per group of
``group_size`` values, with ``n_bins = 2**dst_bits - 1``, all in float32::

    f       = scale_src * q_src + bias_src           # the source group, exactly as dequantize()
    mn, mx  = min(f), max(f)
    s, b    = (mx - mn) / n_bins, mn
    s*, b*  = bf16(s), bf16(b)                       # round to nearest even, AS STORED
    if mx == mn or s* == 0:                          # flat group: no division by zero
        q = 0, stored scale = 0 (bf16 +0.0), stored bias = b*
    else:
        q = clip(rint((f - b*) / s*), 0, n_bins)     # rint = np.rint: round half to EVEN

The codes are computed against the stored (bf16-rounded, back in float32) scale and bias,
so each code is the nearest grid point to ``f`` on the grid the runtime actually uses
(``s* * q + b*``), unlike MLX's own quantizer, which rounds against its unrounded float32
scale. The scale is never negative here (MLX's quantizer often stores negative scales).

Error measure: ``quant_error`` compares two quantized versions of one tensor element by element
without materialising either whole, and returns ``(sum_sq, max_abs, count)``; RMSE is
``sqrt(sum_sq / count)``. Differences are taken in float64 from the two float32 dequantized
values. The float64 summation order is fixed, so the numba and numpy versions agree to the last
bit: in each row, ``acc[j]`` sums the squared differences at position ``j`` of every group, in
group order (j = 0 .. group_size-1); the row's sum is ``acc[0] + acc[1] + ...`` in that order;
the row sums are added in row order. (Column-wise accumulation vectorizes; a running sum along
the row would be one long dependency chain.)

``requantize_minmax`` and ``quant_error`` run numba kernels (in ``affine_fast``) with outputs
identical to ``requantize_minmax_ref`` and ``quant_error_ref``, except ``quant_error``'s sum_sq
for 4 vs 2 bits (below). 4 -> 2 bits, the hot path, has its own kernel: every destination code
is a monotone function of the 4-bit source code, so it is fixed per group by three thresholds on
the source code, applied to 16 codes at a time with uint64 bit tricks (see the comment above
``requant_4to2_groups``).

4 vs 2 bits error (``quant_error`` with bit widths 4 and 2 in either order, and
``requantize_minmax_with_error`` 4 -> 2). Within a group an element's difference depends only on
its pair (4-bit code a, 2-bit code b) and the group's params, and it is computed exactly as above
(``d = float64(s_a * a + b_a) - float64(s_b * b + b_b)``, both dequantizations in float32). So
the kernels count the 16 x 4 pair histogram of each group (bit planes and popcounts) and:

* max_abs = the max of |d| over the non-empty bins: the same value as the reference's;
* count: the same;
* sum_sq, in this order: per group, ``count(a, b) * d(a, b)**2`` summed over the bins in order
  (a = 0..15 major, b = 0..3 minor; empty bins add exactly 0.0); the group sums in group order
  (every row's groups, rows in order) within chunks of 512 groups (``affine_fast._ECHUNK``), and
  the chunk sums in chunk order. Not the reference's order, so equal to it to rounding (a few
  ulp per term; tests hold it to rel 1e-12), but fixed: independent of threads, and the same
  in ``quant_error`` and ``requantize_minmax_with_error`` (whose 2-bit code is a function of the
  4-bit code, so it needs only the 16-bin histogram of the 4-bit codes), which agree exactly.
  (2, 4) is (4, 2) with d -> -d: exactly the same squares and magnitudes.

The kernels do not branch on empty bins (an empty bin adds 0 * d**2). Where the dequantized value
of some code overflows float32 (a bf16 scale near the top of the range), an empty bin's d can be
inf and 0 * inf makes the sum NaN; so a sum or max that is not finite (which finite differences
cannot give) sends the call to the element-wise path, which then decides the result.
``quant_error`` of two bit-identical tensors of the same width is (0.0, 0.0, count) without
computing (every difference is exactly 0.0).
"""

from __future__ import annotations

import sys

import numpy as np

from ..errors import QuantizationError
from .affine_fast import (
    _ECHUNK,
    error_4x2_groups,
    error_rows,
    params_f32,
    requant_4to2_groups,
    requant_err_4to2_groups,
    requant_rows,
)
from .affine_ref import check_bits, check_quantized, dequantize, pack
from .bf16 import bf16_to_f32, f32_to_bf16


def _check_finite_params(scales, biases, what):
    if not (np.isfinite(bf16_to_f32(scales)).all() and np.isfinite(bf16_to_f32(biases)).all()):
        raise QuantizationError(f"{what}: scales or biases contain NaN or inf", hint="the source tensor is damaged")


# ----------------------------------------------------------------------------- reference


def requantize_minmax_ref(packed, scales, biases, src_bits, dst_bits, group_size=64):
    """Requantize (packed u32 [..., out, in*src_bits/32], scales/biases u16-bf16 [..., out, groups])
    from ``src_bits`` to ``dst_bits`` -> (packed u32 [..., out, in*dst_bits/32], scales, biases)."""
    packed, scales, biases, src_bits, group_size, n = check_quantized(
        packed, scales, biases, src_bits, group_size, what="requantize"
    )
    dst_bits = check_bits(dst_bits)
    _check_finite_params(scales, biases, "requantize")
    lead = packed.shape[:-1]  # [..., out]
    f = dequantize(packed, scales, biases, src_bits, group_size)  # [..., out, in] f32
    g = f.reshape(lead + (n // group_size, group_size))  # [..., out, groups, group_size]
    n_bins = np.float32((1 << dst_bits) - 1)
    mn = g.min(axis=-1)  # [..., out, groups]
    mx = g.max(axis=-1)
    s_bits = f32_to_bf16((mx - mn) / n_bins)  # stored scale (bf16)
    b_bits = f32_to_bf16(mn)  # stored bias (bf16)
    s_st = bf16_to_f32(s_bits)  # what the runtime will use, in float32
    b_st = bf16_to_f32(b_bits)
    flat = (mx == mn) | (s_st == 0)  # [..., out, groups]
    divisor = np.where(flat, np.float32(1), s_st)[..., None]  # no 0/0 on flat groups
    q = np.rint((g - b_st[..., None]) / divisor)  # float32, half to even
    q = np.clip(q, np.float32(0), n_bins)
    q[flat] = 0
    s_bits[flat] = 0
    codes = q.astype(np.uint8).reshape(lead + (n,))
    return pack(codes, dst_bits), s_bits, b_bits


def _check_pair(a, bits_a, b, bits_b, group_size):
    pa, sa, ba, bits_a, group_size, n_a = check_quantized(*a, bits_a, group_size, what="quant_error")
    pb, sb, bb, bits_b, group_size, n_b = check_quantized(*b, bits_b, group_size, what="quant_error")
    if pa.shape[:-1] != pb.shape[:-1] or n_a != n_b:
        raise QuantizationError(
            f"quant_error: the two tensors differ in shape: {pa.shape[:-1] + (n_a,)} vs {pb.shape[:-1] + (n_b,)}"
        )
    _check_finite_params(sa, ba, "quant_error")
    _check_finite_params(sb, bb, "quant_error")
    return (pa, sa, ba), bits_a, (pb, sb, bb), bits_b, group_size, n_a


def _seq_sum(x, axis):
    """Sum along ``axis`` strictly left to right (np.add.accumulate; np.sum is pairwise)."""
    return np.take(np.add.accumulate(x, axis=axis), -1, axis=axis)


def quant_error_ref(packed_a, scales_a, biases_a, bits_a, packed_b, scales_b, biases_b, bits_b, group_size=64):
    """-> (sum of squared differences: float, max |difference|: float, element count: int)."""
    a, bits_a, b, bits_b, group_size, n = _check_pair(
        (packed_a, scales_a, biases_a), bits_a, (packed_b, scales_b, biases_b), bits_b, group_size
    )
    fa = dequantize(*a, bits_a, group_size).reshape(-1, n // group_size, group_size)  # [rows, groups, gs]
    fb = dequantize(*b, bits_b, group_size).reshape(fa.shape)
    d = fa.astype(np.float64) - fb.astype(np.float64)
    if d.size == 0:
        return 0.0, 0.0, 0
    columns = _seq_sum(d * d, axis=1)  # [rows, group_size]: position j of every group, in group order
    rows = _seq_sum(columns, axis=1)  # [rows]
    return float(_seq_sum(rows, axis=0)), float(np.abs(d).max()), int(d.size)


# ----------------------------------------------------------------------------- numba-backed


def requantize_minmax(packed, scales, biases, src_bits, dst_bits, group_size=64):
    """Fast ``requantize_minmax_ref`` (numba, parallel): identical output."""
    packed, scales, biases, src_bits, group_size, n = check_quantized(
        packed, scales, biases, src_bits, group_size, what="requantize"
    )
    dst_bits = check_bits(dst_bits)
    _check_finite_params(scales, biases, "requantize")
    lead = packed.shape[:-1]
    s2, b2 = params_f32(scales, biases)  # [rows, groups] f32
    rows, n_groups = s2.shape
    if src_bits == 4 and dst_bits == 2 and sys.byteorder == "little":
        # every group is group_size/8 whole words; view them as uint64 pairs (16 codes each)
        src = np.ascontiguousarray(packed).reshape(rows * n_groups, group_size // 8).view(np.uint64)
        out = np.empty((rows * n_groups, group_size // 16), np.uint32)
        out_s = np.empty(rows * n_groups, np.uint16)
        out_b = np.empty(rows * n_groups, np.uint16)
        requant_4to2_groups(src, s2.reshape(-1), b2.reshape(-1), out, out_s, out_b)
    else:
        p2 = np.ascontiguousarray(packed).reshape(-1, packed.shape[-1])
        out = np.empty((rows, n * dst_bits // 32), np.uint32)
        out_s = np.empty((rows, n_groups), np.uint16)
        out_b = np.empty((rows, n_groups), np.uint16)
        requant_rows(p2, s2, b2, np.int64(src_bits), np.int64(dst_bits), np.int64(group_size), out, out_s, out_b)
    return (
        out.reshape(lead + (n * dst_bits // 32,)),
        out_s.reshape(lead + (n_groups,)),
        out_b.reshape(lead + (n_groups,)),
    )


def quant_error(packed_a, scales_a, biases_a, bits_a, packed_b, scales_b, biases_b, bits_b, group_size=64):
    """Fast ``quant_error_ref`` (numba, parallel): the same (sum_sq, max_abs, count).

    4 vs 2 bits (either way round) takes the pair-histogram path (the same max_abs and count,
    sum_sq to rounding: see the module docstring); two bit-identical tensors give
    (0.0, 0.0, count) at once; anything else gives the reference's result bit for bit."""
    a, bits_a, b, bits_b, group_size, n = _check_pair(
        (packed_a, scales_a, biases_a), bits_a, (packed_b, scales_b, biases_b), bits_b, group_size
    )
    count = int(np.prod(a[0].shape[:-1])) * n
    if count == 0:
        return 0.0, 0.0, 0
    if {bits_a, bits_b} == {4, 2} and sys.byteorder == "little":
        if bits_a == 2:  # d -> -d: the same squares and magnitudes (IEEE subtraction is antisymmetric)
            a, b = b, a
            bits_a, bits_b = 4, 2
        fast = _error_4x2(a, b, group_size)
        if fast is not None:
            return fast + (count,)
    elif bits_a == bits_b and _identical(a, b, bits_a):
        return 0.0, 0.0, count
    return _error_generic(a, bits_a, b, bits_b, group_size) + (count,)


def _error_generic(a, bits_a, b, bits_b, group_size):
    """(sum_sq, max_abs) of two validated triples, element by element (``error_rows``)."""
    pa = np.ascontiguousarray(a[0]).reshape(-1, a[0].shape[-1])
    pb = np.ascontiguousarray(b[0]).reshape(-1, b[0].shape[-1])
    sa, ba = params_f32(a[1], a[2])
    sb, bb = params_f32(b[1], b[2])
    rows = pa.shape[0]
    row_sum = np.empty(rows, np.float64)
    row_max = np.empty(rows, np.float64)
    error_rows(
        pa, sa, ba, np.int64(bits_a), pb, sb, bb, np.int64(bits_b), np.int64(group_size), row_sum, row_max
    )
    return float(_seq_sum(row_sum, axis=0)), float(row_max.max())


def _identical(a, b, bits):
    """Same words, scales and biases, and every dequantized value finite (so each difference is
    exactly 0.0, never inf - inf)."""
    if not all(np.array_equal(x, y) for x, y in zip(a, b)):
        return False
    s, bias = bf16_to_f32(a[1]), bf16_to_f32(a[2])
    bound = float(np.abs(s).max(initial=0.0)) * ((1 << bits) - 1) + float(np.abs(bias).max(initial=0.0))
    return bound < float(np.finfo(np.float32).max) / 2


def _finite_or_none(csum, cmax):
    """The chunk results of a histogram kernel -> (sum_sq, max_abs), or None where they are not
    finite: then some dequantized value overflowed float32 and the element-wise path decides."""
    total = float(_seq_sum(csum, axis=0))
    worst = float(cmax.max())
    return (total, worst) if np.isfinite(total) and np.isfinite(worst) else None


def _error_4x2(a, b, group_size):
    """(sum_sq, max_abs) of 4-bit ``a`` vs 2-bit ``b`` (validated, non-empty) by pair histograms,
    or None (see ``_finite_or_none``)."""
    x4 = np.ascontiguousarray(a[0]).reshape(-1, group_size // 8).view(np.uint64)  # [groups, gs/16]
    y2 = np.ascontiguousarray(b[0]).reshape(-1, group_size // 16).view(np.uint64)  # [groups, gs/32]
    sa, ba = params_f32(a[1], a[2])
    sb, bb = params_f32(b[1], b[2])
    n_chunks = -(-x4.shape[0] // _ECHUNK)
    csum = np.empty(n_chunks, np.float64)
    cmax = np.empty(n_chunks, np.float64)
    error_4x2_groups(x4, sa.reshape(-1), ba.reshape(-1), y2, sb.reshape(-1), bb.reshape(-1), csum, cmax)
    return _finite_or_none(csum, cmax)


def requantize_minmax_with_error(packed, scales, biases, src_bits, dst_bits, group_size=64):
    """``requantize_minmax`` and the ``quant_error`` of its result against the source, together.

    -> (packed, scales, biases, (sum_sq, max_abs, count)): the arrays identical to
    ``requantize_minmax``'s, the error identical to ``quant_error``'s (source first). 4 -> 2 bits
    is one pass (the 2-bit code is a function of the 4-bit code in each group, so a 16-bin
    histogram of the source codes gives the error); other widths run the two calls."""
    packed, scales, biases, src_bits, group_size, n = check_quantized(
        packed, scales, biases, src_bits, group_size, what="requantize"
    )
    dst_bits = check_bits(dst_bits)
    if not (src_bits == 4 and dst_bits == 2 and sys.byteorder == "little"):
        out = requantize_minmax(packed, scales, biases, src_bits, dst_bits, group_size)
        return out + (quant_error(packed, scales, biases, src_bits, *out, dst_bits, group_size),)
    _check_finite_params(scales, biases, "requantize")
    lead = packed.shape[:-1]
    s2, b2 = params_f32(scales, biases)
    rows, n_groups = s2.shape
    n_all = rows * n_groups
    src = np.ascontiguousarray(packed).reshape(n_all, group_size // 8).view(np.uint64)
    out = np.empty((n_all, group_size // 16), np.uint32)
    out_s = np.empty(n_all, np.uint16)
    out_b = np.empty(n_all, np.uint16)
    n_chunks = -(-n_all // _ECHUNK)
    csum = np.empty(n_chunks, np.float64)
    cmax = np.empty(n_chunks, np.float64)
    requant_err_4to2_groups(src, s2.reshape(-1), b2.reshape(-1), out, out_s, out_b, csum, cmax)
    result = (out.reshape(lead + (n // 16,)), out_s.reshape(lead + (n_groups,)), out_b.reshape(lead + (n_groups,)))
    if n_all == 0:
        return result + ((0.0, 0.0, 0),)
    err = _finite_or_none(csum, cmax)
    if err is None:  # as the separate calls would: raise on non-finite output params, else element-wise
        return result + (quant_error(packed, scales, biases, 4, *result, 2, group_size),)
    return result + (err + (rows * n,),)

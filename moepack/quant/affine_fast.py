"""numba fast paths: ``quantize``/``dequantize`` with the signatures and bit-exact results of
``affine_ref``, and the kernels behind ``requant.requantize_minmax``/``requant.quant_error``.

The jitted kernels work on 2-D row-major views (rows = every leading index flattened,
``[rows, in]``, or for the 4 -> 2 requant path ``[groups, words]``) and run ``prange`` without
the GIL; the Python wrappers validate, reshape and convert the bf16 parameters to float32. No
fastmath anywhere: every float operation is the float32 operation the reference performs, in
the same order (without fast-math flags LLVM neither contracts a*b+c into an fma nor
reassociates float arithmetic). ``error_model="numpy"`` only drops the zero-division check that
numba puts around ``/`` (it would block vectorization); the quotients are the IEEE ones.

Performance notes. numba runs LLVM's loop vectorizer but not the SLP vectorizer, so small
fixed-trip loops are unrolled and stay scalar: hot loops either have a constant per-word trip
(decode of one word, fully unrolled) or run over many groups at once (the requant scale and
threshold pass, which vectorizes across groups).

All jitted code lives in this one file on purpose: numba invalidates its on-disk cache per
source file and does not notice an edit to a jitted helper imported from another module.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from ..errors import QuantizationError
from .affine_ref import check_quantized, check_weights
from .bf16 import bf16_to_f32

# error_model="numpy": float division by zero gives inf/nan as in IEEE instead of a raise-check
# branch (which blocks vectorization); results of all other operations are unchanged.
_JIT = dict(nogil=True, cache=True, error_model="numpy")
_FLT_MAX = np.float32(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- helpers


@njit(**_JIT)
def bf16_bits(x):
    """float32 -> bf16 bit pattern (int64), round to nearest even, NaN -> 0x7FC0 (as bf16.f32_to_bf16)."""
    if x != x:
        return np.int64(0x7FC0)
    u = np.int64(np.float32(x).view(np.uint32))
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


@njit(**_JIT)
def bf16_value(b):
    """bf16 bit pattern -> float32."""
    return np.uint32(b << 16).view(np.float32)


@njit(**_JIT)
def decode_group(row, w0, bits, group_size, codes):
    """Codes of one group: ``group_size`` codes of ``bits`` bits from ``row[w0:]`` into ``codes``.

    Groups start on a word boundary (group_size is a multiple of 32), so for 2/4/8 bits each
    word holds 32/bits whole codes; at 3 bits the codes are read from a 64-bit accumulator.
    """
    mask = (1 << bits) - 1
    if bits == 3:
        acc = np.int64(0)
        have = 0
        wi = w0
        for j in range(group_size):
            if have < 3:
                acc |= np.int64(row[wi]) << have
                wi += 1
                have += 32
            codes[j] = acc & 7
            acc >>= 3
            have -= 3
    else:
        per = 32 // bits
        for i in range(group_size // per):
            word = np.int64(row[w0 + i])
            for k in range(per):
                codes[i * per + k] = (word >> (k * bits)) & mask


@njit(**_JIT)
def encode_group(codes, bits, group_size, row, w0):
    """Inverse of ``decode_group``: pack ``codes[:group_size]`` into ``row[w0:]``."""
    if bits == 3:
        acc = np.int64(0)
        have = 0
        wi = w0
        for j in range(group_size):
            acc |= np.int64(codes[j]) << have
            have += 3
            if have >= 32:
                row[wi] = acc & 0xFFFFFFFF
                wi += 1
                acc >>= 32
                have -= 32
    else:
        per = 32 // bits
        for i in range(group_size // per):
            word = np.int64(0)
            for k in range(per):
                word |= np.int64(codes[i * per + k]) << (k * bits)
            row[w0 + i] = word


# ----------------------------------------------------------------------------- kernels


@njit(parallel=True, **_JIT)
def _quantize_rows(w, bits, group_size, packed, scales, biases, bad):
    # w [rows, in] f32 -> packed [rows, in*bits/32] u32, scales/biases [rows, groups] u16;
    # bad[r] = 1 when row r holds a NaN or inf (then its outputs are meaningless).
    rows, n = w.shape
    n_groups = n // group_size
    words_per_group = group_size * bits // 32
    n_bins = np.float32((1 << bits) - 1)
    eps = np.float32(1e-7)
    zero = np.float32(0.0)
    for r in prange(rows):
        codes = np.empty(group_size, np.int64)
        for g in range(n_groups):
            base = g * group_size
            w_min = w[r, base]
            w_max = w_min
            finite = True
            for j in range(group_size):
                v = w[r, base + j]
                if not (abs(v) <= _FLT_MAX):
                    finite = False
                if v < w_min:
                    w_min = v
                if v > w_max:
                    w_max = v
            if not finite:
                bad[r] = 1
            side = abs(w_min) > abs(w_max)
            scale = (w_max - w_min) / n_bins
            if scale < eps:
                scale = eps
            if side:
                edge = w_min
            else:
                scale = -scale
                edge = w_max
            q0 = np.float32(np.rint(edge / scale))
            bias = zero
            if q0 != 0:
                scale = np.float32(edge / q0)
                bias = edge
            for j in range(group_size):
                q = np.float32(np.rint((w[r, base + j] - bias) / scale))
                if q < zero:
                    q = zero
                if q > n_bins:
                    q = n_bins
                codes[j] = np.int64(q)
            encode_group(codes, bits, group_size, packed[r], g * words_per_group)
            scales[r, g] = bf16_bits(scale)
            biases[r, g] = bf16_bits(bias)


@njit(inline="always", **_JIT)
def _dequantize_row_pow2(src, s_row, b_row, group_size, dst, bits):
    # bits in (2, 4, 8), a constant at every call site: the 32/bits codes of a word unroll.
    per = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    words_per_group = group_size // per
    for g in range(s_row.shape[0]):
        s = s_row[g]
        b = b_row[g]
        for w in range(g * words_per_group, (g + 1) * words_per_group):
            x = src[w]
            o = w * per
            for k in range(per):
                dst[o + k] = s * np.float32((x >> np.uint32(k * bits)) & mask) + b


@njit(**_JIT)
def _dequantize_row3(src, s_row, b_row, group_size, dst):
    # 3 bits: blocks of 3 words hold 32 codes; code i sits at stream bit 3i (may straddle words).
    blocks_per_group = group_size // 32
    for g in range(s_row.shape[0]):
        s = s_row[g]
        b = b_row[g]
        for blk in range(g * blocks_per_group, (g + 1) * blocks_per_group):
            w0 = 3 * blk
            x = np.uint64(src[w0]) | (np.uint64(src[w0 + 1]) << np.uint64(32))
            y = np.uint64(src[w0 + 2])
            o = 32 * blk
            for i in range(21):  # codes 0..20: bits 0..62 of x (code 10 straddles words 0/1)
                dst[o + i] = s * np.float32((x >> np.uint64(3 * i)) & np.uint64(7)) + b
            # code 21: bit 63 of x and bits 0-1 of y
            dst[o + 21] = s * np.float32((x >> np.uint64(63)) | ((y & np.uint64(3)) << np.uint64(1))) + b
            for i in range(22, 32):  # codes 22..31: bits 2..31 of y
                dst[o + i] = s * np.float32((y >> np.uint64(3 * i - 64)) & np.uint64(7)) + b


@njit(**_JIT)
def dequantize_row(src, s_row, b_row, bits, group_size, dst):
    """One row: words ``src`` [words] u32, ``s_row``/``b_row`` [groups] f32 -> ``dst`` [in] f32."""
    if bits == 4:
        _dequantize_row_pow2(src, s_row, b_row, group_size, dst, 4)
    elif bits == 2:
        _dequantize_row_pow2(src, s_row, b_row, group_size, dst, 2)
    elif bits == 8:
        _dequantize_row_pow2(src, s_row, b_row, group_size, dst, 8)
    else:
        _dequantize_row3(src, s_row, b_row, group_size, dst)


@njit(parallel=True, **_JIT)
def _dequantize_rows(packed, scales, biases, bits, group_size, out):
    # packed [rows, words] u32, scales/biases [rows, groups] f32 -> out [rows, in] f32
    for r in prange(packed.shape[0]):
        dequantize_row(packed[r], scales[r], biases[r], bits, group_size, out[r])


# ----------------------------------------------------------------------------- requant kernels
# (the spec, the numpy reference and the public wrappers are in requant.py)


@njit(parallel=True, **_JIT)
def requant_rows(packed, scales, biases, src_bits, dst_bits, group_size, out, out_s, out_b):
    # packed [rows, in*src_bits/32] u32, scales/biases [rows, groups] f32
    # -> out [rows, in*dst_bits/32] u32, out_s/out_b [rows, groups] u16
    rows = packed.shape[0]
    n_groups = scales.shape[1]
    src_wpg = group_size * src_bits // 32
    dst_wpg = group_size * dst_bits // 32
    n_src = 1 << src_bits
    n_bins = np.float32((1 << dst_bits) - 1)
    zero = np.float32(0.0)
    # Codes are a function of the source code alone, so when there are fewer source codes than
    # group values a table over all source codes is cheaper than one division per value.
    use_table = n_src <= group_size
    for r in prange(rows):
        src = np.empty(group_size, np.int64)
        dst = np.empty(group_size, np.int64)
        table = np.empty(n_src, np.int64)
        for g in range(n_groups):
            s = scales[r, g]
            b = biases[r, g]
            decode_group(packed[r], g * src_wpg, src_bits, group_size, src)
            q_lo = src[0]
            q_hi = src[0]
            for j in range(group_size):
                q = src[j]
                q_lo = min(q_lo, q)
                q_hi = max(q_hi, q)
            # s*q + b is monotone in q (float rounding is monotone), so the group's min and max
            # are the values of its smallest and largest codes, ordered by the sign of s.
            f_lo = s * np.float32(q_lo) + b
            f_hi = s * np.float32(q_hi) + b
            if f_lo <= f_hi:
                mn, mx = f_lo, f_hi
            else:
                mn, mx = f_hi, f_lo
            sb = bf16_bits((mx - mn) / n_bins)
            bb = bf16_bits(mn)
            s_st = bf16_value(sb)
            b_st = bf16_value(bb)
            if mx == mn or s_st == 0:
                sb = 0
                for j in range(group_size):
                    dst[j] = 0
            elif use_table:
                for q in range(n_src):
                    f = s * np.float32(q) + b
                    c = np.float32(np.rint((f - b_st) / s_st))
                    if c < zero:
                        c = zero
                    if c > n_bins:
                        c = n_bins
                    table[q] = np.int64(c)
                for j in range(group_size):
                    dst[j] = table[src[j]]
            else:
                for j in range(group_size):
                    f = s * np.float32(src[j]) + b
                    c = np.float32(np.rint((f - b_st) / s_st))
                    if c < zero:
                        c = zero
                    if c > n_bins:
                        c = n_bins
                    dst[j] = np.int64(c)
            encode_group(dst, dst_bits, group_size, out[r], g * dst_wpg)
            out_s[r, g] = sb
            out_b[r, g] = bb


# --- 4 -> 2 bits: the hot path (a 4-bit checkpoint requantized for streaming), SWAR on uint64.
#
# The destination code is a monotone function of the source code: f = s*q + b is monotone in q
# (float rounding is monotone), and so are the subtraction, the division by the positive
# stored scale, rint and the clamp. So for a group it is fixed by three thresholds
# T_k = #{q in 0..15 : rint((f(q) - b*) / s*) < k}, k = 1, 2, 3 (the clamp does not change
# these comparisons): with codes complemented (q -> 15 - q) when s < 0, the 2-bit code of q is
# [q >= T1] + [q >= T2] + [q >= T3], evaluated for 16 codes at once in a uint64 (each nibble
# spread into a byte, "q >= T" is bit 7 of q + 0x80 - T). The same argument gives the group's
# min and max from its smallest and largest code. Same results as the reference, bit for bit.

_N1 = np.uint64(0x1111111111111111)
_N8 = np.uint64(0x8888888888888888)
_B1 = np.uint64(0x0101010101010101)
_B8 = np.uint64(0x8080808080808080)
_LO4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK = 512  # groups per parallel work item


@njit(**_JIT)
def _code_range4(words, q_lo, q_hi, i):
    """Smallest and largest 4-bit code among ``words`` (uint64, 16 codes each) -> q_lo[i], q_hi[i]."""
    has0 = np.uint64(0)
    has15 = np.uint64(0)
    has14 = np.uint64(0)
    for j in range(words.shape[0]):
        x = words[j]
        has0 |= (x - _N1) & ~x & _N8  # some nibble == 0 (exact as a yes/no)
        y = ~x
        has15 |= (y - _N1) & x & _N8  # some nibble == 15
        y = x ^ np.uint64(0xEEEEEEEEEEEEEEEE)
        has14 |= (y - _N1) & ~y & _N8  # some nibble == 14
    if has0 != 0 and (has15 != 0 or has14 != 0):  # MLX-quantized groups almost always
        q_lo[i] = 0
        q_hi[i] = 15 if has15 != 0 else 14
        return
    lo = 15
    hi = 0
    for j in range(words.shape[0]):
        x = words[j]
        for k in range(16):
            q = np.int64((x >> np.uint64(4 * k)) & np.uint64(15))
            lo = min(lo, q)
            hi = max(hi, q)
    q_lo[i] = lo
    q_hi[i] = hi


@njit(inline="always", **_JIT)
def _thresholds_4to2(S, B, q_lo, q_hi, t1s, t2s, t3s, OS, OB):
    # Per group i: new scale and bias (-> OS, OB) and the thresholds T1..T3 (16 = never, for a
    # flat group), from the f32 source params S, B and the code range q_lo..q_hi (float32).
    # Branch-free so that it vectorizes over groups.
    n_bins = np.float32(3.0)
    one, two, three, zero = np.float32(1.0), np.float32(2.0), np.float32(3.0), np.float32(0.0)
    for i in range(S.shape[0]):
        s = S[i]
        b = B[i]
        f_lo = s * q_lo[i] + b
        f_hi = s * q_hi[i] + b
        mn = f_lo if f_lo < f_hi else f_hi
        mx = f_hi if f_lo < f_hi else f_lo
        u = np.float32((mx - mn) / n_bins).view(np.uint32)  # finite, >= 0: no NaN case
        sb = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        s_st = np.uint32(sb << np.uint32(16)).view(np.float32)
        u = np.float32(mn).view(np.uint32)
        bb = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        b_st = np.uint32(bb << np.uint32(16)).view(np.float32)
        flat = (mx == mn) | (s_st == zero)
        t1 = np.int32(0)
        t2 = np.int32(0)
        t3 = np.int32(0)
        for q in range(16):
            x = np.rint(((s * np.float32(q) + b) - b_st) / s_st)
            t1 += np.int32(x < one)
            t2 += np.int32(x < two)
            t3 += np.int32(x < three)
        t1s[i] = np.int32(16) if flat else t1  # flat: every code 0
        t2s[i] = np.int32(16) if flat else t2
        t3s[i] = np.int32(16) if flat else t3
        OS[i] = np.uint32(0) if flat else sb
        OB[i] = bb


@njit(inline="always", **_JIT)
def _map_4to2(src, S, t1s, t2s, t3s, out):
    # src [n, words] u64 (16 codes each) -> out [n, words] u32: each group's codes through its
    # thresholds, packed 2-bit.
    zero = np.float32(0.0)
    for i in range(src.shape[0]):
        k1 = np.uint64(0x80 - t1s[i]) * _B1
        k2 = np.uint64(0x80 - t2s[i]) * _B1
        k3 = np.uint64(0x80 - t3s[i]) * _B1
        flip = _ALL if S[i] < zero else np.uint64(0)
        words = src[i]
        dst = out[i]
        for j in range(words.shape[0]):
            x = words[j] ^ flip
            ev = x & _LO4  # codes 0, 2, 4, .. one per byte
            od = (x >> np.uint64(4)) & _LO4  # codes 1, 3, 5, ..
            e1 = (ev + k1) & _B8  # bit 7 of byte: code >= T1
            e2 = (ev + k2) & _B8
            e3 = (ev + k3) & _B8
            o1 = (od + k1) & _B8
            o2 = (od + k2) & _B8
            o3 = (od + k3) & _B8
            # 2-bit code = [>=T1]+[>=T2]+[>=T3]: low bit = xor of the three, high bit = [>=T2]
            y = (
                ((e1 ^ e2 ^ e3) >> np.uint64(7))
                | (e2 >> np.uint64(6))
                | ((o1 ^ o2 ^ o3) >> np.uint64(5))
                | (o2 >> np.uint64(4))
            )  # byte m = codes 2m, 2m+1 as 4 bits
            y = (y | (y >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
            y = (y | (y >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
            y = (y | (y >> np.uint64(16))) & np.uint64(0xFFFFFFFF)
            dst[j] = y


@njit(parallel=True, **_JIT)
def requant_4to2_groups(src, scales, biases, out, out_s, out_b):
    # src [groups, group_size/16] u64 (16 codes each); scales/biases [groups] f32
    # -> out [groups, group_size/16] u32, out_s/out_b [groups] u16
    n_groups = src.shape[0]
    for c in prange((n_groups + _CHUNK - 1) // _CHUNK):
        g0 = c * _CHUNK
        g1 = min(n_groups, g0 + _CHUNK)
        n = g1 - g0
        q_lo = np.empty(n, np.float32)
        q_hi = np.empty(n, np.float32)
        t1s = np.empty(n, np.int32)
        t2s = np.empty(n, np.int32)
        t3s = np.empty(n, np.int32)
        # 1. code range of each group
        for i in range(n):
            _code_range4(src[g0 + i], q_lo, q_hi, i)
        # 2. new scale, bias and thresholds
        _thresholds_4to2(scales[g0:g1], biases[g0:g1], q_lo, q_hi, t1s, t2s, t3s, out_s[g0:g1], out_b[g0:g1])
        # 3. map 16 codes per uint64 through the thresholds and pack them 2-bit into a uint32
        _map_4to2(src[g0:g1], scales[g0:g1], t1s, t2s, t3s, out[g0:g1])


# --- 4 vs 2 bits error: pair histograms on bit planes.
#
# An element's difference depends only on its (4-bit code, 2-bit code) pair and its group's four
# params, so a group's error is a function of its 16x4 pair histogram (requant.quant_error gives
# the summation order). Histograms are counted on bit planes: a block of 64 elements (4 uint64 of
# 4-bit codes, 2 uint64 of 2-bit codes) becomes 4 + 2 uint64 masks, plane k holding bit k of
# every element's code, element 16w + m at bit 4m + sigma(w), sigma = (0, 2, 1, 3). The 4-bit
# planes are a 4x4 bit transpose at every nibble position (24 ops); the 2-bit planes a perfect
# shuffle of 2-bit fields (codes m and 16+m side by side in nibble m) plus one delta swap. Then
# E_a, the elements with 4-bit code a, is an AND of the four planes or their complements (24 ANDs
# for all 16), and counts are popcounts: c_a = |E_a|, k0_a = |E_a & plane0|, k1_a = |E_a & plane1|.
# Where every 4-bit code of a group meets a single 2-bit code (k0_a, k1_a in {0, c_a}; always so
# for a requant output), bin (a, b_a) holds c_a and the other three bins of code a are empty:
# 16 bins, evaluated for 512 groups at a time (vectorized over groups). Other groups are redone
# from all 64 bins (_group_error_4x2), in the same bin order, hence with the same result.
# requant_err_4to2_groups needs only c_a: there the 2-bit code of a is the requant's own.

_M3 = np.uint64(0x3333333333333333)
_M5 = np.uint64(0x5555555555555555)
_ECHUNK = 512  # groups per parallel work item of the error kernels (sums are per chunk)


@intrinsic
def _popcount(typingctx, x):
    """Number of set bits of a uint64 (llvm.ctpop: one popcnt where the CPU has it)."""
    if x != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


@njit(inline="always", **_JIT)
def _planes4(x0, x1, x2, x3):
    # Rows x0..x3 (16 nibbles each) -> planes: nibble m, bit j of plane k = bit k of nibble m of
    # row j (a 4x4 bit transpose at every nibble position, as two rounds of delta swaps).
    t = ((x0 >> np.uint64(2)) ^ x2) & _M3
    x2 ^= t
    x0 ^= t << np.uint64(2)
    t = ((x1 >> np.uint64(2)) ^ x3) & _M3
    x3 ^= t
    x1 ^= t << np.uint64(2)
    t = ((x0 >> np.uint64(1)) ^ x1) & _M5
    x1 ^= t
    x0 ^= t << np.uint64(1)
    t = ((x2 >> np.uint64(1)) ^ x3) & _M5
    x3 ^= t
    x2 ^= t << np.uint64(1)
    return x0, x1, x2, x3


@njit(inline="always", **_JIT)
def _shuffle2(x):
    # Outer perfect shuffle of the 32 2-bit fields: field m (m < 16) -> 2m, field 16+m -> 2m+1.
    t = (x ^ (x >> np.uint64(16))) & np.uint64(0x00000000FFFF0000)
    x ^= t ^ (t << np.uint64(16))
    t = (x ^ (x >> np.uint64(8))) & np.uint64(0x0000FF000000FF00)
    x ^= t ^ (t << np.uint64(8))
    t = (x ^ (x >> np.uint64(4))) & np.uint64(0x00F000F000F000F0)
    x ^= t ^ (t << np.uint64(4))
    t = (x ^ (x >> np.uint64(2))) & np.uint64(0x0C0C0C0C0C0C0C0C)
    x ^= t ^ (t << np.uint64(2))
    return x


@njit(inline="always", **_JIT)
def _block_planes4(words, w0, n_words):
    # The 4-bit planes of the block of (up to) 64 codes at words[w0:w0+4] (n_words = 2: a
    # 32-code group, the missing words read as 0) and the mask of its valid bits.
    x0 = words[w0]
    x1 = words[w0 + 1]
    if n_words >= 4:
        x2 = words[w0 + 2]
        x3 = words[w0 + 3]
        v = _ALL
    else:
        x2 = np.uint64(0)
        x3 = np.uint64(0)
        v = _M5  # rows 0 and 1 sit at nibble bits sigma(0) = 0 and sigma(1) = 2
    p0, p1, p2, p3 = _planes4(x0, x2, x1, x3)  # row order = sigma^-1
    return p0, p1, p2, p3, v


@njit(inline="always", **_JIT)
def _block_planes2(words, w0, n_words):
    # The 2-bit planes of the block of (up to) 64 codes at words[w0:w0+2] (2-bit codes, 32 per
    # uint64; n_words = 1: a 32-code group), in the same element order as _block_planes4.
    r0 = _shuffle2(words[w0])  # nibble m: codes m (bits 0-1) and 16+m (bits 2-3)
    r1 = _shuffle2(words[w0 + 1]) if n_words >= 2 else np.uint64(0)  # codes 32+m, 48+m
    t = ((r0 >> np.uint64(1)) ^ r1) & _M5
    r1 ^= t
    r0 ^= t << np.uint64(1)
    return r0, r1


@njit(inline="always", **_JIT)
def _put(cnt, r, i, v, acc):
    # cnt[r, i] = v (first block of a group) or += v (later blocks)
    if acc:
        cnt[r, i] += np.int32(v)
    else:
        cnt[r, i] = np.int32(v)


@njit(inline="always", **_JIT)
def _code_masks(p0, p1, p2, p3, v):
    # The 16 masks E_a (valid elements whose code is a) from the planes of 4-bit codes, as
    # E_a = H[a >> 2] & L[a & 3]: 8 + 16 ANDs. (LLVM does not unroll a loop over a by itself.)
    n3 = v & ~p3
    h3 = v & p3
    h0 = n3 & ~p2
    h1 = n3 & p2
    h2 = h3 & ~p2
    h3 = h3 & p2
    l0 = ~p1 & ~p0
    l1 = ~p1 & p0
    l2 = p1 & ~p0
    l3 = p1 & p0
    return (
        h0 & l0, h0 & l1, h0 & l2, h0 & l3, h1 & l0, h1 & l1, h1 & l2, h1 & l3,
        h2 & l0, h2 & l1, h2 & l2, h2 & l3, h3 & l0, h3 & l1, h3 & l2, h3 & l3,
    )  # fmt: skip


@njit(inline="always", **_JIT)
def _count_code(e, q0, q1, cnt, a, i, acc):
    # code a: how many elements (row 3a), how many of them have bit 0 / bit 1 of the 2-bit code
    # set (rows 3a+1, 3a+2)
    _put(cnt, 3 * a, i, _popcount(e), acc)
    _put(cnt, 3 * a + 1, i, _popcount(e & q0), acc)
    _put(cnt, 3 * a + 2, i, _popcount(e & q1), acc)


@njit(inline="always", **_JIT)
def _accumulate(fa, fb, cnt, gsum, gmax):
    # One bin of every group: d = fa - fb; gsum += count * d^2; gmax = max(gmax, |d|) if the bin
    # is not empty. Branch-free on purpose: numba lowers a conditional expression to branches,
    # which LLVM vectorizes with masked loads and stores (microcoded, slow, on AMD). So an empty
    # bin adds 0 * d^2, exactly +0.0 when d is finite; a non-finite d anywhere makes the sum
    # inf or NaN, which the callers detect (and fall back to the element-wise path).
    for i in range(fa.shape[0]):
        d = fa[i] - fb[i]
        k = np.float64(cnt[i])
        gsum[i] += k * (d * d)
        gmax[i] = np.fmax(gmax[i], abs(d) * min(k, 1.0))


@njit(inline="always", **_JIT)
def _seq_total(x):
    # x[0] + x[1] + ... strictly in order
    total = 0.0
    for i in range(x.shape[0]):
        total += x[i]
    return total


@njit(inline="always", **_JIT)
def _count_block_4x2(xs, ys, blk, cnt, i, acc):
    # block blk of a group (4-bit words xs, 2-bit words ys) -> rows 3a, 3a+1, 3a+2 of column i
    # (acc: add to them; a constant at each call site, so the branch folds away)
    p0, p1, p2, p3, v = _block_planes4(xs, 4 * blk, xs.shape[0])
    q0, q1 = _block_planes2(ys, 2 * blk, ys.shape[0])
    E = _code_masks(p0, p1, p2, p3, v)
    _count_code(E[0], q0, q1, cnt, 0, i, acc)
    _count_code(E[1], q0, q1, cnt, 1, i, acc)
    _count_code(E[2], q0, q1, cnt, 2, i, acc)
    _count_code(E[3], q0, q1, cnt, 3, i, acc)
    _count_code(E[4], q0, q1, cnt, 4, i, acc)
    _count_code(E[5], q0, q1, cnt, 5, i, acc)
    _count_code(E[6], q0, q1, cnt, 6, i, acc)
    _count_code(E[7], q0, q1, cnt, 7, i, acc)
    _count_code(E[8], q0, q1, cnt, 8, i, acc)
    _count_code(E[9], q0, q1, cnt, 9, i, acc)
    _count_code(E[10], q0, q1, cnt, 10, i, acc)
    _count_code(E[11], q0, q1, cnt, 11, i, acc)
    _count_code(E[12], q0, q1, cnt, 12, i, acc)
    _count_code(E[13], q0, q1, cnt, 13, i, acc)
    _count_code(E[14], q0, q1, cnt, 14, i, acc)
    _count_code(E[15], q0, q1, cnt, 15, i, acc)


@njit(inline="always", **_JIT)
def _count_block_4(xs, blk, cnt, i, acc):
    # block blk of a group's 4-bit words xs -> rows 0..15 (the count of each code) of column i
    p0, p1, p2, p3, v = _block_planes4(xs, 4 * blk, xs.shape[0])
    E = _code_masks(p0, p1, p2, p3, v)
    _put(cnt, 0, i, _popcount(E[0]), acc)
    _put(cnt, 1, i, _popcount(E[1]), acc)
    _put(cnt, 2, i, _popcount(E[2]), acc)
    _put(cnt, 3, i, _popcount(E[3]), acc)
    _put(cnt, 4, i, _popcount(E[4]), acc)
    _put(cnt, 5, i, _popcount(E[5]), acc)
    _put(cnt, 6, i, _popcount(E[6]), acc)
    _put(cnt, 7, i, _popcount(E[7]), acc)
    _put(cnt, 8, i, _popcount(E[8]), acc)
    _put(cnt, 9, i, _popcount(E[9]), acc)
    _put(cnt, 10, i, _popcount(E[10]), acc)
    _put(cnt, 11, i, _popcount(E[11]), acc)
    _put(cnt, 12, i, _popcount(E[12]), acc)
    _put(cnt, 13, i, _popcount(E[13]), acc)
    _put(cnt, 14, i, _popcount(E[14]), acc)
    _put(cnt, 15, i, _popcount(E[15]), acc)


@njit(**_JIT)
def _group_error_4x2(xs, ys, s_a, b_a, s_b, b_b, pairs):
    """(sum, max) of one group from its full 16x4 pair histogram (``pairs``: scratch int64[64]),
    bins in order (a major); the same result as the vectorized path when every 4-bit code of the
    group meets a single 2-bit code (there the other bins are empty and add exactly 0)."""
    n_w4 = xs.shape[0]
    n_w2 = ys.shape[0]
    for r in range(64):
        pairs[r] = 0
    for blk in range((n_w4 + 3) // 4):
        p0, p1, p2, p3, v = _block_planes4(xs, 4 * blk, n_w4)
        q0, q1 = _block_planes2(ys, 2 * blk, n_w2)
        m = (~q0 & ~q1, q0 & ~q1, ~q0 & q1, q0 & q1)
        E = _code_masks(p0, p1, p2, p3, v)
        for a in range(16):
            for b in range(4):
                pairs[4 * a + b] += np.int64(_popcount(E[a] & m[b]))
    total = 0.0
    worst = 0.0
    for a in range(16):
        fa = np.float64(s_a * np.float32(a) + b_a)
        for b in range(4):
            k = pairs[4 * a + b]
            if k > 0:
                d = fa - np.float64(s_b * np.float32(b) + b_b)
                total += np.float64(k) * (d * d)
                ad = abs(d)
                worst = worst if worst >= ad else ad
    return total, worst


@njit(parallel=True, **_JIT)
def error_4x2_groups(x4, sa, ba, y2, sb, bb, csum, cmax):
    # x4 [groups, group_size/16] u64 (4-bit codes), y2 [groups, group_size/32] u64 (2-bit codes),
    # sa/ba/sb/bb [groups] f32 -> csum/cmax [chunks] f64: per chunk of _ECHUNK groups, the sum
    # over its groups in order of each group's sum over the bins (a, b) in order (a major) of
    # count * d^2, and the max |d| over non-empty bins; d as in error_rows.
    # Counted per 4-bit code a: c_a and how many of those have 2-bit bit 0 (k0) / bit 1 (k1)
    # set. When every code meets one 2-bit code b_a (k0, k1 in {0, c_a}: always for a requant
    # output), bin (a, b_a) holds all c_a and the other three are empty, so 16 bins vectorized
    # over groups give the sum; the other ("mixed") groups are redone from their 64 bins.
    n_groups, n_w4 = x4.shape
    n_blocks = (n_w4 + 3) // 4
    for c in prange((n_groups + _ECHUNK - 1) // _ECHUNK):
        g0 = c * _ECHUNK
        n = min(n_groups, g0 + _ECHUNK) - g0
        # rows a cache line longer than the chunk: a group's column of counts then spreads
        # over the L1 sets (a 2 KiB stride would put every row in the same two)
        cnt = np.empty((48, _ECHUNK + 16), np.int32)
        # 1. histograms (the first block of a group stores its counts, later blocks add theirs)
        for i in range(n):
            _count_block_4x2(x4[g0 + i], y2[g0 + i], 0, cnt, i, False)
            for blk in range(1, n_blocks):
                _count_block_4x2(x4[g0 + i], y2[g0 + i], blk, cnt, i, True)
        # 2. the 16 bins (a, b_a), vectorized over groups (loops this simple, or LLVM's cost
        # model refuses to vectorize them)
        SA = sa[g0 : g0 + n]
        BA = ba[g0 : g0 + n]
        SB = sb[g0 : g0 + n]
        BB = bb[g0 : g0 + n]
        fa = np.empty(n, np.float64)
        fb = np.empty(n, np.float64)
        mixed = np.zeros(n, np.int32)
        gsum = np.zeros(n, np.float64)
        gmax = np.zeros(n, np.float64)
        qb = np.empty(n, np.float32)
        for a in range(16):
            ca = cnt[3 * a, :n]
            k0 = cnt[3 * a + 1, :n]
            k1 = cnt[3 * a + 2, :n]
            for i in range(n):  # integer lanes: b_a, and whether code a meets several 2-bit codes
                c_ = ca[i]
                x0 = k0[i]
                x1 = k1[i]
                qb[i] = np.float32(np.int32(x0 > 0) + np.int32(2) * np.int32(x1 > 0))
                mixed[i] |= np.int32(np.uint32(x0 - 1) < np.uint32(c_ - 1)) | np.int32(
                    np.uint32(x1 - 1) < np.uint32(c_ - 1)
                )  # 0 < k < c_a
            for i in range(n):
                fa[i] = np.float64(SA[i] * np.float32(a) + BA[i])
                fb[i] = np.float64(SB[i] * qb[i] + BB[i])
            _accumulate(fa, fb, ca, gsum, gmax)
        # 3. mixed groups: every bin
        pairs = np.empty(64, np.int64)
        for i in range(n):
            if mixed[i] != 0:
                gsum[i], gmax[i] = _group_error_4x2(x4[g0 + i], y2[g0 + i], SA[i], BA[i], SB[i], BB[i], pairs)
        csum[c] = _seq_total(gsum)
        cmax[c] = gmax.max()


@njit(parallel=True, **_JIT)
def requant_err_4to2_groups(src, scales, biases, out, out_s, out_b, csum, cmax):
    # requant_4to2_groups plus the error of the result against the source, as error_4x2_groups
    # computes it (the same chunks and order): the 2-bit code is a function of the 4-bit code in
    # each group, so a 16-bin histogram of the 4-bit codes (bit planes again) gives the error,
    # and also the code range (smallest and largest non-empty bin) the requant needs.
    n_groups, n_words = src.shape
    n_blocks = (n_words + 3) // 4
    zero = np.float32(0.0)
    for c in prange((n_groups + _ECHUNK - 1) // _ECHUNK):
        g0 = c * _ECHUNK
        g1 = min(n_groups, g0 + _ECHUNK)
        n = g1 - g0
        cnt = np.empty((16, _ECHUNK + 16), np.int32)  # padded rows: see error_4x2_groups
        # 1. histogram of the 4-bit codes (first block stores, later blocks add)
        for i in range(n):
            _count_block_4(src[g0 + i], 0, cnt, i, False)
            for blk in range(1, n_blocks):
                _count_block_4(src[g0 + i], blk, cnt, i, True)
        # 2. code range, new scale, bias and thresholds
        q_lo = np.empty(n, np.float32)
        q_hi = np.empty(n, np.float32)
        for i in range(n):
            lo = np.float32(15.0)
            hi = np.float32(0.0)
            for a in range(16):
                k = cnt[15 - a, i]
                lo = np.float32(15 - a) if k > 0 else lo
                k = cnt[a, i]
                hi = np.float32(a) if k > 0 else hi
            q_lo[i] = lo
            q_hi[i] = hi
        t1s = np.empty(n, np.int32)
        t2s = np.empty(n, np.int32)
        t3s = np.empty(n, np.int32)
        S = scales[g0:g1]
        B = biases[g0:g1]
        OS = out_s[g0:g1]
        OB = out_b[g0:g1]
        _thresholds_4to2(S, B, q_lo, q_hi, t1s, t2s, t3s, OS, OB)
        # 3. error, vectorized over groups: bin a holds the pair (a, q2(a))
        s2 = np.empty(n, np.float32)  # the stored (bf16) scale and bias, as the runtime reads them
        b2 = np.empty(n, np.float32)
        neg = np.empty(n, np.int32)  # codes complemented (see requant_4to2_groups)
        for i in range(n):
            s2[i] = np.uint32(np.uint32(OS[i]) << np.uint32(16)).view(np.float32)
            b2[i] = np.uint32(np.uint32(OB[i]) << np.uint32(16)).view(np.float32)
            neg[i] = np.int32(S[i] < zero)
        fa = np.empty(n, np.float64)
        fb = np.empty(n, np.float64)
        gsum = np.zeros(n, np.float64)
        gmax = np.zeros(n, np.float64)
        qb = np.empty(n, np.float32)
        for a in range(16):
            for i in range(n):  # integer lanes: the 2-bit code of source code a
                q = np.int32(15 - a) if neg[i] != 0 else np.int32(a)
                qb[i] = np.float32(np.int32(q >= t1s[i]) + np.int32(q >= t2s[i]) + np.int32(q >= t3s[i]))
            for i in range(n):
                fa[i] = np.float64(S[i] * np.float32(a) + B[i])
                fb[i] = np.float64(s2[i] * qb[i] + b2[i])
            _accumulate(fa, fb, cnt[a, :n], gsum, gmax)
        csum[c] = _seq_total(gsum)
        cmax[c] = gmax.max()
        # 4. map the codes
        _map_4to2(src[g0:g1], S, t1s, t2s, t3s, out[g0:g1])


@njit(parallel=True, **_JIT)
def error_rows(pa, sa, ba, bits_a, pb, sb, bb, bits_b, group_size, row_sum, row_max):
    # pa/pb [rows, words] u32, sa/ba/sb/bb [rows, groups] f32 -> row_sum, row_max [rows] f64.
    # Summation order as requant.quant_error_ref: column j of the row's groups accumulates in
    # acc[j] in group order (an element-wise loop over j: it vectorizes), then acc[0], acc[1], ..
    n_groups = sa.shape[1]
    n = n_groups * group_size
    for r in prange(pa.shape[0]):
        fa = np.empty(n, np.float32)
        fb = np.empty(n, np.float32)
        dequantize_row(pa[r], sa[r], ba[r], bits_a, group_size, fa)
        dequantize_row(pb[r], sb[r], bb[r], bits_b, group_size, fb)
        acc = np.zeros(group_size, np.float64)
        worst = np.zeros(group_size, np.float64)
        for g in range(n_groups):
            base = g * group_size
            for j in range(group_size):
                d = np.float64(fa[base + j]) - np.float64(fb[base + j])
                acc[j] += d * d
                a = abs(d)
                worst[j] = worst[j] if worst[j] >= a else a
        total = 0.0
        for j in range(group_size):
            total += acc[j]
        row_sum[r] = total
        row_max[r] = worst.max()


# ----------------------------------------------------------------------------- public API


def quantize(w, bits, group_size=64):
    """Fast ``affine_ref.quantize``: float32 w [..., out, in] -> (packed u32, scales u16, biases u16)."""
    w, bits, group_size = check_weights(w, bits, group_size)
    lead, n = w.shape[:-1], w.shape[-1]
    w2 = np.ascontiguousarray(w).reshape(-1, n)  # [rows, in]
    rows = w2.shape[0]
    packed = np.empty((rows, n * bits // 32), np.uint32)
    scales = np.empty((rows, n // group_size), np.uint16)
    biases = np.empty((rows, n // group_size), np.uint16)
    bad = np.zeros(rows, np.uint8)
    _quantize_rows(w2, np.int64(bits), np.int64(group_size), packed, scales, biases, bad)
    if bad.any():
        raise QuantizationError("quantize: the weights contain NaN or inf", hint="the source tensor is damaged")
    return (
        packed.reshape(lead + (packed.shape[1],)),
        scales.reshape(lead + (scales.shape[1],)),
        biases.reshape(lead + (biases.shape[1],)),
    )


def params_f32(scales, biases):
    """bf16 scales/biases (any shape) -> contiguous float32 [rows, groups] arrays."""
    g = scales.shape[-1]
    return (
        np.ascontiguousarray(bf16_to_f32(scales)).reshape(-1, g),
        np.ascontiguousarray(bf16_to_f32(biases)).reshape(-1, g),
    )


def dequantize(packed, scales, biases, bits, group_size=64):
    """Fast ``affine_ref.dequantize``: -> float32 [..., out, in]."""
    packed, scales, biases, bits, group_size, n = check_quantized(packed, scales, biases, bits, group_size)
    lead = packed.shape[:-1]
    p2 = np.ascontiguousarray(packed).reshape(-1, packed.shape[-1])
    s2, b2 = params_f32(scales, biases)
    out = np.empty((p2.shape[0], n), np.float32)
    _dequantize_rows(p2, s2, b2, np.int64(bits), np.int64(group_size), out)
    return out.reshape(lead + (n,))

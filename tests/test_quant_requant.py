"""moepack.quant.requant: min-max requantization and the quantization error measure."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.errors import QuantizationError
from moepack.quant import requant as requant_mod
from moepack.quant import (
    bf16_to_f32,
    dequantize,
    f32_to_bf16,
    pack,
    quant_error,
    quant_error_ref,
    quantize,
    requantize_minmax,
    requantize_minmax_ref,
    unpack,
)
from moepack.quant.affine_fast import _ECHUNK
from moepack.quant.requant import requantize_minmax_with_error

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)


def bf16(*values):
    return f32_to_bf16(np.array(values, np.float32))


def hexes(a):
    return [f"0x{int(x):08X}" for x in np.asarray(a).ravel()]


IMPLS = [requantize_minmax_ref, requantize_minmax]
IMPL_IDS = ["ref", "numba"]


# ----------------------------------------------------------------------------- worked groups


@pytest.mark.parametrize("requant", IMPLS, ids=IMPL_IDS)
def test_worked_group_4_to_2(requant):
    # Source: one 4-bit group, scale 0.5, bias -4, codes 0..15 repeating, so f = 0.5 q - 4
    # runs -4.0 .. 3.5. mn = -4, mx = 3.5, s = 7.5 / 3 = 2.5, b = -4 (both exact in bf16:
    # 0x4020, 0xC080). Codes q2 = rint((f + 4) / 2.5) = rint(q / 5):
    #   q   0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15
    #   q2  0 0 0 1 1 1 1 1 2 2  2  2  2  3  3  3
    # 16 two-bit codes per word, code i in bits 2i..2i+1:
    #   0x40+0x100+0x400+0x1000+0x4000 (ones at 3..7) + 0x2AA0000 (twos at 8..12)
    #   + 0xFC000000 (threes at 13..15) = 0xFEAA5540, for each of the 4 words.
    src = pack(np.tile(np.arange(16, dtype=np.uint8), 4)[None], 4)  # [1, 8]
    packed, scales, biases = requant(src, bf16([0.5]), bf16([-4.0]), 4, 2, 64)
    assert hexes(packed) == ["0xFEAA5540"] * 4
    assert hexes(scales) == ["0x00004020"] and hexes(biases) == ["0x0000C080"]


@pytest.mark.parametrize("requant", IMPLS, ids=IMPL_IDS)
def test_worked_group_ties_round_half_to_even(requant):
    # scale 0.25, bias 0, codes 0..12 cycling: f = 0 .. 3, so s = 1, b = 0 and q2 = rint(f).
    # f = 0.5, 1.5, 2.5 are ties: np.rint rounds half to EVEN -> 0, 2, 2.
    #   q    0    1    2    3    4    5    6    7    8    9    10   11   12
    #   f    0   .25  .5  .75   1  1.25 1.5  1.75  2  2.25  2.5  2.75  3
    #   q2   0    0    0    1    1    1    2    2    2    2    2    3    3
    src = pack((np.arange(64) % 13).astype(np.uint8)[None], 4)
    packed, scales, biases = requant(src, bf16([0.25]), bf16([0.0]), 4, 2, 64)
    np.testing.assert_array_equal(unpack(packed, 2)[0, :13], [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3])
    assert hexes(scales) == ["0x00003F80"] and hexes(biases) == ["0x00000000"]


@pytest.mark.parametrize("requant", IMPLS, ids=IMPL_IDS)
def test_flat_groups(requant):
    # row 0: scale 0, so every value is the bias 1.25 (max == min);
    # row 1: codes 7 only with a nonzero scale: max == min again (f = 0.5*7 - 1 = 2.5);
    # row 2: values 0 and the smallest bf16 subnormal (9.2e-41): max > min, but
    #        s = 9.2e-41 / 3 rounds to bf16 0 -> flat as well (no division by zero).
    # Expected for each: codes 0, scale 0 (0x0000), bias = bf16(the minimum).
    codes = np.zeros((3, 64), np.uint8)
    codes[0] = np.arange(64) % 16
    codes[1] = 7
    codes[2, ::2] = 1
    src = pack(codes, 4)
    scales = np.array([[0x0000], [0x3F00], [0x0001]], np.uint16)  # 0, 0.5, 9.2e-41
    biases = np.array([[0x3FA0], [0xBF80], [0x0000]], np.uint16)  # 1.25, -1, 0
    packed, s2, b2 = requant(src, scales, biases, 4, 2, 64)
    assert not packed.any()
    assert hexes(s2) == ["0x00000000"] * 3
    assert hexes(b2) == ["0x00003FA0", "0x00004020", "0x00000000"]
    out = dequantize(packed, s2, b2, 2, 64)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[:2], np.array([[1.25], [2.5]], np.float32).repeat(64, 1))


# ----------------------------------------------------------------------------- quality


def _source(rng, shape, bits, group_size, spread=0.02):
    w = (rng.standard_normal(shape) * spread).astype(np.float32)
    return quantize(w, bits, group_size)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_requant_codes_are_optimal_and_error_plausible(group_size):
    rng = np.random.default_rng(group_size)
    src = _source(rng, (4, 32, 256), 4, group_size)
    packed, scales, biases = requantize_minmax(*src, 4, 2, group_size)

    f = dequantize(*src, 4, group_size).astype(np.float64).reshape(4, 32, -1, group_size)
    s = bf16_to_f32(scales).astype(np.float64)[..., None]
    b = bf16_to_f32(biases).astype(np.float64)[..., None]
    q = unpack(packed, 2).reshape(f.shape).astype(np.float64)
    # per element: no code in 0..3 reconstructs f better than the chosen one (beyond float eps)
    err_chosen = np.abs(s * q + b - f)
    err_best = np.min([np.abs(s * k + b - f) for k in range(4)], axis=0)
    tol = 4 * np.finfo(np.float32).eps * (np.abs(f) + np.abs(b) + 3 * s)
    assert (err_chosen - err_best <= tol).all()
    # ... hence within half a step of the grid, plus what bf16 rounding of s and b moved the ends
    mn, mx = f.min(-1, keepdims=True), f.max(-1, keepdims=True)
    assert (err_chosen <= 0.5 * s + 2.0**-8 * (np.abs(mn) + np.abs(mx)) + tol).all()

    sum_sq, max_abs, count = quant_error(*src, 4, packed, scales, biases, 2, group_size)
    assert count == f.size
    rmse = np.sqrt(sum_sq / count)
    assert max_abs == pytest.approx(err_chosen.max(), rel=1e-6)
    # Uniform rounding on a grid of step s2 gives RMSE ~ s2/sqrt(12). With s2 = 5 * s4 (range/3 vs
    # range/15) that is ~1.44 * the 4-bit scale, so "RMSE < the 4-bit scale" cannot hold; check
    # the rounding-noise figure instead, and that it is well under half a 2-bit step.
    s2_mean = s.mean()
    s4_mean = np.abs(bf16_to_f32(src[1])).mean()
    assert 0.8 * s2_mean / np.sqrt(12) < rmse < 1.2 * s2_mean / np.sqrt(12)
    assert rmse < 0.5 * s2_mean and rmse < 2 * s4_mean


def test_requant_to_more_bits_is_exact_when_grids_nest():
    # scale 17, bias 0, codes 0..15: f = 17 q spans 0..255, so at 8 bits s = 255/255 = 1 and
    # b = 0 (both exact) and every value is a grid point: q8 = 17 q, no error.
    codes = np.tile(np.arange(16, dtype=np.uint8), 4)[None]
    for requant in IMPLS:
        out = requant(pack(codes, 4), bf16([17.0]), bf16([0.0]), 4, 8, 64)
        np.testing.assert_array_equal(unpack(out[0], 8), 17 * codes)
        assert quant_error(pack(codes, 4), bf16([17.0]), bf16([0.0]), 4, *out, 8, 64) == (0.0, 0.0, 64)


# ----------------------------------------------------------------------------- numba == numpy


def _mixed_source(rng, shape, bits, group_size):
    """Random words and bf16 scales of both signs, with some groups of narrow code range."""
    rows, n = int(np.prod(shape[:-1])), shape[-1]
    codes = rng.integers(0, 2**bits, size=(rows, n), dtype=np.uint8)
    g = group_size
    narrow = [
        lambda: rng.integers(3, 10, g),  # codes 3..9 only
        lambda: np.full(g, 5),  # one code
        lambda: rng.integers(0, 2**bits - 1, g),  # no top code
        lambda: rng.integers(1, 2**bits, g),  # no code 0
        lambda: np.where(np.arange(g) % 2 == 0, 0, 2**bits - 2),  # 0 and top-1
    ]
    for row, make in zip(codes, narrow):
        row[:g] = np.minimum(make(), 2**bits - 1)
    gshape = shape[:-1] + (n // group_size,)
    scales = (rng.standard_normal(gshape) * 0.01).astype(np.float32)
    scales.reshape(-1)[::7] = 0  # some zero scales
    biases = (rng.standard_normal(gshape) * 0.05).astype(np.float32)
    packed = pack(codes, bits).reshape(shape[:-1] + (n * bits // 32,))
    return packed, f32_to_bf16(scales), f32_to_bf16(biases)


@pytest.mark.parametrize("src_bits", BITS)
def test_fast_requant_matches_reference(src_bits):
    rng = np.random.default_rng(src_bits)
    for shape in [(6, 128), (2, 5, 256), (3, 1, 2, 384)]:
        for group_size in GROUP_SIZES:
            if shape[-1] % group_size:
                continue
            sources = [_mixed_source(rng, shape, src_bits, group_size)]
            sources.append(_source(rng, shape, src_bits, group_size))  # MLX-like: code 0 always present
            for src in sources:
                for dst_bits in BITS:
                    ref = requantize_minmax_ref(*src, src_bits, dst_bits, group_size)
                    fast = requantize_minmax(*src, src_bits, dst_bits, group_size)
                    ctx = f"{src_bits}->{dst_bits} gs={group_size} shape={shape}"
                    for a, b in zip(ref, fast):
                        assert a.dtype == b.dtype and a.shape == b.shape, ctx
                        np.testing.assert_array_equal(a, b, err_msg=ctx)
                    e_ref = quant_error_ref(*src, src_bits, *ref, dst_bits, group_size)
                    e_fast = quant_error(*src, src_bits, *fast, dst_bits, group_size)
                    _assert_error_matches(e_fast, e_ref, (src_bits, dst_bits), ctx)
                    assert type(e_fast[0]) is float and type(e_fast[1]) is float and type(e_fast[2]) is int


def _assert_error_matches(fast, ref, bits, ctx=""):
    """quant_error's result vs the reference: 4 vs 2 bits sums in another order (rel 1e-12),
    everything else is bit for bit; max_abs and count are always exact."""
    if sorted(bits) == [2, 4]:
        assert fast[0] == pytest.approx(ref[0], rel=1e-12, abs=0.0), ctx
        assert fast[1:] == ref[1:], ctx
    else:
        assert fast == ref, ctx
    assert type(fast[0]) is float and type(fast[1]) is float and type(fast[2]) is int


def test_quant_error_values():
    rng = np.random.default_rng(5)
    a = _source(rng, (3, 4, 256), 4, 64)
    b = requantize_minmax(*a, 4, 3, 64)
    for fn in (quant_error, quant_error_ref):
        assert fn(*a, 4, *a, 4, 64) == (0.0, 0.0, 3 * 4 * 256)
        sum_sq, max_abs, count = fn(*a, 4, *b, 3, 64)
        d = dequantize(*a, 4, 64).astype(np.float64) - dequantize(*b, 3, 64).astype(np.float64)
        assert count == d.size
        assert sum_sq == pytest.approx(np.sum(d * d), rel=1e-12)
        assert max_abs == np.abs(d).max()
        assert fn(*b, 3, *a, 4, 64) == (sum_sq, max_abs, count)  # symmetric


# ----------------------------------------------------------------------------- 4 vs 2 bits: pair histograms


def test_worked_group_error_4_to_2():
    # The worked 4 -> 2 group above: f = 0.5 q - 4, f2 = 2.5 q2 - 4, so d = 0.5 q - 2.5 q2:
    #   q   0  1  2  3   4  5  6  7  8   9  10 11 12 13  14 15
    #   q2  0  0  0  1   1  1  1  1  2   2  2  2  2  3   3  3
    #   d   0 .5  1 -1 -.5  0 .5  1 -1 -.5  0 .5  1 -1 -.5  0
    # sum d^2 = 4 * 1 + 6 * 0.25 + ... = 7.5 per 16 codes, 30 over the group; max |d| = 1.
    src = (pack(np.tile(np.arange(16, dtype=np.uint8), 4)[None], 4), bf16([0.5]), bf16([-4.0]))
    out = requantize_minmax(*src, 4, 2, 64)
    assert quant_error_ref(*src, 4, *out, 2, 64) == (30.0, 1.0, 64)
    assert quant_error(*src, 4, *out, 2, 64) == (30.0, 1.0, 64)
    assert quant_error(*out, 2, *src, 4, 64) == (30.0, 1.0, 64)
    *arrs, err = requantize_minmax_with_error(*src, 4, 2, 64)
    assert err == (30.0, 1.0, 64)
    for a, b in zip(arrs, out):
        np.testing.assert_array_equal(a, b)


def _scramble(rng, packed, fraction):
    """A copy of 2-bit ``packed`` with about ``fraction`` of its words replaced by random ones: the
    groups they fall in pair a 4-bit code with several 2-bit codes (the "mixed" path)."""
    out = packed.copy()
    hit = rng.random(out.shape) < fraction
    out[hit] = rng.integers(0, 2**32, size=int(hit.sum()), dtype=np.uint32)
    return out


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quant_error_4x2_matches_reference(group_size):
    rng = np.random.default_rng(100 + group_size)
    for shape in [(2, 3, 256), (7, 384), (1, 1, 2 * group_size)]:
        sources = [_mixed_source(rng, shape, 4, group_size), _source(rng, shape, 4, group_size)]
        for k, src in enumerate(sources):
            two = requantize_minmax(*src, 4, 2, group_size)
            others = [
                two,  # a requant: every 4-bit code meets one 2-bit code
                (_scramble(rng, two[0], 0.2), two[1], two[2]),  # some mixed groups
                (rng.integers(0, 2**32, size=two[0].shape, dtype=np.uint32), two[1], two[2]),  # all mixed
                _mixed_source(rng, shape, 2, group_size),  # unrelated codes and params
            ]
            for j, b in enumerate(others):
                ctx = f"gs={group_size} shape={shape} source {k} other {j}"
                ref = quant_error_ref(*src, 4, *b, 2, group_size)
                fast = quant_error(*src, 4, *b, 2, group_size)
                _assert_error_matches(fast, ref, (4, 2), ctx)
                assert quant_error(*b, 2, *src, 4, group_size) == fast, ctx  # exactly symmetric


def test_quant_error_4x2_many_chunks():
    # more groups than one parallel work item (and not a multiple of it): the chunk sums
    rng = np.random.default_rng(7)
    src = _source(rng, (3, 65, 1024), 4, 64)
    n_groups = 3 * 65 * 1024 // 64
    assert n_groups > 2 * _ECHUNK and n_groups % _ECHUNK
    two = requantize_minmax(*src, 4, 2, 64)
    ref = quant_error_ref(*src, 4, *two, 2, 64)
    _assert_error_matches(quant_error(*src, 4, *two, 2, 64), ref, (4, 2))
    _assert_error_matches(requantize_minmax_with_error(*src, 4, 2, 64)[3], ref, (4, 2))


@pytest.mark.parametrize("bits", BITS)
def test_quant_error_identical_tensors(bits):
    rng = np.random.default_rng(bits)
    a = _mixed_source(rng, (3, 256), bits, 64)
    assert quant_error(*a, bits, *a, bits, 64) == quant_error_ref(*a, bits, *a, bits, 64) == (0.0, 0.0, 768)
    b = (a[0], a[1], a[2].copy())
    b[2][1, 2] ^= 1  # one bias differs: the element-wise path, bit for bit with the reference
    assert quant_error(*a, bits, *b, bits, 64) == quant_error_ref(*a, bits, *b, bits, 64)


def test_quant_error_4x2_non_finite_falls_back():
    # Scale 2^127 (bf16 0x7F00): codes 0 and 1 give 0 and 1.7e38, but code 15 would give inf. In
    # row 0 no element has code 15, so every difference is finite, yet the histogram paths'
    # empty bin 15 (0 * inf) makes their sum NaN: they hand over to the element-wise path. Row 1
    # of the other 2-bit tensor is compared against code 15 itself: the true sum is inf.
    codes = np.zeros((2, 64), np.uint8)
    codes[0, 1::2] = 1
    codes[1, 1::2] = 15
    huge = np.array([[0x7F00], [0x7F00]], np.uint16)
    zero = np.zeros((2, 1), np.uint16)
    src = (pack(codes[:1], 4), huge[:1], zero[:1])
    two = requantize_minmax(*src, 4, 2, 64)
    generic = requant_mod._error_generic(src, 4, two, 2, 64) + (64,)
    assert np.isfinite(generic[0]) and generic == quant_error_ref(*src, 4, *two, 2, 64)
    assert quant_error(*src, 4, *two, 2, 64) == generic
    assert requantize_minmax_with_error(*src, 4, 2, 64)[3] == generic

    src = (pack(codes, 4), huge, zero)
    other = (np.zeros((2, 4), np.uint32), bf16([1.0], [1.0]).reshape(2, 1), zero)
    generic = requant_mod._error_generic(src, 4, other, 2, 64) + (128,)
    assert generic[0] == np.inf
    np.testing.assert_equal(quant_error(*src, 4, *other, 2, 64), generic)
    with pytest.raises(QuantizationError, match="NaN or inf"):  # as quant_error on requantize_minmax's output
        requantize_minmax_with_error(*src, 4, 2, 64)


def test_quant_error_empty():
    z = (np.zeros((0, 8), np.uint32), np.zeros((0, 1), np.uint16), np.zeros((0, 1), np.uint16))
    z2 = (np.zeros((0, 4), np.uint32), z[1], z[2])
    assert quant_error(*z, 4, *z2, 2, 64) == (0.0, 0.0, 0)
    packed, scales, biases, err = requantize_minmax_with_error(*z, 4, 2, 64)
    assert packed.shape == (0, 4) and scales.shape == biases.shape == (0, 1) and err == (0.0, 0.0, 0)


# ----------------------------------------------------------------------------- requant + error in one pass


@pytest.mark.parametrize("src_bits", BITS)
def test_requantize_with_error_matches_separate_calls(src_bits):
    rng = np.random.default_rng(200 + src_bits)
    for shape in [(6, 128), (2, 3, 256)]:
        for group_size in GROUP_SIZES:
            if shape[-1] % group_size:
                continue
            for src in (_mixed_source(rng, shape, src_bits, group_size), _source(rng, shape, src_bits, group_size)):
                for dst_bits in BITS:
                    ctx = f"{src_bits}->{dst_bits} gs={group_size} shape={shape}"
                    *arrs, err = requantize_minmax_with_error(*src, src_bits, dst_bits, group_size)
                    sep = requantize_minmax(*src, src_bits, dst_bits, group_size)
                    for a, b in zip(arrs, sep):
                        assert a.dtype == b.dtype and a.shape == b.shape, ctx
                        np.testing.assert_array_equal(a, b, err_msg=ctx)
                    # the one-pass error is quant_error's, to the last bit (same bins, same order) ...
                    assert err == quant_error(*src, src_bits, *sep, dst_bits, group_size), ctx
                    # ... so the reference's to rounding
                    ref = quant_error_ref(*src, src_bits, *sep, dst_bits, group_size)
                    _assert_error_matches(err, ref, (src_bits, dst_bits), ctx)


def test_requantize_with_error_non_contiguous():
    rng = np.random.default_rng(9)
    src = _source(rng, (4, 8, 256), 4, 64)
    view = tuple(x[::2, :, :] for x in src)  # every other expert: not contiguous
    copy = tuple(np.ascontiguousarray(x) for x in view)
    *arrs, err = requantize_minmax_with_error(*view, 4, 2, 64)
    *arrs_c, err_c = requantize_minmax_with_error(*copy, 4, 2, 64)
    assert err == err_c == quant_error(*view, 4, *arrs, 2, 64)
    for a, b in zip(arrs, arrs_c):
        np.testing.assert_array_equal(a, b)


def test_requantize_with_error_validates():
    src = quantize(np.zeros((2, 128), np.float32), 4, 64)
    with pytest.raises(QuantizationError, match="bit width"):
        requantize_minmax_with_error(*src, 4, 1, 64)
    with pytest.raises(QuantizationError, match="group size"):
        requantize_minmax_with_error(*src, 4, 2, 96)
    bad = src[1].copy()
    bad[0, 0] = 0x7F80  # inf scale
    with pytest.raises(QuantizationError, match="NaN or inf"):
        requantize_minmax_with_error(src[0], bad, src[2], 4, 2, 64)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("requant", IMPLS, ids=IMPL_IDS)
def test_requant_errors(requant):
    src = quantize(np.zeros((2, 128), np.float32), 4, 64)
    with pytest.raises(QuantizationError, match="bit width"):
        requant(*src, 4, 1, 64)
    with pytest.raises(QuantizationError, match="bit width"):
        requant(*src, 6, 2, 64)
    with pytest.raises(QuantizationError, match="group size"):
        requant(*src, 4, 2, 96)
    with pytest.raises(QuantizationError, match="scales must be uint16"):
        requant(src[0], bf16_to_f32(src[1]), src[2], 4, 2, 64)
    with pytest.raises(QuantizationError, match="expected"):
        requant(src[0], src[1][:, :1], src[2], 4, 2, 64)
    bad = src[1].copy()
    bad[1, 1] = 0x7FC0  # NaN scale
    with pytest.raises(QuantizationError, match="NaN or inf"):
        requant(src[0], bad, src[2], 4, 2, 64)


@pytest.mark.parametrize("fn", [quant_error_ref, quant_error], ids=IMPL_IDS)
def test_quant_error_errors(fn):
    a = quantize(np.zeros((2, 128), np.float32), 4, 64)
    b = quantize(np.zeros((3, 128), np.float32), 4, 64)
    with pytest.raises(QuantizationError, match="differ in shape"):
        fn(*a, 4, *b, 4, 64)
    with pytest.raises(QuantizationError, match="bit width"):
        fn(*a, 4, *a, 7, 64)
    with pytest.raises(QuantizationError, match="packed weights must be uint32"):
        fn(a[0].view(np.float32), a[1], a[2], 4, *a, 4, 64)

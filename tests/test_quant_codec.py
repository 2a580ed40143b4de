"""moepack.quant codec: bf16 rounding, bit packing, MLX affine quantize/dequantize (numpy + numba)."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.errors import QuantizationError
from moepack.quant import affine_fast, affine_ref
from moepack.quant import bf16_to_f32, f32_to_bf16, pack, unpack

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)


def u32(*words):
    return np.array(words, dtype=np.uint32)


def hexes(a):
    return [f"0x{int(x):08X}" for x in np.asarray(a).ravel()]


@pytest.fixture(scope="module")
def mx():
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed: MLX parity tests need `pip install mlx[cpu]`")
    return mx


# ----------------------------------------------------------------------------- bf16


def test_bf16_rounding_by_hand():
    cases = {
        0x3F800000: 0x3F80,  # 1.0 exact
        0x3F808000: 0x3F80,  # tie, kept bit even -> down
        0x3F818000: 0x3F82,  # tie, kept bit odd -> up
        0x3F808001: 0x3F81,  # above the tie -> up
        0x3F807FFF: 0x3F80,  # below the tie -> down
        0x7F7FFFFF: 0x7F80,  # largest float32 rounds to +inf
        0x7F800000: 0x7F80,  # +inf
        0xFF800000: 0xFF80,  # -inf
        0x00018000: 0x0002,  # subnormal, tie -> even (no flush to zero)
        0x80000000: 0x8000,  # -0.0 keeps its sign
        0x7FC00000: 0x7FC0,  # NaN
        0xFFC00001: 0x7FC0,  # -NaN with payload -> canonical NaN
        0x7F800001: 0x7FC0,  # signalling NaN -> canonical NaN
    }
    x = np.array(list(cases), dtype=np.uint32).view(np.float32)
    assert hexes(f32_to_bf16(x)) == hexes(np.array(list(cases.values()), dtype=np.uint32))
    back = bf16_to_f32(np.array([0x3F80, 0xC170, 0x0001], dtype=np.uint16))
    assert back.dtype == np.float32
    assert back[0] == 1.0 and back[1] == -15.0 and back.view(np.uint32)[2] == 0x00010000
    assert f32_to_bf16(np.float32(1.5)) == 0x3FC0  # 0-d works


def test_bf16_matches_mlx_cast(mx):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    expect = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(f32_to_bf16(x), expect)
    b = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    finite = np.isfinite(bf16_to_f32(b))
    expect_f = np.array(mx.array(b).view(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(bf16_to_f32(b)[finite].view(np.uint32), expect_f[finite].view(np.uint32))


# ----------------------------------------------------------------------------- packing by hand


def test_pack_4bit_by_hand():
    # 64 codes 0,1,..,15,0,1,..: code i of a word sits in bits 4i..4i+3, so the words are
    # 0x76543210 (codes 0..7) and 0xFEDCBA98 (codes 8..15), four times over.
    codes = np.tile(np.arange(16, dtype=np.uint8), 4)
    assert hexes(pack(codes, 4)) == ["0x76543210", "0xFEDCBA98"] * 4
    np.testing.assert_array_equal(unpack(pack(codes, 4), 4), codes)


def test_pack_2bit_by_hand():
    # codes 0,1,2,3 repeating: each byte is 0b11_10_01_00 = 0xE4, 16 codes per word -> 0xE4E4E4E4.
    codes = np.tile(np.arange(4, dtype=np.uint8), 16)
    assert hexes(pack(codes, 2)) == ["0xE4E4E4E4"] * 4
    # 3,2,1,0 repeating: 0b00_01_10_11 = 0x1B per byte
    assert hexes(pack(codes[::-1].copy(), 2)) == ["0x1B1B1B1B"] * 4


def test_pack_3bit_by_hand():
    # 3 bits: one bit stream, little end first. Codes 0..7 take 24 bits:
    # 0 | 1<<3 | 2<<6 | 3<<9 | 4<<12 | 5<<15 | 6<<18 | 7<<21 = 0xFAC688 -> bytes 88 C6 FA.
    # Bytes 88 C6 FA 88 | C6 FA 88 C6 | FA 88 C6 FA read as little-endian words:
    codes = np.tile(np.arange(8, dtype=np.uint8), 8)  # 64 codes = 192 bits = 6 words
    assert hexes(pack(codes, 3)) == ["0x88FAC688", "0xC688FAC6", "0xFAC688FA"] * 2
    np.testing.assert_array_equal(unpack(pack(codes, 3), 3), codes)


def test_pack_8bit_by_hand():
    assert hexes(pack(np.array([1, 2, 3, 4, 0xAA, 0xBB, 0xCC, 0xFF], np.uint8), 8)) == ["0x04030201", "0xFFCCBBAA"]


@pytest.mark.parametrize("bits", BITS)
def test_pack_roundtrip_batched(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(2, 3, 96), dtype=np.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (2, 3, 96 * bits // 32) and packed.dtype == np.uint32
    np.testing.assert_array_equal(unpack(packed, bits), codes)


# ----------------------------------------------------------------------------- quantize by hand


@pytest.mark.parametrize("impl", [affine_ref, affine_fast], ids=["ref", "numba"])
def test_quantize_one_group_by_hand(impl):
    # w = 0,1,..,15 repeating: |min| = 0 is not > |max| = 15, so MLX anchors code 0 on the max
    # with a NEGATIVE scale: scale = -(15-0)/15 = -1, q0 = rint(15 / -1) = -15, scale = 15/-15
    # = -1, bias = 15, q = (w - 15) / -1 = 15 - w: codes 15..0 -> words 0x89ABCDEF, 0x01234567.
    w = np.tile(np.arange(16, dtype=np.float32), 4)[None]  # [1, 64]
    packed, scales, biases = impl.quantize(w, 4, 64)
    assert hexes(packed) == ["0x89ABCDEF", "0x01234567"] * 4
    assert hexes(scales) == ["0x0000BF80"]  # bf16 -1.0
    assert hexes(biases) == ["0x00004170"]  # bf16 15.0
    np.testing.assert_array_equal(impl.dequantize(packed, scales, biases, 4, 64), w)

    # w - 15 = -15..0: |min| > |max|, positive scale 1, bias -15, codes = w: 0x76543210, 0xFEDCBA98.
    packed, scales, biases = impl.quantize(w - 15, 4, 64)
    assert hexes(packed) == ["0x76543210", "0xFEDCBA98"] * 4
    assert hexes(scales) == ["0x00003F80"] and hexes(biases) == ["0x0000C170"]


@pytest.mark.parametrize("impl", [affine_ref, affine_fast], ids=["ref", "numba"])
def test_quantize_flat_groups(impl):
    # all zero: scale is clamped to 1e-7 and negated (ties take the max side), q0 = rint(0) = 0,
    # so bias = 0 and every code 0; stored scale = bf16(-1e-7) = 0xB3D7.
    # constant -3.5: scale -1e-7, q0 = 35000000 != 0 -> bias = edge = -3.5, codes 0.
    w = np.stack([np.zeros(64, np.float32), np.full(64, -3.5, np.float32)])
    packed, scales, biases = impl.quantize(w, 4, 64)
    assert not packed.any()
    assert hexes(scales) == ["0x0000B3D7"] * 2
    assert hexes(biases) == ["0x00000000", "0x0000C060"]
    out = impl.dequantize(packed, scales, biases, 4, 64)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, w)


# ----------------------------------------------------------------------------- MLX parity


def _edge_weights(rng, shape, group_size, scale):
    """Random normal weights; the first group of each of the first rows is a special case."""
    w = (rng.standard_normal(shape) * scale).astype(np.float32)
    rows = w.reshape(-1, shape[-1])  # a view: writes go to w
    g = group_size
    special = [
        np.zeros(g),  # all zero
        np.full(g, -0.75 * scale),  # constant
        np.where(np.arange(g) == 5, 40 * scale, rng.standard_normal(g) * scale * 1e-3),  # one outlier
        np.where(np.arange(g) == 7, -30 * scale, -np.abs(rng.standard_normal(g)) * scale),  # all negative
        np.abs(rng.standard_normal(g)) * scale,  # all positive
        rng.standard_normal(g) * 1e-9,  # range below MLX's 1e-7 scale floor
        np.full(g, 1e-8),  # tiny constant
        (np.arange(g) % 7) - 3.0,  # small integers
    ]
    for row, values in zip(rows, special):
        row[:g] = values
    return w


def _mlx_bits(mx, arr):
    return np.array(arr.astype(mx.bfloat16).view(mx.uint16))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quantize_matches_mlx(mx, bits, group_size):
    rng = np.random.default_rng(100 * bits + group_size)
    for scale in (1e-3, 0.05, 30.0):
        w = _edge_weights(rng, (2, 8, 256), group_size, scale)  # stacked [E, out, in]
        for as_bf16 in (False, True):
            x = mx.array(w)
            if as_bf16:  # what mlx-lm quantizes when converting a bf16 checkpoint
                x = x.astype(mx.bfloat16)
            q, s, b = mx.quantize(x, group_size=group_size, bits=bits, stream=mx.cpu)
            wf = np.array(x.astype(mx.float32))  # the bf16 values, exactly, as float32
            for impl in (affine_ref, affine_fast):
                packed, scales, biases = impl.quantize(wf, bits, group_size)
                ctx = f"{impl.__name__} bits={bits} gs={group_size} scale={scale} bf16={as_bf16}"
                np.testing.assert_array_equal(packed, np.array(q), err_msg=ctx)
                np.testing.assert_array_equal(scales, _mlx_bits(mx, s), err_msg=ctx)
                np.testing.assert_array_equal(biases, _mlx_bits(mx, b), err_msg=ctx)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_dequantize_matches_mlx(mx, bits, group_size):
    rng = np.random.default_rng(7 * bits + group_size)
    shape = (3, 4, 256)
    packed = rng.integers(0, 2**32, size=shape[:-1] + (256 * bits // 32,), dtype=np.uint32)  # every code
    gshape = shape[:-1] + (256 // group_size,)
    scales = f32_to_bf16((rng.standard_normal(gshape) * 0.02).astype(np.float32))
    biases = f32_to_bf16((rng.standard_normal(gshape) * 0.1).astype(np.float32))
    scales[0, 0, 0] = 0  # zero scale
    expect = mx.dequantize(
        mx.array(packed),
        mx.array(bf16_to_f32(scales)),
        mx.array(bf16_to_f32(biases)),
        group_size=group_size,
        bits=bits,
        stream=mx.cpu,
    )
    expect = np.array(expect)
    for impl in (affine_ref, affine_fast):
        got = impl.dequantize(packed, scales, biases, bits, group_size)
        assert got.dtype == np.float32 and got.shape == shape
        np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32), err_msg=impl.__name__)


# ----------------------------------------------------------------------------- numba == numpy


SHAPES = [(1, 128), (3, 256), (2, 3, 384), (2, 1, 2, 128)]


@pytest.mark.parametrize("bits", BITS)
def test_fast_matches_reference(bits):
    rng = np.random.default_rng(bits)
    for shape in SHAPES:
        for group_size in GROUP_SIZES:
            if shape[-1] % group_size:
                continue
            w = _edge_weights(rng, shape, group_size, 0.1)
            ref = affine_ref.quantize(w, bits, group_size)
            fast = affine_fast.quantize(w, bits, group_size)
            for a, b in zip(ref, fast):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)
            d_ref = affine_ref.dequantize(*ref, bits, group_size)
            d_fast = affine_fast.dequantize(*ref, bits, group_size)
            np.testing.assert_array_equal(d_ref.view(np.uint32), d_fast.view(np.uint32))


def test_fast_accepts_non_contiguous_input():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 6)).astype(np.float32).T  # [6, 256], Fortran order
    for a, b in zip(affine_ref.quantize(w, 4, 64), affine_fast.quantize(w, 4, 64)):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", [affine_ref, affine_fast], ids=["ref", "numba"])
def test_quantize_errors(impl):
    w = np.zeros((4, 128), np.float32)
    for bits in (1, 5, 6, 7, 16, 0, "4", 4.0, True):
        with pytest.raises(QuantizationError, match="bit width"):
            impl.quantize(w, bits, 64)
    for gs in (16, 48, 256, 0, -64, 64.0):
        with pytest.raises(QuantizationError, match="group size"):
            impl.quantize(w, 4, gs)
    with pytest.raises(QuantizationError, match="does not divide the input dimension 96"):
        impl.quantize(np.zeros((4, 96), np.float32), 4, 64)
    with pytest.raises(QuantizationError, match="input dimension is 0"):
        impl.quantize(np.zeros((4, 0), np.float32), 4, 64)
    with pytest.raises(QuantizationError, match="float32"):
        impl.quantize(w.astype(np.float64), 4, 64)
    with pytest.raises(QuantizationError, match="float32"):
        impl.quantize(w.view(np.uint32), 4, 64)
    with pytest.raises(QuantizationError, match="shape"):
        impl.quantize(np.zeros(128, np.float32), 4, 64)
    bad = w.copy()
    bad[2, 5] = np.nan
    with pytest.raises(QuantizationError, match="NaN or inf"):
        impl.quantize(bad, 4, 64)
    bad[2, 5] = -np.inf
    with pytest.raises(QuantizationError, match="NaN or inf"):
        impl.quantize(bad, 4, 64)


@pytest.mark.parametrize("impl", [affine_ref, affine_fast], ids=["ref", "numba"])
def test_dequantize_errors(impl):
    packed, scales, biases = affine_ref.quantize(np.zeros((4, 128), np.float32), 4, 64)
    with pytest.raises(QuantizationError, match="bit width"):
        impl.dequantize(packed, scales, biases, 5, 64)
    with pytest.raises(QuantizationError, match="packed weights must be uint32"):
        impl.dequantize(packed.astype(np.int64), scales, biases, 4, 64)
    with pytest.raises(QuantizationError, match="scales must be uint16"):
        impl.dequantize(packed, bf16_to_f32(scales), biases, 4, 64)
    with pytest.raises(QuantizationError, match="biases must be uint16"):
        impl.dequantize(packed, scales, biases.astype(np.float16), 4, 64)
    with pytest.raises(QuantizationError, match=r"expected \(4, 2\)"):
        impl.dequantize(packed, scales[:, :1], biases, 4, 64)
    with pytest.raises(QuantizationError, match=r"biases have shape \(3, 2\)"):
        impl.dequantize(packed, scales, biases[:3], 4, 64)
    with pytest.raises(QuantizationError, match="does not divide"):
        impl.dequantize(packed[:, :12], scales, biases, 4, 64)  # 96 inputs
    with pytest.raises(QuantizationError, match="whole number of 3-bit codes"):
        impl.dequantize(packed[:, :4], scales, biases, 3, 32)


def test_pack_errors():
    with pytest.raises(QuantizationError, match="does not fit in 2 bits"):
        pack(np.array([0, 1, 4] + [0] * 13, np.uint8), 2)
    with pytest.raises(QuantizationError, match="multiple of 32 codes"):
        pack(np.zeros(48, np.uint8), 3)
    with pytest.raises(QuantizationError, match="uint8"):
        pack(np.zeros(16, np.int64), 2)
    with pytest.raises(QuantizationError, match="uint32"):
        unpack(np.zeros(4, np.int32), 4)
    with pytest.raises(QuantizationError, match="bit width"):
        pack(np.zeros(16, np.uint8), 5)
    with pytest.raises(QuantizationError, match="float32"):
        f32_to_bf16(np.zeros(3, np.float64))
    with pytest.raises(QuantizationError, match="uint16"):
        bf16_to_f32(np.zeros(3, np.int16))

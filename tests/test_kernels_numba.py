"""kernels_numba against the numpy reference (kernels_ref) over grids of small shapes.

Tolerances (why each is what it is):
  * qmatmul: |y - ref| <= 1e-5 * (|x| @ (|scale| q + |bias|)^T) element by element. The numba kernel sums
    scale * dot(q, x_g) + bias * sum(x_g) per group with reordered (vectorised) float32 reductions; the
    reference rounds every dequantized weight and lets BLAS sum. Both errors scale with the magnitudes of
    the two terms, not with the (possibly cancelled) result.
  * expert_ffn: max |y - ref| <= 2e-5 * max |ref| (three chained qmatmuls with a SwiGLU between).
  * attention, gated_delta: reordered float32 dot products: 1e-5 of the output's scale.
  * rmsnorm, gated_rmsnorm, rope, conv1d_step: same operation order as the reference except a float64 mean
    and libm exp/sin/cos (numpy uses its own SIMD routines): rtol 1e-5 with a small absolute floor.
  * router_topk: indices exactly equal (order included); weights rtol 1e-6.
  * qembedding: bit-identical.
"""

from __future__ import annotations

import inspect
import zlib

import numpy as np
import pytest

from moepack.errors import QuantizationError, ShapeError
from moepack.quant.affine_ref import quantize, unpack
from moepack.quant.bf16 import bf16_to_f32
from moepack.runtime import kernels_numba as KN

REF = pytest.importorskip("moepack.runtime.kernels_ref")

TOKENS = (1, 3, 17)


def rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def qweights(r, out_dim, in_dim, bits, gs, std=0.05):
    """A random float matrix quantized MLX-style: (w uint32, scales bf16, biases bf16)."""
    return quantize((r.standard_normal((out_dim, in_dim)) * std).astype(np.float32), bits, gs)


def term_scale(x, w, scales, biases, bits, gs):
    """|x| @ (|scale| q + |bias|)^T in float64: the size of what a qmatmul output is summed from."""
    q = unpack(w, bits).astype(np.float64)  # [out, in]
    s = np.repeat(np.abs(bf16_to_f32(scales)).astype(np.float64), gs, axis=1)
    b = np.repeat(np.abs(bf16_to_f32(biases)).astype(np.float64), gs, axis=1)
    return np.abs(x).astype(np.float64) @ (s * q + b).T


# ---------------------------------------------------------------------------------------------- contract


def test_same_names_and_signatures_as_the_reference():
    assert KN.__all__ == REF.__all__
    for name in REF.__all__:
        assert inspect.signature(getattr(KN, name)).parameters.keys() == \
            inspect.signature(getattr(REF, name)).parameters.keys(), name


# ---------------------------------------------------------------------------------------------- qmatmul


def test_qmatmul_one_group_by_hand():
    # 32 codes 0..15, 0..15 at 4 bits: words 0x76543210, 0xFEDCBA98 twice; scale 0.5 (bf16 0x3F00),
    # bias -1.0 (bf16 0xBF80): W = 0.5 q - 1; with x = 1: sum(0.5 q - 1) = 0.5 * 2 * 120 - 32 = 88
    w = np.array([[0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98]], dtype=np.uint32)
    s = np.array([[0x3F00]], dtype=np.uint16)
    b = np.array([[0xBF80]], dtype=np.uint16)
    x = np.ones((1, 32), dtype=np.float32)
    assert KN.qmatmul(x, w, s, b, 4, 32).tolist() == [[88.0]]
    x[0, 31] = 2.0  # code 15 -> weight 6.5 counted twice
    assert KN.qmatmul(x, w, s, b, 4, 32).tolist() == [[94.5]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_qmatmul_matches_reference(bits, gs):
    r = rng("qmatmul", bits, gs)
    out_dim, in_dim = 37, 256
    w, s, b = qweights(r, out_dim, in_dim, bits, gs)
    for T in TOKENS:
        x = r.standard_normal((T, in_dim)).astype(np.float32)
        y = KN.qmatmul(x, w, s, b, bits, gs)
        ref = REF.qmatmul(x, w, s, b, bits, gs)
        assert y.dtype == np.float32 and y.shape == (T, out_dim)
        err = np.abs(y.astype(np.float64) - ref) / term_scale(x, w, s, b, bits, gs)
        assert err.max() <= 1e-5, (bits, gs, T, err.max())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qmatmul_token_tiles_and_wide_rows(bits, monkeypatch):
    # force tiles of 4 tokens (T=17: 4 full tiles + 1), a 1024-wide input, bias-heavy weights
    monkeypatch.setattr(KN, "_XTILE_BYTES", 4 * 4 * 1024)
    r = rng("tiles", bits)
    gs = 64
    W = (r.standard_normal((24, 1024)) * 0.01 + 0.3).astype(np.float32)
    w, s, b = quantize(W, bits, gs)
    x = r.standard_normal((17, 1024)).astype(np.float32)
    y = KN.qmatmul(x, w, s, b, bits, gs)
    ref = REF.qmatmul(x, w, s, b, bits, gs)
    err = np.abs(y.astype(np.float64) - ref) / term_scale(x, w, s, b, bits, gs)
    assert err.max() <= 1e-5


def test_qmatmul_accepts_what_the_reference_accepts():
    r = rng("accept")
    w, s, b = qweights(r, 8, 64, 4, 32)
    x64 = r.standard_normal((6, 64))  # float64, and a strided view
    np.testing.assert_allclose(KN.qmatmul(x64[::2], w, s, b, 4, 32), REF.qmatmul(x64[::2], w, s, b, 4, 32),
                               rtol=1e-5, atol=1e-5)
    assert KN.qmatmul(np.zeros((0, 64), np.float32), w, s, b, 4, 32).shape == (0, 8)


def test_qmatmul_rejects_bad_inputs():
    r = rng("reject")
    w, s, b = qweights(r, 8, 64, 4, 32)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(ShapeError):
        KN.qmatmul(x, w, bf16_to_f32(s), b, 4, 32)  # float scales
    with pytest.raises(ShapeError):
        KN.qmatmul(x, w.astype(np.int64), s, b, 4, 32)
    with pytest.raises(ShapeError):
        KN.qmatmul(np.ones((1, 128), np.float32), w, s, b, 4, 32)  # in mismatch
    with pytest.raises(ShapeError):
        KN.qmatmul(x, w, s[:, :1], b, 4, 32)
    with pytest.raises(ShapeError):
        KN.qmatmul(x[0], w, s, b, 4, 32)  # 1-D x
    with pytest.raises(QuantizationError):
        KN.qmatmul(x, w, s, b, 5, 32)
    with pytest.raises(QuantizationError):
        KN.qmatmul(x, w, s, b, 4, 48)


# ---------------------------------------------------------------------------------------------- expert_ffn


@pytest.mark.parametrize("bits", [4, (4, 4, 4), (2, 2, 2), (8, 8, 8), (4, 2, 8), (3, 3, 3)])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_expert_ffn_matches_reference(bits, gs):
    r = rng("ffn", str(bits), gs)
    D, I = 256, 128
    gb, ub, db = (bits,) * 3 if isinstance(bits, int) else bits
    gate, up, down = qweights(r, I, D, gb, gs), qweights(r, I, D, ub, gs), qweights(r, D, I, db, gs)
    for T in TOKENS:
        x = r.standard_normal((T, D)).astype(np.float32)
        y = KN.expert_ffn(x, *gate, *up, *down, bits, gs)
        ref = REF.expert_ffn(x, *gate, *up, *down, bits, gs)
        assert y.dtype == np.float32 and y.shape == (T, D)
        assert np.abs(y - ref).max() <= 2e-5 * np.abs(ref).max(), (bits, gs, T)


def test_expert_ffn_rejects_mismatched_projections():
    r = rng("ffn-bad")
    D, I = 64, 32
    gate, up, down = qweights(r, I, D, 4, 32), qweights(r, I + 32, D, 4, 32), qweights(r, D, I, 4, 32)
    x = np.ones((1, D), np.float32)
    with pytest.raises(ShapeError):
        KN.expert_ffn(x, *gate, *up, *down, 4, 32)
    with pytest.raises(ShapeError):
        KN.expert_ffn(x, *gate, *gate, *down, (4, 4), 32)


# ---------------------------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_qembedding_bit_identical(bits, gs):
    r = rng("embed", bits, gs)
    table = qweights(r, 50, 256, bits, gs, std=1.0)
    ids = r.integers(0, 50, size=17)
    y = KN.qembedding(ids, *table, bits, gs)
    assert y.dtype == np.float32
    assert np.array_equal(y.view(np.uint32), REF.qembedding(ids, *table, bits, gs).view(np.uint32))
    with pytest.raises(ShapeError):
        KN.qembedding([50], *table, bits, gs)


# ---------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("shape", [(1, 8), (3, 64), (17, 4096), (2, 5, 32)])
def test_rmsnorm(shape):
    r = rng("rms", shape)
    x = (r.standard_normal(shape) * 3).astype(np.float32)
    wt = r.standard_normal(shape[-1]).astype(np.float32)
    ref = REF.rmsnorm(x, wt, 1e-6)
    np.testing.assert_allclose(KN.rmsnorm(x, wt, 1e-6), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    with pytest.raises(ShapeError):
        KN.rmsnorm(x, wt[:-1], 1e-6)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H,dv", [(1, 16), (4, 128)])
def test_gated_rmsnorm(T, H, dv):
    r = rng("grms", T, H, dv)
    x = r.standard_normal((T, H, dv)).astype(np.float32)
    z = (r.standard_normal((T, H, dv)) * 4).astype(np.float32)
    wt = r.standard_normal(dv).astype(np.float32)
    ref = REF.gated_rmsnorm(x, z, wt, 1e-6)
    np.testing.assert_allclose(KN.gated_rmsnorm(x, z, wt, 1e-6), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


# ---------------------------------------------------------------------------------------------- rope / attention


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("H,hd,rotary_dim", [(2, 64, 64), (3, 64, 16), (4, 256, 64), (1, 32, 8)])
def test_rope(T, H, hd, rotary_dim):
    r = rng("rope", T, H, hd, rotary_dim)
    x = r.standard_normal((T, H, hd)).astype(np.float32)
    pos = np.sort(r.integers(0, 5000, size=T))
    for p in (pos, pos.astype(np.float32) * np.float32(0.5)):  # int, and scaled (float) positions
        y = KN.rope(x, p, rotary_dim, 1e7)
        np.testing.assert_allclose(y, REF.rope(x, p, rotary_dim, 1e7), rtol=1e-5, atol=1e-6)
        assert np.array_equal(y[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hq,Hkv,hd", [(2, 2, 16), (8, 2, 32), (32, 2, 64), (6, 2, 16)])
@pytest.mark.parametrize("where", ["prefill", "continue"])
def test_attention(T, Hq, Hkv, hd, where):
    r = rng("attn", T, Hq, Hkv, hd, where)
    S = T if where == "prefill" else T + 9  # "continue": T new tokens after 9 cached ones
    q = r.standard_normal((T, Hq, hd)).astype(np.float32)
    k = r.standard_normal((S, Hkv, hd)).astype(np.float32)
    v = r.standard_normal((S, Hkv, hd)).astype(np.float32)
    pos = np.arange(S - T, S)
    scale = hd**-0.5
    np.testing.assert_allclose(KN.attention(q, k, v, pos, scale), REF.attention(q, k, v, pos, scale),
                               rtol=1e-5, atol=1e-5)


def test_attention_first_token_is_its_value():
    r = rng("attn1")
    q, k, v = (r.standard_normal((1, 4, 8)).astype(np.float32) for _ in range(3))
    assert np.array_equal(KN.attention(q, k[:, :1], v[:, :1], [0], 0.3), np.repeat(v[:, :1], 4, axis=1))
    with pytest.raises(ShapeError):
        KN.attention(q, k[:, :1], v[:, :1], [1], 0.3)  # position past the cache


# ---------------------------------------------------------------------------------------------- linear attention


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("C,Kc", [(8, 4), (96, 4), (5, 2), (3, 1)])
def test_conv1d_step(T, C, Kc):
    r = rng("conv", T, C, Kc)
    x = r.standard_normal((T, C)).astype(np.float32)
    state = r.standard_normal((Kc - 1, C)).astype(np.float32)
    wt = r.standard_normal((C, Kc)).astype(np.float32)
    y, st = KN.conv1d_step(x, state, wt)
    yr, sr = REF.conv1d_step(x, state, wt)
    np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-6)
    assert np.array_equal(st, sr)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("Hk,rep,dk,dv", [(1, 1, 16, 8), (2, 4, 32, 16), (2, 2, 128, 128)])
def test_gated_delta(T, Hk, rep, dk, dv):
    r = rng("gdn", T, Hk, rep, dk, dv)
    Hv = Hk * rep
    q = (r.standard_normal((T, Hk, dk)) / dk).astype(np.float32)
    k = (r.standard_normal((T, Hk, dk)) / np.sqrt(dk)).astype(np.float32)
    v = r.standard_normal((T, Hv, dv)).astype(np.float32)
    g = r.uniform(0.5, 1.0, (T, Hv)).astype(np.float32)
    beta = r.uniform(0.0, 1.0, (T, Hv)).astype(np.float32)
    state = r.standard_normal((Hv, dv, dk)).astype(np.float32)
    keep = state.copy()
    out, st = KN.gated_delta(q, k, v, g, beta, state)
    out_r, st_r = REF.gated_delta(q, k, v, g, beta, state)
    assert np.array_equal(state, keep)  # the input state is not modified
    np.testing.assert_allclose(out, out_r, rtol=1e-5, atol=1e-5 * np.abs(out_r).max())
    np.testing.assert_allclose(st, st_r, rtol=1e-5, atol=1e-5 * np.abs(st_r).max())


# ---------------------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("E,k", [(8, 1), (64, 4), (512, 10)])
@pytest.mark.parametrize("norm", [True, False])
def test_router_topk(T, E, k, norm):
    r = rng("router", T, E, k, norm)
    logits = (r.standard_normal((T, E)) * 2).astype(np.float32)
    idx, w = KN.router_topk(logits, k, norm)
    idx_r, w_r = REF.router_topk(logits, k, norm)
    assert idx.dtype == np.int32 and w.dtype == np.float32
    assert np.array_equal(idx, idx_r)
    np.testing.assert_allclose(w, w_r, rtol=1e-6)


def test_router_ties_go_to_the_lower_index():
    logits = np.array([[1, 3, 3, 0, 3, 2], [0, 0, 0, 0, 0, 0]], dtype=np.float32)
    idx, w = KN.router_topk(logits, 3, True)
    assert idx.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert np.array_equal(idx, REF.router_topk(logits, 3, True)[0])
    np.testing.assert_allclose(w, 1 / 3, rtol=1e-6)
    idx, _ = KN.router_topk(logits, 5, False)
    assert idx.tolist() == [[1, 2, 4, 5, 0], [0, 1, 2, 3, 4]]


def test_read_only_inputs():
    # dense weights arrive as read-only views into mapped files
    r = rng("readonly")
    w, s, b = qweights(r, 16, 128, 4, 64)
    x = r.standard_normal((2, 128)).astype(np.float32)
    expect = KN.qmatmul(x, w, s, b, 4, 64)
    for a in (w, s, b, x):
        a.flags.writeable = False
    assert np.array_equal(KN.qmatmul(x, w, s, b, 4, 64), expect)
    assert np.array_equal(KN.qembedding(np.array([3, 1]), w, s, b, 4, 64), REF.qembedding([3, 1], w, s, b, 4, 64))


@pytest.mark.parametrize("bits", [2, 4, 8])  # 8: the row kernels, unscaled x
@pytest.mark.parametrize("scale", [1e-20, 1e20])
def test_qmatmul_one_token_prescaled_x_keeps_its_precision(bits, scale):
    # one token: x is pre-scaled by 2^(-bits*k) per code position (exact unless it drops below float32's
    # normal range, ~1e-38 * 2^28); tiny and huge activations still meet the usual bound
    r = rng("prescale", bits, scale)
    gs = 64
    w, s, b = qweights(r, 40, 512, bits, gs)
    x = (r.standard_normal((1, 512)) * scale).astype(np.float32)
    y = KN.qmatmul(x, w, s, b, bits, gs)
    err = np.abs(y.astype(np.float64) - REF.qmatmul(x, w, s, b, bits, gs)) / term_scale(x, w, s, b, bits, gs)
    assert err.max() <= 1e-5, err.max()


@pytest.mark.parametrize("bits", [2, 4, (4, 2, 4), (2, 4, 8)])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_token_by_token_kernels_for_many_tokens(bits, gs, monkeypatch):
    # T >= 4 takes the token-by-token kernels only for wide inputs; force them on small shapes, with tiles
    # of 4 tokens (T=9: two full tiles + 1), for qmatmul and the fused gate/up of expert_ffn (mixed widths:
    # gate and up of different bits; an 8-bit down projection takes the row kernel)
    monkeypatch.setattr(KN, "_ROW4_MAX_IN", 0)
    monkeypatch.setattr(KN, "_XTILE_BYTES", 4 * 4 * 256)
    r = rng("one-by-one", str(bits), gs)
    gb, ub, db = (bits,) * 3 if isinstance(bits, int) else bits
    w, s, b = qweights(r, 37, 256, gb, gs)
    x = r.standard_normal((9, 256)).astype(np.float32)
    err = np.abs(KN.qmatmul(x, w, s, b, gb, gs).astype(np.float64) - REF.qmatmul(x, w, s, b, gb, gs))
    assert (err / term_scale(x, w, s, b, gb, gs)).max() <= 1e-5
    I = 128
    gate, up, down = qweights(r, I, 256, gb, gs), qweights(r, I, 256, ub, gs), qweights(r, 256, I, db, gs)
    ref = REF.expert_ffn(x, *gate, *up, *down, bits, gs)
    y = KN.expert_ffn(x, *gate, *up, *down, bits, gs)
    assert np.abs(y - ref).max() <= 2e-5 * np.abs(ref).max()

"""The integer dot-product path (kernels_intdot, via kernels_numba.INT_DOT_MODE) against kernels_ref.

Modes: 32 (the default with AVX2: x as two 16-bit integers, float-grade), 16 and 8 (int16 / int8 x, opt-in).
Tolerances (why each is what it is):
  * qmatmul, per output: |y - ref| <= sum_g |scale_g| * sx_g / 2 * sum_{i in g} |q_i - c| (the rounding of x
    to a step sx_g = max|x_g| / qmax, qmax = 32767 * 65534 for mode 32, met by the centred codes q - c,
    c = (2^bits - 1) / 2) + 1e-5 * (|x| @ (|scale| q + |bias|)^T) (float32 reordering: the bound the float
    kernels are held to in test_kernels_numba). This is a bound, not a fit: a wrong lane, stream or group
    wiring breaks it by orders of magnitude.
  * typical size, Gaussian x, 4-bit [64 x 4096]: mode 32 <= 3e-6 of max|ref| (measured ~5e-7, float kernels
    ~6e-7), mode 16 <= 5e-5 (measured ~1.3e-5), mode 8 <= 3e-2 (measured ~6e-3), with margin.
  * expert_ffn: max |y - ref| <= 2e-5 * max|ref| for mode 32 (as the float kernels), 3e-4 for mode 16 (the
    down projection's input is quantized too), 6e-2 for mode 8.
  * all-zero x gives exactly 0; the integer path gives bit-identical results however it is reached.
  * the float kernels (mode 0) keep their own tolerance, since test_kernels_numba now runs the default mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from moepack.quant.affine_ref import quantize, unpack
from moepack.quant.bf16 import bf16_to_f32
from moepack.runtime import kernels_intdot as KI
from moepack.runtime import kernels_numba as KN
from moepack.runtime import kernels_ref as REF


def rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def qweights(r, out_dim, in_dim, bits, gs, std=0.05):
    return quantize((r.standard_normal((out_dim, in_dim)) * std).astype(np.float32), bits, gs)


def bound(x, w, scales, biases, bits, gs, mode):
    """The per-output error bound of the module docstring (float64)."""
    q = unpack(w, bits).astype(np.float64)  # [out, in]
    c = ((1 << bits) - 1) / 2
    s = np.abs(bf16_to_f32(scales)).astype(np.float64)  # [out, ng]
    b = np.abs(bf16_to_f32(biases)).astype(np.float64)
    T, n = x.shape
    ng = n // gs
    qmax = KI.QMAX[mode] * (KI.LO_SCALE if mode == 32 else 1)
    sx = np.abs(x.astype(np.float64)).reshape(T, ng, gs).max(-1) / qmax  # [T, ng]
    qc = np.abs(q - c).reshape(q.shape[0], ng, gs).sum(-1)  # [out, ng]
    rounding = (sx / 2) @ (s * qc).T  # [T, out]
    terms = np.abs(x).astype(np.float64) @ (np.repeat(s, gs, 1) * q + np.repeat(b, gs, 1)).T
    return 1.001 * rounding + 1e-5 * terms


@pytest.fixture
def int_mode(monkeypatch):
    """Set kernels_numba.INT_DOT_MODE for one test (restored afterwards)."""

    def set_mode(mode):
        monkeypatch.setattr(KN, "INT_DOT_MODE", mode)

    return set_mode


def test_default_and_env_switches(monkeypatch):
    for k in ("MOEPACK_INT_DOT", "MOEPACK_INT8_DOT"):
        monkeypatch.delenv(k, raising=False)
    assert KI.default_mode() == (32 if KI.X86_AVX2 else 0)
    for v, mode in (("16", 16), ("1", 32), ("32", 32), ("on", 32), ("0", 0), ("off", 0)):
        monkeypatch.setenv("MOEPACK_INT_DOT", v)
        assert KI.default_mode() == mode, v
    monkeypatch.setenv("MOEPACK_INT8_DOT", "1")
    assert KI.default_mode() == 8


def test_which_projections_take_the_integer_path(int_mode):
    int_mode(32)
    assert KN._int_mode(1, 4096, 4, 64) == 32 and KN._int_mode(3, 1024, 2, 32) == 32
    assert KN._int_mode(40, 4096, 2, 32) == 32  # wide rows: any T
    assert KN._int_mode(4, 1024, 4, 64) == 0  # the float 4-token row kernel is faster there
    assert KN._int_mode(1, 4096, 8, 64) == 0  # 8-bit lane sums would not convert to float exactly
    int_mode(16)
    assert KN._int_mode(1, 4096, 4, 64) == 16
    assert KN._int_mode(3, 1024, 2, 64) == 16
    assert KN._int_mode(16, 4096, 4, 64) == 16 and KN._int_mode(16, 1024, 4, 64) == 16  # any T
    assert KN._int_mode(1, 4096, 8, 64) == 16 and KN._int_mode(40, 1024, 8, 64) == 16
    assert KN._int_mode(1, 4096, 3, 64) == 0  # 3-bit codes straddle units
    assert KN._int_mode(1, 64, 2, 64) == 0  # 2-bit blocks pair two groups: 64 inputs are not enough
    int_mode(8)
    assert KN._int_mode(1, 4096, 4, 64) == 8
    assert KN._int_mode(1, 4096, 8, 64) == 16  # 8-bit codes keep 16-bit activations
    int_mode(0)
    assert KN._int_mode(1, 4096, 4, 64) == 0


@pytest.mark.parametrize("mode", [32, 16, 8])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_qmatmul_within_the_rounding_bound(mode, bits, gs, int_mode):
    int_mode(mode)
    r = rng("intdot", mode, bits, gs)
    out_dim, in_dim = 37, 512  # 37 rows: two full tasks of 16 and a tail of 5
    w, s, b = qweights(r, out_dim, in_dim, bits, gs)
    for T in (1, 2, 5):  # 5: a 4-token tile and one more (mode 32 leaves T >= 4 at 512 inputs to float)
        used = {32: 0, 16: 16, 8: 16}[mode] if bits == 8 else mode  # 8-bit: mode 16, or the float kernels
        used = 0 if (used == 32 and T >= 4) else used
        x = r.standard_normal((T, in_dim)).astype(np.float32)
        x[:, 5] *= 40  # an outlier, as real hidden states have
        assert KN._int_mode(T, in_dim, bits, gs) == used
        y = KN.qmatmul(x, w, s, b, bits, gs)
        ref = REF.qmatmul(x, w, s, b, bits, gs)
        err = np.abs(y.astype(np.float64) - ref)
        lim = bound(x, w, s, b, bits, gs, used or 32)
        assert (err <= lim).all(), (T, float((err / lim).max()))
        int_mode(0)
        assert np.array_equal(KN.qmatmul(x, w, s, b, bits, gs), y) == (used == 0)  # which path ran
        int_mode(mode)


def test_qmatmul_direct_call_is_the_same_computation(int_mode):
    int_mode(16)
    r = rng("direct")
    w, s, b = qweights(r, 21, 256, 4, 64)
    x = r.standard_normal((2, 256)).astype(np.float32)
    y = np.empty((2, 21), np.float32)
    KI.qmm(x, w, s, b, 4, 64, 16, y)
    assert np.array_equal(KN.qmatmul(x, w, s, b, 4, 64), y)


@pytest.mark.parametrize("mode,lim", [(32, 3e-6), (16, 5e-5), (8, 3e-2)])
@pytest.mark.parametrize("bits", [4, 2])
def test_qmatmul_typical_error_at_the_397b_width(mode, lim, bits, int_mode):
    int_mode(mode)
    r = rng("typical", mode, bits)
    w, s, b = qweights(r, 64, 4096, bits, 64, std=0.02)
    x = r.standard_normal((1, 4096)).astype(np.float32)
    ref = REF.qmatmul(x, w, s, b, bits, 64)
    rel = np.abs(KN.qmatmul(x, w, s, b, bits, 64) - ref).max() / np.abs(ref).max()
    assert rel <= lim
    if mode != 32:
        assert rel >= lim / 1000  # the activations really were quantized to `mode` bits


@pytest.mark.parametrize("mode", [32, 16, 8])
def test_edge_cases(mode, int_mode):
    int_mode(mode)
    r = rng("edges", mode)
    w, s, b = qweights(r, 17, 256, 4, 64)
    zero = np.zeros((2, 256), np.float32)
    assert not KN.qmatmul(zero, w, s, b, 4, 64).any()  # exactly 0, no 0/0 from an all-zero group
    x = r.standard_normal((1, 256)).astype(np.float32)
    x[0, 64:128] = 0  # one all-zero group among others
    x[0, 130] = 1e6  # one huge value: its group's other inputs round to 0 against it
    x[0, 200] = -3e-20  # a tiny group scale stays finite
    x[0, 192:200] = 1e-20
    y = KN.qmatmul(x, w, s, b, 4, 64)
    assert np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - REF.qmatmul(x, w, s, b, 4, 64))
    assert (err <= bound(x, w, s, b, 4, 64, mode)).all()


def test_many_tokens_on_wide_rows_tile_the_tokens(int_mode, monkeypatch):
    int_mode(16)
    monkeypatch.setattr(KI, "_XTILE_BYTES", 2 * 4096 * 3)  # tiles of 3 tokens (at least 4: 4-token tiles)
    r = rng("tiles")
    w, s, b = qweights(r, 5, 4096, 2, 64)
    x = r.standard_normal((9, 4096)).astype(np.float32)  # tiles 4 + 4 + 1
    assert KI.token_tile(4096) == 4 and KN._int_mode(9, 4096, 2, 64) == 16
    y = KN.qmatmul(x, w, s, b, 2, 64)
    err = np.abs(y.astype(np.float64) - REF.qmatmul(x, w, s, b, 2, 64))
    assert (err <= bound(x, w, s, b, 2, 64, 16)).all()


@pytest.mark.parametrize("mode,lim", [(32, 2e-5), (16, 3e-4), (8, 6e-2)])
@pytest.mark.parametrize("bits", [4, (4, 2, 8), (2, 2, 4)])
def test_expert_ffn(mode, lim, bits, int_mode):
    int_mode(mode)
    r = rng("ffn", mode, bits)
    gb, ub, db = (bits,) * 3 if np.isscalar(bits) else bits
    D, I = 512, 256
    gate, up, down = qweights(r, I, D, gb, 64), qweights(r, I, D, ub, 64), qweights(r, D, I, db, 64)
    for T in (1, 6):
        x = r.standard_normal((T, D)).astype(np.float32)
        y = KN.expert_ffn(x, *gate, *up, *down, bits, 64)
        ref = REF.expert_ffn(x, *gate, *up, *down, bits, 64)
        assert np.abs(y - ref).max() <= lim * np.abs(ref).max()


def test_generic_vector_ir_without_avx2(tmp_path):
    """Where there is no AVX2 (NUMBA_CPU_NAME=generic here; arm64 Macs), _gblock is plain vector IR."""
    code = """
import numpy as np
from moepack.quant.affine_ref import quantize
from moepack.runtime import kernels_intdot as KI, kernels_ref as REF
assert not KI.X86_AVX2
r = np.random.default_rng(0)
worst = {}
for mode, bits, gs in ((32, 4, 64), (32, 2, 32), (16, 4, 64), (16, 2, 64), (16, 8, 128), (8, 4, 64), (8, 2, 32)):
    w, s, b = quantize((r.standard_normal((9, 256)) * 0.05).astype(np.float32), bits, gs)
    x = r.standard_normal((2, 256)).astype(np.float32)
    y = np.empty((2, 9), np.float32)
    KI.qmm(x, w, s, b, bits, gs, mode, y)
    ref = REF.qmatmul(x, w, s, b, bits, gs)
    worst[(mode, bits, gs)] = float(np.abs(y - ref).max() / np.abs(ref).max())
    assert worst[(mode, bits, gs)] < {32: 3e-6, 16: 1e-4, 8: 5e-2}[mode], worst
print("ok", worst)
"""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_float_kernels_still_within_their_tolerance(bits, gs, int_mode):
    """Mode 0 (MOEPACK_INT_DOT=0): the float kernels, held to test_kernels_numba's bound."""
    int_mode(0)
    r = rng("float", bits, gs)
    w, s, b = qweights(r, 21, 256, bits, gs)
    for T in (1, 3, 9):
        x = r.standard_normal((T, 256)).astype(np.float32)
        err = np.abs(KN.qmatmul(x, w, s, b, bits, gs).astype(np.float64) - REF.qmatmul(x, w, s, b, bits, gs))
        q = unpack(w, bits).astype(np.float64)
        sc = np.repeat(np.abs(bf16_to_f32(s)).astype(np.float64), gs, 1)
        bi = np.repeat(np.abs(bf16_to_f32(b)).astype(np.float64), gs, 1)
        assert (err <= 1e-5 * (np.abs(x).astype(np.float64) @ (sc * q + bi).T)).all()
    D, I = 256, 128
    gate, up, down = qweights(r, I, D, bits, gs), qweights(r, I, D, bits, gs), qweights(r, D, I, bits, gs)
    x = r.standard_normal((2, D)).astype(np.float32)
    ref = REF.expert_ffn(x, *gate, *up, *down, bits, gs)
    assert np.abs(KN.expert_ffn(x, *gate, *up, *down, bits, gs) - ref).max() <= 2e-5 * np.abs(ref).max()

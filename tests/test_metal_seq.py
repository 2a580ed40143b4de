"""The sequence kernels (metal/norm, rope, attention, linear_attention, router .metal) against the numpy spec.

Every kernel runs through moepack.runtime.metal.ops_seq on the CPU emulator under three executor settings
("forward" schedule; "reverse" with strict address spaces; "random" with the strict all-lanes simd mode) over
a small grid of shapes, and is compared with moepack.runtime.kernels_ref: float32 tolerances ~1e-5 relative
(the emulator's exp/sqrt/sin/cos are the C library's), router indices exact. The launch builders' geometry,
argument dtypes and limits are checked against the kernels' parsed signatures and the .metal enums.

`MOEPACK_TEST_EXECUTOR=cuda` runs the same kernel tests on an NVIDIA GPU through the cuda executor (PTX, CuPy)
instead, at the fast-math tolerance 1e-4 (ex2.approx / sin.approx); the emulator-only tests then skip.
"""

from __future__ import annotations

import inspect
import os
import re
import zlib

import numpy as np
import pytest

from moepack.errors import ShapeError
from moepack.runtime import kernels_ref as ref
from moepack.runtime.metal import ops_seq
from moepack.runtime.metal.dispatch import Dispatch
from moepack.runtime.metal.sources import kernel_dir

try:
    from moepack.runtime.metal.emulator import Emulator
except ImportError:  # the plan-only tests below still run
    Emulator = None

EXECUTOR = os.environ.get("MOEPACK_TEST_EXECUTOR", "metal-emu")
RTOL = 1e-4 if EXECUTOR == "cuda" else 1e-5
SETTINGS = {
    "forward": dict(schedule="forward"),
    "reverse-strict-as": dict(schedule="reverse", strict_address_spaces=True),
    "random-strict-simd": dict(schedule="random", strict_simd=True, seed=3),
} if EXECUTOR != "cuda" else {"cuda": None}


def _executor(settings):
    if EXECUTOR == "cuda":
        from moepack.runtime.metal.executor_cuda import CudaExecutor

        return CudaExecutor()
    if Emulator is None:
        pytest.skip("the Metal emulator is not available")
    return Emulator(**settings)


@pytest.fixture(scope="module", params=list(SETTINGS))
def emu(request):
    return _executor(SETTINGS[request.param])


@pytest.fixture(scope="module")
def lax():
    """One executor for tests that need no schedule grid (the emulator's forward schedule)."""
    return _executor(dict(schedule="forward"))


@pytest.fixture(scope="module")
def sig_emu():
    if Emulator is None or EXECUTOR == "cuda":
        pytest.skip("the Metal emulator is not available")
    return Emulator()


def rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))  # not hash(): str hashes vary per process


def randn(r, *shape, scale=1.0) -> np.ndarray:
    return (r.standard_normal(shape) * scale).astype(np.float32)


def bf16(a) -> np.ndarray:
    """float32 -> bf16 bit patterns (round to nearest even)."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u) -> np.ndarray:
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def assert_close(got, want, rtol=None, what=""):
    """|got - want| <= rtol * (|want| + max|want|): relative, with an absolute floor at the output's scale."""
    rtol = RTOL if rtol is None else rtol
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output"
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    err = np.abs(got - want)
    bound = rtol * (np.abs(want) + scale)
    worst = float(np.max(err / np.maximum(bound, 1e-30))) if want.size else 0.0
    assert np.all(err <= bound), f"{what}: max error {err.max():.3g} ({worst:.2f}x the bound), scale {scale:.3g}"


# ------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("rows,width,D", [(1, 7, 7), (3, 64, 64), (2, 300, 300), (4, 48, 16)])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_rmsnorm(emu, rows, width, D, wdtype):
    r = rng("rmsnorm", rows, width, wdtype)
    x = randn(r, rows, width, scale=3.0)
    w32 = randn(r, D) + 1.0
    w = bf16(w32) if wdtype == "bf16" else w32
    wref = from_bf16(w) if wdtype == "bf16" else w32
    want = ref.rmsnorm(x[:, :D], wref, 1e-6)
    if width == D:
        assert_close(ops_seq.rmsnorm(emu, x, w, 1e-6), want, what="rmsnorm")
    else:  # rows wider than the normalised part (a query head followed by its gate)
        ds = ops_seq.rmsnorm_dispatch(x, w, 1e-6)
        emu.run(ds)
        assert_close(ds[0].args[2], want, what="rmsnorm strided")


def test_rmsnorm_long_rows_reread_tail(emu):
    """A threadgroup too small to keep the row in registers (D > 8 * tpg) takes the re-reading path."""
    r = rng("rmsnorm-tail")
    x = randn(r, 2, 300)
    w = randn(r, 300)
    y = np.full_like(x, np.nan)
    emu.run([Dispatch("norm.metal", "rmsnorm_f32", {0: x, 1: w, 2: y, 3: 300, 4: np.float32(1e-5), 5: 300, 6: 300},
                      (2, 1, 1), (32, 1, 1))])
    assert_close(y, ref.rmsnorm(x, w, 1e-5), what="rmsnorm tail")


def test_rmsnorm_in_place(lax):
    r = rng("rmsnorm-inplace")
    x = randn(r, 3, 40)
    w = randn(r, 40)
    want = ref.rmsnorm(x, w, 1e-6)
    lax.run(ops_seq.rmsnorm_dispatch(x, w, 1e-6, out=x))
    assert_close(x, want, what="rmsnorm in place")


@pytest.mark.parametrize("T,H,dv", [(1, 2, 16), (2, 3, 40)])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_gated_rmsnorm(emu, T, H, dv, wdtype):
    r = rng("gated", T, H, dv, wdtype)
    x = randn(r, T, H, dv)
    z = randn(r, T, H, dv, scale=4.0)
    w32 = randn(r, dv)
    w = bf16(w32) if wdtype == "bf16" else w32
    wref = from_bf16(w) if wdtype == "bf16" else w32
    assert_close(ops_seq.gated_rmsnorm(emu, x, z, w, 1e-6), ref.gated_rmsnorm(x, z, wref, 1e-6), what="gated")


# ------------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("T,H,hd,rot", [(1, 2, 16, 16), (3, 4, 32, 8), (2, 3, 64, 16)])
def test_rope(emu, T, H, hd, rot):
    r = rng("rope", T, H, hd, rot)
    x = randn(r, T, H, hd)
    pos = np.array([0, 7, 4093, 123456][:T] if T > 1 else [5000], dtype=np.int64)
    got = ops_seq.rope(emu, x, pos, rot, 10000.0)
    assert_close(got, ref.rope(x, pos, rot, 10000.0), what="rope")
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])  # pass-through dims are copied exactly


def test_rope_float_positions_large_base_in_place(lax):
    """Linear RoPE scaling passes float positions; Qwen3.5 turns 25% of 256 dims with theta 1e7."""
    r = rng("rope-float")
    x = randn(r, 2, 2, 256)
    pos = np.array([3.25, 1e4 + 0.5], dtype=np.float32)
    want = ref.rope(x, pos, 64, 1e7)
    lax.run(ops_seq.rope_dispatch(x, pos, 64, 1e7, out=x))
    assert_close(x, want, what="rope in place")


# ------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("T,Hq,Hkv,hd,S,positions", [
    (1, 2, 1, 32, 5, [4]),  # decode, one simdgroup
    (3, 4, 2, 40, 7, [4, 5, 6]),  # prefill chunk, hd not a multiple of 32
    (1, 2, 2, 64, 70, [69]),  # three simdgroups share the keys
    (2, 2, 1, 16, 300, [0, 299]),  # eight simdgroups; a query that sees a single key
])
def test_attention(emu, T, Hq, Hkv, hd, S, positions):
    r = rng("attn", T, Hq, Hkv, hd, S)
    q = randn(r, T, Hq, hd)
    k = randn(r, S, Hkv, hd)
    v = randn(r, S, Hkv, hd)
    pos = np.array(positions, dtype=np.int64)
    scale = hd**-0.5
    assert_close(ops_seq.attention(emu, q, k, v, pos, scale), ref.attention(q, k, v, pos, scale), what="attention")


@pytest.mark.parametrize("T,Hq,Hkv,hd,S,positions,splits", [
    (1, 4, 2, 64, 70, [69], 3),  # decode split in three
    (2, 2, 1, 16, 300, [0, 299], 4),  # token 0 sees one key: three of its four splits are empty
    (3, 4, 2, 40, 7, [4, 5, 6], 32),  # more splits than keys
])
def test_attention_split_keys(emu, T, Hq, Hkv, hd, S, positions, splits):
    """Two passes: partial softmaxes per key split, then their merge; same result as one pass."""
    r = rng("attn-split", T, Hq, S, splits)
    q, k, v = randn(r, T, Hq, hd), randn(r, S, Hkv, hd), randn(r, S, Hkv, hd)
    pos = np.array(positions)
    ds = ops_seq.attention_dispatch(q, k, v, pos, 0.3, splits=splits)
    assert [d.kernel for d in ds] == ["attention_split_f32", "attention_merge_f32"]
    assert ds[0].grid == (Hq, T, splits)
    emu.run(ds)
    assert_close(ds[1].args[3], ref.attention(q, k, v, pos, 0.3), what="split attention")


def test_attention_head_dim_256_and_large_scores(lax):
    """hd = 256 (Qwen3.5) uses all 8 registers per lane; scores spanning ~45 test the running-max softmax."""
    r = rng("attn-256")
    q = randn(r, 1, 2, 256, scale=8.0)
    k = randn(r, 40, 1, 256)
    v = randn(r, 40, 1, 256)
    pos = np.array([39])
    want = ref.attention(q, k, v, pos, 256**-0.5)
    assert np.ptp(np.einsum("thd,sd->ths", q, k[:, 0]) / 16) > 30  # the scores span a wide range
    assert_close(ops_seq.attention(lax, q, k, v, pos, 256**-0.5), want, what="attention hd=256")


# ------------------------------------------------------------------------------------------- linear attention


@pytest.mark.parametrize("T,C,Kc", [(1, 8, 4), (5, 300, 4), (2, 16, 1), (3, 10, 2)])
def test_conv1d_step(emu, T, C, Kc):
    r = rng("conv", T, C, Kc)
    x = randn(r, T, C, scale=2.0)
    state = randn(r, Kc - 1, C)
    w = randn(r, C, Kc)
    state0 = state.copy()
    y, new_state = ops_seq.conv1d_step(emu, x, state, w)
    want_y, want_state = ref.conv1d_step(x, state, w)
    assert_close(y, want_y, what="conv1d y")
    np.testing.assert_array_equal(new_state, want_state)  # the state is a copy of inputs: exact
    np.testing.assert_array_equal(state, state0)  # the convenience function leaves the caller's state alone


def test_conv1d_state_updated_in_place(lax):
    """Two decode steps through the dispatch builder carry the state in its buffer, as a step-by-step reference."""
    r = rng("conv-inplace")
    C, Kc = 12, 4
    w = randn(r, C, Kc)
    state = np.zeros((Kc - 1, C), dtype=np.float32)
    ref_state = state.copy()
    for step in range(2):
        x = randn(r, 1, C)
        ds = ops_seq.conv1d_step_dispatch(x, state, w)
        lax.run(ds)
        want, ref_state = ref.conv1d_step(x, ref_state, w)
        assert_close(ds[0].args[3], want, what=f"conv step {step}")
        np.testing.assert_array_equal(state, ref_state)


def _delta_inputs(r, T, Hk, Hv, dk, dv):
    q = randn(r, T, Hk, dk) * np.float32(dk**-0.5)
    k = randn(r, T, Hk, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the model L2-normalises q and k
    v = randn(r, T, Hv, dv)
    g = np.exp(-r.uniform(0.01, 1.0, (T, Hv))).astype(np.float32)
    beta = r.uniform(0.0, 1.0, (T, Hv)).astype(np.float32)
    state = randn(r, Hv, dv, dk, scale=0.5)
    return q, k.astype(np.float32), v, g, beta, state


@pytest.mark.parametrize("T,Hk,Hv,dk,dv", [(1, 1, 2, 32, 8), (3, 2, 4, 40, 6), (2, 1, 1, 128, 5)])
def test_gated_delta(emu, T, Hk, Hv, dk, dv):
    q, k, v, g, beta, state = _delta_inputs(rng("delta", T, Hk, Hv, dk, dv), T, Hk, Hv, dk, dv)
    state0 = state.copy()
    out, new_state = ops_seq.gated_delta(emu, q, k, v, g, beta, state)
    want_out, want_state = ref.gated_delta(q, k, v, g, beta, state)
    assert_close(out, want_out, what="gated_delta out")
    assert_close(new_state, want_state, what="gated_delta state")
    np.testing.assert_array_equal(state, state0)


def test_gated_delta_state_updated_in_place(lax):
    """The dispatch updates the caller's state buffer itself: three single-token steps equal one 3-token call."""
    T, Hk, Hv, dk, dv = 3, 1, 2, 64, 4
    q, k, v, g, beta, state = _delta_inputs(rng("delta-inplace"), T, Hk, Hv, dk, dv)
    want_out, want_state = ref.gated_delta(q, k, v, g, beta, state)
    buf = state.copy()
    outs = []
    for t in range(T):
        ds = ops_seq.gated_delta_dispatch(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], buf)
        assert ds[0].args[5] is buf
        lax.run(ds)
        outs.append(ds[0].args[6])
    assert_close(np.concatenate(outs), want_out, what="stepped out")
    assert_close(buf, want_state, what="state in place")


# ------------------------------------------------------------------------------------------- router


@pytest.mark.parametrize("T,E,k", [(5, 8, 2), (2, 64, 8), (1, 512, 10)])
@pytest.mark.parametrize("norm", [False, True])
def test_router_topk(emu, T, E, k, norm):
    logits = randn(rng("router", T, E, k), T, E, scale=2.0)
    idx, w = ops_seq.router_topk(emu, logits, k, norm)
    want_idx, want_w = ref.router_topk(logits, k, norm)
    assert idx.dtype == np.int32 and idx.shape == (T, k)
    np.testing.assert_array_equal(idx, want_idx)
    assert_close(w, want_w, what="router weights")


def test_router_ties_go_to_the_lower_index(emu):
    """Hand-checkable rows: equal logits rank by index; the winners' weights are equal to the last bit."""
    logits = np.array([
        [0.0] * 8,  # all equal -> 0, 1, 2
        [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, 2.0],  # 1, 2, 4 tie at the top
        [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # 0, then the ties 1, 2
        [-1.0, 2.0, -1.0, 2.0, 7.0, -1.0, 2.0, -1.0],  # 4, then 1, 3 of the three 2.0s
    ], dtype=np.float32)
    for norm in (False, True):
        idx, w = ops_seq.router_topk(emu, logits, 3, norm)
        np.testing.assert_array_equal(idx, [[0, 1, 2], [1, 2, 4], [0, 1, 2], [4, 1, 3]])
        np.testing.assert_array_equal(idx, ref.router_topk(logits, 3, norm)[0])
        assert w[0, 0] == w[0, 1] == w[0, 2] and w[1, 0] == w[1, 1] == w[1, 2]
        assert_close(w, ref.router_topk(logits, 3, norm)[1], what="tie weights")
    _, w = ops_seq.router_topk(emu, logits, 3, True)
    assert_close(w.sum(axis=1), np.ones(4), what="renormalised weights sum to 1")
    assert np.allclose(w[0], 1 / 3, rtol=1e-6)


def test_router_many_tokens_and_experts(lax):
    """Several threadgroups of 4 tokens with a ragged last one; 1000 experts (30 registers per lane)."""
    r = rng("router-big")
    logits = randn(r, 9, 1000, scale=3.0)
    logits[2, 500:600] = logits[2].max()  # a hundred-way tie at the top
    idx, w = ops_seq.router_topk(lax, logits, 12, True)
    want_idx, want_w = ref.router_topk(logits, 12, True)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(idx[2], np.arange(500, 512))
    assert_close(w, want_w, what="router 1000 experts")


# ------------------------------------------------------------------------------------------- real shapes


def test_qwen35_397b_shapes_one_decode_step(lax):
    """One decode step of each kernel at Qwen3.5-397B-A17B's sizes (hidden 4096, 512 experts top 10, attention
    32 q / 2 kv heads of 256 with 25% RoPE at theta 1e7, linear attention 16 k / 64 v heads of 128, conv 4)."""
    r = rng("397b")
    x = randn(r, 1, 4096, scale=3.0)
    w = bf16(randn(r, 4096))
    assert_close(ops_seq.rmsnorm(lax, x, w, 1e-6), ref.rmsnorm(x, from_bf16(w), 1e-6), what="rmsnorm 4096")
    logits = randn(r, 1, 512, scale=3.0)
    idx, wts = ops_seq.router_topk(lax, logits, 10, True)
    want_idx, want_w = ref.router_topk(logits, 10, True)
    np.testing.assert_array_equal(idx, want_idx)
    assert_close(wts, want_w, what="router 512")
    q, k, v = randn(r, 1, 32, 256), randn(r, 1100, 2, 256), randn(r, 1100, 2, 256)
    pos = np.array([1099])
    qr = ops_seq.rope(lax, q, pos, 64, 1e7)
    assert_close(qr, ref.rope(q, pos, 64, 1e7), what="rope 256/64")
    assert [d.kernel for d in ops_seq.attention_dispatch(qr, k, v, pos, 1 / 16)] == [
        "attention_split_f32", "attention_merge_f32"]  # 1100 keys on 32 heads: three key splits
    assert_close(ops_seq.attention(lax, qr, k, v, pos, 1 / 16), ref.attention(qr, k, v, pos, 1 / 16),
                 what="attention 32/2/256")
    C = 2 * 16 * 128 + 64 * 128
    xc, st, cw = randn(r, 1, C), randn(r, 3, C), randn(r, C, 4)
    y, new_st = ops_seq.conv1d_step(lax, xc, st, cw)
    want_y, want_st = ref.conv1d_step(xc, st, cw)
    assert_close(y, want_y, what="conv 12288")
    np.testing.assert_array_equal(new_st, want_st)
    dq, dk, dv, g, beta, state = _delta_inputs(r, 1, 16, 64, 128, 128)
    out, new_state = ops_seq.gated_delta(lax, dq, dk, dv, g, beta, state)
    want_out, want_state = ref.gated_delta(dq, dk, dv, g, beta, state)
    assert_close(out, want_out, what="gated_delta out")
    assert_close(new_state, want_state, what="gated_delta state")
    z = randn(r, 1, 64, 128)
    nw = bf16(randn(r, 128))
    assert_close(ops_seq.gated_rmsnorm(lax, out, z, nw, 1e-6), ref.gated_rmsnorm(out, z, from_bf16(nw), 1e-6),
                 what="gated_rmsnorm 64x128")


# ------------------------------------------------------------------------------------------- launch plans


def _dispatches():
    """One Dispatch of every kernel (both norm weight types), from the builders."""
    r = rng("plans")
    x = randn(r, 3, 64)
    q, k, v, g, beta, state = _delta_inputs(r, 2, 1, 2, 32, 4)
    return [
        *ops_seq.rmsnorm_dispatch(x, randn(r, 64), 1e-6),
        *ops_seq.rmsnorm_dispatch(x, bf16(randn(r, 64)), 1e-6),
        *ops_seq.gated_rmsnorm_dispatch(x, x, randn(r, 64), 1e-6),
        *ops_seq.gated_rmsnorm_dispatch(x, x, bf16(randn(r, 64)), 1e-6),
        *ops_seq.rope_dispatch(randn(r, 2, 3, 16), [1, 2], 8, 1e4),
        *ops_seq.attention_dispatch(randn(r, 2, 4, 32), randn(r, 5, 2, 32), randn(r, 5, 2, 32), [3, 4], 0.1),
        *ops_seq.attention_dispatch(randn(r, 1, 4, 32), randn(r, 5, 2, 32), randn(r, 5, 2, 32), [4], 0.1, splits=2),
        *ops_seq.conv1d_step_dispatch(randn(r, 2, 8), np.zeros((3, 8), np.float32), randn(r, 8, 4)),
        *ops_seq.gated_delta_dispatch(q, k, v, g, beta, state),
        *ops_seq.router_topk_dispatch(randn(r, 2, 16), 4, True),
    ]


def test_builders_match_kernel_signatures(sig_emu):
    """Every builder fills exactly the kernel's buffer indices, with the dtypes its parameters declare."""
    ds = _dispatches()
    assert {d.kernel for d in ds} == {"rmsnorm_f32", "rmsnorm_bf16", "gated_rmsnorm_f32", "gated_rmsnorm_bf16",
                                      "rope_f32", "attention_f32", "attention_split_f32", "attention_merge_f32",
                                      "conv1d_step_f32", "gated_delta_f32", "router_topk_f32"}
    for d in ds:
        sig = sig_emu.library(d.source).kernels[d.kernel]
        assert set(sig.buffers) == set(d.args), d.kernel
        for i, p in sig.buffers.items():
            a = d.args[i]
            if p.kind == "buffer":
                assert isinstance(a, np.ndarray) and a.dtype == p.dtype, (d.kernel, i, p.type)
                assert a.flags.c_contiguous and (a.flags.writeable or not p.writable), (d.kernel, i)
            else:
                assert not isinstance(a, np.ndarray) and p.scalar in ("uint", "float"), (d.kernel, i, p.type)
        assert np.prod(d.threadgroup) <= 1024 and all(n >= 1 for n in d.grid + d.threadgroup)


def _enum(source: str, name: str) -> int:
    text = (kernel_dir() / source).read_text()
    m = re.search(rf"enum\s*{{[^}}]*\b{name}\s*=\s*([^,}}]+)", text)
    assert m, f"{name} not in {source}"
    return int(eval(m.group(1), {}, {"ATT_EPL": 8, "DELTA_EPL": 8, "ROUTER_PER_LANE": 32}))  # noqa: S307


def test_limits_mirror_the_metal_files():
    assert ops_seq.NORM_PER == _enum("norm.metal", "NORM_PER")
    assert ops_seq.ROPE_MAX_HALF == _enum("rope.metal", "ROPE_MAX_HALF")
    assert ops_seq.ATT_MAX_SG == _enum("attention.metal", "ATT_MAX_SG")
    assert ops_seq.ATT_MAX_HD == _enum("attention.metal", "ATT_MAX_HD")
    assert ops_seq.ATT_MAX_SPLIT == _enum("attention.metal", "ATT_MAX_SPLIT")
    assert ops_seq.CONV_MAX_K == _enum("linear_attention.metal", "CONV_MAX_K")
    assert ops_seq.DELTA_MAX_DK == _enum("linear_attention.metal", "DELTA_MAX_DK")
    assert ops_seq.ROUTER_MAX_E == _enum("router.metal", "ROUTER_MAX_E")
    assert ops_seq.ROUTER_MAX_K == _enum("router.metal", "ROUTER_MAX_K")


def test_geometry():
    # norms: a threadgroup per row, ~4 values per thread, whole simdgroups, at most 1024 threads
    assert ops_seq.norm_geometry(5, 7) == ((5, 1, 1), (32, 1, 1))
    assert ops_seq.norm_geometry(2, 4096) == ((2, 1, 1), (1024, 1, 1))
    assert ops_seq.norm_geometry(1, 200) == ((1, 1, 1), (64, 1, 1))
    assert ops_seq.norm_geometry(1, 8192 * 4) == ((1, 1, 1), (1024, 1, 1))
    # rope: a threadgroup per token
    assert ops_seq.rope_geometry(3, 32, 32) == ((3, 1, 1), (256, 1, 1))
    assert ops_seq.rope_geometry(1, 2, 4) == ((1, 1, 1), (32, 1, 1))
    # attention: a threadgroup per (head, token), one simdgroup per 32 keys up to 8
    assert ops_seq.attention_geometry(32, 1, 5) == ((32, 1, 1), (32, 1, 1))
    assert ops_seq.attention_geometry(8, 2, 128) == ((8, 2, 1), (128, 1, 1))
    assert ops_seq.attention_geometry(8, 1, 100000) == ((8, 1, 1), (256, 1, 1))
    assert ops_seq.attention_geometry(32, 1, 4096, 8) == ((32, 1, 8), (256, 1, 1))
    assert ops_seq.attention_geometry(4, 1, 70, 3) == ((4, 1, 3), (32, 1, 1))
    # key splits: only for long caches on few (head, token) threadgroups, one per 512 keys, at most 32
    assert ops_seq.attention_splits(32, 1, 1023) == 1
    assert ops_seq.attention_splits(32, 1, 4096) == 8
    assert ops_seq.attention_splits(32, 8, 4096) == 1
    assert ops_seq.attention_splits(2, 1, 100000) == 32
    # linear attention: a thread per conv channel; a simdgroup per state row, 4 per group
    assert ops_seq.conv1d_geometry(8192) == ((32, 1, 1), (256, 1, 1))
    assert ops_seq.conv1d_geometry(10) == ((1, 1, 1), (256, 1, 1))
    assert ops_seq.gated_delta_geometry(128, 64) == ((32, 64, 1), (32, 4, 1))
    assert ops_seq.gated_delta_geometry(6, 4) == ((2, 4, 1), (32, 4, 1))
    # router: a simdgroup per token, up to 4 per group
    assert ops_seq.router_geometry(1) == ((1, 1, 1), (32, 1, 1))
    assert ops_seq.router_geometry(9) == ((3, 1, 1), (32, 4, 1))


def test_every_row_head_token_is_covered():
    """Geometry covers the work exactly once: rows x heads x tokens of each builder's launch."""
    ds = {d.kernel: d for d in _dispatches()}
    assert ds["rmsnorm_f32"].grid[0] == 3
    assert ds["attention_f32"].grid[:2] == (4, 2)
    d = ds["gated_delta_f32"]  # dv = 4 rows per head, Hv = 2 heads
    assert d.grid[0] * d.threadgroup[1] >= 4 and (d.grid[0] - 1) * d.threadgroup[1] < 4 and d.grid[1] == 2
    d = ds["router_topk_f32"]
    assert d.grid[0] * d.threadgroup[1] >= 2 and d.threadgroup[0] == 32


def test_convenience_signatures_match_the_reference():
    for name in ("rmsnorm", "gated_rmsnorm", "rope", "attention", "conv1d_step", "gated_delta", "router_topk"):
        mine = list(inspect.signature(getattr(ops_seq, name)).parameters)
        assert mine[0] == "executor"
        assert mine[1:] == list(inspect.signature(getattr(ref, name)).parameters), name


@pytest.mark.parametrize("call,match", [
    (lambda: ops_seq.attention_dispatch(np.zeros((1, 2, 8)), np.zeros((4, 1, 8)), np.zeros((4, 1, 8)), [4], 1.0),
     "positions must lie"),
    (lambda: ops_seq.attention_dispatch(np.zeros((1, 3, 8)), np.zeros((4, 2, 8)), np.zeros((4, 2, 8)), [0], 1.0),
     "not a multiple"),
    (lambda: ops_seq.attention_dispatch(np.zeros((1, 1, 512)), np.zeros((4, 1, 512)), np.zeros((4, 1, 512)), [0],
                                        1.0), "exceeds"),
    (lambda: ops_seq.rope_dispatch(np.zeros((1, 1, 8)), [0], 5, 1e4), "even"),
    (lambda: ops_seq.router_topk_dispatch(np.zeros((1, 4)), 5, True), "must lie in"),
    (lambda: ops_seq.router_topk_dispatch(np.zeros((1, 2048)), 4, True), "at most"),
    (lambda: ops_seq.conv1d_step_dispatch(np.zeros((1, 4)), np.zeros((3, 4)), np.zeros((4, 4))), "float32"),
    (lambda: ops_seq.gated_delta_dispatch(np.zeros((1, 1, 8)), np.zeros((1, 1, 8)), np.zeros((1, 1, 2)),
                                          np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 8, 2), np.float32)),
     "shape"),
    (lambda: ops_seq.rmsnorm_dispatch(np.zeros((2, 4)), np.ones(8, np.float32), 1e-6), "at least"),
])
def test_user_mistakes_are_shape_errors(call, match):
    with pytest.raises(ShapeError, match=match):
        call()


@pytest.mark.parametrize("op, args", [
    ("attention", (np.zeros((1, 3, 8), np.float32), np.zeros((4, 2, 8), np.float32), np.zeros((4, 2, 8), np.float32),
                   [0], 1.0)),
    ("rope", (np.zeros((1, 1, 8), np.float32), [0], 5, 1e4)),
    ("router_topk", (np.zeros((1, 4), np.float32), 5, True)),
    ("gated_delta", (np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32), np.zeros((1, 3, 2), np.float32),
                     np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32), np.zeros((3, 2, 8), np.float32))),
])
def test_both_fast_backends_reject_a_mistake_with_the_same_message(op, args):
    """The shape contracts live once (moepack.runtime.shapes): numba and Metal say the same thing."""
    from moepack.runtime import kernels_numba
    from moepack.runtime.metal.plan import PlanExecutor

    with pytest.raises(ShapeError) as numba_err:
        getattr(kernels_numba, op)(*args)
    with pytest.raises(ShapeError) as metal_err:
        getattr(ops_seq, op)(PlanExecutor(), *args)
    assert numba_err.value.message == metal_err.value.message

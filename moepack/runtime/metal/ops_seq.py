"""Launch builders for the sequence kernels: norm.metal, rope.metal, attention.metal, linear_attention.metal,
router.metal.

Each op has a `<op>_dispatch(...)` that checks its inputs and returns the Dispatch list (output arrays
allocated, or the caller's `out`), and a convenience `<op>(executor, ...)` that runs it and returns the
result with the signature and semantics of the function of the same name in `moepack.runtime.kernels_ref`
(the spec the kernels are tested against), the executor first. The kernels that carry recurrent state
(conv1d_step, gated_delta) update the `state` buffer of their Dispatch IN PLACE; the convenience functions
run them on a copy, so, like the reference, they leave the caller's state alone and return the new one.

Shape legend: T tokens, N rows, D normalised width, H heads (Hq query, Hkv key/value, Hk/Hv linear-attention
key/value), hd head dim, S keys in the cache, C conv channels, Kc conv width, dk/dv linear-attention head
dims, E experts, k experts per token. bf16 arrays are uint16 bit patterns.

The limits below mirror the enums of the .metal files (tests/test_metal_seq.py reads the files and compares).
"""

from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ..shapes import check_attention, check_gated_delta, check_rope, check_router_k
from .dispatch import Dispatch, Executor

NORM_PER = 8  # norm.metal: row values a thread keeps in registers
ROPE_MAX_HALF = 512  # rope.metal: rotary_dim / 2 at most
ATT_MAX_SG = 8  # attention.metal: simdgroups per threadgroup at most
ATT_MAX_HD = 256  # attention.metal: head dim at most
ATT_MAX_SPLIT = 32  # attention.metal: key splits at most
CONV_MAX_K = 8  # linear_attention.metal: conv width at most
DELTA_MAX_DK = 256  # linear_attention.metal: key head dim at most
DELTA_ROWS = 4  # linear_attention.metal launch: state rows (simdgroups) per threadgroup
CONV_TG = 256  # linear_attention.metal launch: threads (channels) per threadgroup of conv1d_step
ROUTER_MAX_E = 1024  # router.metal: experts at most
ROUTER_MAX_K = 32  # router.metal: experts per token at most
ROUTER_TOKENS = 4  # router.metal launch: tokens (simdgroups) per threadgroup

_HINT = "see the shape legend of moepack.runtime.metal.ops_seq"
_U32 = 1 << 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round32(n: int) -> int:
    return 32 * _cdiv(n, 32)


# ------------------------------------------------------------------------------------------- checks


def _act(x, name: str, ndim: int | None = None) -> np.ndarray:
    """A float activation as a C-contiguous float32 array (no copy when it already is one)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if ndim is not None and x.ndim != ndim:
        raise ShapeError(f"{name} must be a {ndim}-D float array, got shape {x.shape}", hint=_HINT)
    return x


def _buffer(a, shape: tuple[int, ...], dtype, name: str) -> np.ndarray:
    """A caller's buffer the kernel writes in place: exactly `shape` and `dtype`, C-contiguous, writeable."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != tuple(shape):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ShapeError(f"{name} must be a {np.dtype(dtype).name} array of shape {tuple(shape)}, got {got}",
                         hint=_HINT)
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise ShapeError(f"{name} must be a C-contiguous, writeable array (the kernel writes it in place)",
                         hint="pass np.ascontiguousarray(...) of it, or a copy")
    return a


def _out(out, shape: tuple[int, ...], name: str, dtype=np.float32) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=dtype)
    return _buffer(out, shape, dtype, f"{name}: out")


def _fits_u32(name: str, *sizes: int) -> None:
    for n in sizes:
        if n >= _U32:
            raise ShapeError(f"{name}: a buffer of {n} elements is too large for the kernels' uint indices")


# ------------------------------------------------------------------------------------------- norms


def norm_geometry(rows: int, dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of the norm kernels: a threadgroup per row, ~4 values per thread."""
    return (rows, 1, 1), (min(1024, max(32, _round32(_cdiv(dim, 4)))), 1, 1)


def _norm_weight(weight, dim: int | None, name: str) -> tuple[np.ndarray, str]:
    """(weight, kernel suffix): bf16 bit patterns (uint16) stay bf16, anything else becomes float32."""
    w = np.asarray(weight)
    suffix = "bf16" if w.dtype == np.uint16 else "f32"
    w = np.ascontiguousarray(w, dtype=np.uint16 if suffix == "bf16" else np.float32)
    if w.ndim != 1 or w.shape[0] == 0 or (dim is not None and w.shape[0] != dim):
        raise ShapeError(f"{name}: weight has shape {w.shape}, expected [{dim if dim is not None else 'D'}]",
                         hint=_HINT)
    return w, suffix


def rmsnorm_dispatch(x, weight, eps, *, out=None) -> list[Dispatch]:
    """y = x * rsqrt(mean(x^2) + eps) * weight over the first D = len(weight) values of each row of x.

    x: f32 [..., W] with W >= D (rows of W values: a row may hold more than the normalised part, e.g. a
    query head followed by its gate); weight: f32 or bf16 [D]  ->  out f32 [..., D] (args[2]).
    """
    w, suffix = _norm_weight(weight, None, "rmsnorm")
    x = _act(x, "rmsnorm: x")
    D = w.shape[0]
    if x.ndim < 1 or x.shape[-1] < D:
        raise ShapeError(f"rmsnorm: x has shape {x.shape}: rows must hold at least the weight's {D} values",
                         hint=_HINT)
    width = x.shape[-1]
    rows = x.size // width
    y = _out(out, x.shape[:-1] + (D,), "rmsnorm")
    _fits_u32("rmsnorm", x.size)
    grid, tg = norm_geometry(rows, D)
    args = {0: x, 1: w, 2: y, 3: D, 4: np.float32(eps), 5: width, 6: D}
    return [Dispatch("norm.metal", f"rmsnorm_{suffix}", args, grid, tg, label=f"rmsnorm {rows}x{D}")] if rows else []


def rmsnorm(executor: Executor, x, weight, eps) -> np.ndarray:
    """kernels_ref.rmsnorm on `executor`: x f32 [..., D], weight f32 (or bf16) [D] -> f32 [..., D]."""
    w = np.asarray(weight)
    x = _act(x, "rmsnorm: x")
    if x.ndim < 1 or w.ndim != 1 or x.shape[-1] != w.shape[0]:
        raise ShapeError(f"rmsnorm: weight has shape {w.shape}, the normalised axis of x {x.shape} differs",
                         hint=_HINT)
    y = np.empty(x.shape, dtype=np.float32)
    ds = rmsnorm_dispatch(x, w, eps, out=y)
    executor.run(ds)
    return y


def gated_rmsnorm_dispatch(x, z, weight, eps, *, out=None) -> list[Dispatch]:
    """rmsnorm(x) * weight * silu(z) over the last axis. x, z: f32 [..., D]; weight f32 or bf16 [D]
    -> out f32 [..., D] (args[3])."""
    x = _act(x, "gated_rmsnorm: x")
    z = _act(z, "gated_rmsnorm: z")
    if x.ndim < 1 or z.shape != x.shape:
        raise ShapeError(f"gated_rmsnorm: x {x.shape} and z {z.shape} must have the same shape", hint=_HINT)
    D = x.shape[-1]
    w, suffix = _norm_weight(weight, D, "gated_rmsnorm")
    rows = x.size // D
    y = _out(out, x.shape, "gated_rmsnorm")
    _fits_u32("gated_rmsnorm", x.size)
    grid, tg = norm_geometry(rows, D)
    args = {0: x, 1: z, 2: w, 3: y, 4: D, 5: np.float32(eps)}
    return [Dispatch("norm.metal", f"gated_rmsnorm_{suffix}", args, grid, tg,
                     label=f"gated_rmsnorm {rows}x{D}")] if rows else []


def gated_rmsnorm(executor: Executor, x, z, weight, eps) -> np.ndarray:
    """kernels_ref.gated_rmsnorm on `executor`: x, z f32 [T, H, dv], weight [dv] -> f32 [T, H, dv]."""
    ds = gated_rmsnorm_dispatch(x, z, weight, eps)
    if not ds:
        return np.empty(np.shape(x), dtype=np.float32)
    executor.run(ds)
    return ds[0].args[3]


# ------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(rotary_dim: int, base: float) -> np.ndarray:
    """The reference's float32 inverse frequencies [rotary_dim / 2] (computed on the host, so every backend
    turns by the same angles)."""
    half = rotary_dim // 2
    return np.exp(np.arange(half, dtype=np.float32) * np.float32(-np.log(base) / max(half, 1))).astype(np.float32)


def rope_geometry(tokens: int, heads: int, half: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of rope_f32: a threadgroup per token, a thread per rotated pair (at most 256)."""
    return (tokens, 1, 1), (min(256, max(32, _round32(heads * half))), 1, 1)


def rope_dispatch(x, positions, rotary_dim, base, *, out=None) -> list[Dispatch]:
    """x: f32 [T, H, hd]; positions [T] (int or float); rotary_dim even, <= hd  ->  out f32 [T, H, hd]
    (args[3]; `out` may be x itself)."""
    x = _act(x, "rope: x", 3)
    T, H, hd = x.shape
    pos = np.ascontiguousarray(positions, dtype=np.float32)
    rotary_dim = check_rope(x.shape, pos, rotary_dim)
    half = rotary_dim // 2
    if half > ROPE_MAX_HALF:
        raise ShapeError(f"rope: rotary_dim {rotary_dim} exceeds the kernel's {2 * ROPE_MAX_HALF}",
                         hint="run this model with --backend numba")
    y = x if out is x else _out(out, x.shape, "rope")
    _fits_u32("rope", x.size)
    inv_freq = rope_inv_freq(rotary_dim, base) if half else np.zeros(1, dtype=np.float32)
    grid, tg = rope_geometry(T, H, half)
    args = {0: x, 1: pos, 2: inv_freq, 3: y, 4: H, 5: hd, 6: half}
    return [Dispatch("rope.metal", "rope_f32", args, grid, tg, label=f"rope {T}x{H}x{hd} r{rotary_dim}")] if T else []


def rope(executor: Executor, x, positions, rotary_dim, base) -> np.ndarray:
    """kernels_ref.rope on `executor`: x f32 [T, H, hd], positions [T] -> f32 [T, H, hd]."""
    x = _act(x, "rope: x", 3)
    y = np.empty(x.shape, dtype=np.float32)
    ds = rope_dispatch(x, positions, rotary_dim, base, out=y)
    if ds:
        executor.run(ds)
    return y


# ------------------------------------------------------------------------------------------- attention


def attention_splits(q_heads: int, tokens: int, keys: int) -> int:
    """Key splits of the launch: 1 (one pass) unless a long cache (>= 1024 keys) would otherwise run on fewer
    than 256 threadgroups (decode: Hq threadgroups); then a split per 512 keys, at most ATT_MAX_SPLIT."""
    if keys < 1024 or q_heads * tokens >= 256:
        return 1
    return min(ATT_MAX_SPLIT, _cdiv(keys, 512))


def attention_geometry(q_heads: int, tokens: int, keys: int,
                       splits: int = 1) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of attention_f32 (splits = 1) or attention_split_f32: a threadgroup per (query
    head, token, split), one simdgroup per 32 of its keys, 1 to 8."""
    per_group = _cdiv(keys, splits)
    nsg = min(ATT_MAX_SG, max(1, _cdiv(per_group, 32)))
    return (q_heads, tokens, splits), (32 * nsg, 1, 1)


def attention_dispatch(q, k, v, q_positions, scale, *, out=None, splits: int | None = None) -> list[Dispatch]:
    """Causal GQA over the cache. q: f32 [T, Hq, hd]; k, v: f32 [S, Hkv, hd]; q_positions: int [T], each in
    [0, S)  ->  out f32 [T, Hq, hd] (the last dispatch's output). `splits`: key splits (1 = one pass; more =
    attention_split_f32 into [T, Hq, splits] partials, then attention_merge_f32); default attention_splits()."""
    q = _act(q, "attention: q", 3)
    k = _act(k, "attention: k", 3)
    v = _act(v, "attention: v", 3)
    pos = np.asarray(q_positions)
    T, Hq, hd, S, Hkv = check_attention(q, k, v, pos)
    if hd > ATT_MAX_HD:
        raise ShapeError(f"attention: head dim {hd} exceeds the kernel's {ATT_MAX_HD}",
                         hint="run this model with --backend numba")
    pos = np.ascontiguousarray(pos, dtype=np.int32)
    y = _out(out, q.shape, "attention")
    _fits_u32("attention", q.size, k.size)
    if not q.size:
        return []
    visible = int(pos.max()) + 1  # keys any query of this call sees
    n = attention_splits(Hq, T, visible) if splits is None else int(splits)
    if not 1 <= n <= ATT_MAX_SPLIT:
        raise ShapeError(f"attention: {n} key splits, expected 1 to {ATT_MAX_SPLIT}", hint=_HINT)
    grid, tg = attention_geometry(Hq, T, visible, n)
    label = f"attention {T}x{Hq}x{hd} S={S}"
    if n == 1:
        args = {0: q, 1: k, 2: v, 3: pos, 4: y, 5: Hq, 6: Hkv, 7: hd, 8: S, 9: np.float32(scale)}
        return [Dispatch("attention.metal", "attention_f32", args, grid, tg, label=label)]
    part_m = np.empty((T, Hq, n), dtype=np.float32)
    part_l = np.empty((T, Hq, n), dtype=np.float32)
    part_o = np.empty((T, Hq, n, hd), dtype=np.float32)
    _fits_u32("attention", part_o.size)
    split = {0: q, 1: k, 2: v, 3: pos, 4: part_m, 5: part_l, 6: part_o, 7: Hq, 8: Hkv, 9: hd, 10: S,
             11: np.float32(scale), 12: _cdiv(visible, n)}
    merge = {0: part_m, 1: part_l, 2: part_o, 3: y, 4: Hq, 5: hd, 6: n}
    return [Dispatch("attention.metal", "attention_split_f32", split, grid, tg, label=f"{label} split {n}"),
            Dispatch("attention.metal", "attention_merge_f32", merge, (Hq, T, 1),
                     (min(256, max(32, _round32(hd))), 1, 1), label=f"{label} merge {n}")]


def attention(executor: Executor, q, k, v, q_positions, scale) -> np.ndarray:
    """kernels_ref.attention on `executor`: q f32 [T, Hq, hd], k, v f32 [S, Hkv, hd] -> f32 [T, Hq, hd]."""
    y = np.zeros(np.shape(q), dtype=np.float32)
    ds = attention_dispatch(q, k, v, q_positions, scale, out=y)
    if ds:
        executor.run(ds)
    return y


# ------------------------------------------------------------------------------------------- linear attention


def conv1d_geometry(channels: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of conv1d_step_f32: a thread per channel."""
    return (max(1, _cdiv(channels, CONV_TG)), 1, 1), (CONV_TG, 1, 1)


def conv1d_step_dispatch(x, state, weight, *, out=None) -> list[Dispatch]:
    """Depthwise causal conv + SiLU. x: f32 [T, C]; state: f32 [Kc-1, C], updated IN PLACE to the last Kc-1
    rows of [state; x] (must be a writeable C-contiguous float32 array); weight: f32 [C, Kc]
    -> out f32 [T, C] (args[3])."""
    x = _act(x, "conv1d_step: x", 2)
    weight = _act(weight, "conv1d_step: weight", 2)
    T, C = x.shape
    Kc = weight.shape[1]
    if weight.shape[0] != C or not 1 <= Kc <= CONV_MAX_K:
        raise ShapeError(f"conv1d_step: weight has shape {weight.shape}, expected [{C}, Kc] with 1 <= Kc <= "
                         f"{CONV_MAX_K}", hint=_HINT)
    state = _buffer(state, (Kc - 1, C), np.float32, "conv1d_step: state")
    y = _out(out, x.shape, "conv1d_step")
    _fits_u32("conv1d_step", x.size)
    if not C:
        return []
    grid, tg = conv1d_geometry(C)
    state_arg = state if state.size else np.zeros(1, dtype=np.float32)  # Kc = 1: no state; any buffer
    args = {0: x, 1: state_arg, 2: weight, 3: y, 4: T, 5: C, 6: Kc}
    return [Dispatch("linear_attention.metal", "conv1d_step_f32", args, grid, tg, label=f"conv1d {T}x{C} k{Kc}")]


def conv1d_step(executor: Executor, x, state, weight):
    """kernels_ref.conv1d_step on `executor` -> (y f32 [T, C], new_state f32 [Kc-1, C]); `state` is left as is."""
    new_state = np.array(state, dtype=np.float32, order="C", copy=True)
    ds = conv1d_step_dispatch(x, new_state, weight)
    if ds:
        executor.run(ds)
        return ds[0].args[3], new_state
    return np.zeros(np.shape(x), dtype=np.float32), new_state


def gated_delta_geometry(dv: int, v_heads: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of gated_delta_f32: a simdgroup per state row (h, i), DELTA_ROWS rows per group."""
    return (max(1, _cdiv(dv, DELTA_ROWS)), v_heads, 1), (32, DELTA_ROWS, 1)


def gated_delta_dispatch(q, k, v, g, beta, state, *, out=None) -> list[Dispatch]:
    """The gated delta rule over T tokens. q, k: f32 [T, Hk, dk]; v: f32 [T, Hv, dv]; g, beta: f32 [T, Hv];
    state: f32 [Hv, dv, dk], updated IN PLACE (writeable, C-contiguous float32)  ->  out f32 [T, Hv, dv]
    (args[6])."""
    q = _act(q, "gated_delta: q", 3)
    k = _act(k, "gated_delta: k", 3)
    v = _act(v, "gated_delta: v", 3)
    g = _act(g, "gated_delta: g", 2)
    beta = _act(beta, "gated_delta: beta", 2)
    T, Hk, dk, Hv, dv = check_gated_delta(q, k, v, g, beta)
    if dk > DELTA_MAX_DK:
        raise ShapeError(f"gated_delta: key head dim {dk} exceeds the kernel's {DELTA_MAX_DK}",
                         hint="run this model with --backend numba")
    state = _buffer(state, (Hv, dv, dk), np.float32, "gated_delta: state")
    y = _out(out, (T, Hv, dv), "gated_delta")
    _fits_u32("gated_delta", state.size, q.size, v.size)
    if not state.size:
        y[:] = 0
        return []
    grid, tg = gated_delta_geometry(dv, Hv)
    args = {0: q, 1: k, 2: v, 3: g, 4: beta, 5: state, 6: y, 7: T, 8: Hk, 9: Hv, 10: dk, 11: dv}
    return [Dispatch("linear_attention.metal", "gated_delta_f32", args, grid, tg,
                     label=f"gated_delta {T}x{Hv}x{dv}x{dk}")]


def gated_delta(executor: Executor, q, k, v, g, beta, state):
    """kernels_ref.gated_delta on `executor` -> (out f32 [T, Hv, dv], new_state f32 [Hv, dv, dk]); `state`
    is left as is."""
    new_state = np.array(state, dtype=np.float32, order="C", copy=True)
    ds = gated_delta_dispatch(q, k, v, g, beta, new_state)
    if ds:
        executor.run(ds)
        return ds[0].args[6], new_state
    return np.zeros((np.shape(q)[0], np.shape(v)[1], np.shape(v)[2]), dtype=np.float32), new_state


# ------------------------------------------------------------------------------------------- routing


def router_geometry(tokens: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of router_topk_f32: a simdgroup per token, up to ROUTER_TOKENS per group."""
    r = min(ROUTER_TOKENS, max(1, tokens))
    return (max(1, _cdiv(tokens, r)), 1, 1), (32, r, 1)


def router_topk_dispatch(logits, k, norm_topk_prob, *, idx=None, weights=None) -> list[Dispatch]:
    """Softmax over E experts, the k most probable (ties to the lower index), renormalised if asked.
    logits: f32 [T, E]  ->  idx int32 [T, k] (args[1]), weights f32 [T, k] (args[2])."""
    logits = _act(logits, "router_topk: logits", 2)
    T, E = logits.shape
    k = check_router_k(k, E)
    if E > ROUTER_MAX_E or k > ROUTER_MAX_K:
        raise ShapeError(f"router_topk: {E} experts, top {k}: the kernel takes at most {ROUTER_MAX_E} experts "
                         f"and top {ROUTER_MAX_K}", hint="run this model with --backend numba")
    idx = np.empty((T, k), np.int32) if idx is None else _buffer(idx, (T, k), np.int32, "router_topk: idx")
    weights = _out(weights, (T, k), "router_topk: weights")
    _fits_u32("router_topk", logits.size)
    if not T:
        return []
    grid, tg = router_geometry(T)
    args = {0: logits, 1: idx, 2: weights, 3: T, 4: E, 5: k, 6: int(bool(norm_topk_prob))}
    return [Dispatch("router.metal", "router_topk_f32", args, grid, tg, label=f"router {T}x{E} top{k}")]


def router_topk(executor: Executor, logits, k, norm_topk_prob):
    """kernels_ref.router_topk on `executor` -> (idx int32 [T, k], weights f32 [T, k]), highest first."""
    ds = router_topk_dispatch(logits, k, norm_topk_prob)
    if not ds:
        return np.empty((0, int(k)), dtype=np.int32), np.empty((0, int(k)), dtype=np.float32)
    executor.run(ds)
    return ds[0].args[1], ds[0].args[2]

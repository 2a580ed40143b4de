"""Launch builders for `metal/glue.metal` (the small steps between the big kernels of a device-resident decode
step) with their numpy references, and launch builders of the existing kernels over DeviceBuffers.

Glue ops: for each, ``<op>_ref`` (numpy float32, the spec the kernel is tested against), ``<op>_dispatch``
(the Dispatch list; arguments may be numpy arrays or DeviceBuffers) and ``<op>(executor, ...)`` running it
on numpy inputs and returning the result (tests, selftest).

The ``dev_*`` builders launch kernels of quant.metal, norm.metal, rope.metal, attention.metal,
linear_attention.metal and router.metal with explicit sizes instead of numpy shape checks, so their
buffers can be DeviceBuffers (``moepack.runtime.metal.dispatch``): the geometry comes from the same
functions ops_quant / ops_seq use, so every executor and both paths launch alike.

Shape legend: n elements, rows x width, D row width, T tokens, in/out matvec widths, Hq/Hkv heads, hd head
dim, S cache positions, C conv channels, Kc conv width, nk/nv and dk/dv Gated-DeltaNet heads and dims.
"""

from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from . import ops_quant, ops_seq
from .dispatch import DeviceBuffer, Dispatch, Executor

SOURCE = "glue.metal"
TG = 256  # threads per threadgroup of the elementwise kernels
NORM_PER = 8  # glue.metal GLUE_NORM_PER
MV_ROWS = 8  # glue.metal GLUE_MV_ROWS
FLOAT_SUFFIX = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _elementwise(n: int):
    return (max(1, _cdiv(n, TG)), 1, 1), (TG, 1, 1)


def _f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1) / (np.float32(1) + np.exp(-z))


# ------------------------------------------------------------------------------------------- references


def add_ref(a, b) -> np.ndarray:
    return _f32(a) + _f32(b)


def sigmoid_gate_ref(x, gate, gate_stride: int, gate_off: int) -> np.ndarray:
    """x f32 [rows, width] * sigmoid(gate[r * gate_stride + gate_off + i]) -> f32 [rows, width]."""
    x = _f32(x)
    rows, width = x.shape
    g = _f32(gate).reshape(-1)
    cols = np.arange(rows)[:, None] * gate_stride + gate_off + np.arange(width)[None, :]
    return x * _sigmoid(g[cols])


def swiglu_ref(g, u) -> np.ndarray:
    g = _f32(g)
    return g * _sigmoid(g) * _f32(u)


def gdn_gates_ref(b, a, A, dt_bias) -> tuple[np.ndarray, np.ndarray]:
    """(beta, g) = (sigmoid(b), exp(-A * softplus(a + dt_bias))), as the model code computes them."""
    beta = _sigmoid(_f32(b))
    g = np.exp(-_f32(A) * np.logaddexp(_f32(a) + _f32(dt_bias), np.float32(0))).astype(np.float32)
    return beta, g


def l2norm_scale_ref(x, rows_a: int, scale_a: float, scale_b: float, eps: float) -> np.ndarray:
    """Each row of x f32 [rows, D] over its L2 norm (sqrt(sum x^2 + eps)), times scale_a for the first
    rows_a rows and scale_b for the rest."""
    x = _f32(x)
    inv = np.float32(1) / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + np.float32(eps))
    scale = np.where(np.arange(x.shape[0])[:, None] < rows_a, np.float32(scale_a), np.float32(scale_b))
    return (x * inv * scale).astype(np.float32)


def gather_ref(src, idx) -> np.ndarray:
    return _f32(src).reshape(-1)[np.asarray(idx, dtype=np.int64)]


def matvec_ref(x, w, dtype: str) -> np.ndarray:
    """x f32 [T, in] @ float weights [out, in] (stored as `dtype`: 'F32' | 'F16' | 'BF16' bits) -> [T, out]."""
    return _f32(x) @ _weights_f32(w, dtype).T


def embed_rows_ref(ids, table, dtype: str) -> np.ndarray:
    return _weights_f32(np.asarray(table)[np.asarray(ids, dtype=np.int64)], dtype)


def _weights_f32(w, dtype: str) -> np.ndarray:
    from ...quant.bf16 import bf16_to_f32

    w = np.asarray(w)
    return bf16_to_f32(np.ascontiguousarray(w)) if dtype == "BF16" else w.astype(np.float32)


# ------------------------------------------------------------------------------------------- glue builders


def add_dispatch(a, b, out, n: int) -> list[Dispatch]:
    grid, tg = _elementwise(n)
    return [Dispatch(SOURCE, "add_f32", {0: a, 1: b, 2: out, 3: int(n)}, grid, tg, label=f"add {n}")]


def sigmoid_gate_dispatch(x, gate, out, rows: int, width: int, gate_stride: int, gate_off: int) -> list[Dispatch]:
    grid, tg = _elementwise(rows * width)
    args = {0: x, 1: gate, 2: out, 3: int(rows), 4: int(width), 5: int(gate_stride), 6: int(gate_off)}
    return [Dispatch(SOURCE, "sigmoid_gate_f32", args, grid, tg, label=f"sigmoid gate {rows}x{width}")]


def swiglu_dispatch(g, u, out, n: int) -> list[Dispatch]:
    grid, tg = _elementwise(n)
    return [Dispatch(SOURCE, "swiglu_f32", {0: g, 1: u, 2: out, 3: int(n)}, grid, tg, label=f"swiglu {n}")]


def gdn_gates_dispatch(b, a, A, dt_bias, beta, g, n: int) -> list[Dispatch]:
    grid, tg = _elementwise(n)
    args = {0: b, 1: a, 2: A, 3: dt_bias, 4: beta, 5: g, 6: int(n)}
    return [Dispatch(SOURCE, "gdn_gates_f32", args, grid, tg, label=f"gdn gates {n}")]


def l2norm_geometry(D: int):
    tpg = min(1024, max(32, 32 * _cdiv(_cdiv(D, NORM_PER), 32)))
    return tpg


def l2norm_scale_dispatch(x, y, rows: int, D: int, rows_a: int, scale_a: float, scale_b: float,
                          eps: float) -> list[Dispatch]:
    if D > NORM_PER * 1024:
        raise ShapeError(f"l2norm_scale: rows of {D} exceed the kernel's {NORM_PER * 1024}")
    args = {0: x, 1: y, 2: int(D), 3: int(rows_a), 4: np.float32(scale_a), 5: np.float32(scale_b),
            6: np.float32(eps)}
    return [Dispatch(SOURCE, "l2norm_scale_f32", args, (max(1, rows), 1, 1), (l2norm_geometry(D), 1, 1),
                     label=f"l2norm {rows}x{D}")]


def gather_dispatch(src, idx, dst, n: int) -> list[Dispatch]:
    grid, tg = _elementwise(n)
    return [Dispatch(SOURCE, "gather_f32", {0: src, 1: idx, 2: dst, 3: int(n)}, grid, tg, label=f"gather {n}")]


def copy_dispatch(src, dst, n: int) -> list[Dispatch]:
    grid, tg = _elementwise(n)
    return [Dispatch(SOURCE, "copy_f32", {0: src, 1: dst, 2: int(n)}, grid, tg, label=f"copy {n}")]


def matvec_dispatch(x, w, y, dtype: str, in_dim: int, out_dim: int, tokens: int = 1, y_off: int = 0,
                    y_stride: int | None = None) -> list[Dispatch]:
    """Float-weight linear: y[t, y_off + o] = x[t] . w[o] (w stored as `dtype`, 'F32' | 'F16' | 'BF16')."""
    kernel = f"matvec_{FLOAT_SUFFIX[dtype]}"
    args = {0: x, 1: w, 2: y, 3: int(in_dim), 4: int(out_dim), 5: int(y_off),
            6: int(out_dim if y_stride is None else y_stride)}
    return [Dispatch(SOURCE, kernel, args, (max(1, _cdiv(out_dim, MV_ROWS)), tokens, 1), (32 * MV_ROWS, 1, 1),
                     label=f"matvec {out_dim}x{in_dim} {dtype}")]


def embed_rows_dispatch(ids, table, out, dtype: str, D: int, tokens: int = 1) -> list[Dispatch]:
    kernel = f"embed_rows_{FLOAT_SUFFIX[dtype]}"
    return [Dispatch(SOURCE, kernel, {0: ids, 1: table, 2: out, 3: int(D)}, (max(1, _cdiv(D, TG)), tokens, 1),
                     (TG, 1, 1), label=f"embed rows {tokens}x{D}")]


# ------------------------------------------------------------------------------------------- conveniences


def _run_out(executor: Executor, ds: list[Dispatch], out: np.ndarray) -> np.ndarray:
    if ds:
        executor.run(ds)
    return out


def add(executor: Executor, a, b) -> np.ndarray:
    a, b = _f32(a), _f32(b)
    out = np.empty_like(a)
    return _run_out(executor, add_dispatch(a, b, out, a.size), out)


def sigmoid_gate(executor: Executor, x, gate, gate_stride: int, gate_off: int) -> np.ndarray:
    x = _f32(x)
    out = np.empty_like(x)
    return _run_out(executor, sigmoid_gate_dispatch(x, _f32(gate), out, x.shape[0], x.shape[1], gate_stride,
                                                    gate_off), out)


def swiglu(executor: Executor, g, u) -> np.ndarray:
    g, u = _f32(g), _f32(u)
    out = np.empty_like(g)
    return _run_out(executor, swiglu_dispatch(g, u, out, g.size), out)


def gdn_gates(executor: Executor, b, a, A, dt_bias) -> tuple[np.ndarray, np.ndarray]:
    b = _f32(b)
    beta, g = np.empty_like(b), np.empty_like(b)
    executor.run(gdn_gates_dispatch(b, _f32(a), _f32(A), _f32(dt_bias), beta, g, b.size))
    return beta, g


def l2norm_scale(executor: Executor, x, rows_a: int, scale_a: float, scale_b: float, eps: float) -> np.ndarray:
    x = _f32(x)
    y = np.empty_like(x)
    return _run_out(executor, l2norm_scale_dispatch(x, y, x.shape[0], x.shape[1], rows_a, scale_a, scale_b, eps), y)


def gather(executor: Executor, src, idx) -> np.ndarray:
    idx = np.ascontiguousarray(idx, dtype=np.int32)
    dst = np.empty(idx.shape, np.float32)
    return _run_out(executor, gather_dispatch(_f32(src), idx, dst, idx.size), dst)


def matvec(executor: Executor, x, w, dtype: str) -> np.ndarray:
    x = _f32(x)
    w = np.ascontiguousarray(w)
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    return _run_out(executor, matvec_dispatch(x, w, y, dtype, x.shape[1], w.shape[0], x.shape[0]), y)


def embed_rows(executor: Executor, ids, table, dtype: str) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    table = np.ascontiguousarray(table)
    out = np.empty((ids.size, table.shape[1]), np.float32)
    return _run_out(executor, embed_rows_dispatch(ids, table, out, dtype, table.shape[1], ids.size), out)


# ------------------------------------------------------------------------------------------- existing kernels
# over DeviceBuffers (or arrays): explicit sizes, the ops_* geometry, the kernels' documented arg indices


def dev_qmv(x, w, scales, biases, y, bits: int, group_size: int, in_dim: int, out_dim: int, tokens: int = 1,
            y_off: int = 0) -> list[Dispatch]:
    """quant.metal qmv_b{bits}: y[t, y_off + o] (rows of out_dim) = x[t] . dequant(W)[o]."""
    grid, tg, ks = ops_quant.qmv_geometry(out_dim, in_dim, tokens, 1, bits=bits)
    args = {0: x, 1: w, 2: scales, 3: biases, 4: y, 5: int(in_dim), 6: int(out_dim), 7: int(group_size),
            8: int(y_off), 9: ks}
    return [Dispatch(ops_quant.SOURCE, f"qmv_b{bits}", args, grid, tg, label=f"qmv {out_dim}x{in_dim} q{bits}")]


def dev_gate_up(x, gate, up, h, in_dim: int, out_dim: int, tokens: int = 1) -> list[Dispatch]:
    """quant.metal gate_up_swiglu: h = silu(x @ gate^T) * (x @ up^T) for two QLinears of one group size."""
    grid, tg, ks = ops_quant.qmv_geometry(out_dim, in_dim, tokens, matrices=2, bits=max(gate.bits, up.bits))
    args = {0: x, 1: gate.w, 2: gate.scales, 3: gate.biases, 4: up.w, 5: up.scales, 6: up.biases, 7: h,
            8: int(in_dim), 9: int(out_dim), 10: int(gate.group_size), 11: int(gate.bits), 12: int(up.bits), 13: ks}
    return [Dispatch(ops_quant.SOURCE, "gate_up_swiglu", args, grid, tg, label=f"gate_up {out_dim}x{in_dim}")]


def dev_experts(x, block: np.ndarray, layout, h, y) -> list[Dispatch]:
    """The n routed experts of one decode token from their record rows (uint8 [n, stride]): fused gate/up +
    SwiGLU into h [n, I], then down into y [n, D] (two launches, grid.z = expert); x [D] shared (stride 0)."""
    n, stride = block.shape
    flat = block.reshape(-1)
    gw, gsc, gbi, g_bits, gs, I, D = ops_quant._proj(layout, "gate")
    uw, usc, ubi, u_bits, _, _, _ = ops_quant._proj(layout, "up")
    dw, dsc, dbi, d_bits, d_gs, D_out, I_in = ops_quant._proj(layout, "down")
    grid, tg, ks = ops_quant.qmv_geometry(I, D, 1, n, matrices=2, bits=max(g_bits, u_bits))
    first = {0: x, 1: flat, 2: gw.offset, 3: gsc.offset, 4: gbi.offset, 5: uw.offset, 6: usc.offset, 7: ubi.offset,
             8: h, 9: D, 10: I, 11: gs, 12: g_bits, 13: u_bits, 14: stride, 15: 0, 16: I, 17: ks}
    grid2, tg2, ks2 = ops_quant.qmv_geometry(D_out, I_in, 1, n, bits=d_bits)
    down = {0: h, 1: flat, 2: dw.offset, 3: dsc.offset, 4: dbi.offset, 5: y, 6: I_in, 7: D_out, 8: d_gs, 9: 0,
            10: stride, 11: I_in, 12: D_out, 13: ks2}
    return [Dispatch(ops_quant.SOURCE, ops_quant.gate_up_record_kernel(g_bits, u_bits), first, grid, tg,
                     label=f"{n} experts gate_up"),
            Dispatch(ops_quant.SOURCE, f"qmv_rec_b{d_bits}", down, grid2, tg2, label=f"{n} experts down")]


def dev_combine(residual, y, weights, out, D: int, K: int, shared=None, shared_logit=None) -> list[Dispatch]:
    """quant.metal moe_combine(_shared) for one token: out = residual + sum_k w_k y_k (+ sigmoid(s) shared)."""
    args = {0: residual, 1: y, 2: weights, 3: out, 4: int(D), 5: int(K), 6: 1}
    kernel = "moe_combine"
    if shared is not None:
        args.update({7: shared, 8: shared_logit})
        kernel = "moe_combine_shared"
    return [Dispatch(ops_quant.SOURCE, kernel, args, (_cdiv(D, ops_quant.QCOMB_TG), 1, 1), (ops_quant.QCOMB_TG, 1, 1),
                     label=f"{kernel} K={K}")]


def dev_qembed(ids, table, out, D: int, tokens: int = 1) -> list[Dispatch]:
    bits = table.bits
    grid = (_cdiv(D * bits // 32, ops_quant.QEMB_TG), tokens, 1)
    args = {0: ids, 1: table.w, 2: table.scales, 3: table.biases, 4: out, 5: int(D), 6: int(table.group_size)}
    return [Dispatch(ops_quant.SOURCE, f"qembed_b{bits}", args, grid, (ops_quant.QEMB_TG, 1, 1),
                     label=f"embed {tokens} x {D} q{bits}")]


def dev_rmsnorm(x, weight, y, rows: int, D: int, eps: float, x_stride: int | None = None,
                y_stride: int | None = None) -> list[Dispatch]:
    suffix = "bf16" if weight.dtype == np.uint16 else "f32"
    grid, tg = ops_seq.norm_geometry(rows, D)
    args = {0: x, 1: weight, 2: y, 3: int(D), 4: np.float32(eps), 5: int(D if x_stride is None else x_stride),
            6: int(D if y_stride is None else y_stride)}
    return [Dispatch("norm.metal", f"rmsnorm_{suffix}", args, grid, tg, label=f"rmsnorm {rows}x{D}")]


def dev_gated_rmsnorm(x, z, weight, y, rows: int, D: int, eps: float) -> list[Dispatch]:
    suffix = "bf16" if weight.dtype == np.uint16 else "f32"
    grid, tg = ops_seq.norm_geometry(rows, D)
    args = {0: x, 1: z, 2: weight, 3: y, 4: int(D), 5: np.float32(eps)}
    return [Dispatch("norm.metal", f"gated_rmsnorm_{suffix}", args, grid, tg, label=f"gated_rmsnorm {rows}x{D}")]


def dev_rope(x, pos, inv_freq, y, heads: int, hd: int, rotary_dim: int, tokens: int = 1) -> list[Dispatch]:
    half = rotary_dim // 2
    if half > ops_seq.ROPE_MAX_HALF:
        raise ShapeError(f"rope: rotary_dim {rotary_dim} exceeds the kernel's {2 * ops_seq.ROPE_MAX_HALF}")
    grid, tg = ops_seq.rope_geometry(tokens, heads, half)
    args = {0: x, 1: pos, 2: inv_freq, 3: y, 4: int(heads), 5: int(hd), 6: int(half)}
    return [Dispatch("rope.metal", "rope_f32", args, grid, tg, label=f"rope {tokens}x{heads}x{hd} r{rotary_dim}")]


def dev_attention(q, k, v, pos, out, Hq: int, Hkv: int, hd: int, visible: int, scale: float,
                  scratch=None) -> list[Dispatch]:
    """One decode token's attention over the first `visible` cache positions (k, v [capacity, Hkv, hd]);
    split-K (scratch = (part_m [Hq, >= n], part_l, part_o [Hq, >= n, hd]) buffers) as ops_seq chooses."""
    if hd > ops_seq.ATT_MAX_HD:
        raise ShapeError(f"attention: head dim {hd} exceeds the kernel's {ops_seq.ATT_MAX_HD}")
    n = ops_seq.attention_splits(Hq, 1, visible)
    grid, tg = ops_seq.attention_geometry(Hq, 1, visible, n)
    label = f"attention 1x{Hq}x{hd} S={visible}"
    if n == 1 or scratch is None:
        if n != 1:
            grid, tg = ops_seq.attention_geometry(Hq, 1, visible, 1)
        args = {0: q, 1: k, 2: v, 3: pos, 4: out, 5: int(Hq), 6: int(Hkv), 7: int(hd), 8: int(visible),
                9: np.float32(scale)}
        return [Dispatch("attention.metal", "attention_f32", args, grid, tg, label=label)]
    part_m, part_l, part_o = (b.view(0, (Hq, n) if i < 2 else (Hq, n, hd)) for i, b in enumerate(scratch))
    split = {0: q, 1: k, 2: v, 3: pos, 4: part_m, 5: part_l, 6: part_o, 7: int(Hq), 8: int(Hkv), 9: int(hd),
             10: int(visible), 11: np.float32(scale), 12: _cdiv(visible, n)}
    merge = {0: part_m, 1: part_l, 2: part_o, 3: out, 4: int(Hq), 5: int(hd), 6: n}
    return [Dispatch("attention.metal", "attention_split_f32", split, grid, tg, label=f"{label} split {n}"),
            Dispatch("attention.metal", "attention_merge_f32", merge, (Hq, 1, 1),
                     (min(256, max(32, 32 * _cdiv(hd, 32))), 1, 1), label=f"{label} merge {n}")]


def dev_conv1d(x, state, weight, y, C: int, Kc: int) -> list[Dispatch]:
    grid, tg = ops_seq.conv1d_geometry(C)
    args = {0: x, 1: state, 2: weight, 3: y, 4: 1, 5: int(C), 6: int(Kc)}
    return [Dispatch("linear_attention.metal", "conv1d_step_f32", args, grid, tg, label=f"conv1d 1x{C} k{Kc}")]


def dev_gated_delta(q, k, v, g, beta, state, out, Hk: int, Hv: int, dk: int, dv: int) -> list[Dispatch]:
    if dk > ops_seq.DELTA_MAX_DK:
        raise ShapeError(f"gated_delta: key head dim {dk} exceeds the kernel's {ops_seq.DELTA_MAX_DK}")
    grid, tg = ops_seq.gated_delta_geometry(dv, Hv)
    args = {0: q, 1: k, 2: v, 3: g, 4: beta, 5: state, 6: out, 7: 1, 8: int(Hk), 9: int(Hv), 10: int(dk),
            11: int(dv)}
    return [Dispatch("linear_attention.metal", "gated_delta_f32", args, grid, tg, label=f"gated_delta 1x{Hv}x{dv}x{dk}")]


def dev_router(logits, idx, weights, E: int, k: int, norm_topk_prob: bool) -> list[Dispatch]:
    if E > ops_seq.ROUTER_MAX_E or k > ops_seq.ROUTER_MAX_K:
        raise ShapeError(f"router_topk: {E} experts, top {k}: beyond the kernel's {ops_seq.ROUTER_MAX_E} / "
                         f"{ops_seq.ROUTER_MAX_K}")
    grid, tg = ops_seq.router_geometry(1)
    args = {0: logits, 1: idx, 2: weights, 3: 1, 4: int(E), 5: int(k), 6: int(bool(norm_topk_prob))}
    return [Dispatch("router.metal", "router_topk_f32", args, grid, tg, label=f"router 1x{E} top{k}")]


__all__ = [
    "add_ref", "sigmoid_gate_ref", "swiglu_ref", "gdn_gates_ref", "l2norm_scale_ref", "gather_ref", "matvec_ref",
    "embed_rows_ref", "add", "sigmoid_gate", "swiglu", "gdn_gates", "l2norm_scale", "gather", "matvec",
    "embed_rows", "DeviceBuffer",
]

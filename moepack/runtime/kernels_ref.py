"""Numpy reference kernels of the runtime: the spec the fast backends (numba, Metal) are checked against.

Everything computes in float32, like mlx-lm with ``model.set_dtype(mx.float32)``. The model code calls these
through a kernel-module object (``moepack.runtime.kernels_ref`` or ``kernels_numba``, same names and
signatures), never directly, so both backends run the same model code.

Shape legend: T = tokens of this call, S = keys in the cache (all positions so far, new ones included),
D = hidden, E = routed experts, k = experts per token, H = heads (Hq query, Hkv key/value, Hk/Hv of the
linear attention), hd = head dim, dk/dv = linear-attention key/value head dims, C = conv channels,
Kc = conv kernel width, gs = quantization group size. bf16 tensors are uint16 bit patterns.

Quantized weights are MLX affine: ``W[o, i] = scale[o, i // gs] * q[o, i] + bias[o, i // gs]`` with the
codes packed little-end-first into uint32 words (see ``moepack.quant.affine_ref``).
"""

from __future__ import annotations

import numpy as np

from ..quant.affine_ref import dequantize

# qmatmul dequantizes at most this many weight values at a time, so a 248k x 4096 lm_head needs
# ~64 MiB of scratch rather than 4 GiB.
_DEQUANT_CHUNK = 1 << 24

__all__ = [
    "qmatmul",
    "expert_ffn",
    "rmsnorm",
    "gated_rmsnorm",
    "rope",
    "attention",
    "conv1d_step",
    "gated_delta",
    "router_topk",
    "qembedding",
]


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x); exp overflow for very negative x gives sigmoid 0 (silu -0), as in MLX
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(-x))


# ---------------------------------------------------------------------------------------------- matmuls


def qmatmul(x, w, scales, biases, bits, group_size) -> np.ndarray:
    """y = x @ dequant(W).T.

    x: f32 [T, in]; w: uint32 [out, in*bits/32]; scales, biases: bf16 [out, in/gs]  ->  y: f32 [T, out]
    """
    x = _f32(x)
    out_dim = w.shape[0]
    rows = max(1, _DEQUANT_CHUNK // max(1, x.shape[-1]))
    y = np.empty((x.shape[0], out_dim), dtype=np.float32)  # [T, out]
    for o0 in range(0, out_dim, rows):
        o1 = min(out_dim, o0 + rows)
        wf = dequantize(w[o0:o1], scales[o0:o1], biases[o0:o1], bits, group_size)  # [o1-o0, in] f32
        y[:, o0:o1] = x @ wf.T
    return y


def expert_ffn(x, gw, gs_, gb, uw, us, ub, dw, ds, db, bits, group_size) -> np.ndarray:
    """One SwiGLU expert: down(silu(gate(x)) * up(x)).

    x: f32 [T, D]; gate/up: uint32 [I, D*b/32] + bf16 [I, D/gs]; down: uint32 [D, I*b/32] + bf16 [D, I/gs];
    bits: (gate_bits, up_bits, down_bits) (an int means all three); group_size: one int for all three.
    -> f32 [T, D]
    """
    gb_bits, ub_bits, db_bits = (bits, bits, bits) if np.isscalar(bits) else bits
    g = qmatmul(x, gw, gs_, gb, gb_bits, group_size)  # [T, I]
    u = qmatmul(x, uw, us, ub, ub_bits, group_size)  # [T, I]
    h = _silu(g) * u  # [T, I]
    return qmatmul(h, dw, ds, db, db_bits, group_size)  # [T, D]


def qembedding(ids, w, scales, biases, bits, group_size) -> np.ndarray:
    """Rows `ids` of a quantized embedding table, dequantized.

    ids: int [T]; w: uint32 [V, D*bits/32]; scales, biases: bf16 [V, D/gs]  ->  f32 [T, D]
    """
    ids = np.asarray(ids, dtype=np.int64)
    return dequantize(w[ids], scales[ids], biases[ids], bits, group_size)


# ---------------------------------------------------------------------------------------------- norms


def rmsnorm(x, weight, eps) -> np.ndarray:
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last axis.

    x: f32 [T, D]; weight: f32 [D]  ->  f32 [T, D]
    """
    x = _f32(x)
    ms = np.mean(np.square(x), axis=-1, keepdims=True)  # [T, 1]
    return (x * (np.float32(1) / np.sqrt(ms + np.float32(eps)))) * _f32(weight)


def gated_rmsnorm(x, z, weight, eps) -> np.ndarray:
    """Qwen3-Next's RMSNormGated: rmsnorm over dv, times weight, times silu(z).

    x, z: f32 [T, H, dv]; weight: f32 [dv]  ->  f32 [T, H, dv]
    """
    return rmsnorm(x, weight, eps) * _silu(_f32(z))


# ---------------------------------------------------------------------------------------------- attention


def rope(x, positions, rotary_dim, base) -> np.ndarray:
    """Rotary embedding, non-interleaved ("rotate half", MLX traditional=False) on the first rotary_dim dims.

    Pair (i, i + rotary_dim/2) for i < rotary_dim/2 turns by angle pos * base^(-2i/rotary_dim); dims from
    rotary_dim on pass through (Qwen3-Next / 3.5 rotate 25% of each head). Linear RoPE scaling is the
    caller's: pass positions * scale.
    x: f32 [T, H, hd]; positions: [T] (int or float)  ->  f32 [T, H, hd]
    """
    x = _f32(x)
    half = rotary_dim // 2
    # as MLX: inv_freq = exp(-i * log(base) / half), angles in float32
    inv_freq = np.exp(np.arange(half, dtype=np.float32) * np.float32(-np.log(base) / half))  # [half]
    theta = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos = np.cos(theta)[:, None, :]  # [T, 1, half]
    sin = np.sin(theta)[:, None, :]
    x1 = x[..., :half]  # [T, H, half]
    x2 = x[..., half:rotary_dim]
    y = x.copy()
    y[..., :half] = x1 * cos - x2 * sin
    y[..., half:rotary_dim] = x1 * sin + x2 * cos
    return y


def attention(q, k, v, q_positions, scale) -> np.ndarray:
    """Causal grouped-query attention over the whole cache.

    q: f32 [T, Hq, hd]; k, v: f32 [S, Hkv, hd] (key j has position j); q_positions: int [T], each < S;
    query at position p sees keys 0..p; query head h reads kv head h // (Hq / Hkv).  ->  f32 [T, Hq, hd]
    """
    q = _f32(q)
    T, Hq, hd = q.shape
    S, Hkv, _ = k.shape
    rep = Hq // Hkv
    qg = (q * np.float32(scale)).reshape(T, Hkv, rep, hd)  # [T, Hkv, rep, hd]
    scores = np.einsum("tgrd,sgd->grts", qg, _f32(k))  # [Hkv, rep, T, S]
    pos = np.asarray(q_positions, dtype=np.int64)
    masked = np.arange(S)[None, :] > pos[:, None]  # [T, S]
    scores = np.where(masked, np.float32(-np.inf), scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)  # [Hkv, rep, T, S]
    out = np.einsum("grts,sgd->tgrd", p, _f32(v))  # [T, Hkv, rep, hd]
    return np.ascontiguousarray(out.reshape(T, Hq, hd), dtype=np.float32)


# ---------------------------------------------------------------------------------------------- linear attention


def conv1d_step(x, state, weight):
    """Depthwise causal conv over time, then SiLU (Gated-DeltaNet's short conv).

    x: f32 [T, C]; state: f32 [Kc-1, C] (the previous Kc-1 inputs, zeros at the start); weight: f32 [C, Kc]
    -> (y f32 [T, C], new_state f32 [Kc-1, C] = the last Kc-1 rows of [state; x])
    y[t, c] = silu(sum_j weight[c, j] * inp[t + j, c]) with inp = [state; x] (cross-correlation, as MLX)
    """
    x = _f32(x)
    weight = _f32(weight)
    T = x.shape[0]
    Kc = weight.shape[1]
    inp = np.concatenate([_f32(state), x], axis=0)  # [T+Kc-1, C]
    y = np.zeros_like(x)  # [T, C]
    for j in range(Kc):
        y += inp[j : j + T] * weight[:, j]
    new_state = inp[inp.shape[0] - (Kc - 1) :].copy()  # [Kc-1, C]
    return _silu(y), new_state


def gated_delta(q, k, v, g, beta, state):
    """The gated delta rule, one token at a time (mlx-lm's `gated_delta_ops`).

    q, k: f32 [T, Hk, dk] (q already carries the dk^-0.5 readout scale); v: f32 [T, Hv, dv];
    g: f32 [T, Hv] (decay, already exp'd); beta: f32 [T, Hv]; state: f32 [Hv, dv, dk]; value head h uses
    key head h // (Hv / Hk).  ->  (out f32 [T, Hv, dv], new_state f32 [Hv, dv, dk])

    per token:  S = g * S;  delta = (v - S @ k) * beta;  S = S + delta k^T;  out = S @ q
    """
    q, k, v, g, beta = _f32(q), _f32(k), _f32(v), _f32(g), _f32(beta)
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    rep = Hv // Hk
    qh = np.repeat(q, rep, axis=1)  # [T, Hv, dk]
    kh = np.repeat(k, rep, axis=1)
    s = np.array(state, dtype=np.float32, copy=True)  # [Hv, dv, dk]
    out = np.empty((T, Hv, dv), dtype=np.float32)
    for t in range(T):
        s *= g[t][:, None, None]
        kv_mem = (s * kh[t][:, None, :]).sum(axis=-1)  # [Hv, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]  # [Hv, dv]
        s += kh[t][:, None, :] * delta[:, :, None]
        out[t] = (s * qh[t][:, None, :]).sum(axis=-1)
    return out, s


# ---------------------------------------------------------------------------------------------- routing


def router_topk(logits, k, norm_topk_prob):
    """Qwen-style routing: softmax over all experts (float32), keep the k largest, renormalise if asked.

    logits: f32 [T, E]  ->  (idx int32 [T, k], weights f32 [T, k]), highest probability first; ties go to
    the lower expert index. Only the set of k experts matters to the caller, not their order.
    """
    logits = _f32(logits)
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)  # [T, E]
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k].astype(np.int32)  # [T, k]
    w = np.take_along_axis(p, idx, axis=-1)  # [T, k]
    if norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return idx, w.astype(np.float32)


"""The shape contracts of the runtime's kernels (the shape legend of ``kernels_ref``), checked in one place.

Every fast backend (``kernels_numba``, the Metal launch builders ``metal/ops_seq.py``) validates its inputs
through these functions, so a user mistake gives the same one-line ``ShapeError`` whichever backend runs.
Arguments are already-converted arrays (each backend does its own dtype/contiguity conversion); limits of
one backend only (a Metal kernel's largest head dim, say) stay with that backend.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError

HINT = "see the kernel's shape legend (moepack.runtime.kernels_ref)"


def check_rope(x_shape: tuple[int, ...], positions: np.ndarray, rotary_dim) -> int:
    """x [T, H, hd], positions [T], rotary_dim even in [0, hd]  ->  rotary_dim as an int."""
    T, _, hd = x_shape
    if positions.shape != (T,):
        raise ShapeError(f"rope: positions have shape {positions.shape}, expected ({T},)", hint=HINT)
    rotary_dim = int(rotary_dim)
    if rotary_dim < 0 or rotary_dim % 2 or rotary_dim > hd:
        raise ShapeError(f"rope: rotary_dim {rotary_dim} must be even and at most the head dim {hd}",
                         hint="check partial_rotary_factor in config.json")
    return rotary_dim


def check_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> tuple[int, ...]:
    """q [T, Hq, hd]; k, v [S, Hkv, hd] with Hq a multiple of Hkv; positions [T] in [0, S)
    ->  (T, Hq, hd, S, Hkv)."""
    T, Hq, hd = q.shape
    S, Hkv, _ = k.shape
    if v.shape != k.shape or k.shape[2] != hd:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}: expected k, v [S, Hkv, {hd}]",
                         hint=HINT)
    if Hkv == 0 or Hq % Hkv:
        raise ShapeError(f"attention: {Hq} query heads are not a multiple of {Hkv} kv heads", hint=HINT)
    if positions.shape != (T,):
        raise ShapeError(f"attention: q_positions have shape {positions.shape}, expected ({T},)", hint=HINT)
    if T and (positions.min() < 0 or positions.max() >= S):
        raise ShapeError(f"attention: query positions must lie in [0, {S}) (the keys in the cache)",
                         hint="update the KV cache with this call's keys before attending")
    return T, Hq, hd, S, Hkv


def check_gated_delta(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                      beta: np.ndarray) -> tuple[int, ...]:
    """q, k [T, Hk, dk]; v [T, Hv, dv] with Hv a multiple of Hk; g, beta [T, Hv]  ->  (T, Hk, dk, Hv, dv)."""
    T, Hk, dk = q.shape
    _, Hv, dv = v.shape
    if k.shape != q.shape or v.shape[0] != T:
        raise ShapeError(f"gated_delta: q {q.shape}, k {k.shape}, v {v.shape} disagree", hint=HINT)
    if Hk == 0 or Hv % Hk:
        raise ShapeError(f"gated_delta: {Hv} value heads are not a multiple of {Hk} key heads", hint=HINT)
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ShapeError(f"gated_delta: g {g.shape} and beta {beta.shape} must be ({T}, {Hv})", hint=HINT)
    return T, Hk, dk, Hv, dv


def check_router_k(k, n_experts: int) -> int:
    """1 <= k <= E  ->  k as an int."""
    k = int(k)
    if not 1 <= k <= n_experts:
        raise ShapeError(f"router_topk: k = {k} must lie in [1, {n_experts}] (the number of experts)",
                         hint="check num_experts_per_tok in config.json or --experts-per-token")
    return k

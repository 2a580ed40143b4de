"""Qwen3-Next: Gated-DeltaNet linear attention on most layers, gated full attention on every
`full_attention_interval`-th, routed experts plus a sigmoid-gated shared expert.

The Gated-DeltaNet layer lives here and Qwen3.5 reuses it (its projections are split differently).
Shape legend: T tokens, D hidden, nk/nv key/value heads, dk/dv their head dims, C = 2*nk*dk + nv*dv conv
channels, Kc conv width.
"""

from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ..cache import LayerSpec, LinearState
from .common import (LinearAttnArgs, TextArgs, apply_linear, build_decoder, check_out, layer_kinds, req,
                     rope_position_scale, sigmoid)


class GatedDeltaNet:
    """Gated-DeltaNet: in-projections -> causal depthwise conv + SiLU -> L2-normalised q/k -> gated delta
    recurrence -> RMSNorm gated by silu(z) -> out projection. `fused`: Qwen3-Next's in_proj_qkvz/in_proj_ba
    (grouped per key head); otherwise Qwen3.5's in_proj_qkv/z/b/a."""

    def __init__(self, W, prefix: str, args: TextArgs, fused: bool):
        la = args.linear
        D = args.hidden_size
        self.nk, self.nv, self.dk, self.dv, self.Kc = (la.num_k_heads, la.num_v_heads, la.head_k_dim,
                                                       la.head_v_dim, la.conv_kernel)
        if self.nv % self.nk:
            raise ShapeError(f"linear_num_value_heads {self.nv} is not a multiple of linear_num_key_heads {self.nk}")
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused = fused
        if fused:
            self.in_proj_qkvz = W.linear(f"{prefix}.in_proj_qkvz", D)
            self.in_proj_ba = W.linear(f"{prefix}.in_proj_ba", D)
            check_out(f"{prefix}.in_proj_qkvz", self.in_proj_qkvz, 2 * self.key_dim + 2 * self.value_dim)
            check_out(f"{prefix}.in_proj_ba", self.in_proj_ba, 2 * self.nv)
        else:
            self.in_proj_qkv = W.linear(f"{prefix}.in_proj_qkv", D)
            self.in_proj_z = W.linear(f"{prefix}.in_proj_z", D)
            self.in_proj_b = W.linear(f"{prefix}.in_proj_b", D)
            self.in_proj_a = W.linear(f"{prefix}.in_proj_a", D)
            check_out(f"{prefix}.in_proj_qkv", self.in_proj_qkv, self.conv_dim)
            check_out(f"{prefix}.in_proj_z", self.in_proj_z, self.value_dim)
            check_out(f"{prefix}.in_proj_b", self.in_proj_b, self.nv)
            check_out(f"{prefix}.in_proj_a", self.in_proj_a, self.nv)
        conv = W.vector(f"{prefix}.conv1d.weight")  # MLX layout [C, Kc, 1]
        if conv.shape != (self.conv_dim, self.Kc, 1):
            raise ShapeError(f"{prefix}.conv1d.weight is {list(conv.shape)}, expected [{self.conv_dim}, {self.Kc}, 1]")
        self.conv_w = np.ascontiguousarray(conv[..., 0])  # [C, Kc]
        self.dt_bias = W.vector(f"{prefix}.dt_bias")  # [nv]
        self.A = np.exp(W.vector(f"{prefix}.A_log"))  # [nv]
        self.norm = W.vector(f"{prefix}.norm.weight")  # [dv]
        self.out_proj = W.linear(f"{prefix}.out_proj", self.value_dim)
        check_out(f"{prefix}.out_proj", self.out_proj, D)
        self.eps = args.rms_norm_eps

    def spec(self) -> LayerSpec:
        return LayerSpec("linear", (self.Kc, self.conv_dim, self.nv, self.dv, self.dk))

    def _project(self, K, x):
        """x [T, D] -> qkv [T, C] (conv input: q | k | v flattened), z [T, nv, dv], b, a [T, nv]."""
        T = x.shape[0]
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        if self.fused:
            r = nv // nk  # value heads per key head
            qkvz = apply_linear(K, x, self.in_proj_qkvz).reshape(T, nk, 2 * dk + 2 * r * dv)  # grouped per key head
            ba = apply_linear(K, x, self.in_proj_ba).reshape(T, nk, 2 * r)
            q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]  # [T, nk, dk]
            v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(T, nv, dv)
            z = qkvz[..., 2 * dk + r * dv :].reshape(T, nv, dv)
            b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
            qkv = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)
        else:
            qkv = apply_linear(K, x, self.in_proj_qkv)
            z = apply_linear(K, x, self.in_proj_z).reshape(T, nv, dv)
            b = apply_linear(K, x, self.in_proj_b)
            a = apply_linear(K, x, self.in_proj_a)
        return qkv, z, b, a

    def __call__(self, K, x: np.ndarray, st: LinearState, positions: np.ndarray) -> np.ndarray:
        T = x.shape[0]
        nk, nv, dk, dv, kd = self.nk, self.nv, self.dk, self.dv, self.key_dim
        qkv, z, b, a = self._project(K, x)
        conv, st.conv = K.conv1d_step(qkv, st.conv, self.conv_w)  # [T, C]
        q = conv[:, :kd].reshape(T * nk, dk)
        k = conv[:, kd : 2 * kd].reshape(T * nk, dk)
        v = np.ascontiguousarray(conv[:, 2 * kd :]).reshape(T, nv, dv)
        # L2 normalisation as an RMSNorm: x / sqrt(sum x^2 + 1e-6) = rmsnorm(x, eps=1e-6/dk) / sqrt(dk);
        # the dk^-0.5 readout scale is folded into q (mlx-lm's normalize_qk)
        inv = dk**-0.5
        ones = np.ones(dk, dtype=np.float32)
        q = np.float32(inv * inv) * K.rmsnorm(np.ascontiguousarray(q), ones, 1e-6 * inv * inv).reshape(T, nk, dk)
        k = np.float32(inv) * K.rmsnorm(np.ascontiguousarray(k), ones, 1e-6 * inv * inv).reshape(T, nk, dk)
        beta = sigmoid(b)  # [T, nv]
        g = np.exp(-self.A * np.logaddexp(a + self.dt_bias, np.float32(0)))  # decay exp(-A softplus(a + dt_bias))
        out, st.recurrent = K.gated_delta(q, k, v, g.astype(np.float32), beta, st.recurrent)  # [T, nv, dv]
        out = K.gated_rmsnorm(out, z, self.norm, self.eps)
        return apply_linear(K, out.reshape(T, nv * dv), self.out_proj)


def linear_args(tc: dict) -> LinearAttnArgs:
    return LinearAttnArgs(
        num_k_heads=int(req(tc, "linear_num_key_heads")),
        num_v_heads=int(req(tc, "linear_num_value_heads")),
        head_k_dim=int(req(tc, "linear_key_head_dim")),
        head_v_dim=int(req(tc, "linear_value_head_dim")),
        conv_kernel=int(req(tc, "linear_conv_kernel_dim", 4)),
    )


def text_config(config: dict) -> dict:
    return config


def parse_args(config: dict) -> TextArgs:
    tc = text_config(config)
    n = int(req(tc, "num_hidden_layers"))
    heads = int(req(tc, "num_attention_heads"))
    hd = int(tc.get("head_dim") or int(req(tc, "hidden_size")) // heads)
    E = int(tc.get("num_experts", 0))
    step = int(tc.get("decoder_sparse_step", 1))
    only = set(tc.get("mlp_only_layers") or [])
    return TextArgs(
        hidden_size=int(req(tc, "hidden_size")),
        num_hidden_layers=n,
        vocab_size=int(req(tc, "vocab_size")),
        rms_norm_eps=float(req(tc, "rms_norm_eps", 1e-6)),
        num_attention_heads=heads,
        num_key_value_heads=int(req(tc, "num_key_value_heads")),
        head_dim=hd,
        rope_theta=float(req(tc, "rope_theta", 10000.0)),
        rotary_dim=int(hd * float(tc.get("partial_rotary_factor", 1.0))),
        rope_position_scale=rope_position_scale(tc.get("rope_scaling")),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
        num_experts=E,
        num_experts_per_tok=int(tc.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(tc.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(tc.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(tc.get("shared_expert_intermediate_size", 0)),
        intermediate_size=int(tc.get("intermediate_size", 0)),
        attention_output_gate=True,
        layer_types=layer_kinds(tc, n),
        mlp_types=tuple("moe" if (i not in only and E > 0 and (i + 1) % step == 0) else "dense" for i in range(n)),
        linear=linear_args(tc),
    )


def build(W, packed, args: TextArgs):
    return build_decoder(W, packed, args, lambda W_, p, a: GatedDeltaNet(W_, p, a, fused=True), shared_expert=True)

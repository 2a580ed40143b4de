"""Qwen3-MoE (e.g. Qwen3-30B-A3B, Qwen3-235B-A22B): full attention with q/k RMSNorm on every layer, routed
experts without a shared expert (dense MLP on `mlp_only_layers` and off-`decoder_sparse_step` layers)."""

from __future__ import annotations

from .common import TextArgs, build_decoder, req


def text_config(config: dict) -> dict:
    return config


def parse_args(config: dict) -> TextArgs:
    tc = text_config(config)
    n = int(req(tc, "num_hidden_layers"))
    D = int(req(tc, "hidden_size"))
    heads = int(req(tc, "num_attention_heads"))
    hd = int(tc.get("head_dim") or D // heads)
    E = int(tc.get("num_experts", 0))
    step = int(tc.get("decoder_sparse_step", 1))
    only = set(tc.get("mlp_only_layers") or [])
    return TextArgs(
        hidden_size=D,
        num_hidden_layers=n,
        vocab_size=int(req(tc, "vocab_size")),
        rms_norm_eps=float(req(tc, "rms_norm_eps", 1e-6)),
        num_attention_heads=heads,
        num_key_value_heads=int(req(tc, "num_key_value_heads")),
        head_dim=hd,
        rope_theta=float(req(tc, "rope_theta", 10000.0)),
        rotary_dim=hd,
        rope_position_scale=1.0,  # mlx-lm's qwen3_moe uses plain nn.RoPE and ignores rope_scaling
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
        num_experts=E,
        num_experts_per_tok=int(tc.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(tc.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(tc.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=0,
        intermediate_size=int(tc.get("intermediate_size", 0)),
        attention_output_gate=False,
        layer_types=("attention",) * n,
        mlp_types=tuple("moe" if (i not in only and E > 0 and (i + 1) % step == 0) else "dense" for i in range(n)),
    )


def build(W, packed, args: TextArgs):
    return build_decoder(W, packed, args, None, shared_expert=False)

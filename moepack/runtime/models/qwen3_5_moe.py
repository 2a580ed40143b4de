"""Qwen3.5-MoE (e.g. Qwen3.5-397B-A17B): Qwen3-Next's hybrid stack with separate in_proj_qkv/z/b/a, text
fields under `text_config`, tensors under `language_model.`, RoPE settings in `rope_parameters`, every layer
MoE with a sigmoid-gated shared expert."""

from __future__ import annotations

from .common import TextArgs, build_decoder, layer_kinds, req, rope_position_scale
from .qwen3_next import GatedDeltaNet, linear_args

# what mlx-lm assumes when config.json has no rope_parameters
_DEFAULT_ROPE = {"type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25}


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def parse_args(config: dict) -> TextArgs:
    tc = text_config(config)
    n = int(req(tc, "num_hidden_layers"))
    D = int(req(tc, "hidden_size"))
    heads = int(req(tc, "num_attention_heads"))
    hd = int(tc.get("head_dim") or D // heads)
    rp = tc.get("rope_parameters") or _DEFAULT_ROPE
    E = int(tc.get("num_experts", 0))
    return TextArgs(
        hidden_size=D,
        num_hidden_layers=n,
        vocab_size=int(req(tc, "vocab_size")),
        rms_norm_eps=float(req(tc, "rms_norm_eps", 1e-6)),
        num_attention_heads=heads,
        num_key_value_heads=int(req(tc, "num_key_value_heads")),
        head_dim=hd,
        rope_theta=float(rp.get("rope_theta", 100000.0)),
        rotary_dim=int(hd * float(rp.get("partial_rotary_factor", 0.25))),
        rope_position_scale=rope_position_scale(rp),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        num_experts=E,
        num_experts_per_tok=int(tc.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(tc.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(tc.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(tc.get("shared_expert_intermediate_size", 0)),
        intermediate_size=int(tc.get("intermediate_size", 0)),
        attention_output_gate=True,
        layer_types=layer_kinds(tc, n),
        mlp_types=tuple("moe" if E > 0 else "dense" for _ in range(n)),
        linear=linear_args(tc),
        prefix="language_model.model",
        lm_head="language_model.lm_head",
    )


def build(W, packed, args: TextArgs):
    return build_decoder(W, packed, args, lambda W_, p, a: GatedDeltaNet(W_, p, a, fused=False), shared_expert=True)

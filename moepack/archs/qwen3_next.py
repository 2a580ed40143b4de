"""Qwen3-Next: hybrid Gated-DeltaNet / gated attention, routed experts + sigmoid-gated shared expert."""

from .base import Architecture

ARCH = Architecture(
    model_type="qwen3_next",
    eight_bit_modules=(r"mlp\.gate$", r"shared_expert_gate$"),
    hf_norm_plus_one=(r"input_layernorm\.weight$", r"post_attention_layernorm\.weight$",
                      r"^model\.norm\.weight$", r"q_norm\.weight$", r"k_norm\.weight$"),
)

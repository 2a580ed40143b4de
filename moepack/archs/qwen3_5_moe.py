"""Qwen3.5-MoE (e.g. Qwen3.5-397B-A17B): Qwen3-Next's hybrid layout, text fields under `text_config`,
tensors under the `language_model.` prefix; HF checkpoints fuse experts as gate_up_proj / down_proj."""

from dataclasses import dataclass

from .base import Architecture


@dataclass(frozen=True)
class Qwen35Moe(Architecture):
    def text_config(self, config: dict) -> dict:
        return config.get("text_config", config)


ARCH = Qwen35Moe(
    model_type="qwen3_5_moe",
    expert_tensor="language_model.model.layers.{layer}.mlp.switch_mlp.{proj}_proj.{part}",
    hf_expert_tensor="model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight",
    hf_fused_gate_up="model.language_model.layers.{layer}.mlp.experts.gate_up_proj",
    hf_fused_down="model.language_model.layers.{layer}.mlp.experts.down_proj",
    hf_prefix_map=(("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    eight_bit_modules=(r"mlp\.gate$", r"shared_expert_gate$"),
    hf_norm_plus_one=(r"input_layernorm\.weight$", r"post_attention_layernorm\.weight$",
                      r"model\.norm\.weight$", r"q_norm\.weight$", r"k_norm\.weight$"),
)

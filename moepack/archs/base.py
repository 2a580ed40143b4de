"""What moepack needs to know about an MoE architecture to pack it.

Tensor names are data with `{layer}`/`{expert}`/`{proj}` placeholders (gpt-fast style), so an
architecture file is mostly a table. Shape legend: E=experts, D=hidden, I=moe intermediate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PROJS = ("gate", "up", "down")
PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class MoeShape:
    """The routed-expert geometry of one model."""

    num_layers: int
    num_experts: int
    experts_per_token: int
    hidden: int  # D
    moe_intermediate: int  # I

    def proj_shape(self, proj: str) -> tuple[int, int]:
        """(out, in) of one expert's projection."""
        if proj == "down":
            return (self.hidden, self.moe_intermediate)
        return (self.moe_intermediate, self.hidden)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    # MLX (post-sanitize) name of a stacked routed-expert tensor: [E, out, in*bits/32] / [E, out, in/gs]
    expert_tensor: str = "model.layers.{layer}.mlp.switch_mlp.{proj}_proj.{part}"
    # Hugging Face (unquantized) names of routed experts, per expert or fused over experts
    hf_expert_tensor: str = "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    hf_fused_gate_up: str | None = None  # [E, 2*I, D]: gate rows first, then up
    hf_fused_down: str | None = None  # [E, D, I]
    # HF name prefix -> MLX name prefix, applied in order (first match wins)
    hf_prefix_map: tuple[tuple[str, str], ...] = ()
    # names whose quantization MLX keeps at 8 bits (regex on the module path)
    eight_bit_modules: tuple[str, ...] = (r"mlp\.gate$",)
    # norm weights that mlx-lm's sanitize shifts by +1 when loading an HF checkpoint
    hf_norm_plus_one: tuple[str, ...] = ()
    dense_keep_float: tuple[str, ...] = field(default=(r"A_log$", r"dt_bias$", r"norm\.weight$", r"conv1d\.weight$"))

    # -- config -----------------------------------------------------------------------------------
    def text_config(self, config: dict) -> dict:
        """The dict holding the language-model fields (some configs nest it under text_config)."""
        return config

    def moe_shape(self, config: dict) -> MoeShape:
        tc = self.text_config(config)
        try:
            return MoeShape(
                num_layers=int(tc["num_hidden_layers"]),
                num_experts=int(tc["num_experts"]),
                experts_per_token=int(tc["num_experts_per_tok"]),
                hidden=int(tc["hidden_size"]),
                moe_intermediate=int(tc["moe_intermediate_size"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            from ..errors import SourceError

            raise SourceError(f"config.json lacks MoE field {e} for model_type {self.model_type!r}") from None

    # -- names ------------------------------------------------------------------------------------
    def expert_name(self, layer: int, proj: str, part: str) -> str:
        return self.expert_tensor.format(layer=layer, proj=proj, part=part)

    def expert_layer_of(self, name: str) -> int | None:
        """Layer index if `name` is a stacked routed-expert tensor, else None."""
        m = self._expert_re().fullmatch(name)
        return int(m.group(1)) if m else None

    def _expert_re(self) -> re.Pattern:
        pat = re.escape(self.expert_tensor)
        pat = pat.replace(r"\{layer\}", r"(\d+)").replace(r"\{proj\}", r"(gate|up|down)")
        pat = pat.replace(r"\{part\}", r"(weight|scales|biases)")
        return re.compile(pat)

    def hf_expert_layer_of(self, name: str) -> int | None:
        """Layer index if `name` is an unquantized HF routed-expert tensor (per-expert or fused)."""
        pats = [self.hf_expert_tensor.replace("{expert}", "{e}")]
        pats += [p for p in (self.hf_fused_gate_up, self.hf_fused_down) if p]
        for p in pats:
            rx = re.escape(p).replace(r"\{layer\}", r"(\d+)").replace(r"\{e\}", r"\d+")
            rx = rx.replace(r"\{proj\}", r"(?:gate|up|down)")
            m = re.fullmatch(rx, name)
            if m:
                return int(m.group(1))
        return None

    def mlx_name(self, hf_name: str) -> str:
        """An HF tensor name under its MLX (post-sanitize) name."""
        for src, dst in self.hf_prefix_map:
            if hf_name.startswith(src):
                return dst + hf_name[len(src) :]
        return hf_name

    def quant_bits_override(self, module_path: str) -> int | None:
        """Bits MLX uses for this module instead of the default (routers: 8), or None."""
        for rx in self.eight_bit_modules:
            if re.search(rx, module_path):
                return 8
        return None

    def keeps_float(self, mlx_name: str) -> bool:
        return any(re.search(rx, mlx_name) for rx in self.dense_keep_float)

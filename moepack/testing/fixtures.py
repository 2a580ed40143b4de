"""Tiny checkpoints made in-process, for tests, ``make demo`` and benchmarks.

Three routes:

* :func:`write_mlx_checkpoint` -- an MLX-format (mlx-community style) quantized checkpoint written by our own
  safetensors writer, with numpy only (no mlx needed): mlx-lm's tensor names after ``sanitize``, uint32-packed
  weights with bf16 scales/biases, routers at 8 bits, and the ``quantization`` block mlx-lm's convert writes.
* :func:`write_mlx_checkpoint_with_mlx_lm` -- the independent route (needs mlx + mlx-lm): instantiate mlx-lm's
  model, quantize it with mlx-lm's own quantizer and save with mlx-lm's savers, as ``mlx_lm.convert`` does.
  Tests check both routes give identical tensor names, shapes and dtypes and identical configs.
* :func:`write_hf_checkpoint` -- an unquantized Hugging Face (transformers-named, pre-sanitize) checkpoint.

Values are deterministic: every tensor's values come from ``numpy.random.default_rng([seed, crc32(name)])`` where
``name`` is the tensor's canonical (MLX) name, so they do not depend on shard layout, and an HF checkpoint and an
unquantized MLX checkpoint from the same seed hold the same weights (up to layout: expert stacking, conv1d axis
order, the +1 norm offset).

Architectures (mlx-lm 0.32): ``qwen3_5_moe`` (Qwen3.5 MoE, e.g. Qwen3.5-397B-A17B: text fields nested under
``text_config``), ``qwen3_next`` and ``qwen3_moe``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import math
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..source.safetensors_file import DTYPES, f32_to_bf16, write_safetensors

ARCHS = ("qwen3_5_moe", "qwen3_next", "qwen3_moe")
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
# What mlx-lm's quant_predicate for these models returns for the routers (independent of --q-group-size).
ROUTER_QUANT = {"group_size": 64, "bits": 8}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
_BPE_VOCAB = 480  # <= every tiny vocab_size (512) so all token ids have embedding rows

# Top-level keys of the Qwen3.5 (multimodal wrapper) config; every other override goes into text_config.
_QWEN3_5_OUTER_KEYS = {
    "architectures",
    "model_type",
    "text_config",
    "vision_config",
    "quantization",
    "quantization_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "transformers_version",
}

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- else %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)


# ------------------------------------------------------------------ configs
def _base_text_fields(arch: str) -> dict[str, Any]:
    common = {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
    }
    linear_attn = {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "shared_expert_intermediate_size": 64,
    }
    if arch == "qwen3_5_moe":
        return {
            "model_type": "qwen3_5_moe_text",
            **common,
            **linear_attn,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [3, 3, 2],
                "mrope_interleaved": True,
            },
            "dtype": "bfloat16",
        }
    if arch == "qwen3_next":
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            **common,
            **linear_attn,
            "intermediate_size": 256,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "torch_dtype": "bfloat16",
        }
    if arch == "qwen3_moe":
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **common,
            "intermediate_size": 256,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_theta": 1000000.0,
            "torch_dtype": "bfloat16",
        }
    raise ValueError(f"unknown fixture architecture {arch!r} (expected one of {', '.join(ARCHS)})")


def _layer_types(n_layers: int, interval: int) -> list[str]:
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]


def tiny_config(arch: str, *, bits: int | None = None, group_size: int = 64, **overrides: Any) -> dict[str, Any]:
    """A config.json dict for a tiny ``arch`` model that mlx-lm 0.32 can instantiate.

    Defaults: hidden 128, 4 layers (linear-attention / full-attention alternating for qwen3_5_moe and
    qwen3_next), 8 experts, 2 per token, expert intermediate 64, shared expert 64, vocab 512, head dims 64.
    ``overrides`` replace fields (for qwen3_5_moe they go into ``text_config`` unless they are wrapper keys).
    With ``bits`` the ``quantization`` / ``quantization_config`` blocks mlx-lm's convert would write are added.
    """
    text = _base_text_fields(arch)
    if arch == "qwen3_5_moe":
        config: dict[str, Any] = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": text["tie_word_embeddings"],
        }
        for key, value in overrides.items():
            if key in _QWEN3_5_OUTER_KEYS:
                config[key] = value
            else:
                text[key] = value
                if key == "tie_word_embeddings":
                    config[key] = value
        if "text_config" not in overrides:
            config["text_config"] = text
    else:
        config = text
        config.update(overrides)
    tc = text_fields(config)
    if "full_attention_interval" in tc and "layer_types" not in overrides:
        tc["layer_types"] = _layer_types(tc["num_hidden_layers"], tc["full_attention_interval"])
    if bits:
        q = quantization_block(config, bits, group_size)
        config["quantization"] = q
        config["quantization_config"] = copy.deepcopy(q)
    return config


def text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the language model's fields (``text_config`` for qwen3_5_moe, else the config)."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def quantization_block(config: dict[str, Any], bits: int, group_size: int = 64) -> dict[str, Any]:
    """The ``quantization`` block ``mlx_lm.convert -q`` writes: defaults plus one entry per router override."""
    _check_quant(bits, group_size)
    block: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for path, kind, shape in _mlx_modules(config):
        q = _module_quant(config, path, kind, shape, bits, group_size)
        if q is not None and q[2]:
            block[path] = dict(ROUTER_QUANT)
    return block


def _check_quant(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} not supported by MLX affine quantization ({SUPPORTED_BITS})")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size={group_size} not supported (32, 64 or 128)")


# ------------------------------------------------------------------ model structure
# kinds: linear (out, in) | embedding (vocab, dim) | switch (E, out, in) -> quantizable, named "<path>.weight" ...
#        norm (offset +1 in HF for qwen3_next / qwen3_5) | norm_plain | conv1d (C, K, 1) | A_log | dt_bias
_QUANTIZABLE = ("linear", "embedding", "switch")


def _is_router(arch: str, path: str) -> bool:
    if arch == "qwen3_moe":
        return path.endswith("mlp.gate")
    return path.endswith("mlp.gate") or path.endswith("shared_expert_gate")


def _mlx_modules(config: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(module path or tensor name, kind, shape) for every parameter, in mlx-lm naming after sanitize."""
    arch = config["model_type"]
    t = text_fields(config)
    H, V, n_layers = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    root = "language_model.model" if arch == "qwen3_5_moe" else "model"
    head = "language_model.lm_head" if arch == "qwen3_5_moe" else "lm_head"
    has_linear_attn = arch in ("qwen3_5_moe", "qwen3_next")
    offset_norm = "norm" if has_linear_attn else "norm_plain"
    hd = t["head_dim"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    E, I = t["num_experts"], t["moe_intermediate_size"]
    mods: list[tuple[str, str, tuple[int, ...]]] = [(f"{root}.embed_tokens", "embedding", (V, H))]
    for layer in range(n_layers):
        p = f"{root}.layers.{layer}"
        if has_linear_attn and (layer + 1) % t["full_attention_interval"] != 0:
            nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
            dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
            key_dim, value_dim = nk * dk, nv * dv
            conv_dim = 2 * key_dim + value_dim
            a = f"{p}.linear_attn"
            if arch == "qwen3_5_moe":
                mods += [
                    (f"{a}.in_proj_qkv", "linear", (conv_dim, H)),
                    (f"{a}.in_proj_z", "linear", (value_dim, H)),
                    (f"{a}.in_proj_b", "linear", (nv, H)),
                    (f"{a}.in_proj_a", "linear", (nv, H)),
                ]
            else:
                mods += [
                    (f"{a}.in_proj_qkvz", "linear", (2 * key_dim + 2 * value_dim, H)),
                    (f"{a}.in_proj_ba", "linear", (2 * nv, H)),
                ]
            mods += [
                (f"{a}.conv1d.weight", "conv1d", (conv_dim, t["linear_conv_kernel_dim"], 1)),
                (f"{a}.dt_bias", "dt_bias", (nv,)),
                (f"{a}.A_log", "A_log", (nv,)),
                (f"{a}.norm.weight", "norm_plain", (dv,)),
                (f"{a}.out_proj", "linear", (H, value_dim)),
            ]
        else:
            s = f"{p}.self_attn"
            q_out = nh * hd * (2 if has_linear_attn else 1)  # qwen3_next / qwen3_5 gate the attention output
            mods += [
                (f"{s}.q_proj", "linear", (q_out, H)),
                (f"{s}.k_proj", "linear", (nkv * hd, H)),
                (f"{s}.v_proj", "linear", (nkv * hd, H)),
                (f"{s}.o_proj", "linear", (H, nh * hd)),
                (f"{s}.q_norm.weight", offset_norm, (hd,)),
                (f"{s}.k_norm.weight", offset_norm, (hd,)),
            ]
        mods += [
            (f"{p}.input_layernorm.weight", offset_norm, (H,)),
            (f"{p}.post_attention_layernorm.weight", offset_norm, (H,)),
        ]
        m = f"{p}.mlp"
        sparse = E > 0
        if arch != "qwen3_5_moe":
            sparse = (
                sparse
                and layer not in t.get("mlp_only_layers", [])
                and (layer + 1) % t["decoder_sparse_step"] == 0
            )
        if sparse:
            mods += [
                (f"{m}.gate", "linear", (E, H)),
                (f"{m}.switch_mlp.gate_proj", "switch", (E, I, H)),
                (f"{m}.switch_mlp.up_proj", "switch", (E, I, H)),
                (f"{m}.switch_mlp.down_proj", "switch", (E, H, I)),
            ]
            if has_linear_attn:
                S = t["shared_expert_intermediate_size"]
                mods += [
                    (f"{m}.shared_expert.gate_proj", "linear", (S, H)),
                    (f"{m}.shared_expert.up_proj", "linear", (S, H)),
                    (f"{m}.shared_expert.down_proj", "linear", (H, S)),
                    (f"{m}.shared_expert_gate", "linear", (1, H)),
                ]
        else:
            D = t["intermediate_size"]
            mods += [
                (f"{m}.gate_proj", "linear", (D, H)),
                (f"{m}.up_proj", "linear", (D, H)),
                (f"{m}.down_proj", "linear", (H, D)),
            ]
    mods.append((f"{root}.norm.weight", offset_norm, (H,)))
    if not t.get("tie_word_embeddings", False):
        mods.append((head, "linear", (V, H)))
    return mods


def _module_quant(config, path, kind, shape, bits, group_size):
    """(group_size, bits, is_override) as mlx-lm's quantize_model decides, or None when left unquantized."""
    if kind not in _QUANTIZABLE or shape[-1] % group_size != 0:
        return None
    if _is_router(config["model_type"], path):
        return (ROUTER_QUANT["group_size"], ROUTER_QUANT["bits"], True)
    return (group_size, bits, False)


# ------------------------------------------------------------------ values
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])


def _float_values(seed: int, name: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values in MLX (post-sanitize) convention; ``name`` is the canonical MLX tensor name."""
    rng = _rng(seed, name)
    if kind in _QUANTIZABLE:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if kind in ("norm", "norm_plain"):
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "conv1d":
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if kind == "dt_bias":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    raise AssertionError(kind)


def _to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return f32_to_bf16(values)
    return values.astype(DTYPES[dtype][0])


def _quant_parts(seed: int, path: str, shape: tuple[int, ...], bits: int, group_size: int):
    """Random packed codes plus bf16 scales (~0.02 at 4 bits) and biases (~ -scale * 2^(bits-1))."""
    *lead, out, inn = shape
    w_shape = (*lead, out, inn * bits // 32)
    s_shape = (*lead, out, inn // group_size)

    def weight() -> np.ndarray:
        return _rng(seed, path + ".weight").integers(0, 2**32, size=w_shape, dtype=np.uint32)

    def scales_f32() -> np.ndarray:
        base = 0.32 / 2**bits  # dequantized weights span about +-0.16 whatever the bit width
        return (base * _rng(seed, path + ".scales").uniform(0.5, 1.5, s_shape)).astype(np.float32)

    def biases() -> np.ndarray:
        jitter = 1.0 + 0.02 * _rng(seed, path + ".biases").standard_normal(s_shape)
        s = bf16_round(scales_f32())
        return f32_to_bf16((-s * 2 ** (bits - 1) * jitter).astype(np.float32))

    return [
        (path + ".weight", "U32", w_shape, weight),
        (path + ".scales", "BF16", s_shape, lambda: f32_to_bf16(scales_f32())),
        (path + ".biases", "BF16", s_shape, biases),
    ]


def bf16_round(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16, as float32."""
    return (f32_to_bf16(values).astype(np.uint32) << 16).view(np.float32)


Entry = tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]


def _mlx_entries(config: dict[str, Any], bits: int | None, group_size: int, seed: int) -> list[Entry]:
    arch = config["model_type"]
    entries: list[Entry] = []
    for path, kind, shape in _mlx_modules(config):
        q = _module_quant(config, path, kind, shape, bits, group_size) if bits else None
        if q is not None:
            entries += _quant_parts(seed, path, shape, q[1], q[0])
            continue
        name = path + ".weight" if kind in _QUANTIZABLE else path
        dtype = "F32" if (kind == "A_log" and arch == "qwen3_5_moe") else "BF16"  # mlx-lm's cast_predicate
        entries.append(
            (name, dtype, shape, lambda n=name, k=kind, s=shape, d=dtype: _to_dtype(_float_values(seed, n, k, s), d))
        )
    return entries


# ------------------------------------------------------------------ writing
def _write_weights(
    out_dir: Path, entries: list[Entry], shards: int, metadata: dict[str, str], extra_index_meta: dict[str, Any]
) -> None:
    if shards < 1:
        raise ValueError("shards must be >= 1")
    sizes = [math.prod(shape) * DTYPES[dtype][1] for _, dtype, shape, _ in entries]
    total = sum(sizes)
    groups: list[list[Entry]] = [[] for _ in range(shards)]
    acc = 0
    for entry, size in zip(entries, sizes):  # contiguous runs of about total/shards bytes each
        groups[min(shards - 1, acc * shards // max(total, 1))].append(entry)
        acc += size
    groups = [g for g in groups if g]  # a tensor larger than total/shards can leave a shard empty
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    # Files of an earlier fixture in the same folder would be picked up by mlx-lm's model*.safetensors glob.
    for stale in out_dir.glob("model*.safetensors"):
        if stale.name not in names:
            stale.unlink()
    weight_map: dict[str, str] = {}
    for fname, group in zip(names, groups):
        write_safetensors(out_dir / fname, group, metadata)
        for name, *_ in group:
            weight_map[name] = fname
    index = {
        "metadata": {"total_size": total, **extra_index_meta},
        "weight_map": {k: weight_map[k] for k in sorted(weight_map)},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def _write_config(out_dir: Path, config: dict[str, Any]) -> None:
    config = dict(sorted(config.items()))  # what mlx-lm's save_config does
    (out_dir / "config.json").write_text(json.dumps(config, indent=4))


def _prepare_out(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_mlx_checkpoint(
    out_dir: str | os.PathLike,
    arch: str = "qwen3_5_moe",
    bits: int | None = 4,
    group_size: int = 64,
    seed: int = 0,
    shards: int = 2,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write an MLX-format checkpoint (mlx-lm names after sanitize) with numpy only; returns the folder.

    ``bits`` 2/3/4/5/6/8 gives an affine-quantized checkpoint like ``mlx_lm.convert -q`` (routers at 8 bits);
    ``bits=None`` an unquantized bf16 one. Weights are split over ``shards`` files (fewer when there are too few
    tensors to fill them; ``model.safetensors`` when one) with ``model.safetensors.index.json``; with
    ``tokenizer`` a tiny byte-level BPE tokenizer and chat template are added.
    """
    if bits:
        _check_quant(bits, group_size)
    out = _prepare_out(out_dir)
    config = tiny_config(arch, bits=bits, group_size=group_size, **config_overrides)
    entries = _mlx_entries(config, bits, group_size, seed)
    # what mlx-lm's get_total_parameters counts: leaf modules only (so not A_log / dt_bias, which hang directly
    # off the GatedDeltaNet module), a quantized weight as packed size * 32 / bits = out * in
    params = sum(math.prod(shape) for _, kind, shape in _mlx_modules(config) if kind not in ("A_log", "dt_bias"))
    _write_weights(out, entries, shards, {"format": "mlx"}, {"total_parameters": params})
    _write_config(out, config)
    if tokenizer:
        write_tokenizer(out)
    return out


def write_mlx_checkpoint_with_mlx_lm(
    out_dir: str | os.PathLike,
    arch: str = "qwen3_5_moe",
    bits: int | None = 4,
    group_size: int = 64,
    seed: int = 0,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """The independent route (uses mlx + mlx-lm): build mlx-lm's model from :func:`tiny_config`, random-initialise
    it (``mx.random.seed(seed)``), cast to bf16 as ``mlx_lm.convert`` does (honouring ``cast_predicate``), quantize
    with ``mlx_lm.utils.quantize_model`` and the model's ``quant_predicate``, and save with ``save_model`` /
    ``save_config``. This is what mlx-community checkpoints look like."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    if bits:
        _check_quant(bits, group_size)
    out = _prepare_out(out_dir)
    config = tiny_config(arch, **config_overrides)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    cast = getattr(model, "cast_predicate", lambda _: True)

    def to_bf16(path: str, v: Any) -> Any:
        return v.astype(mx.bfloat16) if cast(path) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(to_bf16, model.parameters()))
    if bits:
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
            model, config = quantize_model(
                model, config, group_size, bits, quant_predicate=getattr(model, "quant_predicate", None)
            )
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    if tokenizer:
        write_tokenizer(out)
    return out


# ------------------------------------------------------------------ Hugging Face layout
def _hf_name(arch: str, mlx_name: str) -> str:
    if arch == "qwen3_5_moe":
        if mlx_name.startswith("language_model.model."):
            return "model.language_model." + mlx_name[len("language_model.model.") :]
        if mlx_name.startswith("language_model."):
            return mlx_name[len("language_model.") :]
    return mlx_name


def _hf_entries(config: dict[str, Any], dtype: str, experts: str, seed: int, extras: bool) -> list[Entry]:
    arch = config["model_type"]
    t = text_fields(config)
    entries: list[Entry] = []
    fused: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}

    def value(name: str, kind: str, shape: tuple[int, ...], d: str, post=None) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            v = _float_values(seed, name, kind, shape)
            if post is not None:
                v = post(v)
            return _to_dtype(np.ascontiguousarray(v), d)

        return make

    for path, kind, shape in _mlx_modules(config):
        name = path + ".weight" if kind in _QUANTIZABLE else path
        if kind == "switch":
            prefix, proj = path.rsplit(".switch_mlp.", 1)
            if experts == "per_expert":
                for e in range(shape[0]):
                    hf = _hf_name(arch, f"{prefix}.experts.{e}.{proj}.weight")
                    entries.append((hf, dtype, shape[1:], value(name, kind, shape, dtype, lambda v, e=e: v[e])))
            else:
                fused.setdefault(prefix, {})[proj] = (name, shape)
                if len(fused[prefix]) == 3:
                    g_name, g_shape = fused[prefix]["gate_proj"]
                    u_name, u_shape = fused[prefix]["up_proj"]
                    d_name, d_shape = fused[prefix]["down_proj"]
                    E, I, H = g_shape

                    def gate_up(g_name=g_name, u_name=u_name, g_shape=g_shape, u_shape=u_shape) -> np.ndarray:
                        g = _float_values(seed, g_name, "switch", g_shape)
                        u = _float_values(seed, u_name, "switch", u_shape)
                        return _to_dtype(np.concatenate([g, u], axis=1), dtype)

                    entries.append((_hf_name(arch, f"{prefix}.experts.gate_up_proj"), dtype, (E, 2 * I, H), gate_up))
                    down = value(d_name, "switch", d_shape, dtype)
                    entries.append((_hf_name(arch, f"{prefix}.experts.down_proj"), dtype, d_shape, down))
            continue
        hf = _hf_name(arch, name)
        if kind == "conv1d":  # HF keeps torch's Conv1d layout [C, 1, K]
            C, K, _ = shape
            entries.append((hf, dtype, (C, 1, K), value(name, kind, shape, dtype, lambda v: v.transpose(0, 2, 1))))
        elif kind == "norm":  # stored without the +1 that mlx-lm's sanitize adds
            entries.append((hf, dtype, shape, value(name, kind, shape, dtype, lambda v: v - 1.0)))
        elif kind == "A_log" and arch == "qwen3_5_moe":
            entries.append((hf, "F32", shape, value(name, kind, shape, "F32")))
        else:
            entries.append((hf, dtype, shape, value(name, kind, shape, dtype)))

    if extras and arch in ("qwen3_5_moe", "qwen3_next"):
        H = t["hidden_size"]
        # multi-token-prediction head and (qwen3_5_moe) vision tower: present in real checkpoints, dropped by mlx-lm
        entries.append(("mtp.fc.weight", dtype, (H, 2 * H), value("mtp.fc.weight", "linear", (H, 2 * H), dtype)))
        mtp_norm = value("mtp.norm.weight", "norm", (H,), dtype, lambda v: v - 1.0)
        entries.append(("mtp.norm.weight", dtype, (H,), mtp_norm))
        if arch == "qwen3_5_moe":
            shp = (64, 3, 2, 4, 4)
            entries.append(("model.visual.patch_embed.proj.weight", dtype, shp, value("visual", "linear", shp, dtype)))
    return entries


def write_hf_checkpoint(
    out_dir: str | os.PathLike,
    arch: str = "qwen3_5_moe",
    dtype: str = "bf16",
    experts: str | None = None,
    seed: int = 0,
    shards: int = 2,
    tokenizer: bool = True,
    extras: bool = True,
    **overrides: Any,
) -> Path:
    """Write an unquantized Hugging Face-format checkpoint (transformers names, before mlx-lm's sanitize).

    ``dtype``: 'bf16' | 'f16' | 'f32'. ``experts``: 'per_expert' (``mlp.experts.{E}.{gate,up,down}_proj.weight``)
    or 'fused' (``mlp.experts.gate_up_proj`` [E, 2*I, D] + ``mlp.experts.down_proj`` [E, D, I]); the default is
    the form mlx-lm 0.32 can load for ``arch``: fused for qwen3_5_moe, per-expert otherwise. qwen3_5_moe tensors
    carry the ``model.language_model.`` prefix; conv1d is [C, 1, K]; qwen3_next / qwen3_5 RMSNorm weights are
    stored without the +1 offset. With ``extras`` an ``mtp.*`` head (and for qwen3_5_moe a ``model.visual.*``
    tensor) is included, as in real checkpoints; mlx-lm drops them.
    """
    dtypes = {"bf16": "BF16", "f16": "F16", "f32": "F32"}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    if experts is None:
        experts = "fused" if arch == "qwen3_5_moe" else "per_expert"
    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts must be 'per_expert' or 'fused', got {experts!r}")
    out = _prepare_out(out_dir)
    config = tiny_config(arch, **overrides)
    torch_dtype = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype]
    tc = text_fields(config)
    if "dtype" in tc:
        tc["dtype"] = torch_dtype
    if "torch_dtype" in tc:
        tc["torch_dtype"] = torch_dtype
    if arch == "qwen3_5_moe" and extras:
        config.setdefault(
            "vision_config",
            {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 64, "out_hidden_size": tc["hidden_size"]},
        )
    entries = _hf_entries(config, dtypes[dtype], experts, seed, extras)
    _write_weights(out, entries, shards, {"format": "pt"}, {})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        write_tokenizer(out)
    return out


# ------------------------------------------------------------------ tokenizer
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
Mixture of experts models route every token to a few experts out of many, so most weights stay idle.
A packed checkpoint keeps each expert's weights together so one read from the disk fetches a whole expert.
Reading from a solid state drive is fast when requests are large and aligned, and slow when they are tiny.
The router scores each expert, keeps the top few, and mixes their outputs with softmax weights.
Shared experts run for every token; routed experts run only when the router picks them.
Quantization stores weights as small integers with a scale and a bias for every group of sixty four values.
Linear attention layers keep a fixed size state instead of a growing cache of keys and values.
Full attention layers look back over every earlier token in the conversation.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Please write a short poem about the sea, the wind, and a small boat going home at night.
Here is a list: apples, bananas, cherries, dates, elderberries, figs, grapes and honeydew melons.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 65536.
def add(a, b):\n    return a + b\nprint(add(2, 3))
for i in range(10):\n    if i % 2 == 0:\n        print(i)
{"name": "moepack", "version": "0.1.0", "experts": 512, "active": 10}
Questions and answers help the model learn to follow instructions and to stop when the answer is complete.
Streaming experts from storage lets a model larger than memory run on a laptop, one layer at a time.
The weather today is sunny with a light breeze from the west and a few clouds over the hills.
She opened the book, read the first page twice, and then closed it with a quiet smile.
""" + "".join(
    f"<|im_start|>{role}\n{text}<|im_end|>\n"
    for role, text in [
        ("system", "You are a helpful assistant."),
        ("user", "What is a mixture of experts?"),
        ("assistant", "A layer with many small networks where each token uses only a few of them."),
        ("user", "Why pack the experts?"),
        ("assistant", "So that each expert can be read from the disk in one large request."),
    ]
)


@functools.lru_cache(maxsize=None)
def tokenizer_json() -> str:
    """A tiny byte-level BPE ``tokenizer.json`` trained in-process (deterministic), special tokens at ids 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.split("<|im_end|>\n")] * 2
    tok.train_from_iterator(lines, trainer=trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, special
    return tok.to_str(pretty=True)


def write_tokenizer(out_dir: str | os.PathLike) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json (with the chat template), chat_template.jinja,
    special_tokens_map.json and generation_config.json into ``out_dir``; returns the paths."""
    out = _prepare_out(out_dir)
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    files = {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
        "chat_template.jinja": CHAT_TEMPLATE,
        "special_tokens_map.json": json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            },
            indent=2,
        ),
        "generation_config.json": json.dumps(
            {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID},
            indent=2,
        ),
    }
    paths = []
    for name, text in files.items():
        p = out / name
        p.write_text(text, encoding="utf-8")
        paths.append(p)
    return paths


def iter_tensor_specs(
    config: dict[str, Any], bits: int | None = 4, group_size: int = 64
) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor :func:`write_mlx_checkpoint` writes for ``config``."""
    for name, dtype, shape, _ in _mlx_entries(config, bits, group_size, 0):
        yield name, dtype, shape

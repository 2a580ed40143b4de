"""The dense part of a model (everything but the routed experts): which tensors go to the packed
folder's safetensors, under which MLX name, and how each is produced.

MLX sources: every non-expert tensor is copied byte for byte (quantization untouched).
HF float sources: names mapped to MLX's, conv1d weights moved to MLX's [C, K, 1] layout, norm weights
shifted +1 where mlx-lm's sanitize does, and 2-D weights quantized (affine, group 64; routers at 8 bits)
as `mlx_lm.convert` would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..archs.base import Architecture
from .experts import FLOAT_DTYPES, to_float32

SKIP_HF = (r"^model\.visual\.", r"^vision_tower", r"(^|\.)mtp\.")


@dataclass
class DenseTensor:
    name: str  # MLX name in the packed folder
    dtype: str  # safetensors dtype
    shape: tuple
    produce: Callable[[], np.ndarray]
    nbytes: int


def _copy(ckpt, name):
    return lambda: ckpt.read(name)


def plan_dense_mlx(ckpt, is_expert) -> list[DenseTensor]:
    out = []
    for name in ckpt.tensor_names:
        if is_expert(name):
            continue
        t = ckpt.info(name)
        out.append(DenseTensor(name, t.dtype, tuple(t.shape), _copy(ckpt, name), t.nbytes))
    return out


def _f32_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    from ..quant import f32_to_bf16

    if dtype == "BF16":
        return f32_to_bf16(x)
    if dtype == "F16":
        return x.astype(np.float16)
    return x.astype(np.float32)


def plan_dense_hf(ckpt, arch: Architecture, is_expert, bits: int = 4, group_size: int = 64):
    """(tensors, quantization block for config.json) for an unquantized HF checkpoint."""
    from ..quant import affine_fast, f32_to_bf16

    tc = arch.text_config(ckpt.config)
    tie = bool(tc.get("tie_word_embeddings", ckpt.config.get("tie_word_embeddings", False)))
    names = [n for n in ckpt.tensor_names if not is_expert(n) and not any(re.search(r, n) for r in SKIP_HF)]
    has_raw_conv = any("conv1d.weight" in n and ckpt.info(n).shape[-1] != 1 for n in names)
    qblock = {"group_size": group_size, "bits": bits, "mode": "affine"}
    out = []
    for name in names:
        t = ckpt.info(name)
        mname = arch.mlx_name(name)
        if tie and mname.endswith("lm_head.weight"):
            continue
        if t.dtype not in FLOAT_DTYPES:
            out.append(DenseTensor(mname, t.dtype, tuple(t.shape), _copy(ckpt, name), t.nbytes))
            continue
        shape = tuple(t.shape)

        def load(name=name, dtype=t.dtype):
            return to_float32(ckpt.read(name).reshape(-1).view(np.uint8), dtype).reshape(ckpt.info(name).shape)

        if "conv1d.weight" in mname and len(shape) == 3 and shape[-1] != 1:
            new_shape = (shape[0], shape[2], shape[1])
            out.append(DenseTensor(mname, t.dtype, new_shape,
                                   lambda load=load, d=t.dtype: _f32_to_dtype(np.ascontiguousarray(np.moveaxis(load(), 2, 1)), d),
                                   t.nbytes))
            continue
        if has_raw_conv and len(shape) == 1 and any(re.search(r, mname) for r in arch.hf_norm_plus_one):
            out.append(DenseTensor(mname, t.dtype, shape, lambda load=load, d=t.dtype: _f32_to_dtype(load() + 1.0, d),
                                   t.nbytes))
            continue
        module = mname[: -len(".weight")] if mname.endswith(".weight") else None
        if module and len(shape) == 2 and shape[-1] % group_size == 0:
            b = arch.quant_bits_override(module) or bits
            if b != bits:
                qblock[module] = {"group_size": group_size, "bits": b}
            rows, cols = shape
            wshape, sshape = (rows, cols * b // 32), (rows, cols // group_size)
            cache = {}

            def quantized(part, load=load, b=b, cache=cache, d=t.dtype):
                if "q" not in cache:
                    w = load()
                    if d != "F32":  # round to bf16 first, as mlx-lm casts a bf16 model before quantizing
                        w = (f32_to_bf16(w).astype(np.uint32) << 16).view(np.float32)
                    cache["q"] = affine_fast.quantize(w, b, group_size)
                res = cache["q"][part]
                if part == 2:
                    cache.clear()
                return res

            out.append(DenseTensor(module + ".weight", "U32", wshape, lambda q=quantized: q(0), rows * cols * b // 8))
            out.append(DenseTensor(module + ".scales", "BF16", sshape, lambda q=quantized: q(1), rows * cols // group_size * 2))
            out.append(DenseTensor(module + ".biases", "BF16", sshape, lambda q=quantized: q(2), rows * cols // group_size * 2))
            continue
        out.append(DenseTensor(mname, t.dtype, shape, _copy(ckpt, name), t.nbytes))
    out.sort(key=lambda d: d.name)
    # the three parts of one quantized tensor must stay adjacent and in order for the cache above
    out = _regroup(out)
    return out, qblock


def _regroup(tensors: list[DenseTensor]) -> list[DenseTensor]:
    order = {"weight": 0, "scales": 1, "biases": 2}

    def key(d):
        base, _, part = d.name.rpartition(".")
        return (base, order.get(part, 3), d.name) if part in order else (d.name, 3, d.name)

    return sorted(tensors, key=key)


def tensor_class(name: str) -> str:
    """A coarse class for reporting quantization per tensor class in the manifest."""
    rules = [
        (r"switch_mlp\.", "routed_experts"),
        (r"shared_expert_gate", "shared_expert_gate"),
        (r"shared_expert\.", "shared_expert"),
        (r"mlp\.gate\.", "router"),
        (r"embed_tokens", "embedding"),
        (r"lm_head", "lm_head"),
        (r"linear_attn\.", "linear_attention"),
        (r"self_attn\.", "attention"),
        (r"norm", "norm"),
        (r"mlp\.", "dense_mlp"),
    ]
    for rx, cls in rules:
        if re.search(rx, name):
            return cls
    return "other"


def module_quant(qblock: dict | None, module: str) -> tuple[int | None, int]:
    """(bits, group_size) config.json's quantization block gives a module (per-module overrides first)."""
    qblock = qblock or {}
    o = qblock.get(module)
    if isinstance(o, dict):
        return o.get("bits"), int(o.get("group_size", qblock.get("group_size", 64)))
    return qblock.get("bits"), int(qblock.get("group_size", 64))


def summarize_quantization(tensors: list[DenseTensor], qblock: dict | None) -> dict:
    """{class: sorted list of 'qB.gG' / float dtype strings} over the dense tensors."""
    by_module: dict[str, dict[str, DenseTensor]] = {}
    for d in tensors:
        base, _, part = d.name.rpartition(".")
        by_module.setdefault(base, {})[part] = d
    classes: dict[str, set] = {}
    for base, parts in by_module.items():
        rest = parts
        if {"weight", "scales", "biases"} <= parts.keys() and parts["weight"].dtype == "U32":
            _, gs = module_quant(qblock, base)
            inp = gs * parts["scales"].shape[-1]
            bits = parts["weight"].shape[-1] * 32 // inp
            classes.setdefault(tensor_class(base + ".weight"), set()).add(f"q{bits}.g{gs}")
            rest = {k: v for k, v in parts.items() if k not in ("weight", "scales", "biases")}
        for d in rest.values():
            classes.setdefault(tensor_class(d.name), set()).add(d.dtype.lower())
    return {k: sorted(v) for k, v in sorted(classes.items())}

"""Runtime model code: one module per config.json `model_type`, found by importlib (as `moepack.archs`).

Each module exports `text_config(config) -> dict`, `parse_args(config) -> TextArgs` and
`build(dense_weights, packed_model, args) -> DecoderModel`; shared pieces live in `common.py`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ...errors import UnsupportedArchitectureError

_REMAP = {"qwen3_5_moe_text": "qwen3_5_moe"}  # model_type aliases -> module name
SUPPORTED = ("qwen3_5_moe", "qwen3_next", "qwen3_moe")


def get_model_module(model_type: str | None) -> ModuleType:
    name = _REMAP.get(model_type or "", model_type or "")
    if name not in SUPPORTED:
        raise UnsupportedArchitectureError(
            f"the runtime cannot run model_type={model_type!r}; supported: {', '.join(SUPPORTED)}",
            hint="add a module for it in moepack/runtime/models/",
        )
    return importlib.import_module(f"{__name__}.{name}")

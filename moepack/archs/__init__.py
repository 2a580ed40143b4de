"""Architecture descriptions: one small module per config.json `model_type`.

Each module defines `ARCH`, an `Architecture` instance (see `base.py`). Modules are found by importlib
from the model_type, plus a tiny remapping table for aliases; adding mixtral or a DeepSeek-style model
is one more file here.
"""

from __future__ import annotations

import importlib

from ..errors import UnsupportedArchitectureError
from .base import Architecture

# model_type aliases -> module name
_REMAP = {
    "qwen3_5_moe_text": "qwen3_5_moe",
}

SUPPORTED = ("qwen3_5_moe", "qwen3_next", "qwen3_moe")


def get_architecture(model_type: str | None) -> Architecture:
    """The Architecture for a config.json model_type, or UnsupportedArchitectureError."""
    name = _REMAP.get(model_type or "", model_type or "")
    if name not in SUPPORTED:
        raise UnsupportedArchitectureError(
            f"unsupported architecture model_type={model_type!r}; supported: {', '.join(SUPPORTED)}",
            hint="convert a checkpoint of a supported architecture, or add an architecture file in moepack/archs/",
        )
    module = importlib.import_module(f"{__name__}.{name}")
    return module.ARCH


def architecture_for_config(config: dict) -> Architecture:
    return get_architecture(config.get("model_type"))

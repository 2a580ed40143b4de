"""Qwen3-MoE (e.g. Qwen3-30B-A3B, Qwen3-235B-A22B): attention + routed experts, no shared expert."""

from .base import Architecture

ARCH = Architecture(model_type="qwen3_moe")

"""Test helpers: tiny in-process checkpoints (MLX quantized, Hugging Face unquantized) for tests, demos, benchmarks."""

from .fixtures import (
    ARCHS,
    tiny_config,
    write_hf_checkpoint,
    write_mlx_checkpoint,
    write_mlx_checkpoint_with_mlx_lm,
    write_tokenizer,
)

__all__ = [
    "ARCHS",
    "tiny_config",
    "write_hf_checkpoint",
    "write_mlx_checkpoint",
    "write_mlx_checkpoint_with_mlx_lm",
    "write_tokenizer",
]

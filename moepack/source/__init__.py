"""Reading source checkpoints: validated raw safetensors access and MLX / Hugging Face checkpoint folders."""

"""moepack: pack, requantize, verify and run MoE LLMs larger than RAM by streaming experts from SSD."""

__version__ = "0.1.0"

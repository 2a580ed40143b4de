"""Constants of the packed format. Bump FORMAT_VERSION on any change a reader must know about.

Version history:
  1 — first version: per-layer expert files, records padded to RECORD_ALIGN, xxh3_64 record checksums.
"""

FORMAT_NAME = "moepack"
FORMAT_VERSION = 1
MANIFEST_NAME = "moepack.json"
EXPERTS_DIR = "packed_experts"
RECORD_ALIGN = 16 * 1024  # records start and end on 16 KiB boundaries (macOS page size)
CHECKSUM_ALGO = "xxh3_64"
STATE_NAME = ".moepack-convert.json"  # conversion in progress (resume state); absent in a finished model
DENSE_NAME = "model.safetensors"
DENSE_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
DENSE_INDEX_NAME = "model.safetensors.index.json"
DENSE_SHARD_BYTES = 4 * 1024**3


def layer_file_name(layer: int, num_layers: int) -> str:
    """packed_experts/layer_XX.bin: two digits, three for models of more than 100 layers."""
    width = 3 if num_layers > 100 else 2
    return f"{EXPERTS_DIR}/layer_{layer:0{width}d}.bin"

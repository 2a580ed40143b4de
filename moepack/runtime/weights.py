"""The dense (non-expert) weights of a packed model, memory-mapped.

Every tensor is a read-only numpy view into a mapping of its safetensors file: nothing is copied or
dequantized up front, so a 5 GB dense part costs address space, not RAM, until the pages are touched.
Quantized linears come back as :class:`QLinear` (packed uint32 words + bf16 scales/biases, dequantized by the
kernels as they run), unquantized ones as :class:`FloatLinear`.

Quantization parameters come from config.json's ``quantization`` block (``quantization_config`` as a
fallback): defaults ``bits``/``group_size`` plus per-module overrides keyed by module path (mlx-lm keeps
routers at 8 bits this way). They are cross-checked against the tensors' shapes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import PackedModelError, ShapeError
from ..layout.constants import DENSE_INDEX_NAME, DENSE_NAME
from ..quant.bf16 import bf16_to_f32
from ..source.safetensors_file import SafetensorsFile


@dataclass(frozen=True)
class QLinear:
    """An MLX affine-quantized linear layer (or embedding table): W[o, i] = scale * q + bias per group."""

    w: np.ndarray  # uint32 [out, in*bits/32]
    scales: np.ndarray  # uint16 (bf16) [out, in/gs]
    biases: np.ndarray  # uint16 (bf16) [out, in/gs]
    bits: int
    group_size: int

    @property
    def out_features(self) -> int:
        return self.w.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group_size


@dataclass(frozen=True)
class FloatLinear:
    """An unquantized linear layer or embedding table: weight [out, in] as stored (f32, f16 or bf16 bits)."""

    weight: np.ndarray
    dtype: str  # safetensors dtype: 'F32' | 'F16' | 'BF16'

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def rows_f32(self, rows) -> np.ndarray:
        """f32 copy of the selected rows (a slice or an index array)."""
        return _to_f32(self.weight[rows], self.dtype)


def _to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_to_f32(np.ascontiguousarray(a))
    if dtype in ("F32", "F16", "F64"):
        return np.asarray(a, dtype=np.float32)
    raise ShapeError(f"cannot use a {dtype} tensor as float weights")


_FLOAT = ("F32", "F16", "BF16", "F64")


class DenseWeights:
    """All tensors of a packed folder's ``model.safetensors`` (or its shards + index), memory-mapped.

    ``config``: the model's config.json dict (default: read from the folder) for the quantization block.
    """

    def __init__(self, packed_dir: str | os.PathLike, config: dict | None = None):
        self.path = Path(packed_dir)
        if config is None:
            try:
                config = json.loads((self.path / "config.json").read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise PackedModelError(f"{self.path / 'config.json'} cannot be read ({e})") from None
        self.config = config
        self.quantization = _quant_block(config)
        files = self._files()
        self._maps: list[np.ndarray] = []  # one read-only uint8 view of each mapped file
        self._where: dict[str, tuple[int, object]] = {}  # name -> (file index, TensorInfo)
        for i, f in enumerate(files):
            st = SafetensorsFile(f)  # validates the header before any offset is trusted
            self._maps.append(np.asarray(np.memmap(f, dtype=np.uint8, mode="r")))  # plain ndarray view
            for name, info in st.tensors.items():
                if name in self._where:
                    raise PackedModelError(f"tensor {name} appears in two dense files")
                self._where[name] = (i, info)

    def _files(self) -> list[Path]:
        index = self.path / DENSE_INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise PackedModelError(f"{index} is malformed ({e})") from None
            names = sorted(set(weight_map.values()))
            for n in names:
                if os.path.isabs(n) or ".." in Path(n).parts:
                    raise PackedModelError(f"{index} names a file outside the folder: {n!r}")
            return [self.path / n for n in names]
        single = self.path / DENSE_NAME
        if not single.is_file():
            raise PackedModelError(f"{self.path} has neither {DENSE_NAME} nor {DENSE_INDEX_NAME}")
        return [single]

    # -------------------------------------------------------------------------------------------- raw access
    @property
    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> str:
        return self._info(name).dtype

    def _info(self, name: str):
        try:
            return self._where[name][1]
        except KeyError:
            raise PackedModelError(
                f"the packed model has no tensor {name!r}",
                hint="the dense part does not match this architecture; re-run the conversion",
            ) from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bits), a read-only view into the mapping (no copy)."""
        info = self._info(name)
        mm = self._maps[self._where[name][0]]
        return mm[info.start : info.end].view(info.np_dtype).reshape(info.shape)

    # -------------------------------------------------------------------------------------------- typed access
    def vector(self, name: str) -> np.ndarray:
        """A (small) float tensor as float32: norm weights, A_log, dt_bias, conv weights. This copies."""
        info = self._info(name)
        if info.dtype not in _FLOAT:
            raise ShapeError(f"{name} is {info.dtype}, expected a float tensor")
        return np.ascontiguousarray(_to_f32(self.raw(name), info.dtype))

    def quant_params(self, module: str) -> tuple[int, int] | None:
        """(bits, group_size) config.json gives `module`, or None when it says the module is not quantized."""
        q = self.quantization
        if q is None:
            return None
        entry = q.get(module, None)
        if entry is False:
            return None
        bits, gs = q.get("bits"), q.get("group_size")
        if isinstance(entry, dict):
            bits, gs = entry.get("bits", bits), entry.get("group_size", gs)
            mode = entry.get("mode", q.get("mode", "affine"))
        else:
            mode = q.get("mode", "affine")
        if mode != "affine":
            raise PackedModelError(f"{module} uses quantization mode {mode!r}; the runtime reads affine only")
        if bits is None or gs is None:
            return None
        return int(bits), int(gs)

    def linear(self, prefix: str, in_features: int | None = None) -> QLinear | FloatLinear:
        """The linear layer (or embedding) `prefix` ('...q_proj'): QLinear when `prefix.scales` exists.

        `in_features`, when given, is checked (and, without a quantization block, used to infer bits and
        group size the way mlx-lm does).
        """
        wname = prefix + ".weight"
        info = self._info(wname)
        if not self.has(prefix + ".scales"):
            if info.dtype not in _FLOAT or len(info.shape) != 2:
                raise ShapeError(f"{wname} is {info.dtype} {list(info.shape)} without scales: not a float matrix")
            if in_features is not None and info.shape[1] != in_features:
                raise ShapeError(f"{wname} has {info.shape[1]} inputs, expected {in_features}")
            return FloatLinear(self.raw(wname), info.dtype)
        if not self.has(prefix + ".biases"):
            raise ShapeError(f"{prefix} has scales but no biases: not MLX affine quantization")
        w, s, b = self.raw(wname), self.raw(prefix + ".scales"), self.raw(prefix + ".biases")
        if info.dtype != "U32" or w.ndim != 2:
            raise ShapeError(f"{wname} is {info.dtype} {list(w.shape)}, expected uint32 [out, words]")
        for part, arr in (("scales", s), ("biases", b)):
            if self.dtype(f"{prefix}.{part}") not in ("BF16",):
                raise ShapeError(f"{prefix}.{part} is {self.dtype(prefix + '.' + part)}, expected BF16")
            if arr.shape != (w.shape[0], s.shape[1]):
                raise ShapeError(f"{prefix}.{part} has shape {list(arr.shape)}, expected [{w.shape[0]}, groups]")
        params = self.quant_params(prefix)
        words, groups = w.shape[1], s.shape[1]
        if params is None:
            if in_features is None:
                raise ShapeError(f"{prefix} is quantized but config.json has no quantization block for it",
                                 hint="add the 'quantization' block mlx_lm.convert writes to config.json")
            params = (words * 32 // in_features, in_features // groups)
        bits, gs = params
        in_dim = words * 32 // bits
        if words * 32 % bits or in_dim != groups * gs or (in_features is not None and in_dim != in_features):
            raise ShapeError(
                f"{prefix}: weight [{w.shape[0]}, {words}] words and {groups} groups per row do not fit "
                f"{bits} bits / group {gs}" + (f" with {in_features} inputs" if in_features else ""),
                hint="config.json's quantization block does not match the tensors",
            )
        return QLinear(w, s, b, bits, gs)

    def close(self) -> None:
        # views handed out keep their mapping alive; dropping ours lets it go when they do
        self._maps = []
        self._where = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _quant_block(config: dict) -> dict | None:
    for holder in (config, config.get("text_config") or {}):
        for key in ("quantization", "quantization_config"):
            q = holder.get(key)
            if isinstance(q, dict) and ("bits" in q or "group_size" in q):
                return q
    return None

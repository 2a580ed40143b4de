"""moepack.json: the manifest that makes a folder a packed model. Written last, atomically.

Frozen dataclasses with a lenient `from_json` (unknown keys ignored, so newer minor additions load) and a
strict `validate` (everything a reader relies on is checked before it is trusted).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..archs.base import MoeShape
from ..errors import PackedModelError
from .atomic import write_json_atomic
from .constants import CHECKSUM_ALGO, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from .record import RecordLayout


@dataclass(frozen=True)
class LayerEntry:
    layer: int
    file: str  # relative to the packed folder
    layout: str  # key into Manifest.record_layouts
    bits: int  # routed-expert bits of this layer (all three projections when uniform)
    method: str  # "repack" (bytes copied) | "requant-minmax" | "quantize" (from float)

    def to_json(self) -> dict:
        return {"layer": self.layer, "file": self.file, "layout": self.layout, "bits": self.bits, "method": self.method}


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    xxh3_64: str

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "xxh3_64": self.xxh3_64}


@dataclass(frozen=True)
class Manifest:
    moepack_version: str
    source: dict
    model_type: str
    config: dict
    moe: MoeShape
    quantization: dict
    record_layouts: dict[str, RecordLayout]
    layers: tuple[LayerEntry, ...]
    record_checksums: dict[int, tuple[str, ...]]  # layer -> per-expert xxh3_64
    dense_files: tuple[FileEntry, ...]
    aux_files: tuple[FileEntry, ...]
    rmse: dict | None = None
    extra: dict = field(default_factory=dict)  # sections added by later tools (eval, card), kept verbatim
    format_version: int = FORMAT_VERSION

    # -- queries ----------------------------------------------------------------------------------
    def layer(self, layer: int) -> LayerEntry:
        for e in self.layers:
            if e.layer == layer:
                return e
        raise PackedModelError(f"layer {layer} has no routed experts in this packed model")

    def layout_of(self, layer: int) -> RecordLayout:
        return self.record_layouts[self.layer(layer).layout]

    @property
    def expert_bytes_total(self) -> int:
        return sum(self.layout_of(e.layer).record_size * self.moe.num_experts for e in self.layers)

    def bytes_per_token(self, k: int | None = None) -> int:
        """Routed-expert bytes one decode token reads at K experts per layer (no cache hits)."""
        k = self.moe.experts_per_token if k is None else k
        return sum(self.layout_of(e.layer).record_size * k for e in self.layers)

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "moepack_version": self.moepack_version,
            "source": self.source,
            "model_type": self.model_type,
            "moe": {"num_layers": self.moe.num_layers, "num_experts": self.moe.num_experts,
                    "experts_per_token": self.moe.experts_per_token, "hidden": self.moe.hidden,
                    "moe_intermediate": self.moe.moe_intermediate},
            "quantization": self.quantization,
            "bits_per_layer": {str(e.layer): e.bits for e in self.layers},
            "record_layouts": {k: v.to_json() for k, v in self.record_layouts.items()},
            "layers": [e.to_json() for e in self.layers],
            "dense_files": [f.to_json() for f in self.dense_files],
            "aux_files": [f.to_json() for f in self.aux_files],
            "checksums": {"algorithm": CHECKSUM_ALGO,
                          "records": {str(k): list(v) for k, v in sorted(self.record_checksums.items())}},
            "config": self.config,
        }
        if self.rmse is not None:
            d["rmse"] = self.rmse
        d.update(self.extra)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        try:
            if d.get("format") != FORMAT_NAME:
                raise PackedModelError(f"not a moepack manifest (format={d.get('format')!r})")
            ver = int(d["format_version"])
            if ver > FORMAT_VERSION:
                raise PackedModelError(f"packed format version {ver} is newer than this moepack reads ({FORMAT_VERSION})",
                                       hint="upgrade moepack: pip install -U moepack")
            moe = MoeShape(**{k: int(v) for k, v in d["moe"].items()})
            known = {"format", "format_version", "moepack_version", "source", "model_type", "moe", "quantization",
                     "bits_per_layer", "record_layouts", "layers", "dense_files", "aux_files", "checksums", "config",
                     "rmse"}
            m = cls(
                moepack_version=str(d["moepack_version"]),
                source=dict(d["source"]),
                model_type=str(d["model_type"]),
                config=dict(d["config"]),
                moe=moe,
                quantization=dict(d["quantization"]),
                record_layouts={k: RecordLayout.from_json(v) for k, v in d["record_layouts"].items()},
                layers=tuple(LayerEntry(int(e["layer"]), str(e["file"]), str(e["layout"]), int(e["bits"]),
                                        str(e["method"])) for e in d["layers"]),
                record_checksums={int(k): tuple(v) for k, v in d["checksums"]["records"].items()},
                dense_files=tuple(FileEntry(f["name"], int(f["size"]), f["xxh3_64"]) for f in d["dense_files"]),
                aux_files=tuple(FileEntry(f["name"], int(f["size"]), f["xxh3_64"]) for f in d["aux_files"]),
                rmse=d.get("rmse"),
                extra={k: v for k, v in d.items() if k not in known},
                format_version=ver,
            )
        except PackedModelError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PackedModelError(f"manifest is malformed ({type(e).__name__}: {e})") from None
        m.validate()
        return m

    def validate(self) -> None:
        if self.moe.num_experts <= 0:
            raise PackedModelError("manifest says the model has no experts")
        seen = set()
        for e in self.layers:
            if e.layer in seen or not (0 <= e.layer < self.moe.num_layers):
                raise PackedModelError(f"manifest layer entry {e.layer} is duplicated or out of range")
            seen.add(e.layer)
            if e.layout not in self.record_layouts:
                raise PackedModelError(f"layer {e.layer} names unknown record layout {e.layout!r}")
            if os.path.isabs(e.file) or ".." in Path(e.file).parts:
                raise PackedModelError(f"layer {e.layer} file {e.file!r} escapes the packed folder")
            sums = self.record_checksums.get(e.layer)
            if sums is None or len(sums) != self.moe.num_experts:
                raise PackedModelError(f"layer {e.layer} has {0 if sums is None else len(sums)} record checksums, "
                                       f"expected {self.moe.num_experts}")
        for f in self.dense_files + self.aux_files:
            if os.path.isabs(f.name) or ".." in Path(f.name).parts:
                raise PackedModelError(f"file entry {f.name!r} escapes the packed folder")


def manifest_path(packed_dir: str | os.PathLike) -> Path:
    return Path(packed_dir) / MANIFEST_NAME


def load_manifest(packed_dir: str | os.PathLike) -> Manifest:
    p = manifest_path(packed_dir)
    if not Path(packed_dir).is_dir():
        raise PackedModelError(f"{packed_dir} is not a folder", hint="pass the folder `moepack convert` wrote")
    if not p.is_file():
        raise PackedModelError(f"{packed_dir} has no {MANIFEST_NAME}: not a packed model (or its conversion did not finish)",
                               hint="run `moepack convert SRC OUT` (re-running it resumes an interrupted conversion)")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackedModelError(f"{p} is not valid JSON ({e})") from None
    return Manifest.from_json(d)


def save_manifest(packed_dir: str | os.PathLike, manifest: Manifest) -> None:
    manifest.validate()
    write_json_atomic(manifest_path(packed_dir), manifest.to_json())

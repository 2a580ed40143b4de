"""`moepack verify` (files and checksums), `moepack verify-rmse` (requantization error) and `inspect`."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .archs.base import PROJS
from .errors import PackedModelError, SourceError
from .layout.checksum import hash_bytes, hash_file
from .layout.manifest import Manifest, load_manifest
from .layout.reader import PackedModel, aligned_empty, pread_into
from .progress import progress_bar


@dataclass
class VerifyReport:
    checked_files: int = 0
    checked_records: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"ok": self.ok, "checked_files": self.checked_files, "checked_records": self.checked_records,
                "problems": self.problems}


def _check_layer(path: Path, manifest: Manifest, layer: int, report: VerifyReport, bar) -> None:
    entry = manifest.layer(layer)
    layout = manifest.layout_of(layer)
    E = manifest.moe.num_experts
    f = path / entry.file
    want = layout.record_size * E
    if not f.is_file():
        report.problems.append(f"{entry.file}: missing")
        bar.advance(want)
        return
    size = f.stat().st_size
    if size != want:
        report.problems.append(f"{entry.file}: {size} bytes, expected {want} ({E} records of {layout.record_size})")
        bar.advance(want)
        return
    sums = manifest.record_checksums[layer]
    bad = []
    buf = aligned_empty(layout.record_size)
    fd = os.open(f, os.O_RDONLY)
    try:
        for e in range(E):
            pread_into(fd, buf, e * layout.record_size)
            if hash_bytes(buf) != sums[e]:
                bad.append(e)
            bar.advance(layout.record_size)
    finally:
        os.close(fd)
    report.checked_files += 1
    report.checked_records += E
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (" ..." if len(bad) > 8 else "")
        report.problems.append(f"{entry.file}: {len(bad)} record(s) fail their checksum (experts {shown})")


def verify(packed: str | os.PathLike, *, workers: int | None = None, progress: bool = True) -> VerifyReport:
    """Every file present with the right size and checksum, every expert record's checksum."""
    path = Path(packed)
    manifest = load_manifest(path)
    report = VerifyReport()
    for fe in manifest.dense_files + manifest.aux_files:
        f = path / fe.name
        if not f.is_file():
            report.problems.append(f"{fe.name}: missing")
        elif f.stat().st_size != fe.size:
            report.problems.append(f"{fe.name}: {f.stat().st_size} bytes, expected {fe.size}")
        elif hash_file(f) != fe.xxh3_64:
            report.problems.append(f"{fe.name}: checksum mismatch")
        else:
            report.checked_files += 1
    total = manifest.expert_bytes_total
    workers = workers or os.cpu_count() or 1
    with progress_bar("verifying records", total, enabled=progress) as bar, ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda e: _check_layer(path, manifest, e.layer, report, bar), manifest.layers))
    report.problems.sort()
    return report


# -- RMSE ---------------------------------------------------------------------------------------------

def _layer_rmse(pm: PackedModel, ckpt, arch, shape, layer: int, kind: str) -> dict:
    from .quant import affine_fast, requant
    from .source.experts import FileReader, plan_hf_layer, plan_mlx_layer, read_float_slice, read_quant_slice

    layout = pm.layout(layer)
    E = shape.num_experts
    le = plan_mlx_layer(ckpt, arch, shape, layer, None) if kind == "mlx" else plan_hf_layer(ckpt, arch, shape, layer)
    reader = FileReader()
    acc = {p: [0.0, 0.0, 0] for p in PROJS}  # sum_sq, max_abs, count
    step = max(1, min(E, (64 << 20) // layout.record_size))
    try:
        for e0 in range(0, E, step):
            e1 = min(E, e0 + step)
            recs = pm.read_records(layer, e0, e1 - e0)
            for proj in PROJS:
                comps = [layout.component(f"{proj}.{part}") for part in ("weight", "scales", "biases")]
                packed = [np.ascontiguousarray(recs[:, c.offset:c.offset + c.nbytes]).view(
                    np.uint32 if c.dtype == "uint32" else np.uint16).reshape((e1 - e0,) + c.shape) for c in comps]
                bits, gs = comps[0].bits, comps[0].group_size
                if kind == "mlx":
                    q = le.projs[proj]
                    src = read_quant_slice(reader, q, e0, e1)
                    s, m, n = requant.quant_error(*src, q.bits, *packed, bits, gs)
                else:
                    f = read_float_slice(reader, le.projs[proj], e0, e1)
                    d = affine_fast.dequantize(*packed, bits, gs) - f
                    s, m, n = float(np.square(d, dtype=np.float64).sum()), float(np.abs(d).max()), d.size
                a = acc[proj]
                a[0] += s
                a[1] = max(a[1], m)
                a[2] += n
    finally:
        reader.close()
    row = {"layer": layer, "bits": pm.manifest.layer(layer).bits}
    for p in PROJS:
        row[p] = float(np.sqrt(acc[p][0] / acc[p][2])) if acc[p][2] else 0.0
    row["max_abs"] = {p: float(acc[p][1]) for p in PROJS}
    return row


def verify_rmse(packed: str | os.PathLike, *, source: str | None = None, revision: str | None = None,
                workers: int | None = None, progress: bool = True) -> dict:
    """Per layer RMSE and max abs error of gate/up/down over all experts, packed vs source."""
    from .archs import architecture_for_config
    from .source.checkpoint import open_checkpoint
    from .source.experts import find_expert_layers

    pm = PackedModel(packed)
    m = pm.manifest
    if source is None:
        src = m.source
        source = src.get("path") if src.get("type") == "local" else src.get("repo_id")
        revision = revision or src.get("revision")
        if not source:
            raise SourceError("the manifest does not say where the source checkpoint is", hint="pass --source SRC")
    ckpt = open_checkpoint(source, revision=revision)
    try:
        arch = architecture_for_config(ckpt.config)
        shape = arch.moe_shape(ckpt.config)
        if arch.model_type != m.model_type or shape != m.moe:
            raise SourceError(f"source {source} is a {arch.model_type} {shape}, the packed model a {m.model_type} {m.moe}",
                              hint="pass --source with the checkpoint this model was converted from")
        kind, layers = find_expert_layers(ckpt, arch)
        if sorted(layers) != sorted(e.layer for e in m.layers):
            raise SourceError("source and packed model have different MoE layers")
        del workers  # the numba kernels are parallel inside; layers go one at a time
        rows = []
        with progress_bar("comparing layers", len(layers), unit_bytes=False, enabled=progress) as bar:
            for layer in sorted(layers):
                rows.append(_layer_rmse(pm, ckpt, arch, shape, layer, kind))
                bar.advance(1)
    finally:
        ckpt.close()
        pm.close()
    overall = {p: float(np.mean([r[p] for r in rows])) for p in PROJS}
    return {"layers": rows, "overall": overall}


# -- inspect --------------------------------------------------------------------------------------------

def inspect(packed: str | os.PathLike, *, k: int | None = None) -> dict:
    path = Path(packed)
    m = load_manifest(path)
    kk = k or m.moe.experts_per_token
    dense = sum(f.size for f in m.dense_files)
    bits = {}
    for e in m.layers:
        bits.setdefault(e.bits, []).append(e.layer)
    return {
        "path": str(path),
        "model_type": m.model_type,
        "source": m.source,
        "format_version": m.format_version,
        "moepack_version": m.moepack_version,
        "layers": m.moe.num_layers,
        "moe_layers": len(m.layers),
        "experts": m.moe.num_experts,
        "experts_per_token": m.moe.experts_per_token,
        "hidden": m.moe.hidden,
        "moe_intermediate": m.moe.moe_intermediate,
        "bits": {str(b): ls for b, ls in sorted(bits.items())},
        "record_sizes": {key: lay.record_size for key, lay in m.record_layouts.items()},
        "expert_bytes": m.expert_bytes_total,
        "dense_bytes": dense,
        "total_bytes": m.expert_bytes_total + dense + sum(f.size for f in m.aux_files),
        "k": kk,
        "bytes_per_token": m.bytes_per_token(kk),
        "quantization": m.quantization,
        "rmse_overall": (m.rmse or {}).get("overall"),
    }

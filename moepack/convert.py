"""`moepack convert`: an MLX (or unquantized HF) MoE checkpoint -> a packed model.

Streams a slice of experts at a time (memory bounded by the slice, not the model), overlaps reads and
writes with compute, writes each layer file under a temporary name and renames it when complete, keeps
a resume state file, and writes the manifest last: a folder without moepack.json is not a packed model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .archs import architecture_for_config
from .convert_stream import cached_source_stats, remove_staging, run_streaming
from .archs.base import PARTS, PROJS
from .errors import DiskSpaceError, MoepackError, OutputError, QuantizationError
from .layout.atomic import fsync_dir, write_json_atomic
from .layout.checksum import hash_bytes, hash_file
from .layout.constants import (DENSE_INDEX_NAME, DENSE_NAME, DENSE_SHARD_BYTES, DENSE_SHARD_NAME, EXPERTS_DIR,
                               FORMAT_VERSION, MANIFEST_NAME, STATE_NAME, layer_file_name)
from .layout.manifest import FileEntry, LayerEntry, Manifest, save_manifest
from .layout.reader import aligned_empty
from .layout.record import RecordLayout, record_layout
from .progress import progress_bar
from .source.checkpoint import open_checkpoint
from .source.dense import plan_dense_hf, plan_dense_mlx, summarize_quantization
from .source.experts import (FileReader, LayerExperts, find_expert_layers, plan_hf_layer, plan_mlx_layer,
                             read_float_slice, read_quant_slice)
from .source.safetensors_file import write_safetensors

SUPPORTED_BITS = (2, 3, 4, 8)
CHUNK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LayerPlan:
    experts: LayerExperts
    target_bits: dict  # proj -> bits
    group_size: int
    layout: RecordLayout
    method: str  # repack | requant-minmax | quantize
    file: str


def parse_layer_bits(spec: str | None) -> dict[int, int]:
    """'0-2=4,59=4' -> {0: 4, 1: 4, 2: 4, 59: 4}."""
    out: dict[int, int] = {}
    if not spec:
        return out
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            layers, bits = item.split("=")
            lo, _, hi = layers.partition("-")
            for layer in range(int(lo), int(hi or lo) + 1):
                out[layer] = int(bits)
        except ValueError:
            raise QuantizationError(f"cannot parse --layer-bits item {item!r}",
                                    hint="use LAYERS=BITS items, e.g. --layer-bits 0-2=4,59=4") from None
    return out


def _check_bits(b):
    if b is not None and b not in SUPPORTED_BITS:
        raise QuantizationError(f"--bits {b} is not supported; use one of {', '.join(map(str, SUPPORTED_BITS))}")


def plan_conversion(ckpt, bits: int | None, layer_bits: dict[int, int], group_size: int):
    arch = architecture_for_config(ckpt.config)
    shape = arch.moe_shape(ckpt.config)
    kind, layers = find_expert_layers(ckpt, arch)
    _check_bits(bits)
    for b in layer_bits.values():
        _check_bits(b)
    unknown = sorted(set(layer_bits) - set(layers))
    if unknown:
        raise QuantizationError(f"--layer-bits names layers {unknown} that have no routed experts",
                                hint=f"MoE layers are {layers[0]}..{layers[-1]}")
    if layers[-1] >= shape.num_layers:
        raise MoepackError(f"expert tensors for layer {layers[-1]} but config.json has {shape.num_layers} layers")
    plans = []
    for layer in layers:
        target = layer_bits.get(layer, bits)
        if kind == "mlx":
            le = plan_mlx_layer(ckpt, arch, shape, layer, None)
            gs = le.group_size
            tb = {p: (target or le.projs[p].bits) for p in PROJS}
            method = "repack" if all(tb[p] == le.projs[p].bits for p in PROJS) else "requant-minmax"
        else:
            le = plan_hf_layer(ckpt, arch, shape, layer)
            gs = group_size
            tb = {p: target or 4 for p in PROJS}
            method = "quantize"
        layout = record_layout(shape, tb, gs)
        plans.append(LayerPlan(le, tb, gs, layout, method, layer_file_name(layer, shape.num_layers)))
    return arch, shape, kind, plans


def _source_identity(ckpt) -> dict:
    if getattr(ckpt, "repo_id", None):
        return {"type": "hub", "repo_id": ckpt.repo_id, "revision": ckpt.revision}
    return {"type": "local", "path": str(Path(ckpt.path).resolve())}


def _fingerprint(ckpt, source, plans, kind) -> dict:
    files = [[s, ckpt.shard_size(s)] for s in ckpt.shards]
    return {"format_version": FORMAT_VERSION, "source": source, "source_files": files, "kind": kind,
            "layers": {str(p.experts.layer): [p.layout.key, p.method] for p in plans}}


# -- output folder ------------------------------------------------------------------------------------

def _prepare_output(out: Path, fingerprint: dict, force: bool) -> dict:
    """The resume state ({} for a fresh start). Refuses folders that hold something else."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        ours = (out / MANIFEST_NAME).exists() or (out / STATE_NAME).exists() or (out / EXPERTS_DIR).exists()
        state = None
        if (out / STATE_NAME).exists():
            try:
                state = json.loads((out / STATE_NAME).read_text())
            except (OSError, json.JSONDecodeError):
                state = None
        if (out / MANIFEST_NAME).exists() and not force:
            raise OutputError(f"{out} already holds a packed model",
                              hint="choose another output folder, or pass --force to replace it")
        if state and state.get("fingerprint") == fingerprint and not (out / MANIFEST_NAME).exists():
            return state
        if not force:
            old_src = (state or {}).get("fingerprint", {}).get("source", {})
            new_src = fingerprint["source"]
            if (old_src.get("type") == new_src["type"] == "hub" and old_src.get("repo_id") == new_src["repo_id"]
                    and old_src.get("revision") != new_src["revision"] and old_src.get("revision")):
                raise OutputError(f"{out} holds an unfinished conversion of {new_src['repo_id']} at commit "
                                  f"{old_src['revision'][:12]}, but the revision now resolves to "
                                  f"{str(new_src['revision'])[:12]}",
                                  hint=f"pass --revision {old_src['revision']} to finish it, or --force to start over")
            if state:
                raise OutputError(f"{out} holds an unfinished conversion with other settings (source or bits differ)",
                                  hint="re-run with the same arguments to resume it, or pass --force to start over")
            raise OutputError(f"{out} is not empty and is not a moepack output folder",
                              hint="choose a new or empty output folder")
        if not ours:
            raise OutputError(f"{out} is not empty and is not a moepack output folder; --force only replaces "
                              "moepack output", hint="choose a new or empty output folder")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return {}


def _save_state(out: Path, state: dict) -> None:
    write_json_atomic(out / STATE_NAME, state)


def _check_disk(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    margin = 64 * 1024 * 1024
    if free < needed + margin:
        raise DiskSpaceError(f"not enough disk space in {out}: {needed / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free")


# -- one layer --------------------------------------------------------------------------------------

def _pwrite_all(fd: int, buf: np.ndarray, offset: int, path) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    try:
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    except OSError as e:
        if e.errno == 28:  # ENOSPC
            raise DiskSpaceError(f"disk full while writing {path}") from None
        raise


class _ErrAcc:
    def __init__(self):
        self.sum_sq = {p: 0.0 for p in PROJS}
        self.count = {p: 0 for p in PROJS}
        self.max_abs = {p: 0.0 for p in PROJS}

    def add(self, proj, s, m, c):
        self.sum_sq[proj] += s
        self.max_abs[proj] = max(self.max_abs[proj], m)
        self.count[proj] += c

    def row(self, layer: int, bits: int) -> dict:
        r = {"layer": layer, "bits": bits}
        for p in PROJS:
            r[p] = float(np.sqrt(self.sum_sq[p] / self.count[p])) if self.count[p] else 0.0
        r["max_abs"] = {p: float(self.max_abs[p]) for p in PROJS}
        return r


def _scatter_read(reader: FileReader, q, rec: np.ndarray, layout: RecordLayout, e0: int, e1: int) -> None:
    """Bit-exact repack: read experts e0..e1 of one projection straight into their record slots.

    Expert e's slice of a stacked tensor is contiguous in the source, so one preadv per component scatters
    the whole run of experts into the records: no intermediate copy.
    """
    for part in PARTS:
        t = q.tensors[part]
        per = t.nbytes // t.shape[0]
        c = layout.component(f"{q.proj}.{part}")
        views = [rec[i, c.offset : c.offset + c.nbytes] for i in range(e1 - e0)]
        reader.preadv(q.files[part], views, t.start + e0 * per)


def _load(plan: LayerPlan, reader: FileReader, e0: int, e1: int):
    """Records for experts e0..e1 with the repacked components filled in, and the sources to transform."""
    layout = plan.layout
    le = plan.experts
    rec = aligned_empty(layout.record_size * (e1 - e0)).reshape(e1 - e0, layout.record_size)
    rec[:, layout.payload_size :] = 0
    pending = {}
    for proj in PROJS:
        src = le.projs[proj]
        if le.kind == "mlx" and plan.target_bits[proj] == src.bits:
            _scatter_read(reader, src, rec, layout, e0, e1)
        elif le.kind == "mlx":
            pending[proj] = read_quant_slice(reader, src, e0, e1)
        else:
            pending[proj] = read_float_slice(reader, src, e0, e1)
    return rec, pending


def _transform(plan: LayerPlan, rec: np.ndarray, pending: dict, acc: _ErrAcc) -> None:
    """Requantize / quantize the components that are not plain copies, into their record slots."""
    from .quant import affine_fast, requant

    layout = plan.layout
    n = rec.shape[0]
    for proj, loaded in pending.items():
        tb = plan.target_bits[proj]
        if plan.experts.kind == "mlx":
            w, s, b = loaded
            sb = plan.experts.projs[proj].bits
            *arrs, err = requant.requantize_minmax_with_error(w, s, b, sb, tb, plan.group_size)
            acc.add(proj, *err)
        else:
            f = loaded
            arrs = affine_fast.quantize(f, tb, plan.group_size)
            d = affine_fast.dequantize(*arrs, tb, plan.group_size) - f
            acc.add(proj, float(np.square(d, dtype=np.float64).sum()), float(np.abs(d).max()), d.size)
        for part, arr in zip(PARTS, arrs):
            c = layout.component(f"{proj}.{part}")
            rec[:, c.offset : c.offset + c.nbytes] = np.ascontiguousarray(arr).reshape(n, -1).view(np.uint8)


def _convert_layer(plan: LayerPlan, out: Path, num_experts: int, reader: FileReader, pool, bar, depth: int):
    layout = plan.layout
    le = plan.experts
    per_expert = le.source_bytes(num_experts) / num_experts
    step = max(1, min(num_experts, 1000, int(CHUNK_BYTES // max(per_expert, 1))))
    chunks = [(e0, min(num_experts, e0 + step)) for e0 in range(0, num_experts, step)]
    final = out / plan.file
    tmp = final.with_name(final.name + ".partial")
    checksums: list[str | None] = [None] * num_experts
    acc = _ErrAcc()

    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        def store(e0, rec):
            for i in range(rec.shape[0]):
                checksums[e0 + i] = hash_bytes(rec[i])
            _pwrite_all(fd, rec, e0 * layout.record_size, final)

        # reads and writes run on the pool; (re)quantization runs here, one chunk at a time, because the
        # numba kernels are parallel inside and must not be entered from several threads at once
        loads: deque = deque()
        stores: deque = deque()
        todo = iter(chunks)
        for c in todo:
            loads.append((c, pool.submit(_load, plan, reader, *c)))
            if len(loads) >= depth:
                break
        while loads:
            (e0, e1), fut = loads.popleft()
            rec, pending = fut.result()
            nxt = next(todo, None)
            if nxt is not None:
                loads.append((nxt, pool.submit(_load, plan, reader, *nxt)))
            if pending:
                _transform(plan, rec, pending, acc)
            del pending
            stores.append(pool.submit(store, e0, rec))
            while len(stores) > depth:
                stores.popleft().result()
            bar.advance(per_expert * (e1 - e0))
        while stores:
            stores.popleft().result()
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    bits = max(plan.target_bits.values())
    return checksums, acc.row(le.layer, bits)


def _layer_still_good(out: Path, plan: LayerPlan, done: dict, num_experts: int) -> bool:
    f = out / plan.file
    size = plan.layout.record_size * num_experts
    if not f.is_file() or f.stat().st_size != size or len(done.get("checksums", [])) != num_experts:
        return False
    with open(f, "rb", buffering=0) as fh:
        for e in range(num_experts):
            buf = fh.read(plan.layout.record_size)
            if hash_bytes(buf) != done["checksums"][e]:
                return False
    return True


# -- dense part and the small files ----------------------------------------------------------------

def _write_dense(out: Path, tensors) -> list[FileEntry]:
    total = sum(t.nbytes for t in tensors)
    groups, cur, cur_bytes = [], [], 0
    for t in tensors:
        # keep the weight/scales/biases of one module in one shard
        if cur and cur_bytes + t.nbytes > DENSE_SHARD_BYTES and not t.name.endswith((".scales", ".biases")):
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(t)
        cur_bytes += t.nbytes
    groups.append(cur)
    entries = []
    if len(groups) == 1:
        names = [DENSE_NAME]
    else:
        names = [DENSE_SHARD_NAME.format(index=i + 1, count=len(groups)) for i in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        write_safetensors(out / name, [(t.name, t.dtype, t.shape, t.produce) for t in group], {"format": "mlx"})
        entries.append(FileEntry(name, (out / name).stat().st_size, hash_file(out / name)))
        weight_map.update({t.name: name for t in group})
    if len(groups) > 1:
        write_json_atomic(out / DENSE_INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        entries.append(FileEntry(DENSE_INDEX_NAME, (out / DENSE_INDEX_NAME).stat().st_size,
                                 hash_file(out / DENSE_INDEX_NAME)))
    return entries


def _copy_aux(ckpt, out: Path, config_override: dict | None) -> list[FileEntry]:
    entries = []
    for src in ckpt.aux_files:
        src = Path(src)
        dst = out / src.name
        tmp = dst.with_name(dst.name + ".tmp")
        if src.name == "config.json" and config_override is not None:
            tmp.write_text(json.dumps(config_override, indent=2) + "\n")
        else:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        entries.append(FileEntry(src.name, dst.stat().st_size, hash_file(dst)))
    return entries


# -- the command ---------------------------------------------------------------------------------------

def convert(src: str, out: str | os.PathLike, *, bits: int | None = None, layer_bits: str | dict | None = None,
            workers: int | None = None, force: bool = False, revision: str | None = None, group_size: int = 64,
            delete_source: bool = False, progress: bool = True, stats: dict | None = None) -> Manifest:
    """Pack `src` (folder or hub repo id) into `out`. Re-running after an interruption resumes.

    A hub repo is streamed (see :mod:`moepack.source.hub_stream`): shard headers first, then each shard is
    downloaded when the next layer needs it; with `delete_source` each shard is deleted from the hub cache once
    everything read from it is packed. `stats`, when given a dict, receives what the source side did
    (shards downloaded / reused / deleted, peak source bytes on disk; `{}` for a local folder).
    """
    out = Path(out)
    lb = layer_bits if isinstance(layer_bits, dict) else parse_layer_bits(layer_bits)
    workers = max(1, workers or os.cpu_count() or 1)
    if delete_source and Path(os.fspath(src)).expanduser().exists():
        raise MoepackError(f"--delete-source only applies to a hub repo id; {src} is a local folder",
                           hint="moepack never deletes your own files: leave out --delete-source, and remove "
                                "the source yourself once the conversion has finished")
    ckpt = open_checkpoint(src, revision=revision, stream=True)
    try:
        return _convert(ckpt, out, bits, lb, workers, force, group_size, progress, delete_source, stats)
    finally:
        ckpt.close()


def _convert(ckpt, out, bits, lb, workers, force, group_size, progress, delete_source=False, stats=None) -> Manifest:
    arch, shape, kind, plans = plan_conversion(ckpt, bits, lb, group_size)
    if kind == "mlx":
        is_expert = lambda n: arch.expert_layer_of(n) is not None  # noqa: E731
        dense = plan_dense_mlx(ckpt, is_expert)
        qblock = ckpt.quantization
        config_out = None
    else:
        is_expert = lambda n: arch.hf_expert_layer_of(n) is not None  # noqa: E731
        dense, qblock = plan_dense_hf(ckpt, arch, is_expert, bits=4, group_size=group_size)
        config_out = dict(ckpt.config)
        config_out["quantization"] = qblock
        config_out["quantization_config"] = qblock
    source = _source_identity(ckpt)
    fp = _fingerprint(ckpt, source, plans, kind)
    state = _prepare_output(out, fp, force)
    state.setdefault("fingerprint", fp)
    state.setdefault("layers", {})
    E = shape.num_experts

    needed = sum(p.layout.record_size * E for p in plans if str(p.experts.layer) not in state["layers"])
    needed += sum(t.nbytes for t in dense) + sum(Path(f).stat().st_size for f in ckpt.aux_files)
    streaming = getattr(ckpt, "streaming", False)
    if not streaming:
        _check_disk(out, needed)
    (out / EXPERTS_DIR).mkdir(exist_ok=True)
    _save_state(out, state)
    pending = [p for p in plans if not (state["layers"].get(str(p.experts.layer))
                                        and _layer_still_good(out, p, state["layers"][str(p.experts.layer)], E))]

    todo = {p.experts.layer for p in pending}

    def pack(plan: LayerPlan, reader: FileReader, pool, bar) -> None:
        checksums, rmse_row = _convert_layer(plan, out, E, reader, pool, bar, depth=max(2, workers))
        state["layers"][str(plan.experts.layer)] = {"file": plan.file, "checksums": checksums, "rmse": rmse_row}
        _save_state(out, state)

    source_stats = None
    if streaming:
        source_stats = run_streaming(ckpt, out, state, plans, pending, pack, E, workers, needed, kind, is_expert,
                                     _dense_done(out, state), delete_source, progress, _save_state)
    else:
        reader = FileReader()
        total = sum(p.experts.source_bytes(E) for p in plans)
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool, \
                    progress_bar(f"packing {len(plans)} layers", total, enabled=progress) as bar:
                for i, plan in enumerate(plans):
                    bar.describe(f"layer {i + 1}/{len(plans)}")
                    if plan.experts.layer not in todo:
                        bar.advance(plan.experts.source_bytes(E))
                        continue
                    pack(plan, reader, pool, bar)
        finally:
            reader.close()

    dense_entries = [FileEntry(**f) for f in state.get("dense", [])]
    if not _dense_done(out, state):
        dense_entries = _write_dense(out, dense)
        state["dense"] = [f.to_json() for f in dense_entries]
        _save_state(out, state)
    aux_entries = _copy_aux(ckpt, out, config_out)
    remove_staging(out)  # dense copies of dropped shards (a hub source with --delete-source), now written

    layouts = {p.layout.key: p.layout for p in plans}
    requantized = any(p.method != "repack" for p in plans)
    rmse = None
    if requantized:
        rows = [state["layers"][str(p.experts.layer)]["rmse"] for p in plans]
        rmse = {"reference": "source" if kind == "mlx" else "source (float)", "layers": rows,
                "overall": {pr: float(np.mean([r[pr] for r in rows])) for pr in PROJS}}
    expert_q = {"group_size": sorted({p.group_size for p in plans}),
                "layouts": sorted(layouts), "methods": sorted({p.method for p in plans})}
    if kind == "mlx":
        expert_q["source_bits"] = sorted({b for p in plans for b in p.experts.source_bits.values()})
    manifest = Manifest(
        moepack_version=__version__,
        source=source,
        model_type=arch.model_type,
        config=ckpt.config,
        moe=shape,
        quantization={"source": qblock, "routed_experts": expert_q, "dense": summarize_quantization(dense, qblock)},
        record_layouts=layouts,
        layers=tuple(LayerEntry(p.experts.layer, p.file, p.layout.key, max(p.target_bits.values()), p.method)
                     for p in plans),
        record_checksums={p.experts.layer: tuple(state["layers"][str(p.experts.layer)]["checksums"]) for p in plans},
        dense_files=tuple(dense_entries),
        aux_files=tuple(aux_entries),
        rmse=rmse,
    )
    save_manifest(out, manifest)
    os.unlink(out / STATE_NAME)
    fsync_dir(out)
    if getattr(ckpt, "repo_id", None) and not streaming:  # from the hub cache (offline): all shards were there
        source_stats = cached_source_stats(ckpt, delete_source)
    if stats is not None:
        stats.clear()
        stats.update(source_stats.to_json() if source_stats is not None else {})
    return manifest


def _dense_done(out: Path, state: dict) -> bool:
    entries = [FileEntry(**f) for f in state.get("dense", [])]
    return bool(entries) and all((out / f.name).is_file() and (out / f.name).stat().st_size == f.size
                                 for f in entries)

"""`moepack convert REPO_ID OUT`: the hub side of a conversion, shard by shard.

The layers are planned from the shard headers (:mod:`moepack.source.hub_stream`), then the jobs run in the order
:func:`~moepack.source.shard_schedule.plan_shard_steps` gives: download a shard, pack every layer whose shards are
all on disk, and with ``--delete-source`` drop every shard no job left needs. A shard's dense tensors (everything
but the routed experts) cannot wait for the end when the shard is dropped, so before it goes they are copied into
``OUT/.moepack-source/`` (one safetensors file per shard, written atomically); the packed dense file is written from
those copies at the end, byte for byte what it would be from the source, and the copies are removed.

Resume: the state file says which layers are finished (checked against their record checksums, as for a local
source) and a staged copy is finished when it exists and holds the shard's dense tensors. Only the shards that
unfinished jobs read are downloaded again: a shard dropped after all its layers were packed is not.
"""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import DiskSpaceError, MoepackError
from .progress import progress_bar
from .source.experts import FileReader, FloatProj, QuantProj
from .source.hub_stream import StreamStats, delete_cached_files, download_folder, existing_parent, same_filesystem
from .source.safetensors_file import SafetensorsFile, write_safetensors
from .source.shard_schedule import peak_on_disk, plan_shard_steps

STAGING_DIR = ".moepack-source"  # inside OUT while converting: dense tensors of shards already dropped
_DISK_MARGIN = 64 * 1024 * 1024


def layer_shards(ckpt, plan) -> frozenset:
    """The shard names a layer's expert tensors live in."""
    paths = []
    for q in plan.experts.projs.values():
        if isinstance(q, QuantProj):
            paths += list(q.files.values())
        elif isinstance(q, FloatProj):
            paths += [path for path, _ in q.ranges]
    return frozenset(Path(p).relative_to(ckpt.path).as_posix() for p in paths)


def dense_sources(ckpt, shard: str, kind: str, is_expert) -> list[str]:
    """The tensors of ``shard`` the packed dense part is made from (for an HF source, not the skipped ones)."""
    from .source.dense import SKIP_HF

    names = [n for n in ckpt.tensors_in_shard(shard) if not is_expert(n)]
    if kind == "hf":
        names = [n for n in names if not any(re.search(r, n) for r in SKIP_HF)]
    return names


def _staged_name(shard: str) -> str:
    return shard.replace("/", "__")


def _staged_ok(path: Path, ckpt, names: list[str]) -> bool:
    if not path.is_file():
        return False
    try:
        with SafetensorsFile(path) as sf:
            return set(sf.tensors) == set(names) and all(
                sf.tensors[n].dtype == ckpt.info(n).dtype and sf.tensors[n].shape == ckpt.info(n).shape
                for n in names)
    except MoepackError:
        return False


def _stage(ckpt, shard: str, names: list[str], path: Path) -> None:
    path.parent.mkdir(exist_ok=True)
    infos = [ckpt.info(n) for n in names]
    write_safetensors(path, [(t.name, t.dtype, t.shape, (lambda n=t.name: ckpt.read_bytes(n))) for t in infos],
                      {"staged_from": shard})
    ckpt.stage(path)


def remove_staging(out: Path) -> None:
    shutil.rmtree(Path(out) / STAGING_DIR, ignore_errors=True)


def _check_space(out: Path, out_bytes: int, source_bytes: int, delete_source: bool = False) -> None:
    cache = download_folder()
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    hint = "free some space" + ("" if delete_source else
                                ", or pass --delete-source so only the shards in flight are on disk at once")
    if same_filesystem(out, cache):
        free = shutil.disk_usage(existing_parent(out)).free
        if free < out_bytes + source_bytes + _DISK_MARGIN:
            raise DiskSpaceError(
                f"not enough disk space in {out}: {gb(out_bytes)} for the packed model + {gb(source_bytes)} of source "
                f"shards downloading into {cache} at once, {gb(free)} free", hint)
        return
    for where, need, what in ((out, out_bytes, "the packed model"), (cache, source_bytes, "source shards at once")):
        free = shutil.disk_usage(existing_parent(where)).free
        if free < need + _DISK_MARGIN:
            raise DiskSpaceError(f"not enough disk space in {where}: {gb(need)} needed for {what}, {gb(free)} free",
                                 hint)


def run_streaming(ckpt, out: Path, state: dict, plans: list, pending: list, pack, num_experts: int, workers: int,
                  out_bytes: int, kind: str, is_expert, dense_done: bool, delete_source: bool, progress: bool,
                  save_state) -> StreamStats:
    """Download, pack and (with ``delete_source``) drop shard by shard; returns what happened to the source."""
    by_layer = {p.experts.layer: p for p in pending}
    jobs: dict = {("layer", p.experts.layer): layer_shards(ckpt, p) for p in pending}
    staging = out / STAGING_DIR
    to_stage: dict[str, list[str]] = {}
    if not dense_done:
        from_source = []
        for shard in ckpt.shards:
            names = dense_sources(ckpt, shard, kind, is_expert)
            if not names:
                continue
            path = staging / _staged_name(shard)
            if _staged_ok(path, ckpt, names):  # copied by an earlier, interrupted run
                ckpt.stage(path)
            elif delete_source:
                to_stage[shard] = names
                jobs[("dense", shard)] = frozenset([shard])
            else:
                from_source.append(shard)
        if from_source:  # the dense part is written from these shards themselves at the end: keep them
            jobs[("dense", None)] = frozenset(from_source)
    sizes = {s: ckpt.shard_size(s) for s in ckpt.shards}
    present = [s for s in ckpt.shards if ckpt.is_present(s)]
    steps = plan_shard_steps(jobs, ckpt.shards, sizes, present, drop=delete_source)
    peak, fetched_peak = peak_on_disk(steps)
    wanted = set().union(*jobs.values()) if jobs else set()
    stats = StreamStats(shards=len(ckpt.shards), source_bytes=sum(sizes.values()), planned_peak_source_bytes=peak,
                        reused=[s for s in present if s in wanted])
    staging_bytes = sum(ckpt.info(n).nbytes for names in to_stage.values() for n in names)
    _check_space(out, out_bytes + staging_bytes, fetched_peak, delete_source)

    fetches = [s.fetch for s in steps if s.fetch is not None]
    total = sum(sizes[f] for f in fetches) + sum(p.experts.source_bytes(num_experts) for p in pending)
    state.setdefault("source", {"deleted": []})

    position = {p.experts.layer: i for i, p in enumerate(plans)}

    def label(shard: str) -> str:
        return f"shard {ckpt.shards.index(shard) + 1}/{len(ckpt.shards)}"

    with ThreadPoolExecutor(max_workers=workers) as pool, \
            progress_bar(f"{len(fetches)} shards, {len(pending)} layers", total, enabled=progress) as bar:
        stats.peak_source_bytes_on_disk = ckpt.source_bytes_on_disk()
        for step in steps:
            if step.fetch is not None:
                bar.describe(f"download {label(step.fetch)}")
                before = len(stats.reused)
                ckpt.fetch(step.fetch, progress_bar=bar, stats=stats)
                if len(stats.reused) > before:  # already cached: nothing went through the bar
                    bar.advance(sizes[step.fetch])
                stats.peak_source_bytes_on_disk = max(stats.peak_source_bytes_on_disk, ckpt.source_bytes_on_disk())
            for what, key in step.run:
                if what == "layer":
                    plan = by_layer[key]
                    bar.describe(f"pack layer {key} ({position[key] + 1}/{len(plans)})")
                    reader = FileReader()  # one per layer: a dropped shard must not stay open
                    try:
                        pack(plan, reader, pool, bar)
                    finally:
                        reader.close()
                elif key is not None:
                    bar.describe(f"dense of {label(key)}")
                    _stage(ckpt, key, to_stage[key], staging / _staged_name(key))
            for shard in step.drop:
                bar.describe(f"delete {label(shard)}")
                ckpt.drop(shard, stats=stats)
                state["source"]["deleted"] = sorted(set(state["source"]["deleted"]) | {shard})
            if step.drop:
                save_state(out, state)
    return stats


def cached_source_stats(ckpt, delete_source: bool) -> StreamStats:
    """For a repo converted straight from a complete hub cache (offline): every shard was on disk throughout;
    with ``delete_source`` they are deleted from the cache now."""
    sizes = {s: ckpt.shard_size(s) for s in ckpt.shards}
    total = sum(sizes.values())
    stats = StreamStats(shards=len(sizes), source_bytes=total, reused=list(sizes), peak_source_bytes_on_disk=total,
                        planned_peak_source_bytes=total)
    if delete_source:
        for s in ckpt.shards:
            ckpt.release_shard(s)
        if delete_cached_files(ckpt.repo_id, ckpt.revision, list(sizes)):
            stats.deleted = list(sizes)
    return stats

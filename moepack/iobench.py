"""`moepack bench-io`: the expert-read benchmark on the user's own machine, and the recommendation it saves.

Every cell reads the same random distinct expert records with a real :class:`ExpertReader` (requests of K
records, as decode issues them) and is timed end to end:

* ``threads``  sequential (1) vs parallel reads: pread, mmap+copy, hybrid and direct, cold and warm;
* ``split``    whole-record vs split reads (at the largest thread count);
* ``align``    16 KiB vs 2 MiB aligned destination buffers (warm, one thread);
* ``half``     half of the records resident (every other one warmed first): where the hybrid should win.

``mapped`` is the hybrid reader that hands a wholly cached record over in place (a view of the mapping: no
bytes move), so its warm GB/s is "records made usable per second", not a copy rate; the kernels then read the
weights from the page cache exactly as they would from a buffer. Why not copying is what wins warm: into the
reader's page-aligned buffers a warm pread copies as fast as memcpy out of a mapping does (measured here, 4
threads, 3.93 MB records: 11-14 GB/s both); the seeds' "mmap+copy 1.8x pread" shows only with a destination
off page alignment (a malloc'd buffer: pread 4.1-4.4 vs memcpy 12.2-12.6 GB/s), where the kernel's copy
slows down. So the copying hybrid ties pread when warm, and the in-place one does not copy at all.

Cold: the layer files are dropped from the page cache first (Linux: posix_fadvise DONTNEED; macOS: msync
MS_INVALIDATE); ``direct`` bypasses it (O_DIRECT / F_NOCACHE). Warm: the records are read once first. Each cold
cell records how much of the files was still resident after the drop (``resident_before``). Warm: the records
are in the page cache and were read once before by the same reader (the steady state of a run, in which the
mmap and hybrid readers' own mappings already map the pages).

The recommendation is the (mode, threads, split) with the least expected time per byte at the resident fraction
`f` the model would have (free RAM / expert bytes; 0.5 for a synthetic file): ``f / warm + (1 - f) / cold``.
It is saved per machine in ``$MOEPACK_CACHE`` (default ``~/.cache/moepack``) under ``io/<host>.json``, keyed by
the packed folder and by the disk (device id) that holds it; ``moepack run --io auto`` looks it up
(``recommended_io``) and falls back to pread. The packed folder itself is not written to (it may be a
verified, read-only hub snapshot).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .archs.base import MoeShape
from .errors import MoepackError
from .layout.atomic import write_json_atomic
from .layout.constants import layer_file_name
from .layout.manifest import LayerEntry, Manifest, save_manifest
from .layout.reader import BUFFER_ALIGN, PackedModel, aligned_empty, pread_into
from .layout.record import record_layout
from .runtime.io import ExpertReader
from .runtime.residency import available_ram, evict

QWEN397 = MoeShape(num_layers=60, num_experts=512, experts_per_token=10, hidden=4096, moe_intermediate=1024)
ALIGN_16K = 16 * 1024
HALF_MODES = ("pread", "mmap", "hybrid", "mapped")  # the 'half' group: half of the records resident
MODES = ("pread", "mmap", "hybrid", "mapped", "direct")


# ------------------------------------------------------------------------------------------------ synthetic model


def synthetic_plan(gb: float, bits: int = 2) -> tuple[int, int, int]:
    """(layers, experts per layer, record size) for about `gb` GB of real Qwen3.5-397B records: 512 experts
    per layer, fewer (16 at least) when `gb` is less than one layer."""
    if bits not in (2, 4):
        raise MoepackError(f"synthetic records are 2- or 4-bit, not {bits}")
    if not gb > 0:
        raise MoepackError(f"--synthetic needs a size in GB above 0, got {gb}", hint="e.g. --synthetic 2")
    rec = record_layout(QWEN397, bits).record_size
    n = max(16, int(gb * 1e9 // rec))
    if n <= QWEN397.num_experts:
        return 1, n, rec
    return -(-n // QWEN397.num_experts), QWEN397.num_experts, rec


def write_synthetic_packed(folder: str | os.PathLike, gb: float, bits: int = 2, seed: int = 0,
                           progress: bool = False) -> Path:
    """A packed model folder holding only routed experts of real 397B record size (random bytes, real
    checksums, fsynced so the page cache can drop them): enough for PackedModel, ExpertReader and verify."""
    from .progress import progress_bar

    layers, n_exp, rec_size = synthetic_plan(gb, bits)
    folder = Path(folder)
    (folder / "packed_experts").mkdir(parents=True, exist_ok=True)
    shape = MoeShape(layers, n_exp, min(QWEN397.experts_per_token, n_exp), QWEN397.hidden, QWEN397.moe_intermediate)
    layout = record_layout(shape, bits)
    rng = np.random.default_rng(seed)
    sums, entries = {}, []
    try:
        from .layout.checksum import hash_bytes
    except ImportError:  # xxhash missing (a bare benchmark machine): checksums of zeros, `verify` will object
        def hash_bytes(_):
            return "0" * 16
    with progress_bar("writing synthetic experts", layers * n_exp * rec_size, enabled=progress) as bar:
        for layer in range(layers):
            name = layer_file_name(layer, layers)
            with open(folder / name, "wb") as f:
                digests = []
                for _ in range(n_exp):
                    rec = rng.bit_generator.random_raw(rec_size // 8).view(np.uint8)
                    digests.append(hash_bytes(rec))
                    f.write(memoryview(rec))
                    bar.advance(rec_size)
                f.flush()
                os.fsync(f.fileno())
            sums[layer] = tuple(digests)
            entries.append(LayerEntry(layer, name, layout.key, bits, "quantize"))
    config = {"model_type": "qwen3_5_moe", "num_hidden_layers": layers, "num_experts": n_exp,
              "num_experts_per_tok": shape.experts_per_token, "hidden_size": shape.hidden,
              "moe_intermediate_size": shape.moe_intermediate}
    from . import __version__

    save_manifest(folder, Manifest(__version__, {"synthetic": True, "seed": seed}, "qwen3_5_moe", config, shape,
                                   {"bits": bits, "group_size": 64}, {layout.key: layout}, tuple(entries), sums,
                                   (), ()))
    return folder


def _fs_type(path: Path) -> str:
    """The file system type holding `path` (Linux /proc/self/mounts; '' elsewhere)."""
    try:
        best, kind = "", ""
        real = str(path.resolve())
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
        return kind
    except OSError:
        return ""


def scratch_dir(need_bytes: int) -> Path:
    """A folder on a real disk (not tmpfs: its pages cannot be dropped) with room for `need_bytes` + 1 GB."""
    seen = []
    for cand in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        p = Path(cand)
        if not p.is_dir() or p in seen:
            continue
        seen.append(p)
        if _fs_type(p) in ("tmpfs", "ramfs"):
            continue
        if shutil.disk_usage(p).free >= need_bytes + 10**9:
            return p
    raise MoepackError(f"no folder on a real disk has {(need_bytes + 10**9) / 1e9:.1f} GB free for the synthetic file",
                       hint="free some space, set TMPDIR to a folder on your SSD, or pass a smaller --synthetic")


@contextmanager
def synthetic_model(gb: float, bits: int = 2, progress: bool = False):
    """A temporary synthetic packed model on a real disk, removed afterwards."""
    layers, n_exp, rec = synthetic_plan(gb, bits)
    root = Path(tempfile.mkdtemp(prefix="moepack-bench-io-", dir=scratch_dir(layers * n_exp * rec)))
    try:
        yield write_synthetic_packed(root / "synthetic", gb, bits, progress=progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ cells


@dataclass
class Cell:
    group: str  # 'threads' | 'split' | 'align' | 'half'
    mode: str  # requested io mode
    io_used: str  # the mode the reader ran (direct falls back to pread where refused)
    state: str  # 'cold' | 'warm' | 'half' | 'cached' (warm, but not yet read by this reader)
    threads: int
    split: int
    align: int  # destination buffer alignment, bytes
    experts: int  # records read
    bytes: int
    seconds: float
    gb_s: float
    ms_per_expert: float
    resident_before: float  # fraction of the selected records' pages resident when timing began
    probe_us: float | None = None  # hybrid: residency check per read (cachestat and/or mincore), mean
    mincore_us: float | None = None  # hybrid: mean time of one mincore scan (None: cachestat settled every read)
    copied_fraction: float | None = None  # hybrid: bytes copied from the mapping / bytes read
    in_place_fraction: float | None = None  # mapped: records handed over in place (no bytes moved) / records


def _layer_files(pm: PackedModel) -> list[Path]:
    return [pm.path / e.file for e in pm.manifest.layers]


def _resident_fraction(pm: PackedModel, picks) -> float:
    from .runtime.residency import FileMap

    got = total = 0
    for layer in sorted({lay for lay, _ in picks}):
        size = pm.layout(layer).record_size
        with FileMap(pm.path / pm.manifest.layer(layer).file) as fm:
            for lay, e in picks:
                if lay == layer:
                    v = fm.resident(e * size, size)
                    got += int(v.sum())
                    total += v.size
    return got / total if total else 0.0


def prepare(pm: PackedModel, picks, state: str) -> bool:
    """Put the picked records in `state`; False when the page cache could not be dropped (cold is warm)."""
    ok = True
    if state in ("cold", "half"):
        for f in _layer_files(pm):
            evict(f)
        time.sleep(0.2)  # readahead a previous cell queued (mmap faults) may still be landing: let it, drop again
        for f in _layer_files(pm):
            ok &= evict(f) < 0.05
    if state in ("warm", "cached", "half"):
        chosen = picks[::2] if state == "half" else picks
        buf = aligned_empty(max(pm.layout(lay).record_size for lay, _ in picks))
        fds = {}
        try:
            for lay, e in chosen:
                if lay not in fds:  # an own descriptor without readahead: warm exactly the chosen records
                    fds[lay] = os.open(pm.path / pm.manifest.layer(lay).file, os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fds[lay], 0, 0, os.POSIX_FADV_RANDOM)
                size = pm.layout(lay).record_size
                pread_into(fds[lay], buf[:size], e * size)
        finally:
            for fd in fds.values():
                os.close(fd)
    return ok


def measure(pm: PackedModel, picks, *, group: str, mode: str, state: str, threads: int, split: int = 1,
            align: int = BUFFER_ALIGN, batch: int = 4) -> Cell:
    """Time reading `picks` [(layer, expert)] in requests of `batch` records of one layer."""
    prepare(pm, picks, state)
    resident = _resident_fraction(pm, picks)
    requests: list[tuple[int, list[int]]] = []
    for lay, e in picks:
        if requests and requests[-1][0] == lay and len(requests[-1][1]) < batch:
            requests[-1][1].append(e)
        else:
            requests.append((lay, [e]))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # direct on a file system without O_DIRECT: noted in io_used
        with ExpertReader(pm, io=mode, threads=threads, split=split, buffer_align=align) as reader:
            if state == "warm":  # steady state: read once before by this reader (its mapping's pages are mapped)
                for lay, ids in requests:
                    reader.read(lay, ids)
                reader.stats.reset()
            t0 = time.perf_counter()
            for lay, ids in requests:
                reader.read(lay, ids)
            dt = time.perf_counter() - t0
            st = reader.stats
            io_used = reader.io
    nbytes = st.bytes_read
    cell = Cell(group, mode, io_used, state, threads, split, align, len(picks), nbytes, dt, nbytes / dt / 1e9,
                dt * 1e3 / len(picks), resident)
    if io_used in ("hybrid", "mapped"):
        # mapped probes each record once before deciding (in place or a hybrid read, which probes again)
        probes = st.chunks if io_used == "hybrid" else st.reads + st.chunks
        cell.probe_us = (st.cachestat_s + st.mincore_s) / max(1, probes) * 1e6
        cell.mincore_us = st.mincore_s / st.mincore_calls * 1e6 if st.mincore_calls else None
        cell.copied_fraction = st.copied_bytes / max(1, nbytes)
    if io_used == "mapped":
        cell.in_place_fraction = st.mapped_reads / max(1, st.reads)
    return cell


def pick_records(pm: PackedModel, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """`n` distinct random (layer, expert) records, grouped by layer (ascending), random within a layer."""
    all_recs = [(e.layer, x) for e in pm.manifest.layers for x in range(pm.manifest.moe.num_experts)]
    picks = random.Random(seed).sample(all_recs, min(n, len(all_recs)))
    return sorted(picks, key=lambda p: p[0])


def raw_direct_bandwidth(path: str | os.PathLike, max_bytes: int = 1 << 30, block: int = 16 << 20) -> dict:
    """Sequential O_DIRECT (macOS: F_NOCACHE) reads of `path` in `block`-byte reads, as `dd iflag=direct` does:
    the disk's raw read bandwidth. The page cache is dropped first."""
    evict(path)
    size = min(os.path.getsize(path), max_bytes) // block * block or os.path.getsize(path)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd, flags = os.open(path, os.O_RDONLY), os.O_RDONLY
    direct = flags != os.O_RDONLY
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, 48, 1)  # F_NOCACHE
        direct = True
    buf = aligned_empty(block)
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        pos = 0
        while pos < size:
            n = os.preadv(fd, [view[: min(block, size - pos)]], pos)
            if n <= 0:
                break
            pos += n
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"bytes": pos, "seconds": dt, "gb_s": pos / dt / 1e9, "direct": direct, "block": block}


# ------------------------------------------------------------------------------------------------ the benchmark


def bench(pm: PackedModel, *, threads=(1, 2, 4, 8), splits=(1, 2, 4, 8), experts: int = 64, batch: int | None = None,
          progress: bool = False, seed: int = 0, resident_guess: float | None = None) -> dict:
    """Every cell of the benchmark on `pm`; returns {'cells', 'recommendation', ...} (the --json output)."""
    from .progress import progress_bar

    threads = sorted({int(t) for t in threads})
    splits = sorted({int(s) for s in splits})
    if not threads or threads[0] < 1 or not splits or splits[0] < 1:
        raise MoepackError("--threads and --split take positive integers", hint="e.g. --threads 1,2,4,8")
    if experts < 1:
        raise MoepackError(f"--experts must be at least 1, got {experts}")
    batch = batch or pm.manifest.moe.experts_per_token
    picks = pick_records(pm, experts, seed)
    tmax = threads[-1]
    plan = []  # (group, mode, state, threads, split, align)
    for mode in MODES:
        for state in ("cold", "warm"):
            plan += [("threads", mode, state, t, 1, BUFFER_ALIGN) for t in threads]
    for mode in ("pread", "hybrid", "direct"):
        for state in ("cold", "warm"):
            plan += [("split", mode, state, tmax, s, BUFFER_ALIGN) for s in splits if s > 1]
    for mode in ("pread", "mmap", "hybrid"):
        plan += [("align", mode, "warm", 1, 1, a) for a in (ALIGN_16K, BUFFER_ALIGN)]
    plan += [("half", mode, "half", tmax, 1, BUFFER_ALIGN) for mode in HALF_MODES]
    cells: list[Cell] = []
    cache_drops = prepare(pm, picks[:1], "cold")
    with progress_bar("bench-io", len(plan), unit_bytes=False, enabled=progress) as bar:
        for group, mode, state, t, s, a in plan:
            bar.describe(f"bench-io {mode} {state} x{t}" + (f" split {s}" if s > 1 else ""))
            cells.append(measure(pm, picks, group=group, mode=mode, state=state, threads=t, split=s, align=a,
                                 batch=batch))
            bar.advance(1)
    raw = raw_direct_bandwidth(pm.path / pm.manifest.layers[0].file)
    if resident_guess is None:
        resident_guess = min(1.0, available_ram() / max(1, pm.manifest.expert_bytes_total))
    rec = recommend(cells, resident_guess)
    return {"machine": machine_info(), "packed": str(pm.path), "record_size": pm.layout(picks[0][0]).record_size,
            "experts": len(picks), "batch": batch, "threads": threads, "splits": splits,
            "cache_drop_works": bool(cache_drops), "raw_direct": raw, "resident_guess": resident_guess,
            "cells": [asdict(c) for c in cells], "recommendation": rec}


def recommend(cells: list[Cell], resident: float) -> dict:
    """The (mode, threads, split) with the least expected seconds per GB, f / warm + (1 - f) / cold."""
    by_key: dict[tuple, dict[str, Cell]] = {}
    for c in cells:
        if c.group in ("threads", "split") and c.state in ("cold", "warm") and c.io_used == c.mode:
            by_key.setdefault((c.mode, c.threads, c.split), {})[c.state] = c
    best = None
    for (mode, t, s), st in by_key.items():
        if "cold" not in st or "warm" not in st:
            continue
        score = resident / st["warm"].gb_s + (1 - resident) / st["cold"].gb_s
        key = (score, t, s)  # ties: fewer threads, fewer chunks
        if best is None or key < best[0]:
            best = (key, {"io": mode, "threads": t, "split": s, "warm_gb_s": st["warm"].gb_s,
                          "cold_gb_s": st["cold"].gb_s, "resident_guess": resident, "s_per_gb": score})
    return best[1] if best else {"io": "pread", "threads": 4, "split": 1}


def machine_info() -> dict:
    return {"host": socket.gethostname(), "platform": sys.platform, "cpus": os.cpu_count(),
            "page_size": os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None}


# ------------------------------------------------------------------------------------------------ saved recommendations


def store_path() -> Path:
    root = Path(os.environ.get("MOEPACK_CACHE") or Path.home() / ".cache" / "moepack")
    host = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in socket.gethostname()) or "host"
    return root / "io" / f"{host}.json"


def _device_of(pm_or_path) -> str | None:
    """The disk (st_dev) holding the model's first layer file: a PackedModel, a packed folder or a file."""
    pm = pm_or_path
    try:
        if isinstance(pm, PackedModel):
            path = pm.path / pm.manifest.layers[0].file
        elif Path(pm).is_dir():
            from .layout.manifest import load_manifest

            path = Path(pm) / load_manifest(pm).layers[0].file
        else:
            path = Path(pm)
        return str(os.stat(path).st_dev)
    except (OSError, IndexError, MoepackError):
        return None


def _load_store() -> dict:
    try:
        d = json.loads(store_path().read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def save_recommendation(pm: PackedModel, rec: dict, synthetic: bool) -> Path:
    """Store `rec` for the model itself (unless `pm` is a synthetic file) and for the disk holding it (unless
    its records are under 1 MiB: a tiny model says little about how the disk serves real experts)."""
    d = _load_store()
    entry = dict(rec, measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), packed=str(pm.path),
                 synthetic=synthetic)
    dev = _device_of(pm)
    big = max(pm.layout(e.layer).record_size for e in pm.manifest.layers) >= 1 << 20
    if dev is not None and (synthetic or big):
        d.setdefault("devices", {})[dev] = entry
    if not synthetic:
        d.setdefault("models", {})[str(Path(pm.path).resolve())] = entry
    d["machine"] = machine_info()
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, d)
    return path


def recommended_io(pm: PackedModel | str | os.PathLike) -> dict | None:
    """The saved recommendation for `pm` (a PackedModel or a packed folder: the folder, else its disk) with
    'source' saying which; None if none."""
    from .runtime.io import IO_MODES

    d = _load_store()

    def valid(rec) -> bool:  # a hand-edited or older file must not break `run --io auto`
        try:
            return rec["io"] in IO_MODES and int(rec["threads"]) >= 1 and int(rec["split"]) >= 1
        except (KeyError, TypeError, ValueError):
            return False

    rec = d.get("models", {}).get(str(Path(pm.path if isinstance(pm, PackedModel) else pm).resolve()))
    if rec is not None and valid(rec):
        return dict(rec, source="model")
    dev = _device_of(pm)
    rec = d.get("devices", {}).get(dev) if dev is not None else None
    return dict(rec, source="device") if rec is not None and valid(rec) else None


# ------------------------------------------------------------------------------------------------ output


def table(res: dict) -> str:
    """The cells as a plain-text table, one row per cell, then the recommendation."""
    head = f"{'group':<8}{'mode':<8}{'state':<6}{'thr':>4}{'split':>6}{'align':>7}{'GB/s':>8}{'ms/exp':>9}{'res%':>6}  notes"
    lines = [f"{res['experts']} records of {res['record_size'] / 1e6:.2f} MB, requests of {res['batch']}; "
             f"raw sequential {'O_DIRECT' if res['raw_direct']['direct'] else 'buffered'} read "
             f"{res['raw_direct']['gb_s']:.2f} GB/s", head]
    for c in res["cells"]:
        notes = []
        if c["io_used"] != c["mode"]:
            notes.append(f"ran as {c['io_used']}")
        if c.get("in_place_fraction") is not None:
            notes.append(f"in place {c['in_place_fraction'] * 100:.0f}% (no bytes moved)")
        if c["probe_us"] is not None:
            notes.append(f"probe {c['probe_us']:.0f} us"
                         + (f" (mincore {c['mincore_us']:.0f} us)" if c["mincore_us"] is not None else "")
                         + f", copied {c['copied_fraction'] * 100:.0f}%")
        align = "2M" if c["align"] >= BUFFER_ALIGN else f"{c['align'] // 1024}K"
        lines.append(f"{c['group']:<8}{c['mode']:<8}{c['state']:<6}{c['threads']:>4}{c['split']:>6}{align:>7}"
                     f"{c['gb_s']:>8.2f}{c['ms_per_expert']:>9.2f}{c['resident_before'] * 100:>6.0f}  {', '.join(notes)}")
    r = res["recommendation"]
    lines.append(f"recommended: --io {r['io']} --split {r['split']} ({r['threads']} threads)"
                 + (f": {r['warm_gb_s']:.2f} GB/s warm, {r['cold_gb_s']:.2f} GB/s cold, weighted for "
                    f"{r['resident_guess'] * 100:.0f}% resident" if "warm_gb_s" in r else ""))
    if not res["cache_drop_works"]:
        lines.append("warning: the page cache could not be dropped here (tmpfs?): 'cold' cells read cached data")
    return "\n".join(lines)


def run_bench_io(packed: str | None, *, synthetic: float | None = None, threads=(1, 2, 4, 8), splits=(1, 2, 4, 8),
                 experts: int = 64, progress: bool = False, save: bool = True) -> dict:
    """`moepack bench-io`: on PACKED's records, or on a temporary synthetic model of `synthetic` GB."""
    if (packed is None) == (synthetic is None):
        raise MoepackError("pass a packed model folder or --synthetic GB (not both)" if packed else
                           "nothing to benchmark", hint="e.g. `moepack bench-io ./q397-2bit` or "
                                                        "`moepack bench-io --synthetic 2`")
    if synthetic is not None:
        with synthetic_model(synthetic, progress=progress) as folder, PackedModel(folder) as pm:
            res = bench(pm, threads=threads, splits=splits, experts=experts, progress=progress, resident_guess=0.5)
            res["synthetic_gb"] = synthetic
            if save:
                res["saved_to"] = str(save_recommendation(pm, res["recommendation"], synthetic=True))
        return res
    with PackedModel(packed) as pm:
        res = bench(pm, threads=threads, splits=splits, experts=experts, progress=progress)
        if save:
            res["saved_to"] = str(save_recommendation(pm, res["recommendation"], synthetic=False))
    return res

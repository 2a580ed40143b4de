"""Expert-read figures of the I/O engine, as ratios measured in one run on a synthetic packed model of real
Qwen3.5-397B record size (2-bit: 3,932,160 B per expert, 512 experts per layer; random bytes).

Each figure reads `--experts` distinct random records per repetition (a fresh random set each time) through the
runtime's ExpertReader in requests of K (`--batch`) records with `--threads` threads, and keeps the median of
`--reps` repetitions:

1. cold expert reads (best mode) vs the disk's raw sequential bandwidth: O_DIRECT reads of 16 MiB in this
   process, and `dd iflag=direct bs=16M` when dd exists;
2. hybrid vs the better of pread and mmap+copy, all records warm (read once before by the same reader) and all
   cold (page cache dropped with posix_fadvise DONTNEED);
3. hybrid vs both with half the records resident (every other one warmed first);
4. warm hybrid vs warm pread; also 'cached' (in the page cache but not yet read by this reader, so its mapping
   has no page-table entries yet: mincore walks the page cache and the copy page-faults);
5. the same figures for 'mapped', the hybrid that hands wholly cached records over in place (no copy);
6. warm pread into page-aligned and into misaligned buffers vs memcpy out of a mapping (why a copying
   hybrid cannot beat a pread into aligned buffers by much).

    .venv/bin/python benchmarks/io.py [--gb 4] [--experts 128] [--reps 3] [--threads 4] [--batch 4] [--json]
                                      [--dir DIR] [--keep]

Needs Linux or macOS and a real disk (not tmpfs). Disk: --gb GB, removed afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moepack.iobench import measure, pick_records, raw_direct_bandwidth, scratch_dir, synthetic_plan, write_synthetic_packed  # noqa: E402
from moepack.layout.reader import PackedModel  # noqa: E402
from moepack.runtime.residency import evict  # noqa: E402

MODES = ("pread", "mmap", "hybrid", "mapped", "direct")


def dd_bandwidth(path: Path, max_bytes: int = 1 << 30) -> float | None:
    """GB/s of `dd if=path of=/dev/null bs=16M iflag=direct` (Linux dd), None when unavailable."""
    if shutil.which("dd") is None or sys.platform != "linux":
        return None
    evict(path)
    count = max(1, max_bytes // (16 << 20))
    t0 = time.perf_counter()
    r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", f"count={count}", "iflag=direct"],
                       capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        return None
    return min(path.stat().st_size, count * (16 << 20)) / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the synthetic model goes (default: a real-disk temp dir)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    layers, n_exp, rec = synthetic_plan(a.gb, 2)
    base = Path(a.dir) if a.dir else scratch_dir(layers * n_exp * rec)
    root = Path(tempfile.mkdtemp(prefix="moepack-bench-io-", dir=base))
    t_start = time.perf_counter()
    try:
        t0 = time.perf_counter()
        folder = write_synthetic_packed(root / "synthetic", a.gb, bits=2, progress=not a.json)
        write_s = time.perf_counter() - t0
        with PackedModel(folder) as pm:
            res = run(pm, a)
        res["write_s"] = write_s
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    res["total_s"] = time.perf_counter() - t_start
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(report(res))


def copy_vs_pread(path: Path, record: int, threads: int, n: int = 64) -> dict:
    """Warm GB/s of the three ways to move a cached record into a buffer: pread into a page-aligned buffer,
    pread into one 16 bytes off page alignment (a malloc'd buffer), and memcpy out of a mapping whose page
    tables are already filled. Why the copying hybrid only ties pread here: see moepack/iobench.py."""
    import mmap
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from moepack.layout.reader import aligned_empty

    size = path.stat().st_size
    n = min(n, size // record)
    offs = [i * record for i in range(n)]
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    src = np.frombuffer(m, dtype=np.uint8)
    try:
        aligned = [aligned_empty(record, 1 << 21) for _ in range(threads)]
        unaligned = [aligned_empty(record + 4096, 1 << 21)[16 : 16 + record] for _ in range(threads)]
        ways = {"pread_aligned": lambda i, b: os.preadv(fd, [b], offs[i]),
                "pread_unaligned": lambda i, b: os.preadv(fd, [b], offs[i]),
                "copy": lambda i, b: np.copyto(b, src[offs[i] : offs[i] + record])}
        out = {}
        with ThreadPoolExecutor(threads) as ex:
            for name, fn in ways.items():
                bufs = unaligned if name == "pread_unaligned" else aligned
                for rep in range(2):  # the first pass warms the pages and the mapping's page tables
                    t0 = time.perf_counter()
                    list(ex.map(lambda i: fn(i, bufs[i % threads]), range(n)))
                    dt = time.perf_counter() - t0
                out[name] = n * record / dt / 1e9
        return out
    finally:
        src = None  # the view must go before the mapping can close
        m.close()
        os.close(fd)


def run(pm: PackedModel, a) -> dict:
    cells: dict[tuple[str, str], list[float]] = {}
    extra: dict[tuple[str, str], list[dict]] = {}
    plan = [(m, s) for s in ("cold", "warm", "half", "cached") for m in MODES
            if not (m == "direct" and s in ("half", "cached"))]
    for rep in range(a.reps):
        picks = pick_records(pm, a.experts, seed=1000 + rep)
        order = plan[:]  # a new order each repetition: no cell always follows the same one (mmap's cold
        random.Random(rep).shuffle(order)  # faults queue readahead that can spill into the next cell)
        for mode, state in order:
            c = measure(pm, picks, group="bench", mode=mode, state=state, threads=a.threads, batch=a.batch)
            cells.setdefault((mode, state), []).append(c.gb_s)
            extra.setdefault((mode, state), []).append({"probe_us": c.probe_us, "mincore_us": c.mincore_us,
                                                        "copied": c.copied_fraction,
                                                        "resident_before": c.resident_before, "io_used": c.io_used})
    med = {k: statistics.median(v) for k, v in cells.items()}
    path = pm.path / pm.manifest.layers[0].file
    raw = [raw_direct_bandwidth(path)["gb_s"] for _ in range(max(1, a.reps))]
    dd = [x for x in (dd_bandwidth(path) for _ in range(max(1, a.reps))) if x]
    raw_gbs = statistics.median(raw)
    dd_gbs = statistics.median(dd) if dd else None
    best_cold_mode = max(MODES, key=lambda m: med[(m, "cold")])

    def figures_of(g, raw_, dd_):
        """The ratios from one set of cell values g(mode, state) and raw bandwidths."""

        def better(st):
            return max(g("pread", st), g("mmap", st))

        return {
            "cold_best_vs_raw_odirect": g(best_cold_mode, "cold") / raw_,
            "cold_best_vs_dd": g(best_cold_mode, "cold") / dd_ if dd_ else None,
            "cold_pread_vs_raw_odirect": g("pread", "cold") / raw_,
            "cold_hybrid_vs_raw_odirect": g("hybrid", "cold") / raw_,
            "warm_hybrid_vs_better_pure": g("hybrid", "warm") / better("warm"),
            "cold_hybrid_vs_better_pure": g("hybrid", "cold") / better("cold"),
            "half_hybrid_vs_pread": g("hybrid", "half") / g("pread", "half"),
            "half_hybrid_vs_mmap": g("hybrid", "half") / g("mmap", "half"),
            "warm_hybrid_vs_warm_pread": g("hybrid", "warm") / g("pread", "warm"),
            "cached_hybrid_vs_cached_pread": g("hybrid", "cached") / g("pread", "cached"),
            # the hybrid that uses wholly cached records in place (--io mapped): records made usable per second
            "warm_mapped_vs_warm_pread": g("mapped", "warm") / g("pread", "warm"),
            "warm_mapped_vs_better_pure": g("mapped", "warm") / better("warm"),
            "cold_mapped_vs_better_pure": g("mapped", "cold") / better("cold"),
            "half_mapped_vs_pread": g("mapped", "half") / g("pread", "half"),
            "half_mapped_vs_mmap": g("mapped", "half") / g("mmap", "half"),
        }

    figures = figures_of(lambda m, st: med[(m, st)], raw_gbs, dd_gbs)
    # the same ratios within each repetition (cells of one repetition read the same records, minutes apart
    # at most): their spread says how far one figure can be trusted on this machine
    per_rep = [figures_of(lambda m, st, i=i: cells[(m, st)][i], raw[min(i, len(raw) - 1)],
                          dd[min(i, len(dd) - 1)] if dd else None) for i in range(a.reps)]
    spread = {k: (min(f[k] for f in per_rep), statistics.median(f[k] for f in per_rep), max(f[k] for f in per_rep))
              for k in figures if figures[k] is not None}
    copy = [copy_vs_pread(path, pm.layout(0).record_size, a.threads) for _ in range(max(1, a.reps))]
    copy_med = {k: statistics.median(c[k] for c in copy) for k in copy[0]}
    figures["warm_copy_vs_pread_aligned_dst"] = copy_med["copy"] / copy_med["pread_aligned"]
    figures["warm_copy_vs_pread_unaligned_dst"] = copy_med["copy"] / copy_med["pread_unaligned"]
    probe = {s: statistics.median([e["probe_us"] for e in extra[("hybrid", s)]]) for s in ("cold", "warm", "half", "cached")}
    return {"record_size": pm.layout(0).record_size, "records_in_model": pm.manifest.moe.num_experts * len(pm.manifest.layers),
            "experts_per_cell": a.experts, "reps": a.reps, "threads": a.threads, "batch": a.batch,
            "gb_s_median": {f"{m}/{s}": v for (m, s), v in med.items()},
            "gb_s_all": {f"{m}/{s}": v for (m, s), v in cells.items()},
            "hybrid_details": {s: extra[("hybrid", s)] for s in ("cold", "warm", "half", "cached")},
            "probe_us_per_record": probe,
            "warm_copy_gb_s": copy_med,
            "raw_odirect_gb_s": raw_gbs, "dd_gb_s": dd_gbs, "best_cold_mode": best_cold_mode, "figures": figures,
            "figures_per_rep_min_median_max": spread}


def report(r: dict) -> str:
    med = r["gb_s_median"]
    lines = [f"synthetic 397B 2-bit records ({r['record_size']:,} B), {r['records_in_model']} in the model; "
             f"{r['experts_per_cell']} random records per cell, requests of {r['batch']}, {r['threads']} threads, "
             f"median of {r['reps']}",
             f"{'GB/s':<8}" + "".join(f"{s:>9}" for s in ("cold", "warm", "half", "cached"))]
    for m in MODES:
        lines.append(f"{m:<8}" + "".join(f"{med[f'{m}/{s}']:>9.2f}" if f"{m}/{s}" in med else f"{'-':>9}"
                                         for s in ("cold", "warm", "half", "cached")))
    lines.append(f"raw sequential O_DIRECT 16 MiB reads: {r['raw_odirect_gb_s']:.2f} GB/s"
                 + (f"; dd iflag=direct bs=16M: {r['dd_gb_s']:.2f} GB/s" if r["dd_gb_s"] else ""))
    lines.append("hybrid residency check per record (cachestat, then mincore where partly cached): "
                 + ", ".join(f"{s} {v:.0f} us" for s, v in r["probe_us_per_record"].items()))
    c = r["warm_copy_gb_s"]
    lines.append(f"warm, {r['threads']} threads: pread into page-aligned buffers {c['pread_aligned']:.2f}, into buffers "
                 f"16 B off alignment {c['pread_unaligned']:.2f}, memcpy out of a mapping {c['copy']:.2f} GB/s")
    lines.append("mapped: wholly cached records are used in place (records made usable per second; nothing moves)")
    f = r["figures"]
    sp = r["figures_per_rep_min_median_max"]
    lines.append("figures (ratios of the medians; then min / median / max of the same ratio within each repetition):")
    for k, v in f.items():
        rng = f"   [{sp[k][0]:.2f} / {sp[k][1]:.2f} / {sp[k][2]:.2f}]" if k in sp else ""
        lines.append(f"  {k:<32} {'-' if v is None else f'{v:.2f}'}{rng}")
    lines.append(f"best cold mode: {r['best_cold_mode']}; synthetic write {r['write_s']:.1f} s, total {r['total_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Conversion throughput on a synthetic checkpoint with real Qwen3.5-397B expert shapes.

512 experts of gate/up [1024 x 4096] + down [4096 x 1024] per layer, 4-bit MLX (3.6 GB per layer), a
few layers. Prints, in one run: the machine's raw sequential read bandwidth of the source (cold and
warm page cache), then repack (4-bit, bit-exact) and 2-bit requant throughput and the peak RSS of each
conversion (measured in a child process).

Goals (issue #2): repack >= 80% of raw read bandwidth; requant >= 0.5 GB/s of source per core;
peak RSS < 2 GB.

    python benchmarks/convert.py [--layers 3] [--dir /tmp/moepack-bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moepack.source.safetensors_file import write_safetensors  # noqa: E402
from moepack.testing.fixtures import tiny_config  # noqa: E402

E, D, I, GS = 512, 4096, 1024, 64


def make_checkpoint(root: Path, layers: int, seed: int = 0) -> int:
    """qwen3_moe-named checkpoint: experts of the 397B shape, a token embedding; one shard per layer."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config("qwen3_moe", hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=10,
                      num_hidden_layers=layers, vocab_size=1024, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, intermediate_size=4096)
    cfg["quantization"] = cfg["quantization_config"] = {"group_size": GS, "bits": 4, "mode": "affine"}
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0

    def scales(shape):
        return lambda: (np.abs(rng.normal(0.01, 0.003, shape)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def biases(shape):
        return lambda: ((-8 * np.abs(rng.normal(0.01, 0.003, shape))).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def codes(shape):
        return lambda: np.frombuffer(rng.bytes(int(np.prod(shape)) * 4), dtype=np.uint32).reshape(shape)

    for L in range(layers):
        name = f"model-{L + 1:05d}-of-{layers:05d}.safetensors"
        tensors = []
        for proj, (out, inp) in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
            pre = f"model.layers.{L}.mlp.switch_mlp.{proj}_proj"
            tensors += [(f"{pre}.weight", "U32", (E, out, inp // 8), codes((E, out, inp // 8))),
                        (f"{pre}.scales", "BF16", (E, out, inp // GS), scales((E, out, inp // GS))),
                        (f"{pre}.biases", "BF16", (E, out, inp // GS), biases((E, out, inp // GS)))]
        if L == 0:
            tensors += [("model.embed_tokens.weight", "U32", (1024, D // 8), codes((1024, D // 8))),
                        ("model.embed_tokens.scales", "BF16", (1024, D // GS), scales((1024, D // GS))),
                        ("model.embed_tokens.biases", "BF16", (1024, D // GS), biases((1024, D // GS)))]
        write_safetensors(root / name, tensors, {"format": "mlx"})
        for t in tensors:
            weight_map[t[0]] = name
        total += (root / name).stat().st_size
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return total


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths) -> tuple[float, int]:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    n = 0
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        off = 0
        try:
            while True:
                k = os.preadv(fd, [view], off)
                if k == 0:
                    break
                off += k
        finally:
            os.close(fd)
        n += off
    return time.perf_counter() - t, n


def raw_write(path: Path, nbytes: int) -> float:
    """Seconds to write nbytes with 8 MiB pwrites and one fsync (what a conversion's output costs)."""
    buf = np.frombuffer(np.random.default_rng(1).bytes(8 << 20), dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter()
    try:
        for off in range(0, nbytes, len(buf)):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    os.unlink(path)
    return dt


CHILD = """
import json, resource, sys, time
from moepack.convert import convert
t = time.perf_counter()
convert(sys.argv[1], sys.argv[2], bits=int(sys.argv[3]) if sys.argv[3] != '0' else None, force=True, progress=False)
dt = time.perf_counter() - t
# Linux keeps ru_maxrss across exec (it would report the parent's peak): read VmHWM instead
if sys.platform == 'darwin':
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
else:
    rss = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
print(json.dumps({"seconds": dt, "peak_rss": rss}))
"""


def run_convert(src: Path, out: Path, bits: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), str(bits)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


COMPUTE_CHILD = """
import json, sys, time
import numba
from moepack.convert import plan_conversion
from moepack.quant.requant import requantize_minmax_with_error
from moepack.source.checkpoint import open_checkpoint
from moepack.source.experts import FileReader, read_quant_slice
ck = open_checkpoint(sys.argv[1])
_, shape, _, plans = plan_conversion(ck, 2, {}, 64)
le = plans[0].experts
reader = FileReader()
chunks = [(e0, min(shape.num_experts, e0 + 32)) for e0 in range(0, 128, 32)]
data = [{p: read_quant_slice(reader, q, *c) for p, q in le.projs.items()} for c in chunks]
nbytes = sum(a.nbytes for d in data for t in d.values() for a in t)
res = {}
for threads in (1, 2):
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    requantize_minmax_with_error(*data[0]["gate"], 4, 2, 64)  # compiled / warm
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for d in data:
            for p in ("gate", "up", "down"):
                requantize_minmax_with_error(*d[p], 4, 2, 64)
        best = min(best, time.perf_counter() - t)
    res[threads] = nbytes / best / 1e9
print(json.dumps(res))
"""


def requant_compute(src: Path) -> dict:
    """GB/s of 4-bit source through requant + its error, data already in memory (the CPU part alone)."""
    r = subprocess.run([sys.executable, "-c", COMPUTE_CHILD, str(src)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if r.returncode:
        raise SystemExit(r.stderr)
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/moepack-bench-convert")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint for the next run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(args.dir)
    src = root / "src"
    if not (src / "model.safetensors.index.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing a {args.layers}-layer synthetic checkpoint (397B expert shapes) to {src} ...", file=sys.stderr)
        make_checkpoint(src, args.layers)
    shards = sorted(src.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    cores = os.cpu_count() or 1

    # warm the numba cache outside the timed runs (a tiny conversion compiles everything once)
    from moepack.testing.fixtures import write_mlx_checkpoint
    tiny = write_mlx_checkpoint(root / "tiny", arch="qwen3_moe", bits=4, seed=0) if not (root / "tiny").exists() else root / "tiny"
    run_convert(tiny, root / "tiny-out", 2)

    drop_cache(shards)
    cold_s, n = raw_read(shards)
    warm_s, _ = raw_read(shards)
    wbytes = min(size, 4 << 30)
    write_s = raw_write(root / "write-probe.bin", wbytes)
    res = {"source_bytes": size, "cores": cores, "raw_read_cold_GBps": n / cold_s / 1e9,
           "raw_read_warm_GBps": n / warm_s / 1e9, "raw_write_GBps": wbytes / write_s / 1e9}
    for bits, label in ((0, "repack"), (2, "requant2")):
        out = root / f"out-{label}"
        drop_cache(shards)
        r = run_convert(src, out, bits)
        res[f"{label}_GBps"] = size / r["seconds"] / 1e9
        res[f"{label}_peak_rss_GB"] = r["peak_rss"] / 1e9
        res[f"{label}_seconds"] = r["seconds"]
        shutil.rmtree(out, ignore_errors=True)
    res["repack_vs_cold_read"] = res["repack_GBps"] / res["raw_read_cold_GBps"]
    # a repack reads and writes every byte once: on one disk its bound is the slower of the two
    res["repack_vs_io_bound"] = res["repack_GBps"] / min(res["raw_read_cold_GBps"], res["raw_write_GBps"])
    res["requant2_GBps_per_core"] = res["requant2_GBps"] / cores
    compute = requant_compute(src)
    res["requant_compute_GBps_1thread"] = compute[1]
    res["requant_compute_GBps_2threads"] = compute[2]
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"source: {args.layers} layers x {E} experts, {size / 1e9:.2f} GB, {cores} cores")
        print(f"raw sequential read   cold {res['raw_read_cold_GBps']:.2f} GB/s   warm {res['raw_read_warm_GBps']:.2f} GB/s"
              f"   write+fsync {res['raw_write_GBps']:.2f} GB/s")
        print(f"repack (4-bit)        {res['repack_GBps']:.2f} GB/s = {res['repack_vs_cold_read']:.0%} of cold read, "
              f"{res['repack_vs_io_bound']:.0%} of min(read, write)"
              f"   peak RSS {res['repack_peak_rss_GB']:.2f} GB")
        print(f"requant (4->2 bit)    {res['requant2_GBps']:.2f} GB/s = {res['requant2_GBps_per_core']:.2f} GB/s per core"
              f"   peak RSS {res['requant2_peak_rss_GB']:.2f} GB")
        print(f"requant compute only  {res['requant_compute_GBps_1thread']:.2f} GB/s on 1 thread, "
              f"{res['requant_compute_GBps_2threads']:.2f} GB/s on 2 (source in memory; requant + its RMSE)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

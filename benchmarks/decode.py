"""Decode speed of the CPU runtime on a synthetic checkpoint with real Qwen3.5-397B expert shapes.

512 experts of gate/up [1024 x 4096] + down [4096 x 1024] per layer (7.08 MB per expert at 4-bit, 3.93 MB at
2-bit), qwen3_moe attention (32 q / 4 kv heads of 128), vocab 1024, a few layers. The experts and the
embedding come from benchmarks/convert.py's streaming ``make_checkpoint``; the rest (attention, norms, an
8-bit router, lm_head) is added here as a small extra shard. The checkpoint is packed at 4 and 2 bits.

For each bit width and K (default 4 and 10) it decodes --tokens tokens after an --prompt-token prompt with the
cpu (numba) backend, twice: "cold" (page cache of the packed layer files dropped first, so every expert comes
from the disk) and "warm" (the same token ids again: every expert already cached). Token ids are a fixed
pseudo-random sequence fed one by one (as llama-bench does): a random-weight model's own greedy output
repeats itself, so its routing would read far fewer distinct experts than a real model's.

Per configuration: tok/s, time per token split into expert I/O wait and compute, expert MB per token, the
expert read rate (bytes / I/O wait) next to the raw pread bandwidth measured in the same run (4 threads,
random expert-sized records, cold and warm), and the fraction of distinct experts among those read (routing
sanity: near 1 means the routing is spread out as a real model's). "Cold" runs still find in the page cache
the experts read earlier in the same run (the prompt's, and those reused between tokens: see "distinct"), so
their expert read rate can exceed the raw cold pread figure. If mlx_lm imports, mlx-lm's decode
tok/s on the same source checkpoint (in a child process: it loads everything into RAM) for a ratio, with
the weights as saved (bf16 scales) and upcast to fp32 (MLX's Linux CPU bf16 quantized matmul is slow).

    .venv/bin/python benchmarks/decode.py [--layers 2] [--tokens 16] [--reps 1] [--keep] [--json] [--no-mlx]
                                          [--dir /tmp/moepack-bench-decode]

Disk: ~3.6 GB per layer for the source, as much again for the 4-bit pack and ~2 GB for the 2-bit one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# as `moepack run` does: idle OpenMP threads of the numba kernels sleep instead of spinning on the cores the
# expert-reading threads need (set OMP_WAIT_POLICY=ACTIVE to measure the difference)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moepack.layout.reader import aligned_empty  # noqa: E402
from moepack.source.safetensors_file import write_safetensors  # noqa: E402
from moepack.testing.fixtures import iter_tensor_specs, quantization_block  # noqa: E402


def _bench_convert():
    spec = importlib.util.spec_from_file_location("bench_convert", Path(__file__).with_name("convert.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_conv = _bench_convert()
make_checkpoint, drop_cache = _conv.make_checkpoint, _conv.drop_cache


# ------------------------------------------------------------------------------------------------ checkpoint


def _bf16(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def add_dense(root: Path, seed: int = 1) -> None:
    """Attention, norms, router and lm_head for make_checkpoint's experts, in model-dense.safetensors.

    Quantized weights get zero-mean random codes (bias = -(2^bits - 1)/2 * scale); attention scales are small
    so each token's embedding keeps steering its routing; norms are ones."""
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization"] = cfg["quantization_config"] = quantization_block(cfg, 4)  # routers at 8 bits
    index = json.loads((root / "model.safetensors.index.json").read_text())
    have = set(index["weight_map"])
    rng = np.random.default_rng(seed)
    scale_of = {"self_attn": 0.002, "mlp.gate": 0.01, "lm_head": 0.01}
    tensors, scales = [], {}
    for name, dtype, shape in iter_tensor_specs(cfg, bits=4):
        if name in have:
            continue
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and dtype == "U32":
            arr = np.frombuffer(rng.bytes(int(np.prod(shape)) * 4), dtype=np.uint32).reshape(shape)
        elif name.endswith(".scales"):
            s0 = next((v for k, v in scale_of.items() if k in name), 0.01)
            scales[base] = rng.uniform(0.5 * s0, 1.5 * s0, shape).astype(np.float32)
            arr = _bf16(scales[base])
        elif name.endswith(".biases"):
            bits = cfg["quantization"].get(base, {}).get("bits", 4)
            arr = _bf16(-(2**bits - 1) / 2 * scales[base])
        else:  # norms
            arr = _bf16(np.ones(shape, np.float32))
        tensors.append((name, dtype, shape, arr))
    write_safetensors(root / "model-dense.safetensors", tensors, {"format": "mlx"})
    for t in tensors:
        index["weight_map"][t[0]] = "model-dense.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps(cfg, indent=1))


# ------------------------------------------------------------------------------------------------ raw reads


def raw_pread(files: list[Path], record: int, n: int, threads: int = 4, seed: int = 0) -> tuple[float, float]:
    """GB/s of n random whole-record preads (4 threads, 2 MiB-aligned buffers), cold then warm."""
    rng = np.random.default_rng(seed)
    picks = [(files[int(rng.integers(len(files)))], int(rng.integers(os.path.getsize(files[0]) // record)))
             for _ in range(n)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    bufs = [aligned_empty(record) for _ in range(threads)]

    def read(i):
        f, e = picks[i]
        view = memoryview(bufs[i % threads]).cast("B")
        done = 0
        while done < record:
            done += os.preadv(fds[f], [view[done:]], e * record + done)

    out = []
    try:
        drop_cache(files)
        for _ in range(2):  # cold, then the same records warm
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as ex:
                # thread i % threads owns buffer i % threads: submit in rounds of `threads`
                for r in range(0, n, threads):
                    list(ex.map(read, range(r, min(n, r + threads))))
            out.append(n * record / (time.perf_counter() - t) / 1e9)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------ decode


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, n)]


def decode_run(model, prompt: list[int], ids: list[int]) -> dict:
    cache = model.new_cache()
    model.forward(np.array(prompt), cache)
    model.stats.reset()
    t0 = time.perf_counter()
    for tid in ids:
        logits = model.forward(np.array([tid]), cache)
        int(logits[-1].argmax())  # what choosing the next token costs
    dt = time.perf_counter() - t0
    s = model.stats
    n = len(ids)
    return {"tok_s": n / dt, "ms_per_token": dt * 1e3 / n, "io_wait_ms": s.io_wait_s * 1e3 / n,
            "compute_ms": s.compute_s * 1e3 / n, "MB_per_token": s.expert_bytes_read / 1e6 / n,
            "expert_GBps_io": s.expert_bytes_read / max(s.io_wait_s, 1e-9) / 1e9,
            "expert_GBps_e2e": s.expert_bytes_read / dt / 1e9, "experts_read": s.experts_read}


def distinct_fraction(model, prompt, ids) -> float:
    """Distinct (layer, expert) pairs among all decode-time expert reads of `ids` (1.0: none read twice;
    uniform random routing of n tokens gives about 1 - n*K/1024 for small n)."""
    seen, total = set(), 0
    cache = model.new_cache()
    model.forward(np.array(prompt), cache)
    reader = model.reader
    calls = []
    submit = reader.submit

    def record(layer, experts, slot=0):
        calls.append((layer, tuple(int(e) for e in experts)))
        return submit(layer, experts, slot)

    reader.submit = record
    try:
        for tid in ids:
            model.forward(np.array([tid]), cache)
    finally:
        reader.submit = submit
    for layer, experts in calls:
        total += len(experts)
        seen.update((layer, e) for e in experts)
    return len(seen) / max(1, total)


BALLOON = r"""
import signal, sys, time
import numpy as np
blocks = [np.ones(1 << 27, dtype=np.uint8) for _ in range(int(float(sys.argv[1]) * 8))]  # 128 MiB each, touched
print("READY", flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
while True:
    time.sleep(3600)
"""

MLX_CHILD = r"""
import json, sys, time
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
src, k, upcast = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
prompt, ids = json.loads(sys.argv[4]), json.loads(sys.argv[5])
from pathlib import Path
model, _ = load_model(Path(src), lazy=False, model_config={"num_experts_per_tok": k})
if upcast:
    f32 = lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p
    model.update(tree_map(f32, model.parameters()))
    mx.eval(model.parameters())
best = 0.0
for _ in range(int(sys.argv[6])):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    t = time.perf_counter()
    for tid in ids:
        y = model(mx.array([[tid]]), cache=cache)
        int(mx.argmax(y[0, -1]).item())
    best = max(best, len(ids) / (time.perf_counter() - t))
print(json.dumps({"tok_s": best}))
"""


def mlx_decode(src: Path, k: int, upcast: bool, prompt, ids, reps: int = 1) -> float | None:
    """mlx-lm's decode tok/s (best of `reps`) in a child process, the same ids fed one by one."""
    r = subprocess.run([sys.executable, "-c", MLX_CHILD, str(src), str(k), "1" if upcast else "0",
                        json.dumps(prompt), json.dumps(ids), str(reps)], capture_output=True, text=True)
    if r.returncode:
        print(f"mlx-lm run failed (K={k}, upcast={upcast}): {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["tok_s"]


def warm_numba(root: Path) -> None:
    """Compile the numba kernels on a tiny model first, so no configuration's time includes compiling."""
    from moepack.convert import convert
    from moepack.runtime.model import load_model
    from moepack.testing.fixtures import write_mlx_checkpoint

    for bits in (4, 2):
        tiny = root / f"tiny-{bits}"
        if not (tiny / "moepack.json").exists():
            src = write_mlx_checkpoint(root / "tiny-src", arch="qwen3_moe", bits=4, seed=0)
            convert(str(src), tiny, bits=bits, force=True, progress=False)
        with load_model(tiny, backend="numba") as m:
            c = m.new_cache()
            m.forward(np.array([1, 2, 3, 4]), c)
            m.forward(np.array([5]), c)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per measurement")
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--ks", default="4,10", help="experts per token to measure")
    ap.add_argument("--mlx-tokens", type=int, default=8, help="decode tokens for mlx-lm (slow with bf16 scales)")
    ap.add_argument("--reps", type=int, default=1,
                    help="repeat each measurement, keep the best (steadier on a shared machine)")
    ap.add_argument("--dir", default="/tmp/moepack-bench-decode")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints for the next run")
    ap.add_argument("--no-mlx", action="store_true", help="skip the mlx-lm comparison")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bits", default="4,2", help="packed bit widths to build and measure")
    ap.add_argument("--io", default="pread", help="comma list of --io modes to measure (e.g. pread,hybrid,mmap)")
    ap.add_argument("--drop-source", action="store_true",
                    help="delete the source checkpoint once packed (an 8-layer model needs 2 x 29 GB otherwise)")
    ap.add_argument("--balloon", type=float, default=0.0, metavar="GIB",
                    help="hold GIB GiB of RAM in another process while measuring (bench-anchors/balloon.py's "
                         "method), so only the rest is left for the page cache")
    ap.add_argument("--no-warm", action="store_true", help="measure cold runs only")
    args = ap.parse_args()
    from moepack.convert import convert
    from moepack.runtime.model import load_model

    root = Path(args.dir)
    src = root / "src"
    bit_list = [int(b) for b in args.bits.split(",")]
    have_packs = all((root / f"packed-{b}" / "moepack.json").exists() for b in bit_list)
    if not have_packs and not (src / "model-dense.safetensors").exists():
        shutil.rmtree(src, ignore_errors=True)
        print(f"writing a {args.layers}-layer synthetic checkpoint (397B expert shapes) to {src} ...", file=sys.stderr)
        make_checkpoint(src, args.layers)
        add_dense(src)
    packs = {}
    for bits in bit_list:
        out = root / f"packed-{bits}"
        if not (out / "moepack.json").exists():
            print(f"packing at {bits}-bit ...", file=sys.stderr)
            convert(str(src), out, bits=bits, force=True, progress=False)
        packs[bits] = out
    if args.drop_source:
        shutil.rmtree(src, ignore_errors=True)
    balloon = None
    if args.balloon > 0:
        print(f"holding {args.balloon} GiB of RAM in a balloon process ...", file=sys.stderr)
        balloon = subprocess.Popen([sys.executable, "-c", BALLOON, str(args.balloon)], stdout=subprocess.PIPE,
                                   text=True)
        if "READY" not in (balloon.stdout.readline() or ""):
            raise SystemExit("the balloon process failed to fill its memory")
    print("compiling kernels on a tiny model ...", file=sys.stderr)
    warm_numba(root)

    cfg = json.loads((packs[bit_list[0]] / "config.json").read_text())
    prompt = token_ids(args.prompt_tokens, cfg["vocab_size"], 1)
    ids = token_ids(args.tokens, cfg["vocab_size"], 2)
    ks = [int(k) for k in args.ks.split(",")]
    res = {"layers": args.layers, "tokens": args.tokens, "reps": args.reps, "cores": os.cpu_count(),
           "balloon_GiB": args.balloon,
           "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "raw_pread": {}, "runs": [],
           "mlx_lm": {}}
    for bits, out in packs.items():
        files = sorted((out / "packed_experts").glob("layer_*.bin"))
        record = json.loads((out / "moepack.json").read_text())
        record = next(iter(record["record_layouts"].values()))["record_size"]
        cold, warm = raw_pread(files, record, n=min(64, 512 * len(files)))
        res["raw_pread"][bits] = {"record_bytes": record, "cold_GBps": cold, "warm_GBps": warm}
        for k in ks:
            for io in args.io.split(","):
                with load_model(out, backend="numba", io=io, experts_per_token=k) as m:
                    frac = distinct_fraction(m, prompt, ids)
                cold_r = warm_r = None
                for _ in range(max(1, args.reps)):
                    # drop the cache with no model open: pages mapped by a process (io mmap/hybrid/mapped map
                    # the layer files) cannot be dropped, so a model kept open would measure "cold" warm
                    drop_cache(files)
                    with load_model(out, backend="numba", io=io, experts_per_token=k) as m:
                        r = decode_run(m, prompt, ids)
                        cold_r = r if cold_r is None or r["tok_s"] > cold_r["tok_s"] else cold_r
                        if not args.no_warm:
                            # twice: with --io mapped the first warm pass still page-faults the records it
                            # uses in place for the first time in this process (the cold pass read them with
                            # pread); the second is the steady state of a long generation (as llama-bench
                            # measures after its warm-up run)
                            for _ in range(2):
                                r = decode_run(m, prompt, ids)
                                warm_r = r if warm_r is None or r["tok_s"] > warm_r["tok_s"] else warm_r
                res["runs"].append({"bits": bits, "k": k, "io": io, "cold": cold_r, "warm": warm_r or cold_r,
                                    "distinct_experts": frac})
                print(f"  {bits}-bit K={k} io={io}: cold {cold_r['tok_s']:.2f} tok/s"
                      + (f", warm {warm_r['tok_s']:.2f} tok/s" if warm_r else ""), file=sys.stderr)
    if balloon is not None:
        balloon.terminate()
        balloon.wait()
    if not args.no_mlx and src.exists() and importlib.util.find_spec("mlx_lm") is not None:
        mlx_ids = ids[: args.mlx_tokens]
        for k in ks:
            for upcast in (False, True):
                print(f"  mlx-lm K={k} {'fp32' if upcast else 'bf16'} ...", file=sys.stderr)
                res["mlx_lm"][f"k{k}_{'fp32' if upcast else 'bf16'}"] = mlx_decode(src, k, upcast, prompt, mlx_ids,
                                                                                  args.reps)

    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"decode on {args.layers} layers x 512 experts (397B expert shape), {args.tokens} tokens, "
              f"{res['cores']} cores, cpu backend, OMP_WAIT_POLICY={res['omp_wait_policy']}")
        for bits, r in res["raw_pread"].items():
            print(f"raw pread, {bits}-bit records ({r['record_bytes'] / 1e6:.2f} MB), 4 threads: "
                  f"cold {r['cold_GBps']:.2f} GB/s, warm {r['warm_GBps']:.2f} GB/s")
        hdr = (f"{'bits':>4} {'K':>3} {'io':>7} {'cache':>5} {'tok/s':>7} {'ms/tok':>8} {'io ms':>7} {'cpu ms':>7} "
               f"{'MB/tok':>7} {'GB/s io':>8} {'of raw':>7} {'GB/s e2e':>9} {'distinct':>8} {'vs mlx-lm':>10}")
        print(hdr)
        for run in res["runs"]:
            for phase in ("cold", "warm"):
                r = run[phase]
                raw = res["raw_pread"][run["bits"]][f"{phase}_GBps"]
                mlx = res["mlx_lm"].get(f"k{run['k']}_fp32")
                ratio = f"{r['tok_s'] / mlx:.1f}x" if mlx else "-"
                print(f"{run['bits']:>4} {run['k']:>3} {run['io']:>7} {phase:>5} {r['tok_s']:>7.2f} {r['ms_per_token']:>8.1f} "
                      f"{r['io_wait_ms']:>7.1f} {r['compute_ms']:>7.1f} {r['MB_per_token']:>7.1f} "
                      + (f"{r['expert_GBps_io']:>8.2f} {r['expert_GBps_io'] / raw:>7.0%} " if r["io_wait_ms"] >= 0.05
                         else f"{'-':>8} {'-':>7} ")  # no measurable wait: records used in place
                      + f"{r['expert_GBps_e2e']:>9.2f} "
                      f"{run['distinct_experts']:>8.2f} {ratio:>10}")
        if res["mlx_lm"]:
            print("mlx-lm on the 4-bit source (all in RAM): " + ", ".join(
                f"{key} {v:.2f} tok/s" if v else f"{key} failed" for key, v in res["mlx_lm"].items()))
            print("(vs mlx-lm = our tok/s / mlx-lm's at the same K with fp32 scales, its fastest CPU setting)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

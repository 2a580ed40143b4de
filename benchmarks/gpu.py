"""The metal/*.metal kernels on an NVIDIA GPU (PTX via clang-19, launched with CuPy): correctness and speed.

1. `moepack selftest`'s cases on the cuda executor (each kernel vs the numpy reference);
2. whole tiny models (qwen3_5_moe 4/2-bit, qwen3_next, qwen3_moe) through `--backend cuda` vs numpy:
   max |logit diff| relative to max |logit| over prefill + 3 greedy steps, and equal greedy tokens;
3. decode tok/s of a synthetic Qwen3.5-397B-shaped model (few layers, fewer experts) through the cuda
   executor: the device-resident decode step vs the kernel-module path (MOEPACK_RESIDENT=0's);
4. kernel times at Qwen3.5-397B shapes with device-resident inputs (CUDA events, median of 50 after 5
   warm-ups): dequant-matvec 4096x4096 at 2/4/8 bits, one routed expert (fused gate/up + SwiGLU, then down,
   from a raw 4-bit and 2-bit record), and the effective weight bandwidth of each.

Needs cupy and a GPU; without clang-19 set MOEPACK_PTX_BUNDLE to a folder written by
`python -m moepack.runtime.metal.executor_cuda export DIR`.

    python benchmarks/gpu.py [--json FILE] [--only selftest,parity,kernels,resident]
    python benchmarks/gpu.py --only bandwidth   # dequant-matvec GB/s vs HBM peak at 397B shapes, L2-cold,
                                                # and vs a plain read of the same bytes in the same launches
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moepack.convert import convert  # noqa: E402
from moepack.quant.affine_ref import quantize  # noqa: E402
from moepack.runtime.metal import ops_quant  # noqa: E402
from moepack.runtime.metal.executor_cuda import CudaExecutor  # noqa: E402
from moepack.runtime.metal.selftest import run_selftest  # noqa: E402
from moepack.runtime.model import load_model  # noqa: E402
from moepack.testing.fixtures import write_mlx_checkpoint  # noqa: E402

PROMPT = np.array([1, 37, 200, 5, 88, 410, 17, 3])


def parity(tmp: Path) -> list[dict]:
    rows = []
    for arch, bits in (("qwen3_5_moe", 4), ("qwen3_5_moe", 2), ("qwen3_next", 4), ("qwen3_moe", 4)):
        src = tmp / f"src-{arch}"
        if not src.exists():
            write_mlx_checkpoint(src, arch=arch, bits=4, seed=2)
        dst = tmp / f"{arch}-{bits}"
        convert(src, dst, bits=bits, progress=False)
        res = {}
        for be in ("numpy", "cuda"):
            with load_model(dst, backend=be) as m:
                cache = m.new_cache()
                t0 = time.perf_counter()
                logits = [m.forward(PROMPT, cache)]
                toks = []
                for _ in range(3):
                    toks.append(int(logits[-1][-1].argmax()))
                    logits.append(m.forward(np.array([toks[-1]]), cache))
                res[be] = (logits, toks, time.perf_counter() - t0, getattr(m.K, "log", None),
                           getattr(m, "resident", None))
        ref, got = res["numpy"], res["cuda"]
        rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got[0], ref[0]))
        rows.append({"arch": arch, "bits": bits, "max_rel_logit_diff": rel, "greedy_equal": got[1] == ref[1],
                     "launches": got[3].count if got[3] else None,
                     "resident_step": dict(got[4].last_step) if got[4] is not None else None})
        print(f"parity {arch:<12} {bits}-bit  rel {rel:.2e}  greedy equal {got[1] == ref[1]}  "
              f"launches {rows[-1]['launches']}  resident step {rows[-1]['resident_step']}", flush=True)
    return rows


def _time(cp, fn, reps=50, warm=5) -> float:
    for _ in range(warm):
        fn()
    cp.cuda.get_current_stream().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3)  # us
    return float(np.median(ts))


def _launcher(ex: CudaExecutor, dispatches):
    """A closure launching `dispatches` with every host array replaced by a device copy made once (keyed by
    memory, as the executor does: views of one buffer share their copy)."""
    runs, _ = _cold_launchers(ex, dispatches, copies=1)
    return runs[0]


def _record(rng, D: int, I: int, bits: int):
    from moepack.archs.base import MoeShape
    from moepack.layout.record import record_layout  # the packer's own layout rules

    layout = record_layout(MoeShape(1, 512, 10, D, I), bits, 64)
    rec = np.zeros(layout.record_size, dtype=np.uint8)
    for proj, (o, i) in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
        w, s, b = quantize((rng.standard_normal((o, i)) * 0.02).astype(np.float32), bits, 64)
        for part, arr in (("weight", w), ("scales", s), ("biases", b)):
            c = layout.component(f"{proj}.{part}")
            rec[c.offset:c.offset + c.nbytes] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    return rec, layout


def kernel_times(ex: CudaExecutor) -> list[dict]:
    cp = ex.cp
    rng = np.random.default_rng(0)
    rows = []
    D = 4096
    x = rng.standard_normal((1, D)).astype(np.float32)
    for bits in (2, 4, 8):
        w, s, b = quantize((rng.standard_normal((D, D)) * 0.02).astype(np.float32), bits, 64)
        ds = ops_quant.qmatmul_dispatch(x, w, s, b, bits, 64)
        us = _time(cp, _launcher(ex, ds))
        nbytes = w.nbytes + s.nbytes + b.nbytes
        rows.append({"kernel": f"qmv {bits}-bit {D}x{D}", "us": us, "weight_GBps": nbytes / us / 1e3})
    for bits in (4, 2):
        rec, layout = _record(rng, D, 1024, bits)
        ds = ops_quant.expert_ffn_record_dispatch(x, rec, layout)
        us = _time(cp, _launcher(ex, ds))
        rows.append({"kernel": f"expert ffn {bits}-bit (397B shape, {layout.record_size / 1e6:.2f} MB)", "us": us,
                     "weight_GBps": layout.record_size / us / 1e3})
    for r in rows:
        print(f"{r['kernel']:<44} {r['us']:9.1f} us  {r['weight_GBps']:8.1f} GB/s of weights", flush=True)
    return rows


# a synthetic Qwen3.5-397B-shaped model, few layers: real hidden / head / Gated-DeltaNet / expert shapes, fewer
# experts per layer (K = 10 of them routed, as the real model) and a smaller vocabulary, so it is generated in
# seconds; layers alternate linear attention and full attention
SHAPE_397B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
                  moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts_per_tok=10,
                  linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                  linear_value_head_dim=128, vocab_size=4096)


def resident_decode(tmp: Path, backend: str = "cuda", layers: int = 2, experts: int = 12, tokens: int = 16,
                    bits: int = 4, shape: dict | None = None, rounds: int = 2) -> dict:
    """Decode tok/s of a synthetic 397B-shaped model on `backend`: the device-resident step vs the kernel-module
    path (every kernel its own command buffer, glue on the CPU), same prompt and token ids, logits compared."""
    src = tmp / f"synth-{layers}x{experts}"
    t0 = time.perf_counter()
    if not src.exists():
        write_mlx_checkpoint(src, arch="qwen3_5_moe", bits=4, seed=5, tokenizer=False, num_hidden_layers=layers,
                             num_experts=experts, full_attention_interval=2, **(shape or SHAPE_397B))
    dst = tmp / f"synth-{layers}x{experts}-{bits}"
    if not dst.exists():
        convert(src, dst, bits=bits, progress=False)
    built = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    out = {"layers": layers, "experts": experts, "bits": bits, "build_s": built}
    logits = {}
    feed = None
    for mode in ("kernel-module", "resident") * rounds:  # alternating rounds; the best of each mode is kept
        with load_model(dst, backend=backend) as m:
            m.use_resident = mode == "resident"
            if feed is None:  # the same token ids for both paths
                feed = rng.integers(0, m.vocab_size, tokens)
            for rep in ("warm-up", "timed"):
                cache = m.new_cache()
                m.forward(np.array([1, 2, 3, 4, 5, 6, 7, 8]), cache)
                rows = []
                m.stats.reset()
                m.K.log.clear()
                t1 = time.perf_counter()
                for t in feed[:tokens if rep == "timed" else 2]:
                    rows.append(m.forward(np.array([int(t)]), cache)[-1])
                dt = time.perf_counter() - t1
            logits[mode] = np.stack(rows)
            r = m.resident
            if mode in out and out[mode]["tok_s"] >= tokens / dt:
                continue
            out[mode] = {"tok_s": tokens / dt, "ms_per_token": dt / tokens * 1e3,
                         "io_wait_ms_per_token": m.stats.io_wait_s / tokens * 1e3,
                         "executor_run_ms_per_token": m.K.log.gpu_s / tokens * 1e3,
                         "launches_per_token": m.K.log.count / tokens,
                         "command_buffers_per_token": r.last_step["command_buffers"] if r is not None else None,
                         "expert_MB_per_token": m.stats.expert_bytes_read / tokens / 1e6,
                         "step": dict(r.last_step) if r is not None else None}
    for mode in ("kernel-module", "resident"):
        o = out[mode]
        print(f"decode {mode:<14} {o['tok_s']:7.2f} tok/s  ({o['ms_per_token']:.1f} ms/token: io wait "
              f"{o['io_wait_ms_per_token']:.1f}, in executor.run {o['executor_run_ms_per_token']:.1f}; "
              f"{o['launches_per_token']:.0f} launches in {o['command_buffers_per_token'] or 'one per op:'} command "
              f"buffers, {o['expert_MB_per_token']:.0f} MB experts)",
              flush=True)
    a, b = logits["resident"], logits["kernel-module"]
    out["max_rel_logit_diff"] = float(np.abs(a - b).max() / np.abs(b).max())
    out["speedup"] = out["resident"]["tok_s"] / out["kernel-module"]["tok_s"]
    print(f"resident vs kernel-module: x{out['speedup']:.2f}, max rel logit diff {out['max_rel_logit_diff']:.2e}",
          flush=True)
    return out


# ------------------------------------------------------------------------------------------- matvec bandwidth
# quant.metal's dequant-matvec at Qwen3.5-397B shapes against HBM: every launch reads weights that are not in
# L2 (each case rotates over copies of its weights totalling >= BW_ROTATE_BYTES, 5x the H200's 50 MB L2)

HBM_PEAK_GBPS = 4800.0  # H200 datasheet
BW_ROTATE_BYTES = 256 << 20


def _bf16_bits(rng, shape, lo: int, spread: int) -> np.ndarray:
    """Random bf16 bit patterns lo .. lo+spread (a narrow range of ordinary values: timing data)."""
    return (lo + rng.integers(0, spread, size=shape)).astype(np.uint16)


_BW_DATA: dict = {}


def _qmat_random(rng, out_dim: int, in_dim: int, bits: int, gs: int = 64):
    w = np.frombuffer(rng.bytes(out_dim * in_dim * bits // 8), dtype=np.uint32).reshape(out_dim, -1)
    return w, _bf16_bits(rng, (out_dim, in_dim // gs), 0x3C00, 64), _bf16_bits(rng, (out_dim, in_dim // gs), 0xBD80, 32)


def _key(a: np.ndarray) -> tuple:
    return (a.ctypes.data, a.nbytes, a.dtype.str)


def _cold_launchers(ex: CudaExecutor, dispatches, copies: int):
    """`copies` closures, each launching `dispatches` over its own device copy of every large read-only array
    (the weights); small arrays and outputs are shared. Host arrays are keyed by memory, as the executor does
    (views of one buffer share its device copy). Returns (closures, {key: device array}); key() gives keys."""
    cp = ex.cp
    dev: dict[tuple, object] = {}
    rep: dict[tuple, list] = {}
    plans = []
    for d in dispatches:
        fn, k = ex._function(d.source, d.kernel)
        plans.append((fn, k, d))
        for p in k.params:
            v = d.args[p.index]
            if p.kind != "scalar" and _key(v) not in dev:
                dev[_key(v)] = cp.asarray(v)
                if not p.writable and v.nbytes >= (64 << 10):
                    rep[_key(v)] = [dev[_key(v)]] + [dev[_key(v)].copy() for _ in range(copies - 1)]
    runs = []
    for c in range(copies):
        calls = []
        for fn, k, d in plans:
            args = []
            for p in k.params:
                v = d.args[p.index]
                if p.kind == "scalar":
                    args.append(np.dtype(p.dtype).type(v))
                else:
                    args.append(rep[_key(v)][c] if _key(v) in rep else dev[_key(v)])
            calls.append((fn, tuple(int(g) for g in d.grid), tuple(int(t) for t in d.threadgroup), tuple(args)))

        def run(calls=calls):
            for fn, g, t, a in calls:
                fn(g, t, a)

        runs.append(run)
    return runs, dev


def _time_cold(cp, runs, n: int = 64, reps: int = 7) -> tuple[float, float, str]:
    """(us per launch back to back, us of one launch alone, how): back to back = n launches rotating over the
    weight copies captured in a CUDA graph (no host launch overhead; plain launches if capture fails), median
    of reps; alone = CUDA events around one launch (weights cold too), median of up to 24."""
    stream = cp.cuda.Stream(non_blocking=True)
    how = "graph"
    with stream:
        for r in runs:
            r()
        stream.synchronize()
        try:
            stream.begin_capture()
            for i in range(n):
                runs[i % len(runs)]()
            graph = stream.end_capture()
            launch = lambda: graph.launch(stream)  # noqa: E731
        except Exception:  # noqa: BLE001 - no graphs in this cupy: plain back-to-back launches
            how = "launches"

            def launch():
                for i in range(n):
                    runs[i % len(runs)]()
        launch()
        stream.synchronize()
        ts = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            launch()
            b.record(stream)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / n)
        alone = []
        for i in range(3 * min(8, len(runs))):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            runs[i % len(runs)]()
            b.record(stream)
            b.synchronize()
            alone.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return float(np.median(ts)), float(np.median(alone)), how


# A plain read of the same bytes, for the same-size ceiling: each thread xors 16-byte loads (four in flight per
# loop trip) over a grid-stride loop; the result is written only if it equals a value it never takes, so the
# loads stay and nothing is written.
_READ_SRC = r"""
extern "C" __global__ void read_ceiling(const uint4* __restrict__ p, unsigned long long n, unsigned* out) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    uint4 a = make_uint4(0, 0, 0, 0);
    for (; i + 3 * step < n; i += 4 * step) {
        const uint4 v0 = __ldg(p + i), v1 = __ldg(p + i + step), v2 = __ldg(p + i + 2 * step),
                    v3 = __ldg(p + i + 3 * step);
        a.x ^= v0.x ^ v1.x ^ v2.x ^ v3.x; a.y ^= v0.y ^ v1.y ^ v2.y ^ v3.y;
        a.z ^= v0.z ^ v1.z ^ v2.z ^ v3.z; a.w ^= v0.w ^ v1.w ^ v2.w ^ v3.w;
    }
    for (; i < n; i += step) { const uint4 v = __ldg(p + i); a.x ^= v.x; a.y ^= v.y; a.z ^= v.z; a.w ^= v.w; }
    if ((a.x ^ a.y ^ a.z ^ a.w) == 0x9e3779b9u && a.x == 0x7f4a7c15u) out[0] = a.y;
}
"""


def read_ceiling(cp, sizes: list[int], copies: int) -> float:
    """us per round of plain reads, one launch per entry of `sizes` (bytes), over `copies` rotating buffers,
    timed as the matvecs are (_time_cold): what reading these bytes in these launches can reach here."""
    kern = cp.RawKernel(_READ_SRC, "read_ceiling")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(1, dtype=cp.uint32)
    bufs = [cp.zeros((sum(sizes) // 16 + 1, 4), dtype=cp.uint32) for _ in range(copies)]  # rows of 16 bytes
    runs = []
    for buf in bufs:
        calls, off = [], 0
        for n in sizes:
            n16 = n // 16
            grid = max(1, min(sms * 8, -(-n16 // (256 * 4))))
            calls.append(((grid,), (256,), (buf[off:off + n16], np.uint64(n16), out)))
            off += n16

        def run(calls=calls):
            for g, t, a in calls:
                kern(g, t, a)

        runs.append(run)
    us, _, _ = _time_cold(cp, runs)
    del bufs
    return us


def _bw_row(name: str, nbytes: int, us: float, alone: float, how: str, err: float | None,
            ceiling_us: float | None = None) -> dict:
    gbps = nbytes / us / 1e3
    row = {"case": name, "MB": nbytes / 1e6, "us": us, "GBps": gbps, "pct_peak": 100 * gbps / HBM_PEAK_GBPS,
           "us_alone": alone, "GBps_alone": nbytes / alone / 1e3, "timing": how, "max_rel_err": err}
    if ceiling_us is not None:  # a plain read of the same bytes in the same launches
        row["read_ceiling_us"] = ceiling_us
        row["read_ceiling_pct_peak"] = 100 * nbytes / ceiling_us / 1e3 / HBM_PEAK_GBPS
        row["of_read_ceiling"] = ceiling_us / us
    # a launch moving less than ~8 MB lasts about as long as launching it: its figure says more about latency
    row["latency_bound"] = nbytes < (8 << 20)
    print(f"bw {name:<34} {row['MB']:7.1f} MB {us:8.1f} us {gbps:7.0f} GB/s {row['pct_peak']:5.1f}% of "
          f"{HBM_PEAK_GBPS:.0f}  | alone {alone:7.1f} us {row['GBps_alone']:6.0f} GB/s"
          + (f"  | plain read {ceiling_us:6.1f} us {row['read_ceiling_pct_peak']:5.1f}%: "
             f"{100 * row['of_read_ceiling']:3.0f}% of it" if ceiling_us is not None else "")
          + ("  [latency-bound]" if row["latency_bound"] else "") + (f"  err {err:.1e}" if err is not None else ""),
          flush=True)
    return row


def copy_bandwidth(cp, nbytes: int = 1 << 30) -> dict:
    """Device-to-device copy (read + write) and a read-only reduction over nbytes: the practical ceilings."""
    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    out = {}
    for name, fn, moved in (("copy", lambda: dst.__setitem__(Ellipsis, src), 2 * nbytes),
                            ("read (sum)", lambda: src.sum(), nbytes)):
        fn()
        cp.cuda.get_current_stream().synchronize()
        ts = []
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        out[name] = moved / float(np.median(ts)) / 1e3
        print(f"bw reference {name:<12} {out[name]:7.0f} GB/s ({100 * out[name] / HBM_PEAK_GBPS:.0f}% of "
              f"{HBM_PEAK_GBPS:.0f})", flush=True)
    src = dst = None  # free the 2 GB before the next measurements
    return out


def quant_bandwidth(ex: CudaExecutor, bits_list=(4, 2), check: bool = True, tag: str = "") -> list[dict]:
    """GB/s of weights read by qmv (dense, 4096x4096, 65536x4096, 1024x4096, 4096x1024) and by a batch of 10
    routed experts (fused gate/up + SwiGLU, then down, from raw 397B-shaped records), through ops_quant's
    launch builders; outputs checked against kernels_ref on the first copy."""
    from moepack.runtime import kernels_ref as REF

    cp = ex.cp
    rng = np.random.default_rng(7)
    rows = []
    for bits in bits_list:
        for out_dim, in_dim in ((4096, 4096), (65536, 4096), (1024, 4096), (4096, 1024)):
            key = (bits, out_dim, in_dim)
            if key not in _BW_DATA:
                _BW_DATA[key] = _qmat_random(rng, out_dim, in_dim, bits)
            w, s, b = _BW_DATA[key]
            x = rng.standard_normal((1, in_dim)).astype(np.float32)
            ds = ops_quant.qmatmul_dispatch(x, w, s, b, bits, 64)
            nbytes = w.nbytes + s.nbytes + b.nbytes
            copies = max(1, min(64, BW_ROTATE_BYTES // nbytes))
            runs, dev = _cold_launchers(ex, ds, copies)
            us, alone, how = _time_cold(cp, runs)
            ceil_us = read_ceiling(cp, [nbytes], copies)
            err = None
            if check:
                runs[0]()
                y = cp.asnumpy(dev[_key(ds[0].args[4])])
                n = min(out_dim, 2048)
                ref = REF.qmatmul(x, w[:n], s[:n], b[:n], bits, 64)
                err = float(np.abs(y[:, :n] - ref).max() / np.abs(ref).max())
            rows.append(_bw_row(f"{tag}qmv {bits}-bit {out_dim}x{in_dim}", nbytes, us, alone, how, err, ceil_us))
            del runs, dev
        D, I, E = 4096, 1024, 10
        from moepack.archs.base import MoeShape
        from moepack.layout.record import record_layout

        layout = record_layout(MoeShape(1, 512, 10, D, I), bits, 64)
        if ("experts", bits) not in _BW_DATA:
            recs = np.zeros((E, layout.record_size), dtype=np.uint8)
            for proj, (o, i) in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
                for e in range(E):
                    for part, arr in zip(("weight", "scales", "biases"), _qmat_random(rng, o, i, bits)):
                        layout.component(f"{proj}.{part}").view(recs[e])[...] = arr
            _BW_DATA[("experts", bits)] = recs
        recs = _BW_DATA[("experts", bits)]
        x = rng.standard_normal((1, D)).astype(np.float32)
        y = np.zeros((E, 1, D), np.float32)
        ds = ops_quant.expert_ffn_record_dispatch(x, recs, layout, out=y)
        nbytes = E * layout.payload_size
        copies = max(1, BW_ROTATE_BYTES // nbytes)
        runs, dev = _cold_launchers(ex, ds, copies)
        us, alone, how = _time_cold(cp, runs)
        launch_bytes = [E * sum(layout.component(f"{p}.{q}").nbytes for p in projs
                                for q in ("weight", "scales", "biases")) for projs in (("gate", "up"), ("down",))]
        ceil_us = read_ceiling(cp, launch_bytes, copies)
        err = None
        if check:
            runs[0]()
            got = cp.asnumpy(dev[_key(y)]).reshape(y.shape)
            errs = []
            for e in (0, E - 1):
                parts = [layout.component(f"{p}.{q}").view(recs[e]) for p in ("gate", "up", "down")
                         for q in ("weight", "scales", "biases")]
                ref = REF.expert_ffn(x, *parts, bits, 64)
                errs.append(float(np.abs(got[e] - ref).max() / np.abs(ref).max()))
            err = max(errs)
        rows.append(_bw_row(f"{tag}{E} experts {bits}-bit (2 launches)", nbytes, us, alone, how, err, ceil_us))
        del runs, dev
        for d, projs, part in zip(ds, (("gate", "up"), ("down",)), launch_bytes):  # each launch on its own
            runs, dev = _cold_launchers(ex, [d], copies)
            us, alone, how = _time_cold(cp, runs)
            rows.append(_bw_row(f"{tag}  of which {'/'.join(projs)}", part, us, alone, how, None,
                                read_ceiling(cp, [part], copies)))
            del runs, dev
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--only", default="selftest,parity,kernels,resident",
                    help="comma-separated parts to run (default: all)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the synthetic 397B-shaped model")
    ap.add_argument("--experts", type=int, default=12, help="experts per layer of the synthetic model")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed per path")
    ap.add_argument("--bits", default="4,2", help="bit widths of the bandwidth cases (default: 4,2)")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    ex = CudaExecutor()
    print("device:", ex.describe()["device"], flush=True)
    res: dict = {"device": ex.describe()}
    ok = True
    if "selftest" in parts:
        t0 = time.perf_counter()
        st = run_selftest(ex)
        for r in st:
            print(f"selftest {r.op:<22} {'ok' if r.ok else 'FAIL'}  rel err {r.max_rel_err}  {r.error}", flush=True)
        print(f"selftest: {sum(r.ok for r in st)}/{len(st)} passed in {time.perf_counter() - t0:.1f} s", flush=True)
        res["selftest"] = [r.__dict__ for r in st]
        ok &= all(r.ok for r in st)
    with tempfile.TemporaryDirectory() as tmp:
        if "parity" in parts:
            res["parity"] = parity(Path(tmp))
            ok &= all(p["greedy_equal"] for p in res["parity"])
        if "resident" in parts:
            res["resident_decode"] = resident_decode(Path(tmp), layers=a.layers, experts=a.experts, tokens=a.tokens)
    if "kernels" in parts:
        res["kernels"] = kernel_times(ex)
    if "bandwidth" in parts:  # not in the default set: --only bandwidth
        bits = tuple(int(b) for b in a.bits.split(","))
        res["bandwidth"] = {"reference_GBps": copy_bandwidth(ex.cp), "cases": quant_bandwidth(ex, bits)}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The metal/*.metal kernels on an NVIDIA GPU (PTX via clang-19, launched with CuPy): correctness and speed.

1. `moepack selftest`'s cases on the cuda executor (each kernel vs the numpy reference);
2. whole tiny models (qwen3_5_moe 4/2-bit, qwen3_next, qwen3_moe) through `--backend cuda` vs numpy:
   max |logit diff| relative to max |logit| over prefill + 3 greedy steps, and equal greedy tokens;
3. kernel times at Qwen3.5-397B shapes with device-resident inputs (CUDA events, median of 50 after 5
   warm-ups): dequant-matvec 4096x4096 at 2/4/8 bits, one routed expert (fused gate/up + SwiGLU, then down,
   from a raw 4-bit and 2-bit record), and the effective weight bandwidth of each.

Needs cupy and a GPU; without clang-19 set MOEPACK_PTX_BUNDLE to a folder written by
`python -m moepack.runtime.metal.executor_cuda export DIR`.

    python benchmarks/gpu.py [--json FILE]
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
                res[be] = (logits, toks, time.perf_counter() - t0, getattr(m.K, "log", None))
        ref, got = res["numpy"], res["cuda"]
        rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got[0], ref[0]))
        rows.append({"arch": arch, "bits": bits, "max_rel_logit_diff": rel, "greedy_equal": got[1] == ref[1],
                     "launches": got[3].count if got[3] else None})
        print(f"parity {arch:<12} {bits}-bit  rel {rel:.2e}  greedy equal {got[1] == ref[1]}  "
              f"launches {rows[-1]['launches']}", flush=True)
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
    """A closure launching `dispatches` with every host array replaced by a device copy made once."""
    cp = ex.cp
    dev: dict[int, object] = {}
    calls = []
    for d in dispatches:
        fn, k = ex._function(d.source, d.kernel)
        args = []
        for p in k.params:
            v = d.args[p.index]
            if p.kind == "scalar":
                args.append(np.dtype(p.dtype).type(v))
            else:
                if id(v) not in dev:
                    dev[id(v)] = cp.asarray(v)
                args.append(dev[id(v)])
        calls.append((fn, tuple(int(g) for g in d.grid), tuple(int(t) for t in d.threadgroup), tuple(args)))

    def run():
        for fn, g, t, a in calls:
            fn(g, t, a)

    return run


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    a = ap.parse_args()
    ex = CudaExecutor()
    print("device:", ex.describe()["device"], flush=True)
    t0 = time.perf_counter()
    st = run_selftest(ex)
    for r in st:
        print(f"selftest {r.op:<22} {'ok' if r.ok else 'FAIL'}  rel err {r.max_rel_err}  {r.error}", flush=True)
    print(f"selftest: {sum(r.ok for r in st)}/{len(st)} passed in {time.perf_counter() - t0:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        par = parity(Path(tmp))
    kt = kernel_times(ex)
    if a.json:
        Path(a.json).write_text(json.dumps({"device": ex.describe(), "selftest": [r.__dict__ for r in st],
                                            "parity": par, "kernels": kt}, indent=1))
    return 0 if all(r.ok for r in st) and all(p["greedy_equal"] for p in par) else 1


if __name__ == "__main__":
    raise SystemExit(main())

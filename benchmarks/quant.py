"""Throughput of the numba quant kernels, in GB/s of 4-bit SOURCE bytes (packed + scales + biases).

    .venv/bin/python benchmarks/quant.py [--experts 64] [--out 1024] [--in 4096] [--repeat 3] [--threads 1,2]

On a stacked [experts, out, in] 4-bit tensor, with 1 and 2 threads (numba.set_num_threads; capped
at NUMBA_NUM_THREADS), measures

* ``requantize_minmax`` 4 -> 2 bits;
* ``quant_error`` of the 4-bit source vs that 2-bit requantization (the pair-histogram path);
* ``requantize_minmax_with_error`` 4 -> 2 bits (requant and its error in one pass);
* requant + quant_error as two calls, for comparison with the one pass;
* ``dequantize`` 4 bits -> float32.

Prints, asserts nothing (except that the one-pass error equals the separate calls'). Wall-clock
best of --repeat runs: on a shared machine, other processes skew the figures. The source is
random words with random bf16 scales/biases: the kernels' cost does not depend on the values.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moepack.quant import dequantize, f32_to_bf16, quant_error, requantize_minmax  # noqa: E402
from moepack.quant.requant import requantize_minmax_with_error  # noqa: E402


def best_of(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--out", type=int, default=1024)
    ap.add_argument("--in", dest="in_dim", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = ap.parse_args()

    bits, gs = 4, args.group_size
    e, o, n = args.experts, args.out, args.in_dim
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 2**32, size=(e, o, n * bits // 32), dtype=np.uint32)
    scales = f32_to_bf16((rng.standard_normal((e, o, n // gs)) * 0.01).astype(np.float32))
    biases = f32_to_bf16((rng.standard_normal((e, o, n // gs)) * 0.05).astype(np.float32))
    src = (packed, scales, biases)
    src_bytes = packed.nbytes + scales.nbytes + biases.nbytes
    print(f"source: [{e}, {o}, {n}] {bits}-bit, group {gs}: {src_bytes / 1e9:.3f} GB; cores: {os.cpu_count()}")

    # compile (or load the cache) on a small slice first
    small = tuple(x[:1, :8] for x in src)
    requantize_minmax(*small, bits, 2, gs)
    requantize_minmax_with_error(*small, bits, 2, gs)
    dequantize(*small, bits, gs)
    quant_error(*small, bits, *requantize_minmax(*small, bits, 2, gs), 2, gs)
    two = requantize_minmax(*src, bits, 2, gs)
    err = quant_error(*src, bits, *two, 2, gs)
    assert requantize_minmax_with_error(*src, bits, 2, gs)[3] == err
    print(f"4 -> 2 bits RMSE {np.sqrt(err[0] / err[2]):.6g}, max |d| {err[1]:.6g}")

    def gbs(t):
        return src_bytes / t / 1e9

    threads = sorted({min(int(t), numba.config.NUMBA_NUM_THREADS) for t in args.threads.split(",")})
    for t in threads:
        numba.set_num_threads(t)
        times = {
            "requantize_minmax": best_of(lambda: requantize_minmax(*src, bits, 2, gs), args.repeat),
            "quant_error(4, 2)": best_of(lambda: quant_error(*src, bits, *two, 2, gs), args.repeat),
            "requantize_minmax_with_error": best_of(
                lambda: requantize_minmax_with_error(*src, bits, 2, gs), args.repeat
            ),
            "dequantize": best_of(lambda: dequantize(*src, bits, gs), args.repeat),
        }
        times["requant + quant_error (2 calls)"] = times["requantize_minmax"] + times["quant_error(4, 2)"]
        print(f"threads={t}:")
        for name, dt in times.items():
            print(f"  {name:32s} {gbs(dt):6.3f} GB/s  ({dt:.3f} s, {gbs(dt) / t:.3f} GB/s/thread)")


if __name__ == "__main__":
    main()

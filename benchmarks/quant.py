"""Throughput of the numba quant kernels, in GB/s of 4-bit SOURCE bytes (packed + scales + biases).

    .venv/bin/python benchmarks/quant.py [--experts 64] [--out 1024] [--in 4096] [--repeat 3]

Measures ``requantize_minmax`` (4 -> 2 bits), ``dequantize`` (4 bits -> float32) and
``quant_error`` (4-bit source vs its 2-bit requantization) on a stacked [experts, out, in]
tensor with 1 thread and with every core (numba.set_num_threads). Prints, asserts nothing.
Wall-clock best of --repeat runs: on a shared machine, other processes skew the figures. The source is random words with random bf16 scales/biases: the kernels'
cost does not depend on the values.
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
    args = ap.parse_args()

    bits, gs = 4, args.group_size
    e, o, n = args.experts, args.out, args.in_dim
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 2**32, size=(e, o, n * bits // 32), dtype=np.uint32)
    scales = f32_to_bf16((rng.standard_normal((e, o, n // gs)) * 0.01).astype(np.float32))
    biases = f32_to_bf16((rng.standard_normal((e, o, n // gs)) * 0.05).astype(np.float32))
    src_bytes = packed.nbytes + scales.nbytes + biases.nbytes
    print(f"source: [{e}, {o}, {n}] {bits}-bit, group {gs}: {src_bytes / 1e9:.3f} GB; cores: {os.cpu_count()}")

    # compile (or load the cache) on a small slice first
    requantize_minmax(packed[:1, :8], scales[:1, :8], biases[:1, :8], bits, 2, gs)
    dequantize(packed[:1, :8], scales[:1, :8], biases[:1, :8], bits, gs)
    two = requantize_minmax(packed, scales, biases, bits, 2, gs)
    quant_error(packed[:1, :8], scales[:1, :8], biases[:1, :8], bits, two[0][:1, :8], two[1][:1, :8], two[2][:1, :8], 2, gs)

    threads = sorted({1, numba.config.NUMBA_NUM_THREADS})
    for t in threads:
        numba.set_num_threads(t)
        tr = best_of(lambda: requantize_minmax(packed, scales, biases, bits, 2, gs), args.repeat)
        td = best_of(lambda: dequantize(packed, scales, biases, bits, gs), args.repeat)
        te = best_of(lambda: quant_error(packed, scales, biases, bits, *two, 2, gs), args.repeat)
        print(
            f"threads={t}: requantize_minmax 4->2 {src_bytes / tr / 1e9:5.2f} GB/s ({tr:.3f} s, "
            f"{src_bytes / tr / 1e9 / t:.2f} GB/s/core) | dequantize {src_bytes / td / 1e9:5.2f} GB/s "
            f"({td:.3f} s, writes {e * o * n * 4 / td / 1e9:.2f} GB/s of float32) | quant_error 4 vs 2 "
            f"{src_bytes / te / 1e9:5.2f} GB/s ({te:.3f} s)"
        )


if __name__ == "__main__":
    main()

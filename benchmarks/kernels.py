"""Kernel timings at the Qwen3.5-397B expert shape (D=4096, I=1024, group 64), 4-bit and 2-bit.

For each bit width: one expert FFN (gate + up + down) at T=1 (decode) and T=16 (a prefill batch) with the
numba kernels on 1 and 2 threads, the effective GB/s of quantized weights processed, the numpy reference
(kernels_ref) and, if ``mlx.core`` imports, mx.quantized_matmul on the CPU for ratios; then one
qmatmul [1 x 4096] x [4096 x 4096]^T.

    .venv/bin/python benchmarks/kernels.py [--reps 30] [--min-time 1.0] [--experts 24] [--no-int]

The mask-only rewrite of the 2/4-bit kernels (commit "numba dequant-matvec: shift-free code extraction...")
was timed against the previous code in one process, alternating old/new: expert_ffn 4-bit T=1 x1.30-1.33,
qmatmul 4096^2 4-bit T=1 x1.16-1.26, 2-bit x1.18-1.21 (medians). The copy of the old code used for that
comparison was removed afterwards; `git show` that commit's benchmarks/kernels.py to repeat it.

The "numba" rows run the default kernels (kernels_numba.INT_DOT_MODE: 32 with AVX2, i.e. the integer path
with x as two 16-bit integers). The integer path's modes are timed beside the float kernels (mode 0) at T=1
and T=2 in the same process, called in turn (float, int16x2 = mode 32, int16 = 16, int8 = 8) so that all see
the same machine load; "x" is the median of the per-round time ratios float / int (the steadiest figure on a
shared machine), "err" the max error against the numpy reference. --no-int skips them.
Measured 2026-11-29 in one run (2-core EPYC, load ~1.3-1.9 from other work), expert FFN T=1 against the
float kernels, paired medians, hot / DRAM: 4-bit 2 threads int16x2 x1.28 / x1.28, int16 x1.67 / x1.59, int8
x1.96 / x1.75 (1 thread: x1.35 / x1.30, x1.83 / x1.70, x2.17 / x1.89); 2-bit 2 threads x1.65 / x1.63,
x2.06 / x2.09, x2.49 / x2.42. Errors (of max|ref|): float 6.6e-7, int16x2 9.7e-7, int16 6.2e-5, int8 1.4e-2.
Inlining the float kernels' per-row helpers (same results) had already given the float expert FFN T=1
x1.03-1.13 and the [4096 x 1024] down projection alone x1.2-1.3 over the code before.

Times are the minimum and median over at least --reps calls and --min-time seconds after a warm-up call
(which also compiles). "hot": the weights of one expert (7 MB at 4 bits) stay in the CPU caches between
calls (a compute figure); "DRAM": each call takes the next of --experts copies (more than the last-level
cache holds), so the weights come from memory as they do from the page cache (no SSD involved). On a shared
machine the medians move with whatever else runs; the minima are the kernels' capability.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

D, I, GS = 4096, 1024, 64


def timeit(fn, reps: int, min_s: float = 0.0) -> tuple[float, float]:
    """(min, median) seconds of fn() over at least `reps` calls and at least `min_s` seconds."""
    fn()  # warm-up (and numba compile)
    ts = []
    while len(ts) < reps or sum(ts) < min_s:
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), float(np.median(ts))


def timeit_rounds(fns, reps: int, min_s: float = 0.0):
    """Call fns in turn, round after round: per fn (min s, median s, median of fns[0]-time / its time)."""
    for fn in fns:
        fn()  # warm-up (and numba compile)
    ts = [[] for _ in fns]
    while len(ts[0]) < reps or sum(ts[0]) < min_s:
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t)
    base = np.array(ts[0])
    return [(min(t), float(np.median(t)), float(np.median(base / np.array(t)))) for t in ts]


def with_int_mode(KN, mode, fn):
    """fn run with kernels_numba.INT_DOT_MODE = mode (0: the float kernels)."""

    def call():
        old = KN.INT_DOT_MODE
        KN.INT_DOT_MODE = mode
        try:
            return fn()
        finally:
            KN.INT_DOT_MODE = old

    return call


def nbytes(*arrays) -> int:
    return sum(a.nbytes for a in arrays)


def mlx_setup():
    try:
        import mlx.core as mx
    except Exception:  # noqa: BLE001 - any import problem means "no mlx here"
        return None
    mx.set_default_device(mx.cpu)
    return mx


def mlx_q(mx, w, s, b):
    from moepack.quant.bf16 import bf16_to_f32

    return (mx.array(w), mx.array(bf16_to_f32(s)).astype(mx.bfloat16), mx.array(bf16_to_f32(b)).astype(mx.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="timed calls per figure (numba, mlx)")
    ap.add_argument("--min-time", type=float, default=1.0, help="keep calling numba/mlx for at least this many s")
    ap.add_argument("--experts", type=int, default=24, help="expert copies cycled through for the DRAM rows")
    ap.add_argument("--ref-reps", type=int, default=2, help="timed calls of the (slow) numpy reference")
    ap.add_argument("--no-int", action="store_true", help="skip the integer dot-product rows")
    args = ap.parse_args()

    import numba

    from moepack.quant.affine_ref import quantize
    from moepack.runtime import kernels_numba as KN
    from moepack.runtime import kernels_ref as KR

    mx = mlx_setup()
    rng = np.random.default_rng(0)
    max_threads = numba.config.NUMBA_NUM_THREADS
    threads = [t for t in (1, 2) if t <= max_threads]
    print(f"numba {numba.__version__}, {max_threads} threads available, layer: ", end="")
    tiny = quantize(np.ones((64, 64), np.float32), 4, 64)
    KN.expert_ffn(np.ones((1, 64), np.float32), *tiny, *tiny, *tiny, 4, 64)  # a parallel kernel starts the layer
    print(numba.threading_layer())
    print(f"mlx: {'mx.quantized_matmul on CPU' if mx is not None else 'not importable, skipped'}\n")

    def row(label, t_min, t_med, nb, ref=None, mlx=None):
        line = f"  {label:<24} {t_min * 1e3:8.3f} ms (median {t_med * 1e3:8.3f})  {nb / t_min / 1e9:6.2f} GB/s"
        if ref is not None:
            line += f"  x{ref / t_min:7.1f} vs numpy ref"
        if mlx is not None:
            line += f"  x{mlx / t_min:5.1f} vs mlx"
        print(line)

    for bits in (4, 2):
        gate = quantize((rng.standard_normal((I, D)) * 0.02).astype(np.float32), bits, GS)
        up = quantize((rng.standard_normal((I, D)) * 0.02).astype(np.float32), bits, GS)
        down = quantize((rng.standard_normal((D, I)) * 0.02).astype(np.float32), bits, GS)
        nb = nbytes(*gate, *up, *down)
        copies = [tuple(a.copy() for a in (*gate, *up, *down)) for _ in range(max(1, args.experts))]
        print(f"expert FFN, {bits}-bit, group {GS}: {nb:,} bytes of weights")
        for T in (1, 16):
            x = rng.standard_normal((T, D)).astype(np.float32)
            ref_min, _ = timeit(lambda: KR.expert_ffn(x, *gate, *up, *down, bits, GS), args.ref_reps)
            mlx_min = None
            if mx is not None:
                xm = mx.array(x)
                g_, u_, d_ = mlx_q(mx, *gate), mlx_q(mx, *up), mlx_q(mx, *down)

                def ffn_mlx():
                    g = mx.quantized_matmul(xm, *g_, transpose=True, group_size=GS, bits=bits)
                    u = mx.quantized_matmul(xm, *u_, transpose=True, group_size=GS, bits=bits)
                    h = g * mx.sigmoid(g) * u
                    mx.eval(mx.quantized_matmul(h, *d_, transpose=True, group_size=GS, bits=bits))

                mlx_min, mlx_med = timeit(ffn_mlx, args.reps, args.min_time)
            for nt in threads:
                numba.set_num_threads(nt)
                t_min, t_med = timeit(lambda: KN.expert_ffn(x, *gate, *up, *down, bits, GS), args.reps, args.min_time)
                row(f"T={T:<3} numba {nt} thr, hot", t_min, t_med, nb, ref_min, mlx_min)
                if T == 1:
                    nxt = iter(range(1 << 62))
                    t_min, t_med = timeit(lambda: KN.expert_ffn(x, *copies[next(nxt) % len(copies)], bits, GS),
                                          args.reps, args.min_time)
                    row(f"T={T:<3} numba {nt} thr, DRAM", t_min, t_med, nb, ref_min, mlx_min)
                if T == 1 and not args.no_int:
                    int_rows(KN, KR, x, gate, up, down, copies, bits, nb, nt, args)
            numba.set_num_threads(max_threads)
            row(f"T={T:<3} numpy reference", ref_min, ref_min, nb)
            if mlx_min is not None:
                row(f"T={T:<3} mlx CPU, hot", mlx_min, mlx_med, nb)
        print()

    for bits in (4, 2):
        w, s, b = quantize((rng.standard_normal((D, D)) * 0.02).astype(np.float32), bits, GS)
        x = rng.standard_normal((1, D)).astype(np.float32)
        nb = nbytes(w, s, b)
        print(f"qmatmul [1 x {D}] x [{D} x {D}]^T, {bits}-bit, group {GS}: {nb:,} bytes of weights")
        ref_min, _ = timeit(lambda: KR.qmatmul(x, w, s, b, bits, GS), args.ref_reps)
        mlx_min = None
        if mx is not None:
            xm, q = mx.array(x), mlx_q(mx, w, s, b)
            mlx_min, mlx_med = timeit(
                lambda: mx.eval(mx.quantized_matmul(xm, *q, transpose=True, group_size=GS, bits=bits)),
                args.reps,
                args.min_time,
            )
        for nt in threads:
            numba.set_num_threads(nt)
            t_min, t_med = timeit(lambda: KN.qmatmul(x, w, s, b, bits, GS), args.reps, args.min_time)
            row(f"numba {nt} thr, hot", t_min, t_med, nb, ref_min, mlx_min)
            if not args.no_int:
                fns = [with_int_mode(KN, m, lambda: KN.qmatmul(x, w, s, b, bits, GS)) for m, _ in INT_MODES]
                for (t_min, t_med, ratio), (_, label) in zip(timeit_rounds(fns, args.reps, args.min_time),
                                                             INT_MODES):
                    print(f"  {label:<7} {nt} thr, hot   {t_min * 1e3:8.3f} ms (median {t_med * 1e3:8.3f})"
                          f"  {nb / t_min / 1e9:6.2f} GB/s  x{ratio:5.2f} vs float (paired median)")
        numba.set_num_threads(max_threads)
        row("numpy reference", ref_min, ref_min, nb)
        if mlx_min is not None:
            row("mlx CPU, hot", mlx_min, mlx_med, nb)
        print()


INT_MODES = ((0, "float"), (32, "int16x2"), (16, "int16"), (8, "int8"))


def int_rows(KN, KR, x1, gate, up, down, copies, bits, nb, nt, args) -> None:
    """Expert FFN, float vs the integer path's modes, T=1 and 2, hot and DRAM, plus each one's max error
    against the numpy reference (relative to max |ref|)."""
    rng = np.random.default_rng(1)
    for T in (1, 2):
        x = x1 if T == 1 else rng.standard_normal((T, D)).astype(np.float32)
        ref = KR.expert_ffn(x, *gate, *up, *down, bits, GS)
        errs = []
        for mode, _ in INT_MODES:
            y = with_int_mode(KN, mode, lambda: KN.expert_ffn(x, *gate, *up, *down, bits, GS))()
            errs.append(float(np.abs(y - ref).max() / np.abs(ref).max()))
        for where in ("hot", "DRAM"):
            if where == "hot":
                def ffn():
                    return KN.expert_ffn(x, *gate, *up, *down, bits, GS)
            else:
                nxt = iter(range(1 << 62))

                def ffn():
                    return KN.expert_ffn(x, *copies[next(nxt) % len(copies)], bits, GS)

            res = timeit_rounds([with_int_mode(KN, m, ffn) for m, _ in INT_MODES], args.reps, args.min_time)
            for (t_min, t_med, ratio), (_, label), err in zip(res, INT_MODES, errs):
                line = (f"  T={T:<3} {label:<7} {nt} thr, {where:<4}  {t_min * 1e3:7.3f} ms (median {t_med * 1e3:7.3f})"
                        f"  {nb * T / t_min / 1e9:6.2f} GB/s")
                if label != "float":
                    line += f"  x{ratio:5.2f} vs float (paired median)"
                print(line + f"  err {err:.1e} of max|ref|")


if __name__ == "__main__":
    main()

"""Kernel timings at the Qwen3.5-397B expert shape (D=4096, I=1024, group 64), 4-bit and 2-bit.

For each bit width: one expert FFN (gate + up + down) at T=1 (decode) and T=16 (a prefill batch) with the
numba kernels on 1 and 2 threads, the effective GB/s of quantized weights processed, the numpy reference
(kernels_ref) and, if ``mlx.core`` imports, mx.quantized_matmul on the CPU for ratios; then one
qmatmul [1 x 4096] x [4096 x 4096]^T.

    .venv/bin/python benchmarks/kernels.py [--reps 30] [--min-time 1.0] [--experts 24]
    .venv/bin/python benchmarks/kernels.py --compare [--rounds 5]

--compare: the kernels before and after the mask-only rewrite, in one process: the previous code (shift +
mask per code, a per-word scale gather, 4 tokens per row pass) is kept below as ``_old_*`` and timed against
kernels_numba on the same arrays (qmatmul 4096x4096, expert FFN 4096/1024, bits 4 and 2, group 64, T = 1, 2,
4), alternating old/new for --rounds rounds; prints min and median ms and GB/s of weights (x tokens).

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


# ---------------------------------------------------------------- the previous kernels (for --compare)
# A verbatim copy of kernels_numba's qmatmul/expert_ffn core before the mask-only rewrite (names prefixed
# _old, not cached), kept only to time against the current module in one process. Bits 2, 4, 8 only.

from numba import njit, prange  # noqa: E402

_OLD_JIT = dict(cache=False, nogil=True, error_model="numpy")
_OLD_FM = {"reassoc", "contract"}
_OLD_XTILE_BYTES = 1 << 18


@njit(inline="always", **_OLD_JIT)
def _old_bf(u):
    """bf16 bit pattern (uint16) -> float32, exact."""
    return np.uint32(np.uint32(u) << np.uint32(16)).view(np.float32)


@njit(fastmath=_OLD_FM, **_OLD_JIT)
def _old_prep_x(x, bits, gs, xp, xs):
    """xp[t, k, j] = x[t, j*per + k] (per = 32/bits codes per word); xs[t, g] = sum of group g of x[t]."""
    T, n = x.shape
    per = 32 // bits
    nw = n // per
    for t in range(T):
        for j in range(nw):
            for k in range(per):
                xp[t, k, j] = x[t, j * per + k]
        for g in range(n // gs):
            s = np.float32(0)
            for i in range(g * gs, (g + 1) * gs):
                s += x[t, i]
            xs[t, g] = s


@njit(fastmath=_OLD_FM, **_OLD_JIT)
def _old_row1(wr, sr, br, xp, xs, t, bits, lw):
    """One output: dot(dequant(row), x[t]) from the packed row wr [nw] and its bf16 scales/biases [ng].

    lw = log2(words per group): word j belongs to group j >> lw.
    """
    bacc = np.float32(0)
    for g in range(sr.shape[0]):
        bacc += _old_bf(br[g]) * xs[t, g]
    acc = np.float32(0)
    nw = wr.shape[0]
    if bits == 4:
        for j in range(nw):
            wj = wr[j]
            q = np.float32(0)
            for k in range(8):
                q += np.float32(np.int32((wj >> np.uint32(4 * k)) & np.uint32(15))) * xp[t, k, j]
            acc += _old_bf(sr[j >> lw]) * q
    elif bits == 2:
        for j in range(nw):
            wj = wr[j]
            q = np.float32(0)
            for k in range(16):
                q += np.float32(np.int32((wj >> np.uint32(2 * k)) & np.uint32(3))) * xp[t, k, j]
            acc += _old_bf(sr[j >> lw]) * q
    else:  # 8
        for j in range(nw):
            wj = wr[j]
            q = np.float32(0)
            for k in range(4):
                q += np.float32(np.int32((wj >> np.uint32(8 * k)) & np.uint32(255))) * xp[t, k, j]
            acc += _old_bf(sr[j >> lw]) * q
    return acc + bacc


@njit(fastmath=_OLD_FM, **_OLD_JIT)
def _old_row4(wr, sr, br, xp, xs, t, bits, lw):
    """As _old_row1 for tokens t..t+3 at once: each word is decoded once for the four tokens."""
    b0 = np.float32(0)
    b1 = np.float32(0)
    b2 = np.float32(0)
    b3 = np.float32(0)
    for g in range(sr.shape[0]):
        bg = _old_bf(br[g])
        b0 += bg * xs[t, g]
        b1 += bg * xs[t + 1, g]
        b2 += bg * xs[t + 2, g]
        b3 += bg * xs[t + 3, g]
    a0 = np.float32(0)
    a1 = np.float32(0)
    a2 = np.float32(0)
    a3 = np.float32(0)
    nw = wr.shape[0]
    if bits == 4:
        for j in range(nw):
            wj = wr[j]
            q0 = np.float32(0)
            q1 = np.float32(0)
            q2 = np.float32(0)
            q3 = np.float32(0)
            for k in range(8):
                c = np.float32(np.int32((wj >> np.uint32(4 * k)) & np.uint32(15)))
                q0 += c * xp[t, k, j]
                q1 += c * xp[t + 1, k, j]
                q2 += c * xp[t + 2, k, j]
                q3 += c * xp[t + 3, k, j]
            s = _old_bf(sr[j >> lw])
            a0 += s * q0
            a1 += s * q1
            a2 += s * q2
            a3 += s * q3
    elif bits == 2:
        for j in range(nw):
            wj = wr[j]
            q0 = np.float32(0)
            q1 = np.float32(0)
            q2 = np.float32(0)
            q3 = np.float32(0)
            for k in range(16):
                c = np.float32(np.int32((wj >> np.uint32(2 * k)) & np.uint32(3)))
                q0 += c * xp[t, k, j]
                q1 += c * xp[t + 1, k, j]
                q2 += c * xp[t + 2, k, j]
                q3 += c * xp[t + 3, k, j]
            s = _old_bf(sr[j >> lw])
            a0 += s * q0
            a1 += s * q1
            a2 += s * q2
            a3 += s * q3
    else:  # 8
        for j in range(nw):
            wj = wr[j]
            q0 = np.float32(0)
            q1 = np.float32(0)
            q2 = np.float32(0)
            q3 = np.float32(0)
            for k in range(4):
                c = np.float32(np.int32((wj >> np.uint32(8 * k)) & np.uint32(255)))
                q0 += c * xp[t, k, j]
                q1 += c * xp[t + 1, k, j]
                q2 += c * xp[t + 2, k, j]
                q3 += c * xp[t + 3, k, j]
            s = _old_bf(sr[j >> lw])
            a0 += s * q0
            a1 += s * q1
            a2 += s * q2
            a3 += s * q3
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@njit(fastmath=_OLD_FM, **_OLD_JIT)
def _old_row_tokens(wr, sr, br, xp, xs, t0, t1, bits, lw, y, r):
    """y[t, r] for t in [t0, t1): one weight row against a tile of tokens, 4 at a time."""
    t = t0
    while t + 4 <= t1:
        a0, a1, a2, a3 = _old_row4(wr, sr, br, xp, xs, t, bits, lw)
        y[t, r] = a0
        y[t + 1, r] = a1
        y[t + 2, r] = a2
        y[t + 3, r] = a3
        t += 4
    while t < t1:
        y[t, r] = _old_row1(wr, sr, br, xp, xs, t, bits, lw)
        t += 1


@njit(parallel=True, fastmath=_OLD_FM, **_OLD_JIT)
def _old_rows_par(w, scales, biases, xp, xs, t0, t1, bits, lw, y):
    """y[t0:t1, r] for every row r of w, rows spread over the threads."""
    for r in prange(w.shape[0]):
        _old_row_tokens(w[r], scales[r], biases[r], xp, xs, t0, t1, bits, lw, y, r)


@njit(fastmath=_OLD_FM, **_OLD_JIT)
def _old_silu(v):
    # as kernels_ref: x / (1 + exp(-x)); exp overflow gives -0 for very negative x
    return v / (np.float32(1) + np.exp(-v))


@njit(parallel=True, fastmath=_OLD_FM, **_OLD_JIT)
def _old_gate_up_par(gw, gsc, gbi, uw, usc, ubi, xpg, xsg, xpu, xsu, t0, t1, gbits, ubits, lg, lu, h, u):
    """h[t0:t1] = silu(gate) * up: the gate row and the up row r are computed by the same thread in turn."""
    for r in prange(gw.shape[0]):
        _old_row_tokens(gw[r], gsc[r], gbi[r], xpg, xsg, t0, t1, gbits, lg, h, r)
        _old_row_tokens(uw[r], usc[r], ubi[r], xpu, xsu, t0, t1, ubits, lu, u, r)
        for t in range(t0, t1):
            h[t, r] = _old_silu(h[t, r]) * u[t, r]


@njit(fastmath=_OLD_FM, **_OLD_JIT)
def _old_prepped(x, bits, gs):
    """(xp [T, per, nw], xs [T, ng]) for x [T, in]: see _old_prep_x."""
    T, n = x.shape
    per = 32 // bits
    xp = np.empty((T, per, n // per), np.float32)
    xs = np.empty((T, n // gs), np.float32)
    _old_prep_x(x, bits, gs, xp, xs)
    return xp, xs


def _old_qmm(x, w, scales, biases, bits, gs, y):
    """y [T, out] = x [T, in] @ dequant(w).T for bits 2, 4, 8, one L2-sized tile of tokens at a time."""
    T = x.shape[0]
    xp, xs = _old_prepped(x, bits, gs)
    lw = _old_log2(gs * bits // 32)
    tt = _old_token_tile(x.shape[1])
    for t0 in range(0, T, tt):
        _old_rows_par(w, scales, biases, xp, xs, t0, min(T, t0 + tt), bits, lw, y)


def _old_ffn(x, gw, gsc, gbi, uw, usc, ubi, dw, dsc, dbi, gbits, ubits, dbits, gs, y):
    """y [T, D] = down(silu(gate(x)) * up(x))."""
    T, D = x.shape
    I = gw.shape[0]
    xpg, xsg = _old_prepped(x, gbits, gs)
    xpu, xsu = (xpg, xsg) if ubits == gbits else _old_prepped(x, ubits, gs)
    lg, lu = _old_log2(gs * gbits // 32), _old_log2(gs * ubits // 32)
    h = np.empty((T, I), np.float32)  # gate, then silu(gate) * up
    u = np.empty((T, I), np.float32)
    tt = _old_token_tile(D)
    for t0 in range(0, T, tt):
        _old_gate_up_par(gw, gsc, gbi, uw, usc, ubi, xpg, xsg, xpu, xsu, t0, min(T, t0 + tt), gbits, ubits, lg, lu,
                         h, u)
    _old_qmm(h, dw, dsc, dbi, dbits, gs, y)


def _old_token_tile(in_dim: int) -> int:
    return max(4, (_OLD_XTILE_BYTES // (4 * max(1, in_dim))) // 4 * 4)


def _old_qmatmul(x, w, scales, biases, bits, gs):
    y = np.empty((x.shape[0], w.shape[0]), np.float32)
    _old_qmm(x, w, scales, biases, bits, gs, y)
    return y


def _old_expert_ffn(x, gw, gsc, gbi, uw, usc, ubi, dw, dsc, dbi, bits, gs):
    y = np.empty((x.shape[0], dw.shape[0]), np.float32)
    _old_ffn(x, gw, gsc, gbi, uw, usc, ubi, dw, dsc, dbi, bits, bits, bits, gs, y)
    return y


def _old_log2(n: int) -> int:
    return int(n).bit_length() - 1


def compare(rounds: int, reps: int, tokens=(1, 2, 4)) -> None:
    """Old vs new kernels on the same arrays, alternating old/new, min and median over all rounds."""
    import numba

    from moepack.quant.affine_ref import quantize
    from moepack.runtime import kernels_numba as KN

    rng = np.random.default_rng(0)
    print(f"old (shift+mask, scale gather) vs new (mask only, x pre-scaled); {rounds} rounds x {reps} calls each;"
          f" min / median ms; GB/s = bytes of weights x tokens / min time")
    for nt in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(nt)
        for bits in (4, 2):
            q = lambda *shape: quantize((rng.standard_normal(shape) * 0.02).astype(np.float32), bits, GS)  # noqa: E731
            W, gate, up, down = q(D, D), q(I, D), q(I, D), q(D, I)
            for T in tokens:
                x = rng.standard_normal((T, D)).astype(np.float32)
                cases = (
                    (f"qmatmul {D}x{D}", lambda K: (_old_qmatmul if K is None else K.qmatmul)(x, *W, bits, GS), W),
                    (f"expert_ffn {D}/{I}", lambda K: (_old_expert_ffn if K is None else K.expert_ffn)(
                        x, *gate, *up, *down, bits, GS), (*gate, *up, *down)),
                )
                for name, f, arrays in cases:
                    yo, yn = f(None), f(KN)  # also compiles
                    rel = float(np.abs(yo - yn).max() / np.abs(yo).max())
                    t_old, t_new = [], []
                    for _ in range(rounds):
                        for K, ts in ((None, t_old), (KN, t_new)):
                            for _ in range(reps):
                                t = time.perf_counter()
                                f(K)
                                ts.append(time.perf_counter() - t)
                    nb = nbytes(*arrays) * T
                    o, n = min(t_old), min(t_new)
                    om, nm = float(np.median(t_old)), float(np.median(t_new))
                    print(f"  {nt} thr {bits}-bit T={T} {name:<18} old {o * 1e3:6.3f} / {om * 1e3:6.3f} ms "
                          f"{nb / o / 1e9:5.2f} GB/s   new {n * 1e3:6.3f} / {nm * 1e3:6.3f} ms {nb / n / 1e9:5.2f} GB/s"
                          f"   x{o / n:4.2f} (median x{om / nm:4.2f})  max|diff|/max|y| {rel:.1e}", flush=True)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="timed calls per figure (numba, mlx)")
    ap.add_argument("--min-time", type=float, default=1.0, help="keep calling numba/mlx for at least this many s")
    ap.add_argument("--experts", type=int, default=24, help="expert copies cycled through for the DRAM rows")
    ap.add_argument("--ref-reps", type=int, default=2, help="timed calls of the (slow) numpy reference")
    ap.add_argument("--compare", action="store_true", help="only old vs new one-token kernels (see above)")
    ap.add_argument("--rounds", type=int, default=5, help="--compare: alternating old/new rounds")
    args = ap.parse_args()
    if args.compare:
        compare(args.rounds, args.reps)
        return

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
        numba.set_num_threads(max_threads)
        row("numpy reference", ref_min, ref_min, nb)
        if mlx_min is not None:
            row("mlx CPU, hot", mlx_min, mlx_med, nb)
        print()


if __name__ == "__main__":
    main()

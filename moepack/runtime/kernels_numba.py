"""numba fast paths of ``kernels_ref``: the same names and signatures, results within stated tolerances.

The model code calls ``K.<name>`` with K either this module or ``kernels_ref``; every public function here
accepts what the reference accepts (float activations are converted to contiguous float32 as the reference
does) and returns the same dtypes and shapes. Inputs are checked cheaply in the Python wrappers; a wrong
dtype or shape raises ``ShapeError`` (an unsupported bit width or group size raises ``QuantizationError``,
as the reference's ``dequantize`` does).

Shape legend as in ``kernels_ref``: T tokens, D hidden, I expert intermediate, in/out the input/output
features of a projection, nw = in*bits/32 packed words per row, ng = in/gs groups per row, per = 32/bits
codes per word, S keys, Hq/Hkv/Hk/Hv heads, hd/dk/dv head dims, C conv channels.

How ``qmatmul`` (the hot kernel: decode is a T=1 matvec over 4-bit expert projections) is organised
    y[t, o] = sum_g scale[o, g] * dot(q[o, g], x[t, g]) + sum_g bias[o, g] * sum(x[t, g])
  * The per-group sums of x are computed once per call (``xs``), so the bias costs one multiply-add per group.
  * x is permuted once per call to ``xp[t, k, j] = x[t, j*per + k]``: code k of every word j is multiplied by
    a contiguous run of xp. The inner loop runs over words j with the codes of a word unrolled (k is a
    literal), which LLVM vectorises 8 words wide. The dequantized matrix is never formed; weights are read
    once per call straight from the packed buffer.
  * Token by token (bits 2 and 4; T < 4, or wide rows): code k < per - 1 is isolated with a mask alone,
    w & (m << bits*k) = code * 2^(bits*k), converted to float exactly and multiplied by xp pre-scaled by
    2^(-bits*k) (exact, a power of two); the top code is a shift alone. Per code and 8 words: one and, one
    int->float, one fma. Two vectorised passes per row and token: q_j = dot(codes of word j, x) for every
    word into a scratch row (no reduction), then sum_g scale_g * sum(q of group g) + bias_g * xs_g with a
    literal group width, which LLVM vectorises across 8 groups (shuffles gather a group's words): no per-word
    scale gather, no horizontal sum per group. A row is done for every token of the tile while it is in L1.
    Rows are spread over threads in blocks of _ROWS_PER_TASK.
  * 8 bits, or T >= 4 with inputs <= _ROW4_MAX_IN (e.g. the 1024-wide down projection): each weight row is
    decoded once per block of 4 tokens (shift and mask per code, 4 accumulators), which wins while 4 tokens
    of xp fit in L1. Tokens are tiled so that a tile of xp stays in L2.
  * 3-bit weights (codes straddle words) fall back to dequantize-in-chunks + matmul, as the reference does.
  * The per-row helpers (_qwords, _segsum, _row1, _row_tokens) are inlined into their callers (numba
    inline="always"): a call between jitted functions is not inlined by LLVM and passes every array as an
    exploded struct, which for 1024-wide rows cost a fifth of the time (after inlining: down projection
    [4096 x 1024] at T=1 x1.2-1.3 at 4 bits, x1.1-1.5 at 8 bits, same results). _row4 stays a call: inlined
    into both parallel kernels it made the first compile ~13 s longer for ~no gain.
  * By default on x86 with AVX2 (INT_DOT_MODE = 32), 2/4-bit weights go through kernels_intdot instead
    where the token-by-token kernels would run (_one_by_one): x split per group into two 16-bit integers
    (quantized value and rounded residual), codes times ints in vpmaddwd; as accurate as the float kernels,
    expert FFN T=1 on 2 threads x1.28 (4-bit) / x1.65 (2-bit). Opt-in modes 16 / 8 (int16 / int8
    activations, MOEPACK_INT_DOT=16 / MOEPACK_INT8_DOT=1) are faster still and beyond the parity tolerance;
    MOEPACK_INT_DOT=0 restores the float kernels. See kernels_intdot.

Numerics (what the tests hold this module to)
  * ``qmatmul``/``expert_ffn``: fastmath ``reassoc`` + ``contract`` on the reductions only (needed to
    vectorise them); the summation order differs from dequantize-then-matmul, so results are not bit-equal:
    tested to 1e-5 of |x| @ (|scale| q + |bias|)^T per output (measured <= 4e-8 of it, ~1e-6 of max |y|
    for a 397B-shaped expert). The token-by-token kernels scale x by up to 2^-28 (exact); only activations
    below ~2^-98 (3e-30) would turn subnormal and lose relative precision (tested at |x| ~ 1e-20 and 1e20).
  * ``attention``, ``gated_delta``: dot products vectorised with ``reassoc`` (no contraction in
    ``gated_delta``, so the state update ``S + k*delta`` rounds exactly as the reference's); ~1e-5 relative.
  * ``rmsnorm``/``gated_rmsnorm``: the mean of squares accumulated in float64, the rest as the reference;
    ``rope``: same inv_freq (computed by the same numpy expression) and float32 angles; ``conv1d_step``: same
    order of operations; ``qembedding``: bit-identical (``scale * q + bias``, no fma). exp/sin/cos come from
    libm rather than numpy's SIMD routines, so these agree to a few float32 ulps.
  * ``router_topk``: same softmax in float32, indices ordered by probability with ties to the lower index.

Threading: parallel kernels use numba's threading layer (``numba.set_num_threads`` to limit them). The
runtime calls kernels from ONE Python thread at a time; numba's ``workqueue`` layer (the fallback when
neither OpenMP nor TBB is available) is not safe for concurrent calls from several Python threads. All
kernels release the GIL (``nogil``), so the expert-reading threads keep running while they compute.
A parallel region ends when its slowest thread does: with every core busy (one CPU-bound process beside a
2-core run) a 4-bit expert FFN measured median 5.4 ms on 2 threads vs 1.7 ms on 1 (1.2 ms on 2 when idle),
so give the kernels only the cores that nothing else is spinning on.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ..errors import ShapeError
from ..quant.affine_ref import check_bits, check_group_size
from . import kernels_intdot as _KI
from .kernels_ref import __all__  # noqa: F401  the kernel contract: the same names as the reference
from .shapes import check_attention, check_gated_delta, check_rope, check_router_k

# error_model="numpy": no Python-style ZeroDivisionError checks, which would block vectorisation.
_JIT = dict(cache=True, nogil=True, error_model="numpy")
# Reductions may be reordered (so LLVM can vectorise them) and a*b+c fused; nothing else (no nnan/ninf,
# no approximate functions).
_FM = {"reassoc", "contract"}
_FM_NOFMA = {"reassoc"}

# qmatmul tiles tokens so that one tile of the permuted activations (TT * in * 4 bytes) stays in L2.
_XTILE_BYTES = 1 << 18
# The 3-bit fallback dequantizes at most this many weights at a time (as kernels_ref).
_DEQUANT_CHUNK = 1 << 24


# ================================================================================ validation helpers


def _ro(a: np.ndarray) -> np.ndarray:
    """A read-only view. Every kernel input goes in read-only, so numba compiles one variant per kernel
    whether the caller's array is writable or a read-only view into a mapped file (dense weights are)."""
    v = a.view()
    v.flags.writeable = False
    return v


def _act(a, name: str, ndim: int | None = None) -> np.ndarray:
    """A float activation as a read-only C-contiguous float32 array (no copy when it already is one)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if ndim is not None and a.ndim != ndim:
        raise ShapeError(f"{name} must be a {ndim}-D array, got shape {a.shape}", hint="see the kernel's shape legend")
    return _ro(a)


def _qtensor(w, scales, biases, bits: int, gs: int, in_dim: int, name: str):
    """Check one quantized projection against its input width; returns contiguous (w, scales, biases)."""
    w, scales, biases = np.asarray(w), np.asarray(scales), np.asarray(biases)
    if w.dtype != np.uint32:
        raise ShapeError(f"{name}: packed weights must be uint32, got {w.dtype}")
    for part, a in (("scales", scales), ("biases", biases)):
        if a.dtype != np.uint16:
            raise ShapeError(
                f"{name}: {part} must be uint16 bf16 bit patterns, got {a.dtype}",
                hint="view bf16 tensors as np.uint16",
            )
    if w.ndim != 2:
        raise ShapeError(f"{name}: packed weights must have shape [out, words], got {w.shape}")
    if (in_dim * bits) % 32 or w.shape[1] != in_dim * bits // 32:
        raise ShapeError(
            f"{name}: {w.shape[1]} words per row do not hold {in_dim} {bits}-bit codes "
            f"(expected {in_dim * bits / 32:g})"
        )
    if in_dim % gs:
        raise ShapeError(f"{name}: group size {gs} does not divide the input width {in_dim}")
    expected = (w.shape[0], in_dim // gs)
    for part, a in (("scales", scales), ("biases", biases)):
        if a.shape != expected:
            raise ShapeError(f"{name}: {part} have shape {a.shape}, expected {expected}")
    return _ro(np.ascontiguousarray(w)), _ro(np.ascontiguousarray(scales)), _ro(np.ascontiguousarray(biases))


def _log2(n: int) -> int:
    return int(n).bit_length() - 1


# ================================================================================ quantized matmul kernels


@njit(inline="always", **_JIT)
def _bf(u):
    """bf16 bit pattern (uint16) -> float32, exact."""
    return np.uint32(np.uint32(u) << np.uint32(16)).view(np.float32)


@njit(fastmath=_FM, **_JIT)
def _prep_x(x, bits, gs, pre, xp, xs):
    """xp[t, k, j] = x[t, j*per + k] (per = 32/bits codes per word), if ``pre`` times 2^(-bits*k) for the codes
    k < per - 1 (a power of two: exact); xs[t, g] = sum of group g of x[t]."""
    T, n = x.shape
    per = 32 // bits
    nw = n // per
    for t in range(T):
        for k in range(per):
            f = np.float32(1)
            if pre and k < per - 1:
                f = np.float32(1) / np.float32(1 << (bits * k))
            for j in range(nw):
                xp[t, k, j] = x[t, j * per + k] * f
        for g in range(n // gs):
            s = np.float32(0)
            for i in range(g * gs, (g + 1) * gs):
                s += x[t, i]
            xs[t, g] = s


# Token by token: each code k < per - 1 is isolated with a mask only, (w & (m << bits*k)) = code * 2^(bits*k),
# converted to float exactly and multiplied by x pre-scaled by 2^(-bits*k) (_prep_x with pre); the top code
# is a shift alone. One and, one int->float and one fma per code and 8 words (AVX2), no shifts.
@njit(inline="always", **_JIT)
def _q4(wj, xp, t, j):
    q = np.float32(np.int32(wj >> np.uint32(28))) * xp[t, 7, j]
    for k in range(7):
        q += np.float32(np.int32(wj & np.uint32(15 << (4 * k)))) * xp[t, k, j]
    return q


@njit(inline="always", **_JIT)
def _q2(wj, xp, t, j):
    q = np.float32(np.int32(wj >> np.uint32(30))) * xp[t, 15, j]
    for k in range(15):
        q += np.float32(np.int32(wj & np.uint32(3 << (2 * k)))) * xp[t, k, j]
    return q


@njit(inline="always", **_JIT)
def _qwords(wr, xp, t, bits, qb):
    """qb[j] = dot(codes of word j of the packed row wr, x[t]) (xp pre-scaled): no scale, no reduction across
    words, so LLVM vectorises it 8 words wide with nothing but and, int->float and fma per code."""
    if bits == 4:
        for j in range(wr.shape[0]):
            qb[j] = _q4(wr[j], xp, t, j)
    else:  # 2 (8-bit weights take the row kernels, see _one_by_one)
        for j in range(wr.shape[0]):
            qb[j] = _q2(wr[j], xp, t, j)


@njit(inline="always", **_JIT)
def _seg(qb, sr, br, xs, t, wpg):
    acc = np.float32(0)
    for g in range(sr.shape[0]):
        d = np.float32(0)
        for i in range(wpg):
            d += qb[g * wpg + i]
        acc += _bf(sr[g]) * d + _bf(br[g]) * xs[t, g]
    return acc


@njit(inline="always", **_JIT)
def _segsum(qb, sr, br, xs, t, lw):
    """sum_g scale[g] * (sum of qb over the words of group g) + bias[g] * xs[t, g]. With a literal group width
    LLVM vectorises this across 8 groups at a time (the words of a group gathered by shuffles), so neither a
    per-word scale nor a horizontal sum per group is needed."""
    if lw == 3:
        return _seg(qb, sr, br, xs, t, 8)
    elif lw == 2:
        return _seg(qb, sr, br, xs, t, 4)
    elif lw == 4:
        return _seg(qb, sr, br, xs, t, 16)
    elif lw == 1:
        return _seg(qb, sr, br, xs, t, 2)
    elif lw == 5:
        return _seg(qb, sr, br, xs, t, 32)
    return _seg(qb, sr, br, xs, t, 1 << lw)


@njit(fastmath=_FM, **_JIT)
def _rows1(w, scales, biases, r0, r1, xp, xs, t0, t1, bits, lw, qb, y):
    """y[t0:t1, r0:r1] token by token (xp pre-scaled; qb: scratch [nw]); the row stays in L1 meanwhile."""
    for r in range(r0, r1):
        for t in range(t0, t1):
            _qwords(w[r], xp, t, bits, qb)
            y[t, r] = _segsum(qb, scales[r], biases[r], xs, t, lw)


# Inputs up to which the 4-token row kernel is used for T >= 4 (see _one_by_one).
_ROW4_MAX_IN = 2048
# Rows per parallel task of the token-by-token kernels (the scratch qb is allocated once per task).
_ROWS_PER_TASK = 16


@njit(parallel=True, **_JIT)
def _rows1_par(w, scales, biases, xp, xs, t0, t1, bits, lw, y):
    """y[t0:t1, r] for every row r of w, token by token, blocks of rows spread over the threads."""
    R, nw = w.shape
    for b in prange((R + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        r0 = b * _ROWS_PER_TASK
        qb = np.empty(nw, np.float32)
        _rows1(w, scales, biases, r0, min(R, r0 + _ROWS_PER_TASK), xp, xs, t0, t1, bits, lw, qb, y)


# Several tokens: each word is decoded once per block of 4 tokens (shift and mask per code), tokens tiled
# so that a tile of xp stays in L2.
@njit(inline="always", **_JIT)
def _row1(wr, sr, br, xp, xs, t, bits, lw):
    """One output: dot(dequant(row), x[t]) from the packed row wr [nw] and its bf16 scales/biases [ng].

    lw = log2(words per group): word j belongs to group j >> lw.
    """
    bacc = np.float32(0)
    for g in range(sr.shape[0]):
        bacc += _bf(br[g]) * xs[t, g]
    acc = np.float32(0)
    nw = wr.shape[0]
    if bits == 4:
        for j in range(nw):
            wj = wr[j]
            q = np.float32(0)
            for k in range(8):
                q += np.float32(np.int32((wj >> np.uint32(4 * k)) & np.uint32(15))) * xp[t, k, j]
            acc += _bf(sr[j >> lw]) * q
    elif bits == 2:
        for j in range(nw):
            wj = wr[j]
            q = np.float32(0)
            for k in range(16):
                q += np.float32(np.int32((wj >> np.uint32(2 * k)) & np.uint32(3))) * xp[t, k, j]
            acc += _bf(sr[j >> lw]) * q
    else:  # 8
        for j in range(nw):
            wj = wr[j]
            q = np.float32(0)
            for k in range(4):
                q += np.float32(np.int32((wj >> np.uint32(8 * k)) & np.uint32(255))) * xp[t, k, j]
            acc += _bf(sr[j >> lw]) * q
    return acc + bacc


@njit(fastmath=_FM, **_JIT)
def _row4(wr, sr, br, xp, xs, t, bits, lw):
    """As _row1 for tokens t..t+3 at once: each word is decoded once for the four tokens."""
    b0 = np.float32(0)
    b1 = np.float32(0)
    b2 = np.float32(0)
    b3 = np.float32(0)
    for g in range(sr.shape[0]):
        bg = _bf(br[g])
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
            s = _bf(sr[j >> lw])
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
            s = _bf(sr[j >> lw])
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
            s = _bf(sr[j >> lw])
            a0 += s * q0
            a1 += s * q1
            a2 += s * q2
            a3 += s * q3
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@njit(inline="always", **_JIT)
def _row_tokens(wr, sr, br, xp, xs, t0, t1, bits, lw, y, r):
    """y[t, r] for t in [t0, t1): one weight row against a tile of tokens, 4 at a time."""
    t = t0
    while t + 4 <= t1:
        a0, a1, a2, a3 = _row4(wr, sr, br, xp, xs, t, bits, lw)
        y[t, r] = a0
        y[t + 1, r] = a1
        y[t + 2, r] = a2
        y[t + 3, r] = a3
        t += 4
    while t < t1:
        y[t, r] = _row1(wr, sr, br, xp, xs, t, bits, lw)
        t += 1


@njit(parallel=True, fastmath=_FM, **_JIT)
def _rows_par(w, scales, biases, xp, xs, t0, t1, bits, lw, y):
    """y[t0:t1, r] for every row r of w, rows spread over the threads."""
    for r in prange(w.shape[0]):
        _row_tokens(w[r], scales[r], biases[r], xp, xs, t0, t1, bits, lw, y, r)


@njit(fastmath=_FM, **_JIT)
def _silu(v):
    # as kernels_ref: x / (1 + exp(-x)); exp overflow gives -0 for very negative x
    return v / (np.float32(1) + np.exp(-v))


@njit(parallel=True, fastmath=_FM, **_JIT)
def _gate_up_par(gw, gsc, gbi, uw, usc, ubi, xpg, xsg, xpu, xsu, t0, t1, gbits, ubits, lg, lu, h, u):
    """h[t0:t1] = silu(gate) * up: the gate row and the up row r are computed by the same thread in turn."""
    for r in prange(gw.shape[0]):
        _row_tokens(gw[r], gsc[r], gbi[r], xpg, xsg, t0, t1, gbits, lg, h, r)
        _row_tokens(uw[r], usc[r], ubi[r], xpu, xsu, t0, t1, ubits, lu, u, r)
        for t in range(t0, t1):
            h[t, r] = _silu(h[t, r]) * u[t, r]


@njit(parallel=True, **_JIT)
def _gate_up1_par(gw, gsc, gbi, uw, usc, ubi, xpg, xsg, xpu, xsu, t0, t1, gbits, ubits, lg, lu, h, u):
    """h[t0:t1] = silu(gate) * up token by token; a block of gate rows and the same up rows per task."""
    R = gw.shape[0]
    for b in prange((R + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        r0 = b * _ROWS_PER_TASK
        r1 = min(R, r0 + _ROWS_PER_TASK)
        qg = np.empty(gw.shape[1], np.float32)
        _rows1(gw, gsc, gbi, r0, r1, xpg, xsg, t0, t1, gbits, lg, qg, h)
        qu = qg if uw.shape[1] == gw.shape[1] else np.empty(uw.shape[1], np.float32)
        _rows1(uw, usc, ubi, r0, r1, xpu, xsu, t0, t1, ubits, lu, qu, u)
        for r in range(r0, r1):
            for t in range(t0, t1):
                h[t, r] = _silu(h[t, r]) * u[t, r]


@njit(fastmath=_FM, **_JIT)
def _prepped(x, bits, gs, pre):
    """(xp [T, per, nw], xs [T, ng]) for x [T, in]: see _prep_x."""
    T, n = x.shape
    per = 32 // bits
    xp = np.empty((T, per, n // per), np.float32)
    xs = np.empty((T, n // gs), np.float32)
    _prep_x(x, bits, gs, pre, xp, xs)
    return xp, xs


# Integer dot products (kernels_intdot): 32 (default with AVX2: two 16-bit integers per input, float-grade),
# 16 / 8 (int16 / int8 activations: faster, beyond the mlx-lm parity tolerance), 0 = the float kernels.
# Read at import from the environment (kernels_intdot.default_mode); assign to change it at run time.
INT_DOT_MODE = _KI.default_mode()
DOT_MODES = {"float": 0, "int16x2": 32, "int16": 16, "int8": 8}  # `moepack run --dot NAME`


def set_dot_mode(name: str) -> None:
    """Choose the matvec arithmetic by name (DOT_MODES): 'int16x2' is as accurate as 'float'; 'int16' and
    'int8' are faster and move the logits beyond the mlx-lm parity tolerance (see kernels_intdot)."""
    global INT_DOT_MODE
    if name not in DOT_MODES:
        raise ShapeError(f"unknown dot mode {name!r}: one of {', '.join(DOT_MODES)}")
    INT_DOT_MODE = DOT_MODES[name]


def dot_mode_name() -> str:
    """The arithmetic 2/4-bit matvecs use now (the stats report it)."""
    return {v: k for k, v in DOT_MODES.items()}.get(INT_DOT_MODE, str(INT_DOT_MODE))


def _int_mode(T: int, in_dim: int, bits: int, gs: int) -> int:
    """Mode of the integer path for this projection, 0 for the float kernels. When switched on it takes every
    projection it supports, at any T: measured faster than the float kernels everywhere (paired medians,
    1-2 threads, int16 = mode 16: T=1 [1024 x 4096] 4-bit x1.7-2.2, int8 x1.9-2.5, 2-bit x1.8-2.3 / x2.2-3.0;
    [4096 x 1024] x1.4-2.3; T=4 [4096 x 1024] x1.1-1.4; T=16 x1.3-1.9; mode 32 expert FFN T=1 4-bit x1.3-1.4,
    2-bit x1.6-1.7). 8-bit weights: mode 16 only (see kernels_intdot.supports), measured T=1 x1.6-2.1.
    Except mode 32 at T >= 4 with inputs <= _ROW4_MAX_IN: there the float 4-token row kernel is faster
    ([4096 x 1024] T=4 x0.79-0.89 for mode 32, T=16 x0.96-0.99, T=64 x0.90-1.0), so it keeps that."""
    mode = INT_DOT_MODE
    if not mode:
        return 0
    if bits == 8 and mode == 8:
        mode = 16  # 8-bit activations would saturate vpmaddubsw against 8-bit codes
    if mode == 32 and not _one_by_one(T, in_dim, bits):
        return 0
    return mode if _KI.supports(bits, gs, in_dim, mode) else 0


# The drivers below are plain Python on purpose: numba optimises every jitted function together with the
# callees linked into it, so each jitted caller of the (large) row code pays its compile time again. Kept
# in Python, the row code is linked into two kernels only (_rows_par, _gate_up_par); a call costs ~1-2 us.


def _qmm(x, w, scales, biases, bits, gs, y):
    """y [T, out] = x [T, in] @ dequant(w).T for bits 2, 4, 8, one L2-sized tile of tokens at a time."""
    T, n = x.shape
    mode = _int_mode(T, n, bits, gs)
    if mode:
        _KI.qmm(x, w, scales, biases, bits, gs, mode, y)
        return
    lw = _log2(gs * bits // 32)
    one = _one_by_one(T, n, bits)
    xp, xs = _prepped(x, bits, gs, one)
    tt = _token_tile(n)
    for t0 in range(0, T, tt):
        if one:
            _rows1_par(w, scales, biases, xp, xs, t0, min(T, t0 + tt), bits, lw, y)
        else:
            _rows_par(w, scales, biases, xp, xs, t0, min(T, t0 + tt), bits, lw, y)


def _ffn(x, gw, gsc, gbi, uw, usc, ubi, dw, dsc, dbi, gbits, ubits, dbits, gs, y):
    """y [T, D] = down(silu(gate(x)) * up(x))."""
    T, D = x.shape
    I = gw.shape[0]
    gm, um = _int_mode(T, D, gbits, gs), _int_mode(T, D, ubits, gs)
    if gm and um:
        _ffn_int(x, gw, gsc, gbi, uw, usc, ubi, dw, dsc, dbi, gbits, ubits, dbits, gs, gm, um, y)
        return
    one = _one_by_one(T, D, gbits, ubits)
    xpg, xsg = _prepped(x, gbits, gs, one)
    xpu, xsu = (xpg, xsg) if ubits == gbits else _prepped(x, ubits, gs, one)
    lg, lu = _log2(gs * gbits // 32), _log2(gs * ubits // 32)
    h = np.empty((T, I), np.float32)  # gate, then silu(gate) * up
    u = np.empty((T, I), np.float32)
    tt = _token_tile(D)
    for t0 in range(0, T, tt):
        par = _gate_up1_par if one else _gate_up_par
        par(gw, gsc, gbi, uw, usc, ubi, xpg, xsg, xpu, xsu, t0, min(T, t0 + tt), gbits, ubits, lg, lu, h, u)
    _qmm(_ro(h), dw, dsc, dbi, dbits, gs, y)


def _ffn_int(x, gw, gsc, gbi, uw, usc, ubi, dw, dsc, dbi, gbits, ubits, dbits, gs, gm, um, y):
    """_ffn with gate and up through the integer path (x quantized once per bit width); down picks its own."""
    T, D = x.shape
    I = gw.shape[0]
    xg = _KI.prepped(x, gbits, gs, gm)
    xu = xg if (ubits, um) == (gbits, gm) else _KI.prepped(x, ubits, gs, um)
    gG2, uG2 = _KI.geometry(gbits, gs, gm)[1], _KI.geometry(ubits, gs, um)[1]
    h = np.empty((T, I), np.float32)  # gate, then silu(gate) * up
    u = np.empty((T, I), np.float32)
    tt = _KI.token_tile(D)
    gw8, uw8 = gw.view(np.uint8), uw.view(np.uint8)
    for t0 in range(0, T, tt):
        _KI.gate_up_par(gw8, gsc, gbi, uw8, usc, ubi, xg, xu, t0, min(T, t0 + tt), gbits, ubits, gs,
                        gG2, uG2, h, u)
    _qmm(_ro(h), dw, dsc, dbi, dbits, gs, y)


def _one_by_one(T: int, in_dim: int, *bits: int) -> bool:
    """Use the token-by-token kernels (mask only, x pre-scaled)? For bits 2 and 4: always for T < 4; for more
    tokens the 4-token row kernel (each word decoded once per 4 tokens) wins only while 4 tokens of xp fit in
    L1 (in <= 1024): measured at 4096 inputs 1.2-1.5x slower than token by token, at 1024 inputs 1.6x faster.
    Not for 8 bits (4 codes per word: the row kernel measured 1.1-1.4x faster at T=1)."""
    return 8 not in bits and (T < 4 or in_dim > _ROW4_MAX_IN)


def _token_tile(in_dim: int) -> int:
    return max(4, (_XTILE_BYTES // (4 * max(1, in_dim))) // 4 * 4)


def _qmatmul_fallback(x, w, scales, biases, bits, gs):
    """3-bit (codes straddle words): dequantize a chunk of rows at a time, then a BLAS matmul."""
    from ..quant.affine_fast import dequantize

    out = w.shape[0]
    y = np.empty((x.shape[0], out), dtype=np.float32)
    rows = max(1, _DEQUANT_CHUNK // max(1, x.shape[1]))
    for o0 in range(0, out, rows):
        o1 = min(out, o0 + rows)
        y[:, o0:o1] = x @ dequantize(w[o0:o1], scales[o0:o1], biases[o0:o1], bits, gs).T
    return y


def qmatmul(x, w, scales, biases, bits, group_size) -> np.ndarray:
    """y = x @ dequant(W).T.

    x: f32 [T, in]; w: uint32 [out, in*bits/32]; scales, biases: bf16 [out, in/gs]  ->  y: f32 [T, out]
    """
    x = _act(x, "qmatmul: x", 2)
    bits = check_bits(bits)
    gs = check_group_size(group_size)
    w, scales, biases = _qtensor(w, scales, biases, bits, gs, x.shape[1], "qmatmul")
    if bits == 3:
        return _qmatmul_fallback(x, w, scales, biases, bits, gs)
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    if y.size:
        _qmm(x, w, scales, biases, bits, gs, y)
    return y


def expert_ffn(x, gw, gs_, gb, uw, us, ub, dw, ds, db, bits, group_size) -> np.ndarray:
    """One SwiGLU expert: down(silu(gate(x)) * up(x)).

    x: f32 [T, D]; gate/up: uint32 [I, D*b/32] + bf16 [I, D/gs]; down: uint32 [D, I*b/32] + bf16 [D, I/gs];
    bits: (gate_bits, up_bits, down_bits) (an int means all three); group_size: one int for all three.
    -> f32 [T, D]
    """
    x = _act(x, "expert_ffn: x", 2)
    if np.isscalar(bits):
        bits = (bits, bits, bits)
    if len(bits) != 3:
        raise ShapeError(f"expert_ffn: bits must be an int or (gate, up, down), got {bits!r}")
    gbits, ubits, dbits = (check_bits(b) for b in bits)
    gs = check_group_size(group_size)
    T, D = x.shape
    gw, gs_, gb = _qtensor(gw, gs_, gb, gbits, gs, D, "expert_ffn: gate")
    I = gw.shape[0]
    uw, us, ub = _qtensor(uw, us, ub, ubits, gs, D, "expert_ffn: up")
    dw, ds, db = _qtensor(dw, ds, db, dbits, gs, I, "expert_ffn: down")
    if uw.shape[0] != I:
        raise ShapeError(f"expert_ffn: gate has {I} outputs but up has {uw.shape[0]}")
    if dw.shape[0] != D:
        raise ShapeError(f"expert_ffn: down has {dw.shape[0]} outputs, expected the hidden size {D}")
    if 3 in (gbits, ubits, dbits):
        g = qmatmul(x, gw, gs_, gb, gbits, gs)
        u = qmatmul(x, uw, us, ub, ubits, gs)
        return qmatmul(_silu_arr(g) * u, dw, ds, db, dbits, gs)
    y = np.empty((T, D), dtype=np.float32)
    if T and D and I:
        _ffn(x, gw, gs_, gb, uw, us, ub, dw, ds, db, gbits, ubits, dbits, gs, y)
    elif T and D:
        y[:] = 0
    return y


def _silu_arr(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return v / (np.float32(1) + np.exp(-v))


# ================================================================================ embedding


@njit(**_JIT)
def _qembed(ids, w, scales, biases, bits, gs, y):
    """y[t] = dequant(row ids[t]): w = scale * q + bias in float32 (a multiply and an add, no fma)."""
    T, n = y.shape
    mask = (np.int64(1) << bits) - 1
    for t in range(T):
        r = ids[t]
        acc = np.int64(0)  # little-end-first bit stream of the row
        have = 0
        wi = 0
        for i in range(n):
            if have < bits:
                acc |= np.int64(w[r, wi]) << have
                wi += 1
                have += 32
            q = np.float32(acc & mask)
            acc >>= bits
            have -= bits
            g = i // gs
            y[t, i] = _bf(scales[r, g]) * q + _bf(biases[r, g])


def qembedding(ids, w, scales, biases, bits, group_size) -> np.ndarray:
    """Rows `ids` of a quantized embedding table, dequantized.

    ids: int [T]; w: uint32 [V, D*bits/32]; scales, biases: bf16 [V, D/gs]  ->  f32 [T, D]
    """
    ids = _ro(np.ascontiguousarray(ids, dtype=np.int64))
    if ids.ndim != 1:
        raise ShapeError(f"qembedding: ids must be 1-D [T], got shape {ids.shape}")
    bits = check_bits(bits)
    gs = check_group_size(group_size)
    w = np.asarray(w)
    if w.ndim != 2:
        raise ShapeError(f"qembedding: packed table must have shape [V, words], got {np.shape(w)}")
    D = w.shape[1] * 32 // bits
    w, scales, biases = _qtensor(w, scales, biases, bits, gs, D, "qembedding")
    V = w.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        bad = int(ids[(ids < 0) | (ids >= V)][0])
        raise ShapeError(f"qembedding: token id {bad} is outside the vocabulary [0, {V})",
                         hint="the tokenizer does not match the model")
    y = np.empty((ids.shape[0], D), dtype=np.float32)
    _qembed(ids, w, scales, biases, bits, gs, y)
    return y


# ================================================================================ norms


@njit(fastmath=_FM_NOFMA, **_JIT)
def _sumsq64(v):
    """sum(v^2) accumulated in float64 (vectorised; the order does not matter at this precision)."""
    ss = 0.0
    for i in range(v.shape[0]):
        f = np.float64(v[i])
        ss += f * f
    return ss


@njit(**_JIT)
def _rmsnorm_rows(x, weight, eps, y):
    """x, y [N, D]: y = (x * (1 / sqrt(mean(x^2) + eps))) * weight, mean accumulated in float64."""
    N, D = x.shape
    for r in range(N):
        ms = np.float32(_sumsq64(x[r]) / D)
        inv = np.float32(1) / np.sqrt(ms + eps)
        for i in range(D):
            y[r, i] = (x[r, i] * inv) * weight[i]


@njit(**_JIT)
def _gated_rmsnorm_rows(x, z, weight, eps, y):
    """As _rmsnorm_rows, then times silu(z) (z / (1 + exp(-z)))."""
    N, D = x.shape
    for r in range(N):
        ms = np.float32(_sumsq64(x[r]) / D)
        inv = np.float32(1) / np.sqrt(ms + eps)
        for i in range(D):
            zi = z[r, i]
            y[r, i] = ((x[r, i] * inv) * weight[i]) * (zi / (np.float32(1) + np.exp(-zi)))


def _norm_weight(weight, D: int, name: str) -> np.ndarray:
    weight = _act(weight, f"{name}: weight", 1)
    if weight.shape[0] != D:
        raise ShapeError(f"{name}: weight has {weight.shape[0]} values, the normalised axis has {D}")
    return weight


def rmsnorm(x, weight, eps) -> np.ndarray:
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last axis.

    x: f32 [T, D] (any leading dims); weight: f32 [D]  ->  f32 [T, D]
    """
    x = _act(x, "rmsnorm: x")
    if x.ndim < 1:
        raise ShapeError("rmsnorm: x must have at least one axis")
    D = x.shape[-1]
    weight = _norm_weight(weight, D, "rmsnorm")
    y = np.empty_like(x)
    if x.size:
        _rmsnorm_rows(x.reshape(-1, D), weight, np.float32(eps), y.reshape(-1, D))
    return y


def gated_rmsnorm(x, z, weight, eps) -> np.ndarray:
    """Qwen3-Next's RMSNormGated: rmsnorm over dv, times weight, times silu(z).

    x, z: f32 [T, H, dv]; weight: f32 [dv]  ->  f32 [T, H, dv]
    """
    x = _act(x, "gated_rmsnorm: x")
    z = _act(z, "gated_rmsnorm: z")
    if x.ndim < 1 or z.shape != x.shape:
        raise ShapeError(f"gated_rmsnorm: x {x.shape} and z {z.shape} must have the same shape")
    D = x.shape[-1]
    weight = _norm_weight(weight, D, "gated_rmsnorm")
    y = np.empty_like(x)
    if x.size:
        _gated_rmsnorm_rows(x.reshape(-1, D), z.reshape(-1, D), weight, np.float32(eps), y.reshape(-1, D))
    return y


# ================================================================================ RoPE and attention


@njit(**_JIT)
def _rope(x, pos, inv_freq, y):
    """Rotate pairs (i, i + half) of x [T, H, hd] by pos[t] * inv_freq[i]; dims from 2*half on are copied."""
    T, H, hd = x.shape
    half = inv_freq.shape[0]
    for t in range(T):
        for i in range(half):
            theta = pos[t] * inv_freq[i]  # float32, as the reference
            c = np.cos(theta)
            s = np.sin(theta)
            for h in range(H):
                x1 = x[t, h, i]
                x2 = x[t, h, i + half]
                y[t, h, i] = x1 * c - x2 * s
                y[t, h, i + half] = x1 * s + x2 * c
        for h in range(H):
            for i in range(2 * half, hd):
                y[t, h, i] = x[t, h, i]


def rope(x, positions, rotary_dim, base) -> np.ndarray:
    """Rotary embedding, non-interleaved ("rotate half") on the first rotary_dim dims of each head.

    x: f32 [T, H, hd]; positions: [T] (int or float)  ->  f32 [T, H, hd]
    """
    x = _act(x, "rope: x", 3)
    T, H, hd = x.shape
    pos = _ro(np.ascontiguousarray(positions, dtype=np.float32))
    rotary_dim = check_rope(x.shape, pos, rotary_dim)
    half = rotary_dim // 2
    # the reference's expression, evaluated by numpy, so both backends turn by the same float32 angles
    inv_freq = np.exp(np.arange(half, dtype=np.float32) * np.float32(-np.log(base) / max(half, 1)))
    y = np.empty_like(x)
    if x.size:
        _rope(x, pos, _ro(inv_freq.astype(np.float32)), y)
    return y


@njit(fastmath=_FM, **_JIT)
def _dot(a, b):
    s = np.float32(0)
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@njit(parallel=True, **_JIT)
def _attention(q, k, v, pos, scale, hb, out):
    """Causal GQA. One task = (token, kv head, block of hb query heads of that kv head): each key and value
    row is read once per task and used by all hb heads while it is in L1."""
    T, Hq, hd = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    nb = (rep + hb - 1) // hb
    for task in prange(T * Hkv * nb):
        t = task // (Hkv * nb)
        hk = (task // nb) % Hkv
        h0 = hk * rep + (task % nb) * hb
        nh = min(hb, hk * rep + rep - h0)
        n = pos[t] + 1  # keys 0..pos visible
        qs = np.empty((nh, hd), np.float32)
        for i in range(nh):
            for d in range(hd):
                qs[i, d] = q[t, h0 + i, d] * scale
        sc = np.empty((nh, n), np.float32)
        for j in range(n):
            kj = k[j, hk]
            for i in range(nh):
                sc[i, j] = _dot(qs[i], kj)
        for i in range(nh):
            m = sc[i, 0]
            for j in range(1, n):
                m = max(m, sc[i, j])
            l = np.float32(0)
            for j in range(n):
                e = np.exp(sc[i, j] - m)
                sc[i, j] = e
                l += e
            for j in range(n):
                sc[i, j] = sc[i, j] / l
        o = np.zeros((nh, hd), np.float32)
        for j in range(n):
            vj = v[j, hk]
            for i in range(nh):
                p = sc[i, j]
                oi = o[i]
                for d in range(hd):
                    oi[d] += p * vj[d]
        for i in range(nh):
            for d in range(hd):
                out[t, h0 + i, d] = o[i, d]


def attention(q, k, v, q_positions, scale) -> np.ndarray:
    """Causal grouped-query attention over the whole cache.

    q: f32 [T, Hq, hd]; k, v: f32 [S, Hkv, hd] (key j has position j); q_positions: int [T], each < S;
    query at position p sees keys 0..p; query head h reads kv head h // (Hq / Hkv).  ->  f32 [T, Hq, hd]
    """
    q = _act(q, "attention: q", 3)
    k = _act(k, "attention: k", 3)
    v = _act(v, "attention: v", 3)
    pos = _ro(np.ascontiguousarray(q_positions, dtype=np.int64))
    T, Hq, hd, S, Hkv = check_attention(q, k, v, pos)
    out = np.empty_like(q)
    if q.size:
        rep = Hq // Hkv
        # heads per task: up to 8 share each K/V row read, but leave at least two tasks per thread
        hb = max(1, min(8, rep, (T * Hq) // (2 * numba.get_num_threads())))
        _attention(q, k, v, pos, np.float32(scale), hb, out)
    return out


# ================================================================================ linear attention


@njit(**_JIT)
def _conv1d(x, state, weight, y, new_state):
    """y[t, c] = silu(sum_j weight[c, j] * inp[t + j, c]), inp = [state; x]; summed j = 0.. as the reference."""
    T, C = x.shape
    Kc = weight.shape[1]
    P = Kc - 1
    wt = np.ascontiguousarray(weight.T)  # [Kc, C]: tap j of every channel contiguous
    for t in range(T):
        yt = y[t]
        yt[:] = 0
        for j in range(Kc):
            s = t + j  # row of inp
            src = state[s] if s < P else x[s - P]
            wj = wt[j]
            for c in range(C):
                yt[c] += src[c] * wj[c]
        for c in range(C):
            a = yt[c]
            yt[c] = a / (np.float32(1) + np.exp(-a))
    for r in range(P):
        s = T + r  # the last P rows of inp
        for c in range(C):
            new_state[r, c] = state[s, c] if s < P else x[s - P, c]


def conv1d_step(x, state, weight):
    """Depthwise causal conv over time, then SiLU.

    x: f32 [T, C]; state: f32 [Kc-1, C]; weight: f32 [C, Kc]  ->  (y f32 [T, C], new_state f32 [Kc-1, C])
    """
    x = _act(x, "conv1d_step: x", 2)
    weight = _act(weight, "conv1d_step: weight", 2)
    state = _act(state, "conv1d_step: state", 2)
    T, C = x.shape
    Kc = weight.shape[1]
    if weight.shape[0] != C or Kc < 1:
        raise ShapeError(f"conv1d_step: weight has shape {weight.shape}, expected [{C}, Kc]")
    if state.shape != (Kc - 1, C):
        raise ShapeError(f"conv1d_step: state has shape {state.shape}, expected ({Kc - 1}, {C})")
    y = np.empty_like(x)
    new_state = np.empty_like(state)
    _conv1d(x, state, weight, y, new_state)
    return y, new_state


@njit(parallel=True, fastmath=_FM_NOFMA, **_JIT)
def _gated_delta(q, k, v, g, beta, state, out, new_state):
    """One task per state row (value head h, value dim i): the row [dk] stays in L1 over all T tokens."""
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    dv = v.shape[2]
    rep = Hv // Hk
    for task in prange(Hv * dv):
        h = task // dv
        i = task % dv
        hk = h // rep
        row = new_state[h, i]
        src = state[h, i]
        for d in range(dk):
            row[d] = src[d]
        for t in range(T):
            gt = g[t, h]
            kt = k[t, hk]
            kv = np.float32(0)
            for d in range(dk):
                sd = row[d] * gt
                row[d] = sd
                kv += sd * kt[d]
            delta = (v[t, h, i] - kv) * beta[t, h]
            qt = q[t, hk]
            o = np.float32(0)
            for d in range(dk):
                sd = row[d] + kt[d] * delta
                row[d] = sd
                o += sd * qt[d]
            out[t, h, i] = o


def gated_delta(q, k, v, g, beta, state):
    """The gated delta rule, one token at a time (mlx-lm's ``gated_delta_ops``).

    q, k: f32 [T, Hk, dk]; v: f32 [T, Hv, dv]; g, beta: f32 [T, Hv]; state: f32 [Hv, dv, dk]
    -> (out f32 [T, Hv, dv], new_state f32 [Hv, dv, dk])
    per token:  S = g * S;  delta = (v - S @ k) * beta;  S = S + delta k^T;  out = S @ q
    """
    q = _act(q, "gated_delta: q", 3)
    k = _act(k, "gated_delta: k", 3)
    v = _act(v, "gated_delta: v", 3)
    g = _act(g, "gated_delta: g", 2)
    beta = _act(beta, "gated_delta: beta", 2)
    state = _act(state, "gated_delta: state", 3)
    T, Hk, dk, Hv, dv = check_gated_delta(q, k, v, g, beta)
    if state.shape != (Hv, dv, dk):
        raise ShapeError(f"gated_delta: state has shape {state.shape}, expected ({Hv}, {dv}, {dk})")
    out = np.empty((T, Hv, dv), dtype=np.float32)
    new_state = np.empty_like(state)
    if state.size:
        _gated_delta(q, k, v, g, beta, state, out, new_state)
    else:
        out[:] = 0
    return out, new_state


# ================================================================================ routing


@njit(**_JIT)
def _router(logits, k, norm, idx, wts):
    T, E = logits.shape
    p = np.empty(E, np.float32)
    for t in range(T):
        m = logits[t, 0]
        for e in range(1, E):
            m = max(m, logits[t, e])
        s = np.float32(0)
        for e in range(E):
            pe = np.exp(logits[t, e] - m)
            p[e] = pe
            s += pe
        for e in range(E):
            p[e] = p[e] / s
        # insertion into a descending list of k; a later expert must be strictly larger to move ahead,
        # so ties keep the lower index first (as a stable argsort of -p)
        n = 0
        for e in range(E):
            pe = p[e]
            if n == k and not pe > wts[t, k - 1]:
                continue
            pos = n if n < k else k - 1
            while pos > 0 and pe > wts[t, pos - 1]:
                wts[t, pos] = wts[t, pos - 1]
                idx[t, pos] = idx[t, pos - 1]
                pos -= 1
            wts[t, pos] = pe
            idx[t, pos] = e
            if n < k:
                n += 1
        if norm:
            tot = np.float32(0)
            for i in range(k):
                tot += wts[t, i]
            for i in range(k):
                wts[t, i] = wts[t, i] / tot


def router_topk(logits, k, norm_topk_prob):
    """Softmax over all experts (float32), keep the k largest, renormalise if asked.

    logits: f32 [T, E]  ->  (idx int32 [T, k], weights f32 [T, k]), highest probability first; ties go to
    the lower expert index.
    """
    logits = _act(logits, "router_topk: logits", 2)
    T, E = logits.shape
    k = check_router_k(k, E)
    idx = np.empty((T, k), dtype=np.int32)
    wts = np.empty((T, k), dtype=np.float32)
    if T:
        _router(logits, k, bool(norm_topk_prob), idx, wts)
    return idx, wts

"""Integer dot products for quantized matmuls: activations quantized per group, codes times ints in int32.

Used by ``kernels_numba.qmatmul`` / ``expert_ffn`` (see ``kernels_numba._int_mode``) in one of three modes:
  * 32 (the default where AVX2 is there): x split into two 16-bit integers per input, xq and the rounded
    residual xl (x ~= sx * (xq + xl / 65534), ~2^-31 of the group's max|x|): as accurate as the float
    kernels, faster by x1.28 (4-bit) / x1.65 (2-bit) on an expert FFN at T=1 on 2 threads.
  * 16 (``MOEPACK_INT_DOT=16``): xq alone, x1.67 / x2.06, error ~1e-5..6e-5 of max|y|: beyond the mlx-lm
    parity tolerance end to end, opt-in.
  * 8 (``MOEPACK_INT8_DOT=1``): 8-bit xq (llama.cpp's Q8 activations), x1.96 / x2.49, ~1e-2: opt-in.
``MOEPACK_INT_DOT=0`` (or ``kernels_numba.INT_DOT_MODE = 0``) gives the float kernels everywhere. The float
kernels spend ~3.25 instructions per 8 weights (and, int->float, fma per code); here the codes of a unit
meet integer activations in vpmaddwd (16-bit: 16 products per instruction) or vpmaddubsw (8-bit: 32), as
llama.cpp does: per 64 4-bit weights ~15 instructions (mode 16), ~23 (mode 32) or ~8 (mode 8).

Per token t and group g of gs inputs (sx_g = max|x_g| / qmax, xq = round(x / sx_g), xs_g = sum(x_g)):
    dot(W_row_g, x_g) = scale_g * sum_i q_i x_i + bias_g * xs_g
                     ~= scale_g * (sx_g * sum_i q_i xq_i + cg_g) + bias_g * xs_g
    cg_g = c * (xs_g - sx_g * sum_i xq_i),  c = (2^bits - 1) / 2
  (mode 32: xq_i + xl_i / 65534 for xq_i.) The cg_g term (computed once per call) is exactly c * sum(x_g)
  minus its quantized estimate, so the rounding error of xq meets the centred codes (q - c) rather than q:
  ~2x less error for free. sum_i q_i xq_i is exact in int32 (|q| <= 255, |xq| <= 32767, gs <= 128 < 2^31),
  and each lane's sum (8-16 products of 2/4-bit codes, < 2^24) converts to float32 exactly; with 8-bit
  codes it would not (8 * 255 * 32767 > 2^24), which is why 8-bit weights take mode 16 only.

Layout: the packed row is read as units of U bits (U = 16 for 16-bit activations: a unit holds 16/bits
codes, code k of unit m is (unit >> bits*k) & mask, no widening needed; U = 8 for 8-bit: vpmaddubsw takes
bytes). Stream k is the vector of code k of every unit of a block of G2 groups (G2 > 1 where a group alone
fills less than a vector: 2-bit, or group 32); x is permuted once per call so that stream k meets a
contiguous run of xq. vpmaddwd / vpmaddubsw sum adjacent lanes, which belong to the same group, so each
block leaves 8 int32 lanes, Lg per group; they are converted to float and multiplied by scale_g * sx_g in
registers (one fma per block), with one horizontal sum per row. sum_g scale_g * cg_g + bias_g * xs_g is
a separate vectorised pass over the groups.

The vector code is LLVM IR written here (``_growdot``, a numba intrinsic): on x86 with AVX2 it calls
vpmaddwd / vpmaddubsw directly; elsewhere it is plain vector IR (multiply, add adjacent lanes) that LLVM
lowers for the target (tested for correctness with NUMBA_CPU_NAME=generic, speed not measured there; the
default there is the float kernels).

Numerics (tests/test_kernels_intdot.py holds each mode to a bound derived from its rounding):
  * mode 32: ~5e-7 of max|y| per matvec, ~1e-6 per expert FFN (float kernels ~6e-7). End to end on the tiny
    parity checkpoints (4 layers, mlx-lm float32 as the reference, prefill + 8 decode steps, 4- and 2-bit):
    max logit difference <= 1.9e-5 of max|logit| (float kernels: <= 1.6e-5; tolerance 1e-4), greedy tokens
    identical. Groups whose max|x| is below ~1e-33 (max|x| / 32767 subnormal) would lose relative precision
    (float kernels: ~1e-30).
  * mode 16: one 397B-shaped matvec with Gaussian x ~1.3e-5 of max|y|; one expert FFN ~6e-5 (the down
    projection's input silu(gate) * up is heavy-tailed). End to end: 4e-4 .. 8.6e-4 of max|logit| for
    qwen3_5_moe / qwen3_next, 3.4e-5 for qwen3_moe: beyond the tolerance. (Per-8-input activation scales
    would gain only 1.5-2x on the activations captured from those runs.)
  * mode 8 (2/4-bit weights only; 8-bit weights get mode 16): ~6e-3 of max|y| per matvec, ~1.5e-2 per expert
    FFN; end to end the logits move by 1e-2 .. 1.8 x max|logit| and greedy tokens change on the hybrids.
"""

from __future__ import annotations

import os

import llvmlite.binding as llb
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

_JIT = dict(cache=True, nogil=True, error_model="numpy")
_FM = {"reassoc", "contract"}

# numba compiles for the host CPU unless NUMBA_CPU_NAME says otherwise (then only the generic vector IR)
def _host_has_avx2() -> bool:
    try:  # LLVM cannot list the features of every host (it raises RuntimeError there): then no AVX2 path
        return bool(llb.get_host_cpu_features().get("avx2", False))
    except RuntimeError:
        return False


X86_AVX2 = numba.config.CPU_NAME in (None, "host") and _host_has_avx2()

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
QMAX = {32: 32767, 16: 32767, 8: 127}
LO_SCALE = 65534  # mode 32: x ~= sx * (xq + xl / LO_SCALE), xl the rounded residual, |xl| <= 32767
GROUP_SIZES = (32, 64, 128)


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def default_mode() -> int:
    """The integer path's mode from the environment: MOEPACK_INT8_DOT=1 -> 8; MOEPACK_INT_DOT=16 -> 16;
    MOEPACK_INT_DOT=0 (off, false, no) -> 0, the float kernels; MOEPACK_INT_DOT=1 (32, on) -> 32; unset ->
    32 where AVX2 is there (measured), else 0."""
    if _env_flag("MOEPACK_INT8_DOT", False):
        return 8
    v = os.environ.get("MOEPACK_INT_DOT", "").strip().lower()
    if v == "16":
        return 16
    if v == "":
        return 32 if X86_AVX2 else 0
    return 32 if _env_flag("MOEPACK_INT_DOT", False) else 0


def geometry(bits: int, gs: int, mode: int) -> tuple[int, int, int, int]:
    """(U, G2, Lv, Lg): unit bits, groups per block, vector lanes per stream, int32 partial sums per group."""
    wide = mode != 8  # 16-bit activations (mode 32: two of them)
    U = 16 if wide else 8
    nu = gs * bits // U  # units per group
    W = 16 if wide else 32  # lanes of one AVX2 vpmaddwd / vpmaddubsw
    G2 = max(1, W // nu)
    Lv = G2 * nu
    lanes = Lv // 2 if wide else Lv // 4
    if G2 == 1:
        lanes = min(lanes, 8)  # folded
    return U, G2, Lv, lanes // G2


def supports(bits: int, gs: int, in_dim: int, mode: int) -> bool:
    """Can the integer path take this projection? (8-bit codes only with 16-bit activations: vpmaddubsw
    would saturate; 3-bit codes straddle units.)"""
    if mode not in (8, 16, 32) or bits not in (2, 4, 8) or gs not in GROUP_SIZES:
        return False
    if bits == 8 and mode != 16:
        # 8 bits: vpmaddubsw would saturate (mode 8); lane sums reach 8 * 255 * 32767 > 2^24, so their
        # conversion to float32 would round and the residuals of mode 32 would be lost in it
        return False
    _, G2, _, _ = geometry(bits, gs, mode)
    return in_dim % (gs * G2) == 0


# ================================================================================ LLVM IR of one block


def _vty(t, n):
    return ir.VectorType(t, n)


def _splat(t, n, v):
    return ir.Constant(_vty(t, n), [ir.Constant(t, v)] * n)


def _sel(b, v, lo, n):
    """lanes lo..lo+n-1 of v"""
    return b.shuffle_vector(v, v, ir.Constant(_vty(_I32, n), list(range(lo, lo + n))))


def _pairs(b, p, n):
    """p[0::2] + p[1::2]"""
    ev = b.shuffle_vector(p, p, ir.Constant(_vty(_I32, n // 2), list(range(0, n, 2))))
    od = b.shuffle_vector(p, p, ir.Constant(_vty(_I32, n // 2), list(range(1, n, 2))))
    return b.add(ev, od)


def _avx2_chunks(b, name, out_ty, in_ty, width, a, x, n):
    """The AVX2 pairwise multiply-add `name` (width input lanes -> width / 2 output lanes) over the width-lane
    chunks of a and x, the chunks' results added (where n > width: the lanes all belong to one group)."""
    fn = b.module.declare_intrinsic(name, fnty=ir.FunctionType(_vty(out_ty, width // 2), [_vty(in_ty, width)] * 2))
    r = None
    for c in range(0, n, width):
        p = b.call(fn, [_sel(b, a, c, width), _sel(b, x, c, width)])
        r = p if r is None else b.add(r, p)
    return r


def _madd_wd(b, a, x, n):
    """n int16 x n int16 -> int32 sums of adjacent products (vpmaddwd)."""
    if X86_AVX2 and n % 16 == 0:
        return _avx2_chunks(b, "llvm.x86.avx2.pmadd.wd", _I32, _I16, 16, a, x, n)
    return _pairs(b, b.mul(b.sext(a, _vty(_I32, n)), b.sext(x, _vty(_I32, n))), n)


def _madd_ubs(b, u, s, n):
    """n uint8 x n int8 -> int16 sums of adjacent products (vpmaddubsw; codes < 16 cannot saturate)."""
    if X86_AVX2 and n % 32 == 0:
        return _avx2_chunks(b, "llvm.x86.avx2.pmadd.ub.sw", _I16, _I8, 32, u, s, n)
    return _pairs(b, b.mul(b.zext(u, _vty(_I16, n)), b.sext(s, _vty(_I16, n))), n)


def _fold(b, acc, n_out):
    n = acc.type.count
    while n > n_out:  # G2 == 1: fold the halves
        acc = b.add(_sel(b, acc, 0, n // 2), _sel(b, acc, n // 2, n // 2))
        n //= 2
    return acc


def _block_ir(b, wp, xp, bits, gs, mode, xlp=None):
    """The int32 partial sums (a vector of G2 * Lg lanes, group by group) of one block; wp: i8* to the
    block's packed codes, xp: i16* / i8* to its permuted activations; xlp (mode 32): i16* to the residuals,
    whose partial sums come second: returns (sums, residual sums or None)."""
    U, G2, Lv, Lg = geometry(bits, gs, mode)
    ut = ir.IntType(U)
    v = b.load(b.bitcast(wp, _vty(ut, Lv).as_pointer()), align=1)
    xt = _I8 if mode == 8 else _I16
    acc = None
    lo = None
    for k in range(U // bits):
        c = v
        if k:
            c = b.lshr(c, _splat(ut, Lv, bits * k))
        if bits * (k + 1) < U:
            c = b.and_(c, _splat(ut, Lv, (1 << bits) - 1))
        xk = b.load(b.bitcast(b.gep(xp, [ir.Constant(_I64, k * Lv)]), _vty(xt, Lv).as_pointer()), align=1)
        p = _madd_ubs(b, c, xk, Lv) if mode == 8 else _madd_wd(b, c, xk, Lv)
        acc = p if acc is None else b.add(acc, p)
        if xlp is not None:
            xk = b.load(b.bitcast(b.gep(xlp, [ir.Constant(_I64, k * Lv)]), _vty(_I16, Lv).as_pointer()), align=1)
            p = _madd_wd(b, c, xk, Lv)
            lo = p if lo is None else b.add(lo, p)
    if mode == 8:
        acc = _madd_wd(b, acc, _splat(_I16, acc.type.count, 1), acc.type.count)
    return _fold(b, acc, G2 * Lg), (None if lo is None else _fold(b, lo, G2 * Lg))


@intrinsic(prefer_literal=True)
def _growdot(typingctx, wb, xq, sxs, nblk, bits, gs):
    """sum over the nblk blocks of the packed row wb (uint8 [nbytes]) of sxs[group] * (the int32 partial sums
    of _block_ir against xq): lanes converted to float and scaled in registers, one horizontal sum per row.
    sxs: float32 [ng], scale_g * sx_g. bits and gs must be literals."""
    if not (isinstance(bits, types.IntegerLiteral) and isinstance(gs, types.IntegerLiteral)):
        return None
    B, G = bits.literal_value, gs.literal_value
    split = xq.ndim == 2  # mode 32: xq [2, in], the quantized x then the residuals
    mode = 32 if split else (16 if xq.dtype == types.int16 else 8)
    if mode == 8 and B == 8:
        mode = 16  # unreachable (supports() refuses it); keeps the IR well-typed
    U, G2, Lv, Lg = geometry(B, G, mode)
    F = G2 * Lg  # lanes per block
    wstep, xstep = G2 * G * B // 8, G2 * G
    f32 = ir.FloatType()
    fv = _vty(f32, F)

    def codegen(context, builder, signature, args):
        wbv, xqv, sxv, nb = args[:4]
        nb = context.cast(builder, nb, signature.args[3], types.int64)
        wbase = context.make_array(signature.args[0])(context, builder, wbv).data
        xary = context.make_array(signature.args[1])(context, builder, xqv)
        xbase = xary.data
        if split:  # the residual row follows the quantized one (xq is C-contiguous [2, in])
            xlbase = builder.gep(xbase, [cgutils.unpack_tuple(builder, xary.shape)[1]])
        sbase = context.make_array(signature.args[2])(context, builder, sxv).data
        accp = cgutils.alloca_once_value(builder, ir.Constant(fv, None))
        with cgutils.for_range(builder, nb) as loop:
            blk = loop.index
            wp = builder.gep(wbase, [builder.mul(blk, ir.Constant(_I64, wstep))])
            xp = builder.gep(xbase, [builder.mul(blk, ir.Constant(_I64, xstep))])
            xo = builder.mul(blk, ir.Constant(_I64, xstep))
            lanes, lo = _block_ir(builder, wp, xp, B, G, mode, builder.gep(xlbase, [xo]) if split else None)
            f = builder.sitofp(lanes, fv)
            if split:
                flo = builder.fmul(builder.sitofp(lo, fv), ir.Constant(fv, [ir.Constant(f32, 1.0 / LO_SCALE)] * F))
                f = builder.fadd(f, flo)
            sp = builder.gep(sbase, [builder.mul(blk, ir.Constant(_I64, G2))])
            sg = builder.load(builder.bitcast(sp, _vty(f32, G2).as_pointer()), align=4)
            sv = builder.shuffle_vector(sg, sg, ir.Constant(_vty(_I32, F), [lane // Lg for lane in range(F)]))
            acc = builder.fadd(builder.load(accp), builder.fmul(f, sv, flags=("contract",)), flags=("contract",))
            builder.store(acc, accp)
        acc = builder.load(accp)
        tot = builder.extract_element(acc, ir.Constant(_I32, 0))
        for lane in range(1, F):
            tot = builder.fadd(tot, builder.extract_element(acc, ir.Constant(_I32, lane)))
        return tot

    return types.float32(wb, xq, sxs, nblk, bits, gs), codegen


# ================================================================================ numba kernels


@njit(inline="always", **_JIT)
def _bf(u):
    return np.uint32(np.uint32(u) << np.uint32(16)).view(np.float32)


@njit(fastmath=_FM, **_JIT)
def prep_x(x, bits, gs, G2, Lv, qmax, split, xq, xl, sx, cg, xs):
    """Quantize x [T, in] per group into xq (permuted: code k of unit m of a block at k*Lv + m of the block),
    with sx, cg, xs [T, ng] as in the module docstring; if split, also the rounded residuals into xl (same
    layout): x ~= sx * (xq + xl / LO_SCALE)."""
    T, n = x.shape
    U = 16 if qmax > 127 else 8
    cpu = U // bits  # codes per unit
    nu = gs // cpu  # units per group
    center = np.float32((1 << bits) - 1) * np.float32(0.5)
    fq = np.float32(qmax)
    for t in range(T):
        xt = x[t]
        qt = xq[t]
        lt = xl[t]
        for g in range(n // gs):
            m = np.float32(0)
            s = np.float32(0)
            for i in range(g * gs, (g + 1) * gs):
                m = max(m, abs(xt[i]))
                s += xt[i]
            inv = fq / m if m > 0 else np.float32(0)
            d = m / fq
            o = (g // G2) * G2 * gs + (g % G2) * nu  # lane 0 of stream 0 of this group in its block
            qs = np.float32(0)  # exact: |sum| <= 128 * 32767 < 2^24
            ls = 0.0
            for k in range(cpu):
                for u in range(nu):
                    xi = xt[g * gs + u * cpu + k]
                    if split:  # in float64: |x / sx - q| <= 1/2 exactly, so the residual never clips
                        xd = np.float64(xi) / np.float64(d) if m > 0 else 0.0
                        q = min(max(np.rint(xd), -fq), fq)
                        lo = min(max(np.rint((xd - q) * LO_SCALE), -32767.0), 32767.0)
                        lt[o + k * Lv + u] = lo
                        ls += lo
                    else:
                        q = min(max(np.rint(xi * inv), -fq), fq)
                    qt[o + k * Lv + u] = q
                    qs += q
            sx[t, g] = d
            xs[t, g] = s
            cg[t, g] = center * np.float32(np.float64(s) - np.float64(d) * (np.float64(qs) + ls / LO_SCALE))


@njit(inline="always", **_JIT)
def _rowdot(wr8, xrow, sxs, nblk, bits, gs):
    # one branch per (bits, gs) so that _growdot gets literals
    if bits == 4:
        if gs == 64:
            return _growdot(wr8, xrow, sxs, nblk, 4, 64)
        elif gs == 32:
            return _growdot(wr8, xrow, sxs, nblk, 4, 32)
        return _growdot(wr8, xrow, sxs, nblk, 4, 128)
    elif bits == 2:
        if gs == 64:
            return _growdot(wr8, xrow, sxs, nblk, 2, 64)
        elif gs == 32:
            return _growdot(wr8, xrow, sxs, nblk, 2, 32)
        return _growdot(wr8, xrow, sxs, nblk, 2, 128)
    if gs == 64:
        return _growdot(wr8, xrow, sxs, nblk, 8, 64)
    elif gs == 32:
        return _growdot(wr8, xrow, sxs, nblk, 8, 32)
    return _growdot(wr8, xrow, sxs, nblk, 8, 128)


@njit(inline="always", **_JIT)
def _row_scales(sr, br, sxt, cgt, xst, sxs):
    """sxs[g] = scale_g * sx_g; returns sum_g scale_g * cg_g + bias_g * xs_g (vectorised across groups).
    Inlined: as a call it cost as much as the dot products of a 1024-wide row (measured 2x slower)."""
    c = np.float32(0)
    for g in range(sr.shape[0]):
        s = _bf(sr[g])
        sxs[g] = s * sxt[g]
        c += s * cgt[g] + _bf(br[g]) * xst[g]
    return c


@njit(fastmath=_FM, **_JIT)
def _rows(w8, sc, bi, r0, r1, xq, sx, cg, xs, t0, t1, bits, gs, G2, sxs, y):
    """y[t0:t1, r0:r1] token by token; the row stays in L1 meanwhile. sxs: scratch [ng]."""
    nblk = sc.shape[1] // G2
    for r in range(r0, r1):
        for t in range(t0, t1):
            c = _row_scales(sc[r], bi[r], sx[t], cg[t], xs[t], sxs)
            y[t, r] = _rowdot(w8[r], xq[t], sxs, nblk, bits, gs) + c


# Rows per parallel task (the scratch is allocated once per task).
_ROWS_PER_TASK = 16


@njit(parallel=True, **_JIT)
def rows_par(w8, sc, bi, xq, sx, cg, xs, t0, t1, bits, gs, G2, y):
    """y[t0:t1, r] = dot(row r, x[t]) for every row of w8 (uint8 view of the packed rows)."""
    R = w8.shape[0]
    for b in prange((R + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        r0 = b * _ROWS_PER_TASK
        sxs = np.empty(sc.shape[1], np.float32)
        _rows(w8, sc, bi, r0, min(R, r0 + _ROWS_PER_TASK), xq, sx, cg, xs, t0, t1, bits, gs, G2, sxs, y)


@njit(fastmath=_FM, **_JIT)
def _silu(v):
    return v / (np.float32(1) + np.exp(-v))


@njit(parallel=True, **_JIT)
def gate_up_par(gw8, gsc, gbi, uw8, usc, ubi, xg, xu, t0, t1, gbits, ubits, gs, gG2, uG2, h, u):
    """h[t0:t1] = silu(gate) * up; a block of gate rows and the same up rows per task. xg, xu: the
    (xq, sx, cg, xs) of x for the gate's and the up's bits (the same tuple when they agree)."""
    R = gw8.shape[0]
    for b in prange((R + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        r0 = b * _ROWS_PER_TASK
        r1 = min(R, r0 + _ROWS_PER_TASK)
        sxs = np.empty(gsc.shape[1], np.float32)
        _rows(gw8, gsc, gbi, r0, r1, xg[0], xg[1], xg[2], xg[3], t0, t1, gbits, gs, gG2, sxs, h)
        _rows(uw8, usc, ubi, r0, r1, xu[0], xu[1], xu[2], xu[3], t0, t1, ubits, gs, uG2, sxs, u)
        for r in range(r0, r1):
            for t in range(t0, t1):
                h[t, r] = _silu(h[t, r]) * u[t, r]


def prepped(x: np.ndarray, bits: int, gs: int, mode: int):
    """(xq, sx, cg, xs) of x [T, in] (float32, C-contiguous) for `bits`-bit weights."""
    T, n = x.shape
    _, G2, Lv, _ = geometry(bits, gs, mode)
    sx = np.empty((T, n // gs), np.float32)
    cg = np.empty_like(sx)
    xs = np.empty_like(sx)
    if mode == 32:
        xq = np.empty((T, 2, n), np.int16)  # [t, 0] quantized, [t, 1] residuals
        prep_x(x, bits, gs, G2, Lv, QMAX[mode], True, xq[:, 0], xq[:, 1], sx, cg, xs)
    else:
        xq = np.empty((T, n), np.int16 if mode == 16 else np.int8)
        prep_x(x, bits, gs, G2, Lv, QMAX[mode], False, xq, xq, sx, cg, xs)
    return xq, sx, cg, xs


# Tokens per call of the row kernels: one tile of xq (2 bytes per input) stays in L2.
_XTILE_BYTES = 1 << 18


def token_tile(in_dim: int) -> int:
    return max(4, _XTILE_BYTES // (2 * max(1, in_dim)))


def qmm(x, w, scales, biases, bits, gs, mode, y, xp=None):
    """y [T, out] = x [T, in] @ dequant(w).T through the integer path (the caller checked ``supports``);
    xp: the ``prepped`` x if the caller has it."""
    T, n = x.shape
    G2 = geometry(bits, gs, mode)[1]
    if xp is None:
        xp = prepped(x, bits, gs, mode)
    w8 = w.view(np.uint8)
    tt = token_tile(n)
    for t0 in range(0, T, tt):
        rows_par(w8, scales, biases, *xp, t0, min(T, t0 + tt), bits, gs, G2, y)

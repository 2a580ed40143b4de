"""Launch builders for `metal/quant.metal`: quantized matvec, fused gate/up + SwiGLU, embedding, MoE combine.

Each op has a `<op>_dispatch(...)` that checks its inputs and returns the Dispatch list (output arrays
allocated, or the caller's `out`), and a convenience `<op>(executor, ...)` that runs it and returns the
result. `qmatmul`, `expert_ffn` and `qembedding` take the arguments of the functions of the same names in
`moepack.runtime.kernels_ref` (the spec they are tested against), with the executor first. Routed experts
come as raw records (uint8, as pread reads them) plus their `RecordLayout`: `expert_ffn_record` takes one
record, or a batch [n, record_size] that runs as one pair of dispatches (grid.z = expert), whose output
[K, 1, D] for one decode token is `moe_combine`'s y.

Matvec geometry: `ksplit` simdgroups share each block of rows (a kernel parameter, chosen here per dispatch
by `choose_ksplit`), so one expert's small matrices still fill a large GPU and big ones stay unsplit.

Shape legend: T tokens, in/out a projection's input/output widths, D hidden, I expert intermediate,
K experts per token, V vocabulary, gs group size. bf16 arrays are uint16 bit patterns.

The geometry constants below mirror the `#define`s of quant.metal (the tests read the file and compare).
"""

from __future__ import annotations

import numpy as np

from ...errors import QuantizationError, ShapeError
from ...layout.record import RecordLayout
from ...quant.affine_ref import SUPPORTED_GROUP_SIZES
from .dispatch import Dispatch, Executor

SOURCE = "quant.metal"
KERNEL_BITS = (2, 4, 8)  # bit widths with kernels (3-bit codes straddle words: not on this backend)

QMV_SG = 8  # simdgroups per threadgroup
QMV_ROWS = 4  # output rows per simdgroup
QMV_VPT = 16  # inputs in 16 bytes of 8-bit codes: a lane reads min(QMV_VPT * 8 / bits, 32) inputs of a row a step
QMV_XCHUNK = 4096  # floats of x staged in threadgroup memory at a time
QEMB_TG = 64  # threads per threadgroup of qembed
QCOMB_TG = 256  # threads per threadgroup of moe_combine

KSPLITS = (1, 2, 4, 8)  # simdgroups that may share a block of rows (a kernel parameter)
# qmv / gate_up dispatches aim for at least this many threadgroups (row blocks x tokens x experts): measured on
# an H200 (132 SMs), one expert's 1024 x 4096 4-bit gate/up took 8.8 us with 4 simdgroups per row block (128
# groups) and 41.7 us with 1 (32 groups), while a batch of 10 experts or a 65536-row matrix ran fastest unsplit;
# with the 16-byte-per-lane kernels (benchmarks/gpu.py --only bandwidth, L2-cold, CUDA graph): 4096 x 4096 4-bit
# 9.9 us at ksplit 2 vs 12.3 at 1, 1024 x 4096 6.8-6.9 us at 4-8 vs 11.7 at 1, the 10-expert batch 60 us at 1
# vs 75 at 2, 65536 x 4096 84 us at 1 vs 101 at 2.
TARGET_GROUPS = 256
# ... but a matrix smaller than this many weights is not split: its time is launch latency on any GPU, and
# unsplit it costs the CPU emulator 8x fewer threads (tiny test models run whole through it).
SPLIT_MIN_WEIGHTS = 1 << 20
_U32 = 1 << 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------- checks


def _bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in KERNEL_BITS:
        raise QuantizationError(
            f"the Metal kernels take {KERNEL_BITS}-bit weights, not {bits!r}",
            hint="3-bit models run on the CPU backend (--backend cpu)" if bits == 3 else None,
        )
    return int(bits)


def _group_size(gs, in_dim: int, name: str) -> int:
    if isinstance(gs, bool) or not isinstance(gs, (int, np.integer)) or int(gs) not in SUPPORTED_GROUP_SIZES:
        raise QuantizationError(f"{name}: unsupported group size {gs!r}: expected one of {SUPPORTED_GROUP_SIZES}")
    if in_dim % int(gs):
        raise QuantizationError(f"{name}: group size {gs} does not divide the input width {in_dim}")
    return int(gs)


def _act(x, name: str, ndim: int = 2) -> np.ndarray:
    """A float activation as a C-contiguous float32 array (no copy when it already is one)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != ndim:
        raise ShapeError(f"{name} must be a {ndim}-D float array, got shape {x.shape}",
                         hint="see the shape legend of moepack.runtime.metal.ops_quant")
    return x


def _qtensor(w, scales, biases, bits: int, gs: int, in_dim: int, name: str):
    """One dense quantized matrix checked against its input width; returns contiguous (w, scales, biases)."""
    w, scales, biases = np.asarray(w), np.asarray(scales), np.asarray(biases)
    if w.dtype != np.uint32 or w.ndim != 2:
        raise ShapeError(f"{name}: packed weights must be uint32 [out, words], got {w.dtype} {w.shape}")
    for part, a in (("scales", scales), ("biases", biases)):
        if a.dtype != np.uint16:
            raise ShapeError(f"{name}: {part} must be uint16 bf16 bit patterns, got {a.dtype}",
                             hint="view bf16 tensors as np.uint16")
    if w.shape[1] * 32 != in_dim * bits:
        raise ShapeError(f"{name}: {w.shape[1]} words per row do not hold {in_dim} {bits}-bit codes "
                         f"(expected {in_dim * bits // 32})")
    gs = _group_size(gs, in_dim, name)
    for part, a in (("scales", scales), ("biases", biases)):
        if a.shape != (w.shape[0], in_dim // gs):
            raise ShapeError(f"{name}: {part} have shape {a.shape}, expected {(w.shape[0], in_dim // gs)}")
    return _aligned16(np.ascontiguousarray(w)), np.ascontiguousarray(scales), np.ascontiguousarray(biases)


def _aligned16(a: np.ndarray) -> np.ndarray:
    """`a` itself when its data starts on a 16-byte boundary (numpy's and the readers' buffers do), else an
    aligned copy: the matvec kernels read packed weights 16 bytes at a time from the start of a buffer."""
    if a.ctypes.data % 16 == 0:
        return a
    raw = np.empty(a.nbytes + 16, dtype=np.uint8)
    off = (-raw.ctypes.data) % 16
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _out(out, shape: tuple[int, ...], name: str, offset: int = 0) -> np.ndarray:
    """The caller's output buffer (float32, C-contiguous, room for `offset` + prod(shape)) or a new one."""
    if out is None:
        if offset:
            raise ShapeError(f"{name}: an output offset needs an output buffer (out=)")
        return np.empty(shape, dtype=np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ShapeError(f"{name}: out must be a C-contiguous float32 array")
    if out.size < offset + int(np.prod(shape)):
        raise ShapeError(f"{name}: out holds {out.size} floats, needs {offset + int(np.prod(shape))}")
    return out


def _records(record, layout: RecordLayout) -> tuple[np.ndarray, int, int]:
    """One raw record [>= payload] or a batch of them [n, record_size] -> (flat uint8 buffer, n, stride)."""
    record = np.asarray(record)
    if record.dtype != np.uint8 or record.ndim not in (1, 2) or not record.flags.c_contiguous:
        raise ShapeError(f"expert records must be a contiguous uint8 array [size] or [experts, size], got "
                         f"{record.dtype} {record.shape}",
                         hint="pass the bytes exactly as PackedModel.read_record / read_records return them")
    n, size = (1, record.shape[0]) if record.ndim == 1 else record.shape
    if size < layout.payload_size:
        raise ShapeError(f"expert record of {size} bytes is shorter than its layout's {layout.payload_size}")
    if (n - 1) * size + layout.payload_size >= _U32:
        raise ShapeError(f"{n} expert records of {size} bytes: byte offsets do not fit the kernels' uint",
                         hint="run fewer experts per dispatch")
    flat = record if record.ndim == 1 else record.reshape(-1)  # a view: no copy of the bytes
    return _aligned16(flat), n, size  # (copied only if it does not start 16-byte aligned)


def _expert_x(x, n: int, width: int, what: str) -> tuple[np.ndarray, int, int]:
    """x [T, width] read by every expert (stride 0) or [n, T, width] one per expert -> (x, T, x_stride)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 2 and x.shape[1] == width:
        return x, x.shape[0], 0
    if x.ndim == 3 and x.shape[0] == n and x.shape[2] == width:
        return x, x.shape[1], x.shape[1] * width
    raise ShapeError(f"{what}: x has shape {x.shape}, expected [T, {width}] or [{n}, T, {width}]")


def _proj(layout: RecordLayout, proj: str):
    """(weight, scales, biases) components of one projection, their bits, group size, out and in widths."""
    cw, cs, cb = (layout.component(f"{proj}.{part}") for part in ("weight", "scales", "biases"))
    bits = _bits(cw.bits)
    out_dim, words = cw.shape
    in_dim = words * 32 // bits
    gs = _group_size(cw.group_size, in_dim, f"{proj} projection")
    return cw, cs, cb, bits, gs, out_dim, in_dim


# ------------------------------------------------------------------------------------------- geometry


def rows_per_simdgroup(matrices: int = 1) -> int:
    """Output rows of one simdgroup's block: QMV_ROWS for qmv, half that for gate_up (rows of both matrices)."""
    return QMV_ROWS // matrices


def rows_per_group(ksplit: int, matrices: int = 1) -> int:
    """Output rows per threadgroup of qmv (matrices=1) / gate_up (2) when `ksplit` simdgroups share each block
    of rows."""
    return QMV_SG // ksplit * rows_per_simdgroup(matrices)


def lane_run(bits: int) -> int:
    """Inputs of a row one lane reads a step (quant.metal qrun; `bits`: the wider codes of the matrices)."""
    return min(QMV_VPT * 8 // bits, 32)


def choose_ksplit(out_dim: int, in_dim: int, tokens: int = 1, experts: int = 1, matrices: int = 1,
                  bits: int = 8) -> int:
    """1 for a matrix under SPLIT_MIN_WEIGHTS or whose rows are one step of the 32 lanes (in_dim <= 32 *
    lane_run(bits), `bits` the widest codes in play: a second simdgroup on a block would find no step left;
    measured on an H200, a 4096 x 1024 4-bit matrix 3.8 -> 3.6 us, 2-bit 3.7 -> 3.4), else the smallest split
    that gives TARGET_GROUPS threadgroups (the largest when none does)."""
    if out_dim * in_dim < SPLIT_MIN_WEIGHTS or in_dim <= 32 * lane_run(bits):
        return 1
    for ks in KSPLITS:
        if _cdiv(out_dim, rows_per_group(ks, matrices)) * tokens * experts >= TARGET_GROUPS:
            return ks
    return KSPLITS[-1]


def qmv_geometry(out_dim: int, in_dim: int, tokens: int, experts: int = 1, ksplit: int | None = None,
                 matrices: int = 1, bits: int = 8):
    """(grid, threadgroup, ksplit) of qmv (matrices=1) / gate_up (2): a threadgroup per
    rows_per_group(ksplit, matrices) output rows of one token of one expert of the batch (`bits`: the widest
    codes, for choose_ksplit)."""
    ks = choose_ksplit(out_dim, in_dim, tokens, experts, matrices, bits) if ksplit is None else int(ksplit)
    if ks not in KSPLITS:
        raise ShapeError(f"ksplit {ksplit!r}: expected one of {KSPLITS}")
    return (_cdiv(out_dim, rows_per_group(ks, matrices)), tokens, experts), (32 * QMV_SG, 1, 1), ks


def qmv_rows_of(group_x: int, simdgroup: int, ksplit: int, matrices: int = 1) -> range:
    """Output rows that simdgroup `simdgroup` of threadgroup column `group_x` works on (the kernel's formula;
    `ksplit` simdgroups share each block of rows, each taking every ksplit-th step of the inputs)."""
    nrb = QMV_SG // ksplit
    rows = rows_per_simdgroup(matrices)
    row0 = (group_x * nrb + simdgroup % nrb) * rows
    return range(row0, row0 + rows)


# ------------------------------------------------------------------------------------------- qmatmul


def qmatmul_dispatch(x, w, scales, biases, bits, group_size, *, out=None, out_offset: int = 0,
                     ksplit: int | None = None) -> list[Dispatch]:
    """y = x @ dequant(W).T into `out` (a new float32 [T, out] unless given; written from float `out_offset`).

    x: f32 [T, in]; w: uint32 [out, in*bits/32]; scales, biases: bf16 [out, in/gs].
    """
    x = _act(x, "qmatmul: x")
    bits = _bits(bits)
    w, scales, biases = _qtensor(w, scales, biases, bits, group_size, x.shape[1], "qmatmul")
    T, in_dim = x.shape
    out_dim = w.shape[0]
    y = _out(out, (T, out_dim), "qmatmul", out_offset)
    if T == 0 or out_dim == 0:
        return []
    grid, tg, ks = qmv_geometry(out_dim, in_dim, T, 1, ksplit, bits=bits)
    args = {0: x, 1: w, 2: scales, 3: biases, 4: y, 5: in_dim, 6: out_dim, 7: int(group_size), 8: int(out_offset),
            9: ks}
    return [Dispatch(SOURCE, f"qmv_b{bits}", args, grid, tg, label=f"qmv {out_dim}x{in_dim} q{bits}")]


def qmatmul(executor: Executor, x, w, scales, biases, bits, group_size) -> np.ndarray:
    """kernels_ref.qmatmul on `executor`: x f32 [T, in] -> f32 [T, out]."""
    x = _act(x, "qmatmul: x")
    y = np.empty((x.shape[0], np.asarray(w).shape[0]), dtype=np.float32)
    ds = qmatmul_dispatch(x, w, scales, biases, bits, group_size, out=y)
    if ds:
        executor.run(ds)
    return y


def qmatmul_record_dispatch(x, record, layout: RecordLayout, proj: str, *, out=None,
                            out_offset: int = 0) -> list[Dispatch]:
    """One projection ("gate", "up" or "down") of routed experts, straight from their raw records.

    record: one record (uint8 [size]) -> f32 [T, out]; or a batch (uint8 [n, size], e.g. read_records) ->
    f32 [n, T, out], all n experts in one dispatch (grid.z). x: f32 [T, in] read by every expert, or
    [n, T, in]. `out`/`out_offset` place the result inside a larger float32 buffer.
    """
    flat, n, stride = _records(record, layout)
    cw, cs, cb, bits, gs, out_dim, in_dim = _proj(layout, proj)
    x, T, x_stride = _expert_x(x, n, in_dim, f"{proj} projection")
    shape = (T, out_dim) if np.asarray(record).ndim == 1 else (n, T, out_dim)
    y = _out(out, shape, f"{proj} projection", out_offset)
    if T == 0 or n == 0:
        return []
    grid, tg, ks = qmv_geometry(out_dim, in_dim, T, n, bits=bits)
    args = {0: x, 1: flat, 2: cw.offset, 3: cs.offset, 4: cb.offset, 5: y, 6: in_dim, 7: out_dim, 8: gs,
            9: int(out_offset), 10: stride, 11: x_stride, 12: T * out_dim, 13: ks}
    return [Dispatch(SOURCE, f"qmv_rec_b{bits}", args, grid, tg, label=f"{n} expert(s) {proj} q{bits}")]


# ------------------------------------------------------------------------------------------- expert FFN


def _split_bits(bits) -> tuple[int, int, int]:
    if np.isscalar(bits):
        return (_bits(bits),) * 3
    bits = tuple(bits)
    if len(bits) != 3:
        raise QuantizationError(f"expert bits must be one int or (gate, up, down), got {bits!r}")
    return tuple(_bits(b) for b in bits)  # type: ignore[return-value]


def gate_up_dispatch(x, gw, gs_, gb, uw, us, ub, bits, group_size, *, out=None) -> list[Dispatch]:
    """h = silu(x @ gate^T) * (x @ up^T) in one dispatch: x f32 [T, D] -> h f32 [T, I].

    bits: one int for both or (gate_bits, up_bits); gate/up: uint32 [I, D*b/32] + bf16 [I, D/gs].
    """
    x = _act(x, "gate_up: x")
    if np.isscalar(bits):
        g_bits = u_bits = _bits(bits)
    elif len(bits) in (2, 3):
        g_bits, u_bits = _bits(bits[0]), _bits(bits[1])
    else:
        raise QuantizationError(f"gate/up bits must be one int, (gate, up) or (gate, up, down), got {bits!r}")
    T, D = x.shape
    gw, gs_, gb = _qtensor(gw, gs_, gb, g_bits, group_size, D, "gate projection")
    uw, us, ub = _qtensor(uw, us, ub, u_bits, group_size, D, "up projection")
    if gw.shape[0] != uw.shape[0]:
        raise ShapeError(f"gate has {gw.shape[0]} output rows, up has {uw.shape[0]}: expected the same")
    I = gw.shape[0]
    h = _out(out, (T, I), "gate_up")
    if T == 0 or I == 0:
        return []
    grid, tg, ks = qmv_geometry(I, D, T, matrices=2, bits=max(g_bits, u_bits))
    args = {0: x, 1: gw, 2: gs_, 3: gb, 4: uw, 5: us, 6: ub, 7: h, 8: D, 9: I, 10: int(group_size),
            11: g_bits, 12: u_bits, 13: ks}
    return [Dispatch(SOURCE, "gate_up_swiglu", args, grid, tg, label=f"gate_up {I}x{D} q{g_bits}/q{u_bits}")]


def expert_ffn_dispatch(x, gw, gs_, gb, uw, us, ub, dw, ds, db, bits, group_size, *, out=None,
                        out_offset: int = 0) -> list[Dispatch]:
    """down(silu(gate(x)) * up(x)) as two dispatches (fused gate/up, then the down matvec): f32 [T, D]."""
    x = _act(x, "expert_ffn: x")
    g_bits, u_bits, d_bits = _split_bits(bits)
    h = np.empty((x.shape[0], np.asarray(gw).shape[0]), dtype=np.float32)
    first = gate_up_dispatch(x, gw, gs_, gb, uw, us, ub, (g_bits, u_bits), group_size, out=h)
    return first + qmatmul_dispatch(h, dw, ds, db, d_bits, group_size, out=out, out_offset=out_offset)


def expert_ffn(executor: Executor, x, gw, gs_, gb, uw, us, ub, dw, ds, db, bits, group_size) -> np.ndarray:
    """kernels_ref.expert_ffn on `executor`: x f32 [T, D] -> f32 [T, D]."""
    x = _act(x, "expert_ffn: x")
    y = np.empty((x.shape[0], np.asarray(dw).shape[0]), dtype=np.float32)
    ds = expert_ffn_dispatch(x, gw, gs_, gb, uw, us, ub, dw, ds, db, bits, group_size, out=y)
    if ds:
        executor.run(ds)
    return y


def gate_up_record_kernel(gate_bits: int, up_bits: int) -> str:
    """The fused gate/up kernel for records: one of its own when both widths agree (its registers are not
    sized by the other widths' code), else the all-pairs gate_up_swiglu_rec."""
    return f"gate_up_swiglu_rec_b{gate_bits}" if gate_bits == up_bits else "gate_up_swiglu_rec"


def expert_ffn_record_dispatch(x, record, layout: RecordLayout, *, out=None, out_offset: int = 0,
                               h=None) -> list[Dispatch]:
    """Routed experts from their raw records: fused gate/up + SwiGLU, then down (two dispatches).

    record: one record (uint8 [size]) -> f32 [T, D]; or a batch (uint8 [n, size]) -> f32 [n, T, D], every
    expert in the same two dispatches. x: f32 [T, D] read by every expert, or [n, T, D]. For one decode
    token the batch's output [K, 1, D] is moe_combine's y [T=1, K, D]. `out`/`out_offset` place the result
    inside a larger float32 buffer; `h` is an optional f32 [(n,) T, I] scratch buffer.
    """
    flat, n, stride = _records(record, layout)
    gw, gsc, gbi, g_bits, g_gs, I, D = _proj(layout, "gate")
    uw, usc, ubi, u_bits, u_gs, u_out, u_in = _proj(layout, "up")
    if (u_out, u_in) != (I, D) or u_gs != g_gs:
        raise ShapeError(f"record layout: up is [{u_out}, {u_in}] group {u_gs}, gate [{I}, {D}] group {g_gs}: "
                         "the fused gate/up kernel needs the same shape and group size")
    x, T, x_stride = _expert_x(x, n, D, "expert_ffn_record")
    batch = np.asarray(record).ndim == 2
    h = _out(h, (n, T, I) if batch else (T, I), "expert_ffn_record scratch")
    if T == 0 or n == 0:
        return []
    grid, tg, ks = qmv_geometry(I, D, T, n, matrices=2, bits=max(g_bits, u_bits))
    args = {0: x, 1: flat, 2: gw.offset, 3: gsc.offset, 4: gbi.offset, 5: uw.offset, 6: usc.offset,
            7: ubi.offset, 8: h, 9: D, 10: I, 11: g_gs, 12: g_bits, 13: u_bits, 14: stride, 15: x_stride,
            16: T * I, 17: ks}
    first = Dispatch(SOURCE, gate_up_record_kernel(g_bits, u_bits), args, grid, tg,
                     label=f"{n} expert(s) gate_up q{g_bits}/q{u_bits}")
    down = qmatmul_record_dispatch(h.reshape((n, T, I)) if batch else h, record, layout, "down", out=out,
                                   out_offset=out_offset)
    return [first] + down


def expert_ffn_record(executor: Executor, x, record, layout: RecordLayout) -> np.ndarray:
    """Routed experts straight from their raw packed records (one record [size] -> f32 [T, D]; a batch
    [n, size] -> f32 [n, T, D]); x f32 [T, D] shared by the experts, or [n, T, D]."""
    record = np.asarray(record)
    x = np.asarray(x, dtype=np.float32)
    T = x.shape[-2] if x.ndim >= 2 else 0
    D = layout.component("down.weight").shape[0]
    y = np.empty((T, D) if record.ndim == 1 else (record.shape[0], T, D), dtype=np.float32)
    ds = expert_ffn_record_dispatch(x, record, layout, out=y)
    if ds:
        executor.run(ds)
    return y


# ------------------------------------------------------------------------------------------- embedding


def qembedding_dispatch(ids, w, scales, biases, bits, group_size, *, out=None) -> list[Dispatch]:
    """Rows `ids` of a quantized table, dequantized: ids int [T]; w uint32 [V, D*bits/32] -> f32 [T, D]."""
    bits = _bits(bits)
    ids_in = np.asarray(ids)
    if ids_in.ndim != 1 or not (ids_in.size == 0 or np.issubdtype(ids_in.dtype, np.integer)):
        raise ShapeError(f"qembedding: ids must be a 1-D integer array, got {ids_in.dtype} {ids_in.shape}")
    w = np.asarray(w)
    if w.dtype != np.uint32 or w.ndim != 2:
        raise ShapeError(f"qembedding: packed table must be uint32 [V, words], got {w.dtype} {w.shape}")
    D = w.shape[1] * 32 // bits
    w, scales, biases = _qtensor(w, scales, biases, bits, group_size, D, "qembedding")
    V = w.shape[0]
    if ids_in.size and (ids_in.min() < 0 or ids_in.max() >= V):
        raise ShapeError(f"qembedding: token ids must lie in 0..{V - 1}, got {ids_in.min()}..{ids_in.max()}")
    ids32 = np.ascontiguousarray(ids_in, dtype=np.int32)
    T = ids32.shape[0]
    e = _out(out, (T, D), "qembedding")
    if T == 0:
        return []
    grid = (_cdiv(D * bits // 32, QEMB_TG), T, 1)
    args = {0: ids32, 1: w, 2: scales, 3: biases, 4: e, 5: D, 6: int(group_size)}
    return [Dispatch(SOURCE, f"qembed_b{bits}", args, grid, (QEMB_TG, 1, 1), label=f"embed {T} x {D} q{bits}")]


def qembedding(executor: Executor, ids, w, scales, biases, bits, group_size) -> np.ndarray:
    """kernels_ref.qembedding on `executor`: ids int [T] -> f32 [T, D]."""
    e = np.empty((np.asarray(ids).shape[0], np.asarray(w).shape[1] * 32 // _bits(bits)), dtype=np.float32)
    ds = qembedding_dispatch(ids, w, scales, biases, bits, group_size, out=e)
    if ds:
        executor.run(ds)
    return e


# ------------------------------------------------------------------------------------------- MoE combine


def moe_combine_ref(residual, y, weights, shared=None, shared_logit=None) -> np.ndarray:
    """The numpy spec of moe_combine (float32, quant.metal's order):

    acc = sigmoid(shared_logit[t]) * shared[t] (or 0); acc += w[t, k] * y[t, k] for k in order;
    out = residual + acc.  residual f32 [T, D]; y f32 [T, K, D]; weights f32 [T, K]; shared f32 [T, D];
    shared_logit f32 [T]  ->  f32 [T, D]
    """
    residual, y, weights = (np.asarray(a, dtype=np.float32) for a in (residual, y, weights))
    acc = np.zeros_like(residual)
    if shared is not None:
        with np.errstate(over="ignore"):
            gate = np.float32(1) / (np.float32(1) + np.exp(-np.asarray(shared_logit, dtype=np.float32)))
        acc = gate[:, None] * np.asarray(shared, dtype=np.float32)
    for k in range(y.shape[1]):
        acc = acc + weights[:, k, None] * y[:, k]
    return residual + acc


def moe_combine_dispatch(residual, y, weights, shared=None, shared_logit=None, *, out=None) -> list[Dispatch]:
    """out = residual + sum_k w[:, k] * y[:, k] (+ sigmoid(shared_logit) * shared); see moe_combine_ref.

    `out` may be `residual` itself (updated in place).
    """
    residual = _act(residual, "moe_combine: residual")
    y = _act(y, "moe_combine: y", ndim=3)
    weights = _act(weights, "moe_combine: weights")
    T, D = residual.shape
    K = y.shape[1]
    if y.shape != (T, K, D) or weights.shape != (T, K):
        raise ShapeError(f"moe_combine: residual {residual.shape}, y {y.shape}, weights {weights.shape}: "
                         "expected [T, D], [T, K, D], [T, K]")
    if (shared is None) != (shared_logit is None):
        raise ShapeError("moe_combine: give both shared and shared_logit, or neither")
    o = _out(out, (T, D), "moe_combine")
    if T == 0:
        return []
    args = {0: residual, 1: y, 2: weights, 3: o, 4: D, 5: K, 6: T}
    kernel = "moe_combine"
    if shared is not None:
        shared = _act(shared, "moe_combine: shared")
        shared_logit = np.ascontiguousarray(shared_logit, dtype=np.float32).reshape(-1)
        if shared.shape != (T, D) or shared_logit.shape != (T,):
            raise ShapeError(f"moe_combine: shared {shared.shape}, shared_logit {shared_logit.shape}: "
                             f"expected [{T}, {D}] and [{T}]")
        args.update({7: shared, 8: shared_logit})
        kernel = "moe_combine_shared"
    grid = (_cdiv(D, QCOMB_TG), T, 1)
    return [Dispatch(SOURCE, kernel, args, grid, (QCOMB_TG, 1, 1), label=f"{kernel} K={K}")]


def moe_combine(executor: Executor, residual, y, weights, shared=None, shared_logit=None) -> np.ndarray:
    """moe_combine_ref on `executor`: f32 [T, D]."""
    residual = _act(residual, "moe_combine: residual")
    out = np.empty_like(residual)
    ds = moe_combine_dispatch(residual, y, weights, shared, shared_logit, out=out)
    if ds:
        executor.run(ds)
    return out


__all__ = [
    "SOURCE", "KERNEL_BITS", "KSPLITS", "rows_per_simdgroup", "rows_per_group", "lane_run", "choose_ksplit",
    "qmv_geometry", "qmv_rows_of",
    "qmatmul_dispatch", "qmatmul", "qmatmul_record_dispatch",
    "gate_up_dispatch", "gate_up_record_kernel", "expert_ffn_dispatch", "expert_ffn", "expert_ffn_record_dispatch",
    "expert_ffn_record",
    "qembedding_dispatch", "qembedding", "moe_combine_ref", "moe_combine_dispatch", "moe_combine",
]


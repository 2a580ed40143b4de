"""metal/quant.metal (through the CPU emulator) against the numpy reference, and its launch builders.

Every kernel runs under three emulator modes: forward schedule with strict address spaces, reverse schedule
with the strict all-32-lanes simd mode, and a seeded random schedule (a missing barrier shows under some
schedules only).

Tolerances (why each is what it is):
  * qmatmul (qmv*): |y - ref| <= 1e-5 * (|x| @ (|scale| q + |bias|)^T) element by element. The kernel sums
    scale * dot(q, x) + bias * sum(x) per 16 inputs per lane, then folds lanes with simd_sum; the reference
    rounds each dequantized weight and lets BLAS sum. Both errors scale with the two terms' magnitudes, not
    with the (possibly cancelled) result. Dense and record entry points run the same code: bit-equal.
  * expert_ffn: max |y - ref| <= 2e-5 * max |ref| (three chained matvecs with a SwiGLU between; exp is
    libm's on the emulator).
  * qembedding: bit-identical (scale * q is exact in float32, so fma or not gives the same value).
  * moe_combine: |out - ref64| <= 1e-6 * (|residual| + |gated shared| + sum_k |w y_k|): a few float32
    roundings of K+2 terms (fma or not), against a float64 numpy expression.
"""

from __future__ import annotations

import inspect
import re
import zlib

import numpy as np
import pytest

from moepack.archs.base import MoeShape
from moepack.errors import QuantizationError, ShapeError
from moepack.layout.record import record_layout
from moepack.quant.affine_ref import quantize, unpack
from moepack.quant.bf16 import bf16_to_f32
from moepack.runtime import kernels_ref as REF
from moepack.runtime.metal import ops_quant as OQ
from moepack.runtime.metal.sources import kernel_dir

MODES = {
    "forward-strict-as": dict(schedule="forward", strict_address_spaces=True),
    "reverse-strict-simd": dict(schedule="reverse", strict_simd=True),
    "random": dict(schedule="random", seed=3),
}


def rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def qweights(r, out_dim, in_dim, bits, gs, std=0.05, mean=0.0):
    """A random float matrix quantized MLX-style: (w uint32, scales bf16, biases bf16)."""
    return quantize((r.standard_normal((out_dim, in_dim)) * std + mean).astype(np.float32), bits, gs)


def term_scale(x, w, scales, biases, bits, gs):
    """|x| @ (|scale| q + |bias|)^T in float64: the size of what a qmatmul output is summed from."""
    q = unpack(w, bits).astype(np.float64)  # [out, in]
    s = np.repeat(np.abs(bf16_to_f32(scales)).astype(np.float64), gs, axis=1)
    b = np.repeat(np.abs(bf16_to_f32(biases)).astype(np.float64), gs, axis=1)
    return np.abs(x).astype(np.float64) @ (s * q + b).T


def fill_record(layout, parts: dict) -> np.ndarray:
    """A raw record (uint8 [record_size], padding zero) holding parts {'gate': (w, s, b), ...}."""
    rec = np.zeros(layout.record_size, dtype=np.uint8)
    for proj, arrays in parts.items():
        for part, a in zip(("weight", "scales", "biases"), arrays):
            layout.component(f"{proj}.{part}").view(rec)[...] = a
    return rec


@pytest.fixture(scope="module", params=list(MODES), ids=list(MODES))
def emu(request):
    from moepack.runtime.metal.emulator import Emulator

    return Emulator(**MODES[request.param])


# ---------------------------------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", ["qmatmul", "expert_ffn", "qembedding"])
def test_same_signatures_as_the_reference_after_the_executor(name):
    params = list(inspect.signature(getattr(OQ, name)).parameters)
    assert params[0] == "executor" and params[1:] == list(inspect.signature(getattr(REF, name)).parameters)


# ---------------------------------------------------------------------------------------------- geometry


def test_geometry_constants_match_the_kernel_source():
    text = (kernel_dir() / OQ.SOURCE).read_text()
    defines = {m[1]: int(m[2]) for m in re.finditer(r"^#define (\w+) (\d+)\b", text, re.M)}
    for name in ("QMV_SG", "QMV_ROWS", "QMV_VPT", "QMV_XCHUNK", "QEMB_TG", "QCOMB_TG"):
        assert defines[name] == getattr(OQ, name), name
    assert all(gs % OQ.QMV_VPT == 0 for gs in (32, 64, 128))  # a lane's inputs share one scale and bias
    assert OQ.QMV_XCHUNK * 4 <= 16 * 1024  # threadgroup memory per kernel, well under Apple's 32 KiB
    assert all(OQ.QMV_SG % ks == 0 for ks in OQ.KSPLITS)


@pytest.mark.parametrize("out_dim", [1, 7, 8, 9, 64, 100])
@pytest.mark.parametrize("T", [1, 3])
def test_qmv_grid_covers_every_row_and_token_once(out_dim, T):
    w, s, b = qweights(rng("geo"), out_dim, 64, 4, 32)
    for ksplit in (None,) + OQ.KSPLITS:
        (d,) = OQ.qmatmul_dispatch(np.zeros((T, 64), np.float32), w, s, b, 4, 32, ksplit=ksplit)
        ks = d.args[9]
        assert d.kernel == "qmv_b4" and d.threadgroup == (32 * OQ.QMV_SG, 1, 1) and ks in OQ.KSPLITS
        assert d.grid[1:] == (T, 1)  # one token per grid row
        rows = [r for gx in range(d.grid[0]) for sg in range(OQ.QMV_SG) for r in OQ.qmv_rows_of(gx, sg, ks)]
        assert all(rows.count(r) == ks for r in rows)  # each row: exactly its ksplit simdgroups
        assert set(range(out_dim)) <= set(rows) and len(set(rows)) - out_dim < OQ.rows_per_group(ks)
        assert d.args[4].shape == (T, out_dim) and d.args[6] == out_dim and d.args[5] == 64


def test_ksplit_spreads_small_dispatches_and_keeps_large_ones_whole():
    assert OQ.choose_ksplit(1024, 4096) == 8  # one expert's gate/up at decode: 4 rows a group, 256 groups
    assert OQ.choose_ksplit(1024, 4096, experts=10) == 1  # a batch of 10 experts: 320 groups unsplit
    assert OQ.choose_ksplit(4096, 4096) == 2 and OQ.choose_ksplit(65536, 4096) == 1
    assert OQ.choose_ksplit(64, 128) == 1  # tiny: not worth 8x the emulated threads
    # rows that are one step of the 32 lanes (a 4-bit 1024-wide down projection) have no step to share ...
    assert [OQ.lane_run(b) for b in (2, 4, 8)] == [32, 32, 16]
    assert OQ.choose_ksplit(4096, 1024, bits=4) == 1 and OQ.choose_ksplit(4096, 1024, bits=2) == 1
    # ... 8-bit ones of that width take two steps, and split as before
    assert OQ.choose_ksplit(4096, 1024, bits=8) == 2 == OQ.choose_ksplit(4096, 1024)
    assert OQ.choose_ksplit(1024, 4096, bits=4) == 8
    for out_dim, in_dim, T, E in [(1024, 4096, 1, 1), (4096, 1024, 1, 1), (512, 4096, 3, 1), (1024, 4096, 1, 10)]:
        ks = OQ.choose_ksplit(out_dim, in_dim, T, E)
        groups = -(-out_dim // OQ.rows_per_group(ks)) * T * E
        assert groups >= OQ.TARGET_GROUPS or ks == OQ.KSPLITS[-1]
        assert ks == 1 or -(-out_dim // OQ.rows_per_group(ks // 2)) * T * E < OQ.TARGET_GROUPS


def test_embedding_and_combine_grids_cover_their_outputs():
    table = qweights(rng("geo-e"), 10, 384, 2, 128)
    (d,) = OQ.qembedding_dispatch([3, 0, 9], *table, 2, 128)
    assert d.grid[0] * d.threadgroup[0] >= 384 * 2 // 32 and (d.grid[0] - 1) * d.threadgroup[0] < 24
    assert d.grid[1] == 3 and d.args[0].dtype == np.int32
    (c,) = OQ.moe_combine_dispatch(np.zeros((2, 300)), np.zeros((2, 4, 300)), np.zeros((2, 4)))
    assert c.grid == (2, 2, 1) and c.threadgroup == (OQ.QCOMB_TG, 1, 1) and c.kernel == "moe_combine"


def test_record_dispatch_offsets_come_from_the_layout():
    D, I = 128, 64
    lay = record_layout(MoeShape(1, 1, 1, D, I), {"gate": 4, "up": 2, "down": 8}, 64)
    rec = np.zeros(lay.record_size, np.uint8)
    gu, down = OQ.expert_ffn_record_dispatch(np.zeros((1, D)), rec, lay)
    names = ["gate.weight", "gate.scales", "gate.biases", "up.weight", "up.scales", "up.biases"]
    assert [gu.args[i] for i in range(2, 8)] == [lay.component(n).offset for n in names]
    assert (gu.args[12], gu.args[13]) == (4, 2) and down.kernel == "qmv_rec_b8"
    assert gu.kernel == "gate_up_swiglu_rec"  # mixed widths: the all-pairs kernel (uniform ones have their own)
    assert [down.args[i] for i in (2, 3, 4)] == [lay.component(f"down.{p}").offset for p in
                                                 ("weight", "scales", "biases")]
    assert down.args[0] is gu.args[8]  # the down matvec reads h, the gate/up output
    assert gu.args[1] is rec and down.args[1] is rec  # the raw record, no copy


def test_dispatch_arguments_match_the_parsed_kernel_signatures():
    """Every builder's buffer indices are exactly the kernel's, with dtypes the ABI maps the types to."""
    from moepack.runtime.metal.emulator import Emulator

    lib = Emulator().library(OQ.SOURCE)
    for d in all_dispatches():
        sig = lib.kernels[d.kernel]
        check_args_against_signature(d, sig)


def all_dispatches():
    r = rng("sig")
    D, I = 128, 64
    x = np.zeros((2, D), np.float32)
    out = []
    for bits in OQ.KERNEL_BITS:
        w = qweights(r, I, D, bits, 64)
        out += OQ.qmatmul_dispatch(x, *w, bits, 64)
        out += OQ.qembedding_dispatch([1, 2], *w, bits, 64)
        lay = record_layout(MoeShape(1, 1, 1, D, I), bits, 64)
        out += OQ.expert_ffn_record_dispatch(x, np.zeros(lay.record_size, np.uint8), lay)
    lay = record_layout(MoeShape(1, 1, 1, D, I), {"gate": 4, "up": 2, "down": 8}, 64)  # mixed widths
    out += OQ.expert_ffn_record_dispatch(x, np.zeros(lay.record_size, np.uint8), lay)
    g, u, dn = qweights(r, I, D, 4, 64), qweights(r, I, D, 4, 64), qweights(r, D, I, 4, 64)
    out += OQ.expert_ffn_dispatch(x, *g, *u, *dn, 4, 64)
    y = np.zeros((2, 3, D), np.float32)
    out += OQ.moe_combine_dispatch(x, y, np.zeros((2, 3)))
    out += OQ.moe_combine_dispatch(x, y, np.zeros((2, 3)), x, np.zeros(2))
    assert {d.kernel for d in out} == {"qmv_b2", "qmv_b4", "qmv_b8", "qmv_rec_b2", "qmv_rec_b4", "qmv_rec_b8",
                                       "qembed_b2", "qembed_b4", "qembed_b8", "gate_up_swiglu",
                                       "gate_up_swiglu_rec", "gate_up_swiglu_rec_b2", "gate_up_swiglu_rec_b4",
                                       "gate_up_swiglu_rec_b8", "moe_combine", "moe_combine_shared"}
    return out


def test_compiles_to_ptx_with_an_entry_per_kernel():
    """The same file through the CUDA branch of the stand-in header (clang-19, no CUDA toolkit)."""
    from moepack.runtime.metal.ptx import compile_ptx

    mod = compile_ptx(OQ.SOURCE)
    for d in all_dispatches():
        k = mod.kernels[d.kernel]
        assert f".entry {d.kernel}(" in mod.ptx
        assert len(k.launch_args(d.args)) == len(d.args)  # every builder argument has its launch slot


def test_ptx_occupancy_hints_match_the_launch_geometry():
    """CUDA launch bounds: a launch with more threads than its entry's bound fails, so each hinted kernel's
    threads must be the threadgroup its launch builder uses; the kernel bodies are inlined into their entries
    (no call: the pointers are then known to be global, scalars are values)."""
    import re

    from moepack.runtime.metal.ptx import OCCUPANCY, compile_ptx

    mod = compile_ptx(OQ.SOURCE)
    builders = {d.kernel: d for d in all_dispatches()}
    assert {"qmv_rec_b4", "gate_up_swiglu_rec"} <= set(OCCUPANCY) <= set(builders)
    for name, (threads, groups) in OCCUPANCY.items():
        assert builders[name].threadgroup == (threads, 1, 1)
        head = re.search(rf"\.entry {name}\((.*?)\)\s*(.*?)\{{", mod.ptx, re.S).group(2)
        assert f".maxntid {threads}, 1, 1" in head and f".minnctapersm {groups}" in head
    for name in builders:
        body = mod.ptx[mod.ptx.index(f".entry {name}("):]
        body = body[:body.index("\n}\n")]
        assert "call.uni" not in body and "ld.global" in body, name


_DTYPES = {"float": np.float32, "bfloat": np.uint16, "uint": np.uint32, "int": np.int32, "uchar": np.uint8}


def check_args_against_signature(d, sig):
    buffers = {p.index: p for p in sig.params if p.index is not None}
    assert set(buffers) == set(d.args), (d.kernel, sorted(buffers), sorted(d.args))
    for i, p in buffers.items():
        a = d.args[i]
        if p.kind == "buffer":
            assert isinstance(a, np.ndarray) and p.address_space == "device", (d.kernel, i)
            assert a.dtype == _DTYPES[p.base], (d.kernel, i, a.dtype, p.base)
            assert a.flags.c_contiguous and (a.flags.writeable or p.const), (d.kernel, i)
        else:
            assert p.kind == "scalar" and p.address_space == "constant" and p.base == "uint", (d.kernel, i)
            assert isinstance(a, int) and 0 <= a < 1 << 32, (d.kernel, i, a)


# ---------------------------------------------------------------------------------------------- input checks


def test_builders_refuse_what_the_kernels_cannot_do():
    r = rng("bad")
    w3 = qweights(r, 8, 64, 3, 32)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(QuantizationError) as e:
        OQ.qmatmul_dispatch(x, *w3, 3, 32)
    assert "--backend cpu" in e.value.hint
    w4 = qweights(r, 8, 64, 4, 32)
    with pytest.raises(QuantizationError):
        OQ.qmatmul_dispatch(x, *w4, 4, 16)  # group size not 32/64/128
    with pytest.raises(ShapeError):
        OQ.qmatmul_dispatch(np.ones((1, 32), np.float32), *w4, 4, 32)  # x too narrow
    with pytest.raises(ShapeError):
        OQ.qembedding_dispatch([8], *w4, 4, 32)  # id out of range
    with pytest.raises(ShapeError):
        OQ.qmatmul_dispatch(x, *w4, 4, 32, out=np.zeros(8, np.float32), out_offset=4)  # no room
    lay = record_layout(MoeShape(1, 1, 1, 64, 32), 4, 32)
    with pytest.raises(ShapeError):
        OQ.expert_ffn_record_dispatch(x, np.zeros(lay.payload_size - 1, np.uint8), lay)  # truncated record
    with pytest.raises(ShapeError):
        OQ.moe_combine_dispatch(np.zeros((1, 8)), np.zeros((1, 2, 8)), np.zeros((1, 2)), np.zeros((1, 8)))


def test_no_tokens_launch_nothing(emu):
    # T = 0 (e.g. an empty prefill chunk): empty results of the reference's shapes, no zero-sized grid
    r = rng("empty")
    g, u, d = qweights(r, 32, 64, 4, 32), qweights(r, 32, 64, 4, 32), qweights(r, 64, 32, 4, 32)
    x = np.zeros((0, 64), np.float32)
    assert OQ.qmatmul_dispatch(x, *g, 4, 32) == []
    assert OQ.qmatmul(emu, x, *g, 4, 32).shape == REF.qmatmul(x, *g, 4, 32).shape == (0, 32)
    assert OQ.expert_ffn(emu, x, *g, *u, *d, 4, 32).shape == (0, 64)
    assert OQ.qembedding(emu, np.zeros(0, np.int64), *g, 4, 32).shape == (0, 64)
    assert OQ.moe_combine(emu, x, np.zeros((0, 2, 64)), np.zeros((0, 2))).shape == (0, 64)


# ---------------------------------------------------------------------------------------------- qmatmul


def test_qmatmul_one_group_by_hand(emu):
    # 32 codes 0..15, 0..15 at 4 bits: words 0x76543210, 0xFEDCBA98 twice; scale 0.5 (bf16 0x3F00),
    # bias -1.0 (bf16 0xBF80): W = 0.5 q - 1; with x = 1: sum(0.5 q - 1) = 0.5 * 2 * 120 - 32 = 88
    w = np.array([[0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98]], dtype=np.uint32)
    s = np.array([[0x3F00]], dtype=np.uint16)
    b = np.array([[0xBF80]], dtype=np.uint16)
    x = np.ones((1, 32), dtype=np.float32)
    assert OQ.qmatmul(emu, x, w, s, b, 4, 32).tolist() == [[88.0]]
    x[0, 31] = 2.0  # code 15 -> weight 6.5 counted twice
    assert OQ.qmatmul(emu, x, w, s, b, 4, 32).tolist() == [[94.5]]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_qmatmul_matches_reference(emu, bits, gs):
    r = rng("qmv", bits, gs)
    for out_dim, in_dim in [(32, 64), (40, 128), (96, 256)]:
        if in_dim % gs:
            continue
        w, s, b = qweights(r, out_dim, in_dim, bits, gs)
        for T in (1, 3):
            x = r.standard_normal((T, in_dim)).astype(np.float32)
            y = OQ.qmatmul(emu, x, w, s, b, bits, gs)
            ref = REF.qmatmul(x, w, s, b, bits, gs)
            assert y.dtype == np.float32 and y.shape == (T, out_dim)
            err = np.abs(y.astype(np.float64) - ref) / term_scale(x, w, s, b, bits, gs)
            assert err.max() <= 1e-5, (out_dim, in_dim, T, err.max())


@pytest.mark.parametrize("ksplit", OQ.KSPLITS)
def test_qmatmul_every_ksplit(emu, ksplit):
    # 2 input steps per simdgroup at ksplit 1, none for some simdgroups at 8; 44 rows: a partial row block
    r = rng("ksplit", ksplit)
    w, s, b = qweights(r, 44, 1024, 4, 64)
    x = r.standard_normal((2, 1024)).astype(np.float32)
    y = np.empty((2, 44), np.float32)
    emu.run(OQ.qmatmul_dispatch(x, w, s, b, 4, 64, out=y, ksplit=ksplit))
    err = np.abs(y.astype(np.float64) - REF.qmatmul(x, w, s, b, 4, 64)) / term_scale(x, w, s, b, 4, 64)
    assert err.max() <= 1e-5


def test_qmatmul_wide_input_spans_several_staged_chunks(emu):
    # in = 2112 > QMV_XCHUNK (2048): a full chunk then a 64-wide one; 12 rows: a half-empty threadgroup;
    # bias-heavy weights so the bias * sum(x) term matters
    r = rng("wide")
    in_dim, gs = OQ.QMV_XCHUNK + 64, 64
    w, s, b = qweights(r, 12, in_dim, 4, gs, std=0.01, mean=0.3)
    x = r.standard_normal((2, in_dim)).astype(np.float32)
    y = OQ.qmatmul(emu, x, w, s, b, 4, gs)
    err = np.abs(y.astype(np.float64) - REF.qmatmul(x, w, s, b, 4, gs)) / term_scale(x, w, s, b, 4, gs)
    assert err.max() <= 1e-5


@pytest.mark.parametrize("bits,gs,in_dim", [(2, 32, 32), (2, 32, 96), (4, 32, 96), (2, 32, 4096 + 32),
                                             (8, 32, 4096 + 96), (4, 64, 2 * 4096 + 64)])
def test_qmatmul_rows_off_16_byte_alignment_and_long_tails(emu, bits, gs, in_dim):
    # 2-bit rows of 32 or 96 inputs are 8 / 24 bytes: the word-by-word path; the long ones stage x in
    # several chunks and end in a partial step; 13 rows: a partial row block
    r = rng("align", bits, gs, in_dim)
    w, s, b = qweights(r, 13, in_dim, bits, gs)
    for T in (1, 2):
        x = r.standard_normal((T, in_dim)).astype(np.float32)
        y = OQ.qmatmul(emu, x, w, s, b, bits, gs)
        err = np.abs(y.astype(np.float64) - REF.qmatmul(x, w, s, b, bits, gs)) / term_scale(x, w, s, b, bits, gs)
        assert err.max() <= 1e-5, (T, err.max())
    # the same rows from a buffer that starts 8 bytes past 16-byte alignment (the launch copies it)
    wb = np.empty(w.size + 4, np.uint32)
    start = (-wb.ctypes.data // 4 + 2) % 4
    wm = wb[start : start + w.size].reshape(w.shape)
    wm[...] = w
    assert wm.ctypes.data % 16 == 8
    assert np.array_equal(OQ.qmatmul(emu, x, wm, s, b, bits, gs), OQ.qmatmul(emu, x, w, s, b, bits, gs))


@pytest.mark.parametrize("bits", [2, 8])
def test_record_matvec_equals_dense_matvec(emu, bits):
    # the same weights through qmv_rec_b* (offsets into a record) and qmv_b* (three buffers), written at an
    # offset inside a larger output buffer: bit-equal, and nothing outside the slot touched
    r = rng("rec-vs-dense", bits)
    D, I = 128, 64
    lay = record_layout(MoeShape(1, 1, 1, D, I), bits, 32)
    parts = {"gate": qweights(r, I, D, bits, 32), "up": qweights(r, I, D, bits, 32),
             "down": qweights(r, D, I, bits, 32)}
    rec = fill_record(lay, parts)
    x = r.standard_normal((3, D)).astype(np.float32)
    big = np.full(5 * I, -7.0, np.float32)
    emu.run(OQ.qmatmul_record_dispatch(x, rec, lay, "up", out=big, out_offset=I))
    dense = OQ.qmatmul(emu, x, *parts["up"], bits, 32)
    assert np.array_equal(big[I:4 * I].reshape(3, I), dense)
    assert (big[:I] == -7).all() and (big[4 * I:] == -7).all()


# ---------------------------------------------------------------------------------------------- expert FFN


@pytest.mark.parametrize("bits,gs", [(4, 64), ((4, 2, 8), 32), ((8, 4, 2), 128)])
def test_expert_ffn_matches_reference(emu, bits, gs):
    r = rng("ffn", str(bits), gs)
    D, I = 256, 128
    gb, ub, db = (bits,) * 3 if isinstance(bits, int) else bits
    gate, up, down = qweights(r, I, D, gb, gs), qweights(r, I, D, ub, gs), qweights(r, D, I, db, gs)
    for T in (1, 3):
        x = r.standard_normal((T, D)).astype(np.float32)
        y = OQ.expert_ffn(emu, x, *gate, *up, *down, bits, gs)
        ref = REF.expert_ffn(x, *gate, *up, *down, bits, gs)
        assert y.dtype == np.float32 and y.shape == (T, D)
        assert np.abs(y - ref).max() <= 2e-5 * np.abs(ref).max(), (bits, gs, T)
        # the record path: the same weights laid out as a routed expert's record
        lay = record_layout(MoeShape(1, 1, 1, D, I), dict(zip(("gate", "up", "down"), (gb, ub, db))), gs)
        rec = fill_record(lay, {"gate": gate, "up": up, "down": down})
        assert np.array_equal(OQ.expert_ffn_record(emu, x, rec, lay), y)


@pytest.fixture(scope="module")
def packed_model(mlx_ckpt, tmp_path_factory):
    """The session's tiny qwen3_5_moe checkpoint packed at 2 bits (requantized from 4), group 64."""
    from moepack.convert import convert
    from moepack.layout.reader import PackedModel

    out = tmp_path_factory.mktemp("metal-quant") / "packed"
    convert(str(mlx_ckpt), out, bits=2, progress=False)
    with PackedModel(out) as pm:
        yield pm


def expert_ref(pm, layer, rec, x):
    """kernels_ref.expert_ffn on the nine typed views of one raw record."""
    lay = pm.layout(layer)
    a = pm.expert_arrays(layer, rec)
    bits = tuple(lay.proj_bits(p) for p in ("gate", "up", "down"))
    parts = (a[f"{p}.{q}"] for p in ("gate", "up", "down") for q in ("weight", "scales", "biases"))
    return REF.expert_ffn(x, *parts, bits, lay.component("gate.weight").group_size)


def test_expert_ffn_from_a_real_packed_record(emu, packed_model):
    pm = packed_model
    layer = pm.manifest.layers[0].layer
    lay = pm.layout(layer)
    recs = pm.read_records(layer, 0, 3)  # [3, record_size]: what pread puts in the expert buffer
    x = rng("packed").standard_normal((2, pm.manifest.moe.hidden)).astype(np.float32)
    for e in (0, 2):
        ref = expert_ref(pm, layer, recs[e], x)
        y = OQ.expert_ffn_record(emu, x, recs[e], lay)
        assert np.abs(y - ref).max() <= 2e-5 * np.abs(ref).max(), e


def test_a_batch_of_experts_in_one_pair_of_dispatches(emu, packed_model):
    # 3 records read with one pread: two dispatches (grid.z = 3) give what three single-expert runs give,
    # bit for bit, with x shared by the experts or one x per expert
    pm = packed_model
    layer = pm.manifest.layers[-1].layer
    lay = pm.layout(layer)
    recs = pm.read_records(layer, 1, 3)
    D = pm.manifest.moe.hidden
    r = rng("batch")
    x = r.standard_normal((2, D)).astype(np.float32)
    ds = OQ.expert_ffn_record_dispatch(x, recs, lay)
    assert len(ds) == 2 and all(d.grid[2] == 3 for d in ds)
    y = OQ.expert_ffn_record(emu, x, recs, lay)
    assert y.shape == (3, 2, D)
    for e in range(3):
        assert np.array_equal(y[e], OQ.expert_ffn_record(emu, x, recs[e], lay)), e
    xs = r.standard_normal((3, 2, D)).astype(np.float32)
    y = OQ.expert_ffn_record(emu, xs, recs, lay)
    for e in range(3):
        ref = expert_ref(pm, layer, recs[e], xs[e])
        assert np.abs(y[e] - ref).max() <= 2e-5 * np.abs(ref).max(), e


def test_one_decode_step_of_the_moe_block(emu, packed_model):
    # routed experts (one batch) -> moe_combine with the sigmoid-gated shared expert and the residual,
    # against the numpy model code's order: y = gate * shared; y += w_k * expert_k(x); h + y
    pm = packed_model
    layer = pm.manifest.layers[0].layer
    lay = pm.layout(layer)
    D = pm.manifest.moe.hidden
    r = rng("decode")
    chosen = [5, 1, 6]  # the router's top-k for this token
    recs = np.stack([pm.read_record(layer, e) for e in chosen])  # [K, record_size]
    x = r.standard_normal((1, D)).astype(np.float32)
    residual = r.standard_normal((1, D)).astype(np.float32)
    w = np.array([[0.5, 0.3, 0.2]], np.float32)
    shared, logit = r.standard_normal((1, D)).astype(np.float32), np.array([0.7], np.float32)
    y = np.empty((len(chosen), 1, D), np.float32)  # [K, T=1, D] == moe_combine's [T=1, K, D]
    out = np.empty((1, D), np.float32)
    plan = OQ.expert_ffn_record_dispatch(x, recs, lay, out=y)
    plan += OQ.moe_combine_dispatch(residual, y.reshape(1, len(chosen), D), w, shared, logit, out=out)
    emu.run(plan)  # one command buffer: gate/up, down, combine
    ref = np.float32(1) / (np.float32(1) + np.exp(-logit)) * shared
    for k, rec in enumerate(recs):
        ref = ref + w[0, k] * expert_ref(pm, layer, rec, x)
    ref = residual + ref
    assert np.abs(out - ref).max() <= 2e-5 * np.abs(ref).max()


# ---------------------------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qembedding_bit_identical(emu, bits):
    for gs in (32, 64, 128):
        r = rng("embed", bits, gs)
        table = qweights(r, 50, 384, bits, gs, std=1.0)
        ids = r.integers(0, 50, size=5)
        e = OQ.qembedding(emu, ids, *table, bits, gs)
        assert e.dtype == np.float32 and e.shape == (5, 384)
        assert np.array_equal(e.view(np.uint32), REF.qembedding(ids, *table, bits, gs).view(np.uint32)), gs


# ---------------------------------------------------------------------------------------------- MoE combine


@pytest.mark.parametrize("shared", [False, True])
def test_moe_combine(emu, shared):
    r = rng("combine", shared)
    T, K, D = 3, 4, 300  # D not a multiple of the 256-thread groups
    res = r.standard_normal((T, D)).astype(np.float32)
    y = r.standard_normal((T, K, D)).astype(np.float32)
    w = r.random((T, K)).astype(np.float32)
    sh = r.standard_normal((T, D)).astype(np.float32) if shared else None
    logit = np.array([-3.0, 0.5, 40.0], np.float32) if shared else None
    out = OQ.moe_combine(emu, res, y, w, sh, logit)
    # independent float64 expression
    terms = w.astype(np.float64)[:, :, None] * y
    ref = res + terms.sum(axis=1)
    scale = np.abs(res) + np.abs(terms).sum(axis=1)
    if shared:
        gated = sh / (1 + np.exp(-logit.astype(np.float64)))[:, None]
        ref, scale = ref + gated, scale + np.abs(gated)
    assert np.abs(out - ref).max() <= 1e-6 * scale.max()
    assert np.abs(out - OQ.moe_combine_ref(res, y, w, sh, logit)).max() <= 1e-6 * scale.max()
    # in place: out is the residual buffer
    emu.run(OQ.moe_combine_dispatch(res, y, w, sh, logit, out=res))
    assert np.array_equal(res, out)

"""The CPU emulator of the Metal kernels: fixtures in tests/metal_fixtures/ run and match numpy, and the
emulator catches what a Mac would do differently (missing barrier, early return before a barrier, C++17,
address-space misuse, divergent simd collectives, wrong dtypes)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from moepack.runtime.metal import Dispatch
from moepack.runtime.metal.emulator import Emulator, EmulatorError
from moepack.runtime.metal.emulator.build import clang
from moepack.runtime.metal.emulator.library import Library
from moepack.runtime.metal.signature import parse_kernels

FIX = Path(__file__).parent / "metal_fixtures"

try:
    clang()
except EmulatorError:  # pragma: no cover - CI installs clang-19 (.ci/run)
    pytest.skip("clang >= 19 not installed", allow_module_level=True)


def fx(name: str) -> str:
    return str(FIX / name)


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
@pytest.mark.parametrize("strict", [False, True])
def test_row_reduction_matches_numpy(schedule, strict):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    sums = np.zeros(3, np.float32)
    emu = Emulator(schedule=schedule, strict_address_spaces=strict, strict_simd=strict, seed=7)
    emu.run([Dispatch(fx("reduce.metal"), "row_sumsq", {0: x, 1: sums, 2: 300}, (3, 1, 1), (96, 1, 1))])
    np.testing.assert_allclose(sums, (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)


def test_ucontext_fallback_matches(monkeypatch):
    """Hosts other than x86-64 switch fibers with ucontext instead of the assembly switch."""
    from moepack.runtime.metal.emulator import library

    monkeypatch.setattr(library, "CPU_FLAGS", library.CPU_FLAGS + ["-DMOEPACK_EMU_UCONTEXT"])
    x = np.random.default_rng(8).standard_normal((2, 100)).astype(np.float32)
    sums = np.zeros(2, np.float32)
    lib = library.Library.load(fx("reduce.metal"))
    for schedule in (0, 2):
        lib.launch(Dispatch(fx("reduce.metal"), "row_sumsq", {0: x, 1: sums, 2: 100}, (2, 1, 1), (64, 1, 1)), schedule, 1, True)
        np.testing.assert_allclose(sums, (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)


def test_builtins_in_3d_geometry():
    grid, tg = (2, 3, 1), (4, 2, 5)  # 40 threads per group: one full and one partial simdgroup
    T = [g * t for g, t in zip(grid, tg)]
    out = np.zeros((T[2], T[1], T[0], 24), np.uint32)
    Emulator(schedule="random").run([Dispatch(fx("builtins.metal"), "builtins", {0: out}, grid, tg)])
    z, y, x = np.meshgrid(np.arange(T[2]), np.arange(T[1]), np.arange(T[0]), indexing="ij")
    pos = np.stack([x, y, z], -1)
    local = pos % tg
    lin = local[..., 0] + tg[0] * (local[..., 1] + tg[1] * local[..., 2])
    np.testing.assert_array_equal(out[..., 0:3], pos)
    np.testing.assert_array_equal(out[..., 3:6], local)
    np.testing.assert_array_equal(out[..., 6:9], pos // tg)
    np.testing.assert_array_equal(out[..., 9:12], np.broadcast_to(tg, pos.shape))
    np.testing.assert_array_equal(out[..., 12:15], np.broadcast_to(grid, pos.shape))
    np.testing.assert_array_equal(out[..., 15:18], np.broadcast_to(T, pos.shape))
    np.testing.assert_array_equal(out[..., 18], lin)
    np.testing.assert_array_equal(out[..., 19], lin % 32)
    np.testing.assert_array_equal(out[..., 20], lin // 32)
    assert (out[..., 21] == 2).all() and (out[..., 23] == 32).all()
    np.testing.assert_array_equal(out[..., 22], x + 1000 * y)


def test_multi_argument_vector_constructor():
    x = np.arange(32, dtype=np.float32)
    out = np.zeros_like(x)
    Emulator().run([Dispatch(fx("reduce.metal"), "scale_first", {0: x, 1: out, 2: 3.0}, (2, 1, 1), (4, 1, 1))])
    want = x.reshape(8, 4).copy()
    want[:, 0] *= 3
    np.testing.assert_array_equal(out, want.reshape(-1))


def _tg_sum(kernel: str, schedule: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.random(4 * 64).astype(np.float32)
    out = np.zeros(4, np.float32)
    Emulator(schedule=schedule).run([Dispatch(fx("barrier.metal"), kernel, {0: x, 1: out}, (4, 1, 1), (64, 1, 1))])
    return out, x.reshape(4, 64).astype(np.float64).sum(1)


def test_missing_barrier_is_caught_by_some_schedule():
    errors = {}
    for schedule in ("forward", "reverse"):
        got, want = _tg_sum("tg_sum_with_barrier", schedule)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        got, want = _tg_sum("tg_sum_missing_barrier", schedule)
        errors[schedule] = np.nan_to_num(np.abs(got - want), nan=np.inf).max()
    # thread 0 runs first under "forward" and sums garbage (NaN); under "reverse" it happens to be right
    assert errors["forward"] > 1.0
    assert errors["reverse"] < 1e-4


def test_uninitialised_threadgroup_memory_reads_garbage():
    out = np.zeros(32, np.float32)
    Emulator().run([Dispatch(fx("limits.metal"), "read_uninitialised", {0: out}, (1, 1, 1), (32, 1, 1))])
    assert np.isnan(out).all()


def test_early_return_before_barrier_is_an_error():
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    d = Dispatch(fx("barrier.metal"), "early_return", {0: x, 1: out, 2: 40}, (1, 1, 1), (64, 1, 1))
    with pytest.raises(EmulatorError, match=r"early_return.*returned while other threads wait.*line 41"):
        Emulator().run([d])
    # with every thread inside the bound the same kernel is fine
    Emulator().run([Dispatch(fx("barrier.metal"), "early_return", {0: x, 1: out, 2: 64}, (1, 1, 1), (64, 1, 1))])
    np.testing.assert_array_equal(out, x[::-1])


def test_divergent_barrier_is_an_error():
    out = np.zeros(64, np.float32)
    with pytest.raises(EmulatorError, match="different barriers.*divergent"):
        Emulator(schedule="reverse").run([Dispatch(fx("barrier.metal"), "divergent_barrier", {0: out}, (1, 1, 1), (64, 1, 1))])


def test_cxx17_construct_fails_to_compile():
    with pytest.raises(EmulatorError, match=r"cxx17\.metal.*compile failed.*cxx17\.metal:6:.*C\+\+17") as e:
        Emulator().library(fx("cxx17.metal"))
    assert "if constexpr" in e.value.log


def test_strict_address_spaces_reject_what_lax_mode_accepts():
    out = np.zeros(32, np.float32)
    d = Dispatch(fx("address_space.metal"), "misuse", {0: out}, (1, 1, 1), (32, 1, 1))
    Emulator().run([d])  # lax: address-space words are empty, so this compiles and even works
    np.testing.assert_array_equal(out, np.arange(32, dtype=np.float32)[::-1])
    with pytest.raises(EmulatorError, match=r"address_space\.metal.*compile failed.*store_all"):
        Emulator(strict_address_spaces=True).run([d])


def test_strict_simd_rejects_divergent_collective():
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    d = Dispatch(fx("simd_ops.metal"), "divergent_simd", {0: x, 1: out}, (2, 1, 1), (32, 1, 1))
    Emulator().run([d])  # lax: Metal's rule, the 16 lanes that reached the call form the active set
    lanes = np.arange(64) % 32
    want = np.where(lanes < 16, np.repeat([x[:16].sum(), x[32:48].sum()], 32), -1.0)
    np.testing.assert_array_equal(out, want)
    with pytest.raises(EmulatorError, match=r"simd_sum at line 47 ran with 16 of 32 lanes"):
        Emulator(strict_simd=True).run([d])


@pytest.mark.parametrize("schedule", ["forward", "random"])
def test_simd_collectives_match_numpy(schedule):
    n = 128
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    out = np.zeros(6 * 4096, np.float32)
    lanes = np.zeros(n, np.uint32)
    Emulator(schedule=schedule, strict_simd=True).run(
        [Dispatch(fx("simd_ops.metal"), "simd_collectives", {0: x, 1: out, 2: lanes}, (2, 1, 1), (64, 1, 1))])
    xs = x.reshape(-1, 32)
    idx = np.arange(32)
    blocks = out.reshape(6, 4096)[:, :n]
    np.testing.assert_allclose(blocks[0], np.repeat(xs.astype(np.float64).sum(1), 32), rtol=1e-5)
    np.testing.assert_array_equal(blocks[1], np.repeat(xs.max(1), 32))
    np.testing.assert_array_equal(blocks[2], xs[:, idx ^ 1].reshape(-1))
    down = np.where(idx + 3 < 32, np.minimum(idx + 3, 31), idx)  # out of range: own value
    np.testing.assert_array_equal(blocks[3], xs[:, down].reshape(-1))
    np.testing.assert_array_equal(blocks[4], np.repeat(xs[:, 5], 32))
    np.testing.assert_allclose(blocks[5], np.cumsum(xs.astype(np.float64), axis=1).reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(lanes, np.tile(idx + 100 * idx, n // 32))


def test_vector_half_bfloat_types():
    a = np.array([[1.5, -2.0, 0.1, 3.14159], [1e-3, 7.0, 65504.0, -1e20]], np.float32)
    y = np.zeros_like(a)
    h = np.zeros(2, np.float16)
    b = np.zeros(2, np.uint16)
    bits = np.zeros(2, np.uint32)
    Emulator().run([Dispatch(fx("simd_ops.metal"), "vector_types", {0: a, 1: y, 2: h, 3: b, 4: bits}, (2, 1, 1), (1, 1, 1))])
    bf = lambda v: ((v.view(np.uint32) + 0x7FFF + ((v.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)  # noqa: E731
    np.testing.assert_array_equal(y[:, :2], a[:, :2] * 2)
    np.testing.assert_array_equal(y[:, 2], a[:, 2].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(b, bf(a[:, 3].copy()))
    np.testing.assert_array_equal(y[:, 3], (b.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_array_equal(h, a[:, 2].astype(np.float16) + np.float16(1))
    np.testing.assert_array_equal(bits, a[:, 0].view(np.uint32))


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_matvec_matches_numpy(schedule):
    rng = np.random.default_rng(4)
    rows, cols = 24, 1280  # two x chunks, a partial last threadgroup
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    y = np.zeros(rows, np.float32)
    Emulator(schedule=schedule).run(
        [Dispatch(fx("matvec.metal"), "matvec_f32", {0: W, 1: x, 2: y, 3: rows, 4: cols}, (3, 1, 1), (256, 1, 1))])
    np.testing.assert_allclose(y, W.astype(np.float64) @ x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strict", [False, True])
def test_language_surface_matches_numpy(strict):
    n = 64
    x = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    x[0] = 0.0
    out = np.zeros(8 * n, np.float32)
    Emulator(strict_address_spaces=strict).run(
        [Dispatch(fx("language.metal"), "language", {0: x, 1: out, 2: n}, (2, 1, 1), (32, 1, 1))])
    o = out.reshape(8, n)
    g = np.arange(n)
    xd = x.astype(np.float64)
    np.testing.assert_allclose(o[0], x * np.array([0.5, 1, 2, 4], np.float32)[g & 3], rtol=1e-6)
    np.testing.assert_allclose(o[1], np.exp(xd) + np.sqrt(np.abs(xd)), rtol=1e-5)
    np.testing.assert_array_equal(o[2], g - 20.0 + (g - 2 + 3 - 4))
    np.testing.assert_array_equal(o[3], (x.astype(np.float16) * np.float16(1.5)).astype(np.float32))
    np.testing.assert_allclose(o[4], np.where(x > 0, 1, -1) * np.clip(np.abs(x), 0.25, 1.0), rtol=1e-6)
    np.testing.assert_array_equal(o[5], x.view(np.float16)[1::2].astype(np.float32))
    np.testing.assert_array_equal(o[6], 2 * np.maximum(x, 0) + np.minimum(g, 7).astype(np.float32))
    np.testing.assert_allclose(o[7], np.tanh(xd) + 1 / np.sqrt(1 + xd * xd) + np.floor(x * np.float32(3)) + (x == 0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["forward", "random"])
def test_atomics_histogram(schedule):
    v = np.random.default_rng(5).integers(0, 16, 256).astype(np.uint32)
    hist = np.zeros(16, np.uint32)
    vmax = np.zeros(1, np.uint32)
    Emulator(schedule=schedule, strict_address_spaces=True).run(
        [Dispatch(fx("atomics.metal"), "histogram16", {0: v, 1: hist, 2: vmax}, (4, 1, 1), (64, 1, 1))])
    np.testing.assert_array_equal(hist, np.bincount(v, minlength=16))
    assert vmax[0] == v.max()
    with pytest.raises(EmulatorError, match="int32 does not match.*uint32"):
        Emulator().run([Dispatch(fx("atomics.metal"), "histogram16", {0: v, 1: hist.astype(np.int32), 2: vmax},
                                 (4, 1, 1), (64, 1, 1))])


def test_dtype_and_argument_errors_are_clear():
    x = np.zeros((2, 64), np.float32)
    sums = np.zeros(2, np.float32)
    run = lambda args: Emulator().run([Dispatch(fx("reduce.metal"), "row_sumsq", args, (2, 1, 1), (32, 1, 1))])  # noqa: E731
    with pytest.raises(EmulatorError, match=r"row_sumsq, buffer\(0\) 'x'.*float64 does not match.*float32") as e:
        run({0: x.astype(np.float64), 1: sums, 2: 64})
    assert "astype(np.float32)" in e.value.hint
    with pytest.raises(EmulatorError, match=r"missing argument for \[\[buffer\(2\)\]\] 'n'"):
        run({0: x, 1: sums})
    with pytest.raises(EmulatorError, match=r"no \[\[buffer\(7\)\]\]"):
        run({0: x, 1: sums, 2: 64, 7: 1})
    with pytest.raises(EmulatorError, match="writes this buffer but the array is read-only"):
        ro = sums.copy()
        ro.flags.writeable = False
        run({0: x, 1: ro, 2: 64})
    with pytest.raises(EmulatorError, match="got the float"):
        run({0: x, 1: sums, 2: 64.0})
    with pytest.raises(EmulatorError, match="not C-contiguous"):
        run({0: np.zeros((64, 2), np.float32).T, 1: sums, 2: 64})
    with pytest.raises(EmulatorError, match="has no kernel 'nope'"):
        Emulator().run([Dispatch(fx("reduce.metal"), "nope", {}, (1, 1, 1), (1, 1, 1))])


def test_runtime_faults_become_errors():
    out = np.zeros(64, np.float32)
    with pytest.raises(EmulatorError, match="exceeds Metal's 32 KiB"):
        Emulator().run([Dispatch(fx("limits.metal"), "too_much_threadgroup", {0: out}, (1, 1, 1), (32, 1, 1))])
    with pytest.raises(EmulatorError, match=r"wild_write: invalid memory access.*thread \(0,0,0\)"):
        Emulator().run([Dispatch(fx("limits.metal"), "wild_write", {0: out, 1: 1 << 44}, (1, 1, 1), (1, 1, 1))])
    # the process is still healthy afterwards
    test_multi_argument_vector_constructor()


def test_read_past_the_end_of_a_buffer_names_the_buffer():
    x = np.arange(50, dtype=np.float32)  # 200 bytes: the guard page starts right after the last element
    out = np.zeros(50, np.float32)
    d = Dispatch(fx("limits.metal"), "off_by_one", {0: x, 1: out}, (1, 1, 1), (50, 1, 1))
    with pytest.raises(EmulatorError, match=r"off_by_one: invalid memory access.*thread \(49,0,0\).*"
                                            r"0 bytes past the end of buffer\(0\) 'x' \(200 bytes\)"):
        Emulator().run([d])
    Emulator(guard_buffers=False).run([d])  # without guards the overrun silently reads the neighbour
    np.testing.assert_array_equal(out[:49], x[1:])


@pytest.mark.parametrize("guard", [True, False])
def test_one_array_at_two_indices_stays_one_buffer(guard):
    a = np.zeros(4, np.float32)
    Emulator(guard_buffers=guard).run([Dispatch(fx("limits.metal"), "alias_probe", {0: a, 1: a}, (1, 1, 1), (1, 1, 1))])
    np.testing.assert_array_equal(a, [5.0, 10.0, 0.0, 0.0])


def test_compile_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPACK_METAL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.metal"
    shutil.copy(FIX / "reduce.metal", src)
    first = Library.load(src)
    assert first.built
    mtime = first.so_path.stat().st_mtime_ns
    second = Library.load(src)  # a fresh load, as in a new process
    assert not second.built and second.so_path == first.so_path
    assert first.so_path.stat().st_mtime_ns == mtime
    emu = Emulator()
    assert emu.library(src) is emu.library(src)
    src.write_text(src.read_text().replace("v.x * s", "v.x * s * 2.0f"))
    assert Library.load(src).built  # a changed source rebuilds


def test_signature_parsing():
    src = """
    #include <metal_stdlib>
    using namespace metal;
    // kernel void commented_out(device float* x [[buffer(0)]]) {}
    kernel void k(device const float4* a [[buffer(0)]], const device bfloat* b [[buffer(2)]],
                  constant uint& n [[buffer(1)]], uint3 gid [[thread_position_in_grid]]) {}
    """
    sigs = parse_kernels(src, "t.metal")
    assert list(sigs) == ["k"]
    a, b, n, gid = sigs["k"].params
    assert (a.index, a.base, a.width, a.dtype, a.writable) == (0, "float4", 4, np.float32, False)
    assert (b.index, b.dtype, b.const, b.address_space) == (2, np.uint16, True, "device")
    assert (n.kind, n.index, n.dtype) == ("scalar", 1, np.uint32)
    assert (gid.kind, gid.builtin, gid.base) == ("builtin", "thread_position_in_grid", "uint3")
    with pytest.raises(EmulatorError, match="no \\[\\[buffer\\(n\\)\\]\\] or builtin attribute"):
        parse_kernels("kernel void f(device float* x) {}", "t.metal")
    with pytest.raises(EmulatorError, match="is a template"):
        parse_kernels("template <int B>\nkernel void f(device float* x [[buffer(0)]]) {}", "t.metal")
    macro = ("#define K(B) \\\n  kernel void k_b##B(device float* y [[buffer(0)]], \\\n"
             "                    uint i [[thread_position_in_grid]]) { y[i] = B; }\nK(2)\nK(4)\n")
    assert list(parse_kernels(macro, "t.metal")) == ["k_b2", "k_b4"]  # no preprocessor needed (macOS executor)
    with pytest.raises(EmulatorError, match="used by both"):
        parse_kernels("kernel void f(device float* x [[buffer(0)]], device float* y [[buffer(0)]]) {}", "t.metal")


# ---------------------------------------------------------------------------------------------- PTX
from moepack.runtime.metal import ptx as ptx_mod  # noqa: E402
from moepack.runtime.metal.sources import kernel_dir  # noqa: E402

REAL_FILES = ["quant.metal", "norm.metal", "rope.metal", "attention.metal", "linear_attention.metal", "router.metal"]


@pytest.mark.parametrize("name", ["reduce.metal", "simd_ops.metal", "barrier.metal", "matvec.metal", "atomics.metal",
                                  "language.metal", "builtins.metal"])
def test_fixture_compiles_to_ptx(name):
    mod = ptx_mod.compile_ptx(fx(name))
    for k in mod.kernels.values():
        assert f".visible .entry {k.name}(" in mod.ptx
        n_params = sum(1 for p in k.signature.params if p.kind != "builtin")
        assert mod.ptx.count(f"{k.name}_param_") >= n_params
    assert ".extern" not in mod.ptx  # everything resolved: no libdevice, no CUDA toolkit
    if name == "reduce.metal":
        assert "shfl.sync.bfly" in mod.ptx and "bar.sync" in mod.ptx and ".shared" in mod.ptx
        k = mod.kernels["row_sumsq"]
        assert [(p.index, p.kind, p.dtype) for p in k.params] == [
            (0, "pointer", np.float32), (1, "pointer", np.float32), (2, "scalar", np.uint32)]
        x, s = np.zeros(4, np.float32), np.zeros(1, np.float32)
        args = k.launch_args({0: x, 1: s, 2: 4})
        assert args[0] is x and args[2] == np.uint32(4) and args[2].dtype == np.uint32


def test_ptx_rejects_cxx17():
    with pytest.raises(EmulatorError, match=r"PTX.*C\+\+17"):
        ptx_mod.compile_ptx(fx("cxx17.metal"))


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_kernel_file_compiles_to_ptx_and_for_the_emulator(name):
    path = kernel_dir() / name
    if not path.exists():
        pytest.skip(f"metal/{name} not written yet")
    mod = ptx_mod.compile_ptx(path)
    lib = Emulator(strict_address_spaces=True).library(path)
    assert set(mod.kernels) == set(lib.kernels) and mod.kernels
    assert ".extern" not in mod.ptx

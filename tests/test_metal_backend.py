"""The Metal kernels as a runtime backend: whole models through the emulated kernels vs the numpy reference,
the launch plan, `moepack selftest`, `moepack run --backend metal-emu`, and the executors' error paths.

Tolerance: the emulated Metal kernels and the numpy reference both compute in float32 with different
summation orders; over prefill + one decode step of the tiny checkpoints the measured max |logit diff| is
5e-7..7e-6 of the largest |logit| (all three architectures, 4- and 2-bit), so REL_TOL = 1e-4 (as the
mlx-lm parity tests) has a >10x margin and still catches a wrong kernel (errors of 1e-3..1).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from moepack.convert import convert
from moepack.errors import MoepackError
from moepack.runtime.model import load_model
from moepack.testing.fixtures import write_mlx_checkpoint
from moepack.testing.parity import greedy_logits

if shutil.which("clang-19") is None and shutil.which("clang-20") is None:
    pytest.skip("clang-19 is needed to compile the .metal kernels (apt-get install -y clang-19)",
                allow_module_level=True)

REL_TOL = 1e-4
PROMPT = np.array([1, 37, 200, 5, 88, 410, 17, 3])


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("metal-backend")
    out = {}
    for arch in ("qwen3_5_moe", "qwen3_next", "qwen3_moe"):
        src = write_mlx_checkpoint(d / f"src-{arch}", arch=arch, bits=4, seed=2)
        for bits in (4, 2) if arch == "qwen3_5_moe" else (4,):
            dst = d / f"{arch}-{bits}"
            convert(src, dst, bits=bits, progress=False)
            out[(arch, bits)] = dst
    return out


def _run(path, backend, n_decode=2):
    """Logits of the prompt's prefill and `n_decode` greedy steps, the greedy tokens, the kernel module."""
    return greedy_logits(path, backend, PROMPT, n_decode)


@pytest.mark.parametrize("arch,bits", [("qwen3_5_moe", 4), ("qwen3_5_moe", 2), ("qwen3_next", 4), ("qwen3_moe", 4)])
def test_model_through_emulated_kernels_matches_numpy(packed, arch, bits):
    ref, ref_toks, _ = _run(packed[(arch, bits)], "numpy")
    got, got_toks, gk = _run(packed[(arch, bits)], "metal-emu")
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        assert np.abs(a - b).max() / np.abs(b).max() < REL_TOL
    assert got_toks == ref_toks
    assert gk.cpu_fallbacks == 0
    kernels = {x.kernel for x in gk.log.launches}
    # routed experts go through the record kernels (the raw pread buffer, components at their offsets)
    assert f"gate_up_swiglu_rec_b{bits}" in kernels and f"qmv_rec_b{bits}" in kernels
    assert "router_topk_f32" in kernels and "rmsnorm_f32" in kernels
    if arch != "qwen3_moe":
        assert {"gated_delta_f32", "conv1d_step_f32", "gated_rmsnorm_f32"} <= kernels
    assert "attention_f32" in kernels and "rope_f32" in kernels


def test_reverse_schedule_gives_the_same_model_output(packed, monkeypatch):
    fwd, _, _ = _run(packed[("qwen3_5_moe", 4)], "metal-emu", n_decode=1)
    monkeypatch.setenv("MOEPACK_EMU_SCHEDULE", "reverse")
    rev, _, gk = _run(packed[("qwen3_5_moe", 4)], "metal-emu", n_decode=1)
    assert gk.executor.schedule == "reverse"
    for a, b in zip(fwd, rev):
        assert np.abs(a - b).max() / np.abs(b).max() < REL_TOL


def test_launch_plan_checks_and_groups_every_dispatch(packed):
    from moepack.runtime.metal.plan import format_plan, launch_plan

    path = packed[("qwen3_5_moe", 2)]
    plan = launch_plan(path, tokens=3)
    with load_model(path, backend="numpy") as m:
        n_layers = len(m.decoder.layers)
        k = m.experts_per_token
        row = -(-m.packed.layout(0).record_size // (2 << 20)) * (2 << 20)  # the reader's 2 MiB-aligned rows
    phases = [(cb["layer"], cb["phase"]) for cb in plan["decode"]]
    want = [(None, "embed")] + [(i, p) for i in range(n_layers) for p in ("attention", "routing", "experts")] + \
        [(None, "head")]
    assert phases == want
    assert plan["decode_launches"] == sum(len(cb["launches"]) for cb in plan["decode"])
    # per MoE layer in decode: the K routed experts in one fused gate/up launch and one down launch, straight
    # from the reader's record rows (uint8 [K, row]), then one moe_combine onto the shared expert's part
    for cb in plan["decode"]:
        if cb["phase"] == "experts":
            names = [x["kernel"] for x in cb["launches"]]
            assert names.count("gate_up_swiglu_rec_b2") == 1 and names.count("qmv_rec_b2") == 1
            assert names[-1] == "moe_combine"
            rec = next(x for x in cb["launches"] if x["kernel"] == "gate_up_swiglu_rec_b2")["buffers"]["1"]
            assert rec == f"uint8[{k * row}]"  # the K rows, flattened
    # the prefill (3 tokens routed to different experts) keeps one launch pair per expert
    assert plan["prefill_launches"] > plan["decode_launches"]
    text = format_plan(plan)
    assert "router_topk_f32" in text and "layer 0" in text


def test_plan_executor_rejects_a_wrong_dispatch():
    from moepack.runtime.metal.dispatch import Dispatch, KernelError
    from moepack.runtime.metal.plan import PlanExecutor

    x = np.zeros((1, 64), np.float32)
    w = np.ones(64, np.float32)
    ok = Dispatch("norm.metal", "rmsnorm_f32", {0: x, 1: w, 2: x.copy(), 3: 64, 4: 1e-6, 5: 64, 6: 64}, (1, 1, 1),
                  (32, 1, 1))
    PlanExecutor().run([ok])
    bad_dtype = Dispatch(ok.source, ok.kernel, {**ok.args, 0: x.astype(np.float64)}, ok.grid, ok.threadgroup)
    missing = Dispatch(ok.source, ok.kernel, {i: v for i, v in ok.args.items() if i != 3}, ok.grid, ok.threadgroup)
    too_big = Dispatch(ok.source, ok.kernel, ok.args, ok.grid, (2048, 1, 1))
    for d in (bad_dtype, missing, too_big):
        with pytest.raises(KernelError):
            PlanExecutor().run([d])


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "moepack", *args], capture_output=True, text=True, env=env)


def test_run_cli_metal_emu_matches_numpy(packed):
    path = str(packed[("qwen3_5_moe", 4)])
    common = ["run", path, "--prompt-ids", "1,37,200,5", "--max-tokens", "3", "--temperature", "0", "--json"]
    a = _cli(*common, "--backend", "numpy")
    b = _cli(*common, "--backend", "metal-emu")
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["tokens"] == jb["tokens"] and len(jb["tokens"]) == 3
    assert jb["stats"]["backend"] == "metal-emu"


def test_selftest_cli_on_the_emulator():
    r = _cli("selftest", "--backend", "metal-emu", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["failed"] == 0 and rep["passed"] == len(rep["cases"]) >= 22
    ops = {c["op"] for c in rep["cases"]}  # glue.metal (the resident decode step) is checked too
    assert {"add", "swiglu", "sigmoid_gate", "gdn_gates", "l2norm_scale", "gather", "matvec bf16 weights"} <= ops
    assert all(c["ok"] and c["max_rel_err"] <= c["tolerance"] for c in rep["cases"])
    assert rep["environment"]["executor"] == "metal-emu"


def test_selftest_reports_a_broken_kernel(monkeypatch):
    """A kernel that computes the wrong thing is a FAIL row, not a crash and not a pass."""
    from moepack.runtime.metal import ops_seq, selftest
    from moepack.runtime.metal.emulator import Emulator

    real = ops_seq.rmsnorm

    def broken(ex, x, w, eps):
        return real(ex, x, w, eps) * np.float32(1.01)

    monkeypatch.setattr(ops_seq, "rmsnorm", broken)
    res = {r.op: r for r in selftest.run_selftest(Emulator())}
    assert not res["rmsnorm"].ok and res["rmsnorm"].max_rel_err > 1e-3
    assert res["attention"].ok


def test_selftest_environment_carries_the_executors_description():
    # what a first Mac user pastes into an issue: the executor's own description (the Metal one reports the
    # GPU, unified memory, whether no-copy buffers wrap in place), and still a report if describing fails
    from moepack.runtime.metal.selftest import environment

    class Described:
        name = "described"

        def describe(self):
            return {"nocopy_in_place": True}

    class Broken:
        name = "broken"

        def describe(self):
            raise RuntimeError("no GPU name")

    assert environment(Described())["nocopy_in_place"] is True
    env = environment(Broken())
    assert env["executor"] == "broken" and env["describe_error"] == "RuntimeError: no GPU name"


def test_selftest_plan_cli(packed):
    r = _cli("selftest", "--plan", str(packed[("qwen3_moe", 4)]), "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["decode_launches"] > 0 and plan["cpu_fallbacks"] == 0


@pytest.mark.skipif(sys.platform == "darwin", reason="on a Mac the metal backend is real")
def test_metal_backend_off_macos_is_a_one_line_error(packed):
    r = _cli("run", str(packed[("qwen3_moe", 4)]), "--prompt-ids", "1,2", "--max-tokens", "1", "--backend", "metal")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "metal backend is not available" in r.stderr and "macOS" in r.stderr


def test_cuda_backend_without_a_gpu_is_a_one_line_error(packed):
    from moepack.runtime.metal.executor_cuda import available

    if available()[0]:
        pytest.skip("a CUDA GPU is present")
    r = _cli("run", str(packed[("qwen3_moe", 4)]), "--prompt-ids", "1,2", "--max-tokens", "1", "--backend", "cuda")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "cuda backend is not available" in r.stderr


def test_ptx_bundle_export_and_staleness(tmp_path, monkeypatch):
    from moepack.runtime.metal import executor_cuda, sources
    from moepack.runtime.metal.dispatch import KernelError

    files = executor_cuda.export_bundle(tmp_path / "bundle")
    stems = {p.stem for p in sources.list_sources()}
    assert {p.stem for p in files} == stems
    meta = json.loads((tmp_path / "bundle" / "quant.json").read_text())
    assert "qmv_b4" in meta["kernels"] and ".entry qmv_b4(" in (tmp_path / "bundle" / "quant.ptx").read_text()
    # every kernel's launch parameters: the buffer indices of its signature, writable outputs marked
    out_params = [p for p in meta["kernels"]["qmv_b4"] if p["writable"]]
    assert len(out_params) == 1 and out_params[0]["kind"] == "pointer"
    monkeypatch.setenv(executor_cuda.ENV_BUNDLE, str(tmp_path / "bundle"))
    ptx, kernels = executor_cuda._load_bundle("quant.metal")
    assert set(kernels) == set(meta["kernels"])
    meta["sha256"] = "0" * 64
    (tmp_path / "bundle" / "quant.json").write_text(json.dumps(meta))
    with pytest.raises(KernelError, match="another version"):
        executor_cuda._load_bundle("quant.metal")


def test_unknown_executor_is_a_clear_error():
    from moepack.runtime.metal.executors import make_executor

    with pytest.raises(MoepackError, match="unknown executor"):
        make_executor("vulkan")


def test_metal_emu_without_clang_is_a_one_line_error(tmp_path):
    import os

    env = {**os.environ, "MOEPACK_CLANG": str(tmp_path / "no-such-clang")}
    r = _cli("selftest", "--backend", "metal-emu", env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "clang 19 or newer not found" in r.stderr and "apt-get install -y clang-19" in r.stderr

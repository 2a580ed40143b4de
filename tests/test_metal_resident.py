"""The device-resident decode step (moepack/runtime/metal/resident.py) and its glue kernels (metal/glue.metal).

Glue kernels against their numpy references (ops_glue.*_ref) under the emulator's forward and reverse
schedules, once with strict address spaces and once with strict all-lanes simd; persistent DeviceBuffers;
whole tiny models of the three architectures at 4 and 2 bits decoded through the resident step on the
emulator vs the numpy backend (REL_TOL as tests/test_metal_backend.py: measured 5e-7..4e-6 here), equal
greedy tokens, and the shape of a step: one read-back per MoE layer (the router's top-k) plus the logits.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from moepack.convert import convert
from moepack.runtime.metal import ops_glue as G
from moepack.runtime.model import load_model
from moepack.testing.fixtures import write_mlx_checkpoint

if shutil.which("clang-19") is None and shutil.which("clang-20") is None:
    pytest.skip("clang-19 is needed to compile the .metal kernels (apt-get install -y clang-19)",
                allow_module_level=True)

from moepack.runtime.metal.dispatch import DeviceBuffer, KernelError  # noqa: E402
from moepack.runtime.metal.emulator import Emulator  # noqa: E402

REL_TOL = 1e-4
PROMPT = np.array([1, 37, 200, 5, 88, 410, 17, 3])
RNG = np.random.default_rng(7)


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-30))


# ------------------------------------------------------------------------------------------- glue kernels

EMUS = {
    "forward": lambda: Emulator("forward"),
    "reverse": lambda: Emulator("reverse"),
    "strict-as": lambda: Emulator("random", strict_address_spaces=True, seed=3),
    "strict-simd": lambda: Emulator("reverse", strict_simd=True),
}


@pytest.fixture(params=list(EMUS), scope="module")
def emu(request):
    return EMUS[request.param]()


def _f(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def test_elementwise_glue_kernels_match_numpy(emu):
    a, b = _f(300), _f(300)
    assert _rel(G.add(emu, a, b), G.add_ref(a, b)) < 1e-6
    assert _rel(G.swiglu(emu, a, b), G.swiglu_ref(a, b)) < 1e-5
    x, gate = _f(5, 24), _f(5 * 48, scale=4.0)  # gated attention: per head [query 24 | gate 24]
    assert _rel(G.sigmoid_gate(emu, x, gate, 48, 24), G.sigmoid_gate_ref(x, gate, 48, 24)) < 1e-5
    src, idx = _f(97), RNG.integers(0, 97, 260).astype(np.int32)
    assert np.array_equal(G.gather(emu, src, idx), G.gather_ref(src, idx))
    # the Gated-DeltaNet gates, with logits far into both tails of sigmoid and softplus
    bb, aa = _f(40, scale=30.0), _f(40, scale=30.0)
    A, dt = np.exp(_f(40, scale=0.5)), _f(40)
    for got, want in zip(G.gdn_gates(emu, bb, aa, A, dt), G.gdn_gates_ref(bb, aa, A, dt)):
        assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("rows,D,rows_a", [(4, 64, 2), (3, 200, 1), (2, 1000, 2)])
def test_l2norm_scale_matches_numpy_and_the_model_formula(emu, rows, D, rows_a):
    x = _f(rows, D)
    got = G.l2norm_scale(emu, x, rows_a, D**-0.5, 1.0, 1e-6)
    assert _rel(got, G.l2norm_scale_ref(x, rows_a, D**-0.5, 1.0, 1e-6)) < 1e-5
    # what GatedDeltaNet computes for q (scale dk^-0.5) and k (scale 1) through an RMSNorm
    from moepack.runtime import kernels_ref

    inv = D**-0.5
    want = kernels_ref.rmsnorm(x, np.ones(D, np.float32), 1e-6 * inv * inv)
    want[:rows_a] *= np.float32(inv * inv)
    want[rows_a:] *= np.float32(inv)
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_float_weight_matvec_and_embedding_rows(emu, dtype):
    from moepack.quant.bf16 import f32_to_bf16

    w32 = _f(37, 100)
    w = {"F32": w32, "F16": w32.astype(np.float16), "BF16": f32_to_bf16(w32)}[dtype]
    x = _f(2, 100)
    assert _rel(G.matvec(emu, x, w, dtype), G.matvec_ref(x, w, dtype)) < 1e-5
    ids = np.array([3, 0, 36], np.int32)
    assert np.array_equal(G.embed_rows(emu, ids, w, dtype), G.embed_rows_ref(ids, w, dtype))


def test_device_buffers_views_upload_download():
    emu = Emulator()
    buf = emu.alloc((4, 8), np.float32)
    assert isinstance(buf, DeviceBuffer) and not emu.download(buf).any()  # zero-filled
    data = _f(4, 8)
    emu.upload(buf, data)
    row2 = buf.view(16, (8,))
    assert np.array_equal(emu.download(row2), data[2])
    # a kernel writes a view in place; the rest of the buffer is untouched
    emu.run(G.add_dispatch(row2, row2, row2, 8))
    want = data.copy()
    want[2] *= 2
    assert np.array_equal(emu.download(buf), want)
    ints = emu.alloc((6,), np.uint32)
    emu.upload(ints.view(0, (3,), np.int32), np.array([-1, 2, 3], np.int32))
    emu.upload(ints.view(3, (3,), np.float32), np.array([0.5, 1, 2], np.float32))
    got = emu.download(ints)
    assert got[:3].view(np.int32).tolist() == [-1, 2, 3] and got[3:].view(np.float32).tolist() == [0.5, 1, 2]
    with pytest.raises(KernelError):
        buf.view(30, (8,))  # past the end
    with pytest.raises(KernelError):
        buf.reshape(5, 8)


# ------------------------------------------------------------------------------------------- whole models

MODELS = [("qwen3_5_moe", 4), ("qwen3_5_moe", 2), ("qwen3_next", 4), ("qwen3_next", 2), ("qwen3_moe", 4),
          ("qwen3_moe", 2)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("metal-resident")
    out = {}
    for arch in ("qwen3_5_moe", "qwen3_next", "qwen3_moe"):
        src = write_mlx_checkpoint(d / f"src-{arch}", arch=arch, bits=4, seed=2)
        for bits in (4, 2) if arch != "qwen3_moe" else (4, 2, 3):
            out[(arch, bits)] = d / f"{arch}-{bits}"
            convert(src, out[(arch, bits)], bits=bits, progress=False)
    return out


def _decode(path, backend, n=3, env=None, monkeypatch=None):
    """Logits of the prefill and n greedy decode steps, the tokens, per-step counters, the synced cache."""
    with load_model(path, backend=backend) as m:
        cache = m.new_cache()
        logits = [m.forward(PROMPT, cache)]
        toks, steps = [], []
        for _ in range(n):
            toks.append(int(logits[-1][-1].argmax()))
            logits.append(m.forward(np.array([toks[-1]]), cache))
            if m.resident is not None:
                steps.append(dict(m.resident.last_step))
        m.sync_cache(cache)
        state = cache.state_dict()
        info = {"resident": m.resident, "error": m.resident_error, "layers": m.decoder.layers,
                "launches": [x.kernel for x in getattr(m.K, "log", None).launches] if backend != "numpy" else []}
    return logits, toks, steps, state, info


@pytest.fixture(scope="module")
def reference(packed):
    return {key: _decode(packed[key], "numpy") for key in MODELS}


@pytest.mark.parametrize("arch,bits", MODELS)
def test_resident_decode_matches_numpy(packed, reference, arch, bits):
    ref, ref_toks, _, ref_state, _ = reference[(arch, bits)]
    got, toks, steps, state, info = _decode(packed[(arch, bits)], "metal-emu")
    assert info["resident"] is not None, info["error"]
    for a, b in zip(got, ref):
        assert a.shape == b.shape and _rel(a, b) < REL_TOL
    assert toks == ref_toks
    # the cache brought back from the device continues exactly where the numpy one is
    assert set(state) == set(ref_state) and int(state["offset"]) == len(PROMPT) + 3
    for k in ref_state:
        assert state[k].shape == ref_state[k].shape, k
        if state[k].dtype == np.float32 and state[k].size:
            assert _rel(state[k], ref_state[k]) < REL_TOL, k
    # a step's structure: one command buffer ending in a read-back per MoE layer (router top-k), one more for
    # a shared expert while the reads fly, and the last one ending in the logits read-back
    layers = info["layers"]
    moe = sum(type(l.mlp).__name__ == "MoeBlock" for l in layers)
    shared = sum(getattr(l.mlp, "shared", None) is not None for l in layers)
    for s in steps:
        assert s["readbacks"] == moe + 1 == len(layers) + 1
        assert s["command_buffers"] == moe + shared + 1
    for s in steps[1:]:  # the first step also uploads the prefilled cache and the model's small vectors
        assert s["uploads"] == 3 + moe  # token id, position (int and float), per layer the expert weights
    assert steps[0]["uploads"] > 3 + moe
    kernels = set(info["launches"])
    assert {"add_f32", f"gate_up_swiglu_rec_b{bits}", "moe_combine_shared" if shared else "moe_combine"} <= kernels
    if arch != "qwen3_moe":
        assert {"l2norm_scale_f32", "gdn_gates_f32", "sigmoid_gate_f32", "gated_delta_f32"} <= kernels
    if arch == "qwen3_next":
        assert "gather_f32" in kernels


def test_state_dict_after_resident_steps_needs_no_explicit_sync(packed, reference, tmp_path):
    """Session.save / truncation read the cache through state_dict(), which pulls the device's newest state."""
    from moepack.runtime.session import Session, load_session

    ref_state = reference[("qwen3_5_moe", 4)][3]
    with load_model(packed[("qwen3_5_moe", 4)], backend="metal-emu") as m:
        s = Session.new(m)
        logits = m.forward(PROMPT, s.cache)
        for _ in range(3):
            logits = m.forward(np.array([int(logits[-1].argmax())]), s.cache)
        assert m.resident is not None and m.resident.dirty  # the host arrays are behind the device
        s.tokens = [0] * s.cache.offset
        s.save(tmp_path / "s.npz")  # no sync_cache() call
        state = load_session(tmp_path / "s.npz", m).cache.state_dict()
    for k in ref_state:
        if ref_state[k].dtype == np.float32 and ref_state[k].size:
            assert state[k].shape == ref_state[k].shape and _rel(state[k], ref_state[k]) < REL_TOL, k


def test_escape_hatch_and_unsupported_models_keep_the_old_path(packed, reference, monkeypatch):
    ref, ref_toks, *_ = reference[("qwen3_moe", 4)]
    monkeypatch.setenv("MOEPACK_RESIDENT", "0")
    got, toks, steps, _, info = _decode(packed[("qwen3_moe", 4)], "metal-emu", n=1)
    assert info["resident"] is None and steps == []
    assert all(_rel(a, b) < REL_TOL for a, b in zip(got, ref[:2])) and toks == ref_toks[:1]
    monkeypatch.delenv("MOEPACK_RESIDENT")
    # 3-bit experts have no kernel: the model says why and decodes through the kernel-module path
    ref3, toks3, *_ = _decode(packed[("qwen3_moe", 3)], "numpy", n=1)
    got3, gtoks3, steps3, _, info3 = _decode(packed[("qwen3_moe", 3)], "metal-emu", n=1)
    assert info3["resident"] is None and "3-bit" in info3["error"] and steps3 == []
    assert all(_rel(a, b) < REL_TOL for a, b in zip(got3, ref3)) and gtoks3 == toks3


def test_kv_growth_and_prefill_after_resident_steps(packed, monkeypatch):
    """Device KV buffers grow (rows copied on the device) and a prefill after resident steps continues from
    the synced host cache: same logits as numpy through the whole sequence."""
    from moepack.runtime.metal import resident

    monkeypatch.setattr(resident, "KV_STEP", 4)
    path = packed[("qwen3_5_moe", 4)]
    feed = [PROMPT[:3]] + [np.array([t]) for t in (9, 14, 2, 77, 5, 6)] + [np.array([40, 41, 42]), np.array([8])]
    out = {}
    for be in ("numpy", "metal-emu"):
        with load_model(path, backend=be) as m:
            cache = m.new_cache()
            out[be] = [m.forward(ids, cache) for ids in feed]
            if be == "metal-emu":
                copies = [x for x in m.K.log.launches if x.kernel == "copy_f32"]
                n_steps = m.resident.counters.steps
    # capacity 8 after the 3-token prompt; position 8 grows it (K and V of both attention layers copied)
    assert n_steps == 7 and len(copies) == 4
    for a, b in zip(out["metal-emu"], out["numpy"]):
        assert _rel(a, b) < REL_TOL


def test_generate_with_a_session_saves_the_device_state(packed, tmp_path):
    from moepack.runtime.generate import generate
    from moepack.runtime.session import Session, load_session

    path = packed[("qwen3_next", 4)]
    res = {}
    for be in ("numpy", "metal-emu"):
        with load_model(path, backend=be) as m:
            s = Session.new(m)
            g1 = generate(m, list(PROMPT), session=s, max_tokens=3)
            s.save(tmp_path / f"{be}.npz")
            s2 = load_session(tmp_path / f"{be}.npz", m)  # resumed: the second turn reuses the saved cache
            g2 = generate(m, list(PROMPT) + g1.tokens + [5, 6], session=s2, max_tokens=2)
            res[be] = (g1.tokens, g2.tokens, g2.reused_tokens, s2.cache.state_dict())
    assert res["numpy"][:3] == res["metal-emu"][:3] and res["metal-emu"][2] > len(PROMPT)
    for k, v in res["numpy"][3].items():
        if v.dtype == np.float32 and v.size:
            assert _rel(res["metal-emu"][3][k], v) < REL_TOL, k


def test_launch_plan_describes_the_resident_step(packed):
    from moepack.runtime.metal.plan import format_plan, launch_plan

    plan = launch_plan(packed[("qwen3_moe", 2)], tokens=2)
    res = plan["resident"]
    n_layers = 4
    assert res["supported"] and res["read_backs"] == n_layers + 1 == res["command_buffers"]
    assert res["launches"] == sum(len(cb["launches"]) for cb in res["buffers"])
    assert [cb["read_back"][0].split(" int")[0].split(" uint")[0] for cb in res["buffers"][:-1]] == \
        ["top-k ids + weights"] * n_layers
    assert res["buffers"][-1]["read_back"] == ["logits float32[512]"]
    # each command buffer after the first starts with the previous layer's routed experts from their records
    for cb in res["buffers"][1:]:
        assert cb["launches"][0]["kernel"].startswith("gate_up_swiglu_rec") and \
            cb["launches"][2]["kernel"] == "moe_combine"
    assert "resident decode step" in format_plan(plan) and "-> read back logits" in format_plan(plan)


def _float_weights(m):
    """Swap some quantized linears of a loaded model for float ones (as unquantized checkpoints have): the
    embedding and lm_head as bf16, layer 0's shared-expert gate as f16 (so that GLU runs unfused)."""
    from moepack.quant.affine_ref import dequantize
    from moepack.quant.bf16 import f32_to_bf16
    from moepack.runtime.models.common import GLU
    from moepack.runtime.weights import FloatLinear

    def f(q, dtype):
        w = dequantize(q.w, q.scales, q.biases, q.bits, q.group_size)
        w = {"BF16": f32_to_bf16(w), "F16": w.astype(np.float16), "F32": w}[dtype]
        w.flags.writeable = False
        return FloatLinear(w, dtype)

    dec = m.decoder
    dec.embed_tokens = f(dec.embed_tokens, "BF16")
    dec.lm_head = f(dec.lm_head, "F32")
    mlp = dec.layers[0].mlp
    mlp.shared = GLU(f(mlp.shared.gate, "F16"), mlp.shared.up, mlp.shared.down)


def test_float_weights_through_the_resident_step(packed):
    out = {}
    for be in ("numpy", "metal-emu"):
        with load_model(packed[("qwen3_5_moe", 4)], backend=be) as m:
            _float_weights(m)
            cache = m.new_cache()
            out[be] = [m.forward(PROMPT, cache)] + [m.forward(np.array([t]), cache) for t in (5, 300)]
            if be == "metal-emu":
                assert m.resident is not None and m.resident.counters.steps == 2
                kernels = {x.kernel for x in m.K.log.launches}
    assert {"embed_rows_bf16", "matvec_f32", "matvec_f16", "swiglu_f32"} <= kernels
    for a, b in zip(out["metal-emu"], out["numpy"]):
        assert _rel(a, b) < REL_TOL


def test_split_k_attention_over_a_long_device_cache():
    """A decode token over 1100 cached positions takes the two-pass (split-K) launch, reading the KV cache
    and writing its output in DeviceBuffers (only the first `visible` rows of a larger capacity)."""
    from moepack.runtime import kernels_ref

    emu = Emulator("reverse")
    Hq, Hkv, hd, S, cap = 2, 1, 32, 1100, 1280
    q, k, v = _f(1, Hq, hd), _f(S, Hkv, hd), _f(S, Hkv, hd)
    kc, vc = emu.alloc((cap, Hkv, hd), np.float32), emu.alloc((cap, Hkv, hd), np.float32)
    emu.upload(kc.view(0, (S, Hkv, hd)), k)
    emu.upload(vc.view(0, (S, Hkv, hd)), v)
    qb, out, pos = emu.alloc((1, Hq, hd), np.float32), emu.alloc((1, Hq, hd), np.float32), emu.alloc((1,), np.int32)
    emu.upload(qb, q)
    emu.upload(pos, np.array([S - 1], np.int32))
    scratch = tuple(emu.alloc((n,), np.float32) for n in (Hq * 32, Hq * 32, Hq * 32 * hd))
    ds = G.dev_attention(qb, kc, vc, pos, out, Hq, Hkv, hd, S, hd**-0.5, scratch)
    assert [d.kernel for d in ds] == ["attention_split_f32", "attention_merge_f32"]
    emu.run(ds)
    want = kernels_ref.attention(q, k, v, np.array([S - 1]), hd**-0.5)
    assert _rel(emu.download(out), want) < 1e-5


def test_dense_mlp_layer_runs_without_a_read_back(tmp_path):
    """Qwen3-Next with a dense-MLP layer (mlp_only_layers): that layer's MLP joins its attention's command
    buffer, so a step reads back once per MoE layer (3) plus the logits."""
    src = write_mlx_checkpoint(tmp_path / "src", arch="qwen3_next", bits=4, seed=4, mlp_only_layers=[1])
    convert(src, tmp_path / "packed", bits=4, progress=False)
    out = {}
    for be in ("numpy", "metal-emu"):
        with load_model(tmp_path / "packed", backend=be) as m:
            cache = m.new_cache()
            out[be] = [m.forward(PROMPT[:3], cache)] + [m.forward(np.array([t]), cache) for t in (5, 9)]
            if be == "metal-emu":
                assert m.args.mlp_types == ("moe", "dense", "moe", "moe")
                step = m.resident.last_step
    assert step["readbacks"] == 4 and step["command_buffers"] == 3 + 3 + 1
    for a, b in zip(out["metal-emu"], out["numpy"]):
        assert _rel(a, b) < REL_TOL

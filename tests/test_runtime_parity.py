"""The numpy runtime against mlx-lm (the reference implementation), on tiny checkpoints of each architecture.

mlx-lm runs the SOURCE checkpoint after ``model.set_dtype(mx.float32)``: that casts the bf16 scales/biases,
norms, conv and dt_bias to float32 exactly (bf16 -> f32 is exact) and leaves the uint32 codes alone, so both
sides dequantize to bit-identical float32 weights and compute in float32. What is left is float32
reordering: BLAS vs MLX's quantized matmul accumulation order, exp/rsqrt/sin/cos ulps, the order experts
are summed. Measured max |logit diff| over prefill + 8 decode steps (12-token prompt, fixture seeds 0-3;
max |logit| is ~5):

    arch          4-bit: abs (rel to max|logit|)     2-bit: abs (rel)
    qwen3_5_moe   1.8e-05..2.6e-05 (3.9e-06..5.4e-06)    1.7e-05..3.0e-05 (4.6e-06..6.5e-06)
    qwen3_next    1.8e-05..6.2e-05 (4.2e-06..1.5e-05)    2.5e-05..5.5e-05 (4.7e-06..1.5e-05)
    qwen3_moe     2.9e-06..4.3e-06 (5.2e-07..8.7e-07)    3.3e-06..4.1e-06 (6.2e-07..8.2e-07)

i.e. up to ~250 float32 ulps of the logit scale after 4 layers of 64-512-term sums and a recurrence (the
hybrids, with Gated-DeltaNet, drift most). The tolerance, ``REL_TOL = 1e-4`` of the largest |logit|, leaves a
6x margin and is still far below a real disagreement (a wrong RoPE split, head order, eps or routing choice
shows up at 1e-3..1 relative). Greedy continuations must be identical.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model as mlx_load_model  # noqa: E402

from moepack.archs import get_architecture  # noqa: E402
from moepack.archs.base import PARTS, PROJS  # noqa: E402
from moepack.convert import convert  # noqa: E402
from moepack.layout.reader import PackedModel  # noqa: E402
from moepack.runtime.model import load_model  # noqa: E402
from moepack.source.safetensors_file import SafetensorsFile, write_safetensors  # noqa: E402
from moepack.testing.fixtures import write_mlx_checkpoint  # noqa: E402

ARCHS = ("qwen3_5_moe", "qwen3_next", "qwen3_moe")
PROMPT = np.array([1, 37, 200, 5, 88, 410, 17, 3, 250, 99, 64, 12])  # 12 tokens
N_DECODE = 8
REL_TOL = 1e-4  # of max |logit|; see the module docstring


def _rel_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _mlx_model(path):
    model, _ = mlx_load_model(path)
    model.set_dtype(mx.float32)
    return model


def _greedy_mlx(model, prompt, n):
    cache = make_prompt_cache(model)
    logits = [np.array(model(mx.array(prompt)[None], cache=cache)[0])]
    toks = []
    for _ in range(n):
        toks.append(int(logits[-1][-1].argmax()))
        logits.append(np.array(model(mx.array([toks[-1]])[None], cache=cache)[0]))
    return logits, toks


def _greedy_ours(model, prompt, n):
    cache = model.new_cache()
    logits = [model.forward(prompt, cache)]
    toks = []
    for _ in range(n):
        toks.append(int(logits[-1][-1].argmax()))
        logits.append(model.forward(np.array([toks[-1]]), cache))
    return logits, toks


def _mlx_checkpoint_from_packed(packed_dir, out_dir):
    """An MLX checkpoint mlx-lm can load, made from a packed folder: dense tensors copied, each layer's routed
    experts stacked back into switch_mlp tensors, per-module quantization overrides for their bits."""
    pm = PackedModel(packed_dir)
    config = json.loads((packed_dir / "config.json").read_text())
    arch = get_architecture(pm.manifest.model_type)
    dense = SafetensorsFile(packed_dir / "model.safetensors")
    tensors = [(n, t.dtype, t.shape, (lambda n=n: dense.read(n))) for n, t in dense.tensors.items()]
    E = pm.manifest.moe.num_experts
    for entry in pm.manifest.layers:
        recs = pm.read_records(entry.layer, 0, E)  # [E, record_size]
        per_expert = [pm.expert_arrays(entry.layer, recs[e]) for e in range(E)]
        layout = pm.layout(entry.layer)
        for proj in PROJS:
            for part in PARTS:
                stacked = np.stack([a[f"{proj}.{part}"] for a in per_expert])
                dtype = "U32" if part == "weight" else "BF16"
                tensors.append((arch.expert_name(entry.layer, proj, part), dtype, stacked.shape, stacked))
            module = arch.expert_name(entry.layer, proj, "weight")[: -len(".weight")]
            c = layout.component(f"{proj}.weight")
            for key in ("quantization", "quantization_config"):
                config[key][module] = {"bits": c.bits, "group_size": c.group_size}
    out_dir.mkdir()
    write_safetensors(out_dir / "model.safetensors", tensors, {"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    pm.close()
    return out_dir


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    """(arch, source MLX checkpoint, 4-bit packed folder)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    src = write_mlx_checkpoint(root / "src", arch=arch, bits=4, seed=0)
    convert(str(src), root / "packed", progress=False)
    return arch, src, root / "packed"


def test_set_dtype_float32_only_widens_floats(case):
    _, src, _ = case
    model, _ = mlx_load_model(src)
    before = dict(tree_flatten(model.parameters()))
    model.set_dtype(mx.float32)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys()
    n_scales = 0
    for name, old in before.items():
        new = after[name]
        if old.dtype == mx.uint32:  # packed codes untouched
            assert new.dtype == mx.uint32 and np.array_equal(np.array(old), np.array(new)), name
            continue
        assert old.dtype in (mx.bfloat16, mx.float32), (name, old.dtype)
        assert new.dtype == mx.float32, name
        assert np.array_equal(np.array(old.astype(mx.float32)), np.array(new)), name  # exact widening
        n_scales += name.endswith((".scales", ".biases"))
    assert n_scales > 0


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_prefill_and_greedy_match_mlx(case, backend):
    """The numpy reference and the cpu backend's default kernels (integer dot products where AVX2 is there:
    kernels_numba.INT_DOT_MODE) both against mlx-lm in float32."""
    arch, src, packed = case
    ref_logits, ref_toks = _greedy_mlx(_mlx_model(src), PROMPT, N_DECODE)
    with load_model(packed, backend=backend) as model:
        logits, toks = _greedy_ours(model, PROMPT, N_DECODE)
        assert model.stats.tokens == len(PROMPT) + N_DECODE
    assert logits[0].shape == (len(PROMPT), 512)
    diffs = [_rel_diff(a, b) for a, b in zip(logits, ref_logits)]
    assert max(diffs) <= REL_TOL, f"{arch}: max rel logit diff per step {diffs}"
    assert toks == ref_toks


def test_two_bit_experts_match_mlx(case, tmp_path):
    """Pack with --bits 2 (requantized experts), rebuild an MLX checkpoint from the packed records, compare."""
    arch, src, _ = case
    packed2 = tmp_path / "packed2"
    convert(str(src), packed2, bits=2, progress=False)
    mlx2 = _mlx_checkpoint_from_packed(packed2, tmp_path / "mlx2")
    ref_logits, ref_toks = _greedy_mlx(_mlx_model(mlx2), PROMPT, N_DECODE)
    for backend in ("numpy", "numba"):
        with load_model(packed2, backend=backend) as model:
            assert model.decoder.layers[0].mlp.bits == (2, 2, 2)
            logits, toks = _greedy_ours(model, PROMPT, N_DECODE)
        diffs = [_rel_diff(a, b) for a, b in zip(logits, ref_logits)]
        assert max(diffs) <= REL_TOL, f"{arch} 2-bit {backend}: max rel logit diff per step {diffs}"
        assert toks == ref_toks, backend


def test_decode_step_by_step_equals_prefill(case):
    """The caches are right: one token at a time (and 5 + 7) gives the prefill's logits."""
    _, _, packed = case
    with load_model(packed) as model:
        full = model.forward(PROMPT, model.new_cache())
        cache = model.new_cache()
        steps = np.concatenate([model.forward(PROMPT[i : i + 1], cache) for i in range(len(PROMPT))])
        assert cache.offset == len(PROMPT)
        cache = model.new_cache()
        split = np.concatenate([model.forward(PROMPT[:5], cache), model.forward(PROMPT[5:], cache)])
    assert _rel_diff(steps, full) <= 1e-5
    assert _rel_diff(split, full) <= 1e-5


def test_cache_state_dict_round_trip(case, tmp_path):
    """Saving the cache mid-conversation (np.savez, as a session file would) and restoring it continues
    bit for bit like the uninterrupted cache."""
    from moepack.runtime.cache import Cache

    _, _, packed = case
    with load_model(packed) as model:
        cache = model.new_cache()
        model.forward(PROMPT[:7], cache)
        np.savez(tmp_path / "session.npz", **cache.state_dict())
        want = model.forward(PROMPT[7:], cache)
        with np.load(tmp_path / "session.npz") as f:
            restored = Cache.from_state_dict(dict(f))
        assert restored.offset == 7
        got = model.forward(PROMPT[7:], restored)
    assert np.array_equal(got, want)


# ------------------------------------------------------------------------------------------------ kernel by kernel
# Each reference kernel against the mlx op mlx-lm uses, on random float32 inputs. Single ops, so only summation
# order and libm ulps differ: measured max |diff| / max |ref| <= 7e-7 (rope at position 3000, 2-bit qmatmul);
# tolerance 4e-6 (~30 float32 ulps of the output scale).

from moepack.quant import affine_ref  # noqa: E402
from moepack.runtime import kernels_ref as K  # noqa: E402


def _close(ours, ref, rel=4e-6):
    ref = np.asarray(ref)
    assert ours.shape == ref.shape
    assert ours.dtype == np.float32
    scale = max(float(np.abs(ref).max()), 1e-30)
    assert float(np.abs(ours - ref).max()) <= rel * scale, float(np.abs(ours - ref).max()) / scale


def _quantized(rng, out, inp, bits, gs=64):
    w = (0.05 * rng.standard_normal((out, inp))).astype(np.float32)
    return affine_ref.quantize(w, bits, gs)


def _mx_q(w, s, b):
    f = lambda a: mx.array(a).view(mx.bfloat16).astype(mx.float32)  # noqa: E731
    return mx.array(w), f(s), f(b)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kernel_qmatmul_and_embedding(bits):
    rng = np.random.default_rng(bits)
    w, s, b = _quantized(rng, 96, 256, bits)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    mw, ms, mb = _mx_q(w, s, b)
    ref = mx.quantized_matmul(mx.array(x), mw, ms, mb, transpose=True, group_size=64, bits=bits)
    _close(K.qmatmul(x, w, s, b, bits, 64), ref)
    ids = np.array([3, 0, 95, 3])
    _close(K.qembedding(ids, w, s, b, bits, 64), mx.dequantize(mw, ms, mb, group_size=64, bits=bits)[mx.array(ids)],
           rel=0)


def test_kernel_expert_ffn():
    rng = np.random.default_rng(7)
    gate, up, down = _quantized(rng, 64, 128, 4), _quantized(rng, 64, 128, 2), _quantized(rng, 128, 64, 4)
    x = rng.standard_normal((3, 128)).astype(np.float32)

    def qmm(a, wsb, bits):
        return mx.quantized_matmul(a, *_mx_q(*wsb), transpose=True, group_size=64, bits=bits)

    g, u = qmm(mx.array(x), gate, 4), qmm(mx.array(x), up, 2)
    ref = qmm(g * mx.sigmoid(g) * u, down, 4)
    _close(K.expert_ffn(x, *gate, *up, *down, (4, 2, 4), 64), ref)


def test_kernel_norms():
    from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 64)).astype(np.float32)
    z = rng.standard_normal((4, 3, 64)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    _close(K.rmsnorm(x[:, 0], w, 1e-6), mx.fast.rms_norm(mx.array(x[:, 0]), mx.array(w), 1e-6))
    norm = Qwen3NextRMSNormGated(64, eps=1e-6)
    norm.weight = mx.array(w)
    _close(K.gated_rmsnorm(x, z, w, 1e-6), norm(mx.array(x), mx.array(z)))


@pytest.mark.parametrize("rotary_dim,offset", [(64, 0), (16, 5), (16, 3000)])
def test_kernel_rope(rotary_dim, offset):
    rng = np.random.default_rng(rotary_dim)
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)  # [T, H, hd]
    ref = mx.fast.rope(mx.array(x.transpose(1, 0, 2))[None], rotary_dim, traditional=False, base=1e7, scale=1.0,
                       offset=offset)[0].transpose(1, 0, 2)
    _close(K.rope(x, np.arange(offset, offset + 6), rotary_dim, 1e7), ref)


def test_kernel_attention_causal_gqa():
    rng = np.random.default_rng(2)
    S, T = 9, 4  # 5 cached positions, then 4 new queries at positions 5..8
    q = rng.standard_normal((T, 8, 32)).astype(np.float32)
    k = rng.standard_normal((S, 2, 32)).astype(np.float32)
    v = rng.standard_normal((S, 2, 32)).astype(np.float32)
    t = lambda a: mx.array(a.transpose(1, 0, 2))[None]  # noqa: E731  [1, H, L, hd]
    ref = mx.fast.scaled_dot_product_attention(t(q), t(k), t(v), scale=32**-0.5, mask="causal")[0].transpose(1, 0, 2)
    _close(K.attention(q, k, v, np.arange(5, 9), 32**-0.5), ref)


def test_kernel_conv1d_step():
    import mlx.nn as nn

    rng = np.random.default_rng(3)
    C, Kc, T = 12, 4, 5
    x = rng.standard_normal((T, C)).astype(np.float32)
    state = rng.standard_normal((Kc - 1, C)).astype(np.float32)
    w = rng.standard_normal((C, Kc)).astype(np.float32)
    conv = nn.Conv1d(C, C, kernel_size=Kc, groups=C, bias=False, padding=0)
    conv.weight = mx.array(w[:, :, None])  # MLX layout [C, Kc, 1]
    ref = nn.silu(conv(mx.array(np.concatenate([state, x]))[None]))[0]
    y, new_state = K.conv1d_step(x, state, w)
    _close(y, ref)
    assert np.array_equal(new_state, np.concatenate([state, x])[-(Kc - 1) :])


def test_kernel_gated_delta():
    from mlx_lm.models.gated_delta import gated_delta_ops

    rng = np.random.default_rng(4)
    T, Hk, Hv, dk, dv = 5, 2, 4, 16, 8
    q = rng.standard_normal((T, Hk, dk)).astype(np.float32) * 0.25
    k = rng.standard_normal((T, Hk, dk)).astype(np.float32) * 0.25
    v = rng.standard_normal((T, Hv, dv)).astype(np.float32)
    g = rng.uniform(0.5, 1.0, (T, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (T, Hv)).astype(np.float32)
    state = rng.standard_normal((Hv, dv, dk)).astype(np.float32)
    y_ref, s_ref = gated_delta_ops(*(mx.array(a)[None] for a in (q, k, v, g, beta, state)))
    y, s = K.gated_delta(q, k, v, g, beta, state)
    _close(y, y_ref[0])
    _close(s, s_ref[0])


def test_kernel_router_topk_matches_mlx_choice():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((64, 32)).astype(np.float32)
    gates = mx.softmax(mx.array(logits), axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-4, axis=-1)[..., -4:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    scores = np.array(scores / scores.sum(axis=-1, keepdims=True))
    idx, w = K.router_topk(logits, 4, True)
    assert idx.dtype == np.int32 and w.dtype == np.float32
    ref_idx = np.array(inds)
    for t in range(64):  # same set of experts; weights equal expert by expert
        assert set(idx[t]) == set(ref_idx[t])
        order = np.argsort(ref_idx[t])
        np.testing.assert_allclose(w[t][np.argsort(idx[t])], scores[t][order], rtol=1e-6)

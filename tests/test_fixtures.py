"""The tiny fixture checkpoints are what mlx-lm itself would load, produce and convert from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moepack.source.checkpoint import open_checkpoint
from moepack.source.safetensors_file import bf16_to_f32
from moepack.testing import ARCHS, tiny_config, write_hf_checkpoint, write_mlx_checkpoint
from moepack.testing.fixtures import IM_END_ID, IM_START_ID, SPECIAL_TOKENS, text_fields, tokenizer_json

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENS = [[IM_START_ID, 17, 99, 300, 5, IM_END_ID]]


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """Own-writer MLX checkpoints, one per arch (written once per module)."""
    root = tmp_path_factory.mktemp("own")
    return {arch: write_mlx_checkpoint(root / arch, arch) for arch in ARCHS}


def _signature(path: Path) -> set[tuple[str, str, tuple[int, ...]]]:
    with open_checkpoint(path) as ck:
        return {(n, ck.info(n).dtype, ck.info(n).shape) for n in ck.tensor_names}


# ------------------------------------------------------------------ no mlx needed
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_config_shape(arch):
    cfg = tiny_config(arch, bits=4)
    t = text_fields(cfg)
    if arch == "qwen3_5_moe":
        assert cfg["model_type"] == "qwen3_5_moe" and t["model_type"] == "qwen3_5_moe_text"
        assert "hidden_size" not in cfg and t is cfg["text_config"]
        prefix = "language_model.model.layers"
    else:
        assert cfg["model_type"] == arch and t is cfg
        prefix = "model.layers"
    for key in ("hidden_size", "moe_intermediate_size", "head_dim", "vocab_size"):
        assert t[key] % 64 == 0, key
    assert t["vocab_size"] >= len(json.loads(tokenizer_json())["model"]["vocab"])
    if arch != "qwen3_moe":
        assert t["shared_expert_intermediate_size"] % 64 == 0
        assert set(t["layer_types"]) == {"linear_attention", "full_attention"}
    q = cfg["quantization"]
    assert q == cfg["quantization_config"] and q is not cfg["quantization_config"]
    assert (q["group_size"], q["bits"], q["mode"]) == (64, 4, "affine")
    routers = {k for k in q if k not in ("group_size", "bits", "mode")}
    expect = {f"{prefix}.{i}.mlp.gate" for i in range(t["num_hidden_layers"])}
    if arch != "qwen3_moe":
        expect |= {f"{prefix}.{i}.mlp.shared_expert_gate" for i in range(t["num_hidden_layers"])}
    assert routers == expect and all(q[k] == {"group_size": 64, "bits": 8} for k in routers)
    assert "quantization" not in tiny_config(arch)

    small = tiny_config(arch, num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=True)
    ts = text_fields(small)
    assert (ts["num_hidden_layers"], ts["vocab_size"], ts["tie_word_embeddings"]) == (2, 1024, True)


def test_fixture_writers_work_without_mlx(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        for mod in ("mlx", "mlx.core", "mlx.nn", "mlx_lm", "torch"):
            sys.modules[mod] = None  # any import of these now fails
        from moepack.testing import write_mlx_checkpoint, write_hf_checkpoint
        from moepack.source.checkpoint import open_checkpoint
        a = write_mlx_checkpoint(sys.argv[1] + "/mlx", "qwen3_5_moe", bits=3, shards=4)
        b = write_hf_checkpoint(sys.argv[1] + "/hf", "qwen3_next", dtype="f16")
        print(len(open_checkpoint(a).shards), len(open_checkpoint(b).tensor_names))
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    shards, n_hf = map(int, proc.stdout.split())
    assert shards == 4 and n_hf > 100


def test_fixtures_are_deterministic(tmp_path):
    a = write_mlx_checkpoint(tmp_path / "a", "qwen3_moe", seed=7, shards=2)
    b = write_mlx_checkpoint(tmp_path / "b", "qwen3_moe", seed=7, shards=2)
    c = write_mlx_checkpoint(tmp_path / "c", "qwen3_moe", seed=8, shards=2)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    first = "model-00001-of-00002.safetensors"
    assert (a / first).read_bytes() != (c / first).read_bytes()
    index = json.loads((a / "model.safetensors.index.json").read_text())
    total = sum((a / s).stat().st_size for s in set(index["weight_map"].values()))
    assert 0 < index["metadata"]["total_size"] < total  # tensor bytes, without headers


def test_quantized_values_look_like_a_trained_model(own):
    with open_checkpoint(own["qwen3_5_moe"]) as ck:
        p = "language_model.model.layers.0.mlp.switch_mlp.up_proj"
        w, s, b = ck.read(p + ".weight"), bf16_to_f32(ck.read(p + ".scales")), bf16_to_f32(ck.read(p + ".biases"))
        codes = ((w[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).reshape(*w.shape[:-1], -1)
        deq = codes.reshape(*s.shape, 64) * s[..., None] + b[..., None]
        assert 0.01 < deq.std() < 0.2 and abs(deq.mean()) < 0.01
        assert 0.005 < s.mean() < 0.05 and np.all(s > 0)
        norm = bf16_to_f32(ck.read("language_model.model.layers.0.input_layernorm.weight"))
        assert abs(norm.mean() - 1) < 0.05
        assert ck.info("language_model.model.layers.0.linear_attn.A_log").dtype == "F32"
        assert ck.info("language_model.model.layers.0.linear_attn.conv1d.weight").shape == (512, 4, 1)


def test_hf_per_expert_and_fused_hold_the_same_experts(tmp_path):
    fused = open_checkpoint(write_hf_checkpoint(tmp_path / "f", "qwen3_5_moe", dtype="f32", experts="fused"))
    split = open_checkpoint(write_hf_checkpoint(tmp_path / "s", "qwen3_5_moe", dtype="f32", experts="per_expert"))
    p = "model.language_model.layers.1.mlp.experts"
    gate_up, down = fused.read(f"{p}.gate_up_proj"), fused.read(f"{p}.down_proj")
    assert gate_up.shape == (8, 128, 128) and down.shape == (8, 128, 64)
    for e in (0, 7):
        np.testing.assert_array_equal(gate_up[e, :64], split.read(f"{p}.{e}.gate_proj.weight"))
        np.testing.assert_array_equal(gate_up[e, 64:], split.read(f"{p}.{e}.up_proj.weight"))
        np.testing.assert_array_equal(down[e], split.read(f"{p}.{e}.down_proj.weight"))
    assert fused.info("model.language_model.layers.0.linear_attn.conv1d.weight").shape == (512, 1, 4)
    assert "lm_head.weight" in fused and "mtp.fc.weight" in fused and "model.visual.patch_embed.proj.weight" in fused
    fused.close()
    split.close()


# ------------------------------------------------------------------ with mlx-lm
@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_lm_loads_and_runs_own_fixture(own, arch):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, config = load_model(own[arch])  # strict: every tensor present, none extra, shapes match
    logits = model(mx.array(TOKENS))
    assert logits.shape == (1, len(TOKENS[0]), text_fields(config)["vocab_size"])
    assert bool(mx.isfinite(logits).all())
    layer = model.layers[0].mlp
    assert (layer.gate.bits, layer.gate.group_size) == (8, 64)
    assert (layer.switch_mlp.gate_proj.bits, layer.switch_mlp.gate_proj.group_size) == (4, 64)


@pytest.mark.parametrize(
    "arch, bits, group_size",
    [(a, 4, 64) for a in ARCHS] + [("qwen3_5_moe", 3, 32), ("qwen3_next", 8, 64), ("qwen3_moe", 2, 128)],
)
def test_own_writer_matches_mlx_lm_convert(own, tmp_path, arch, bits, group_size):
    pytest.importorskip("mlx_lm")
    from moepack.testing import write_mlx_checkpoint_with_mlx_lm

    if (bits, group_size) == (4, 64):
        ours = own[arch]
    else:
        ours = write_mlx_checkpoint(tmp_path / "ours", arch, bits, group_size)
    theirs = write_mlx_checkpoint_with_mlx_lm(tmp_path / "mlx", arch, bits=bits, group_size=group_size, tokenizer=False)
    assert _signature(ours) == _signature(theirs)
    assert json.loads((ours / "config.json").read_text()) == json.loads((theirs / "config.json").read_text())
    ours_meta = json.loads((ours / "model.safetensors.index.json").read_text())["metadata"]
    theirs_meta = json.loads((theirs / "model.safetensors.index.json").read_text())["metadata"]
    assert ours_meta == theirs_meta


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_lm_loads_hf_fixture(tmp_path, arch):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, _ = load_model(write_hf_checkpoint(tmp_path / "hf", arch))  # bf16, sanitized by mlx-lm
    model.set_dtype(mx.float32)  # mlx's CPU gather_mm runs float32 only
    logits = model(mx.array(TOKENS))
    assert bool(mx.isfinite(logits).all())

    # Same seed, other layout: after mlx-lm's sanitize (expert stacking, conv1d axes, norm +1) the HF weights are
    # the unquantized MLX fixture's weights.
    hf, _ = load_model(write_hf_checkpoint(tmp_path / "hf32", arch, dtype="f32", tokenizer=False), lazy=True)
    mlx_, _ = load_model(write_mlx_checkpoint(tmp_path / "mlx16", arch, bits=None, tokenizer=False), lazy=True)
    a, b = dict(tree_flatten(hf.parameters())), dict(tree_flatten(mlx_.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k].astype(mx.float32)), rtol=1e-2, atol=1e-3, err_msg=k)


def test_mlx_lm_load_with_tokenizer_and_chat_template(own):
    mlx_lm = pytest.importorskip("mlx_lm")
    model, tok = mlx_lm.load(str(own["qwen3_5_moe"]))
    assert IM_END_ID in tok.eos_token_ids
    messages = [{"role": "user", "content": "Why pack the experts?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>user\nWhy pack the experts?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids[0] == IM_START_ID and IM_END_ID in ids and max(ids) < 512
    assert tok.decode(ids) == prompt
    assert tok.convert_ids_to_tokens(list(range(3))) == list(SPECIAL_TOKENS)
    text = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=3)
    assert isinstance(text, str)

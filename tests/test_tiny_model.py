"""The tiny trained qwen3_5_moe model shipped in moepack/data: checksums, size, loads with moepack's checkpoint
reader and with mlx-lm (same logits as moepack's runtime), is actually trained, and `moepack demo` on it."""

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moepack.convert import convert
from moepack.eval import DEFAULT_TEXT, evaluate, windows
from moepack.runtime.tokenizer import load_tokenizer
from moepack.source.checkpoint import open_checkpoint

DATA = Path(__file__).resolve().parents[1] / "moepack" / "data"
TINY = DATA / "tiny-qwen35-moe"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _sums() -> dict[str, str]:
    out = {}
    for line in (TINY / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            out[name.strip()] = digest
    return out


def test_files_match_their_recorded_checksums_and_size_budget():
    sums = _sums()
    files = {p.name for p in TINY.iterdir() if p.is_file()} - {"SHA256SUMS"}
    assert set(sums) == files
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    for name, digest in sums.items():
        assert hashlib.sha256((TINY / name).read_bytes()).hexdigest() == digest, name
    assert sum((TINY / n).stat().st_size for n in files) <= 10 * 1024 * 1024


def test_loads_with_the_checkpoint_reader():
    from moepack.archs import architecture_for_config
    from moepack.source.experts import find_expert_layers

    ckpt = open_checkpoint(TINY)  # the reader used for user checkpoints; validates every shard header
    try:
        cfg = ckpt.config
        assert cfg["model_type"] == "qwen3_5_moe"
        tc = cfg["text_config"]
        assert 16 <= tc["num_experts"] <= 32 and tc["num_experts_per_tok"] >= 4
        assert tc["shared_expert_intermediate_size"] > 0
        assert set(tc["layer_types"]) == {"linear_attention", "full_attention"}
        assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
        assert cfg["quantization"]["language_model.model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
        arch = architecture_for_config(cfg)
        kind, layers = find_expert_layers(ckpt, arch)
        assert kind == "mlx" and sorted(layers) == list(range(tc["num_hidden_layers"]))
    finally:
        ckpt.close()


def test_tokenizer_and_chat_template():
    tok = load_tokenizer(TINY)
    assert 2000 <= tok.vocab_size <= 4096
    assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    ids = tok.encode(PROMPT, add_special_tokens=False)
    assert tok.decode(ids) == PROMPT
    assert len(ids) < len(PROMPT) / 2  # BPE trained on Python source: merges indentation and keywords
    chat = tok.apply_chat_template([{"role": "user", "content": "Return the n-th Fibonacci number."}])
    assert chat == "<|im_start|>user\nReturn the n-th Fibonacci number.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == [2]


def test_eval_text_is_held_out():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tiny", DATA.parents[1] / "scripts" / "train_tiny.py")
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    trained = {n for item in tt.TRAIN_FILES for n in (item if isinstance(item, tuple) else (item,))}
    assert not trained & set(tt.EVAL_FILES)
    text = DEFAULT_TEXT.read_text(encoding="utf-8")
    assert 2000 <= len(text.encode()) <= 16000


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    convert(str(TINY), root / "p4", progress=False)
    convert(str(TINY), root / "p2", bits=2, progress=False)
    return root


def test_trained_model_beats_chance_by_far(packed):
    rec = evaluate(packed / "p4", backend="numpy", save=False).record
    vocab = load_tokenizer(TINY).vocab_size
    assert rec["perplexity"] < 120 < vocab  # an untrained model is near `vocab` (2048); this one ~84
    rec2 = evaluate(packed / "p2", source=packed / "p4", backend="numpy", save=False).record
    assert rec2["perplexity"] > rec["perplexity"] and rec2["kl_mean"] > 0


def test_mlx_lm_loads_it_and_agrees_with_the_runtime(packed, tmp_path):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm import load

    from moepack.runtime.model import load_model

    model, tokenizer = load(str(TINY))  # mlx-lm's own loader, its tokenizer through transformers
    model.set_dtype(mx.float32)
    ids = load_tokenizer(TINY).encode(PROMPT, add_special_tokens=False)
    assert list(tokenizer.encode(PROMPT)) == ids  # the shipped tokenizer uses Qwen's own pipeline
    ref = np.array(model(mx.array(ids)[None])[0])
    with load_model(packed / "p4", backend="numpy") as m:
        ours = m.forward(np.array(ids), m.new_cache())
    assert float(np.abs(ours - ref).max() / np.abs(ref).max()) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9

    # perplexity: moepack eval against mlx-lm in float32 on the same windows
    f = tmp_path / "t.txt"
    f.write_text(PROMPT * 6)
    r = evaluate(packed / "p4", text=f, window=32, backend="numpy", save=False)
    tids = load_tokenizer(TINY).encode(PROMPT * 6, add_special_tokens=False)
    nll = []
    for a, b in windows(len(tids), 32):
        lg = np.array(model(mx.array(tids[a:b - 1])[None])[0]).astype(np.float64)
        lg -= lg.max(-1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        nll.append(-lp[np.arange(b - a - 1), tids[a + 1:b]])
    assert math.isclose(r.record["perplexity"], math.exp(np.concatenate(nll).mean()), rel_tol=1e-3)


def test_demo_runs_on_the_embedded_model(tmp_path):
    # in a fresh process, as `make demo` runs it (the demo keeps OpenBLAS to one thread when it imports numpy)
    r = subprocess.run([sys.executable, "-m", "moepack", "demo", "--max-tokens", "6", "--out", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0, r.stderr
    for words in ("SHA256SUMS ok", "verify ok", "mean", "4-bit", "2-bit", "tok/s", "first token",
                  "/token", "perplexity", "KL(4-bit||2-bit) mean", "top-1 agreement", "def fibonacci(n):"):
        assert words in out, (words, out)
    m2 = json.loads((tmp_path / "demo" / "packed-2bit" / "moepack.json").read_text())
    assert m2["eval"]["kl_mean"] > 0 and m2["eval"]["perplexity"] > 1
    assert m2["rmse"]["overall"]["down"] > 0

"""`moepack eval`: perplexity against an independent computation, KL = 0 for a bit-exact repack and > 0 after
2-bit requantization, the manifest's eval section, and one-line errors for bad input."""

import json
import math

import numpy as np
import pytest

from moepack.cli import main
from moepack.convert import convert
from moepack.errors import SourceError
from moepack.eval import RECORDED, EvalError, evaluate, windows
from moepack.layout.manifest import load_manifest
from moepack.runtime.tokenizer import load_tokenizer
from moepack.testing.fixtures import write_mlx_checkpoint
from moepack.verify import verify

TEXT = (
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    if i % 2 == 0:\n        print(add(i, 3))\n"
    "The router scores each expert, keeps the top few, and mixes their outputs with softmax weights.\n"
    "Quantization stores weights as small integers with a scale and a bias for every group of values.\n"
)


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _clean_error(code, err, *words):
    assert code != 0
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line]
    assert lines[0].startswith("error: ") and len(lines) <= 2, lines
    assert any(line.startswith("hint: ") for line in lines)
    for w in words:
        assert w in err, (w, err)


@pytest.fixture(scope="module")
def models(mlx_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    p4, p2 = root / "p4", root / "p2"
    convert(str(mlx_ckpt), p4, progress=False)
    convert(str(mlx_ckpt), p2, bits=2, progress=False)
    text = root / "text.txt"
    text.write_text(TEXT)
    return {"src": mlx_ckpt, "p4": p4, "p2": p2, "text": text}


def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_windows():
    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert windows(9, 4) == [(0, 4), (4, 8)]  # a last window of one token scores nothing
    assert windows(3, 8) == [(0, 3)]


def test_kl_is_zero_for_a_4bit_repack_of_its_own_source(models):
    r = evaluate(models["p4"], text=models["text"], source=models["src"], backend="numpy", save=False)
    rec = r.record
    assert rec["kl_mean"] == 0.0 and rec["kl_p99"] == 0.0 and rec["kl_max"] == 0.0
    assert rec["top1_agreement"] == 1.0
    assert rec["perplexity"] == rec["reference_perplexity"]
    assert "own bits" in rec["reference"]


def test_kl_is_positive_after_2bit(models):
    r = evaluate(models["p2"], text=models["text"], source=models["p4"], backend="numpy", save=False)
    rec = r.record
    assert rec["kl_mean"] > 0 and rec["kl_max"] >= rec["kl_p99"] >= 0
    assert np.isclose(rec["kl_mean"], r.kl.mean()) and r.kl.size == rec["scored_tokens"]
    assert 0 <= rec["top1_agreement"] <= 1
    assert rec["perplexity"] != rec["reference_perplexity"]
    # the reference's perplexity is the 4-bit model's own
    r4 = evaluate(models["p4"], text=models["text"], backend="numpy", save=False)
    assert math.isclose(rec["reference_perplexity"], r4.record["perplexity"], rel_tol=1e-12)
    # the recorded source (the 4-bit MLX checkpoint) is the same reference as the 4-bit repack
    rr = evaluate(models["p2"], text=models["text"], source=RECORDED, backend="numpy", save=False)
    assert rr.record["kl_mean"] == rec["kl_mean"] and rr.record["top1_agreement"] == rec["top1_agreement"]


def test_perplexity_equals_log_softmax_of_dumped_logits(models, capsys, tmp_path):
    p4 = models["p4"]
    ids = load_tokenizer(p4).encode(TEXT, add_special_tokens=False)
    f = tmp_path / "logits.npy"
    code, _, err = run(capsys, "run", p4, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "0",
                       "--dump-logits", f, "--backend", "numpy")
    assert code == 0, err
    logits = np.load(f)
    assert logits.shape[0] == len(ids)
    lp = _log_softmax(logits[:-1])
    nll = -lp[np.arange(len(ids) - 1), ids[1:]]
    want = math.exp(nll.mean())
    r = evaluate(p4, text=models["text"], backend="numpy", save=False)  # one window: the text is short
    assert r.record["windows"] == 1 and r.record["scored_tokens"] == len(ids) - 1
    assert math.isclose(r.record["perplexity"], want, rel_tol=1e-9), (r.record["perplexity"], want)
    np.testing.assert_allclose(r.nll, nll, rtol=1e-9, atol=1e-12)


def test_windows_restart_the_cache(models):
    p4 = models["p4"]
    from moepack.runtime.model import load_model

    ids = np.asarray(load_tokenizer(p4).encode(TEXT, add_special_tokens=False))
    r = evaluate(p4, text=models["text"], window=16, backend="numpy", save=False)
    wins = windows(len(ids), 16)
    assert r.record["windows"] == len(wins) > 2
    assert r.record["scored_tokens"] == sum(b - a - 1 for a, b in wins)
    want = []
    with load_model(p4) as m:
        for a, b in wins:
            lp = _log_softmax(m.forward(ids[a:b], m.new_cache())[:-1])  # the whole window, as eval feeds it
            want.append(-lp[np.arange(b - a - 1), ids[a + 1:b]])
    np.testing.assert_allclose(r.nll, np.concatenate(want), rtol=1e-9)


def test_result_saved_in_manifest_and_cli(models, capsys):
    p2 = models["p2"]
    before = load_manifest(p2)
    code, out, err = run(capsys, "eval", p2, "--text", models["text"], "--source", models["p4"], "--json",
                         "--backend", "numpy")
    assert code == 0, err
    res = json.loads(out)
    assert res["saved"] is True and res["kl_mean"] > 0
    m = load_manifest(p2)
    assert m.extra["eval"]["perplexity"] == res["perplexity"]
    assert m.extra["eval"]["kl_p99"] == res["kl_p99"]
    assert m.record_checksums == before.record_checksums and m.rmse == before.rmse
    assert verify(p2, progress=False).ok
    # human output; --source without a value uses the recorded source; --no-save leaves the section alone
    code, out, err = run(capsys, "eval", p2, "--text", models["text"], "--backend", "numpy", "--no-save",
                         "--source")
    assert code == 0, err
    assert "perplexity" in out and "KL(ref||model)" in out and "top-1 agreement" in out
    assert "packed at its own bits" in out
    assert load_manifest(p2).extra["eval"] == m.extra["eval"]


@pytest.mark.parametrize("content, words", [
    (b"", ["empty"]),
    (b"   \n\n\t ", ["whitespace"]),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["binary"]),
    (b"caf\xe9 au lait", ["not UTF-8"]),
])
def test_bad_text_is_a_one_line_error(models, capsys, tmp_path, content, words):
    f = tmp_path / "bad.txt"
    f.write_bytes(content)
    code, _, err = run(capsys, "eval", models["p4"], "--text", f, "--backend", "numpy")
    _clean_error(code, err, *words)


def test_missing_text_file(models, capsys, tmp_path):
    code, _, err = run(capsys, "eval", models["p4"], "--text", tmp_path / "nope.txt", "--backend", "numpy")
    _clean_error(code, err, "no such file")


def test_text_too_long_says_how_to_pass_max_tokens(models, capsys):
    n = len(load_tokenizer(models["p4"]).encode(TEXT, add_special_tokens=False))
    code, _, err = run(capsys, "eval", models["p4"], "--text", models["text"], "--max-tokens", "20",
                       "--backend", "numpy")
    _clean_error(code, err, "--max-tokens 20", f"--max-tokens {n}")
    with pytest.raises(EvalError):
        evaluate(models["p4"], text=models["text"], max_tokens=20, save=False)


def test_window_longer_than_context(models, tmp_path):
    with pytest.raises(EvalError, match="context"):
        evaluate(models["p4"], text=models["text"], window=10**6, save=False)


def test_source_of_another_model(models, capsys, tmp_path):
    other = write_mlx_checkpoint(tmp_path / "other", bits=4, seed=1, vocab_size=640)
    code, _, err = run(capsys, "eval", models["p4"], "--text", models["text"], "--source", other,
                       "--backend", "numpy")
    _clean_error(code, err, "another model", "vocab_size 640 vs 512")
    other2 = write_mlx_checkpoint(tmp_path / "other2", bits=4, seed=1, hidden_size=256)
    convert(str(other2), tmp_path / "other2-packed", progress=False)
    with pytest.raises(SourceError, match="hidden_size 256 vs 128"):
        evaluate(models["p4"], text=models["text"], source=tmp_path / "other2-packed", save=False)
    code, _, err = run(capsys, "eval", models["p4"], "--text", models["text"], "--source", tmp_path / "missing",
                       "--backend", "numpy")
    _clean_error(code, err, "missing")


def test_source_with_another_tokenizer(models, tmp_path):
    import shutil

    alt = tmp_path / "alt"
    shutil.copytree(models["p4"], alt)
    tj = alt / "tokenizer.json"
    tj.write_text(tj.read_text().replace('"<|im_end|>"', '"<|im_stop|>"'))
    with pytest.raises(SourceError, match="another tokenizer"):
        evaluate(models["p2"], text=models["text"], source=alt, save=False)

"""`moepack run` / `moepack chat`: prompts tokenized as transformers and mlx-lm do, greedy output equal to
mlx-lm's on the source checkpoint, logits dumps, JSON, streaming, and one-line errors for bad input."""

import json
import os
import shutil

import numpy as np
import pytest

from moepack.cli import main
from moepack.convert import convert
from moepack.runtime.model import load_model
from moepack.runtime.tokenizer import TokenizerError, encode_prompt, load_tokenizer
from moepack.testing.fixtures import IM_END_ID, write_mlx_checkpoint

PROMPT_IDS = [1, 37, 200, 5, 88, 410, 17, 3, 250, 99, 64, 12]
PROMPTS = ["Hello! How are you?", "Write a poem about the sea.\nKeep it short: 4 lines, \"quoted\" & <tagged>."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    src = write_mlx_checkpoint(root / "src", arch="qwen3_5_moe", bits=4, seed=2)
    convert(str(src), root / "p4", progress=False)
    return src, root / "p4"


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code, err, *words):
    assert code != 0
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if x]
    assert lines[0].startswith("error: "), err
    assert any(x.startswith("hint: ") for x in lines), err
    for w in words:
        assert w in err, (w, err)


# ------------------------------------------------------------------------------------------------ tokenizer


@pytest.fixture(scope="module")
def tok_only(ckpt, tmp_path_factory):
    """The fixture's tokenizer files without config.json, for the references to load.

    With config.json beside it, transformers 5 picks the tokenizer class from model_type (Qwen3_5Tokenizer),
    which replaces tokenizer.json's pre-tokenizer with Qwen3.5's own split regex and NFC. The fixture's
    tokenizer.json uses GPT-2's ByteLevel regex, so the two differ on a space before a digit; on the real
    Qwen3.5 tokenizer.json (which carries that regex) they agree. The runtime follows tokenizer.json."""
    folder = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        shutil.copy(ckpt[1] / name, folder / name)
    return folder


def test_chat_prompt_ids_equal_transformers(ckpt, tok_only):
    transformers = pytest.importorskip("transformers")
    packed = ckpt[1]
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_only))
    ours = load_tokenizer(packed)
    for text in PROMPTS:
        msgs = [{"role": "user", "content": text}]
        want = list(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        assert encode_prompt(ours, text) == want
        assert ours.encode_chat(msgs) == want
        assert encode_prompt(ours, text, raw=True) == ref.encode(text)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye, 😀 日本"}]
    assert ours.apply_chat_template(conv) == ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert ours.eos_token_ids == [IM_END_ID]


def test_chat_prompt_ids_equal_mlx_lm(ckpt, tok_only):
    tu = pytest.importorskip("mlx_lm.tokenizer_utils")
    packed = ckpt[1]
    ref = tu.load(tok_only)
    ours = load_tokenizer(packed)
    for text in PROMPTS:
        msgs = [{"role": "user", "content": text}]
        for thinking in (False, True):  # mlx-lm always passes enable_thinking to the template
            want = ref.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=thinking)
            assert ours.encode_chat(msgs, enable_thinking=thinking) == list(want)
        assert ours.encode(text) == ref.encode(text)


_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set loop_messages = messages %}
{%- endif %}
{% for m in loop_messages %}
    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    <|im_start|>{{ m['role'] }}
{{ m['content'] }} {{ {'k': '<b>&', 'n': [1, 2]} | tojson }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}[{{ eos_token }}|{{ pad_token }}]"""


def test_template_rendering_follows_transformers(ckpt, tmp_path):
    """trim_blocks/lstrip_blocks, loop controls, tojson without HTML escaping, special-token variables."""
    transformers = pytest.importorskip("transformers")
    _, packed = ckpt
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(packed / name, folder / name)
    (folder / "chat_template.jinja").write_text(_TEMPLATE)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = load_tokenizer(folder)
    conv = [{"role": "system", "content": "S"}] + [{"role": r, "content": f"m{i}"}
                                                  for i, r in enumerate(["user", "assistant"] * 3)]
    for msgs in (conv, conv[1:2]):
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
                ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    with pytest.raises(TokenizerError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_streaming_detokenizer_holds_split_characters(ckpt):
    tok = load_tokenizer(ckpt[1])
    text = "héllo wörld 😀 日本語 ok\nnext line ½"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 2  # multi-byte characters really are split across tokens
    d = tok.detokenizer()
    pieces = [d.add(t) for t in ids] + [d.finalize()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # at least one token completed no character yet
    # an unfinished character at the very end comes out as decode() gives it
    d = tok.detokenizer()
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1
    assert [d.add(t) for t in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert d.finalize() == tok.decode(emoji[:-1])


# ------------------------------------------------------------------------------------------------ run


def _mlx_greedy(src, prompt, n, eos):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_load_model

    model, _ = mlx_load_model(src)
    model.set_dtype(mx.float32)
    cache = make_prompt_cache(model)
    last = model(mx.array(prompt)[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        t = int(np.array(last).argmax())
        if t in eos:
            break
        out.append(t)
        last = model(mx.array([t])[None], cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_greedy_tokens_equal_mlx_lm(ckpt, capsys, backend):
    src, packed = ckpt
    code, out, err = cli(capsys, "run", packed, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--temperature", "0",
                         "--max-tokens", "10", "--json", "--backend", backend)
    assert code == 0, err
    res = json.loads(out)
    with load_model(packed) as m:
        eos = set(m.eos_token_ids)
    assert res["tokens"] == _mlx_greedy(src, PROMPT_IDS, 10, eos)
    assert res["stats"]["backend"] == {"numpy": "numpy", "cpu": "numba"}[backend]


def test_dump_logits_equals_forward(ckpt, capsys, tmp_path):
    _, packed = ckpt
    f = tmp_path / "logits"  # no '.npy' appended
    code, _, err = cli(capsys, "run", packed, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens", "3",
                       "--dump-logits", f, "--backend", "numpy")
    assert code == 0, err
    got = np.load(f)
    with load_model(packed, backend="numpy") as m:
        want = m.forward(np.array(PROMPT_IDS), m.new_cache())
    assert got.dtype == np.float32 and got.shape == (len(PROMPT_IDS), m.vocab_size)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_json_is_one_object_and_streaming_equals_final_text(ckpt, capsys):
    _, packed = ckpt
    args = ("run", packed, "--prompt", PROMPTS[0], "--max-tokens", "16", "--backend", "numpy")
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0 and err == ""
    assert len(out.strip().splitlines()) == 1
    res = json.loads(out)
    assert set(res) == {"tokens", "text", "stats"}
    tok = load_tokenizer(packed)
    assert res["text"] == tok.decode(res["tokens"])
    s = res["stats"]
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_s", "expert_bytes_per_token", "io_wait_s", "compute_s",
                "peak_rss_bytes"):
        assert key in s
    assert s["peak_rss_bytes"] > 1e6 and s["prompt_tokens"] == len(encode_prompt(tok, PROMPTS[0]))
    assert set(s["phases"]) == {"prefill", "decode"} and s["phases"]["prefill"]["layers"]
    code, streamed, err = cli(capsys, *args, "--stats")
    assert code == 0
    assert streamed == res["text"] + ("" if res["text"].endswith("\n") else "\n")
    assert "tok/s" in err and "first token" in err and "I/O wait" in err and "peak RSS" in err
    assert "prefill" in err and "decode" in err and "attn ms" in err  # the per-layer table


def test_raw_prompt_is_plain_encode(ckpt, capsys, tmp_path):
    _, packed = ckpt
    text = "The quick brown fox"
    f = tmp_path / "l.npy"
    code, out, err = cli(capsys, "run", packed, "--prompt", text, "--raw", "--max-tokens", "0", "--json",
                         "--dump-logits", f, "--backend", "numpy")
    assert code == 0, err
    ids = load_tokenizer(packed).encode(text)
    assert json.loads(out)["stats"]["prompt_tokens"] == len(ids) == np.load(f).shape[0]
    with load_model(packed, backend="numpy") as m:
        want = m.forward(np.array(ids), m.new_cache())
    np.testing.assert_allclose(np.load(f), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_sampling_is_reproducible_with_a_seed(ckpt, capsys):
    _, packed = ckpt
    args = ("run", packed, "--prompt-ids", "1,2,3", "--max-tokens", "8", "--temperature", "1.5", "--top-k", "50",
            "--top-p", "0.95", "--json", "--backend", "numpy", "--experts-per-token", "4")
    a = json.loads(cli(capsys, *args, "--seed", "5")[1])
    b = json.loads(cli(capsys, *args, "--seed", "5")[1])
    assert a["tokens"] == b["tokens"] and a["stats"]["seed"] == 5
    c = json.loads(cli(capsys, *args)[1])
    assert isinstance(c["stats"]["seed"], int)  # a random seed, reported so it can be reused


def test_experts_per_token_override_and_low_k_warning(ckpt, capsys):
    _, packed = ckpt
    code, out, err = cli(capsys, "run", packed, "--prompt-ids", "1,2,3", "--max-tokens", "2",
                         "--experts-per-token", "3", "--backend", "numpy", "--io", "mmap")
    assert code == 0
    assert err.startswith("warning: ") and "collapses at K <= 3" in err and "K=3" in err
    code, out, err = cli(capsys, "run", packed, "--prompt-ids", "1,2,3", "--max-tokens", "2",
                         "--experts-per-token", "4", "--backend", "numpy", "--json")
    assert code == 0 and err == ""
    s = json.loads(out)["stats"]
    assert s["experts_per_token"] == 4 and s["phases"]["decode"]["experts_read"] == 4 * 4  # 4 layers


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("damage", ["manifest", "layer_file", "not_packed"])
def test_damaged_packed_folder(ckpt, capsys, tmp_path, damage):
    _, packed = ckpt
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    if damage == "manifest":
        m = json.loads((bad / "moepack.json").read_text())
        m["format_version"] = 99
        (bad / "moepack.json").write_text(json.dumps(m))
    elif damage == "layer_file":
        f = sorted((bad / "packed_experts").iterdir())[1]
        f.write_bytes(f.read_bytes()[:-100])
    else:
        (bad / "moepack.json").unlink()
    code, out, err = cli(capsys, "run", bad, "--prompt-ids", "1,2", "--backend", "numpy")
    assert_clean_error(code, err)
    assert out == ""


def test_missing_tokenizer_with_prompt(ckpt, capsys, tmp_path):
    _, packed = ckpt
    bare = tmp_path / "bare"
    shutil.copytree(packed, bare)
    (bare / "tokenizer.json").unlink()
    code, _, err = cli(capsys, "run", bare, "--prompt", "hi")
    assert_clean_error(code, err, "tokenizer.json", "--prompt-ids")
    code, out, err = cli(capsys, "run", bare, "--prompt-ids", "1,2", "--max-tokens", "2", "--backend", "numpy")
    assert code == 0 and len(out.split()) == 2  # without a tokenizer the ids are the output


@pytest.mark.parametrize("args,words", [
    (("--prompt-ids", "1,2,512"), ("512", "outside the vocabulary")),
    (("--prompt-ids", "1,-3"), ("-3", "outside the vocabulary")),
    (("--prompt", "hi", "--prompt-ids", "1"), ("--prompt-ids",)),
    ((), ("--prompt",)),
    (("--prompt-ids", "1,a"), ("integers",)),
    (("--prompt-ids", " , "), ("empty",)),
    (("--prompt-ids", "1", "--top-p", "0"), ("--top-p",)),
    (("--prompt-ids", "1", "--max-tokens", "-1"), ("--max-tokens",)),
    (("--prompt-ids", "1", "--experts-per-token", "99"), ("--experts-per-token", "1..8")),
])
def test_bad_input_is_a_one_line_error(ckpt, capsys, args, words):
    code, out, err = cli(capsys, "run", ckpt[1], "--backend", "numpy", *args)
    assert_clean_error(code, err, *words)
    assert out == ""


@pytest.mark.parametrize("cmd", ["run", "chat"])
def test_help_has_examples(capsys, cmd):
    code, out, _ = cli(capsys, cmd, "--help")
    assert code == 0 and "Example" in out and f"moepack {cmd}" in out
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--experts-per-token",
                 "--backend", "--io", "--session", "--stats"):
        assert flag in out
    if cmd == "run":
        for flag in ("--prompt", "--prompt-ids", "--raw", "--dump-logits", "--json"):
            assert flag in out


@pytest.mark.parametrize("io, want", [("pread", {"OMP_WAIT_POLICY": "PASSIVE"}), ("hybrid:2", {"OMP_WAIT_POLICY": "PASSIVE"}),
                                      ("mapped", {"GOMP_SPINCOUNT": "30000"})])
def test_openmp_wait_follows_the_io_mode_and_never_overrides_the_user(monkeypatch, io, want):
    """Reader threads need the cores (sleeping kernel threads); in-place mapped reads need none (brief spin)."""
    from moepack.cli.run_cmd import _openmp_wait

    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(k, "x")  # so that monkeypatch restores the original state afterwards
        monkeypatch.delenv(k)
    _openmp_wait(io)
    assert {k: os.environ.get(k) for k in want} == want
    other = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} - set(want)
    assert all(k not in os.environ for k in other)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice stands
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    _openmp_wait(io)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ


def test_dot_chooses_the_cpu_matvec_arithmetic(ckpt, capsys, tmp_path, monkeypatch):
    from moepack.runtime import kernels_numba

    monkeypatch.setattr(kernels_numba, "INT_DOT_MODE", kernels_numba.INT_DOT_MODE)  # restored afterwards
    _, packed = ckpt
    logits = {}
    for dot in ("float", "int16x2", "int16", "int8"):
        f = tmp_path / f"{dot}.npy"
        code, out, err = cli(capsys, "run", packed, "--prompt-ids", "1,37,200,5,88", "--max-tokens", "2",
                             "--backend", "cpu", "--dot", dot, "--dump-logits", f, "--json")
        assert code == 0, err
        assert json.loads(out)["stats"]["dot"] == dot == kernels_numba.dot_mode_name()
        logits[dot] = np.load(f)
    scale = np.abs(logits["float"]).max()
    # int16x2 is float-grade; int16 and int8 trade accuracy for speed, in that order
    assert np.abs(logits["int16x2"] - logits["float"]).max() <= 1e-4 * scale
    assert np.abs(logits["int16"] - logits["float"]).max() <= 1e-2 * scale
    assert not np.array_equal(logits["int8"], logits["float"])
    code, out, err = cli(capsys, "run", packed, "--prompt-ids", "1,2", "--dot", "fp8")
    assert code != 0 and "fp8" in err and "Traceback" not in err
    code, out, err = cli(capsys, "run", packed, "--prompt-ids", "1,2", "--max-tokens", "1", "--backend", "numpy",
                         "--json")
    assert code == 0 and json.loads(out)["stats"]["dot"] is None  # the numpy reference has one arithmetic

"""Sessions: a follow-up turn prefills only its new tokens and gives what one run over everything gives;
sessions from another model, other K, or damaged files are refused."""

import json
import shutil

import numpy as np
import pytest

from moepack.cli import main
from moepack.convert import convert
from moepack.errors import MoepackError
from moepack.runtime.generate import chat_turn, generate, run
from moepack.runtime.model import load_model
from moepack.runtime.session import Session, SessionError, load_session, open_session
from moepack.runtime.tokenizer import load_tokenizer
from moepack.testing.fixtures import write_mlx_checkpoint

P1 = [1, 37, 200, 5, 88, 410, 17]
P2 = [3, 250, 99, 64, 12]


def _pack(root, arch, seed):
    src = write_mlx_checkpoint(root / f"src-{arch}-{seed}", arch=arch, bits=4, seed=seed)
    out = root / f"packed-{arch}-{seed}"
    convert(str(src), out, progress=False)
    return out


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("session")
    return {"hybrid": _pack(root, "qwen3_5_moe", 3), "hybrid_other": _pack(root, "qwen3_5_moe", 4),
            "kv": _pack(root, "qwen3_moe", 3)}


def _greedy(packed, ids, n=6, **kw):
    return run(packed, prompt_ids=ids, max_tokens=n, temperature=0.0, backend="numpy", **kw)


def test_second_turn_prefills_only_new_tokens_and_matches_one_run(packs, tmp_path):
    sess = tmp_path / "s.npz"
    g1 = _greedy(packs["hybrid"], P1, session=sess)
    saved = np.load(sess)["session.tokens"].tolist()
    assert saved[: len(P1)] == P1 and saved[len(P1):][: len(g1.tokens)] == g1.tokens
    g2 = _greedy(packs["hybrid"], P2, session=sess)
    # the last generated token was never fed (its logits were not needed): it is prefilled with the new ones
    assert g2.reused_tokens == len(saved) - 1
    assert g2.stats["phases"]["prefill"]["tokens"] == len(P2) + 1
    assert g2.stats["prefill_tokens"] == len(P2) + 1
    one = _greedy(packs["hybrid"], saved + P2)
    assert one.reused_tokens == 0 and one.stats["prefill_tokens"] == len(saved) + len(P2)
    assert g2.tokens == one.tokens
    # the session file now holds the whole conversation
    assert np.load(sess)["session.tokens"].tolist()[: len(saved) + len(P2)] == saved + P2


def test_session_logits_match_a_fresh_forward(packs):
    """Continuing from a saved-and-restored cache equals running the concatenation in one go."""
    with load_model(packs["hybrid"]) as m:
        s = Session.new(m)
        generate(m, P1, session=s, max_tokens=0)
        d = s.cache.state_dict()
        restored = type(s.cache).from_state_dict({k: v.copy() for k, v in d.items()})
        a = m.forward(np.array(P2), restored)
        fresh = m.new_cache()
        b = m.forward(np.array(P1 + P2), fresh)[len(P1):]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())


def test_chat_turns_reuse_the_conversation(packs, tmp_path):
    sess = tmp_path / "chat.npz"
    g1 = run(packs["hybrid"], prompt="My name is Ada.", max_tokens=5, backend="numpy", session=sess)
    g2 = run(packs["hybrid"], prompt="What is my name?", max_tokens=5, backend="numpy", session=sess)
    tok = load_tokenizer(packs["hybrid"])
    assert g2.reused_tokens == g1.prompt_tokens + len(g1.tokens) + (g1.finish_reason == "stop") - 1
    assert g2.stats["prefill_tokens"] == g2.prompt_tokens - g2.reused_tokens
    # the new tokens are what the template adds for the new turn
    msgs = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": g1.text},
            {"role": "user", "content": "What is my name?"}]
    full = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert full.endswith("<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n")
    with load_model(packs["hybrid"]) as m:
        s = load_session(sess, m)
        assert s.messages == msgs + [{"role": "assistant", "content": g2.text}]


def test_chat_turn_library(packs):
    with load_model(packs["hybrid"]) as m:
        tok = load_tokenizer(packs["hybrid"])
        s = Session.new(m)
        g1 = chat_turn(m, tok, s, "Hello", max_tokens=4)
        assert g1.prompt_tokens == len(tok.encode_chat([{"role": "user", "content": "Hello"}]))
        g2 = chat_turn(m, tok, s, "Again", max_tokens=4)
        assert g2.reused_tokens > g1.prompt_tokens
        assert [x["role"] for x in s.messages] == ["user", "assistant", "user", "assistant"]


def test_divergent_context_truncates_kv_only_cache(packs):
    with load_model(packs["kv"], backend="numpy") as m:
        s = Session.new(m)
        generate(m, P1 + P2, session=s, max_tokens=0)
        assert s.cache.offset == len(P1 + P2)
        other = P1 + [7, 8, 9]
        g = generate(m, other, session=s, max_tokens=0, keep_logits=True)
        assert g.reused_tokens == len(P1)  # the KV cache was cut back to the common prefix
        ref = m.forward(np.array(other), m.new_cache())[len(P1):]
        np.testing.assert_allclose(g.logits, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_divergent_context_restarts_hybrid_cache(packs):
    with load_model(packs["hybrid"], backend="numpy") as m:
        s = Session.new(m)
        generate(m, P1 + P2, session=s, max_tokens=0)
        g = generate(m, P1 + [7, 8, 9], session=s, max_tokens=0)
        assert g.reused_tokens == 0  # a linear-attention state cannot be rewound
        assert s.cache.offset == len(P1) + 3


def test_interrupted_generation_leaves_a_usable_session(packs):
    with load_model(packs["hybrid"], backend="numpy") as m:
        s = Session.new(m)
        calls = []
        g = generate(m, P1, session=s, max_tokens=50, eos_token_ids=[],
                     should_stop=lambda: calls.append(1) or len(calls) >= 3)
        assert g.finish_reason == "interrupted" and len(g.tokens) == 3
        assert s.cache.offset == len(s.tokens) - 1
        g2 = generate(m, s.ids_context(P2), session=s, max_tokens=0)
        assert g2.reused_tokens == len(P1) + 2


def test_session_from_another_model_is_refused(packs, tmp_path, capsys):
    sess = tmp_path / "s.npz"
    _greedy(packs["hybrid"], P1, n=2, session=sess)
    with pytest.raises(SessionError, match="another model"):
        _greedy(packs["hybrid_other"], P2, n=2, session=sess)
    code = main(["run", str(packs["hybrid_other"]), "--prompt-ids", "1,2", "--session", str(sess),
                 "--backend", "numpy"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert err.startswith("error: ") and "another model" in err and "hint: " in err


def test_session_with_other_k_is_refused(packs, tmp_path):
    sess = tmp_path / "s.npz"
    _greedy(packs["hybrid"], P1, n=2, session=sess)
    with pytest.raises(SessionError, match="--experts-per-token"), pytest.warns(RuntimeWarning, match="collapses"):
        _greedy(packs["hybrid"], P2, n=2, session=sess, experts_per_token=3)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_session_is_refused(packs, tmp_path, capsys, damage):
    sess = tmp_path / "s.npz"
    _greedy(packs["hybrid"], P1, n=2, session=sess)
    data = sess.read_bytes()
    sess.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"not a zip" * 100, "empty": b""}[damage])
    with pytest.raises(SessionError, match="damaged or truncated"):
        _greedy(packs["hybrid"], P2, n=2, session=sess)
    code = main(["run", str(packs["hybrid"]), "--prompt-ids", "1,2", "--session", str(sess), "--backend", "numpy"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and err.startswith("error: ") and "hint: " in err


def test_session_missing_key_is_refused(packs, tmp_path):
    sess = tmp_path / "s.npz"
    _greedy(packs["hybrid"], P1, n=2, session=sess)
    d = dict(np.load(sess))
    del d["cache.layer.0.recurrent"]  # layer 0 is linear attention
    with open(sess, "wb") as f:
        np.savez(f, **d)
    with pytest.raises(SessionError, match="damaged"):
        _greedy(packs["hybrid"], P2, n=2, session=sess)


def test_session_file_is_written_atomically(packs, tmp_path):
    sess = tmp_path / "s.bin"  # any name: no '.npz' is appended
    _greedy(packs["hybrid"], P1, n=2, session=sess)
    assert sess.exists() and [p.name for p in tmp_path.iterdir()] == ["s.bin"]
    with load_model(packs["hybrid"]) as m:
        s = open_session(sess, m)
        assert s.cache.offset == len(s.tokens) - 1 and s.tokens[: len(P1)] == P1
        assert open_session(tmp_path / "new.npz", m).tokens == []


def test_nothing_to_run_is_refused(packs):
    with load_model(packs["hybrid"]) as m:
        with pytest.raises(MoepackError, match="nothing to run"):
            generate(m, [], max_tokens=1)


def test_chat_cli_multi_turn_with_reset_and_eof(packs, tmp_path, monkeypatch, capsys):
    import io

    sess = tmp_path / "c.npz"
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nagain\n/reset\nfresh start\n"))  # ends without /exit
    code = main(["chat", str(packs["hybrid"]), "--session", str(sess), "--max-tokens", "3", "--backend", "numpy"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "(new conversation)" in err and "Traceback" not in err
    with load_model(packs["hybrid"]) as m:
        s = load_session(sess, m)
    assert [x["content"] for x in s.messages if x["role"] == "user"] == ["fresh start"]
    monkeypatch.setattr("sys.stdin", io.StringIO("next\n/exit\nnever read\n"))
    code = main(["chat", str(packs["hybrid"]), "--session", str(sess), "--max-tokens", "3", "--backend", "numpy",
                 "--stats"])
    out, err = capsys.readouterr()
    assert code == 0 and "resumed 1 turns" in err and "decode" in err
    with load_model(packs["hybrid"]) as m:
        s = load_session(sess, m)
    assert [x["content"] for x in s.messages if x["role"] == "user"] == ["fresh start", "next"]


def test_chat_without_tokenizer_is_a_clean_error(packs, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(packs["hybrid"], bare)
    (bare / "tokenizer.json").unlink()
    code = main(["chat", str(bare)])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error: ") and "tokenizer.json" in err and "--prompt-ids" in err
    assert "Traceback" not in err


def test_soft_interrupt_turns_ctrl_c_into_a_stop_request():
    import os
    import signal

    from moepack.cli.run_cmd import _soft_interrupt

    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN when started in the background
    with _soft_interrupt() as stopped:
        assert not stopped()
        os.kill(os.getpid(), signal.SIGINT)
        assert stopped()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler is back


def test_json_stats_are_serialisable(packs, tmp_path, capsys):
    code = main(["run", str(packs["kv"]), "--prompt-ids", "5,6,7", "--max-tokens", "2", "--backend", "numpy",
                 "--json", "--session", str(tmp_path / "s.npz")])
    out = capsys.readouterr().out
    assert code == 0
    res = json.loads(out)
    assert res["stats"]["prompt_tokens"] == 3


def test_chat_context_ignores_an_unfed_end_token_the_template_does_not_write(packs):
    """A reply that ended with <|endoftext|> (an EOS the template does not write) still reuses the cache."""
    with load_model(packs["hybrid"], backend="numpy") as m:
        tok = load_tokenizer(packs["hybrid"])
        s = Session.new(m)
        msgs = [{"role": "user", "content": "Hello"}]
        g = generate(m, s.chat_context(tok, msgs), session=s, tokenizer=tok, max_tokens=3, eos_token_ids=[])
        m.forward(np.array(s.tokens[-1:]), s.cache)  # feed the last reply token, then "sample" <|endoftext|>
        s.tokens.append(0)
        msgs += [{"role": "assistant", "content": g.text}, {"role": "user", "content": "More"}]
        ctx = s.chat_context(tok, msgs)
        assert ctx[: s.cache.offset] == s.tokens[:-1]
        assert tok.decode(ctx) == tok.apply_chat_template(msgs)
        held = s.cache.offset
        g2 = generate(m, ctx, session=s, max_tokens=1)
        assert g2.reused_tokens == held and g2.stats["dropped_tokens"] == 0
        assert g2.stats["prefill_tokens"] == len(ctx) - held

"""Text generation on a loaded model: prefill, then one token at a time, streaming text as it completes.

    with load_model("packed/") as model:
        tok = load_tokenizer("packed/")
        g = generate(model, tok.encode_chat([{"role": "user", "content": "Hi"}]), tokenizer=tok,
                     max_tokens=64, on_text=print_piece)
    g.tokens, g.text, g.stats

``run(packed, prompt=..., ...)`` is ``moepack run``: its keywords are the command's options.

Where time goes is reported per phase: ``prefill`` (the new prompt tokens, fed in chunks of
``prefill_chunk``) and ``decode`` (one forward per generated token after the first). ``model.stats`` is reset
at the start of each phase; ``Generation.stats["phases"]`` keeps both snapshots (per layer: attention and MoE
time, expert I/O wait, experts and bytes read).
"""

from __future__ import annotations

import os
import resource
import secrets
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import MoepackError
from .residency import proc_kib_field
from .sampling import check_sampling, make_sampler
from .session import Session, open_session

BACKEND_CHOICES = ("auto", "cpu", "numpy", "metal-emu", "cuda", "metal")
MIN_SAFE_K = 4  # seed notes: every layer needs K >= 4; K = 2-3 collapses output
PREFILL_CHUNK = 512  # prompt tokens per forward call: bounds the [T, vocab] logits and attention scores


@dataclass
class Generation:
    """What one generate() call produced."""

    tokens: list[int]  # generated ids, end-of-sequence excluded
    text: str  # their text ('' without a tokenizer)
    finish_reason: str  # 'stop' (end of sequence), 'length' (max_tokens), 'interrupted'
    prompt_tokens: int  # the whole context fed to the model, reused part included
    reused_tokens: int  # context tokens the session cache already held (not recomputed)
    stats: dict = field(default_factory=dict)
    logits: np.ndarray | None = None  # [prefilled tokens, vocab] when asked for
    has_text: bool = True  # False when there was no tokenizer to turn the tokens into text


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: VmHWM on Linux, ru_maxrss elsewhere."""
    hwm = proc_kib_field("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux/BSD KiB


def resolve_backend(backend: str) -> str:
    """CLI backend name -> model backend: 'cpu' is the numba fast path, 'numpy' the reference, 'auto' numba
    when it imports and runs, else numpy."""
    if backend in ("numpy", "metal-emu", "cuda", "metal"):  # the GPU executors check themselves when made
        return backend
    if backend not in ("auto", "cpu", "numba"):
        raise MoepackError(f"unknown backend {backend!r}", hint=f"use one of {', '.join(BACKEND_CHOICES)}")
    try:
        from .model import load_kernels

        K = load_kernels("numba")
        x = np.ones((1, 64), dtype=np.float32)
        if not np.allclose(K.rmsnorm(x, np.ones(64, dtype=np.float32), 1e-6), 1.0, atol=1e-3):
            raise MoepackError("the numba kernels give wrong results on this machine")
        return "numba"
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        if backend == "auto":
            return "numpy"
        msg = e.message if isinstance(e, MoepackError) else f"{type(e).__name__}: {e}"
        raise MoepackError(f"the cpu (numba) backend is not usable: {msg}", hint="pass --backend numpy") from None


def open_model(packed, *, backend: str = "auto", io: str = "pread", experts_per_token: int | None = None):
    """load_model() with the CLI's backend names and K checked against the manifest first."""
    from ..layout.manifest import load_manifest
    from .model import load_model

    if experts_per_token is not None:
        moe = load_manifest(packed).moe
        if not 1 <= experts_per_token <= moe.num_experts:
            raise MoepackError(f"--experts-per-token {experts_per_token} is outside 1..{moe.num_experts}",
                               hint=f"the model has {moe.num_experts} experts per layer and routes to "
                                    f"{moe.experts_per_token} by default")
    return load_model(packed, backend=resolve_backend(backend), io=io, experts_per_token=experts_per_token)


def check_ids(ids, vocab_size: int) -> list[int]:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise MoepackError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                           hint="the ids come from another tokenizer than this model's")
    return ids


def generate(model, context, *, session: Session | None = None, tokenizer=None, max_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | np.random.Generator | None = None, eos_token_ids=None,
             on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
             keep_logits: bool = False, prefill_chunk: int = PREFILL_CHUNK) -> Generation:
    """Continue `context` (all ids of the conversation) with up to `max_tokens` tokens.

    With a `session`, the tokens its cache already holds are not recomputed and the session is updated
    (tokens, cache); `should_stop` is polled between forward calls (Ctrl-C handling) and ends the
    generation cleanly, the cache consistent. `keep_logits` keeps the prefill logits (one row per token
    fed, i.e. per prompt position without a session)."""
    if max_tokens < 0:
        raise MoepackError(f"--max-tokens must be >= 0, got {max_tokens}", hint="0 only prefills the prompt")
    check_sampling(temperature, top_p, top_k)
    context = check_ids(context, model.vocab_size)
    if not context:
        raise MoepackError("nothing to run: the prompt has no tokens")
    keep_cache = session is not None  # the caller keeps the session: its cache must end up on the host
    session = session if session is not None else Session.new(model)
    eos = set(model.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if tokenizer is not None and eos_token_ids is None:
        eos.update(tokenizer.eos_token_ids)
    pick = make_sampler(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)  # a Generator continues
    stop = should_stop or (lambda: False)
    detok = tokenizer.detokenizer() if tokenizer is not None else None
    emit = on_text or (lambda s: None)

    held = session.cache.offset
    reused = session.prepare(model, context)
    feed = context[reused:]
    cache = session.cache
    rows = [] if keep_logits else None
    finish = "length"
    model.stats.reset()
    t0 = time.perf_counter()
    logits = None
    for i in range(0, len(feed), max(1, prefill_chunk)):
        logits = model.forward(np.asarray(feed[i : i + prefill_chunk], dtype=np.int64), cache)
        if rows is not None:
            rows.append(logits)
        if i + prefill_chunk < len(feed) and stop():
            finish = "interrupted"
            break
    t_prefill = time.perf_counter() - t0
    prefill_stats = model.stats.to_json()
    model.stats.reset()

    generated: list[int] = []
    decode_steps = 0
    ttft = None
    t1 = time.perf_counter()
    if finish != "interrupted" and max_tokens > 0:
        last = logits[-1]
        while True:
            tok = pick(last)
            if ttft is None:
                ttft = time.perf_counter() - t0
            session.tokens.append(tok)  # part of the conversation; fed to the cache next time if not now
            if tok in eos:
                finish = "stop"
                break
            generated.append(tok)
            if detok is not None:
                piece = detok.add(tok)
                if piece:
                    emit(piece)
            if len(generated) >= max_tokens:
                finish = "length"
                break
            if stop():
                finish = "interrupted"
                break
            last = model.forward(np.array([tok], dtype=np.int64), cache)[-1]
            decode_steps += 1
    if keep_cache and hasattr(model, "sync_cache"):
        model.sync_cache(cache)  # GPU backends: the decode steps' state comes back from the device
    if detok is not None:
        piece = detok.finalize()
        if piece:
            emit(piece)
    t_decode = time.perf_counter() - t1
    decode_stats = model.stats.to_json()

    n_fed = prefill_stats["tokens"]
    io_wait = prefill_stats["io_wait_s"] + decode_stats["io_wait_s"]
    stats = {
        "backend": model.backend,
        "io": model.reader.io,
        "dot": model.K.dot_mode_name() if hasattr(model.K, "dot_mode_name") else None,
        "experts_per_token": model.experts_per_token,
        "prompt_tokens": len(context),
        "reused_tokens": reused,
        "dropped_tokens": held - reused,  # session tokens that did not prefix this context (recomputed)
        "prefill_tokens": n_fed,
        "generated_tokens": len(generated),
        "finish_reason": finish,
        "prefill_s": t_prefill,
        "prefill_tok_s": n_fed / t_prefill if t_prefill > 0 else 0.0,
        "ttft_s": ttft,
        "decode_steps": decode_steps,
        "decode_s": t_decode,
        "decode_tok_s": decode_steps / t_decode if decode_steps and t_decode > 0 else None,
        "expert_bytes_per_token": (decode_stats["expert_bytes_read"] / decode_steps if decode_steps
                                   else prefill_stats["expert_bytes_read"] / max(1, n_fed)),
        "io_wait_s": io_wait,
        "compute_s": prefill_stats["compute_s"] + decode_stats["compute_s"],
        "peak_rss_bytes": peak_rss_bytes(),
        "phases": {"prefill": prefill_stats, "decode": decode_stats},
    }
    return Generation(generated, detok.text if detok is not None else "", finish, len(context), reused, stats,
                      np.concatenate(rows) if rows else (np.zeros((0, model.vocab_size), np.float32)
                                                         if rows is not None else None), detok is not None)


def chat_turn(model, tokenizer, session: Session, user_text: str, **generate_kwargs) -> Generation:
    """One chat turn: the conversation so far plus `user_text` through the chat template, the reply appended
    to ``session.messages``. Only the tokens the session does not already hold are prefilled."""
    messages = list(session.messages) + [{"role": "user", "content": user_text}]
    context = session.chat_context(tokenizer, messages)
    g = generate(model, context, session=session, tokenizer=tokenizer, **generate_kwargs)
    session.messages = messages + [{"role": "assistant", "content": g.text}]
    return g


def parse_ids(text: str) -> list[int]:
    """'1,2, 3' or '1 2 3' -> [1, 2, 3]."""
    parts = [p for p in text.replace(",", " ").split()]
    if not parts:
        raise MoepackError("--prompt-ids is empty", hint='pass comma-separated token ids, e.g. --prompt-ids "1,2,3"')
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise MoepackError(f"--prompt-ids must be integers, got {text!r}",
                           hint='pass comma-separated token ids, e.g. --prompt-ids "1,2,3"') from None


def _write_npy(path: str | os.PathLike, array: np.ndarray) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # a file object: np.save would append '.npy' to a name
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run(packed, *, prompt: str | None = None, prompt_ids: str | list[int] | None = None, raw: bool = False,
        max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        seed: int | None = None, experts_per_token: int | None = None, backend: str = "auto", io: str = "pread",
        session: str | os.PathLike | None = None, dump_logits: str | os.PathLike | None = None,
        on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
        warn: Callable[[str], None] | None = None) -> Generation:
    """`moepack run`: load PACKED, build the prompt, generate, save the session and the logits if asked."""
    from .tokenizer import TokenizerError, load_tokenizer

    warn = warn or (lambda m: warnings.warn(m, RuntimeWarning, stacklevel=3))
    if (prompt is None) == (prompt_ids is None):
        raise MoepackError("pass exactly one of --prompt and --prompt-ids"
                           if prompt is not None else "nothing to run: no --prompt or --prompt-ids",
                           hint='e.g. --prompt "Hello" or --prompt-ids "1,2,3"')
    check_sampling(temperature, top_p, top_k)
    if max_tokens < 0:
        raise MoepackError(f"--max-tokens must be >= 0, got {max_tokens}", hint="0 only prefills the prompt")
    ids = parse_ids(prompt_ids) if isinstance(prompt_ids, str) else (None if prompt_ids is None else list(prompt_ids))
    if experts_per_token is not None and experts_per_token < MIN_SAFE_K:
        warn(f"--experts-per-token {experts_per_token}: output collapses at K <= 3 (every layer needs K >= 4)")
    if seed is None and temperature > 0:
        seed = secrets.randbits(32)  # reported in the stats, so a good sample can be reproduced
    tokenizer = None
    if prompt is not None:
        tokenizer = load_tokenizer(packed, required=False)
        if tokenizer is None:
            raise TokenizerError(f"{packed} has no tokenizer.json, so --prompt cannot be tokenized")
        if not raw and tokenizer.chat_template is None:
            warn("the model has no chat template: using the prompt as raw text")
            raw = True
    model = open_model(packed, backend=backend, io=io, experts_per_token=experts_per_token)
    try:
        if tokenizer is None:
            try:
                tokenizer = load_tokenizer(packed, required=False)  # only to turn generated ids into text
            except TokenizerError as e:
                warn(f"no text output: {e.message}")
        sess = open_session(session, model)
        kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  on_text=on_text, should_stop=should_stop, keep_logits=dump_logits is not None)
        if prompt is not None and not raw:
            g = chat_turn(model, tokenizer, sess, prompt, **kw)
        else:
            new = ids if ids is not None else tokenizer.encode(prompt, add_special_tokens=not sess.tokens)
            g = generate(model, sess.ids_context(check_ids(new, model.vocab_size)), session=sess,
                         tokenizer=tokenizer, **kw)
        g.stats["seed"] = seed
        if g.stats["dropped_tokens"]:
            warn(f"the session's tokens did not all prefix this prompt: {g.stats['dropped_tokens']} of them were "
                 "dropped and the context was recomputed")
        if session is not None:
            sess.save(session)
        if dump_logits is not None:
            _write_npy(dump_logits, g.logits.astype(np.float32, copy=False))
        return g
    finally:
        model.close()

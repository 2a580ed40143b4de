"""`moepack run PACKED` (one prompt, streamed) and `moepack chat PACKED` (interactive, multi-turn)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import warnings

import click

_BACKENDS = ("auto", "cpu", "numpy", "metal-emu", "cuda", "metal")
_IO = ("pread", "direct", "mmap", "hybrid", "mapped", "auto")


def _io_spec(io: str, split: int) -> str:
    """--io M --split N as the 'M:N' form the runtime's io argument takes."""
    return io if split == 1 else f"{io}:{split}"


def _model_options(f):
    """Options `run` and `chat` share (sampling, K, backend, I/O, session, stats), outermost last."""
    opts = [
        click.option("--max-tokens", type=int, default=256, show_default=True,
                     help="Generate at most N tokens (stops earlier at end of sequence)."),
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="0 is greedy (argmax); higher samples more freely."),
        click.option("--top-p", type=float, default=1.0, show_default=True,
                     help="Sample from the smallest set of tokens whose probability reaches P (1 = off)."),
        click.option("--top-k", type=int, default=0, show_default=True,
                     help="Sample from the K most likely tokens only (0 = off)."),
        click.option("--seed", type=int, default=None,
                     help="Seed of the sampler (default: random, reported in the stats)."),
        click.option("--experts-per-token", type=int, default=None, metavar="K",
                     help="Routed experts per token (default: the model's). Fewer read less from the SSD; "
                          "output collapses at K <= 3."),
        click.option("--backend", type=click.Choice(_BACKENDS), default="auto", show_default=True,
                     help="cpu: numba kernels; numpy: the reference; auto: cpu when numba works; metal: the "
                          "metal/*.metal kernels on Apple silicon; cuda: the same kernels as PTX on an NVIDIA "
                          "GPU (needs cupy); metal-emu: the same kernels in the CPU emulator (slow: for "
                          "verification, tiny models)."),
        click.option("--io", type=click.Choice(_IO), default="auto", show_default=True,
                     help="How experts are read: pread (through the page cache), direct (bypass it: cold-read "
                          "benchmarks), mmap (for comparison), hybrid (mincore: copy cached pages from a "
                          "mapping, pread the rest), mapped (as hybrid, but a wholly cached expert is used in place: no "
                          "copy), auto (what `moepack bench-io` saved for this model or disk, else mapped on the "
                          "CPU backends when the experts fit in memory, pread otherwise)."),
        click.option("--dot", type=click.Choice(("auto", "float", "int16x2", "int16", "int8")), default="auto",
                     show_default=True,
                     help="Arithmetic of the cpu backend's 2/4-bit matvecs: int16x2 (auto's choice with AVX2: "
                          "integer dot products, as accurate as float), float, or faster and less exact: "
                          "int16 (~1.1x; logits move ~1e-3 of their range) and int8 (llama.cpp's activations; "
                          "tokens can change)."),
        click.option("--split", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
                     help="Read each expert as N 16 KiB-aligned chunks on N threads."),
        click.option("--session", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                     help="Resume the conversation saved in FILE (if it exists) and save it back: a follow-up "
                          "prompt prefills only its new tokens."),
        click.option("--stats", "show_stats", is_flag=True,
                     help="Also print time, I/O and experts read per layer and phase."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@contextlib.contextmanager
def _soft_interrupt():
    """First Ctrl-C: ask generation to stop after the current token (the cache stays consistent).
    Second Ctrl-C: KeyboardInterrupt as usual."""
    hits = [0]

    def handler(signum, frame):
        hits[0] += 1
        if hits[0] > 1:
            raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread (embedded use): leave Ctrl-C alone
        previous = None
    try:
        yield lambda: hits[0] > 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _warnings_as_lines():
    """Runtime warnings (e.g. --io direct falling back to pread) as one 'warning:' line on stderr."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: click.echo(f"warning: {message}", err=True)
        yield


def _set_dot(dot: str) -> None:
    if dot != "auto":
        from ..runtime import kernels_numba

        kernels_numba.set_dot_mode(dot)


def _openmp_wait_for(packed: str, io: str, split: int, backend: str) -> None:
    """_openmp_wait() for the mode `--io` resolves to on this model (auto: saved recommendation or default)."""
    from ..runtime.io import planned_io

    try:
        mode = planned_io(packed, _io_spec(io, split), backend)
    except Exception:  # noqa: BLE001 - a bad folder is reported by the loader, with its own message
        mode = io
    _openmp_wait(mode)


def _openmp_wait(io: str) -> None:
    """How idle OpenMP threads of the numba kernels wait (unless the user chose): must run before the first
    parallel kernel starts the OpenMP runtime.

    Reading threads need the cores: with pread/direct/hybrid/mmap the kernels' idle threads sleep
    (OMP_WAIT_POLICY=PASSIVE). Measured with benchmarks/decode.py: warm K=10 decode went from 20 to 39 tok/s
    on 16 cores and from ~6 to ~20 on a busy 2-core VM when spinning threads stopped starving the readers.
    With --io mapped, cached experts need no reading thread, so the idle threads spin briefly
    (GOMP_SPINCOUNT=30000, ~tens of microseconds) before sleeping: the next kernel of the token, launched a
    few microseconds later, then finds them awake. Measured: in RAM 58-64 vs 41-44 tok/s (2 cores, K=4), warm
    1 layer K=10 169 vs 146 tok/s (16 cores); with pread the same spinning fell from 102 to 46 tok/s."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if str(io).partition(":")[0] == "mapped":
        os.environ["GOMP_SPINCOUNT"] = "30000"
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def _mb(n) -> str:
    return f"{n / 1e6:.1f} MB"


def summary(stats: dict) -> str:
    """Two lines: prompt/prefill/first token, then decode/I-O/memory."""
    s = stats
    line1 = (f"prompt {s['prompt_tokens']} tokens ({s['reused_tokens']} reused from the session), prefill "
             f"{s['prefill_tokens']} in {s['prefill_s']:.2f} s = {s['prefill_tok_s']:.1f} tok/s")
    if s["ttft_s"] is not None:
        line1 += f", first token after {s['ttft_s']:.2f} s"
    dec = (f"{s['decode_tok_s']:.2f} tok/s" if s["decode_tok_s"] else "-")
    line2 = (f"generated {s['generated_tokens']} ({s['finish_reason']}), decode {dec}, experts "
             f"{_mb(s['expert_bytes_per_token'])}/token at K={s['experts_per_token']}, I/O wait "
             f"{s['io_wait_s']:.2f} s vs compute {s['compute_s']:.2f} s, peak RSS {_mb(s['peak_rss_bytes'])} "
             f"[{s['backend']}, {s['io']}" + (f", {s['dot']}" if s.get("dot") else "") + "]")
    return line1 + "\n" + line2


def layer_table(stats: dict) -> str:
    """Per phase and layer: ms per token in attention and MoE, of which waiting for expert reads; experts
    and MB read per token."""
    lines = [f"{'phase':<8}{'layer':>6}{'attn ms':>10}{'moe ms':>10}{'io wait':>10}{'experts':>9}{'MB read':>10}"
             "   (per token)"]
    for phase in ("prefill", "decode"):
        p = stats["phases"][phase]
        n = p["tokens"]
        if not n:
            continue
        for layer, t in p["layers"].items():
            lines.append(f"{phase:<8}{layer:>6}{t['attn_s'] * 1e3 / n:>10.2f}{t['moe_s'] * 1e3 / n:>10.2f}"
                         f"{t['io_wait_s'] * 1e3 / n:>10.2f}{t['experts_read'] / n:>9.1f}"
                         f"{t['bytes_read'] / 1e6 / n:>10.2f}")
        lines.append(f"{phase:<8}{'all':>6}  {n} tokens, {p['forward_calls']} forward calls, I/O wait "
                     f"{p['io_wait_s']:.3f} s ({p['io_wait_s'] * 1e3 / n:.2f} ms/token), compute "
                     f"{p['compute_s']:.3f} s, {_mb(p['expert_bytes_read'])} read")
    return "\n".join(lines)


def _report(stats: dict, show_stats: bool) -> None:
    click.echo(summary(stats), err=True)
    if show_stats:
        click.echo(layer_table(stats), err=True)


@click.command("run")
@click.argument("packed")
@click.option("--revision", default=None, help="Hub revision when PACKED is a repo id.")
@click.option("--prompt", default=None, metavar="TEXT",
              help="Text prompt, sent through the model's tokenizer and chat template (as one user message).")
@click.option("--prompt-ids", default=None, metavar='"1,2,3"',
              help="Token ids instead of text: no tokenizer, no chat template.")
@click.option("--raw", is_flag=True, help="Tokenize --prompt as plain text, without the chat template.")
@_model_options
@click.option("--dump-logits", type=click.Path(dir_okay=False), default=None, metavar="FILE.npy",
              help="Write the prompt's logits, float32 [prompt tokens, vocab] (one row per position prefilled).")
@click.option("--json", "as_json", is_flag=True,
              help='Print one JSON object {"tokens", "text", "stats"} and nothing else on stdout.')
def run_cmd(packed, revision, prompt, prompt_ids, raw, max_tokens, temperature, top_p, top_k, seed, experts_per_token,
            backend, io, dot, split, session, show_stats, dump_logits, as_json):
    """Generate text with a packed model on the CPU, streaming its experts from disk.

    The text streams to stdout as it is generated; timings (prefill and decode tok/s, time to first token,
    expert bytes per token, I/O wait vs compute, peak memory) go to stderr at the end. Ctrl-C stops the
    answer early (the session stays usable); a second Ctrl-C aborts.

    \b
    Examples:
      moepack run ./q397-2bit --prompt "Explain mixture of experts in one paragraph."
      moepack run ./q397-2bit --prompt "Hi" --experts-per-token 4 --max-tokens 64 --stats
      moepack run ./q397-2bit --prompt-ids "1,2,3" --temperature 0 --json
      moepack run ./q397-2bit --prompt "Write a haiku" --temperature 0.7 --top-p 0.9 --seed 1
      moepack run ./q397-2bit --prompt "My name is Ada." --session chat.npz
      moepack run ./q397-2bit --prompt "What is my name?" --session chat.npz   # prefills only this turn
      moepack run ./q397-2bit --prompt-ids "1,2,3" --max-tokens 0 --dump-logits logits.npy
      moepack run me/Qwen3.5-397B-A17B-moepack-2bit --prompt "Hi"   # pulled, verified once, cached
    """
    from ..hub.pull import resolve_packed
    from ..runtime.generate import run

    packed = resolve_packed(packed, revision, progress=not as_json)
    _openmp_wait_for(packed, io, split, backend)
    _set_dot(dot)
    streamed = []

    def on_text(piece: str) -> None:
        streamed.append(piece)
        if not as_json:
            click.echo(piece, nl=False)

    with _warnings_as_lines(), _soft_interrupt() as stopped:
        g = run(packed, prompt=prompt, prompt_ids=prompt_ids, raw=raw, max_tokens=max_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, experts_per_token=experts_per_token,
                backend=backend, io=_io_spec(io, split), session=session, dump_logits=dump_logits, on_text=on_text,
                should_stop=stopped, warn=_warn)
    if as_json:
        click.echo(json.dumps({"tokens": g.tokens, "text": g.text, "stats": g.stats}))
        return
    if not g.has_text and g.tokens:  # no tokenizer: the ids are the output
        click.echo(" ".join(map(str, g.tokens)), nl=False)
    if streamed or g.tokens:
        click.echo("" if "".join(streamed).endswith("\n") else "\n", nl=False)
    _report(g.stats, show_stats)


def _read_line(interactive: bool) -> str | None:
    """One line of user input; None at end of input (Ctrl-D)."""
    if not interactive:
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\n")
    while True:
        try:
            return input(">>> ")
        except EOFError:
            click.echo("")
            return None
        except KeyboardInterrupt:
            click.echo("\n(Ctrl-D or /exit quits)")


@click.command("chat")
@click.argument("packed")
@click.option("--revision", default=None, help="Hub revision when PACKED is a repo id.")
@_model_options
@click.option("--system", default=None, metavar="TEXT", help="System message at the start of a new conversation.")
def chat_cmd(packed, revision, max_tokens, temperature, top_p, top_k, seed, experts_per_token, backend, io, dot,
             split, session, show_stats, system):
    """Chat with a packed model in the terminal, one turn after another.

    Each turn sends the whole conversation through the chat template, but only the tokens the cache does not
    already hold are prefilled. With --session the conversation is saved after every turn and resumed on the
    next start. Type /exit (or press Ctrl-D) to quit, /reset to start a new conversation; Ctrl-C during an
    answer stops it and returns to the prompt.

    \b
    Examples:
      moepack chat ./q397-2bit
      moepack chat ./q397-2bit --session chat.npz --experts-per-token 4 --temperature 0.7 --top-p 0.9
    """
    import numpy as np

    from ..hub.pull import resolve_packed

    packed = resolve_packed(packed, revision)
    _openmp_wait_for(packed, io, split, backend)
    _set_dot(dot)
    from ..runtime.generate import MIN_SAFE_K, chat_turn, open_model
    from ..runtime.sampling import check_sampling
    from ..runtime.session import Session, open_session
    from ..runtime.tokenizer import TokenizerError, load_tokenizer

    check_sampling(temperature, top_p, top_k)
    if experts_per_token is not None and experts_per_token < MIN_SAFE_K:
        _warn(f"--experts-per-token {experts_per_token}: output collapses at K <= 3 (every layer needs K >= 4)")
    try:
        tokenizer = load_tokenizer(packed)
    except TokenizerError as e:
        raise TokenizerError(e.message, hint='chat needs the tokenizer; `moepack run PACKED --prompt-ids "1,2,3"` '
                                             "works without one") from None
    if tokenizer.chat_template is None:
        raise TokenizerError(f"{packed} has no chat template (tokenizer_config.json or chat_template.jinja)",
                             hint='use `moepack run PACKED --raw --prompt TEXT` for plain-text prompts')
    interactive = sys.stdin.isatty()
    with _warnings_as_lines(), open_model(packed, backend=backend, io=_io_spec(io, split), experts_per_token=experts_per_token) as model:
        sess = open_session(session, model)
        rng = np.random.default_rng(seed)
        click.echo(f"moepack chat: {packed} [{model.backend}, K={model.experts_per_token}]"
                   + (f", resumed {sum(x.get('role') == 'user' for x in sess.messages)} turns ({len(sess.tokens)} tokens)"
                      if sess.tokens else "")
                   + ". /exit quits, /reset starts over, Ctrl-C stops an answer.", err=True)
        while True:
            line = _read_line(interactive)
            if line is None or line.strip() == "/exit":
                break
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                sess.reset(model)
                if session:
                    sess.save(session)
                click.echo("(new conversation)", err=True)
                continue
            if system and not sess.messages:
                sess.messages = [{"role": "system", "content": system}]
            try:
                with _soft_interrupt() as stopped:
                    g = chat_turn(model, tokenizer, sess, text, max_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, top_k=top_k, seed=rng, should_stop=stopped,
                                  on_text=lambda piece: click.echo(piece, nl=False))
            except KeyboardInterrupt:  # second Ctrl-C: the cache may be half-updated; go back to the last save
                click.echo("\n(answer aborted)", err=True)
                sess = open_session(session, model) if session else Session.new(model)
                if not session:
                    click.echo("(conversation reset: pass --session FILE to keep it across aborts)", err=True)
                continue
            click.echo("" if g.text.endswith("\n") else "\n", nl=False)
            if g.stats["dropped_tokens"]:
                _warn(f"the conversation did not extend the cached tokens: {g.stats['dropped_tokens']} recomputed")
            if g.finish_reason == "interrupted":
                click.echo("(stopped)", err=True)
            if show_stats:
                _report(g.stats, True)
            if session:
                sess.save(session)

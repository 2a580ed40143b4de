"""`moepack demo`: what `make demo` runs, on the tiny trained model shipped with moepack."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "tiny-qwen35-moe"
DEFAULT_PROMPT = "def fibonacci(n):\n"


def check_sums(folder: Path) -> list[str]:
    """Problems found checking `folder`'s files against its SHA256SUMS ([] when all match)."""
    sums = folder / "SHA256SUMS"
    if not sums.is_file():
        return [f"{sums} is missing"]
    problems = []
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        digest, name = line.split(maxsplit=1)
        f = folder / name.strip().lstrip("*")
        if not f.is_file():
            problems.append(f"{f.name}: missing")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            problems.append(f"{f.name}: checksum mismatch")
    return problems


def _wrap(text: str, width: int) -> list[str]:
    out = []
    for line in text.expandtabs(4).split("\n"):
        line = "".join(c if c.isprintable() else "?" for c in line)
        while len(line) > width:
            out.append(line[:width])
            line = line[width:]
        out.append(line)
    return out


def column_width() -> int:
    """Width of one column of the side-by-side output: half the terminal (100 columns when not a terminal)."""
    return max(32, min(60, (shutil.get_terminal_size((100, 24)).columns - 3) // 2))


def side_by_side(left: str, right: str, width: int) -> list[str]:
    a, b = _wrap(left, width), _wrap(right, width)
    n = max(len(a), len(b))
    a += [""] * (n - len(a))
    b += [""] * (n - len(b))
    return [f"{x:<{width}} | {y}".rstrip() for x, y in zip(a, b)]


def _fmt_bytes(n: float) -> str:
    from .tables import human_bytes

    return human_bytes(n)


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for the packed models (default: a temporary folder, removed at the end).")
@click.option("--prompt", default=DEFAULT_PROMPT,
              help=f"Raw text prompt for both models (default: {DEFAULT_PROMPT!r}).")
@click.option("--max-tokens", type=int, default=48, show_default=True, help="Tokens to generate with each model.")
@click.option("--backend", type=click.Choice(["auto", "cpu", "numpy"]), default="numpy", show_default=True,
              help="Runtime kernels. numpy is the fastest end to end for this tiny model (no compile time).")
def demo_cmd(out, prompt, max_tokens, backend):
    """Pack the tiny trained MoE model shipped with moepack at 4 and 2 bits, compare them: RMSE, generated
    text, speed, perplexity and KL divergence.

    The model is a 4-bit MLX checkpoint of the qwen3_5_moe architecture (hybrid linear/full attention,
    16 routed experts, 4 per token, a shared expert), trained on Python standard-library source
    (scripts/train_tiny.py, docs/tiny-model.md).

    \b
    Example:
      moepack demo --out ./demo-out
    """
    if "numpy" not in sys.modules:
        # the tiny model's matrix products are small: one BLAS thread is faster, and much faster on a busy
        # machine, where OpenBLAS's waiting threads compete with everything else (3 s vs 13 s for step 5)
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from ..convert import convert
    from ..errors import MoepackError
    from ..eval import evaluate
    from ..runtime.generate import generate, resolve_backend
    from ..runtime.model import load_model
    from ..runtime.tokenizer import load_tokenizer
    from ..verify import inspect, verify
    from .tables import rmse_table

    t_start = time.perf_counter()
    if max_tokens < 1:
        raise MoepackError(f"--max-tokens must be at least 1, got {max_tokens}")
    src = EMBEDDED
    problems = check_sums(src)
    if problems:
        raise MoepackError(f"the embedded model in {src} is damaged: {'; '.join(problems)}",
                           hint="reinstall moepack (pip install --force-reinstall moepack)")
    size = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    with tempfile.TemporaryDirectory(prefix="moepack-demo-") as tmp:
        root = Path(out) if out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        click.echo(f"1. source: {src.name}, the tiny trained qwen3_5_moe model shipped with moepack "
                   f"(MLX 4-bit, {_fmt_bytes(size)}, SHA256SUMS ok)")
        packed = {}
        for bits in (4, 2):
            dst = root / f"packed-{bits}bit"
            t0 = time.perf_counter()
            m = convert(str(src), dst, bits=bits, force=True, progress=False)
            dt = time.perf_counter() - t0
            rep = verify(dst, progress=False)
            info = inspect(dst)
            flag = "" if bits == 4 else " --bits 2"
            click.echo(f"{'2a' if bits == 4 else '2b'}. moepack convert {src.name} {dst.name}{flag}: {dt:.2f} s, "
                       f"verify {'ok' if rep.ok else '; '.join(rep.problems)}; {info['moe_layers']} layers x "
                       f"{info['experts']} experts, {_fmt_bytes(info['expert_bytes'])} of experts, "
                       f"{_fmt_bytes(info['bytes_per_token'])} read per token at K={info['k']}")
            packed[bits] = (dst, m)
        click.echo("3. RMSE of the 2-bit experts against the 4-bit source (moepack verify-rmse packed-2bit)")
        click.echo(rmse_table(packed[2][1].rmse))

        resolved = resolve_backend(backend)
        tok = load_tokenizer(packed[4][0])
        ids = tok.encode(prompt, add_special_tokens=False)
        click.echo(f"4. moepack run packed-Nbit --raw --prompt {prompt!r} --max-tokens {max_tokens} "
                   f"(greedy, {resolved} backend)")
        gens = {}
        models = {}
        col = column_width()
        try:
            for bits in (4, 2):
                model = load_model(packed[bits][0], backend=resolved)
                models[bits] = model
                model.forward(ids[:1], model.new_cache())  # warm-up: compile (numba) / page in the weights
                gens[bits] = generate(model, ids, tokenizer=tok, max_tokens=max_tokens)
            click.echo(f"{'4-bit':<{col}} | 2-bit")
            click.echo(f"{'-' * col}-+-{'-' * col}")
            for line in side_by_side(prompt + gens[4].text, prompt + gens[2].text, col):
                click.echo(line)
            click.echo(f"{'-' * col}-+-{'-' * col}")

            def stat_line(fmt):
                return f"{fmt(gens[4].stats):<{col}} | {fmt(gens[2].stats)}"

            click.echo(stat_line(lambda s: f"decode {s['decode_tok_s'] or 0:.1f} tok/s, first token "
                                           f"{1000 * (s['ttft_s'] or 0):.0f} ms"))
            click.echo(stat_line(lambda s: f"experts read {_fmt_bytes(s['expert_bytes_per_token'])}/token"))

            r4 = evaluate(packed[4][0], backend=resolved, model=models[4])
            r2 = evaluate(packed[2][0], source=str(packed[4][0]), backend=resolved, model=models[2])
        finally:
            for model in models.values():
                model.close()
        a, b = r4.record, r2.record
        click.echo(f"5. moepack eval packed-Nbit (held-out Python source, {a['text']}: {a['tokens']:,} tokens, "
                   f"{a['windows']} windows of <= {a['window']}, {a['scored_tokens']:,} scored); 2-bit also "
                   "--source packed-4bit")
        click.echo(f"   {'':<26}{'4-bit':>10}{'2-bit':>10}")
        click.echo(f"   {'perplexity':<26}{a['perplexity']:>10.3f}{b['perplexity']:>10.3f}  "
                   f"({100 * (b['perplexity'] / a['perplexity'] - 1):+.1f}%)")
        click.echo(f"   {'KL(4-bit||2-bit) mean':<26}{'-':>10}{b['kl_mean']:>10.4f}  nats/token")
        click.echo(f"   {'KL(4-bit||2-bit) p99':<26}{'-':>10}{b['kl_p99']:>10.4f}  nats/token")
        click.echo(f"   {'top-1 agreement':<26}{'-':>10}{100 * b['top1_agreement']:>9.1f}%")
        click.echo(f"done in {time.perf_counter() - t_start:.1f} s"
                   + (f"; packed models in {root}" if out else ""))

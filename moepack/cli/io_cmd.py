"""`moepack bench-io` (expert-read benchmark, saved recommendation) and `moepack trace` (routing trace)."""

from __future__ import annotations

import json

import click

from ..errors import MoepackError


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        out = [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise click.BadParameter(f"expected positive integers separated by commas, got {value!r}")
    return out


@click.command("bench-io")
@click.argument("packed", required=False)
@click.option("--synthetic", type=float, default=None, metavar="GB",
              help="Benchmark a temporary synthetic layer file of GB gigabytes of real Qwen3.5-397B 2-bit records "
                   "(3,932,160 B) on a real disk (TMPDIR, /var/tmp or here), removed afterwards.")
@click.option("--threads", default="1,2,4,8", show_default=True, callback=_int_list, metavar="LIST",
              help="Reader thread counts to compare (1 = sequential).")
@click.option("--split", "splits", default="1,2,4,8", show_default=True, callback=_int_list, metavar="LIST",
              help="Chunks per expert read to compare (at the largest thread count).")
@click.option("--experts", type=click.IntRange(min=1), default=64, show_default=True, metavar="N",
              help="Distinct random expert records read per cell.")
@click.option("--json", "as_json", is_flag=True, help="Print every cell and the recommendation as JSON.")
@click.option("--no-save", is_flag=True, help="Do not save the recommendation for `--io auto`.")
def bench_io_cmd(packed, synthetic, threads, splits, experts, as_json, no_save):
    """Measure expert reads on this machine and save the best way to read them.

    Compares sequential vs parallel reads, cold (page cache dropped: posix_fadvise DONTNEED / O_DIRECT on Linux,
    msync invalidate / F_NOCACHE on macOS) vs warm, pread vs mmap+copy vs the mincore hybrid vs direct, 16 KiB
    vs 2 MiB aligned buffers, whole vs split reads, and half-resident records. Prints GB/s and ms per expert
    per cell, and saves the recommended --io/--split for this machine, the model and its disk, which
    `moepack run --io auto` then uses. Cold cells drop PACKED's files from the page cache.

    \b
    Examples:
      moepack bench-io ./q397-2bit
      moepack bench-io --synthetic 2
      moepack bench-io ./q397-2bit --threads 1,4 --split 1,4 --experts 32 --json
      moepack run ./q397-2bit --prompt "Hi" --io auto
    """
    from ..hub.pull import resolve_packed
    from ..iobench import run_bench_io, table

    if packed is not None:
        packed = resolve_packed(packed, None, progress=not as_json)
    res = run_bench_io(packed, synthetic=synthetic, threads=threads, splits=splits, experts=experts,
                       progress=not as_json, save=not no_save)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    click.echo(table(res))
    if res.get("saved_to"):
        click.echo(f"saved for `moepack run --io auto` in {res['saved_to']}", err=True)


@click.command("trace")
@click.argument("packed")
@click.option("--prompt", default=None, metavar="TEXT", help="Text prompt (through the chat template).")
@click.option("--prompt-ids", default=None, metavar='"1,2,3"', help="Token ids instead of text.")
@click.option("--raw", is_flag=True, help="Tokenize --prompt as plain text, without the chat template.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Tokens generated (greedy) after the prompt.")
@click.option("--backend", type=click.Choice(("auto", "cpu", "numpy")), default="auto", show_default=True,
              help="Kernels: cpu (numba), numpy (reference), auto.")
@click.option("--io", type=click.Choice(("pread", "direct", "mmap", "hybrid", "mapped", "auto")), default="pread",
              show_default=True, help="How experts are read while tracing.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object.")
@click.option("--plot", "plot_file", default=None, metavar="FILE.png",
              help="Plot frequency, overlap and LRU hit rates (needs matplotlib).")
def trace_cmd(packed, prompt, prompt_ids, raw, max_tokens, backend, io, as_json, plot_file):
    """Trace which experts a prompt routes to, layer by layer.

    Feeds the prompt one token at a time, then generates greedily, recording every token's experts; reports
    per layer the distinct experts used and the busiest, the consecutive-token overlap, the hit rate an LRU
    cache of 32/64/128/... experts per layer would have had, and how much of each layer file sits in the
    page cache afterwards (mincore).

    \b
    Examples:
      moepack trace ./q397-2bit --prompt "Explain mixture of experts." --max-tokens 64
      moepack trace ./q397-2bit --prompt-ids "1,2,3" --json > trace.json
      moepack trace ./q397-2bit --prompt "Hi" --plot trace.png
    """
    from ..hub.pull import resolve_packed
    from ..trace import plot, report, run_trace

    if plot_file is not None and not plot_file.lower().endswith(".png"):
        raise MoepackError(f"--plot writes a PNG file, got {plot_file!r}", hint="e.g. --plot trace.png")
    packed = resolve_packed(packed, None, progress=not as_json)  # a folder, or a hub repo id (pulled)
    res = run_trace(packed, prompt=prompt, prompt_ids=prompt_ids, raw=raw, max_tokens=max_tokens, backend=backend,
                    io=io)
    if plot_file:
        plot(res, plot_file)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(report(res))
    if plot_file:
        click.echo(f"plot written to {plot_file}", err=True)

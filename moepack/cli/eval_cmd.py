"""`moepack eval PACKED`: perplexity on a text, and KL divergence / top-1 agreement against a reference."""

from __future__ import annotations

import json

import click


def eval_lines(rec: dict, name: str) -> list[str]:
    """The human-readable report of one evaluation record."""
    lines = [
        f"model       {name}: experts {rec['experts_bits']}-bit, K={rec['experts_per_token']} [{rec['backend']}]",
        f"text        {rec['text']}: {rec['tokens']:,} tokens in {rec['windows']} window(s) of <= {rec['window']} "
        f"tokens ({rec['method']}); {rec['scored_tokens']:,} scored",
        f"perplexity  {rec['perplexity']:.4f}  (mean NLL {rec['nll_mean']:.4f} nats/token)",
    ]
    if "reference" in rec:
        lines += [
            f"reference   {rec['reference']}: perplexity {rec['reference_perplexity']:.4f}",
            f"KL(ref||model)  mean {rec['kl_mean']:.5f}  p99 {rec['kl_p99']:.5f}  max {rec['kl_max']:.5f} "
            f"nats/token; top-1 agreement {100 * rec['top1_agreement']:.1f}%",
        ]
    return lines


@click.command("eval")
@click.argument("packed", type=click.Path(file_okay=False))
@click.option("--text", "text_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="UTF-8 text to score (default: the evaluation text shipped with moepack, held-out Python "
                   "standard-library source).")
@click.option("--source", is_flag=False, flag_value="", default=None, metavar="SRC",
              help="Reference for KL divergence: a packed model, or a source checkpoint (folder or hub repo id; "
                   "packed at its own bits to a temporary folder first). --source with no value uses the source "
                   "recorded in PACKED's manifest.")
@click.option("--max-tokens", type=int, default=4096, show_default=True,
              help="Refuse a text longer than this many tokens (evaluation time grows with the length).")
@click.option("--window", type=int, default=None, metavar="N",
              help="Tokens per window (default: the model's context, at most 1024).")
@click.option("--backend", type=click.Choice(["auto", "cpu", "numpy"]), default="auto", show_default=True,
              help="cpu: numba kernels; numpy: the reference; auto: cpu when numba works.")
@click.option("--no-save", is_flag=True, help="Do not record the result in PACKED/moepack.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def eval_cmd(packed, text_file, source, max_tokens, window, backend, no_save, as_json):
    """Perplexity of a packed model on a text; with --source, the KL divergence of its next-token
    distributions from a reference model's (mean, 99th percentile, max) and top-1 agreement.

    The text is tokenized with PACKED's tokenizer as plain text and cut into consecutive windows; each window
    starts with an empty cache and its first token is context only. Both models run through moepack's
    runtime. The result is saved in PACKED/moepack.json as the `eval` section (shown on the model card).

    \b
    Examples:
      moepack eval ./q397-2bit
      moepack eval ./q397-2bit --source ./q397-4bit --json
      moepack eval ./q397-2bit --source                 # against the source recorded in the manifest
      moepack eval ./q397-2bit --text wiki.txt --max-tokens 20000
    """
    from ..eval import evaluate

    res = evaluate(packed, text=text_file, source=source, max_tokens=max_tokens, window=window, backend=backend,
                   save=not no_save, progress=not as_json)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=1))
    else:
        from pathlib import Path

        click.echo("\n".join(eval_lines(res.record, Path(packed).name)))
        if res.saved:
            click.echo(f"saved in {Path(packed) / 'moepack.json'} (eval section); {res.seconds:.1f} s")
    if res.save_error:
        click.echo(f"warning: result not saved in the manifest: {res.save_error}", err=True)

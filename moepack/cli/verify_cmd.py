"""`moepack verify`, `moepack verify-rmse`, `moepack inspect`."""

from __future__ import annotations

import json

import click

from .tables import human_bytes, rmse_table


@click.command("verify")
@click.argument("packed")
@click.option("--revision", default=None, help="Hub revision when PACKED is a repo id.")
@click.option("--workers", type=int, default=None, help="Threads (default: all cores).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify_cmd(packed, revision, workers, quiet, as_json):
    """Check every file of a packed model: present, right size, every record's checksum.

    Exit status 0 when everything checks out, 1 otherwise (each problem named).

    \b
    Example:
      moepack verify ./q397-2bit
    """
    from ..hub.pull import resolve_packed
    from ..verify import verify

    packed = resolve_packed(packed, revision, progress=not quiet and not as_json)
    rep = verify(packed, workers=workers, progress=not quiet and not as_json)
    if as_json:
        click.echo(json.dumps(rep.to_json(), indent=1))
    elif rep.ok:
        click.echo(f"ok: {rep.checked_files} files, {rep.checked_records} expert records verified")
    else:
        for p in rep.problems:
            click.echo(f"problem: {p}")
        click.echo(f"{len(rep.problems)} problem(s); re-run `moepack convert` (it resumes) or re-download", err=True)
    click.get_current_context().exit(0 if rep.ok else 1)


@click.command("verify-rmse")
@click.argument("packed", type=click.Path(file_okay=False))
@click.option("--source", default=None, help="Source checkpoint (default: the one recorded in the manifest).")
@click.option("--revision", default=None, help="Hub revision of --source.")
@click.option("--json", "json_file", default=None, metavar="FILE", help="Also write the table as JSON ('-' = stdout only).")
@click.option("--plot", "plot_file", default=None, metavar="FILE.png", help="Plot RMSE per layer (needs matplotlib).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def verify_rmse_cmd(packed, source, revision, json_file, plot_file, quiet):
    """RMSE and max abs error of gate/up/down per layer: packed (dequantized) vs source.

    \b
    Examples:
      moepack verify-rmse ./q397-2bit
      moepack verify-rmse ./q397-2bit --source ./Qwen3.5-397B-A17B-4bit --json rmse.json --plot rmse.png
    """
    from ..verify import verify_rmse

    res = verify_rmse(packed, source=source, revision=revision, progress=not quiet and json_file != "-")
    if json_file == "-":
        click.echo(json.dumps(res, indent=1))
    else:
        click.echo(rmse_table(res))
        if json_file:
            with open(json_file, "w") as f:
                json.dump(res, f, indent=1)
    if plot_file:
        from ..plot import plot_rmse

        plot_rmse(res, plot_file)


@click.command("inspect")
@click.argument("packed")
@click.option("--revision", default=None, help="Hub revision when PACKED is a repo id.")
@click.option("-k", "--experts-per-token", "k", type=int, default=None,
              help="K for the bytes-per-token figure (default: the model's).")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def inspect_cmd(packed, revision, k, as_json):
    """Model, layers, experts, bits, record size, total size and bytes read per token.

    \b
    Example:
      moepack inspect ./q397-2bit -k 4
    """
    from ..hub.pull import resolve_packed
    from ..verify import inspect

    info = inspect(resolve_packed(packed, revision, progress=not as_json), k=k)
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    bits = ", ".join(f"{b}-bit: {len(ls)} layers" for b, ls in info["bits"].items())
    rec = ", ".join(f"{key}: {human_bytes(v)}" for key, v in info["record_sizes"].items())
    lines = [
        f"model            {info['model_type']}  (format v{info['format_version']}, moepack {info['moepack_version']})",
        f"source           {info['source'].get('repo_id') or info['source'].get('path')}",
        f"layers           {info['layers']} ({info['moe_layers']} with routed experts)",
        f"experts          {info['experts']} per layer, {info['experts_per_token']} per token",
        f"expert bits      {bits}",
        f"record size      {rec}",
        f"experts on disk  {human_bytes(info['expert_bytes'])}",
        f"dense part       {human_bytes(info['dense_bytes'])}",
        f"total            {human_bytes(info['total_bytes'])}",
        f"read per token   {human_bytes(info['bytes_per_token'])} at K={info['k']}",
    ]
    if info.get("rmse_overall"):
        o = info["rmse_overall"]
        lines.append(f"rmse (mean)      gate {o['gate']:.6f}  up {o['up']:.6f}  down {o['down']:.6f}")
    click.echo("\n".join(lines))

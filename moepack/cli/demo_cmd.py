"""`moepack demo`: what `make demo` runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for the demo's checkpoint and packed models (default: a temporary folder).")
@click.option("--arch", type=click.Choice(["qwen3_5_moe", "qwen3_next", "qwen3_moe"]), default="qwen3_5_moe",
              show_default=True, help="Architecture of the generated checkpoint.")
def demo_cmd(out, arch):
    """Build a small MLX-format 4-bit MoE checkpoint, pack it at 4 and 2 bits, verify both, print RMSE.

    \b
    Example:
      moepack demo --out ./demo-out
    """
    from ..convert import convert
    from ..testing.fixtures import write_mlx_checkpoint
    from ..verify import inspect, verify, verify_rmse
    from .tables import human_bytes, rmse_table

    with tempfile.TemporaryDirectory(prefix="moepack-demo-") as tmp:
        root = Path(out) if out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        src = root / "source-mlx-4bit"
        if not (src / "config.json").exists():
            click.echo(f"1. writing a small {arch} MLX 4-bit checkpoint to {src}")
            write_mlx_checkpoint(src, arch=arch, bits=4, num_hidden_layers=8, num_experts=32, hidden_size=256,
                                 moe_intermediate_size=128, seed=0)
        for bits in (4, 2):
            dst = root / f"packed-{bits}bit"
            step = "2a" if bits == 4 else "2b"
            click.echo(f"{step}. moepack convert {src.name} {dst.name} --bits {bits}")
            convert(str(src), dst, bits=bits, force=True, progress=False)
            rep = verify(dst, progress=False)
            info = inspect(dst)
            click.echo(f"   verify: {'ok' if rep.ok else rep.problems}; {info['moe_layers']} layers x "
                       f"{info['experts']} experts, record {human_bytes(max(info['record_sizes'].values()))}, "
                       f"{human_bytes(info['bytes_per_token'])} read per token at K={info['k']}")
        click.echo("3. moepack verify-rmse packed-2bit   (2-bit vs the 4-bit source)")
        click.echo(rmse_table(verify_rmse(root / "packed-2bit", progress=False)))

"""`moepack convert SRC OUT`."""

from __future__ import annotations

import json

import click


@click.command("convert")
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--bits", type=click.Choice(["2", "3", "4", "8"]), default=None,
              help="Routed-expert bits. Same as the source: bit-exact repack; lower: min/max requantization "
                   "(s = (max-min)/(2^bits-1), b = min, per group). Default: keep the source's bits "
                   "(4 for an unquantized source).")
@click.option("--layer-bits", default=None, metavar="SPEC",
              help="Per-layer override of --bits, e.g. '0-2=4,59=4' keeps layers 0, 1, 2 and 59 at 4 bits.")
@click.option("--group-size", type=int, default=64, show_default=True,
              help="Group size when quantizing an unquantized (bf16/fp16) source; MLX sources keep theirs.")
@click.option("--workers", type=int, default=None, help="I/O threads (default: all cores).")
@click.option("--revision", default=None, help="Hub branch, tag or commit when SRC is a repo id.")
@click.option("--delete-source", is_flag=True,
              help="SRC a hub repo id: delete each source shard from the hub cache as soon as everything read from "
                   "it is packed, so only the shards in flight are on disk (not the whole checkpoint).")
@click.option("--force", is_flag=True, help="Replace OUT if it holds a packed model or another conversion.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of text.")
def convert_cmd(src, out, bits, layer_bits, group_size, workers, revision, delete_source, force, quiet, as_json):
    """Pack an MLX-format MoE checkpoint (local folder or hub repo id) into OUT.

    Each expert of each layer becomes one contiguous, 16 KiB-aligned record in
    OUT/packed_experts/layer_XX.bin, so one pread fetches it; the rest of the model goes to
    OUT/model.safetensors; OUT/moepack.json (written last) describes it all.

    A hub repo id is converted shard by shard: the shard headers are read first, then each shard is
    downloaded (into the hub cache) when the next layer needs it and checked (size, sha256). With
    --delete-source each shard is deleted again once packed, so the disk holds only the shards in
    flight. An interrupted conversion resumes when re-run with the same arguments (shards already
    packed and deleted are not downloaded again). HF_HUB_OFFLINE=1 converts from the hub cache.

    \b
    Examples:
      moepack convert ./Qwen3.5-397B-A17B-4bit ./q397-4bit          # bit-exact repack
      moepack convert mlx-community/Qwen3.5-397B-A17B-4bit ./q397-2bit --bits 2
      moepack convert mlx-community/Qwen3.5-397B-A17B-4bit ./q397-2bit --bits 2 --delete-source
      HF_HUB_OFFLINE=1 moepack convert mlx-community/Qwen3.5-397B-A17B-4bit ./q397-4bit   # from the cache
      moepack convert ./src ./out --bits 2 --layer-bits 0-2=4       # keep layers 0-2 at 4-bit
    """
    from ..convert import convert
    from ..verify import inspect

    source: dict = {}
    m = convert(src, out, bits=int(bits) if bits else None, layer_bits=layer_bits, workers=workers, force=force,
                revision=revision, group_size=group_size, delete_source=delete_source,
                progress=not quiet and not as_json, stats=source)
    info = inspect(out)
    if as_json:
        click.echo(json.dumps({"out": str(out), "inspect": info, "rmse": m.rmse, "source": source or None},
                              indent=1))
        return
    click.echo(f"packed {info['moe_layers']} MoE layers x {info['experts']} experts into {out}")
    if source:
        def size(n):
            return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"

        click.echo(f"source: {source['shards']} shards ({size(source['source_bytes'])}): "
                   f"{source['shards_downloaded']} downloaded, {source['shards_reused']} found in the hub cache, "
                   f"{source['shards_deleted']} deleted; at most {size(source['peak_source_bytes_on_disk'])} "
                   "of it on disk at once")
    click.echo(f"experts {info['expert_bytes'] / 1e9:.3f} GB, dense {info['dense_bytes'] / 1e9:.3f} GB; "
               f"{info['bytes_per_token'] / 1e6:.1f} MB of experts per token at K={info['k']}")
    if m.rmse:
        from .tables import rmse_table

        click.echo(rmse_table(m.rmse))

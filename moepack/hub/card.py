"""The model card (``README.md``) of a packed model, generated from its manifest.

Layout of the file::

    ---                                  YAML front matter (the hub reads it)
    library_name: moepack
    base_model: <source repo>            when the source was a hub repo
    ...
    ---
    <the user's text, if any>
    <!-- moepack:begin -->
    ... generated: what the packed format is, bits per layer, RMSE table, quality figures, bytes read per
    token, versions, usage ...
    <!-- moepack:end -->
    <the user's text, if any>

Regenerating keeps everything outside the markers. In the front matter moepack owns ``library_name``,
``base_model`` (+ ``base_model_relation``) when it knows the source repo, ``pipeline_tag`` and its four ``tags``;
the user's extra tags, their ``license`` and every other key they added are kept. A README.md without markers
(written by hand) keeps its text, and the generated block is appended after it.

``README.md`` is not one of the manifest's checked files (``aux_files``), so writing the card never changes what
``moepack verify`` checks.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import __version__
from . import HubError, one_line

BEGIN = "<!-- moepack:begin -->"
END = "<!-- moepack:end -->"
CARD_NAME = "README.md"
TAGS = ("moe", "moepack", "quantized", "mlx")
PIPELINE_TAG = "text-generation"
HUB_URL = "https://huggingface.co"


# -- front matter -----------------------------------------------------------------------------------------

def split_front_matter(text: str, *, where: str = CARD_NAME) -> tuple[dict, str]:
    """``(metadata, body)`` of a card. No front matter: ``({}, text)``. Invalid YAML raises HubError."""
    import yaml

    t = text[1:] if text.startswith("\ufeff") else text
    lines = t.splitlines(keepends=True)
    if not lines or lines[0].rstrip("\r\n") != "---":
        return {}, text
    for i in range(1, len(lines)):
        if lines[i].rstrip("\r\n") == "---":
            raw, body = "".join(lines[1:i]), "".join(lines[i + 1:])
            try:
                meta = yaml.safe_load(raw) if raw.strip() else {}
            except yaml.YAMLError as e:
                raise HubError(f"{where}: the front matter is not valid YAML ({one_line(e)})",
                               hint=f"fix the YAML between the two --- lines at the top of {where}, "
                                    "or delete the file to have the card written anew") from None
            if meta is None:
                meta = {}
            if not isinstance(meta, dict):
                raise HubError(f"{where}: the front matter is a YAML {type(meta).__name__}, not a mapping",
                               hint=f"the block between the --- lines of {where} must hold `key: value` lines")
            return meta, body
    raise HubError(f"{where}: the front matter opened by --- on the first line is never closed",
                   hint=f"add a line `---` after the metadata in {where}")


def license_from_card(text: str | None) -> str | None:
    if not text:
        return None
    try:
        meta, _ = split_front_matter(text)
    except HubError:
        return None
    lic = meta.get("license")
    return lic if isinstance(lic, str) and lic.strip() else None


def find_license(manifest, source_card: str | None = None) -> str | None:
    """The source's license where it is known: its config.json, else its model card.

    The card is ``source_card`` when given (publish fetches it from the hub), else a README.md next to a local
    source, else one already in the local hub cache (never downloaded here).
    """
    cfg = manifest.config or {}
    for holder in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        lic = holder.get("license")
        if isinstance(lic, str) and lic.strip():
            return lic.strip()
    lic = license_from_card(source_card)
    if lic:
        return lic
    src = manifest.source or {}
    try:
        if src.get("type") == "local" and src.get("path"):
            p = Path(src["path"]) / CARD_NAME
            if p.is_file():
                return license_from_card(p.read_text(encoding="utf-8", errors="replace"))
        elif src.get("type") == "hub" and src.get("repo_id"):
            from huggingface_hub import try_to_load_from_cache

            p = try_to_load_from_cache(src["repo_id"], CARD_NAME, revision=src.get("revision"))
            if isinstance(p, str) and os.path.isfile(p):
                return license_from_card(Path(p).read_text(encoding="utf-8", errors="replace"))
    except Exception:  # best effort: a card we cannot read just has no license
        return None
    return None


def front_matter(manifest, existing: dict, license: str | None) -> dict:
    """The card's metadata: moepack's keys first, then every other key the user had."""
    src = manifest.source or {}
    base = src.get("repo_id") if src.get("type") == "hub" else None
    user_tags = existing.get("tags") or []
    if isinstance(user_tags, str):
        user_tags = [user_tags]
    ours: dict = {"library_name": "moepack"}
    if base:
        ours["base_model"] = base
        ours["base_model_relation"] = "quantized"
    ours["pipeline_tag"] = PIPELINE_TAG
    ours["tags"] = list(TAGS) + [t for t in user_tags if isinstance(t, (str, int, float)) and str(t) not in TAGS]
    lic = existing.get("license") or license  # a license the user wrote wins over the one found in the source
    if lic:
        ours["license"] = lic
    for k, v in existing.items():
        if k not in ours:
            ours[k] = v
    return ours


def _dump_front_matter(meta: dict) -> str:
    import yaml

    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, default_flow_style=False) + "---\n"


# -- the generated block ----------------------------------------------------------------------------------

def _ranges(nums) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    nums = sorted(nums)
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


def fmt_err(v) -> str:
    """An RMSE / error figure: 6 decimals, or 4 significant digits below 0.001."""
    v = float(v)
    if v == 0:
        return "0"
    return f"{v:.6f}" if abs(v) >= 1e-3 else f"{v:.3e}"


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt_value(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt_value(x) for x in v)
    return str(v)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _bytes(n: float) -> str:
    from ..cli.tables import human_bytes

    return human_bytes(n)


def _source_line(src: dict) -> str:
    if src.get("type") == "hub" and src.get("repo_id"):
        rid = src["repo_id"]
        rev = src.get("revision")
        at = f" at commit `{rev[:12]}`" if isinstance(rev, str) and rev else ""
        return f"[{rid}]({HUB_URL}/{rid}){at}"
    if src.get("path"):  # only the folder's name: a card must not publish a local path
        return f"a local checkpoint (`{Path(str(src['path'])).name}`)"
    return "unknown"


def _eval_section(ev) -> list[str]:
    """Quality figures from the manifest's optional ``eval`` section (perplexity, KL, ...), shown as they are."""
    if not isinstance(ev, dict) or not ev:
        return []
    lines = ["## Quality", "", "Measured by moepack and recorded in the manifest's `eval` section.", "",
             "| measure | value |", "|---|---|"]
    for k, v in ev.items():
        lines.append(f"| {_cell(k)} | {_cell(_fmt_value(v))} |")
    return lines + [""]


def _rmse_section(rmse) -> list[str]:
    lines = ["## Requantization error", ""]
    if not isinstance(rmse, dict) or not rmse.get("layers"):
        return lines + ["The routed experts are a bit-exact repack of the source's: no requantization error.", ""]
    ref = rmse.get("reference", "source")
    lines += [f"RMSE per MoE layer of the routed experts' gate, up and down projections over all experts: packed "
              f"(dequantized) against the {ref} (dequantized). These are the numbers "
              "`moepack verify-rmse --json` reports (stored in the manifest's `rmse`).", "",
              "| layer | bits | gate | up | down | max abs error |", "|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rmse["layers"], key=lambda r: r["layer"]):
        mx = max((r.get("max_abs") or {"-": 0.0}).values())
        lines.append(f"| {r['layer']} | {r.get('bits', '')} | {fmt_err(r['gate'])} | {fmt_err(r['up'])} | "
                     f"{fmt_err(r['down'])} | {fmt_err(mx)} |")
    o = rmse.get("overall")
    if isinstance(o, dict):
        lines.append(f"| mean | | {fmt_err(o['gate'])} | {fmt_err(o['up'])} | {fmt_err(o['down'])} | |")
    return lines + [""]


def render_block(packed: str | os.PathLike, manifest, info: dict, repo_id: str | None) -> str:
    """The generated Markdown that goes between the markers."""
    m = manifest
    name = repo_id.split("/")[-1] if repo_id else Path(packed).resolve().name
    target = repo_id or "REPO_ID"
    src = m.source or {}
    base = src.get("repo_id") if src.get("type") == "hub" else None
    layouts = m.record_layouts
    align = {getattr(lay, "alignment", 0) for lay in layouts.values()}
    align_txt = "/".join(f"{a // 1024} KiB" if a % 1024 == 0 else f"{a} bytes" for a in sorted(align) if a) or "?"
    by_bits: dict[tuple[int, str], list[int]] = {}
    for e in m.layers:
        by_bits.setdefault((e.bits, e.method), []).append(e.layer)
    bits_short = "; ".join(f"{b}-bit: layers {_ranges(ls)}" for (b, _), ls in sorted(by_bits.items()))
    rec = ", ".join(f"{_bytes(lay.record_size)} (`{key}`)" for key, lay in sorted(layouts.items()))
    k = info["k"]

    lines = [
        "<!-- Generated by moepack from moepack.json. Text between the moepack:begin and moepack:end markers is "
        "rewritten each time the card is generated: write your own text above or below them. -->",
        "",
        f"# {name}",
        "",
        f"The `{m.model_type}` Mixture-of-Experts model"
        + (f" [{base}]({HUB_URL}/{base})" if base else "")
        + ", packed for [moepack](https://pypi.org/project/moepack/): it runs MoE models larger than RAM by keeping "
        "the dense part in memory and reading each token's routed experts from SSD.",
        "",
        "## The packed format",
        "",
        "A packed model is a folder: `moepack.json` (the manifest: shapes, record layouts, bits per layer and an "
        "xxh3-64 checksum for every expert record), `packed_experts/layer_XX.bin` (one file per MoE layer; each "
        f"expert is one contiguous record aligned to {align_txt}, fetched with a single `pread` when the router "
        "picks it), `model.safetensors` (everything else: attention, embeddings, routers, shared experts, kept in "
        "memory) and the source's config and tokenizer files. Experts are MLX affine-quantized (group size 64).",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | `{m.model_type}` |",
        f"| source | {_source_line(src)} |",
        f"| layers | {m.moe.num_layers} ({len(m.layers)} with routed experts) |",
        f"| routed experts | {m.moe.num_experts} per layer, {m.moe.experts_per_token} per token by default |",
        f"| hidden size / expert intermediate size | {m.moe.hidden} / {m.moe.moe_intermediate} |",
        f"| routed-expert bits | {bits_short} |",
        f"| expert record | {rec} |",
        f"| size on disk | {_bytes(info['total_bytes'])} (experts {_bytes(info['expert_bytes'])}, "
        f"dense part {_bytes(info['dense_bytes'])}) |",
        f"| **read per token** | **{_bytes(info['bytes_per_token'])}** of routed experts at the default "
        f"K={k} ({info['bytes_per_token']:,} bytes, before any page-cache hits) |",
        f"| versions | packed format {m.format_version}, written by moepack {m.moepack_version}; "
        f"card by moepack {__version__} |",
        "",
        "## Bits per layer",
        "",
        "| bits | method | layers |",
        "|---:|---|---|",
    ]
    for (b, method), ls in sorted(by_bits.items()):
        lines.append(f"| {b} | {method} | {_ranges(ls)} |")
    lines.append("")
    lines += _rmse_section(m.rmse)
    lines += _eval_section(m.extra.get("eval"))
    lines += [
        "## Usage",
        "",
        "```sh",
        "pip install moepack",
        f"moepack run {target}",
        "```",
        "",
        f"`moepack pull {target}` only downloads it (to the Hugging Face cache, or `--local-dir DIR`) and checks "
        "every file's size and every expert record's checksum once, before first use. `moepack verify` re-checks a "
        "copy, `moepack inspect` shows sizes and bytes read per token at another K (`-k`).",
    ]
    return "\n".join(lines)


# -- the whole card -------------------------------------------------------------------------------------

def merge_card(existing: str | None, meta: dict, block: str) -> str:
    """Front matter + the user's text with the generated block in place of the old one (or appended)."""
    body = existing or ""
    if existing:
        _, body = split_front_matter(existing)
    marked = f"{BEGIN}\n{block.strip()}\n{END}"
    nb, ne = body.count(BEGIN), body.count(END)
    if nb == 0 and ne == 0:
        before, after = body.rstrip(), ""
        before = (before + "\n\n") if before else ""
        new_body = before + marked + "\n"
    elif nb == 1 and ne == 1 and body.index(BEGIN) < body.index(END):
        i, j = body.index(BEGIN), body.index(END) + len(END)
        new_body = body[:i] + marked + body[j:]
    else:
        raise HubError(f"{CARD_NAME}: the markers {BEGIN} / {END} are unpaired or out of order "
                       f"({nb} begin, {ne} end)",
                       hint=f"leave exactly one {BEGIN} followed by one {END} in {CARD_NAME} (or delete both to "
                            "have the generated block appended)")
    if not new_body.startswith("\n"):
        new_body = "\n" + new_body
    return _dump_front_matter(meta) + new_body


def render_card(packed: str | os.PathLike, *, repo_id: str | None = None, existing: str | None = None,
                source_card: str | None = None) -> str:
    """The full README.md text for ``packed``: generated from its manifest, ``existing`` text outside the markers
    and the user's front-matter keys kept. ``existing`` defaults to the folder's current README.md."""
    from ..layout.manifest import load_manifest
    from ..verify import inspect

    path = Path(packed)
    m = load_manifest(path)
    if CARD_NAME in {f.name for f in m.dense_files + m.aux_files}:
        raise HubError(f"{CARD_NAME} is one of the files `moepack verify` checks in {path}: writing the model card "
                       "would break the packed model",
                       hint=f"re-convert the model, or remove {CARD_NAME} from the manifest's aux_files")
    if existing is None and (path / CARD_NAME).is_file():
        existing = (path / CARD_NAME).read_text(encoding="utf-8")
    old_meta = split_front_matter(existing)[0] if existing else {}
    meta = front_matter(m, old_meta, find_license(m, source_card))
    block = render_block(path, m, inspect(path), repo_id)
    return merge_card(existing, meta, block)


def write_card(packed: str | os.PathLike, *, repo_id: str | None = None, source_card: str | None = None) -> str:
    """Write (or regenerate) README.md in the packed folder, atomically; returns its text."""
    from ..layout.atomic import write_bytes_atomic

    text = render_card(packed, repo_id=repo_id, source_card=source_card)
    write_bytes_atomic(Path(packed) / CARD_NAME, text.encode("utf-8"))
    return text


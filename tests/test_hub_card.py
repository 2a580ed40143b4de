"""The model card: front matter, RMSE table = verify-rmse numbers, quality figures, user text kept, verify passes."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from moepack.cli import main
from moepack.convert import convert
from moepack.hub import HubError
from moepack.hub.card import BEGIN, END, TAGS, render_card, split_front_matter, write_card
from moepack.layout.constants import MANIFEST_NAME
from moepack.testing.fixtures import write_mlx_checkpoint
from moepack.verify import inspect, verify

ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([-+.\deE]+) \| ([-+.\deE]+) \| ([-+.\deE]+) \| ([-+.\deE]+) \|$")
MEAN = re.compile(r"^\| mean \| \| ([-+.\deE]+) \| ([-+.\deE]+) \| ([-+.\deE]+) \| \|$")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    src = write_mlx_checkpoint(root / "src", arch="qwen3_5_moe", bits=4, seed=0)
    convert(str(src), root / "packed", bits=2, progress=False)
    return src, root / "packed"


@pytest.fixture
def packed(built, tmp_path):
    return shutil.copytree(built[1], tmp_path / "packed")


def _edit_manifest(folder, **changes):
    p = folder / MANIFEST_NAME
    d = json.loads(p.read_text())
    for k, v in changes.items():
        if k == "license":
            d["config"]["license"] = v
        else:
            d[k] = v
    p.write_text(json.dumps(d, indent=1))


def _close(card_value: str, exact: float) -> bool:
    return abs(float(card_value) - exact) <= max(5e-7, 1e-3 * abs(exact))


def test_front_matter_for_a_hub_source(packed):
    _edit_manifest(packed, source={"type": "hub", "repo_id": "src-org/Tiny-MoE-4bit", "revision": "a" * 40},
                   license="apache-2.0")
    text = render_card(packed, repo_id="me/tiny-q2")
    assert text.startswith("---\n")
    meta, body = split_front_matter(text)
    assert yaml.safe_load(text.split("---\n")[1]) == meta  # plain YAML between the --- lines
    assert meta["library_name"] == "moepack"
    assert meta["base_model"] == "src-org/Tiny-MoE-4bit" and meta["base_model_relation"] == "quantized"
    assert meta["tags"] == list(TAGS) == ["moe", "moepack", "quantized", "mlx"]
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "apache-2.0"
    assert body.count(BEGIN) == 1 and body.count(END) == 1
    assert "[src-org/Tiny-MoE-4bit](https://huggingface.co/src-org/Tiny-MoE-4bit) at commit `aaaaaaaaaaaa`" in body
    assert "pip install moepack" in body and "moepack run me/tiny-q2" in body and "moepack pull me/tiny-q2" in body


def test_local_source_no_base_model_and_license_from_source_card(built, packed):
    meta, body = split_front_matter(render_card(packed))
    assert "base_model" not in meta and "license" not in meta
    assert str(built[0]) not in body  # a local path is not published, only the folder's name
    assert "a local checkpoint (`src`)" in body
    (built[0] / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# the source's card\n")
    try:
        assert split_front_matter(render_card(packed))[0]["license"] == "mit"
    finally:
        (built[0] / "README.md").unlink()


def test_rmse_table_matches_manifest_and_verify_rmse_json(packed, capsys):
    m = json.loads((packed / MANIFEST_NAME).read_text())
    code = main(["verify-rmse", str(packed), "--json", "-", "-q"])
    assert code == 0
    cli = json.loads(capsys.readouterr().out)
    card = render_card(packed)
    rows = {int(g[0]): g for g in (ROW.match(line).groups() for line in card.splitlines() if ROW.match(line))}
    assert sorted(rows) == [r["layer"] for r in m["rmse"]["layers"]] == [r["layer"] for r in cli["layers"]]
    for stored, fresh in zip(m["rmse"]["layers"], cli["layers"]):
        g = rows[stored["layer"]]
        assert int(g[1]) == stored["bits"] == fresh["bits"]
        for i, proj in enumerate(("gate", "up", "down")):
            assert _close(g[2 + i], stored[proj]) and _close(g[2 + i], fresh[proj]), (proj, g, stored, fresh)
        assert _close(g[5], max(stored["max_abs"].values()))
        assert _close(g[5], max(fresh["max_abs"].values()))
    mean = next(MEAN.match(line).groups() for line in card.splitlines() if MEAN.match(line))
    for i, proj in enumerate(("gate", "up", "down")):
        assert _close(mean[i], m["rmse"]["overall"][proj]) and _close(mean[i], cli["overall"][proj])


def test_bits_bytes_per_token_versions(packed):
    info = inspect(packed)
    card = render_card(packed, repo_id="me/x")
    assert f"({info['bytes_per_token']:,} bytes" in card and f"K={info['k']}" in card
    assert "| 2 | requant-minmax | 0-3 |" in card  # bits per layer
    assert "2-bit: layers 0-3" in card
    assert "packed format 1, written by moepack 0.1.0" in card
    assert "## Quality" not in card  # no eval section in the manifest: no quality figures


def test_quality_figures_from_eval_section(packed):
    _edit_manifest(packed, eval={"dataset": "wikitext-2 (512 tokens)",
                                 "perplexity": {"source": 3.64, "packed": 5.71},
                                 "kl_divergence": {"mean": 0.1234, "p99": 1.5}})
    card = render_card(packed)
    assert "## Quality" in card
    assert "| perplexity | source: 3.64, packed: 5.71 |" in card
    assert "| kl_divergence | mean: 0.1234, p99: 1.5 |" in card
    assert "| dataset | wikitext-2 (512 tokens) |" in card


def test_user_edits_survive_regeneration_and_verify_still_passes(packed):
    first = write_card(packed, repo_id="me/tiny-q2")
    assert (packed / "README.md").read_text() == first
    meta, body = split_front_matter(first)
    meta["language"] = ["en"]
    meta["tags"] = meta["tags"] + ["my-tag"]
    meta["license"] = "other"
    edited = ("---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"
              + "# My notes\n\nTested on an M3 Max: 5 tok/s.\n\n"
              + body.replace(END, END + "\n\n## Acknowledgements\n\nThanks to the Qwen team.\n")
              .replace("# tiny-q2", "# EDITED INSIDE THE MARKERS"))
    (packed / "README.md").write_text(edited)
    _edit_manifest(packed, eval={"perplexity": 4.2})  # something new to show
    second = write_card(packed, repo_id="me/tiny-q2")
    meta2, body2 = split_front_matter(second)
    assert meta2["language"] == ["en"] and meta2["license"] == "other"  # user keys and values kept
    assert meta2["tags"] == list(TAGS) + ["my-tag"]
    assert body2.index("# My notes") < body2.index(BEGIN) < body2.index(END) < body2.index("## Acknowledgements")
    assert "Tested on an M3 Max: 5 tok/s." in body2 and "Thanks to the Qwen team." in body2
    assert "EDITED INSIDE THE MARKERS" not in body2 and "# tiny-q2" in body2  # inside: regenerated
    assert "| perplexity | 4.2 |" in body2
    assert body2.count(BEGIN) == 1 and body2.count(END) == 1
    assert write_card(packed, repo_id="me/tiny-q2") == second  # stable

    rep = verify(packed, progress=False)
    assert rep.ok, rep.problems
    assert "README.md" not in {f["name"] for f in json.loads((packed / MANIFEST_NAME).read_text())["aux_files"]}


def test_hand_written_readme_without_markers_is_kept(packed):
    (packed / "README.md").write_text("My own README.\n")
    card = write_card(packed)
    meta, body = split_front_matter(card)
    assert meta["library_name"] == "moepack"
    assert body.lstrip().startswith("My own README.") and body.index("My own README.") < body.index(BEGIN)


@pytest.mark.parametrize("text,words", [
    ("---\nlicense: [unclosed\n---\nbody\n", "not valid YAML"),
    ("---\n- a\n- b\n---\nbody\n", "not a mapping"),
    ("---\nlicense: mit\nbody without end\n", "never closed"),
    (f"x\n{BEGIN}\nold\n", "unpaired"),
    (f"{END}\nx\n{BEGIN}\n", "out of order"),
])
def test_broken_readme_is_a_clear_error(packed, text, words):
    (packed / "README.md").write_text(text)
    with pytest.raises(HubError, match=re.escape(words)) as e:
        write_card(packed)
    assert e.value.hint and "\n" not in e.value.message
    assert (packed / "README.md").read_text() == text  # left untouched


def test_bit_exact_repack_has_no_rmse_table(built, tmp_path):
    out = tmp_path / "p4"
    convert(str(built[0]), out, bits=4, progress=False)
    card = render_card(out)
    assert "bit-exact repack" in card and not any(ROW.match(line) for line in card.splitlines())
    assert "| 4 | repack | 0-3 |" in card

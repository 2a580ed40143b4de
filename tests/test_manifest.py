"""The manifest is validated before it is trusted; hostile or damaged manifests are refused by name."""

import json

import pytest

from moepack.convert import convert
from moepack.errors import PackedModelError
from moepack.layout.constants import MANIFEST_NAME
from moepack.layout.manifest import load_manifest
from moepack.layout.reader import PackedModel


@pytest.fixture(scope="module")
def packed(mlx_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "p"
    convert(str(mlx_ckpt), out, bits=2, progress=False)
    return out


def _edit(packed, tmp_path, fn):
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(packed, dst)
    d = json.loads((dst / MANIFEST_NAME).read_text())
    fn(d)
    (dst / MANIFEST_NAME).write_text(json.dumps(d))
    return dst


def test_roundtrip_keeps_unknown_sections(packed, tmp_path):
    from moepack.layout.manifest import save_manifest

    dst = _edit(packed, tmp_path, lambda d: d.update({"eval": {"ppl": 3.5}}))
    m = load_manifest(dst)
    assert m.extra == {"eval": {"ppl": 3.5}}
    save_manifest(dst, m)
    assert json.loads((dst / MANIFEST_NAME).read_text())["eval"] == {"ppl": 3.5}


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(format="gguf"), "not a moepack manifest"),
    (lambda d: d.update(format_version=99), "newer"),
    (lambda d: d["layers"][0].update(file="../../etc/passwd"), "escapes"),
    (lambda d: d["layers"][0].update(layout="q9.g64"), "unknown record layout"),
    (lambda d: d["checksums"]["records"].popitem(), "record checksums"),
    (lambda d: d["record_layouts"]["q2.g64"]["components"][0].update(nbytes=1), "record component"),
    (lambda d: d.pop("moe"), "malformed"),
    (lambda d: d["dense_files"][0].update(name="/abs/model.safetensors"), "escapes"),
])
def test_hostile_manifests_refused(packed, tmp_path, edit, words):
    dst = _edit(packed, tmp_path, edit)
    with pytest.raises(PackedModelError, match=words):
        PackedModel(dst)


def test_truncated_layer_file_refused_on_open(packed, tmp_path):
    import shutil

    dst = tmp_path / "t"
    shutil.copytree(packed, dst)
    f = sorted((dst / "packed_experts").iterdir())[0]
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1)
    with pytest.raises(PackedModelError, match="bytes, expected"):
        PackedModel(dst)


def test_manifest_not_json(packed, tmp_path):
    import shutil

    dst = tmp_path / "j"
    shutil.copytree(packed, dst)
    (dst / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(PackedModelError, match="not valid JSON"):
        load_manifest(dst)

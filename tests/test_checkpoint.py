"""Opening checkpoints: local folders (index, single file, unindexed shards), damaged downloads, hub cache offline."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moepack.errors import CorruptFileError, SourceError
from moepack.source.checkpoint import Checkpoint, open_checkpoint
from moepack.source.safetensors_file import SafetensorsFile, write_safetensors
from moepack.testing import write_mlx_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return write_mlx_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "qwen3_5_moe", shards=3)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _folder(tmp_path: Path, files: dict[str, list], config: dict | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config if config is not None else {"model_type": "qwen3_moe"}))
    for name, tensors in files.items():
        write_safetensors(tmp_path / name, tensors)
    return tmp_path


def test_sharded_with_index(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    with open_checkpoint(sharded) as ck:
        assert isinstance(ck, Checkpoint)
        assert ck.path == sharded and ck.repo_id is None and ck.revision is None
        assert ck.config["model_type"] == "qwen3_5_moe"
        assert ck.quantization["bits"] == 4 and ck.quantization["group_size"] == 64
        assert ck.tensor_names == sorted(index["weight_map"])
        assert ck.shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        seen = []
        for shard in ck.shards:
            names = ck.tensors_in_shard(shard)
            starts = [ck.info(n).start for n in names]
            assert starts == sorted(starts)  # file order
            assert all(ck.file_of(n) == sharded / shard for n in names)
            seen += names
        assert sorted(seen) == ck.tensor_names
        name = "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight"
        info = ck.info(name)
        assert info.dtype == "U32" and info.shape == (8, 64, 16)
        with SafetensorsFile(ck.file_of(name)) as f:
            np.testing.assert_array_equal(ck.read(name), f.read(name))
        assert ck.read_bytes(name) == ck.read(name).tobytes()
        assert name in ck and "nope" not in ck
        with pytest.raises(SourceError, match="no tensor named 'nope'"):
            ck.info("nope")
        with pytest.raises(SourceError, match="not one of this checkpoint's shards"):
            ck.tensors_in_shard("model-00009-of-00009.safetensors")
        aux = {p.name for p in ck.aux_files}
        assert {
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        } <= aux
        assert not any(n.endswith(".safetensors") or n.endswith(".index.json") for n in aux)


def test_single_file_without_index(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    folder = _folder(tmp_path / "m", {"model.safetensors": [("w", "F32", (2, 3), a), ("b", "U8", (2,), b"\x01\x02")]},
                     config={"model_type": "qwen3_moe", "quantization_config": {"bits": 4, "group_size": 64}})
    (folder / "tokenizer.json").write_text("{}")
    (folder / "merges.txt").write_text("")
    (folder / "vocab.json").write_text("{}")
    (folder / "README.md").write_text("card")
    with open_checkpoint(str(folder)) as ck:
        assert ck.shards == ["model.safetensors"] and ck.tensor_names == ["b", "w"]
        assert ck.quantization == {"bits": 4, "group_size": 64}
        np.testing.assert_array_equal(ck.read("w"), a)
        assert [p.name for p in ck.aux_files] == ["config.json", "merges.txt", "tokenizer.json", "vocab.json"]


def test_several_shards_without_index_and_duplicates(tmp_path):
    one = [("a", "U8", (1,), b"a")]
    two = [("b", "U8", (1,), b"b")]
    folder = _folder(tmp_path / "u", {"model-1.safetensors": one, "model-2.safetensors": two, "mtp.safetensors": one})
    with open_checkpoint(folder) as ck:  # mlx-lm only loads model*.safetensors, so do we
        assert ck.shards == ["model-1.safetensors", "model-2.safetensors"] and ck.tensor_names == ["a", "b"]
        assert ck.quantization is None
    dup = _folder(tmp_path / "d", {"model-1.safetensors": one, "model-2.safetensors": one})
    with pytest.raises(CorruptFileError, match="tensor 'a' is in both model-1.safetensors and model-2.safetensors"):
        open_checkpoint(dup)


def test_missing_shard_says_download_incomplete(sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "c")
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(SourceError, match="model-00002-of-00003.safetensors.*missing.*download is incomplete") as err:
        open_checkpoint(folder)
    assert err.value.hint


def test_index_naming_absent_tensor(sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "c")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.model.layers.9.ghost.weight"] = "model-00001-of-00003.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptFileError, match="'language_model.model.layers.9.ghost.weight' mapped to this shard"):
        open_checkpoint(folder)
    # without up-front validation the error comes on first use of that shard
    ck = open_checkpoint(folder, validate=False)
    assert "language_model.model.layers.9.ghost.weight" in ck.tensor_names
    with pytest.raises(CorruptFileError, match="ghost"):
        ck.read("language_model.model.layers.9.ghost.weight")


def test_damaged_index_and_shard(sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "c")
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="index.json: not valid JSON"):
        open_checkpoint(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(CorruptFileError, match="not a .safetensors file in the folder"):
        open_checkpoint(folder)

    folder = _copy(sharded, tmp_path / "t")
    shard = folder / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CorruptFileError, match="model-00003-of-00003.safetensors: truncated"):
        open_checkpoint(folder)


def test_missing_or_bad_config(tmp_path):
    folder = _folder(tmp_path / "m", {"model.safetensors": [("a", "U8", (1,), b"a")]})
    (folder / "config.json").unlink()
    with pytest.raises(SourceError, match="no config.json"):
        open_checkpoint(folder)
    (folder / "config.json").write_text("{oops")
    with pytest.raises(SourceError, match="config.json: not valid JSON"):
        open_checkpoint(folder)
    (folder / "config.json").write_text("[1]")
    with pytest.raises(SourceError, match="expected a JSON object"):
        open_checkpoint(folder)


def test_no_weights_and_bad_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(SourceError, match="no \\*.safetensors files"):
        open_checkpoint(tmp_path / "empty")
    (tmp_path / "file.safetensors").write_bytes(b"")
    with pytest.raises(SourceError, match="is a file, not a checkpoint folder"):
        open_checkpoint(tmp_path / "file.safetensors")
    with pytest.raises(SourceError, match="no such folder, and not a hub repo id"):
        open_checkpoint(str(tmp_path / "does" / "not" / "exist"))


# ------------------------------------------------------------------ hub cache, offline
def _hub_repo(cache: Path, repo_id: str, src: Path, commit: str, tree_extra: list[str] = ()) -> None:
    """Lay ``src``'s files out as huggingface_hub's cache does: blobs/, snapshots/<commit>/ symlinks, refs/main."""
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    blobs, snap = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    tree = {}
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blobs / digest, snap))
        tree[f.name] = {"size": len(data), "blob_id": hashlib.sha1(data).hexdigest()}
    for extra in tree_extra:  # listed by the Hub, never downloaded
        tree[extra] = {"size": 10, "blob_id": "0" * 40}
    if tree_extra:
        (repo / "trees").mkdir()
        (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))


_OFFLINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from moepack.errors import MoepackError
    from moepack.source.checkpoint import open_checkpoint
    results = {}
    for label, repo, rev in json.loads(sys.argv[1]):
        try:
            ck = open_checkpoint(repo, revision=rev)
            name = ck.tensor_names[0]
            results[label] = {"ok": True, "path": str(ck.path), "repo_id": ck.repo_id, "revision": ck.revision,
                              "n": len(ck.tensor_names), "shape": list(ck.read(name).shape),
                              "aux": sorted(p.name for p in ck.aux_files), "model_type": ck.config["model_type"]}
            ck.close()
        except MoepackError as e:
            results[label] = {"ok": False, "type": type(e).__name__, "msg": str(e), "hint": e.hint}
    print(json.dumps(results))
    """
)


def _run_offline(cases: list, cache: Path, tmp_path: Path, **env_extra: str) -> dict:
    """Run the cases in a fresh interpreter: huggingface_hub reads its environment variables at import time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        HF_HUB_CACHE=str(cache),
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        **env_extra,
    )
    proc = subprocess.run(
        [sys.executable, "-c", _OFFLINE_SCRIPT, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hub_cache_offline(sharded, tmp_path):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    commit = hashlib.sha1(b"tiny-moe").hexdigest()
    _hub_repo(cache, "tiny-org/tiny-moe", sharded, commit)
    broken_commit = hashlib.sha1(b"broken").hexdigest()
    _hub_repo(cache, "tiny-org/half-done", sharded, broken_commit, tree_extra=["model-00004-of-00004.safetensors"])

    cases = [
        ["main", "tiny-org/tiny-moe", None],
        ["by_commit", "tiny-org/tiny-moe", commit],
        ["absent_repo", "tiny-org/absent", None],
        ["absent_branch", "tiny-org/tiny-moe", "v2"],
        ["incomplete", "tiny-org/half-done", None],
    ]
    res = _run_offline(cases, cache, tmp_path, HF_HUB_OFFLINE="1")
    for label in ("main", "by_commit"):
        r = res[label]
        assert r["ok"], r
        assert r["repo_id"] == "tiny-org/tiny-moe" and r["revision"] == commit
        assert Path(r["path"]) == cache / "models--tiny-org--tiny-moe" / "snapshots" / commit
        assert r["model_type"] == "qwen3_5_moe" and r["n"] > 100
        assert "tokenizer.json" in r["aux"] and "chat_template.jinja" in r["aux"]

    for label in ("absent_repo", "absent_branch"):
        r = res[label]
        assert not r["ok"] and r["type"] == "SourceError", r
        assert "not in the local hub cache" in r["msg"] and "HF_HUB_OFFLINE=1" in r["msg"]
        assert "\n" not in r["msg"] and r["hint"]

    r = res["incomplete"]
    assert not r["ok"] and r["type"] == "SourceError" and "incomplete" in r["msg"], r


def test_hub_unreachable_falls_back_to_cache(sharded, tmp_path):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    commit = hashlib.sha1(b"tiny-moe").hexdigest()
    _hub_repo(cache, "tiny-org/tiny-moe", sharded, commit)
    cases = [["cached", "tiny-org/tiny-moe", None], ["absent", "tiny-org/absent", None]]
    # nothing listens on the discard port: connections are refused at once
    res = _run_offline(cases, cache, tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert res["cached"]["ok"] and res["cached"]["revision"] == commit, res
    r = res["absent"]
    assert not r["ok"] and r["type"] == "SourceError", r
    assert "Hub cannot be reached" in r["msg"] and "not in the local hub cache" in r["msg"]

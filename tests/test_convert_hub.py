"""`moepack convert REPO_ID OUT` shard by shard: real huggingface_hub client code against the loopback hub
(tests/hub_server.py), each run a fresh interpreter whose network is limited to loopback.

The source: a tiny qwen3_5_moe MLX 4-bit checkpoint in 6 shards, where layer 0 spans shards 1-2, layer 2 spans
4-5 and layer 3 spans 5-6 (so a layer can need two shards at once). Every result is compared byte for byte with
converting the same checkpoint from a local folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hub_server import HubServer, _clean, _ok, cli, folder_files, hub_env, run_calls
from moepack.convert import convert
from moepack.layout.constants import MANIFEST_NAME, STATE_NAME
from moepack.source.safetensors_file import SafetensorsFile, write_safetensors
from moepack.source.shard_schedule import Step, peak_on_disk, plan_shard_steps
from moepack.testing.fixtures import write_mlx_checkpoint

REPO = "tester/tiny-moe-6shards"
SHARDS = [f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert-hub")
    src = write_mlx_checkpoint(root / "src", arch="qwen3_5_moe", bits=4, seed=3, shards=6)
    assert sorted(p.name for p in src.glob("*.safetensors")) == SHARDS
    # shard 6 gets a header larger than the first range read (100 kB), so reading it takes a second one
    last = src / SHARDS[5]
    with SafetensorsFile(last) as sf:
        tensors = [(n, t.dtype, t.shape, sf.read_bytes(n)) for n, t in sf.tensors.items()]
        meta = {**sf.metadata, "notes": "x" * 150_000}
    write_safetensors(last, tensors, meta)
    convert(str(src), root / "local-q2", bits=2, progress=False)  # the reference: same checkpoint, local folder
    return src, root / "local-q2"


@pytest.fixture
def hub(built):
    with HubServer(lifetime=120) as h:
        h.add_repo(REPO, folder_files(built[0]))
        yield h


def _same_as_local(out: Path, local: Path) -> None:
    got, want = folder_files(out), folder_files(local)
    assert set(got) == set(want), set(got) ^ set(want)
    for name in want:
        if name != MANIFEST_NAME:
            assert got[name] == want[name], name
    mg, mw = json.loads(got[MANIFEST_NAME]), json.loads(want[MANIFEST_NAME])
    assert mg.pop("source")["type"] == "hub" and mw.pop("source")["type"] == "local"
    assert mg == mw
    assert not (out / STATE_NAME).exists() and not (out / ".moepack-source").exists()


def _cdn_downloads(hub, src: Path) -> dict[str, int]:
    """Shard name -> how many full downloads (200, not the 206 header reads) the CDN served."""
    by_sha = {hashlib.sha256((src / s).read_bytes()).hexdigest(): s for s in SHARDS}
    n = dict.fromkeys(SHARDS, 0)
    for method, path, status in hub.requests("GET", r"^/lfs-objects/"):
        if status == 200:
            n[by_sha[path.rsplit("/", 1)[1]]] += 1
    return n


def _cache_repo(home: Path) -> Path:
    return home / "hub-cache" / ("models--" + REPO.replace("/", "--"))


def _shards_in_cache(home: Path, src: Path) -> list[str]:
    """Shards whose bytes are anywhere in the hub cache (blob or snapshot entry, incomplete downloads too)."""
    sizes = {(src / s).stat().st_size: s for s in SHARDS}
    return sorted({sizes[p.stat().st_size] for p in _cache_repo(home).rglob("*")
                   if p.is_file() and p.stat().st_size in sizes})


def _json_out(r) -> dict:
    return json.loads(_ok(r)["out"])


def test_schedule_by_hand():
    # layers 0, 1 in a; layer 2 split over b and c; d holds only dense tensors (staged on its own)
    needs = {("layer", 0): {"a"}, ("layer", 1): {"a"}, ("layer", 2): {"b", "c"}, ("dense", "d"): {"d"}}
    sizes = {"a": 4, "b": 2, "c": 3, "d": 1}
    steps = plan_shard_steps(needs, ["a", "b", "c", "d"], sizes)
    assert steps == [Step(None, (), (), 0, 0),
                     Step("a", (("layer", 0), ("layer", 1)), ("a",), 4, 4),
                     Step("b", (), (), 2, 2),
                     Step("c", (("layer", 2),), ("b", "c"), 5, 5),
                     Step("d", (("dense", "d"),), ("d",), 1, 1)]
    assert peak_on_disk(steps) == (5, 5)
    # a already on disk; c not needed by anything left: dropped at once, never fetched; without dropping nothing goes
    resumed = plan_shard_steps({("layer", 2): {"a", "b"}}, ["a", "b", "c"], sizes, present=["a", "c"])
    assert resumed == [Step(None, (), ("c",), 7, 0), Step("b", (("layer", 2),), ("a", "b"), 6, 2)]
    kept = plan_shard_steps({("layer", 2): {"a", "b"}}, ["a", "b", "c"], sizes, present=["a", "c"], drop=False)
    assert [s.drop for s in kept] == [(), ()] and peak_on_disk(kept) == (9, 2)
    with pytest.raises(ValueError, match="not in the order"):
        plan_shard_steps({("layer", 0): {"z"}}, ["a"], sizes)


def test_stream_with_delete_source_equals_local(hub, built, tmp_path):
    src, local = built
    out = tmp_path / "out"
    r = run_calls([cli("convert", REPO, str(out), "--bits", "2", "--delete-source", "--json")], hub_env(hub, tmp_path))
    s = _json_out(r[0])["source"]
    _same_as_local(out, local)
    total = sum((src / n).stat().st_size for n in SHARDS)
    assert s["shards"] == 6 and s["source_bytes"] == total and s["downloaded_bytes"] == total
    assert s["shards_downloaded"] == 6 and s["shards_deleted"] == 6 and s["shards_reused"] == 0
    # at most the two shards of a split layer on disk at once, as planned; well below the whole checkpoint
    pairs = max((src / a).stat().st_size + (src / b).stat().st_size for a, b in zip(SHARDS, SHARDS[1:]))
    assert s["peak_source_bytes_on_disk"] == s["planned_peak_source_bytes"] <= pairs < total / 2
    assert _shards_in_cache(tmp_path, src) == []  # no shard blob, link or partial download left
    assert (_cache_repo(tmp_path) / "snapshots").is_dir()  # the small files stay cached
    assert _cdn_downloads(hub, src) == dict.fromkeys(SHARDS, 1)  # each shard downloaded once
    assert len(hub.requests("GET", r"^/lfs-objects/")) == 6 + 7  # + the header range reads: two for shard 6
    assert not hub.rejected and not hub.unhandled  # (the server refuses a token sent to the CDN)


def test_without_delete_keeps_the_snapshot_and_offline_converts_from_it(hub, built, tmp_path):
    src, local = built
    r = run_calls([cli("convert", REPO, str(tmp_path / "a"), "--bits", "2", "--json")], hub_env(hub, tmp_path))
    s = _json_out(r[0])["source"]
    _same_as_local(tmp_path / "a", local)
    assert s["shards_downloaded"] == 6 and s["shards_deleted"] == 0
    assert s["peak_source_bytes_on_disk"] == s["source_bytes"]
    assert _shards_in_cache(tmp_path, src) == SHARDS
    n = len(hub.log)
    off = run_calls([cli("convert", REPO, str(tmp_path / "b"), "--bits", "2", "--json"),
                     cli("convert", REPO, str(tmp_path / "c"), "--bits", "2", "--delete-source", "-q")],
                    hub_env(hub, tmp_path, offline=True))
    assert _json_out(off[0])["source"]["shards_reused"] == 6
    _same_as_local(tmp_path / "b", local)
    assert "6 found in the hub cache, 6 deleted" in _ok(off[1])["out"]  # offline: dropped once converted
    _same_as_local(tmp_path / "c", local)
    assert _shards_in_cache(tmp_path, src) == [] and len(hub.log) == n  # offline means offline


def test_interrupted_run_resumes_without_downloading_dropped_shards_again(hub, built, tmp_path):
    src, local = built
    sha5 = hashlib.sha256((src / SHARDS[4]).read_bytes()).hexdigest()
    hub.fail("GET", rf"^/lfs-objects/{sha5}$", skip=1, times=1)  # the header read passes, the download fails
    out = tmp_path / "out"
    env = hub_env(hub, tmp_path)
    first = run_calls([cli("convert", REPO, str(out), "--bits", "2", "--delete-source")], env)[0]
    _clean(first, f"hub repo {REPO}@", "downloading model-00005-of-00006.safetensors failed", "injected failure")
    state = json.loads((out / STATE_NAME).read_text())
    assert not (out / MANIFEST_NAME).exists() and sorted(state["layers"], key=int) == ["0", "1"]
    assert state["source"]["deleted"] == SHARDS[:3]  # layers 0 and 1 and their dense tensors are done
    assert _shards_in_cache(tmp_path, src) == [SHARDS[3]]  # waits with layer 2 for shard 5
    assert _cdn_downloads(hub, src) == {**dict.fromkeys(SHARDS[:4], 1), **dict.fromkeys(SHARDS[4:], 0)}

    # damage finished layer 1: its shard (3) was deleted, so it is downloaded again; shards 1 and 2 are not
    f = out / state["layers"]["1"]["file"]
    data = bytearray(f.read_bytes())
    data[7] ^= 0xFF
    f.write_bytes(bytes(data))
    # meanwhile main moves on: the unfinished conversion names the commit it started from
    started = hub.head(REPO)
    with hub.lock:
        repo = hub.repos[REPO]
        hub._commit(repo, "main", {**repo.commits[started].files, "README.md": hub._regular(b"# new card\n")}, "card")
    moved, again = run_calls([cli("convert", REPO, str(out), "--bits", "2", "--delete-source"),
                              cli("convert", REPO, str(out), "--bits", "2", "--delete-source", "--json",
                                  "--revision", started)], env)
    _clean(moved, f"unfinished conversion of {REPO} at commit {started[:12]}, but the revision now resolves to")
    assert f"pass --revision {started} to finish it" in moved["err"]
    s = _json_out(again)["source"]
    assert s["downloaded"] == [SHARDS[2], SHARDS[4], SHARDS[5]] and s["shards_reused"] == 1
    assert _cdn_downloads(hub, src) == {SHARDS[0]: 1, SHARDS[1]: 1, SHARDS[2]: 2, SHARDS[3]: 1, SHARDS[4]: 1,
                                        SHARDS[5]: 1}
    _same_as_local(out, local)
    assert _shards_in_cache(tmp_path, src) == []


def test_damaged_shard_download_is_a_clear_error(hub, built, tmp_path):
    src, local = built
    good = (src / SHARDS[2]).read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x5A  # same size: only the sha256 can tell
    hub.corrupt[(REPO, SHARDS[2])] = bytes(bad)
    out = tmp_path / "out"
    env = hub_env(hub, tmp_path)
    r = run_calls([cli("convert", REPO, str(out), "--bits", "2", "--delete-source"),
                   cli("convert", "tester/absent", str(tmp_path / "x")),
                   cli("convert", str(src), str(tmp_path / "y"), "--delete-source")], env)
    _clean(r[0], f"{SHARDS[2]} does not match its sha256", "the download is damaged")
    assert "downloaded again" in r[0]["err"]
    assert not (out / MANIFEST_NAME).exists() and SHARDS[2] not in _shards_in_cache(tmp_path, src)
    _clean(r[1], "hub repo tester/absent not found")
    assert not (tmp_path / "x" / MANIFEST_NAME).exists()
    _clean(r[2], "--delete-source only applies to a hub repo id")
    assert not (tmp_path / "y").exists() and (src / SHARDS[0]).is_file()  # a local source is never touched
    # a truncated download: huggingface_hub's own size check, the same kind of error
    hub.corrupt[(REPO, SHARDS[2])] = good[:-100]
    short = run_calls([cli("convert", REPO, str(out), "--bits", "2", "--delete-source")], env)[0]
    _clean(short, SHARDS[2], "wrong size")
    assert not (out / MANIFEST_NAME).exists() and SHARDS[2] not in _shards_in_cache(tmp_path, src)
    hub.corrupt.clear()  # once the hub serves the right bytes, the same command finishes the job
    done = run_calls([cli("convert", REPO, str(out), "--bits", "2", "--delete-source", "--json")], env)[0]
    assert _json_out(done)["source"]["downloaded"] == SHARDS[2:]  # 1 and 2 were packed and dropped before
    _same_as_local(out, local)


def test_disk_space_check_counts_the_shards_in_flight(monkeypatch, tmp_path):
    import moepack.convert_stream as cs
    from moepack.errors import DiskSpaceError

    class Usage:
        total = used = 10**12
        free = 5 * 10**9

    monkeypatch.setattr(cs.shutil, "disk_usage", lambda p: Usage)
    monkeypatch.setattr(cs, "download_folder", lambda: tmp_path / "cache")  # same filesystem as OUT
    cs._check_space(tmp_path / "out", 2 * 10**9, 2 * 10**9)  # 4 GB of 5 free: fine
    with pytest.raises(DiskSpaceError, match=r"2.00 GB for the packed model \+ 3.00 GB of source shards") as e:
        cs._check_space(tmp_path / "out", 2 * 10**9, 3 * 10**9)
    assert "--delete-source" in e.value.hint


def test_single_file_and_unquantized_hf_repos_equal_local(tmp_path):
    """No index (one model.safetensors, found through the tree listing), and a bf16 Hugging Face checkpoint
    (renamed, quantized dense tensors made from the staged copies; vision / MTP tensors skipped)."""
    from moepack.testing.fixtures import write_hf_checkpoint

    one = write_mlx_checkpoint(tmp_path / "one", arch="qwen3_moe", bits=4, seed=2, shards=1)
    hf = write_hf_checkpoint(tmp_path / "hf", arch="qwen3_5_moe", seed=2, shards=3)
    (one / "model.safetensors.index.json").unlink()
    for src in (one, hf):
        convert(str(src), tmp_path / f"{src.name}-local", progress=False)
    with HubServer(lifetime=60) as hub:
        hub.add_repo("tester/one", folder_files(one))
        hub.add_repo("tester/hf", folder_files(hf))
        res = run_calls([cli("convert", "tester/one", str(tmp_path / "one-out"), "--delete-source", "--json"),
                         cli("convert", "tester/hf", str(tmp_path / "hf-out"), "--delete-source", "--json")],
                        hub_env(hub, tmp_path))
        assert not hub.rejected and not hub.unhandled
    for r, src in zip(res, (one, hf)):
        s = _json_out(r)["source"]
        n = len(list(src.glob("*.safetensors")))
        assert s["shards"] == s["shards_downloaded"] == s["shards_deleted"] == n
        assert n == 1 or s["peak_source_bytes_on_disk"] < s["source_bytes"]
        got, want = folder_files(tmp_path / f"{src.name}-out"), folder_files(tmp_path / f"{src.name}-local")
        assert set(got) == set(want) and all(got[k] == want[k] for k in want if k != MANIFEST_NAME)
    assert not list((tmp_path / "hub-cache").rglob("*.safetensors"))


def test_hub_errors_become_one_line_errors():
    from moepack.errors import CorruptFileError, DiskSpaceError
    from moepack.source.checkpoint import hub_errors

    with pytest.raises(DiskSpaceError, match=r"hub repo o/m@main: disk full while downloading into"):
        with hub_errors("o/m", None):
            raise OSError(28, "No space left on device")
    with pytest.raises(CorruptFileError, match=r"o/m@abc: downloading x failed: the file arrived with the wrong size"):
        with hub_errors("o/m", "abc", "downloading x"):
            raise OSError("Consistency check failed: file should be of size 10 but has size 9 (x).\nRetry.")

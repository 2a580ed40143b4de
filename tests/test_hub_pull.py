"""`moepack pull` / resolve_packed: real snapshot_download over HTTP from the loopback hub, offline from the cache,
verify once (marker), damaged downloads, bad repos."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from hub_server import _clean, _ok, HubServer, cli, folder_files, hub_env, run_calls
from moepack.convert import convert
from moepack.errors import CorruptFileError
from moepack.hub import HubError
from moepack.hub.card import write_card
from moepack.hub.pull import MARKER_NAME, ensure_verified, resolve_packed
from moepack.layout.constants import MANIFEST_NAME
from moepack.testing.fixtures import write_mlx_checkpoint

REPO = "tester/tiny-q2"
BAD = "packed_experts/layer_01.bin"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("pull")
    src = write_mlx_checkpoint(root / "src", arch="qwen3_5_moe", bits=4, seed=0)
    convert(str(src), root / "packed", bits=2, progress=False)
    write_card(root / "packed", repo_id=REPO)
    return root / "packed"


@pytest.fixture
def hub(built):
    with HubServer(lifetime=120) as h:
        h.add_repo(REPO, folder_files(built))
        yield h




def _path(r) -> Path:
    return Path(r["out"].strip().splitlines()[-1])


def _same_files(folder: Path, built: Path):
    got, want = folder_files(folder), folder_files(built)
    assert set(got) == set(want), set(got) ^ set(want)  # (.gitattributes is hidden: not compared)
    assert all(got[n] == want[n] for n in want)


def _flip(data: bytes, at: int = 5000) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x5A
    return bytes(b)


def test_pull_over_http_then_cached_then_offline(hub, built, tmp_path):
    # a public repo: no token needed. hf_xet stays enabled (the default install): the server announces no Xet
    # storage (no X-Xet-* headers, no xetHash in the tree), so files come over plain HTTP
    env = hub_env(hub, tmp_path, token=None, xet=True)
    res = run_calls([cli("pull", REPO), cli("pull", REPO),
                     ["py", "moepack.hub.pull", "resolve_packed", [REPO], {"progress": False}]], env)
    first, second, resolved = (_ok(r) for r in res)
    commit = hub.head(REPO)
    snap = tmp_path / "hub-cache" / "models--tester--tiny-q2" / "snapshots" / commit
    assert _path(first) == snap and first["out"].strip() == str(snap)  # stdout: the folder only
    assert f"verified {REPO}@{commit[:12]}: 11 files, 32 expert records" in first["err"]
    _same_files(snap, built)
    assert (snap / "packed_experts/layer_00.bin").is_symlink()  # the real hub cache layout: links to blobs
    marker = json.loads((snap / MARKER_NAME).read_text())
    assert marker["repo_id"] == REPO and marker["commit"] == commit and marker["checked_records"] == 32
    assert "verified earlier" in second["err"] and _path(second) == snap
    assert Path(resolved["value"]) == snap
    # every file went over HTTP once; LFS files through the CDN redirect, without the hub token
    gets = [p for m, p, s in hub.log if m == "GET" and s in (200, 206) and ("/resolve/" in p or "/lfs-objects/" in p)]
    assert len([p for p in gets if "/lfs-objects/" in p]) == 5
    assert len(gets) == len(folder_files(built)) + 1  # + .gitattributes
    assert not hub.rejected and not hub.unhandled and not hub.requests(path_regex="xet")

    # offline: straight from the cache, the earlier check still holds; also by commit
    n = len(hub.log)
    off = run_calls([cli("pull", REPO), cli("pull", REPO, "--revision", commit),
                     ["py", "moepack.hub.pull", "resolve_packed", [REPO], {}]],
                    hub_env(hub, tmp_path, offline=True))
    for r in off:
        _ok(r)
    assert _path(off[0]) == _path(off[1]) == Path(off[2]["value"]) == snap
    assert "verified earlier" in off[0]["err"]
    assert len(hub.log) == n  # offline means offline


def test_pull_local_dir_and_revision(hub, built, tmp_path):
    d = tmp_path / "here"
    res = run_calls([cli("pull", REPO, "--local-dir", str(d)), cli("pull", REPO, "--local-dir", str(d)),
                     cli("pull", REPO, "--revision", "nope")], hub_env(hub, tmp_path))
    _ok(res[0])
    assert _path(res[0]) == d.resolve()
    _same_files(d, built)
    assert (d / MARKER_NAME).is_file() and (d / ".cache" / "huggingface").is_dir()
    assert json.loads((d / MARKER_NAME).read_text())["commit"] == hub.head(REPO)
    assert "verified earlier" in _ok(res[1])["err"]
    _clean(res[2], "hub repo tester/tiny-q2 has no revision 'nope'")


def test_pull_offline_from_a_prepopulated_hub_cache(built, tmp_path):
    """No server at all: the cache laid out as huggingface_hub does (blobs, snapshot links, refs/main)."""
    commit = hashlib.sha1(b"tiny-q2").hexdigest()
    repo = tmp_path / "hub-cache" / "models--tester--tiny-q2"
    snap = repo / "snapshots" / commit
    for name, data in folder_files(built).items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(os.path.relpath(blob, (snap / name).parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    res = run_calls([cli("pull", REPO), cli("pull", REPO), cli("pull", "tester/absent")],
                    hub_env(None, tmp_path, offline=True))
    assert _path(_ok(res[0])) == snap and f"verified {REPO}@{commit[:12]}" in res[0]["err"]
    assert "verified earlier" in _ok(res[1])["err"]
    _clean(res[2], "hub repo tester/absent@main is not in the hub cache", "HF_HUB_OFFLINE=1 forbids downloading it")


def test_damaged_download_into_the_cache(hub, built, tmp_path):
    hub.corrupt[(REPO, BAD)] = _flip((built / BAD).read_bytes())  # same size: only the checksums can tell
    env = hub_env(hub, tmp_path)
    res = run_calls([cli("pull", REPO), ["py", "moepack.hub.pull", "resolve_packed", [REPO], {}]], env)
    commit = hub.head(REPO)
    snap = tmp_path / "hub-cache" / "models--tester--tiny-q2" / "snapshots" / commit
    line = _clean(res[0], f"download of {REPO}@{commit[:12]} does not match its manifest",
                  f"{BAD}: 1 record(s) fail their checksum")
    assert "hint: re-run the same `moepack pull tester/tiny-q2` command" in res[0]["err"], line
    # what other commands get from resolve_packed: the same error (the bad file was fetched again, still bad)
    assert res[1]["code"].startswith("exception: CorruptFileError: download of") and BAD in res[1]["code"]
    assert not (snap / MARKER_NAME).exists() and not (snap / MANIFEST_NAME).exists() and not (snap / BAD).exists()
    bad_blob = tmp_path / "hub-cache" / "models--tester--tiny-q2" / "blobs" / hashlib.sha256(
        (built / BAD).read_bytes()).hexdigest()
    assert not bad_blob.exists()  # removed, so the next pull fetches it again
    assert not list(tmp_path.rglob(MARKER_NAME)) and not list(tmp_path.glob("moepack-cache/verified/*.json"))
    # offline, the damaged copy is not served as a model
    off = run_calls([cli("pull", REPO)], hub_env(hub, tmp_path, offline=True))
    _clean(off[0], "incomplete")
    # once the hub serves the right bytes, pulling again repairs the copy
    hub.corrupt.clear()
    again = run_calls([cli("pull", REPO)], env)
    assert _path(_ok(again[0])) == snap and "verified" in again[0]["err"]
    _same_files(snap, built)


def test_damaged_download_into_a_local_dir(hub, built, tmp_path):
    hub.corrupt[(REPO, "config.json")] = b"{" + (built / "config.json").read_bytes()[1:].replace(b"4", b"5", 1)
    d = tmp_path / "dl"
    res = run_calls([cli("pull", REPO, "--local-dir", str(d))], hub_env(hub, tmp_path))
    _clean(res[0], "does not match its manifest", "config.json: checksum mismatch")
    assert not (d / MANIFEST_NAME).exists() and not (d / MARKER_NAME).exists() and not (d / "config.json").exists()
    assert (d / "packed_experts" / "layer_00.bin").exists()  # the good files stay: the next pull resumes
    hub.corrupt.clear()
    again = run_calls([cli("pull", REPO, "--local-dir", str(d))], hub_env(hub, tmp_path))
    assert _path(_ok(again[0])) == d.resolve()
    _same_files(d, built)


def test_bad_repos(hub, built, tmp_path):
    hub.add_repo("tester/plain-checkpoint", {"config.json": b"{}", "model.safetensors": b"\0" * 64})
    hub.add_repo("tester/secret", folder_files(built), private=True)
    env = hub_env(hub, tmp_path, token=None)
    res = run_calls([cli("pull", "tester/does-not-exist"), cli("pull", "tester/plain-checkpoint"),
                     cli("pull", "tester/secret"), cli("pull", "not a repo")], env)
    _clean(res[0], "hub repo tester/does-not-exist not found")
    assert "./tester/does-not-exist does not exist" in res[0]["err"]
    _clean(res[1], "hub repo tester/plain-checkpoint@", "has no moepack.json", "it is not a moepack packed model")
    _clean(res[2], "hub repo tester/secret not found (or it is private and no valid token was sent)")
    _clean(res[3], "'not a repo' is not a hub repo id")
    down = run_calls([cli("pull", REPO)], hub_env(None, tmp_path / "nohub"))  # nothing listens there
    _clean(down[0], "the hub cannot be reached and the repo is not in the hub cache")
    ok = run_calls([cli("pull", "tester/secret")], hub_env(hub, tmp_path))  # with the token it is found
    _ok(ok[0])
    assert hub.requests("GET", r"^/lfs-objects/") and not hub.rejected  # the token was not sent to the "CDN"


# -- in-process: the marker, resolve_packed on paths ------------------------------------------------------

@pytest.fixture
def local(built, tmp_path):
    return shutil.copytree(built, tmp_path / "copy")


def test_marker_skips_rechecks_until_a_file_changes(local, monkeypatch):
    from moepack import verify as verify_mod

    calls, real = [], verify_mod.verify

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(verify_mod, "verify", counting)  # ensure_verified imports it at call time
    r1 = ensure_verified(local, progress=False)
    r2 = ensure_verified(local, progress=False)
    assert r1.verified_now and not r2.verified_now and len(calls) == 1
    assert r2.checked_records == 32
    f = local / BAD
    st = f.stat()
    f.write_bytes(_flip(f.read_bytes()))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(CorruptFileError, match="layer_01.bin: 1 record") as e:
        ensure_verified(local, progress=False)
    assert "\n" not in e.value.message and e.value.hint
    assert len(calls) == 2 and not (local / MANIFEST_NAME).exists() and not (local / MARKER_NAME).exists()


def test_marker_falls_back_to_the_moepack_cache_for_read_only_folders(local, tmp_path, monkeypatch):
    import moepack.layout.atomic as atomic

    monkeypatch.setenv("MOEPACK_CACHE", str(tmp_path / "mcache"))
    real = atomic.write_json_atomic

    def refuse_in_folder(path, obj):
        if Path(path).parent == local:
            raise PermissionError(13, "read-only", str(path))
        return real(path, obj)

    monkeypatch.setattr(atomic, "write_json_atomic", refuse_in_folder)
    assert ensure_verified(local, progress=False).verified_now
    assert not (local / MARKER_NAME).exists() and len(list((tmp_path / "mcache" / "verified").glob("*.json"))) == 1
    assert not ensure_verified(local, progress=False).verified_now


def test_newer_format_is_not_taken_for_damage(local):
    from moepack.errors import PackedModelError

    m = json.loads((local / MANIFEST_NAME).read_text())
    m["format_version"] = 99
    (local / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(PackedModelError, match="newer than this moepack reads") as e:
        ensure_verified(local, repo_id=REPO, progress=False)
    assert "upgrade moepack" in e.value.hint
    assert (local / MANIFEST_NAME).exists() and not (local / MARKER_NAME).exists()  # nothing removed, not marked
    (local / MANIFEST_NAME).write_text('{"format": "moepack", "trunc')
    with pytest.raises(CorruptFileError, match="is not valid JSON"):
        ensure_verified(local, repo_id=REPO, progress=False)
    assert not (local / MANIFEST_NAME).exists()


def test_resolve_packed_paths(local, tmp_path):
    assert resolve_packed(local) == local and resolve_packed(str(local)) == local
    with pytest.raises(HubError, match="no such folder, and not a hub repo id"):
        resolve_packed(str(tmp_path / "nope" / "deeper" / "x"))

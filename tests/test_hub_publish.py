"""`moepack publish` against the loopback hub (tests/hub_server.py): what arrives, resume, refusals, dry run.

Each run is a fresh interpreter (huggingface_hub reads HF_ENDPOINT, HF_TOKEN, HF_HUB_DISABLE_XET... at import)
with a network guard that refuses anything but loopback.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil

import pytest

from hub_server import _clean, _ok, TOKEN, HubServer, cli, folder_files, hub_env, run_calls
from moepack.convert import convert
from moepack.layout.constants import MANIFEST_NAME
from moepack.testing.fixtures import write_mlx_checkpoint
from moepack.verify import verify

REPO = "tester/tiny-q2"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    src = write_mlx_checkpoint(root / "src", arch="qwen3_5_moe", bits=4, seed=0)
    convert(str(src), root / "packed", bits=2, progress=False)
    return root / "packed"


@pytest.fixture
def packed(built, tmp_path):
    return shutil.copytree(built, tmp_path / "packed")


@pytest.fixture
def hub():
    with HubServer(lifetime=120) as h:
        yield h




def _no_token_leak(results):
    for r in results:
        assert TOKEN not in r["out"] and TOKEN not in r["err"]


def _expected_repo(folder) -> dict[str, bytes]:
    files = folder_files(folder)
    assert "README.md" in files and MANIFEST_NAME in files
    return files


def _assert_repo_matches(hub, repo, folder, revision="main"):
    remote = hub.files(repo, revision)
    local = _expected_repo(folder)
    assert set(remote) == set(local) | {".gitattributes"}, set(remote) ^ set(local)
    for name, data in local.items():
        assert hashlib.sha256(remote[name]).hexdigest() == hashlib.sha256(data).hexdigest(), name
    assert not hub.rejected, hub.rejected
    assert not hub.unhandled, hub.unhandled


def _manifest_last(hub, repo):
    """The manifest and card arrive in the last commit, after every data file."""
    mine = [c for c in hub.commits if c["repo"] == repo]
    paths = [[op["path"] for op in c["ops"]] for c in mine]
    assert sorted(paths[-1]) == ["README.md", MANIFEST_NAME], paths
    assert all(MANIFEST_NAME not in p for p in paths[:-1])
    return mine


def test_publish_lfs_path_branch_and_message(hub, packed, tmp_path):
    env = hub_env(hub, tmp_path)  # HF_HUB_DISABLE_XET=1: preupload, LFS batch + PUT + verify, NDJSON commit
    res = run_calls([cli("publish", str(packed), REPO),
                     cli("publish", str(packed), REPO, "--revision", "v2", "--commit-message", "second try",
                         "--private")], env)
    _no_token_leak(res)
    _ok(res[0])
    assert f"{hub.url}/{REPO}" in res[0]["out"] and "moepack pull tester/tiny-q2" in res[0]["out"]
    assert (packed / "README.md").is_file() and verify(packed, progress=False).ok  # card written, still verifies
    _assert_repo_matches(hub, REPO, packed)
    commits = _manifest_last(hub, REPO)
    assert len(commits) == 2
    ops = {op["path"]: op for c in commits for op in c["ops"]}
    assert ops["packed_experts/layer_00.bin"]["op"] == "lfsFile" and ops["model.safetensors"]["op"] == "lfsFile"
    assert ops["config.json"]["op"] == "file"
    assert commits[0]["summary"].startswith("Upload qwen3_5_moe packed model (2-bit experts) with moepack")
    assert commits[1]["summary"] == commits[0]["summary"] + " (manifest and model card)"
    assert len(hub.lfs_puts) == len(set(hub.lfs_puts)) == 5  # 4 layer files + the dense safetensors
    assert hub.requests("POST", r"/lfs-verify/") and hub.requests("GET", r"^/api/whoami-v2$")
    assert not hub.repos[REPO].private

    # second run: a new branch from main; its files are main's, so nothing is stored or committed (no commit
    # for the message to go on) and no LFS object is sent again
    _ok(res[1])
    assert "--revision v2" in res[1]["out"] and "/tree/v2" in res[1]["out"]
    assert "note: tester/tiny-q2 already existed and is public: --private only applies" in res[1]["err"]
    assert hub.requests("POST", rf"/api/models/{REPO}/branch/v2")
    _assert_repo_matches(hub, REPO, packed, "v2")
    assert hub.head(REPO, "v2") == hub.head(REPO, "main")  # unchanged files: no new commit at all
    assert len(hub.lfs_puts) == 5


def test_publish_upload_folder_pipeline_with_hf_xet_installed(packed, tmp_path):
    if importlib.util.find_spec("hf_xet") is None:
        pytest.skip("hf_xet not installed: upload_folder takes the single-commit path")
    # With hf_xet, upload_folder runs its streamed multi-commit pipeline. The loopback hub has no Xet store, so
    # it answers every preupload with uploadMode "regular": files travel base64 in the NDJSON commit.
    with HubServer(upload_mode="regular") as hub:
        # the manifest + card commit is refused once: the re-run commits only that (data files are unchanged)
        hub.fail("POST", rf"^/api/models/{REPO}/commit/main$", skip=1, times=1, message="injected: try later")
        run = [cli("publish", str(packed), REPO, "--commit-message", "pipeline")]
        res = run_calls(run, hub_env(hub, tmp_path, xet=True))
        _clean(res[0], "uploading to tester/tiny-q2 failed", "injected: try later")
        assert MANIFEST_NAME not in hub.files(REPO) and "packed_experts/layer_03.bin" in hub.files(REPO)
        res = run_calls(run, hub_env(hub, tmp_path, xet=True))
        _ok(res[0])
        _assert_repo_matches(hub, REPO, packed)
        commits = _manifest_last(hub, REPO)
        assert [c["summary"] for c in commits] == ["pipeline", "pipeline (manifest and model card)"]
        assert all(op["op"] == "file" for c in commits for op in c["ops"])
        assert not hub.requests(path_regex=r"lfs|xet")


def test_interrupted_uploads_resume(hub, packed, tmp_path):
    layer2 = hashlib.sha256((packed / "packed_experts/layer_02.bin").read_bytes()).hexdigest()
    hub.fail("PUT", rf"^/lfs-upload/{REPO}/{layer2}$", status=400, message="injected: connection to storage lost")
    hub.fail("POST", rf"^/api/models/{REPO}/commit/main$", status=400, message="injected: commit refused")
    env = hub_env(hub, tmp_path)
    res = run_calls([cli("publish", str(packed), REPO)], env)
    # run 1: the PUT of layer_02 fails; the other objects may have been stored; nothing committed
    line = _clean(res[0], "uploading to tester/tiny-q2 failed", "layer_02.bin", "injected: connection to storage lost")
    assert "hint: re-run the same command: the upload resumes" in res[0]["err"], line
    after1 = list(hub.lfs_puts)
    assert layer2 not in after1 and not hub.commits
    # run 2: only what is missing is sent (layer_02 at least), then the data commit is refused
    res += run_calls([cli("publish", str(packed), REPO)], env)
    _clean(res[1], "uploading to tester/tiny-q2 failed", "injected: commit refused")
    after2 = hub.lfs_puts[len(after1):]
    assert layer2 in after2 and not set(after1) & set(after2)
    assert set(hub.lfs_puts) == {hashlib.sha256(d).hexdigest() for n, d in folder_files(packed).items()
                                 if n.endswith((".bin", ".safetensors"))}
    assert not hub.commits and set(hub.files(REPO)) == {".gitattributes"}  # nothing looks like a packed model
    # run 3: no object sent again, both commits land; the final content is right
    res += run_calls([cli("publish", str(packed), REPO)], env)
    _no_token_leak(res)
    _ok(res[2])
    assert len(hub.lfs_puts) == len(set(hub.lfs_puts)) == 5
    _assert_repo_matches(hub, REPO, packed)
    _manifest_last(hub, REPO)


def test_manifest_commit_interrupted_then_resumed(hub, packed, tmp_path):
    # the data commit goes through, the manifest + card commit is refused once
    hub.fail("POST", rf"^/api/models/{REPO}/commit/main$", skip=1, times=1, message="injected: manifest commit refused")
    env = hub_env(hub, tmp_path)
    res = run_calls([cli("publish", str(packed), REPO)], env)
    _clean(res[0], "injected: manifest commit refused")
    paths = set(hub.files(REPO))
    assert MANIFEST_NAME not in paths and "README.md" not in paths  # data only: not taken for a packed model
    assert "packed_experts/layer_00.bin" in paths
    res += run_calls([cli("publish", str(packed), REPO)], env)
    _ok(res[1])
    _assert_repo_matches(hub, REPO, packed)
    commits = [c for c in hub.commits if c["repo"] == REPO]
    assert len(commits) == 2  # the data commit is not repeated: unchanged files are skipped
    assert len(hub.lfs_puts) == 5


def test_refuses_a_folder_that_fails_verify(hub, packed, tmp_path):
    f = packed / "packed_experts/layer_01.bin"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    (packed / "tokenizer.json").unlink()
    res = run_calls([cli("publish", str(packed), REPO), cli("publish", str(packed), REPO, "--dry-run")],
                    hub_env(hub, tmp_path))
    for r in res:
        line = _clean(r, "fails `moepack verify` (2 problem(s))", "packed_experts/layer_01.bin",
                      "record(s) fail their checksum", "tokenizer.json: missing")
        assert "nothing was uploaded" in r["err"], line
    assert not (packed / "README.md").exists()  # no card written either
    assert [r[1] for r in hub.log] == ["/api/whoami-v2"]  # the token check, then nothing
    assert REPO not in hub.repos


def test_token_missing_rejected_or_from_saved_login(hub, packed, tmp_path):
    no_token = run_calls([cli("publish", str(packed), REPO)], hub_env(hub, tmp_path, token=None))
    line = _clean(no_token[0], "not logged in to the Hugging Face hub")
    assert "hint: log in with `hf auth login` (or set HF_TOKEN" in no_token[0]["err"], line
    assert not hub.log  # nothing was sent

    bad = run_calls([cli("publish", str(packed), REPO)], hub_env(hub, tmp_path, token="hf_wrongToken123456"))
    _clean(bad[0], "the hub rejected your token (from HF_TOKEN)")
    assert "hf_wrongToken123456" not in bad[0]["err"] + bad[0]["out"]
    assert [r[1:] for r in hub.log] == [("/api/whoami-v2", 401)]

    # the hub's saved login (what `hf auth login` writes) is found the same way
    home = tmp_path / "login"
    (home / "hf-home").mkdir(parents=True)
    (home / "hf-home" / "token").write_text(TOKEN)
    env = hub_env(hub, home, token=None)
    res = run_calls([cli("publish", str(packed), REPO, "--dry-run"), cli("publish", str(packed), REPO, "--private")],
                    env)
    _no_token_leak(res)
    _ok(res[0])
    assert "token     found (the saved login (`hf auth login`))" in res[0]["out"]
    _ok(res[1])
    assert hub.repos[REPO].private
    _assert_repo_matches(hub, REPO, packed)


def test_dry_run_lists_files_and_card_uploads_nothing(hub, packed, tmp_path):
    # a packed model whose source is a hub repo: base_model, and the license read from the source's card
    src_commit = hub.add_repo("src-org/tiny-moe-4bit",
                              {"README.md": b"---\nlicense: apache-2.0\nlanguage: [en]\n---\n# Tiny MoE\n",
                               "config.json": b"{}"})
    m = json.loads((packed / MANIFEST_NAME).read_text())
    m["source"] = {"type": "hub", "repo_id": "src-org/tiny-moe-4bit", "revision": src_commit}
    (packed / MANIFEST_NAME).write_text(json.dumps(m, indent=1))
    before = folder_files(packed)
    res = run_calls([cli("publish", str(packed), REPO, "--dry-run", "--revision", "exp", "--private")],
                    hub_env(hub, tmp_path, token=None))
    out = _ok(res[0])["out"]
    assert out.startswith("dry run: nothing is uploaded and nothing is written")
    assert "repo      tester/tiny-q2 (branch exp; if created: private)" in out
    assert "token     none: run `hf auth login`" in out
    for name, data in before.items():  # every file with its size
        assert any(line.split() == [f"{len(data):,}", name] for line in out.splitlines()), name
    assert "license   apache-2.0" in out
    card = out.split("--- README.md ", 1)[1]
    assert "library_name: moepack" in card and "base_model: src-org/tiny-moe-4bit" in card
    assert "license: apache-2.0" in card and "moepack run tester/tiny-q2" in card
    assert "| layer | bits | gate | up | down | max abs error |" in card
    assert folder_files(packed) == before and not (packed / "README.md").exists()
    # only reads of the source's card; no write endpoint was called
    assert {path for _, path, _ in hub.log} <= {"/api/models/src-org/tiny-moe-4bit/revision/" + src_commit,
                                                 f"/src-org/tiny-moe-4bit/resolve/{src_commit}/README.md"}
    assert REPO not in hub.repos and not hub.rejected


def test_namespace_and_repo_id_errors(hub, packed, tmp_path):
    res = run_calls([cli("publish", str(packed), "someone-else/tiny"), cli("publish", str(packed), "no-namespace"),
                     cli("publish", str(tmp_path / "missing"), REPO)], hub_env(hub, tmp_path))
    _no_token_leak(res)
    _clean(res[0], "creating hub repo someone-else/tiny", "may not write to someone-else")
    _clean(res[1], "'no-namespace' is not a hub repo id of the form namespace/name")
    _clean(res[2], "is not a folder")
    assert not hub.rejected
    with HubServer(token_role="read") as ro:
        read_only = run_calls([cli("publish", str(packed), REPO)], hub_env(ro, tmp_path))
        _clean(read_only[0], "your token (from HF_TOKEN) is read-only")
        assert [p for _, p, _ in ro.log] == ["/api/whoami-v2"]
    down = run_calls([cli("publish", str(packed), REPO)], hub_env(None, tmp_path))  # nothing listens there
    _clean(down[0], "checking your token: cannot reach the hub at http://127.0.0.1:9")

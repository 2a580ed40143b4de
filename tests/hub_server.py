"""A loopback stand-in for the Hugging Face hub HTTP API, for tests. It never talks to the real hub.

It speaks the calls huggingface_hub 2.4 makes for what moepack does (see docs/hub.md for the list):

* ``GET  /api/whoami-v2``                               token check
* ``POST /api/repos/create``                            create_repo (409 when it exists)
* ``POST /api/models/{repo}/branch/{branch}``           create_branch (409 when it exists)
* ``POST /api/validate-yaml``                           README.md front matter check (upload_folder / create_commit)
* ``POST /api/models/{repo}/preupload/{rev}``           upload mode per file (regular / lfs) and the remote oid
* ``POST /{repo}.git/info/lfs/objects/batch``           LFS batch: an upload + verify action per missing object
* ``PUT  /lfs-upload/{repo}/{sha256}``                  LFS object upload (sha256 and size checked; per repo)
* ``POST /lfs-verify/{repo}``                           LFS verify action
* ``POST /api/models/{repo}/commit/{rev}``              NDJSON commit (strictly validated)
* ``GET  /api/models/{repo}[/revision/{rev}]``          repo_info (snapshot_download resolves the commit)
* ``GET  /api/models/{repo}/tree/{rev}[/{path}]``       list_repo_tree (snapshot_download's file list)
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``             file metadata and content (Range supported); LFS files
  answer with a 302 to a "CDN" on another origin (``localhost`` instead of ``127.0.0.1``), as the hub does
* ``HEAD|GET /lfs-objects/{sha256}``                    that CDN
* ``GET  /api/agent-harnesses``                         fetched by huggingface_hub when it builds headers: 404

There is no Xet endpoint: the server never announces Xet storage (no ``X-Xet-*`` headers, no ``xetHash`` in trees).
Uploads take the LFS path when the client runs with ``HF_HUB_DISABLE_XET=1``; with hf_xet installed, use
``upload_mode="regular"`` so every file travels base64-encoded inside the commit (the streamed multi-commit
pipeline of ``upload_folder`` without its Xet data path).

Everything that arrives is recorded (``log``, ``commits``, ``lfs_puts``, ``rejected``, ``unhandled``). Failures can be
injected (``fail``) and downloads corrupted (``corrupt``). The server binds 127.0.0.1 on a random port, serves
each request on its own thread, refuses bodies above ``max_body`` and shuts itself down after ``lifetime`` seconds.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

TOKEN = "hf_loopbackTestToken0123456789abcdef"
USER = "tester"
GITATTRIBUTES = b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
LFS_SUFFIXES = (".bin", ".safetensors", ".gguf", ".npy")
LFS_SIZE = 10 * 1024 * 1024
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_REPO = r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+)"


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class _File:
    kind: str  # "regular" | "lfs"
    data: bytes | None  # regular files only
    sha256: str
    size: int

    @property
    def oid(self) -> str:  # what the tree and preupload report
        return git_blob_oid(self.data) if self.kind == "regular" else self.sha256


@dataclass
class _Commit:
    oid: str
    parent: str | None
    files: dict[str, _File]
    summary: str
    description: str = ""


@dataclass
class _Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)

    def resolve(self, rev: str) -> _Commit | None:
        if rev in self.branches:
            return self.commits[self.branches[rev]]
        return self.commits.get(rev) if _HEX40.match(rev) else None


@dataclass
class _Failure:
    method: str
    pattern: re.Pattern
    status: int
    times: int
    message: str
    skip: int = 0  # matching requests let through before the failures start
    hits: int = 0


class _Reply(Exception):
    def __init__(self, status: int, body=None, headers: dict | None = None, error_code: str | None = None):
        self.status, self.body, self.headers, self.error_code = status, body, dict(headers or {}), error_code


class HubServer:
    """The fake hub. ``with HubServer() as hub: ... hub.url`` or ``start()`` / ``stop()``."""

    def __init__(self, *, token: str = TOKEN, user: str = USER, orgs: tuple[str, ...] = ("test-org",),
                 upload_mode: str = "auto", lifetime: float = 120.0, max_body: int = 64 << 20,
                 cdn_host: str = "localhost", token_role: str = "write"):
        assert upload_mode in ("auto", "regular", "lfs")
        self.token, self.user, self.orgs = token, user, tuple(orgs)
        self.upload_mode, self.lifetime, self.max_body, self.cdn_host = upload_mode, lifetime, max_body, cdn_host
        self.token_role = token_role  # what whoami says the token may do: "write" or "read"
        self.lock = threading.RLock()
        self.repos: dict[str, _Repo] = {}
        self.lfs: dict[tuple[str, str], bytes] = {}  # (repo_id, sha256) -> content: LFS storage is per repo
        self.log: list[tuple[str, str, int]] = []  # (method, path, status) of every request
        self.commits: list[dict] = []  # accepted commits, as parsed
        self.lfs_puts: list[str] = []  # sha256 of every accepted LFS object upload
        self.rejected: list[str] = []  # why a malformed request was refused
        self.unhandled: list[str] = []  # requests no route matched
        self.corrupt: dict[tuple[str, str], bytes] = {}  # (repo_id, path) -> bytes served instead of the real ones
        self._failures: list[_Failure] = []
        self._counter = itertools.count(1)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "HubServer":
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="hub-server", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.lifetime, self.stop)  # bounded: stops by itself
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- test helpers ---------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes], *, private: bool = False,
                 summary: str = "initial upload") -> str:
        """Create a repo holding ``files`` (LFS for weights, as the hub decides); returns the commit oid."""
        with self.lock:
            repo = self._new_repo(repo_id, private)
            head = repo.commits[repo.branches["main"]]
            new = dict(head.files)
            for path, data in files.items():
                new[path] = self._store(repo_id, path, data)
            return self._commit(repo, "main", new, summary)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The content of a repo at ``revision``: path -> bytes."""
        with self.lock:
            c = self.repos[repo_id].resolve(revision)
            return {p: self._content(repo_id, f) for p, f in c.files.items()}

    def head(self, repo_id: str, revision: str = "main") -> str:
        with self.lock:
            return self.repos[repo_id].resolve(revision).oid

    def fail(self, method: str, path_regex: str, *, status: int = 400, times: int = 1, skip: int = 0,
             message: str = "injected failure") -> None:
        """After letting ``skip`` of them through, answer the next ``times`` requests matching ``method`` and
        ``path_regex`` with ``status`` (400 by default: huggingface_hub retries 429/5xx by itself)."""
        with self.lock:
            self._failures.append(_Failure(method.upper(), re.compile(path_regex), status, times, message, skip))

    def requests(self, method: str | None = None, path_regex: str | None = None) -> list[tuple[str, str, int]]:
        with self.lock:
            return [r for r in self.log if (method is None or r[0] == method)
                    and (path_regex is None or re.search(path_regex, r[1]))]

    # -- state (call with the lock held) -------------------------------------------------------------
    def _new_repo(self, repo_id: str, private: bool) -> _Repo:
        repo = _Repo(repo_id, private)
        self.repos[repo_id] = repo
        root = _Commit(self._oid("root", repo_id), None, {".gitattributes": self._regular(GITATTRIBUTES)},
                       "initial commit")
        repo.commits[root.oid] = root
        repo.branches["main"] = root.oid
        return repo

    def _oid(self, *parts) -> str:
        return hashlib.sha1(("\0".join(map(str, parts)) + f"\0{next(self._counter)}").encode()).hexdigest()

    @staticmethod
    def _regular(data: bytes) -> _File:
        return _File("regular", data, hashlib.sha256(data).hexdigest(), len(data))

    def _store(self, repo_id: str, path: str, data: bytes) -> _File:
        if self._mode(path, len(data), data[:512]) == "lfs":
            sha = hashlib.sha256(data).hexdigest()
            self.lfs[(repo_id, sha)] = data
            return _File("lfs", None, sha, len(data))
        return self._regular(data)

    def _content(self, repo_id: str, f: _File) -> bytes:
        return f.data if f.kind == "regular" else self.lfs[(repo_id, f.sha256)]

    def _mode(self, path: str, size: int, sample: bytes) -> str:
        if self.upload_mode != "auto":
            return self.upload_mode
        if path.endswith(LFS_SUFFIXES) or size >= LFS_SIZE or b"\0" in sample:
            return "lfs"
        return "regular"

    def _commit(self, repo: _Repo, branch: str, files: dict[str, _File], summary: str, description: str = "") -> str:
        parent = repo.branches[branch]
        c = _Commit(self._oid(repo.repo_id, parent, summary), parent, files, summary, description)
        repo.commits[c.oid] = c
        repo.branches[branch] = c.oid
        return c.oid


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_hub: HubServer

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing -------------------------------------------------------------------------------------
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _read_body(self) -> bytes:
        hub = self.server_hub
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                if len(out) + size > hub.max_body:
                    raise _Reply(413, {"error": "body too large"})
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        if n > hub.max_body:
            self.close_connection = True
            raise _Reply(413, {"error": "body too large"})
        return self.rfile.read(n) if n else b""

    def _dispatch(self, method: str) -> None:
        hub = self.server_hub
        parts = urlsplit(self.path)
        path, query = parts.path, parse_qs(parts.query)
        status = 500
        try:
            body = self._read_body() if method in ("POST", "PUT") else b""
            with hub.lock:
                for f in hub._failures:
                    if f.method == method and f.hits < f.skip + f.times and f.pattern.search(path):
                        f.hits += 1
                        if f.hits > f.skip:
                            raise _Reply(f.status, {"error": f.message})
            for m, rx, fn in _ROUTES:
                if m == method or (m == "GET" and method == "HEAD" and fn in _HEAD_OK):
                    match = rx.match(path)
                    if match:
                        fn(self, method, query, body, **{k: unquote(v) if v is not None else None
                                                       for k, v in match.groupdict().items()})
                        return
            with hub.lock:
                hub.unhandled.append(f"{method} {self.path}")
            raise _Reply(404, {"error": f"no such endpoint: {method} {path}"})
        except _Reply as r:
            status = r.status
            if r.status == 413:
                self.close_connection = True
            self._send(r.status, r.body, r.headers, r.error_code, head=method == "HEAD")
        except Exception as e:  # a bug in this server: say so instead of leaving the client hanging
            with hub.lock:
                hub.rejected.append(f"{method} {self.path}: server error {type(e).__name__}: {e}")
            self.close_connection = True
            self._send(500, {"error": f"test server bug: {e}"}, head=method == "HEAD")
        finally:
            with hub.lock:
                hub.log.append((method, path, getattr(self, "_status", status)))

    def _send(self, status: int, body=None, headers: dict | None = None, error_code: str | None = None,
              head: bool = False, content_type: str | None = None) -> None:
        self._status = status
        if isinstance(body, (dict, list)):
            data, ctype = json.dumps(body).encode(), content_type or "application/json"
        else:
            data, ctype = (body or b""), content_type or "application/octet-stream"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
        if status >= 400 and isinstance(body, dict) and "error" in body:
            self.send_header("X-Error-Message", str(body["error"])[:200])
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head and data:
            self.wfile.write(data)

    # -- auth helpers ---------------------------------------------------------------------------------
    def _authed(self) -> bool:
        return self.headers.get("Authorization", "") == f"Bearer {self.server_hub.token}"

    def _require_auth(self) -> None:
        if not self._authed():
            raise _Reply(401, {"error": "Invalid credentials in Authorization header"})

    def _can_write(self, namespace: str) -> bool:
        hub = self.server_hub
        return namespace == hub.user or namespace in hub.orgs

    def _repo(self, repo_id: str, *, write: bool = False) -> _Repo:
        hub = self.server_hub
        if write:
            self._require_auth()
        repo = hub.repos.get(repo_id)
        if repo is None or (repo.private and not self._authed()):
            raise _Reply(404, {"error": "Repository not found"}, error_code="RepoNotFound")
        if write and not self._can_write(repo_id.split("/")[0]):
            raise _Reply(403, {"error": f"You don't have the rights to write to {repo_id}"})
        return repo

    def _rev(self, repo: _Repo, rev: str) -> _Commit:
        c = repo.resolve(rev)
        if c is None:
            raise _Reply(404, {"error": f"Invalid rev id: {rev}"}, error_code="RevisionNotFound")
        return c

    def _json(self, body: bytes) -> dict:
        try:
            d = json.loads(body or b"{}")
        except ValueError:
            self._reject("request body is not JSON")
        if not isinstance(d, dict):
            self._reject("request body is not a JSON object")
        return d

    def _reject(self, why: str, status: int = 400):
        with self.server_hub.lock:
            self.server_hub.rejected.append(f"{self.command} {self.path}: {why}")
        raise _Reply(status, {"error": why})

    # -- endpoints ------------------------------------------------------------------------------------
    def whoami(self, method, query, body):
        self._require_auth()
        hub = self.server_hub
        self._send(200, {"type": "user", "name": hub.user, "fullname": "Test User",
                         "orgs": [{"type": "org", "name": o} for o in hub.orgs],
                         "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": hub.token_role}}})

    def create_repo(self, method, query, body):
        self._require_auth()
        hub = self.server_hub
        d = self._json(body)
        name, org = d.get("name"), d.get("organization") or hub.user
        if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
            self._reject(f"invalid repo name {name!r}")
        if d.get("type") not in (None, "model"):
            self._reject(f"this server only hosts model repos, not {d.get('type')!r}")
        repo_id = f"{org}/{name}"
        if not self._can_write(org):
            raise _Reply(403, {"error": f"You don't have the rights to create a model under the namespace {org}"})
        with hub.lock:
            if repo_id in hub.repos:
                raise _Reply(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
            private = d.get("visibility") == "private" or d.get("private") is True
            hub._new_repo(repo_id, private)
        self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def create_branch(self, method, query, body, repo, branch):
        hub = self.server_hub
        with hub.lock:
            r = self._repo(repo, write=True)
            d = self._json(body)
            if branch in r.branches:
                raise _Reply(409, {"error": f"Reference refs/heads/{branch} already exists"})
            start = self._rev(r, d.get("startingPoint") or "main")
            r.branches[branch] = start.oid
        self._send(200, {})

    def validate_yaml(self, method, query, body):
        d = self._json(body)
        content = d.get("content")
        if not isinstance(content, str):
            self._reject("validate-yaml: no content")
        if content.startswith("---"):
            end = content.find("\n---", 3)
            try:
                meta = yaml.safe_load(content[3:end]) if end > 0 else None
                if end < 0 or not isinstance(meta, dict):
                    raise ValueError("front matter is not a mapping")
            except (yaml.YAMLError, ValueError) as e:
                with self.server_hub.lock:
                    self.server_hub.rejected.append(f"validate-yaml: {e}")
                raise _Reply(400, {"errors": [{"message": f"invalid YAML: {e}"}], "error": "invalid metadata"})
        self._send(200, {"errors": [], "warnings": []})

    def preupload(self, method, query, body, repo, rev):
        hub = self.server_hub
        d = self._json(body)
        files = d.get("files")
        if not isinstance(files, list) or not files:
            self._reject("preupload: 'files' must be a non-empty list")
        with hub.lock:
            r = self._repo(repo, write=True)
            head = self._rev(r, rev)
            out = []
            for f in files:
                if not (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
                        and isinstance(f.get("sample"), str)):
                    self._reject(f"preupload: malformed file entry {f!r}")
                sample = base64.b64decode(f["sample"])
                existing = head.files.get(f["path"])
                out.append({"path": f["path"], "uploadMode": hub._mode(f["path"], f["size"], sample),
                            "shouldIgnore": False, "oid": existing.oid if existing else None})
        self._send(200, {"files": out, "commitOid": head.oid})

    def lfs_batch(self, method, query, body, repo):
        hub = self.server_hub
        d = self._json(body)
        if d.get("operation") != "upload" or not isinstance(d.get("objects"), list):
            self._reject("lfs batch: only operation=upload with a list of objects")
        if d.get("hash_algo", "sha256") != "sha256":
            self._reject("lfs batch: hash_algo must be sha256")
        with hub.lock:
            self._repo(repo, write=True)
            objects = []
            for o in d["objects"]:
                oid, size = o.get("oid"), o.get("size")
                if not (isinstance(oid, str) and _HEX64.match(oid) and isinstance(size, int) and size >= 0):
                    self._reject(f"lfs batch: malformed object {o!r}")
                if (repo, oid) in hub.lfs:  # already stored: no action, the client skips it (this is what resumes)
                    objects.append({"oid": oid, "size": size})
                else:
                    objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                        "upload": {"href": f"{hub.url}/lfs-upload/{repo}/{oid}?size={size}"},
                        "verify": {"href": f"{hub.url}/lfs-verify/{repo}"}}})
        self._send(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def lfs_upload(self, method, query, body, repo, oid):
        hub = self.server_hub
        want = int(query.get("size", ["-1"])[0])
        if len(body) != want:
            self._reject(f"lfs upload {oid}: {len(body)} bytes, announced {want}")
        if hashlib.sha256(body).hexdigest() != oid:
            self._reject(f"lfs upload {oid}: content does not hash to its oid")
        with hub.lock:
            hub.lfs[(repo, oid)] = body
            hub.lfs_puts.append(oid)
        self._send(200, b"")

    def lfs_verify(self, method, query, body, repo):
        hub = self.server_hub
        d = self._json(body)
        with hub.lock:
            data = hub.lfs.get((repo, d.get("oid")))
        if data is None or len(data) != d.get("size"):
            self._reject(f"lfs verify: object {d.get('oid')} not stored with size {d.get('size')}", 404)
        self._send(200, {})

    def commit(self, method, query, body, repo, rev):
        hub = self.server_hub
        if query.get("create_pr"):
            self._reject("commit: pull requests are not supported by this server")
        if not (self.headers.get("Content-Type") or "").startswith("application/x-ndjson"):
            self._reject("commit: Content-Type must be application/x-ndjson")
        try:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        except (UnicodeDecodeError, ValueError) as e:
            self._reject(f"commit: not NDJSON ({e})")
        if not lines or not isinstance(lines[0], dict) or lines[0].get("key") != "header":
            self._reject("commit: the first line must be the header")
        header = lines[0].get("value")
        if not (isinstance(header, dict) and isinstance(header.get("summary"), str) and header["summary"].strip()
                and isinstance(header.get("description", ""), str)):
            self._reject("commit: header needs a non-empty summary and a string description")
        if len(lines) < 2:
            self._reject("commit: no operations")
        with hub.lock:
            r = self._repo(repo, write=True)
            if rev not in r.branches:
                raise _Reply(404, {"error": f"Invalid rev id: {rev}"}, error_code="RevisionNotFound")
            head = r.commits[r.branches[rev]]
            parent = header.get("parentCommit")
            if parent is not None and parent != head.oid:
                raise _Reply(412, {"error": "A commit has happened since. Please refresh and try again."})
            files = dict(head.files)
            ops, seen = [], set()
            for line in lines[1:]:
                key, v = (line.get("key"), line.get("value")) if isinstance(line, dict) else (None, None)
                path = v.get("path") if isinstance(v, dict) else None
                if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
                    self._reject(f"commit: operation {line!r} has no valid path")
                if path in seen:
                    self._reject(f"commit: {path} appears twice")
                seen.add(path)
                if key == "file":
                    if v.get("encoding") != "base64" or not isinstance(v.get("content"), str):
                        self._reject(f"commit: file {path} must carry base64 content")
                    try:
                        data = base64.b64decode(v["content"], validate=True)
                    except ValueError:
                        self._reject(f"commit: file {path} content is not valid base64")
                    files[path] = hub._regular(data)
                    ops.append({"op": "file", "path": path, "size": len(data)})
                elif key == "lfsFile":
                    oid, size = v.get("oid"), v.get("size")
                    if v.get("algo") != "sha256" or not isinstance(oid, str) or not _HEX64.match(oid):
                        self._reject(f"commit: lfsFile {path} needs algo sha256 and a sha256 oid")
                    stored = hub.lfs.get((repo, oid))
                    if stored is None:
                        self._reject(f"commit: lfsFile {path} refers to LFS object {oid} that was never uploaded", 422)
                    if size is not None and size != len(stored):
                        self._reject(f"commit: lfsFile {path} size {size} != uploaded {len(stored)}")
                    files[path] = _File("lfs", None, oid, len(stored))
                    ops.append({"op": "lfsFile", "path": path, "size": len(stored), "oid": oid})
                elif key == "deletedFile":
                    if path not in files:
                        self._reject(f"commit: deletedFile {path}: A file with this name doesn't exist", 404)
                    del files[path]
                    ops.append({"op": "deletedFile", "path": path})
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    for p in [p for p in files if p.startswith(prefix)]:
                        del files[p]
                    ops.append({"op": "deletedFolder", "path": path})
                else:
                    self._reject(f"commit: unknown operation key {key!r}")
            oid = hub._commit(r, rev, files, header["summary"], header.get("description", ""))
            hub.commits.append({"repo": repo, "revision": rev, "oid": oid, "summary": header["summary"],
                                "description": header.get("description", ""), "parent": parent, "ops": ops})
        self._send(200, {"success": True, "commitOid": oid, "commitUrl": f"{hub.url}/{repo}/commit/{oid}",
                         "hookOutput": ""})

    def repo_info(self, method, query, body, repo, rev=None):
        hub = self.server_hub
        with hub.lock:
            r = self._repo(repo)
            c = self._rev(r, rev or "main")
            self._send(200, {"id": repo, "modelId": repo, "author": repo.split("/")[0], "sha": c.oid,
                             "private": r.private, "disabled": False, "gated": False, "downloads": 0, "likes": 0,
                             "tags": [], "lastModified": "2026-01-01T00:00:00.000Z",
                             "siblings": [{"rfilename": p} for p in sorted(c.files)]})

    def tree(self, method, query, body, repo, rev, path=None):
        hub = self.server_hub
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = (path or "").strip("/")
        with hub.lock:
            c = self._rev(self._repo(repo), rev)
            entries, dirs = [], set()
            for p, f in sorted(c.files.items()):
                if prefix and not p.startswith(prefix + "/"):
                    continue
                rel = p[len(prefix) + 1:] if prefix else p
                parts = rel.split("/")
                for i in range(1, len(parts)):
                    dirs.add("/".join(([prefix] if prefix else []) + parts[:i]))
                if not recursive and len(parts) > 1:
                    continue
                e = {"type": "file", "path": p, "size": f.size}
                if f.kind == "lfs":
                    ptr = lfs_pointer(f.sha256, f.size)
                    e.update(oid=git_blob_oid(ptr), lfs={"oid": f.sha256, "size": f.size, "pointerSize": len(ptr)})
                else:
                    e["oid"] = git_blob_oid(f.data)
                entries.append(e)
            for d in sorted(dirs):
                depth = d.count("/") - (prefix.count("/") + 1 if prefix else 0)
                if recursive or depth == 0:
                    entries.append({"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()})
        self._send(200, entries)

    def resolve(self, method, query, body, repo, rev, path):
        hub = self.server_hub
        with hub.lock:
            r = self._repo(repo)
            c = self._rev(r, rev)
            f = c.files.get(path)
            if f is None:
                raise _Reply(404, {"error": f"Entry not found: {path}"}, {"X-Repo-Commit": c.oid},
                             error_code="EntryNotFound")
            common = {"X-Repo-Commit": c.oid}
            if f.kind == "lfs":  # the hub redirects LFS files to its CDN, another origin
                cdn = f"http://{hub.cdn_host}:{hub.port}/lfs-objects/{f.sha256}?repo={quote(repo)}&path={quote(path)}"
                raise _Reply(302, b"", {**common, "Location": cdn, "ETag": f'"{f.oid}"',
                                        "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
            data = hub.corrupt.get((repo, path), f.data)
        self._serve_bytes(method, data, {**common, "ETag": f'"{f.oid}"'})

    def cdn(self, method, query, body, oid):
        hub = self.server_hub
        repo, path = query.get("repo", [""])[0], query.get("path", [""])[0]
        if self.headers.get("Authorization"):
            self._reject("cdn: the client sent its hub token to the CDN")
        with hub.lock:
            data = hub.lfs.get((repo, oid))
            if data is None:
                raise _Reply(404, {"error": "no such object"})
            data = hub.corrupt.get((repo, path), data)
        self._serve_bytes(method, data, {"ETag": f'"{oid}"'})

    def _serve_bytes(self, method: str, data: bytes, headers: dict) -> None:
        rng = self.headers.get("Range")
        m = re.match(r"^bytes=(\d+)-(\d*)$", rng or "")
        if m:
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(data) - 1
            part = data[start:end + 1]
            headers = {**headers, "Content-Range": f"bytes {start}-{start + len(part) - 1}/{len(data)}",
                       "Accept-Ranges": "bytes"}
            self._send(206, part, headers, head=method == "HEAD")
        else:
            self._send(200, data, {**headers, "Accept-Ranges": "bytes"}, head=method == "HEAD")

    def agent_harnesses(self, method, query, body):
        raise _Reply(404, {"error": "not served here"})


_ROUTES = [
    ("GET", re.compile(r"^/api/whoami-v2$"), _Handler.whoami),
    ("GET", re.compile(r"^/api/agent-harnesses$"), _Handler.agent_harnesses),
    ("POST", re.compile(r"^/api/repos/create$"), _Handler.create_repo),
    ("POST", re.compile(r"^/api/validate-yaml$"), _Handler.validate_yaml),
    ("POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<branch>[^/]+)$"), _Handler.create_branch),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), _Handler.preupload),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), _Handler.commit),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$"), _Handler.lfs_batch),
    ("PUT", re.compile(rf"^/lfs-upload/{_REPO}/(?P<oid>[0-9a-f]{{64}})$"), _Handler.lfs_upload),
    ("POST", re.compile(rf"^/lfs-verify/{_REPO}$"), _Handler.lfs_verify),
    ("GET", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$"), _Handler.repo_info),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), _Handler.tree),
    ("GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), _Handler.resolve),
    ("GET", re.compile(r"^/lfs-objects/(?P<oid>[0-9a-f]{64})$"), _Handler.cdn),
]
_HEAD_OK = {_Handler.resolve, _Handler.cdn}


# -- running the CLI against the server --------------------------------------------------------------------
# huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE, HF_TOKEN... at import, so every run is a fresh interpreter. It
# installs a network guard first: name lookups and connections to anything but loopback fail, so no test can
# reach the real hub even if an endpoint were misconfigured.

REPO_ROOT = Path(__file__).resolve().parents[1]

_RUNNER = r"""
import contextlib, io, json, socket, sys, traceback

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
_getaddrinfo = socket.getaddrinfo
def _guarded_getaddrinfo(host, *args, **kwargs):
    h = host.decode() if isinstance(host, bytes) else host
    if h not in _LOOPBACK:
        raise socket.gaierror(f"test network guard: {h!r} is not loopback")
    return _getaddrinfo(host, *args, **kwargs)
socket.getaddrinfo = _guarded_getaddrinfo
_connect = socket.socket.connect
def _guarded_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOOPBACK:
        raise OSError(f"test network guard: connect to {address[0]!r} refused")
    return _connect(self, address)
socket.socket.connect = _guarded_connect

calls = json.loads(sys.argv[1])
results = []
for call in calls:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if call[0] == "cli":
                from moepack.cli import main
                code, value = main(call[1]), None
            else:  # ["py", module, function, args, kwargs]: call a function, return str(result)
                import importlib
                fn = getattr(importlib.import_module(call[1]), call[2])
                value, code = str(fn(*call[3], **call[4])), 0
        except SystemExit as e:
            code, value = e.code, None
        except BaseException as e:
            traceback.print_exc()
            code, value = "exception: " + type(e).__name__ + ": " + str(e), None
    results.append({"call": call, "code": code, "value": value, "out": out.getvalue(), "err": err.getvalue()})
print("@@RESULTS@@" + json.dumps(results))
"""


def hub_env(hub: "HubServer | None", home, *, token: str | None = TOKEN, xet: bool = False, offline: bool = False,
            **extra: str) -> dict:
    """Environment for a run: endpoint on the loopback server, caches and HF_HOME under ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "MOEPACK_"))}
    env.update(
        HF_ENDPOINT=hub.url if hub is not None else "http://127.0.0.1:9",  # discard port: refused at once
        HF_HOME=str(home / "hf-home"),
        HF_HUB_CACHE=str(home / "hub-cache"),
        MOEPACK_CACHE=str(home / "moepack-cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    if token:
        env["HF_TOKEN"] = token
    if not xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def run_calls(calls: list, env: dict, *, timeout: float = 90) -> list[dict]:
    """Run ``calls`` (``["cli", argv]`` or ``["py", module, function, args, kwargs]``) in one fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(calls)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO_ROOT))
    marker = "@@RESULTS@@"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(marker)), None)
    assert proc.returncode == 0 and line is not None, f"runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(line[len(marker):])


def cli(*argv: str) -> list:
    return ["cli", list(argv)]


def folder_files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (relative posix path -> bytes), hidden files and folders excluded."""
    folder = Path(folder)
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            out[rel.as_posix()] = p.read_bytes()
    return out


def _ok(r):
    """A successful CLI run (see `cli`): exit 0, no traceback."""
    assert r["code"] == 0, r
    assert "Traceback" not in r["err"]
    return r


def _clean(r, *words):
    """A failed run: non-zero, one `error:` line and a `hint:` line, no traceback, the words present."""
    assert r["code"] not in (0, None) and not str(r["code"]).startswith("exception"), r
    assert "Traceback" not in r["err"], r["err"]
    lines = [ln for ln in r["err"].splitlines() if ln.startswith(("error: ", "hint: "))]
    assert [ln.split(":")[0] for ln in lines] == ["error", "hint"], r["err"]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]

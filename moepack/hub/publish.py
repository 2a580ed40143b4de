"""``moepack publish PACKED REPO_ID``: verify, write the model card, create the repo, upload (resumably).

Order of work, cheapest failure first: repo id, token (``HF_TOKEN`` or the hub's saved login; never printed),
``whoami`` (a rejected or read-only token fails before anything is hashed), ``moepack verify`` of the folder (a
folder with any problem is refused, the problems named), the model card written into the folder, ``create_repo``
(``exist_ok``), the branch when ``--revision`` names one that does not exist yet, then two commits:

1. the data: ``packed_experts/*.bin``, the dense safetensors, config / tokenizer files (everything the manifest
   lists);
2. ``moepack.json`` and ``README.md``.

The manifest goes last for the reason the format spec gives (a folder without ``moepack.json`` is not a packed
model; writers write it last): an upload interrupted at any point leaves a repo that no reader takes for a complete
packed model, and ``moepack pull`` verifies whatever it gets anyway.

Upload API choice (huggingface_hub 2.4). ``HfApi.upload_large_folder`` is gone in 2.4: its job -- resumable,
multi-commit uploads of big folders -- moved into ``HfApi.upload_folder``. With ``hf_xet`` installed (a default
dependency of huggingface_hub 2.4 on x86_64 / arm64) ``upload_folder`` streams the files through the Xet protocol,
commits in adaptive batches and resumes when re-run: files already committed are skipped (the preupload call
returns their remote oid) and chunks already uploaded are deduplicated by the Xet store. Unlike
``upload_large_folder`` (which in 0.2x took no commit message) it takes ``revision`` (our ``--revision`` branch)
and ``commit_message``. Without ``hf_xet`` (or with ``HF_HUB_DISABLE_XET=1``) ``upload_folder`` makes a single
``create_commit`` with LFS uploads; re-running it skips every LFS object the hub already holds (the LFS batch
answer carries no upload action for them), so an interrupted upload resumes at file granularity. The tests run
both paths against a loopback server; see docs/hub.md.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import PackedModelError
from ..layout.constants import MANIFEST_NAME, STATE_NAME
from . import HubError, is_repo_id, one_line, transport_errors
from .card import CARD_NAME

LOGIN_HINT = "log in with `hf auth login` (or set HF_TOKEN to a token with write access), then re-run"
RESUME_HINT = "re-run the same command: the upload resumes (files the hub already has are not sent again)"


@dataclass
class PublishPlan:
    packed: Path
    repo_id: str
    revision: str | None
    private: bool
    commit_message: str
    data_files: list[tuple[str, int]]  # (path in repo, size), first commit
    meta_files: list[tuple[str, int]]  # moepack.json and README.md, last commit
    card: str
    checked_files: int = 0
    checked_records: int = 0
    license: str | None = None

    @property
    def files(self) -> list[tuple[str, int]]:
        return self.data_files + self.meta_files

    @property
    def total_bytes(self) -> int:
        return sum(s for _, s in self.files)

    @property
    def meta_message(self) -> str:
        return f"{self.commit_message} (manifest and model card)"


@dataclass
class PublishResult:
    repo_id: str
    url: str
    revision: str
    commit: str | None
    files: int
    bytes: int
    notes: list[str] = field(default_factory=list)


# -- token ---------------------------------------------------------------------------------------------

def find_token() -> tuple[str | None, str | None]:
    """``(token, where it came from)`` from the usual places; ``(None, None)`` when not logged in."""
    try:
        from huggingface_hub import get_token

        token = get_token()
    except Exception as e:  # e.g. an OIDC exchange that failed
        raise HubError(f"cannot read your Hugging Face token ({one_line(e)})", hint=LOGIN_HINT) from None
    if not token:
        return None, None
    env = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return token, ("HF_TOKEN" if env and env.strip() == token else "the saved login (`hf auth login`)")  # or OIDC


def require_token() -> tuple[str, str]:
    token, where = find_token()
    if not token:
        raise HubError("not logged in to the Hugging Face hub: publishing needs a token with write access",
                       hint=LOGIN_HINT)
    return token, where


def check_token(token: str, where: str) -> dict:
    """whoami: a rejected or read-only token fails here, before any hashing or upload."""
    from huggingface_hub import HfApi

    with hub_errors("checking your token", None):
        try:
            me = HfApi(token=token).whoami(token=token)
        except _http_error_type() as e:
            if _status(e) == 401:
                raise HubError(f"the hub rejected your token (from {where})", hint=LOGIN_HINT) from None
            raise
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HubError(f"your token (from {where}) is read-only: it cannot create repos or upload",
                       hint="create a token with write access at https://huggingface.co/settings/tokens and "
                            "log in with it (`hf auth login`)")
    return me


# -- errors ----------------------------------------------------------------------------------------------

def _http_error_type():
    from huggingface_hub.errors import HfHubHTTPError

    return HfHubHTTPError


def _status(e) -> int | None:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)


def _http_detail(e) -> str:
    msg = getattr(e, "server_message", None)
    msg = " ".join(str(msg).split()) if msg else one_line(e)
    code = _status(e)
    return f"HTTP {code}: {msg}" if code and not msg.startswith(str(code)) else msg


@contextlib.contextmanager
def hub_errors(what: str, repo_id: str | None):
    """Turn huggingface_hub / network exceptions into one-line HubErrors with the next step."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = constants.ENDPOINT
    try:
        yield
    except HubError:
        raise
    except RepositoryNotFoundError:
        raise HubError(f"{what}: hub repo {repo_id} not found, or your token cannot write to it",
                       hint="check the repo id and that your token has write access to its namespace") from None
    except RevisionNotFoundError:
        raise HubError(f"{what}: hub repo {repo_id} has no such branch",
                       hint="check --revision (a branch name; moepack creates it from main when missing)") from None
    except HfHubHTTPError as e:
        code = _status(e)
        if code == 401:
            raise HubError(f"{what}: the hub rejected your token", hint=LOGIN_HINT) from None
        if code == 403:
            ns = repo_id.split("/")[0] if repo_id else "this namespace"
            raise HubError(f"{what}: your token may not write to {ns} ({_http_detail(e)})",
                           hint="use a namespace you can write to (your user name or an organization you belong "
                                "to), or a token with write access to it") from None
        raise HubError(f"{what} failed ({_http_detail(e)})", hint=RESUME_HINT) from None
    except transport_errors() as e:
        raise HubError(f"{what}: cannot reach the hub at {endpoint} ({one_line(e)})",
                       hint="check your network connection (or HF_ENDPOINT / proxy settings); " + RESUME_HINT) from None
    except (RuntimeError, ValueError) as e:
        # LFS uploads wrap the HTTP error: "Error while uploading 'x' to the Hub." from HfHubHTTPError
        cause = e.__cause__
        if isinstance(cause, HfHubHTTPError):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
            raise HubError(f"{what} failed: {first} ({_http_detail(cause)})", hint=RESUME_HINT) from None
        raise HubError(f"{what} failed ({one_line(e)})", hint=RESUME_HINT) from None


# -- plan ------------------------------------------------------------------------------------------------

def _manifest_files(m) -> list[str]:
    return [e.file for e in m.layers] + [f.name for f in m.dense_files] + [f.name for f in m.aux_files]


def default_commit_message(m) -> str:
    bits = sorted({e.bits for e in m.layers})
    b = "/".join(map(str, bits)) + "-bit experts" if bits else "no routed experts"
    return f"Upload {m.model_type} packed model ({b}) with moepack {__version__}"


def _fetch_source_card(m) -> str | None:
    """The source repo's README.md (for its license), best effort: never fails the publish."""
    src = m.source or {}
    if src.get("type") != "hub" or not src.get("repo_id"):
        return None
    try:
        from huggingface_hub import constants, hf_hub_download

        if constants.HF_HUB_OFFLINE:
            return None
        p = hf_hub_download(src["repo_id"], CARD_NAME, revision=src.get("revision"))
        return Path(p).read_text(encoding="utf-8", errors="replace")
    except Exception:
        return None


def prepare_publish(packed: str | os.PathLike, repo_id: str, *, revision: str | None = None, private: bool = False,
                    commit_message: str | None = None, progress: bool = True,
                    fetch_source_card: bool = True) -> PublishPlan:
    """Verify ``packed`` and build the card and the file list; writes nothing."""
    from ..layout.manifest import load_manifest
    from ..verify import verify
    from .card import find_license, render_card

    check_repo_id(repo_id)
    path = Path(packed)
    m = load_manifest(path)
    if (path / STATE_NAME).exists():
        raise PackedModelError(f"{path} holds {STATE_NAME}: its conversion has not finished",
                               hint="re-run the same `moepack convert` command to finish it, then publish")
    rep = verify(path, progress=progress)
    if not rep.ok:
        shown = "; ".join(rep.problems[:3]) + (f"; and {len(rep.problems) - 3} more" if len(rep.problems) > 3 else "")
        raise HubError(f"{path} fails `moepack verify` ({len(rep.problems)} problem(s)): {shown}",
                       hint=f"nothing was uploaded; `moepack verify {path}` lists every problem; re-run "
                            "`moepack convert` (it resumes and repairs) or re-download the model")
    source_card = None
    if fetch_source_card and find_license(m) is None:
        source_card = _fetch_source_card(m)
    card = render_card(path, repo_id=repo_id, source_card=source_card)
    data = [(name, (path / name).stat().st_size) for name in _manifest_files(m)]
    meta = [(MANIFEST_NAME, (path / MANIFEST_NAME).stat().st_size), (CARD_NAME, len(card.encode("utf-8")))]
    return PublishPlan(path, repo_id, revision, private, commit_message or default_commit_message(m), data, meta,
                       card, rep.checked_files, rep.checked_records, license=find_license(m, source_card))


def check_repo_id(repo_id: str) -> None:
    if not is_repo_id(repo_id):
        raise HubError(f"{repo_id!r} is not a hub repo id of the form namespace/name",
                       hint="use your user name or an organization as namespace, e.g. me/Qwen3.5-397B-moepack-2bit")


# -- upload ----------------------------------------------------------------------------------------------

def _literal(name: str) -> str:
    """An fnmatch pattern that matches exactly ``name``."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def upload(plan: PublishPlan, *, token: str) -> PublishResult:
    """Write the card into the folder, create the repo (and branch), upload data, then manifest + card."""
    from huggingface_hub import HfApi, constants

    from ..layout.atomic import write_bytes_atomic

    repo_id, rev = plan.repo_id, plan.revision
    write_bytes_atomic(plan.packed / CARD_NAME, plan.card.encode("utf-8"))
    api = HfApi(token=token)
    notes: list[str] = []
    with hub_errors(f"creating hub repo {repo_id}", repo_id):
        api.create_repo(repo_id, repo_type="model", private=True if plan.private else None, exist_ok=True)
        if plan.private:
            info = api.repo_info(repo_id, repo_type="model")
            if not getattr(info, "private", True):
                notes.append(f"{repo_id} already existed and is public: --private only applies when the repo is "
                             "created (change its visibility in the repo's settings)")
    if rev and rev != constants.DEFAULT_REVISION:
        with hub_errors(f"creating branch {rev} of {repo_id}", repo_id):
            api.create_branch(repo_id, branch=rev, repo_type="model", exist_ok=True)
    with hub_errors(f"uploading to {repo_id}", repo_id):
        api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(plan.packed), revision=rev,
                          allow_patterns=[_literal(n) for n, _ in plan.data_files],
                          commit_message=plan.commit_message)
        info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(plan.packed), revision=rev,
                                 allow_patterns=[_literal(n) for n, _ in plan.meta_files],
                                 commit_message=plan.meta_message)
    branch = rev or constants.DEFAULT_REVISION
    url = f"{api.endpoint}/{repo_id}" + (f"/tree/{branch}" if branch != constants.DEFAULT_REVISION else "")
    return PublishResult(repo_id, url, branch, getattr(info, "oid", None), len(plan.files), plan.total_bytes, notes)

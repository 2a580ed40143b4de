"""``moepack pull REPO_ID``: download a packed model, verify it once before first use, remember that it was.

Download: ``huggingface_hub.snapshot_download`` (progress bars, resumable, the hub cache or ``--local-dir``; offline
from the cache with ``HF_HUB_OFFLINE=1``). The hub client checks sizes only; moepack then runs ``verify`` (every
file's size and xxh3-64, every expert record's checksum) and records the result in ``.moepack-verified`` next to
the manifest (in the snapshot folder of the hub cache, which is per commit, or in the local dir). The marker holds
the manifest's hash and each checked file's size and mtime: while they match, later runs skip the full check (a
file that changed is re-verified). Where the folder is read-only the marker goes to the moepack cache
(``$MOEPACK_CACHE``, default ``~/.cache/moepack``) instead.

A download that fails verification is not left looking complete: no marker is written, the damaged files are
removed (in the hub cache: the snapshot link and its blob, so the next pull fetches them again) and so is the
manifest (``moepack.json``; in the cache only the snapshot's link to it), so the folder is not taken for a packed
model. The error names the file.

:func:`resolve_packed` is the entry point for other commands: a local folder is returned as it is, a repo id is
pulled (or found in the cache) and verified once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import CorruptFileError, DiskSpaceError, PackedModelError
from ..layout.constants import MANIFEST_NAME
from . import HubError, is_repo_id, one_line, transport_errors

MARKER_NAME = ".moepack-verified"
MARKER_FORMAT = "moepack-verified"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class PullResult:
    path: Path
    repo_id: str
    commit: str | None
    verified_now: bool  # False: a valid marker from an earlier check was found
    checked_files: int
    checked_records: int
    verified_at: str | None = None


def resolve_packed(path_or_repo_id: str | os.PathLike, revision: str | None = None, *, progress: bool = True) -> Path:
    """A packed model's folder from a local path or a hub repo id (``org/name``).

    An existing path is returned as it is (not verified: ``moepack verify`` does that). Otherwise a repo id is
    pulled -- downloaded if needed, verified on first use, cached -- and its folder returned; with
    ``HF_HUB_OFFLINE=1`` it is served from the hub cache. ``revision`` (branch, tag or commit) only applies to repo
    ids.
    """
    text = os.fspath(path_or_repo_id)
    p = Path(text).expanduser()
    if p.exists():
        return p
    if is_repo_id(text):
        return pull(text, revision=revision, progress=progress).path
    raise HubError(f"{text}: no such folder, and not a hub repo id of the form org/name",
                   hint="pass a packed model folder (made by `moepack convert`) or a hub repo id such as "
                        "me/Qwen3.5-397B-moepack-2bit")


def pull(repo_id: str, revision: str | None = None, local_dir: str | os.PathLike | None = None, *,
         progress: bool = True) -> PullResult:
    """Download ``repo_id`` (hub cache, or ``local_dir``) and verify it unless an earlier check still holds."""
    if not is_repo_id(repo_id):
        raise HubError(f"{repo_id!r} is not a hub repo id of the form org/name",
                       hint="pass the repo id shown on the model's hub page, e.g. me/Qwen3.5-397B-moepack-2bit")
    folder, commit = _download(repo_id, revision, local_dir, progress)
    at = f"{repo_id}@{commit[:12]}" if commit else repo_id
    if not (folder / MANIFEST_NAME).is_file():
        raise HubError(f"hub repo {at} has no {MANIFEST_NAME} in {folder}: it is not a moepack packed model "
                       "(or an earlier pull found this copy damaged and removed it)",
                       hint=f"pull a repo made by `moepack publish` (re-run online to repair a damaged copy); to "
                            f"pack a regular checkpoint run `moepack convert {repo_id} OUT`")
    return ensure_verified(folder, repo_id=repo_id, commit=commit, progress=progress)


# -- download ----------------------------------------------------------------------------------------------

def _download(repo_id: str, revision: str | None, local_dir, progress: bool) -> tuple[Path, str | None]:
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:  # pragma: no cover - a declared dependency
        raise HubError(f"{repo_id}: huggingface_hub is not installed to download it",
                       hint="pip install huggingface_hub") from None
    import huggingface_hub.errors as hf_errors

    incomplete = getattr(hf_errors, "IncompleteSnapshotError", None)  # newer huggingface_hub only
    rev = revision or "main"
    at = f"{repo_id}@{rev}"
    offline = bool(getattr(constants, "HF_HUB_OFFLINE", False))
    where = f"--local-dir {local_dir}" if local_dir is not None else f"the hub cache ({constants.HF_HUB_CACHE})"
    kwargs = {"revision": revision}
    if local_dir is not None:
        kwargs["local_dir"] = str(local_dir)
    silence = not progress and not are_progress_bars_disabled()
    if silence:
        disable_progress_bars()
    try:
        folder = snapshot_download(repo_id, **kwargs)
    except GatedRepoError:
        raise HubError(f"hub repo {repo_id} is gated: you have not been granted access",
                       hint="accept the model's terms on its hub page, then log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise HubError(f"hub repo {repo_id} not found (or it is private and no valid token was sent)",
                       hint=f"check the repo id (if you meant a local folder: ./{repo_id} does not exist); "
                            "for a private repo log in with `hf auth login`") from None
    except RevisionNotFoundError:
        raise HubError(f"hub repo {repo_id} has no revision {rev!r}",
                       hint="check the branch, tag or commit passed as --revision") from None
    except LocalEntryNotFoundError as e:
        if incomplete is not None and isinstance(e, incomplete):
            raise HubError(f"hub repo {at}: the copy in {where} is incomplete and the hub cannot be reached",
                           hint="re-run with network access (and without HF_HUB_OFFLINE=1) to finish the download; "
                                "it resumes") from None
        if offline:
            raise HubError(f"hub repo {at} is not in {where} and HF_HUB_OFFLINE=1 forbids downloading it",
                           hint="unset HF_HUB_OFFLINE to download it, or point HF_HUB_CACHE / HF_HOME at the cache "
                                "that holds it") from None
        raise HubError(f"hub repo {at}: the hub cannot be reached and the repo is not in {where}",
                       hint="check your network connection (or HF_ENDPOINT / proxy settings) and retry") from None
    except HfHubHTTPError as e:
        raise HubError(f"hub repo {at}: download failed ({one_line(e)})",
                       hint="check your network connection and retry; downloads resume where they stopped") from None
    except transport_errors() as e:
        raise HubError(f"hub repo {at}: the download was cut off ({one_line(e)})",
                       hint="check your network connection and retry; downloads resume where they stopped") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskSpaceError(f"hub repo {at}: disk full while downloading into {where}") from None
        raise HubError(f"hub repo {at}: download failed ({one_line(e)})",
                       hint="check your network connection and the download folder, then retry") from None
    except ValueError as e:  # an invalid repo id or revision string
        raise HubError(f"{repo_id}: not a valid hub repo id or revision ({one_line(e)})") from None
    finally:
        if silence:
            enable_progress_bars()
    folder = Path(folder)
    if local_dir is None:
        commit = folder.name if _COMMIT.match(folder.name) else None
    else:
        commit = _local_dir_commit(folder)
    return folder, commit


def _local_dir_commit(folder: Path) -> str | None:
    """The commit a --local-dir copy came from, as huggingface_hub recorded it next to the manifest."""
    try:
        from huggingface_hub._local_folder import read_download_metadata

        meta = read_download_metadata(folder, MANIFEST_NAME)
        return meta.commit_hash if meta is not None else None
    except Exception:
        return None


# -- verify once ---------------------------------------------------------------------------------------------

def _checked_files(m) -> list[str]:
    return sorted({e.file for e in m.layers} | {f.name for f in m.dense_files} | {f.name for f in m.aux_files})


def _stat(folder: Path, name: str) -> list[int] | None:
    try:
        st = (folder / name).stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _cache_root() -> Path:
    return Path(os.environ.get("MOEPACK_CACHE") or Path.home() / ".cache" / "moepack")


def _marker_paths(folder: Path) -> list[Path]:
    key = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:20]
    return [folder / MARKER_NAME, _cache_root() / "verified" / f"{key}.json"]


def _read_marker(folder: Path) -> dict | None:
    for p in _marker_paths(folder):
        with contextlib.suppress(OSError, ValueError):
            d = json.loads(p.read_text())
            if isinstance(d, dict) and d.get("format") == MARKER_FORMAT:
                return d
    return None


def _marker_holds(d: dict | None, folder: Path, manifest_hash: str, names: list[str]) -> bool:
    if not d or d.get("manifest_xxh3") != manifest_hash:
        return False
    files = d.get("files")
    if not isinstance(files, dict) or sorted(files) != names:
        return False
    return all(_stat(folder, n) == files[n] for n in names)


def _write_marker(folder: Path, record: dict) -> None:
    from ..layout.atomic import write_json_atomic

    for p in _marker_paths(folder):
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(p, record)
            return
        except OSError:
            continue  # read-only folder: try the moepack cache


def _clear_markers(folder: Path) -> None:
    for p in _marker_paths(folder):
        with contextlib.suppress(OSError):
            p.unlink()


def _remove(folder: Path, name: str, *, blob_too: bool) -> None:
    """Remove a file of the copy. In the hub cache the snapshot entry is a link to a blob: remove the link, and the
    blob too when its content is bad (else the next snapshot_download would link the same bad bytes again)."""
    p = folder / name
    with contextlib.suppress(OSError):
        if p.is_symlink():
            if blob_too:
                with contextlib.suppress(OSError):
                    p.resolve().unlink()
            p.unlink()
        elif p.exists():
            p.unlink()


def ensure_verified(folder: str | os.PathLike, *, repo_id: str | None = None, commit: str | None = None,
                    progress: bool = True) -> PullResult:
    """Verify ``folder`` unless its marker still holds; on failure leave nothing that looks complete."""
    from ..layout.checksum import hash_bytes
    from ..layout.manifest import Manifest
    from ..verify import verify

    folder = Path(folder)
    at = (f"{repo_id}@{commit[:12]}" if commit else repo_id) if repo_id else str(folder)
    raw = (folder / MANIFEST_NAME).read_bytes()
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # damaged bytes: not a manifest at all
        _clear_markers(folder)
        _remove(folder, MANIFEST_NAME, blob_too=True)
        raise CorruptFileError(f"download of {at}: {MANIFEST_NAME} is not valid JSON ({one_line(e)}); "
                               "it was removed",
                               hint=_redownload_hint(repo_id)) from None
    try:
        m = Manifest.from_json(d)
    except PackedModelError as e:  # e.g. a newer format version: the copy is fine, this moepack is too old
        _clear_markers(folder)
        raise PackedModelError(f"{at}: {e.message}", hint=e.hint) from None
    names = _checked_files(m)
    mhash = hash_bytes(raw)
    marker = _read_marker(folder)
    if _marker_holds(marker, folder, mhash, names):
        return PullResult(folder, repo_id or "", commit, False, int(marker.get("checked_files", 0)),
                          int(marker.get("checked_records", 0)), marker.get("verified_at"))
    rep = verify(folder, progress=progress)
    if not rep.ok:
        _clear_markers(folder)
        bad = sorted({p.split(": ", 1)[0] for p in rep.problems} & set(names))
        for name in bad:
            _remove(folder, name, blob_too=True)
        _remove(folder, MANIFEST_NAME, blob_too=False)
        more = f" (and {len(rep.problems) - 1} more problem(s))" if len(rep.problems) > 1 else ""
        raise CorruptFileError(f"download of {at} does not match its manifest: {rep.problems[0]}{more}; "
                               "the damaged file(s) and the manifest were removed",
                               hint=_redownload_hint(repo_id))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write_marker(folder, {"format": MARKER_FORMAT, "version": 1, "repo_id": repo_id, "commit": commit,
                           "moepack_version": __version__, "verified_at": now, "manifest_xxh3": mhash,
                           "checked_files": rep.checked_files, "checked_records": rep.checked_records,
                           "files": {n: _stat(folder, n) for n in names}})
    return PullResult(folder, repo_id or "", commit, True, rep.checked_files, rep.checked_records, now)


def _redownload_hint(repo_id: str | None) -> str:
    if not repo_id:
        return "download the model again"
    return (f"re-run the same `moepack pull {repo_id}` command to download them again; if it happens again the "
            "files on the hub are damaged: tell the repo's author")

"""A source checkpoint: a folder (or a Hugging Face Hub repo) of safetensors shards plus config and tokenizer files.

``open_checkpoint(src)`` accepts a local folder or a hub repo id (``org/name``). Repos are fetched with
``huggingface_hub.snapshot_download`` (weights, config, tokenizer and chat-template files only), which also works
offline from the hub cache (``HF_HUB_OFFLINE=1``); with ``stream=True`` (what ``moepack convert`` uses) only the
small files and the shard headers are fetched up front and shards are downloaded when needed
(:mod:`moepack.source.hub_stream`).

Tensors are found through ``model.safetensors.index.json`` when present, otherwise through the ``*.safetensors``
files in the folder (``model*.safetensors`` when there are any, as mlx-lm does). Shard headers are parsed and
validated when a shard is first needed; :meth:`Checkpoint.validate` (run by ``open_checkpoint`` by default) opens
them all up front, so a damaged or incomplete download is reported before any work starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from ..errors import CorruptFileError, DiskSpaceError, SourceError
from .safetensors_file import SafetensorsFile, TensorInfo

INDEX_FILE = "model.safetensors.index.json"

# What to fetch from a hub repo: weights, config, tokenizer, chat template. Never code (*.py) or other media.
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.jinja",
    "tokenizer*",
    "*.txt",
    "*.model",
    "*.tiktoken",
]

# Files copied next to a packed model so it can be loaded and chatted with.
AUX_FILE_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
AUX_FILE_GLOBS = ("*.model", "*.tiktoken", "vocab*.json", "vocab*.txt", "merges*.txt")

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def open_checkpoint(src: str | os.PathLike, revision: str | None = None, *, validate: bool = True,
                    stream: bool = False) -> "Checkpoint":
    """Open a checkpoint from a local folder or a hub repo id (``org/name``, when no such path exists).

    ``revision`` (branch, tag or commit) only applies to hub repos. With ``validate`` (the default) every shard
    header is read and cross-checked against the index before returning. With ``stream``, a hub repo (when the
    hub can be reached, i.e. not HF_HUB_OFFLINE=1) is opened without downloading its shards: only the small files
    and the shard headers are fetched, and :meth:`~moepack.source.hub_stream.StreamingCheckpoint.fetch` downloads
    a shard when it is needed (see :mod:`moepack.source.hub_stream`).
    """
    text = os.fspath(src)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceError(
                f"{path}: is a file, not a checkpoint folder",
                "pass the folder that holds config.json and the *.safetensors files",
            )
        ckpt = Checkpoint(path)
    elif _REPO_ID.match(text) and ".." not in text:
        ckpt = None
        if stream:
            from .hub_stream import open_streaming

            ckpt = open_streaming(text, revision)  # None when offline: the cache path below, as without stream
        if ckpt is None:
            folder, commit = _download(text, revision)
            ckpt = Checkpoint(folder, repo_id=text, revision=commit)
    else:
        raise SourceError(
            f"{text}: no such folder, and not a hub repo id of the form org/name",
            "pass a local checkpoint folder or a Hugging Face repo id such as mlx-community/Qwen3.5-397B-A17B-4bit",
        )
    if validate:
        try:
            ckpt.validate()
        except BaseException:
            ckpt.close()
            raise
    return ckpt


def _download(repo_id: str, revision: str | None) -> tuple[Path, str | None]:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise SourceError(
            f"{repo_id}: not a local folder, and huggingface_hub is not installed to fetch it",
            "pip install huggingface_hub, or pass a local folder",
        ) from None
    with hub_errors(repo_id, revision):
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    folder = Path(folder)
    commit = folder.name if _COMMIT.match(folder.name) else None
    return folder, commit


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None, what: str = "download"):
    """Turn what huggingface_hub raises while fetching from ``repo_id`` into one-line moepack errors."""
    import huggingface_hub
    from huggingface_hub import constants
    from ..hub import transport_errors
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    incomplete_error = getattr(huggingface_hub.errors, "IncompleteSnapshotError", None)
    rev = revision or "main"
    at = f"{repo_id}@{rev}"
    offline = bool(getattr(constants, "HF_HUB_OFFLINE", False))
    cache = getattr(constants, "HF_HUB_CACHE", None)
    try:
        yield
    except GatedRepoError:
        raise SourceError(
            f"hub repo {repo_id} is gated: you have not been granted access",
            "accept the model's terms on huggingface.co, then log in with `hf auth login`",
        ) from None
    except RepositoryNotFoundError:
        raise SourceError(
            f"hub repo {repo_id} not found (or it is private and no valid token was sent)",
            f"check the repo id (if you meant a local folder: ./{repo_id} does not exist); "
            "for a private repo log in with `hf auth login`",
        ) from None
    except RevisionNotFoundError:
        raise SourceError(
            f"hub repo {repo_id} has no revision {rev!r}",
            "check the branch, tag or commit passed as revision",
        ) from None
    except LocalEntryNotFoundError as e:
        if incomplete_error is not None and isinstance(e, incomplete_error):
            raise SourceError(
                f"hub repo {at}: the cached snapshot in {cache} is incomplete and the Hub cannot be reached",
                "re-run with network access (and without HF_HUB_OFFLINE=1) to finish the download",
            ) from None
        if offline:
            raise SourceError(
                f"hub repo {at} is not in the local hub cache ({cache}) and HF_HUB_OFFLINE=1 forbids downloading it",
                "unset HF_HUB_OFFLINE to download it, or point HF_HUB_CACHE / HF_HOME at the cache that holds it"
                f" (if you meant a local folder: ./{repo_id} does not exist)",
            ) from None
        raise SourceError(
            f"hub repo {at}: the Hub cannot be reached and the repo is not in the local hub cache ({cache})",
            "check your network connection (or proxy / HF_ENDPOINT) and retry",
        ) from None
    except HfHubHTTPError as e:
        raise SourceError(
            f"hub repo {at}: {what} failed ({_one_line(e)})",
            "check your network connection and retry; a conversion resumes where it stopped",
        ) from None
    except transport_errors() as e:
        raise SourceError(
            f"hub repo {at}: the Hub cannot be reached ({_one_line(e)})",
            "check your network connection (or proxy / HF_ENDPOINT) and retry; a conversion resumes where it stopped",
        ) from None
    except OSError as e:
        if getattr(e, "errno", None) == 28:  # ENOSPC
            raise DiskSpaceError(f"hub repo {at}: disk full while downloading into {cache}") from None
        if "Consistency check failed" in str(e):  # huggingface_hub: the body had another size than announced
            raise CorruptFileError(
                f"hub repo {at}: {what} failed: the file arrived with the wrong size ({_one_line(e)})",
                "re-run the same command: the file is downloaded again (nothing damaged was kept)",
            ) from None
        raise SourceError(
            f"hub repo {at}: {what} failed ({_one_line(e)})",
            "check your network connection and the hub cache folder, then retry",
        ) from None
    except ValueError as e:  # invalid repo id / revision string
        raise SourceError(f"{repo_id}: not a valid hub repo id ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(text) > 1 and text[0].endswith(":"):  # "Bad request:" then the server's message on the next line
        text[0] = f"{text[0]} {text[1]}"
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class Checkpoint:
    """A checkpoint folder: ``config``, tensor names, shard files and lazy tensor access.

    Attributes: ``path`` (the folder), ``repo_id`` / ``revision`` (hub repo id and commit hash when it came from the
    hub, else None), ``config`` (config.json), ``quantization`` (the ``quantization`` block, else
    ``quantization_config``, else None), ``tensor_names`` (sorted), ``shards`` (shard file names, sorted),
    ``index`` (the parsed index file or None).
    """

    def __init__(self, path: str | os.PathLike, repo_id: str | None = None, revision: str | None = None):
        self.path = Path(path)
        self.repo_id = repo_id
        self.revision = revision
        self._lock = threading.Lock()
        self._files: dict[str, SafetensorsFile] = {}
        self.config = self._load_config()
        self.quantization = self._find_quantization(self.config)
        self.index: dict[str, Any] | None = None
        self._where: dict[str, str] = {}  # tensor name -> shard file name
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            self._from_index(index_path)
        else:
            self._from_files()
        self.tensor_names: list[str] = sorted(self._where)
        self._shard_tensors: dict[str, list[str]] = {s: [] for s in self.shards}
        for name in self.tensor_names:
            self._shard_tensors[self._where[name]].append(name)

    # ------------------------------------------------------------- discovery
    def _load_config(self) -> dict[str, Any]:
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise SourceError(
                f"{self.path}: no config.json",
                "a checkpoint folder needs config.json next to its *.safetensors files; re-download it",
            )
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise SourceError(f"{cfg_path}: not valid JSON ({e})", "the file is damaged; re-download it") from None
        except OSError as e:
            raise SourceError(f"{cfg_path}: cannot read ({e.strerror})") from None
        if not isinstance(config, dict):
            raise SourceError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
        return config

    @staticmethod
    def _find_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
        for holder in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
            for key in ("quantization", "quantization_config"):
                q = holder.get(key)
                if isinstance(q, dict):
                    return q
        return None

    def _from_index(self, index_path: Path) -> None:
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptFileError(f"{index_path}: not valid JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptFileError(f"{index_path}: no 'weight_map' object mapping tensor names to shard files")
        if not weight_map:
            raise CorruptFileError(f"{index_path}: weight_map is empty")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            p = PurePosixPath(shard)
            if p.is_absolute() or ".." in p.parts or not shard.endswith(".safetensors"):
                raise CorruptFileError(f"{index_path}: shard name {shard!r} is not a .safetensors file in the folder")
        missing = [s for s in shards if not self._shard_exists(s)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise SourceError(
                f"{self.path}: shard {missing[0]}{more} named in {INDEX_FILE} is missing: the download is incomplete",
                "re-run the download (it resumes), or copy the missing shard files into the folder",
            )
        self.index = index
        self.shards: list[str] = shards
        self._where = dict(weight_map)

    # hooks a checkpoint whose shards are not all on disk yet (moepack.source.hub_stream) overrides
    def _shard_exists(self, shard: str) -> bool:
        return (self.path / shard).is_file()

    def _safetensors_names(self) -> list[str]:
        return sorted(p.name for p in self.path.glob("*.safetensors") if p.is_file())

    def _new_shard_file(self, shard: str) -> SafetensorsFile:
        return SafetensorsFile(self.path / shard)

    def _from_files(self) -> None:
        files = self._safetensors_names()
        model_files = [f for f in files if f.startswith("model")]
        shards = model_files or files
        if not shards:
            raise SourceError(
                f"{self.path}: no *.safetensors files and no {INDEX_FILE}",
                "the folder is not a safetensors checkpoint, or the download did not fetch the weights",
            )
        self.shards = shards
        where: dict[str, str] = {}
        for shard in shards:
            sf = self._open_shard(shard, check_index=False)
            for name in sf.tensors:
                if name in where:
                    raise CorruptFileError(
                        f"{self.path}: tensor {name!r} is in both {where[name]} and {shard}",
                        "the folder mixes files from two checkpoints; remove the stray file or re-download",
                    )
                where[name] = shard
        self._where = where

    # ------------------------------------------------------------- shards
    def _open_shard(self, shard: str, check_index: bool = True) -> SafetensorsFile:
        sf = self._files.get(shard)
        if sf is not None:
            return sf
        with self._lock:
            sf = self._files.get(shard)
            if sf is not None:
                return sf
            sf = self._new_shard_file(shard)
            if check_index and self.index is not None:
                absent = [n for n in self._shard_tensors.get(shard, ()) if n not in sf.tensors]
                if absent:
                    more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
                    raise CorruptFileError(
                        f"{self.path / shard}: tensor {absent[0]!r}{more} mapped to this shard by {INDEX_FILE} "
                        "is not in it",
                        "the index and the shards come from different downloads; re-download the checkpoint",
                    )
            self._files[shard] = sf
            return sf

    def validate(self) -> None:
        """Open and validate every shard header; check every indexed tensor is where the index says."""
        for shard in self.shards:
            self._open_shard(shard)

    def _shard_of(self, name: str) -> str:
        try:
            return self._where[name]
        except KeyError:
            raise SourceError(
                f"{self.path}: no tensor named {name!r}",
                "the checkpoint does not hold the tensor its config implies; is it the right model?",
            ) from None

    # ------------------------------------------------------------- public
    def __contains__(self, name: object) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._open_shard(self._shard_of(name)).tensors[name]

    def file_of(self, name: str) -> Path:
        return self.path / self._shard_of(name)

    def read(self, name: str) -> np.ndarray:
        return self._open_shard(self._shard_of(name)).read(name)

    def read_bytes(self, name: str) -> bytes:
        return self._open_shard(self._shard_of(name)).read_bytes(name)

    def tensors_in_shard(self, shard: str) -> list[str]:
        """The checkpoint's tensors stored in ``shard``, in file order (ascending offset)."""
        if shard not in self._shard_tensors:
            raise SourceError(f"{self.path}: {shard!r} is not one of this checkpoint's shards")
        sf = self._open_shard(shard)
        return sorted(self._shard_tensors[shard], key=lambda n: sf.tensors[n].start)

    def shard_file(self, shard: str) -> SafetensorsFile:
        """The opened (validated) :class:`SafetensorsFile` for ``shard``."""
        if shard not in self._shard_tensors:
            raise SourceError(f"{self.path}: {shard!r} is not one of this checkpoint's shards")
        return self._open_shard(shard)

    @property
    def aux_files(self) -> list[Path]:
        """Config, tokenizer and chat-template files present in the folder (to copy into packed output)."""
        found: dict[str, Path] = {}
        for name in AUX_FILE_NAMES:
            p = self.path / name
            if p.is_file():
                found[name] = p
        for pattern in AUX_FILE_GLOBS:
            for p in self.path.glob(pattern):
                if p.is_file():
                    found.setdefault(p.name, p)
        return [found[n] for n in sorted(found)]

    def shard_size(self, shard: str) -> int:
        """``shard``'s size in bytes."""
        return os.path.getsize(self.path / shard)

    def release_shard(self, shard: str) -> None:
        """Close ``shard``'s file descriptor (its header stays known; a later read opens the file again)."""
        sf = self._files.get(shard)
        if sf is not None:
            sf.close()

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for sf in files:
            sf.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        origin = f" from {self.repo_id}@{self.revision}" if self.repo_id else ""
        return f"Checkpoint({str(self.path)!r}{origin}, {len(self.tensor_names)} tensors in {len(self.shards)} shards)"

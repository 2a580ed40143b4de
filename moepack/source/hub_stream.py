"""A hub checkpoint opened without downloading its shards: they are fetched one at a time as a conversion needs them.

``open_streaming(repo_id, revision)`` resolves the revision to a commit (``model_info``), lists the repo's files
with their sizes and LFS sha256 (``list_repo_tree``), downloads the small files (config, index, tokenizer, chat
template: everything ``snapshot_download`` would fetch but the ``*.safetensors``) with ``hf_hub_download``, and
reads every shard's header with two HTTP range reads at most (the hub client's own session, headers and error
handling; LFS files follow the hub's redirect to its CDN). The headers are validated by the same parser as local
files, so the conversion is planned exactly as for a local folder before any shard is downloaded.

Where shards go: the hub cache (``hf_hub_download`` into ``HF_HUB_CACHE``), not a staging folder. That keeps the
hub's own resume, locking and offline behaviour: a shard already cached is used without downloading it, a
conversion without ``--delete-source`` leaves the usual complete snapshot (so a later run works offline), and the
cache tools (``hf cache``) see what is there. Dropping a shard (``--delete-source``) goes through the hub's own
``scan_cache_dir().delete_files(...)``: the snapshot link goes, and the blob with it unless another cached revision
links to the same blob (it also handles the cache-wide shared blob store of newer huggingface_hub versions).

Every shard this run downloads is checked before it is read: its size, and its sha256 against the LFS oid the hub
lists. A mismatch deletes the damaged copy from the cache and stops with a one-line error; re-running downloads it
again. Shards found already cached are checked by size only (hashing hundreds of GB again on every resume is
what the hub's content-addressed cache is there to avoid).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CorruptFileError, SourceError
from .checkpoint import HUB_ALLOW_PATTERNS, Checkpoint, _one_line, hub_errors
from .safetensors_file import MAX_HEADER_BYTES, SafetensorsFile

HEADER_PROBE_BYTES = 100_000  # one range read holds the whole header of almost every shard
_HASH_CHUNK = 16 << 20
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repo at the resolved commit, as ``list_repo_tree`` describes it."""

    path: str
    size: int
    sha256: str | None  # LFS files only
    git_oid: str | None = None  # git blob id (sha1 of "blob <size>\0" + content) of a regular (non-LFS) file


@dataclass
class StreamStats:
    """What fetching and dropping shards did during one run (``moepack convert --json`` prints it)."""

    shards: int = 0
    source_bytes: int = 0
    downloaded: list = field(default_factory=list)  # shard names fetched over the network
    reused: list = field(default_factory=list)  # shard names found complete in the hub cache
    deleted: list = field(default_factory=list)  # shard names dropped from the hub cache
    downloaded_bytes: int = 0
    peak_source_bytes_on_disk: int = 0  # measured: the most shard bytes in the cache snapshot at once
    planned_peak_source_bytes: int = 0  # from the plan, before anything was downloaded

    def to_json(self) -> dict:
        return {"shards": self.shards, "source_bytes": self.source_bytes,
                "shards_downloaded": len(self.downloaded), "shards_reused": len(self.reused),
                "shards_deleted": len(self.deleted), "downloaded_bytes": self.downloaded_bytes,
                "peak_source_bytes_on_disk": self.peak_source_bytes_on_disk,
                "planned_peak_source_bytes": self.planned_peak_source_bytes,
                "downloaded": list(self.downloaded), "deleted": list(self.deleted)}


def open_streaming(repo_id: str, revision: str | None) -> "StreamingCheckpoint | None":
    """The repo opened for streaming, or None when the hub is not to be used (HF_HUB_OFFLINE=1, or it cannot be
    reached: the caller then falls back to the hub cache, as a plain ``open_checkpoint`` does)."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.file_download import repo_folder_name

    from ..hub import transport_errors

    if constants.HF_HUB_OFFLINE:
        return None
    api = HfApi()
    with hub_errors(repo_id, revision, "resolving the revision"):
        try:
            info = api.model_info(repo_id, revision=revision)
        except transport_errors():  # no network: the hub cache, as snapshot_download would
            return None
    commit = info.sha
    if not commit or not _COMMIT.match(commit):
        raise SourceError(f"hub repo {repo_id}@{revision or 'main'}: the hub did not name the commit it resolved to")
    with hub_errors(repo_id, commit, "listing files"):
        entries = api.list_repo_tree(repo_id, revision=commit, recursive=True)
        files = {}
        for e in entries:
            if getattr(e, "size", None) is None:  # a folder
                continue
            lfs = getattr(e, "lfs", None)
            files[e.path] = RemoteFile(e.path, int(e.size), lfs.sha256 if lfs is not None else None,
                                       None if lfs is not None else getattr(e, "blob_id", None))
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    folder = storage / "snapshots" / commit
    _record_ref(storage, revision or "main", commit)
    if "config.json" not in files:
        raise SourceError(f"hub repo {repo_id}@{commit[:12]} has no config.json",
                          "is it a model checkpoint? moepack converts MLX or Hugging Face safetensors checkpoints")
    small = [p for p in sorted(files) if not p.endswith(".safetensors")
             and any(fnmatch.fnmatch(p, pat) for pat in HUB_ALLOW_PATTERNS)]
    with hub_errors(repo_id, commit, "downloading the config and tokenizer files"):
        for p in small:
            hf_hub_download(repo_id, p, revision=commit, tqdm_class=_quiet_tqdm())
    return StreamingCheckpoint(folder, repo_id, commit, files)


def _record_ref(storage: Path, revision: str, commit: str) -> None:
    """Note in the cache which commit ``revision`` (a branch or tag) resolved to, as snapshot_download does
    (``refs/<revision>``), so that a later offline run finds the snapshot by branch name."""
    if revision == commit:
        return
    ref = storage / "refs" / revision
    try:
        if ref.is_file() and ref.read_text().strip() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".moepack-tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError as e:
        raise SourceError(f"cannot write to the hub cache {storage} ({_one_line(e)})",
                          "check the permissions of the hub cache (HF_HUB_CACHE / HF_HOME)") from None


class _RemoteShardFile(SafetensorsFile):
    """A shard's header read over HTTP; tensor reads go to ``path`` (the cache snapshot entry) once downloaded."""

    def __init__(self, path: Path, label: str, header: bytes, file_size: int):
        import threading

        self.path = Path(path)
        self.label = label
        self._fd = None
        self._lock = threading.Lock()
        self.tensors = {}
        self.metadata = {}
        self.file_size = file_size
        self.header_size = 8 + len(header)
        self._parse_header(header, file_size)

    def _corrupt(self, what: str, hint: str | None = None) -> CorruptFileError:
        return CorruptFileError(f"{self.label}: {what}", hint)


class StreamingCheckpoint(Checkpoint):
    """A :class:`Checkpoint` of a hub repo whose shards are downloaded on demand (:meth:`fetch`) and can be dropped
    again (:meth:`drop`). ``path`` is the hub cache's snapshot folder for the commit; a shard's tensors are
    readable once it is fetched. Tensors of a dropped shard can be served from a staged copy (:meth:`stage`)."""

    streaming = True

    def __init__(self, folder: Path, repo_id: str, commit: str, files: dict[str, RemoteFile]):
        self.remote = files
        self._staged: dict[str, SafetensorsFile] = {}  # tensor name -> staged copy
        self._staged_files: list[SafetensorsFile] = []
        super().__init__(folder, repo_id=repo_id, revision=commit)

    # -- Checkpoint hooks: the shards are on the hub, not (yet) in the folder
    def _shard_exists(self, shard: str) -> bool:
        return shard in self.remote

    def _safetensors_names(self) -> list[str]:
        return sorted(p for p in self.remote if p.endswith(".safetensors") and "/" not in p)

    def _new_shard_file(self, shard: str) -> SafetensorsFile:
        if self.is_present(shard):
            return SafetensorsFile(self.path / shard)
        label = f"hub repo {self.repo_id}@{self.revision[:12]}: {shard}"
        header = self._remote_header(shard, label)
        return _RemoteShardFile(self.path / shard, label, header, self.remote[shard].size)

    def shard_size(self, shard: str) -> int:
        return self.remote[shard].size

    def _remote_header(self, shard: str, label: str) -> bytes:
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        size = self.remote[shard].size
        if size < 8:
            raise CorruptFileError(f"{label}: {size} bytes, too short for a safetensors file (needs at least 8)")
        url = hf_hub_url(self.repo_id, shard, revision=self.revision)
        headers = build_hf_headers()

        def get(start: int, end: int) -> bytes:  # bytes [start, end)
            r = get_session().get(url, headers={**headers, "Range": f"bytes={start}-{end - 1}"},
                                  timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
            hf_raise_for_status(r)
            data = r.content
            if r.status_code == 200 and start:  # the server ignored the range: it sent the whole file
                data = data[start:end]
            return data[: end - start]

        with hub_errors(self.repo_id, self.revision, f"reading the header of {shard}"):
            head = get(0, min(size, HEADER_PROBE_BYTES))
            if len(head) < 8:
                raise CorruptFileError(f"{label}: the hub sent {len(head)} bytes for the first 8 of the header")
            n = int.from_bytes(head[:8], "little")
            if n > MAX_HEADER_BYTES:
                raise CorruptFileError(f"{label}: header length {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + n > size:
                raise CorruptFileError(f"{label}: header length {n} bytes runs past the end of the {size}-byte file")
            if len(head) < 8 + n:
                head += get(len(head), 8 + n)
            if len(head) < 8 + n:
                raise CorruptFileError(f"{label}: the hub sent a short header ({len(head) - 8} of {n} bytes)")
        return head[8 : 8 + n]

    # -- shards on disk
    def is_present(self, shard: str) -> bool:
        """``shard`` is complete in the cache snapshot (its entry exists and has the listed size)."""
        p = self.path / shard
        try:
            return p.is_file() and p.stat().st_size == self.remote[shard].size
        except OSError:
            return False

    def source_bytes_on_disk(self) -> int:
        """Bytes of this checkpoint's shards now in the cache snapshot (what the peak figure measures)."""
        total = 0
        for shard in self.shards:
            try:
                total += (self.path / shard).stat().st_size
            except OSError:
                pass
        return total

    def fetch(self, shard: str, *, progress_bar=None, stats: StreamStats | None = None) -> Path:
        """Download ``shard`` into the hub cache unless it is there already; check it; return its path."""
        from huggingface_hub import hf_hub_download

        target = self.path / shard
        if self.is_present(shard):
            if stats is not None:
                stats.reused.append(shard)
            return target
        with hub_errors(self.repo_id, self.revision, f"downloading {shard}"):
            got = Path(hf_hub_download(self.repo_id, shard, revision=self.revision,
                                       tqdm_class=_quiet_tqdm(progress_bar)))
        self._check_download(shard, got)
        if stats is not None:
            stats.downloaded.append(shard)
            stats.downloaded_bytes += self.remote[shard].size
        return target

    def _check_download(self, shard: str, path: Path) -> None:
        want = self.remote[shard]
        at = f"hub repo {self.repo_id}@{self.revision[:12]}"
        hint = ("re-run the same command: the damaged shard was deleted and is downloaded again; "
                "finished layers are kept")
        size = path.stat().st_size
        if size != want.size:
            self._delete_cached([shard])
            raise CorruptFileError(f"{at}: {shard} arrived with {size} bytes, the hub lists {want.size}", hint)
        if want.sha256 is not None:  # an LFS file: the sha256 of its content
            kind, expected, h = "sha256", want.sha256, hashlib.sha256()
        elif want.git_oid is not None:  # a regular git file: its git blob id
            kind, expected, h = "git blob id", want.git_oid, hashlib.sha1(b"blob %d\0" % size)
        else:
            return
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(_HASH_CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
        if h.hexdigest() != expected:
            self._delete_cached([shard])
            raise CorruptFileError(f"{at}: {shard} does not match its {kind} {expected[:12]}... "
                                   f"(got {h.hexdigest()[:12]}...): the download is damaged", hint)

    def drop(self, shard: str, *, stats: StreamStats | None = None) -> None:
        """Close ``shard`` and delete it from the hub cache (snapshot link, and the blob unless shared)."""
        self.release_shard(shard)
        if self._delete_cached([shard]) and stats is not None:
            stats.deleted.append(shard)

    def _delete_cached(self, shards: list[str]) -> bool:
        self.release_shard_all(shards)
        return delete_cached_files(self.repo_id, self.revision, shards)

    def release_shard_all(self, shards: list[str]) -> None:
        for s in shards:
            if s in self._files:
                self.release_shard(s)

    # -- tensors of dropped shards, from staged copies
    def stage(self, path: Path) -> None:
        """Serve the tensors in the safetensors file ``path`` from there from now on (their shard may be gone)."""
        sf = SafetensorsFile(path)
        self._staged_files.append(sf)
        for name in sf.tensors:
            self._staged[name] = sf

    def read(self, name: str):
        sf = self._staged.get(name)
        return sf.read(name) if sf is not None else super().read(name)

    def read_bytes(self, name: str) -> bytes:
        sf = self._staged.get(name)
        return sf.read_bytes(name) if sf is not None else super().read_bytes(name)

    def close(self) -> None:
        for sf in self._staged_files:
            sf.close()
        super().close()


def delete_cached_files(repo_id: str, commit: str | None, names: list[str]) -> bool:
    """Delete ``names`` of ``repo_id``@``commit`` from the hub cache with the hub's own cache tools. True when
    something was deleted."""
    from huggingface_hub import constants, scan_cache_dir

    cache = Path(constants.HF_HUB_CACHE)
    if not cache.is_dir():
        return False
    info = scan_cache_dir(cache)
    wanted = set(names)
    files = []
    for repo in info.repos:
        if repo.repo_id != repo_id or repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            if commit is not None and rev.commit_hash != commit:
                continue
            snap = Path(rev.snapshot_path)
            files += [f for f in rev.files if Path(f.file_path).relative_to(snap).as_posix() in wanted]
    if not files:
        return False
    try:
        info.delete_files(*files).execute()
    except OSError as e:
        raise SourceError(f"could not delete {names[0]} of {repo_id} from the hub cache ({_one_line(e)})",
                          f"check the permissions of {cache}") from None
    return True


def _quiet_tqdm(bar=None):
    """A tqdm class for hf_hub_download that draws nothing itself and forwards the byte counts to our bar."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Forward(hf_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            initial = kwargs.get("initial") or 0
            super().__init__(*args, **kwargs)
            if bar is not None and initial:
                bar.advance(initial)

        def update(self, n=1):
            if bar is not None and n:
                bar.advance(n)
            return super().update(n)

    return Forward


def download_folder() -> Path:
    """Where shards are downloaded to (for the disk space check): the hub cache."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def same_filesystem(a: Path, b: Path) -> bool:
    return os.stat(existing_parent(a)).st_dev == os.stat(existing_parent(b)).st_dev

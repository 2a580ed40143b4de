"""Reading a packed model: the manifest, then one `pread` per expert record into an aligned buffer."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import PackedModelError
from .manifest import Manifest, load_manifest
from .record import RecordLayout

BUFFER_ALIGN = 2 * 1024 * 1024  # 2 MiB-aligned destinations read warm data fastest (seed notes)


def aligned_empty(nbytes: int, align: int = BUFFER_ALIGN) -> np.ndarray:
    """A uint8 array of `nbytes` whose data pointer is a multiple of `align`."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes]


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill `buf` from `fd` at `offset`; a short read means the file is truncated."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise PackedModelError(f"unexpected end of file reading {len(view)} bytes at offset {offset}")
        done += n


class PackedModel:
    """An open packed model: manifest validated, layer files checked for size, fds opened lazily."""

    def __init__(self, path: str | os.PathLike, manifest: Manifest | None = None):
        self.path = Path(path)
        self.manifest = manifest or load_manifest(self.path)
        self._fds: dict[int, int] = {}
        for e in self.manifest.layers:
            f = self.path / e.file
            want = self.manifest.layout_of(e.layer).record_size * self.manifest.moe.num_experts
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                raise PackedModelError(f"{e.file} is missing") from None
            if size != want:
                raise PackedModelError(f"{e.file} is {size} bytes, expected {want}")

    def layout(self, layer: int) -> RecordLayout:
        return self.manifest.layout_of(layer)

    def fd(self, layer: int) -> int:
        fd = self._fds.get(layer)
        if fd is None:
            fd = os.open(self.path / self.manifest.layer(layer).file, os.O_RDONLY)
            self._fds[layer] = fd
        return fd

    def read_record(self, layer: int, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """Expert `expert` of `layer` as raw bytes [record_size], with one pread."""
        if not 0 <= expert < self.manifest.moe.num_experts:
            raise PackedModelError(f"expert {expert} out of range 0..{self.manifest.moe.num_experts - 1}")
        size = self.layout(layer).record_size
        buf = aligned_empty(size) if out is None else out[:size]
        pread_into(self.fd(layer), buf, expert * size)
        return buf

    def read_records(self, layer: int, first: int, count: int) -> np.ndarray:
        """`count` consecutive records [count, record_size] with one pread."""
        size = self.layout(layer).record_size
        buf = aligned_empty(size * count)
        pread_into(self.fd(layer), buf, first * size)
        return buf.reshape(count, size)

    def expert_arrays(self, layer: int, record: np.ndarray) -> dict[str, np.ndarray]:
        """Typed views of a record's nine components: {'gate.weight': uint32 [out, w], ...}."""
        return {c.name: c.view(record) for c in self.layout(layer).components}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

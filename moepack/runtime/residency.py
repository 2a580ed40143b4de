"""Which pages of a file are in the OS page cache: ``mincore()`` through ctypes (Linux, macOS), the runs of
resident and missing pages of a byte range, and dropping a file from the cache (for cold-read benchmarks).
On Linux 6.5+ ``cachestat()`` counts a range's cached pages in one cheap call (mincore costs ~0.1 us per page
not mapped by this process, ~90 us per 3.9 MB record): a quick all-or-nothing test before mincore.

    with FileMap(path) as fm:
        vec = fm.resident(offset, length)          # bool per page of [offset, offset + length)
        for r in read_plan(vec, fm.page_size, offset, length):
            ...                                    # r.resident: copy r.start:r.end from the mapping, else pread

``read_plan`` is pure (tested on synthetic residency vectors); ``FileMap`` is the one place that calls the OS.

Caveats: a mapped page can be evicted between ``mincore`` and the copy; the copy then page-faults and is still
correct (only slower). Since Linux 5.0, ``mincore`` reports the page cache only for files the caller owns or
could open for writing; for other files it reports just the pages this process has mapped, so fewer pages look
resident and the hybrid reader preads more (still byte-identical).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import MoepackError

PAGE_SIZE = mmap.PAGESIZE
_MS_INVALIDATE = 2  # msync flag, the same value on Linux and macOS
_libc = None
_libc_gil = None
_tls = threading.local()


def _lib():
    global _libc
    if _libc is None:
        if sys.platform not in ("linux", "darwin"):
            raise MoepackError(f"mincore is not available on {sys.platform}", hint="use --io pread")
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.mincore.restype = ctypes.c_int
        lib.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.msync.restype = ctypes.c_int
        _libc = lib
    return _libc


def _lib_gil():
    """libc called *holding* the GIL: for calls of a few microseconds, cheaper than releasing the GIL and
    competing for it again with the reader threads (measured: a 4 us cachestat cost ~60 us that way)."""
    global _libc_gil
    if _libc_gil is None:
        lib = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        _libc_gil = lib
    return _libc_gil


# cachestat(2), Linux 6.5+: the same number on x86-64 and arm64 (the unified table)
_CACHESTAT_NR = 451 if sys.platform == "linux" and os.uname().machine in ("x86_64", "aarch64") else None


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(k, ctypes.c_uint64) for k in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                 "nr_recently_evicted")]


def mincore_available() -> bool:
    try:
        _lib()
        return True
    except (MoepackError, OSError, AttributeError):
        return False


# ------------------------------------------------------------------------------------------------ pure planning


@dataclass(frozen=True)
class Run:
    """Bytes [start, end) of the requested range (relative to its offset), all resident or all missing."""

    start: int
    end: int
    resident: bool

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def page_runs(resident: np.ndarray) -> list[tuple[int, int, bool]]:
    """Coalesce a bool-per-page vector into maximal runs (first page, end page, resident)."""
    v = np.asarray(resident, dtype=bool)
    if v.size == 0:
        return []
    if v.all() or not v.any():  # the common cases, without building edge arrays
        return [(0, int(v.size), bool(v[0]))]
    edges = np.flatnonzero(v[1:] != v[:-1]) + 1  # pages where residency changes
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [v.size]))
    return [(int(s), int(e), bool(v[s])) for s, e in zip(starts, ends)]


def read_plan(resident: np.ndarray, page_size: int, offset: int, length: int) -> list[Run]:
    """Runs covering bytes [offset, offset + length) of a file, given `resident` for the pages
    floor(offset / page_size) .. ceil((offset + length) / page_size) - 1. Byte positions in the runs are
    relative to `offset`; the first and last runs are clipped to the range (offsets need not be page-aligned)."""
    first = offset // page_size
    n_pages = -(-(offset + length) // page_size) - first
    if len(resident) != n_pages:
        raise ValueError(f"{len(resident)} residency entries for {n_pages} pages")
    runs = []
    for p0, p1, res in page_runs(resident):
        a = max(0, (first + p0) * page_size - offset)
        b = min(length, (first + p1) * page_size - offset)
        if b > a:
            runs.append(Run(a, b, res))
    return runs


# ------------------------------------------------------------------------------------------------ the OS side


class FileMap:
    """A read-only mapping of a whole file, with ``resident()`` (mincore) over any byte range of it.

    ``array`` is a uint8 numpy view of the mapping (copies out of it release the GIL). Close it only when no
    view taken from ``array`` is still in use."""

    def __init__(self, path: str | os.PathLike | None = None, *, fd: int | None = None):
        if (path is None) == (fd is None):
            raise ValueError("pass exactly one of path and fd")
        self._own_fd = fd is None
        fd = os.open(path, os.O_RDONLY) if self._own_fd else fd
        try:
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            if self._own_fd:
                os.close(fd)
            raise
        self._fd = fd  # for cachestat; closed by close() when opened here
        self._cachestat = _CACHESTAT_NR is not None
        self.page_size = PAGE_SIZE
        self.array = (np.frombuffer(self._map, dtype=np.uint8) if self._map is not None
                      else np.zeros(0, dtype=np.uint8))
        self._addr = self.array.ctypes.data

    def resident(self, offset: int = 0, length: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Bool per page of bytes [offset, offset + length): True where the page is in the page cache.
        `out` (uint8, at least one entry per page) avoids an allocation: the result is a view of it."""
        length = self.size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range {offset}+{length} outside the {self.size}-byte file")
        if length == 0:
            return np.zeros(0, dtype=bool)
        ps = self.page_size
        first = offset // ps
        n_pages = -(-(offset + length) // ps) - first
        vec = np.empty(n_pages, dtype=np.uint8) if out is None or out.size < n_pages else out[:n_pages]
        if _lib().mincore(self._addr + first * ps, n_pages * ps, vec.ctypes.data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        np.bitwise_and(vec, 1, out=vec)  # bit 0: resident (macOS sets other flag bits too)
        return vec.view(bool)

    def cached_pages(self, offset: int, length: int) -> int | None:
        """How many pages of [offset, offset + length) are in the page cache, by one cachestat() call (Linux
        6.5+: a few microseconds, where mincore walks every page); None where cachestat is not available."""
        if not self._cachestat or length <= 0:
            return None
        bufs = getattr(_tls, "cachestat", None)  # per-thread argument structs, reused
        if bufs is None:
            rng, out = _CachestatRange(), _Cachestat()
            bufs = _tls.cachestat = (rng, out, ctypes.byref(rng), ctypes.byref(out))
        rng, out, rng_p, out_p = bufs
        rng.off, rng.len = offset, length
        if _lib_gil().syscall(_CACHESTAT_NR, self._fd, rng_p, out_p, 0) != 0:
            self._cachestat = False  # ENOSYS (older kernel), EPERM (file not ours): mincore only from now on
            return None
        return int(out.nr_cache)

    def resident_fraction(self) -> float:
        return float(self.resident().mean()) if self.size else 1.0

    def invalidate(self) -> None:
        """macOS: drop the file's clean pages from the cache (msync MS_INVALIDATE, as vmtouch -e does)."""
        if self.size and _lib().msync(self._addr, self.size, _MS_INVALIDATE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"msync: {os.strerror(err)}")

    def close(self) -> None:
        if self._map is not None:
            self.array = np.zeros(0, dtype=np.uint8)
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view: the mapping goes when that view does
                pass
            self._map = None
        if self._own_fd and self._fd is not None:
            os.close(self._fd)
        self._fd = None
        self._cachestat = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def proc_kib_field(path: str, key: str) -> int | None:
    """Bytes of a `key:  N kB` line of a Linux /proc file (/proc/meminfo, /proc/self/status); None where the
    file or the line is missing (other systems)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_ram() -> int:
    """Bytes of memory the OS could give a process now, page cache it may reclaim included (Linux
    MemAvailable); elsewhere half the physical memory; 0 if unknown."""
    avail = proc_kib_field("/proc/meminfo", "MemAvailable")
    if avail is not None:
        return avail
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 0


def evict(path: str | os.PathLike) -> float:
    """Drop `path`'s pages from the page cache; returns the fraction still resident afterwards (mincore).

    Linux: fdatasync (dirty pages cannot be dropped), then posix_fadvise(DONTNEED). macOS: msync(MS_INVALIDATE)
    on a mapping. Raises MoepackError where neither exists."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.fdatasync(fd)
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with FileMap(fd=fd) as fm:
                return fm.resident_fraction()
        if sys.platform == "darwin":
            with FileMap(fd=fd) as fm:
                fm.invalidate()
                return fm.resident_fraction()
    finally:
        os.close(fd)
    raise MoepackError(f"cannot drop files from the page cache on {sys.platform}",
                       hint="cold-read figures need Linux or macOS")


def warm(path: str | os.PathLike, offset: int = 0, length: int | None = None, chunk: int = 8 << 20) -> None:
    """Read bytes [offset, offset + length) of `path` into the page cache (plain buffered reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size if length is None else offset + length
        buf = bytearray(chunk)
        view = memoryview(buf)
        pos = offset
        while pos < end:
            n = os.preadv(fd, [view[: min(chunk, end - pos)]], pos)
            if n <= 0:
                break
            pos += n
    finally:
        os.close(fd)

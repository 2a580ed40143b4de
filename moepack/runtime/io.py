"""Reading routed experts: one pread per expert record, on a persistent thread pool, into reused buffers.

``ExpertReader.submit(layer, expert_ids)`` queues one read per expert and returns at once, so the caller can
compute (the shared expert, the previous batch of experts) while the SSD works; ``Pending.wait()`` hands back
typed views of each record's nine components. ``os.preadv`` releases the GIL, so the reads of one request
really run in parallel (NVMe queueing: the seed notes measured 4 threads at 9x sequential).

I/O modes:

* ``'pread'`` (default): buffered reads through the OS page cache ("trust the OS": an app-level cache lost
  to the page cache in every measurement of the seed notes).
* ``'direct'``: bypass the page cache (``O_DIRECT`` on Linux, ``F_NOCACHE`` on macOS), for cold-read
  benchmarks. Records are 16 KiB multiples at 16 KiB-multiple offsets and the buffers are 2 MiB-aligned, so
  O_DIRECT's alignment rules hold. Where the OS or file system refuses (tmpfs, other platforms) the reader
  warns once and falls back to ``'pread'``.
* ``'mmap'``: copy the record out of a read-only mapping of the layer file (page faults instead of one
  large read; slower when cold, per the notes; kept for comparison).

Buffer lifetime rule: each request uses a *slot* (an int, default 0) owning a pool of 2 MiB-aligned record
buffers, grown to the largest request it has seen and then reused. The arrays ``Pending.wait()`` returns
for slot ``s`` stay valid until the next ``submit(..., slot=s)`` begins; that call first waits for any reads
still running into slot ``s``. Use two slots to overlap reading one batch of experts with computing the
previous one.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import MoepackError, PackedModelError
from ..layout.reader import PackedModel, aligned_empty

IO_MODES = ("pread", "direct", "mmap")
_F_NOCACHE = 48  # fcntl command on macOS


@dataclass
class IOStats:
    bytes_read: int = 0  # record bytes fetched (padding included)
    reads: int = 0  # expert records fetched
    requests: int = 0  # submit() calls
    wait_s: float = 0.0  # time callers spent blocked in Pending.wait()

    def reset(self) -> None:
        self.bytes_read = self.reads = self.requests = 0
        self.wait_s = 0.0

    def to_json(self) -> dict:
        return asdict(self)


class Pending:
    """The reads of one submit(); ``wait()`` returns {expert_id: {component: array view}}."""

    def __init__(self, reader: "ExpertReader", layer: int, experts: list[int], futures: list[Future],
                 records: list[np.ndarray]):
        self._reader = reader
        self.layer = layer
        self.experts = experts
        self._futures = futures
        self._records = records
        self._result: dict[int, dict[str, np.ndarray]] | None = None

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def _drain(self) -> None:
        """Wait for every read to finish (errors or not): the buffers may be reused afterwards."""
        for f in self._futures:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - reported by wait(); here we only need them finished
                pass

    def wait(self) -> dict[int, dict[str, np.ndarray]]:
        if self._result is None:
            t0 = time.perf_counter()
            try:
                for f in self._futures:
                    f.result()
            finally:
                self._drain()
                self._reader.stats.wait_s += time.perf_counter() - t0
            pm = self._reader.packed
            self._result = {e: pm.expert_arrays(self.layer, rec) for e, rec in zip(self.experts, self._records)}
        return self._result

    def records(self) -> dict[int, np.ndarray]:
        """{expert_id: the raw record bytes (uint8, inside a 2 MiB-aligned buffer)} after wait(); same lifetime
        as wait()'s views. GPU backends hand these to their kernels whole (no copy on unified memory)."""
        self.wait()
        return dict(zip(self.experts, self._records))


class ExpertReader:
    """Reads expert records of a :class:`PackedModel` (see the module docstring for modes and buffer lifetime)."""

    def __init__(self, packed_model: PackedModel, io: str = "pread", threads: int = 4):
        if io not in IO_MODES:
            raise MoepackError(f"unknown io mode {io!r}", hint=f"use one of {', '.join(IO_MODES)}")
        if threads < 1:
            raise MoepackError(f"io threads must be at least 1, got {threads}")
        self.packed = packed_model
        self.requested_io = io
        self.io = io
        self.threads = threads
        self.stats = IOStats()
        self._record_max = max((packed_model.layout(e.layer).record_size for e in packed_model.manifest.layers),
                               default=0)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moepack-io")
        self._buffers: dict[int, list[np.ndarray]] = {}  # slot -> record buffers
        self._inflight: dict[int, Pending] = {}  # slot -> last request on it
        self._fds: dict[int, int] = {}  # layer -> fd opened for this mode ('direct')
        self._maps: dict[int, mmap.mmap] = {}  # layer -> mapping ('mmap')
        self._lock = threading.Lock()
        self._closed = False
        if io == "direct" and not (hasattr(os, "O_DIRECT") or sys.platform == "darwin"):
            self._fallback("this platform has neither O_DIRECT nor F_NOCACHE")

    # -------------------------------------------------------------------------------------------- public
    def submit(self, layer: int, expert_ids, slot: int = 0) -> Pending:
        """Queue one read per expert of `layer` into slot `slot`'s buffers; returns immediately."""
        if self._closed:
            raise MoepackError("the expert reader is closed")
        experts = [int(e) for e in expert_ids]
        if len(set(experts)) != len(experts):
            raise MoepackError(f"expert ids repeat in one request: {experts}")
        size = self.packed.layout(layer).record_size
        n_exp = self.packed.manifest.moe.num_experts
        for e in experts:
            if not 0 <= e < n_exp:
                raise PackedModelError(f"expert {e} out of range 0..{n_exp - 1}")
        prev = self._inflight.pop(slot, None)
        if prev is not None:
            prev._drain()  # the buffers of this slot are about to be overwritten
        bufs = self._buffers.setdefault(slot, [])
        while len(bufs) < len(experts):
            bufs.append(aligned_empty(self._record_max))
        records = [bufs[i][:size] for i in range(len(experts))]
        read = self._reader_for(layer)
        futures = [self._pool.submit(read, layer, e, rec, size) for e, rec in zip(experts, records)]
        pending = Pending(self, layer, experts, futures, records)
        self._inflight[slot] = pending
        self.stats.requests += 1
        self.stats.reads += len(experts)
        self.stats.bytes_read += size * len(experts)
        return pending

    def read(self, layer: int, expert_ids, slot: int = 0) -> dict[int, dict[str, np.ndarray]]:
        """submit() then wait()."""
        return self.submit(layer, expert_ids, slot).wait()

    def buffer_bytes(self) -> int:
        return sum(b.nbytes for bufs in self._buffers.values() for b in bufs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self._inflight.values():
            p._drain()
        self._inflight.clear()
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping goes when it does
                pass
        self._maps.clear()
        self._buffers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -------------------------------------------------------------------------------------------- modes
    def _fallback(self, why: str) -> None:
        if self.io != "pread":
            warnings.warn(f"io='{self.requested_io}' is not available ({why}); reading experts with pread instead",
                          RuntimeWarning, stacklevel=3)
        self.io = "pread"

    def _reader_for(self, layer: int):
        """The read function for `layer`; opens descriptors/mappings here, in the submitting thread."""
        if self.io == "direct":
            if layer not in self._fds:
                try:
                    self._fds[layer] = self._open_direct(layer)
                except OSError as e:
                    self._fallback(f"{e.strerror} opening {self.packed.manifest.layer(layer).file}")
            if self.io == "direct":
                return self._read_direct
        if self.io == "mmap":
            if layer not in self._maps:
                fd = self.packed.fd(layer)
                self._maps[layer] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            return self._read_mmap
        self.packed.fd(layer)
        return self._read_pread

    def _open_direct(self, layer: int) -> int:
        path = self.packed.path / self.packed.manifest.layer(layer).file
        if sys.platform == "darwin":
            import fcntl

            fd = os.open(path, os.O_RDONLY)
            fcntl.fcntl(fd, _F_NOCACHE, 1)
            return fd
        return os.open(path, os.O_RDONLY | os.O_DIRECT)

    def _read_pread(self, layer: int, expert: int, buf: np.ndarray, size: int) -> None:
        _pread_full(self.packed.fd(layer), buf, expert * size)

    def _read_direct(self, layer: int, expert: int, buf: np.ndarray, size: int) -> None:
        fd = self._fds.get(layer)
        if fd is not None:
            try:
                _pread_full(fd, buf, expert * size)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                with self._lock:  # the file system accepted O_DIRECT at open but refuses the read
                    if self.io == "direct":
                        self._fallback(f"{e.strerror} on an O_DIRECT read")
        _pread_full(self.packed.fd(layer), buf, expert * size)

    def _read_mmap(self, layer: int, expert: int, buf: np.ndarray, size: int) -> None:
        src = np.frombuffer(self._maps[layer], dtype=np.uint8, count=size, offset=expert * size)
        np.copyto(buf, src)


def _pread_full(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise PackedModelError(f"unexpected end of file reading {len(view)} bytes at offset {offset}")
        done += n

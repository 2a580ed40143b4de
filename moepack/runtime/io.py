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
* ``'hybrid'``: map each layer file once; per read ask ``mincore()`` which pages are in the page cache, copy
  those runs out of the mapping (warm copies beat pread) and pread the missing runs, each run one call
  (cold bulk reads stay large disk commands); a read less than half cached is one pread of the whole
  range. On Linux 6.5+ one ``cachestat()`` call first settles the all-cached and mostly-missing cases
  (microseconds, where mincore walks every page); ``IOStats`` counts both kinds of call and their time.
* ``'mapped'``: as ``'hybrid'``, except that a record whose pages are ALL in the page cache is not copied
  at all: the request hands back a view of the mapping itself and the kernels read the weights in place
  (what llama.cpp does with its mmap, for a model that fits in RAM). Records not wholly cached are read as
  ``'hybrid'`` reads them, so a cold record is still one large pread, never a storm of page faults. If the
  OS evicts a page between the check and its use, the kernel's access faults it back in: slower, never
  wrong (the mapping is of the file itself). ``IOStats.mapped_reads`` / ``mapped_bytes`` count them.
* ``'auto'``: the recommendation ``moepack bench-io`` saved for this model or its disk (mode, threads,
  split), else ``'pread'``; ``reader.io`` then names the mode chosen.

Split reads (``split=N``): each record is read as N chunks with 16 KiB-aligned boundaries, queued as
separate tasks, so one expert's read runs on up to N threads at once (the pool has max(threads, N) threads).
Every mode and split returns byte-identical records.

A ``recorder`` (``reader.recorder = fn``) is called as ``fn(layer, expert_ids)`` on every submit: how
``moepack trace`` sees the routing without touching model code.

Buffer lifetime rule: each request uses a *slot* (an int, default 0) owning a pool of 2 MiB-aligned record
buffers, grown to the largest request it has seen and then reused. The arrays ``Pending.wait()`` returns
for slot ``s`` stay valid until the next ``submit(..., slot=s)`` begins; that call first waits for any reads
still running into slot ``s``. Use two slots to overlap reading one batch of experts with computing the
previous one.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, fields

import numpy as np

from ..errors import MoepackError, PackedModelError
from ..layout.constants import RECORD_ALIGN
from ..layout.reader import BUFFER_ALIGN, PackedModel, aligned_empty
from .residency import FileMap, available_ram, mincore_available, read_plan

IO_MODES = ("pread", "direct", "mmap", "hybrid", "mapped")
IO_CHOICES = IO_MODES + ("auto",)  # what the CLI and load_model accept
# hybrid: a read with less than this fraction of its pages cached is one pread of the whole range (the kernel
# copies the few cached pages itself): splitting it into a copy and a shorter pread costs more than it saves
# (measured: records with a readahead-cached prefix read at 0.8x pread when split)
HYBRID_MIN_CACHED = 0.5
_F_NOCACHE = 48  # fcntl command on macOS


@dataclass
class IOStats:
    bytes_read: int = 0  # record bytes fetched (padding included)
    reads: int = 0  # expert records fetched
    requests: int = 0  # submit() calls
    wait_s: float = 0.0  # time callers spent blocked in Pending.wait()
    chunks: int = 0  # read tasks queued (reads x split)
    cachestat_calls: int = 0  # hybrid: cachestat() probes (Linux 6.5+), one per chunk
    cachestat_s: float = 0.0  # hybrid: time spent in them (all threads together)
    mincore_calls: int = 0  # hybrid: mincore() scans: every chunk without cachestat, else partly cached ones
    mincore_s: float = 0.0  # hybrid: time spent in them, run planning included
    copied_bytes: int = 0  # hybrid: bytes found resident and copied from the mapping
    pread_bytes: int = 0  # hybrid: bytes found missing and pread
    pread_calls: int = 0  # hybrid: preads issued for missing runs
    mapped_reads: int = 0  # mapped: records used in place from the mapping (wholly cached: nothing copied)
    mapped_bytes: int = 0  # mapped: their bytes

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())

    def to_json(self) -> dict:
        return asdict(self)


class Pending:
    """The reads of one submit(); ``wait()`` returns {expert_id: {component: array view}}."""

    def __init__(self, reader: "ExpertReader", layer: int, experts: list[int], futures: list[Future],
                 records: list[np.ndarray], groups: list[list[Future]] | None = None,
                 block: np.ndarray | None = None):
        self._reader = reader
        self.layer = layer
        self.experts = experts
        self._futures = futures
        self._records = records
        self._groups = groups  # per expert (same order): the read tasks filling its record ([] when in place)
        self._block = block  # [n, stride] uint8: row i holds expert i's record (None: some were used in place)
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

    def completed(self):
        """Yield (expert_id, {component: view}) as each expert's record is complete, in the order the reads
        finish (records used in place first), so the caller computes one expert while the others still read.
        Time blocked here counts as I/O wait; a failed read raises when its expert's turn comes (after every
        read of the request has finished, so the buffers are quiet)."""
        if self._groups is None or self._result is not None:
            yield from self.wait().items()
            return
        pm = self._reader.packed
        todo = {i: set(g) for i, g in enumerate(self._groups)}
        ready = [i for i, g in todo.items() if not g]
        while todo:
            for i in ready:
                del todo[i]
                for f in self._groups[i]:
                    if f.exception() is not None:
                        self._drain()
                        f.result()
                yield self.experts[i], pm.expert_arrays(self.layer, self._records[i])
            if not todo:
                break
            t0 = time.perf_counter()
            done, _ = wait_futures({f for g in todo.values() for f in g}, return_when=FIRST_COMPLETED)
            self._reader.stats.wait_s += time.perf_counter() - t0
            for g in todo.values():
                g -= done
            ready = [i for i, g in todo.items() if not g]

    def record_block(self) -> np.ndarray | None:
        """After the reads: all records of the request as one uint8 [n, stride] array (row i = experts[i], the
        record at the start of each 2 MiB-aligned row), or None when some record was used in place."""
        if self._block is None:
            return None
        self.wait()
        return self._block

    def records(self) -> dict[int, np.ndarray]:
        """{expert_id: the raw record bytes (uint8, inside a 2 MiB-aligned buffer)} after wait(); same lifetime
        as wait()'s views. GPU backends hand these to their kernels whole (no copy on unified memory)."""
        self.wait()
        return dict(zip(self.experts, self._records))


class ExpertReader:
    """Reads expert records of a :class:`PackedModel` (see the module docstring for modes and buffer lifetime).

    ``buffer_align`` is the alignment of the record buffers: 2 MiB by default; bench-io compares 16 KiB."""

    def __init__(self, packed_model: PackedModel, io: str = "pread", threads: int = 4, split: int = 1,
                 buffer_align: int = BUFFER_ALIGN, auto_default: str = "pread"):
        io, spec_split = parse_io(io)
        split = split if spec_split is None else spec_split
        self.auto = None  # the saved recommendation 'auto' used (None: none, or io was not 'auto')
        if io == "auto":
            from ..iobench import recommended_io

            self.auto = recommended_io(packed_model)
            rec = self.auto or {}
            io, threads = rec.get("io", auto_default), int(rec.get("threads", threads))
            split = int(rec.get("split", split)) if spec_split is None else spec_split  # explicit --split wins
        if threads < 1:
            raise MoepackError(f"io threads must be at least 1, got {threads}")
        if split < 1:
            raise MoepackError(f"--split must be at least 1, got {split}", hint="1 reads each expert in one call")
        if buffer_align < 4096 or buffer_align & (buffer_align - 1):
            raise MoepackError(f"buffer alignment must be a power of two >= 4096, got {buffer_align}")
        self.packed = packed_model
        self.requested_io = io
        self.io = io
        self.threads = threads
        self.split = split
        self.buffer_align = buffer_align
        self.stats = IOStats()
        self.recorder = None  # fn(layer, expert_ids) called on every submit (moepack trace)
        self._record_max = max((packed_model.layout(e.layer).record_size for e in packed_model.manifest.layers),
                               default=0)
        self._pool = ThreadPoolExecutor(max_workers=max(threads, split), thread_name_prefix="moepack-io")
        self._buffers: dict[int, list[np.ndarray]] = {}  # slot -> record buffers (rows of _blocks[slot])
        self._blocks: dict[int, np.ndarray] = {}  # slot -> [rows, row_stride] uint8 block (2 MiB-aligned rows)
        self._inflight: dict[int, Pending] = {}  # slot -> last request on it
        self._fds: dict[int, int] = {}  # layer -> fd opened for this mode ('direct')
        self._maps: dict[int, FileMap] = {}  # layer -> mapping ('mmap', 'hybrid')
        self._chunks: dict[int, list[tuple[int, int]]] = {}  # record size -> split chunks
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._closed = False
        if io == "direct" and not (hasattr(os, "O_DIRECT") or sys.platform == "darwin"):
            self._fallback("this platform has neither O_DIRECT nor F_NOCACHE")
        if io in ("hybrid", "mapped") and not mincore_available():
            self._fallback("mincore is not available on this platform")

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
        if self.recorder is not None:
            self.recorder(layer, experts)
        prev = self._inflight.pop(slot, None)
        if prev is not None:
            prev._drain()  # the buffers of this slot are about to be overwritten
        bufs = self._slot_buffers(slot, len(experts))
        read = self._reader_for(layer)
        chunks = self._chunks.get(size)
        if chunks is None:
            chunks = self._chunks[size] = split_ranges(size, self.split)
        fm = self._maps.get(layer) if self.io == "mapped" else None
        records, futures, groups, used = [], [], [], 0
        for e in experts:
            if fm is not None and self._wholly_cached(fm, e * size, size):
                records.append(fm.array[e * size : (e + 1) * size])  # in place: no copy, no read task
                groups.append([])
                self.stats.mapped_reads += 1
                self.stats.mapped_bytes += size
                continue
            rec = bufs[used][:size]
            used += 1
            records.append(rec)
            groups.append([self._pool.submit(read, layer, e * size + a, rec[a:b]) for a, b in chunks])
            futures += groups[-1]
        block = self._blocks.get(slot) if used == len(experts) else None  # every record in rows 0..n-1
        pending = Pending(self, layer, experts, futures, records, groups,
                          None if block is None else block[: len(experts)])
        self._inflight[slot] = pending
        self.stats.requests += 1
        self.stats.reads += len(experts)
        self.stats.chunks += len(futures)
        self.stats.bytes_read += size * len(experts)
        return pending

    def read(self, layer: int, expert_ids, slot: int = 0) -> dict[int, dict[str, np.ndarray]]:
        """submit() then wait()."""
        return self.submit(layer, expert_ids, slot).wait()

    def buffer_bytes(self) -> int:
        return sum(b.nbytes for bufs in self._buffers.values() for b in bufs)

    def _slot_buffers(self, slot: int, n: int) -> list[np.ndarray]:
        """At least n record buffers for `slot`: the rows of one block whose row stride is the largest record
        rounded up to the buffer alignment, so every row stays 2 MiB-aligned and a request's records also
        form one [n, stride] array (GPU kernels take a batch of experts that way). Grown by replacement: the
        previous request on the slot is finished, and its arrays are invalid from this submit on anyway."""
        bufs = self._buffers.get(slot, [])
        if len(bufs) >= n:
            return bufs
        if self.buffer_align < BUFFER_ALIGN:  # bench-io's 16 KiB-aligned destinations: separate buffers
            bufs = bufs + [record_buffer(self._record_max, self.buffer_align) for _ in range(n - len(bufs))]
        else:
            stride = -(-self._record_max // self.buffer_align) * self.buffer_align
            block = aligned_empty(n * stride, self.buffer_align).reshape(n, stride)
            self._blocks[slot] = block
            bufs = [block[i] for i in range(n)]
        self._buffers[slot] = bufs
        return bufs

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
            m.close()
        self._maps.clear()
        self._buffers.clear()
        self._blocks.clear()

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
        if self.io in ("mmap", "hybrid", "mapped"):
            if layer not in self._maps:
                self._maps[layer] = FileMap(fd=self.packed.fd(layer))
            return self._read_mmap if self.io == "mmap" else self._read_hybrid
        self.packed.fd(layer)
        return self._read_pread

    def _wholly_cached(self, fm: FileMap, offset: int, n: int) -> bool:
        """Are all pages of [offset, offset + n) in the page cache? One cachestat() (Linux 6.5+), else mincore."""
        t0 = time.perf_counter()
        n_pages = (offset + n - 1) // fm.page_size - offset // fm.page_size + 1
        cached = fm.cached_pages(offset, n)
        if cached is not None:
            self._count(time.perf_counter() - t0, None, 0, 0, 0)
            return cached >= n_pages
        vec = getattr(self._tls, "vec", None)
        if vec is None or vec.size < n_pages:
            vec = self._tls.vec = np.empty(n_pages, dtype=np.uint8)
        ok = bool(fm.resident(offset, n, out=vec).all())
        self._count(None, time.perf_counter() - t0, 0, 0, 0)
        return ok

    def _open_direct(self, layer: int) -> int:
        path = self.packed.path / self.packed.manifest.layer(layer).file
        if sys.platform == "darwin":
            import fcntl

            fd = os.open(path, os.O_RDONLY)
            fcntl.fcntl(fd, _F_NOCACHE, 1)
            return fd
        return os.open(path, os.O_RDONLY | os.O_DIRECT)

    # each read function fills `dst` (a slice of a record buffer) from file offset `offset` of `layer`
    def _read_pread(self, layer: int, offset: int, dst: np.ndarray) -> None:
        _pread_full(self.packed.fd(layer), dst, offset)

    def _read_direct(self, layer: int, offset: int, dst: np.ndarray) -> None:
        fd = self._fds.get(layer)
        if fd is not None:
            try:
                _pread_full(fd, dst, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                with self._lock:  # the file system accepted O_DIRECT at open but refuses the read
                    if self.io == "direct":
                        self._fallback(f"{e.strerror} on an O_DIRECT read")
        _pread_full(self.packed.fd(layer), dst, offset)

    def _read_mmap(self, layer: int, offset: int, dst: np.ndarray) -> None:
        np.copyto(dst, self._maps[layer].array[offset : offset + dst.size])

    def _read_hybrid(self, layer: int, offset: int, dst: np.ndarray) -> None:
        fm = self._maps[layer]
        n = dst.size
        ps = fm.page_size
        n_pages = (offset + n - 1) // ps - offset // ps + 1
        t0 = time.perf_counter()
        cached = fm.cached_pages(offset, n)  # one cheap call settles the all/none cases (Linux 6.5+)
        t1 = time.perf_counter()
        # the all-cached and none-cached fast paths: as little Python (GIL time) as the pure modes
        if cached is not None and cached >= n_pages:
            np.copyto(dst, fm.array[offset : offset + n])
            self._count(t1 - t0, None, n, 0, 0)
            return
        if cached is not None and cached < n_pages * HYBRID_MIN_CACHED:  # none or little cached: one pread
            _pread_full(self.packed.fd(layer), dst, offset)
            self._count(t1 - t0, None, 0, n, 1)
            return
        vec = getattr(self._tls, "vec", None)  # this thread's mincore vector, reused
        if vec is None or vec.size < n_pages:
            vec = self._tls.vec = np.empty(n_pages, dtype=np.uint8)
        resident = fm.resident(offset, n, out=vec)
        if resident.mean() < HYBRID_MIN_CACHED:  # (no cachestat) little cached: one pread, as above
            t2 = time.perf_counter()
            _pread_full(self.packed.fd(layer), dst, offset)
            self._count(None if cached is None else t1 - t0, t2 - t1, 0, n, 1)
            return
        runs = read_plan(resident, ps, offset, n)
        t2 = time.perf_counter()
        copied = preads = pread_bytes = 0
        fd = self.packed.fd(layer)
        for r in runs:
            if r.resident:
                np.copyto(dst[r.start : r.end], fm.array[offset + r.start : offset + r.end])
                copied += r.nbytes
            else:
                _pread_full(fd, dst[r.start : r.end], offset + r.start)
                preads += 1
                pread_bytes += r.nbytes
        self._count(None if cached is None else t1 - t0, t2 - t1, copied, pread_bytes, preads)

    def _count(self, cachestat_s, mincore_s, copied: int, pread_bytes: int, preads: int) -> None:
        with self._lock:
            s = self.stats
            if cachestat_s is not None:
                s.cachestat_calls += 1
                s.cachestat_s += cachestat_s
            if mincore_s is not None:
                s.mincore_calls += 1
                s.mincore_s += mincore_s
            s.copied_bytes += copied
            s.pread_bytes += pread_bytes
            s.pread_calls += preads


# auto reads with 'mapped' when the model's experts take at most this share of the memory available
FITS_IN_RAM = 0.8


def default_io(backend: str, expert_bytes: int | None = None) -> str:
    """What ``io='auto'`` reads with when `moepack bench-io` saved nothing for the model or its disk.

    CPU backends ('cpu', 'numpy', 'auto'), experts fitting in memory (`expert_bytes` at most FITS_IN_RAM of
    what the OS could give now, page cache included): ``'mapped'`` where mincore() exists. Measured with
    benchmarks/decode.py (2-core VM, 397B expert shapes, 2 layers in RAM): K=4 71 vs 47 tok/s, K=10 40 vs
    23 with pread. Warm, a copying reader cannot beat pread by much: pread into the reader's page-aligned
    buffers already runs at the speed of a memcpy out of a mapping (moepack/iobench.py's docstring); only
    not copying does. Experts larger than memory, or GPU backends: ``'pread'``, trusting the page cache
    (8 layers, 29 GB, ~6 GiB of cache, K=4: pread 3.7, mapped 3.2 tok/s, in place records being evicted
    under the kernels; 'direct' 4.9 there but behind pread at K=10). GPU decode launches take the K records
    as one block of buffer rows, which records used in place would break up."""
    if backend in ("metal", "metal-emu", "cuda") or not mincore_available():
        return "pread"
    if expert_bytes is not None and expert_bytes > FITS_IN_RAM * available_ram():
        return "pread"
    return "mapped"


def planned_io(packed_path, io: str, backend: str) -> str:
    """The mode an ExpertReader opened with `io` for `backend` on the packed folder will use (before opening
    it: `moepack run` sets how idle kernel threads wait from it, which must happen before they start)."""
    mode, _ = parse_io(io)
    if mode != "auto":
        return mode
    from ..iobench import recommended_io

    rec = recommended_io(packed_path)
    if rec:
        return rec["io"]
    from ..layout.manifest import load_manifest

    return default_io(backend, load_manifest(packed_path).expert_bytes_total)


def parse_io(spec: str) -> tuple[str, int | None]:
    """'hybrid' -> ('hybrid', None); 'hybrid:4' -> ('hybrid', 4): the form `moepack run --io M --split N`
    passes down through the generation API."""
    mode, _, n = str(spec).partition(":")
    if mode not in IO_CHOICES:
        raise MoepackError(f"unknown io mode {spec!r}", hint=f"use one of {', '.join(IO_CHOICES)}")
    if not n:
        return mode, None
    try:
        return mode, int(n)
    except ValueError:
        raise MoepackError(f"bad io mode {spec!r}", hint="use MODE or MODE:SPLIT, e.g. hybrid:4") from None


def split_ranges(size: int, n: int, align: int = RECORD_ALIGN) -> list[tuple[int, int]]:
    """[start, end) of `n` near-equal chunks covering [0, size), inner boundaries on multiples of `align`
    (fewer chunks when `size` has fewer than `n` aligned blocks)."""
    blocks = -(-size // align)
    n = max(1, min(n, blocks))
    cuts = [min(size, (blocks * i // n) * align) for i in range(n + 1)]
    cuts[-1] = size
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def record_buffer(nbytes: int, align: int = BUFFER_ALIGN) -> np.ndarray:
    """A uint8 buffer aligned to `align`; below 2 MiB, deliberately *not* aligned to 2 x `align`, so a
    benchmark of 16 KiB-aligned destinations measures exactly that."""
    if align >= BUFFER_ALIGN:
        return aligned_empty(nbytes, align)
    raw = np.empty(nbytes + 2 * BUFFER_ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % BUFFER_ALIGN + align
    return raw[off : off + nbytes]


def _pread_full(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise PackedModelError(f"unexpected end of file reading {len(view)} bytes at offset {offset}")
        done += n

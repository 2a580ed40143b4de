"""The mincore hybrid reader and split reads: the run-splitting logic on hand-made residency vectors, then
byte-identical records from a real file on disk in every residency state (pages dropped with
posix_fadvise(DONTNEED), checked with mincore), for every mode and split."""

import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from moepack.errors import MoepackError
from moepack.iobench import _fs_type, write_synthetic_packed
from moepack.layout.reader import PackedModel
from moepack.runtime.io import ExpertReader, parse_io, record_buffer, split_ranges
from moepack.runtime import residency
from moepack.runtime.residency import PAGE_SIZE, FileMap, Run, evict, page_runs, read_plan

KiB = 1024

# ------------------------------------------------------------------------------------------------ pure logic


def test_page_runs_by_hand():
    assert page_runs(np.array([], bool)) == []
    assert page_runs(np.ones(5, bool)) == [(0, 5, True)]
    assert page_runs(np.zeros(3, bool)) == [(0, 3, False)]
    v = np.array([0, 0, 1, 1, 1, 0, 1], bool)  # holes at the start, in the middle; resident at the end
    assert page_runs(v) == [(0, 2, False), (2, 5, True), (5, 6, False), (6, 7, True)]


@pytest.mark.parametrize("vec, want", [
    ([1, 1, 1, 1], [(0, 16, True)]),  # all resident: one copy
    ([0, 0, 0, 0], [(0, 16, False)]),  # none: one pread
    ([0, 1, 1, 1], [(0, 4, False), (4, 16, True)]),  # hole at the start
    ([1, 0, 0, 1], [(0, 4, True), (4, 12, False), (12, 16, True)]),  # hole in the middle: ONE pread of 2 pages
    ([1, 1, 1, 0], [(0, 12, True), (12, 16, False)]),  # hole at the end
    ([0, 1, 0, 1], [(0, 4, False), (4, 8, True), (8, 12, False), (12, 16, True)]),
])
def test_read_plan_aligned(vec, want):
    """Page size 4, a 16-byte range at offset 8 (pages 2..5 of the file)."""
    runs = read_plan(np.array(vec, bool), 4, 8, 16)
    assert [(r.start, r.end, r.resident) for r in runs] == want
    assert sum(r.nbytes for r in runs) == 16


def test_read_plan_unaligned_range_is_clipped():
    # bytes 6..17 of a file with 4-byte pages: pages 1..4 (bytes 4..19); page 1 and 3 missing
    runs = read_plan(np.array([0, 1, 0, 1], bool), 4, 6, 12)
    assert runs == [Run(0, 2, False), Run(2, 6, True), Run(6, 10, False), Run(10, 12, True)]
    with pytest.raises(ValueError):
        read_plan(np.ones(3, bool), 4, 6, 12)  # 4 pages are needed


def test_split_ranges_by_hand():
    # the 397B 4-bit record: 432 blocks of 16 KiB -> 4 chunks of 108 blocks
    assert split_ranges(7_077_888, 4) == [(i * 1_769_472, (i + 1) * 1_769_472) for i in range(4)]
    assert split_ranges(7_077_888, 1) == [(0, 7_077_888)]
    # 5 blocks in 2 chunks: 2 blocks then 3; the end is the record end
    assert split_ranges(5 * 16 * KiB, 2) == [(0, 32 * KiB), (32 * KiB, 80 * KiB)]
    # fewer blocks than chunks: one chunk per block
    assert split_ranges(3 * 16 * KiB, 8) == [(0, 16 * KiB), (16 * KiB, 32 * KiB), (32 * KiB, 48 * KiB)]
    # a size that is not a multiple of 16 KiB: inner cuts aligned, last chunk ends at the size
    r = split_ranges(40 * KiB, 3)
    assert r[0][0] == 0 and r[-1][1] == 40 * KiB and all(a % (16 * KiB) == 0 for a, _ in r)


def test_record_buffer_alignment():
    for align in (16 * KiB, 64 * KiB):
        b = record_buffer(100_000, align)
        assert b.ctypes.data % align == 0 and b.ctypes.data % (2 * align) != 0 and b.nbytes == 100_000
    assert record_buffer(10, 2 * 1024 * KiB).ctypes.data % (2 * 1024 * KiB) == 0


def test_parse_io():
    assert parse_io("hybrid") == ("hybrid", None)
    assert parse_io("pread:4") == ("pread", 4)
    for bad in ("carrier-pigeon", "hybrid:x", "mmap:4:2"):
        with pytest.raises(MoepackError):
            parse_io(bad)


# ------------------------------------------------------------------------------------------------ a real file


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """16 records of the 397B 2-bit size (3,932,160 B) on the real disk, fsynced."""
    if sys.platform not in ("linux", "darwin"):
        pytest.skip("mincore is Linux/macOS only")
    root = tmp_path_factory.mktemp("hybrid")
    cleanup = None
    if _fs_type(root) in ("tmpfs", "ramfs"):  # its pages cannot be dropped: use a real disk
        disks = [Path(c) for c in ("/var/tmp", os.getcwd()) if _fs_type(Path(c)) not in ("tmpfs", "ramfs", "")]
        if not disks:
            pytest.skip("no folder on a real disk: pages of tmpfs cannot be dropped from the page cache")
        root = cleanup = Path(tempfile.mkdtemp(dir=disks[0], prefix="moepack-test-"))
    folder = write_synthetic_packed(root / "synthetic", 0.02, bits=2, seed=3)
    pm = PackedModel(folder)
    path = folder / pm.manifest.layers[0].file
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("posix_fadvise is Linux-only: page states cannot be set precisely here")
    if evict(path) > 0.01:
        pytest.skip("this file system cannot drop pages from the page cache (posix_fadvise DONTNEED ignored)")
    # no readahead on the readers' descriptor: a pread of one chunk must not cache pages of another chunk read
    # at the same time, or the copied/pread byte counts below would depend on timing
    os.posix_fadvise(pm.fd(0), 0, 0, os.POSIX_FADV_RANDOM)
    yield pm, path, path.read_bytes()
    pm.close()
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)


def _set_state(path, size, expert, state):
    """Make record `expert`'s pages resident per `state`; returns the wanted bool-per-page vector."""
    n = size // PAGE_SIZE
    want = {"all": np.ones(n, bool), "none": np.zeros(n, bool)}.get(state)
    if want is None:
        want = np.ones(n, bool)
        hole = {"start": slice(0, 100), "middle": slice(400, 520), "end": slice(n - 77, n),
                "scattered": slice(5, n - 5, 7)}[state]
        want[hole] = False
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: warm exactly the pages wanted
        buf = bytearray(PAGE_SIZE)
        for p in np.flatnonzero(want):
            os.preadv(fd, [buf], expert * size + int(p) * PAGE_SIZE)
    finally:
        os.close(fd)
    with FileMap(path) as fm:
        got = fm.resident(expert * size, size).copy()
    if not np.array_equal(got, want):
        pytest.skip(f"could not set page state {state!r} precisely ({int((got != want).sum())} pages differ)")
    return want


@pytest.mark.parametrize("probe", ["cachestat", "mincore-only"])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("state", ["all", "none", "start", "middle", "end", "scattered"])
def test_hybrid_is_byte_identical_in_every_residency_state(synth, state, split, probe, monkeypatch):
    pm, path, data = synth
    size = pm.layout(0).record_size
    expert = 5
    if probe == "mincore-only":
        monkeypatch.setattr(residency, "_CACHESTAT_NR", None)  # as on macOS and Linux < 6.5
    want_pages = _set_state(path, size, expert, state)
    with ExpertReader(pm, io="hybrid", threads=3, split=split) as reader:
        got = reader.read(0, [expert])[expert]
        raw = np.concatenate([got[c.name].view(np.uint8).reshape(-1) for c in pm.layout(0).components])
        st = reader.stats
    assert raw.tobytes() == data[expert * size: expert * size + raw.nbytes]  # the file's bytes, read independently
    # the hybrid really took both paths, in the amounts the page state implies
    missing = int((~want_pages).sum()) * PAGE_SIZE
    assert st.pread_bytes == missing and st.copied_bytes == size - missing
    holes = len([r for r in page_runs(want_pages) if not r[2]])
    assert holes <= st.pread_calls <= holes + split - 1  # one pread per hole (a chunk boundary may cut one in two)
    with FileMap(path) as fm:
        has_cachestat = fm.cached_pages(0, PAGE_SIZE) is not None
    if probe == "mincore-only" or not has_cachestat:
        assert st.cachestat_calls == 0 and st.mincore_calls == split and st.mincore_s > 0
    else:  # cachestat settles chunks wholly cached or wholly missing; mincore scans the rest
        assert st.cachestat_calls == split and st.cachestat_s > 0
        chunk_pages = [want_pages[a // PAGE_SIZE: b // PAGE_SIZE] for a, b in split_ranges(size, split)]
        assert st.mincore_calls == sum(1 for v in chunk_pages if 0 < v.sum() < v.size)


@pytest.mark.parametrize("mode", ["pread", "mmap", "hybrid", "direct"])
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_mode_and_split_returns_the_file_bytes(synth, mode, split):
    pm, path, data = synth
    size = pm.layout(0).record_size
    evict(path)
    experts = [9, 0, 15, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with ExpertReader(pm, io=mode, threads=2, split=split) as reader:
            for slot in (0, 1):  # cold, then warm
                got = reader.read(0, experts, slot=slot)
                for e in experts:
                    raw = np.concatenate([got[e][c.name].view(np.uint8).reshape(-1) for c in pm.layout(0).components])
                    assert raw.tobytes() == data[e * size: e * size + raw.nbytes], (mode, split, e)
            assert reader.stats.chunks == 2 * len(experts) * split
            assert reader.io in (mode, "pread")


def test_filemap_reports_what_was_read(synth):
    pm, path, _ = synth
    size = pm.layout(0).record_size
    want = _set_state(path, size, 2, "middle")
    with FileMap(path) as fm:
        assert np.array_equal(fm.resident(2 * size, size), want)
        n = fm.cached_pages(2 * size, size)
        if n is not None:  # cachestat (Linux 6.5+) counts what mincore sees
            assert n == int(want.sum())
            assert fm.cached_pages(2 * size + 400 * PAGE_SIZE, 120 * PAGE_SIZE) == 0  # the hole
        assert fm.resident(0, 10).tolist() == [False]  # record 0 was dropped; a partial page counts as one
        with pytest.raises(ValueError):
            fm.resident(fm.size - 10, 20)
    assert evict(path) < 0.01


@pytest.mark.parametrize("probe", ["cachestat", "mincore-only"])
@pytest.mark.parametrize("state", ["all", "none", "middle"])
def test_mapped_uses_a_wholly_cached_record_in_place_and_reads_the_rest(synth, state, probe, monkeypatch):
    """io='mapped': a record whose pages are all cached is handed back as a view of the mapping (nothing copied,
    no read task); any other record is read as hybrid reads it. Either way the bytes are the file's."""
    pm, path, data = synth
    size = pm.layout(0).record_size
    expert = 7
    if probe == "mincore-only":
        monkeypatch.setattr(residency, "_CACHESTAT_NR", None)
    want_pages = _set_state(path, size, expert, state)
    with ExpertReader(pm, io="mapped", threads=2) as reader:
        pending = reader.submit(0, [expert])
        rec = pending.records()[expert]
        got = pending.wait()[expert]
        raw = np.concatenate([got[c.name].view(np.uint8).reshape(-1) for c in pm.layout(0).components])
        st = reader.stats
        assert raw.tobytes() == data[expert * size: expert * size + raw.nbytes]
        in_place = bool(want_pages.all())
        assert (st.mapped_reads, st.mapped_bytes) == ((1, size) if in_place else (0, 0))
        assert st.chunks == (0 if in_place else 1)
        # in place: the record's memory IS the mapping (read-only); otherwise one of the reader's own buffers
        assert (not rec.flags.writeable) == in_place
        if not in_place:
            missing = int((~want_pages).sum()) * PAGE_SIZE
            assert st.pread_bytes == missing and st.copied_bytes == size - missing


def test_model_logits_are_identical_with_mapped_and_pread(mlx_ckpt, tmp_path):
    """The in-place records of io='mapped' feed the kernels exactly the bytes a pread would."""
    from moepack.convert import convert
    from moepack.runtime.model import load_model

    out = tmp_path / "packed"
    convert(mlx_ckpt, out, bits=4, progress=False)
    ids = np.array([1, 37, 200, 5, 88, 410, 17, 3])
    logits = {}
    for io in ("pread", "mapped"):
        with load_model(out, backend="numpy", io=io) as m:
            cache = m.new_cache()
            logits[io] = [m.forward(ids, cache), m.forward(np.array([5]), cache)]
            if io == "mapped":  # the packed files were just written, so they are cached: used in place
                assert m.reader.stats.mapped_reads > 0
    for a, b in zip(logits["pread"], logits["mapped"]):
        assert np.array_equal(a, b)


def test_completed_yields_each_expert_once_with_its_bytes_and_reports_a_failed_read(synth, monkeypatch):
    pm, path, data = synth
    size = pm.layout(0).record_size
    experts = [3, 11, 0, 6]
    with ExpertReader(pm, io="pread", threads=2, split=2) as reader:
        seen = []
        for e, arrays in reader.submit(0, experts).completed():
            raw = np.concatenate([arrays[c.name].view(np.uint8).reshape(-1) for c in pm.layout(0).components])
            assert raw.tobytes() == data[e * size: e * size + raw.nbytes]
            seen.append(e)
        assert sorted(seen) == sorted(experts)
        real = reader._read_pread

        def flaky(layer, offset, dst):
            if offset == 11 * size:
                raise OSError(5, "Input/output error")
            return real(layer, offset, dst)

        monkeypatch.setattr(reader, "_read_pread", flaky)
        with pytest.raises(OSError, match="Input/output"):
            list(reader.submit(0, experts, slot=1).completed())


@pytest.mark.parametrize("probe", ["cachestat", "mincore-only"])
def test_hybrid_reads_a_mostly_missing_record_in_one_pread(synth, probe, monkeypatch):
    """A record with only a small cached prefix (what readahead leaves behind) is one pread, not copy + pread."""
    pm, path, data = synth
    size = pm.layout(0).record_size
    n = size // PAGE_SIZE
    if probe == "mincore-only":
        monkeypatch.setattr(residency, "_CACHESTAT_NR", None)
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.preadv(fd, [bytearray(32 * PAGE_SIZE)], 4 * size)  # the first 32 of n pages of record 4
    finally:
        os.close(fd)
    with FileMap(path) as fm:
        if int(fm.resident(4 * size, size).sum()) != 32:
            pytest.skip("could not set the page state precisely")
    with ExpertReader(pm, io="hybrid", threads=1) as reader:
        got = reader.read(0, [4])[4]
        st = reader.stats
    raw = np.concatenate([got[c.name].view(np.uint8).reshape(-1) for c in pm.layout(0).components])
    assert raw.tobytes() == data[4 * size: 4 * size + raw.nbytes]
    assert 32 < n // 2
    assert (st.pread_calls, st.pread_bytes, st.copied_bytes) == (1, size, 0)

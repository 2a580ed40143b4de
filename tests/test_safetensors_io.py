"""Raw safetensors reading/writing: round trips against the reference library and mlx, hostile files refused."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from moepack.errors import CorruptFileError, MoepackError, ShapeError, SourceError
from moepack.source import safetensors_file as stf
from moepack.source.safetensors_file import (
    DTYPES,
    SafetensorsFile,
    TensorInfo,
    bf16_to_f32,
    f32_to_bf16,
    write_safetensors,
)


def _sample(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    np_dtype = DTYPES[dtype][0]
    n = int(np.prod(shape))
    if dtype == "BOOL":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype == "BF16":
        return f32_to_bf16(rng.standard_normal(n).astype(np.float32)).reshape(shape)
    if dtype == "C64":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np_dtype).reshape(shape)
    if np_dtype.kind == "f":
        return rng.standard_normal(n).astype(np_dtype).reshape(shape)
    info = np.iinfo(np_dtype)
    return rng.integers(info.min, info.max, n, dtype=np_dtype, endpoint=True).reshape(shape)


def _all_dtype_tensors(seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i, dtype in enumerate(DTYPES):
        shape = (3, i + 1) if i % 3 else (i + 2,)
        out.append((f"t.{dtype.lower()}", dtype, shape, _sample(dtype, shape, rng)))
    out.append(("empty", "F32", (0, 4), np.zeros((0, 4), np.float32)))
    out.append(("scalar", "I64", (), np.array(-7, np.int64)))
    return out


def test_roundtrip_every_dtype_against_reference_library(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open

    tensors = _all_dtype_tensors()
    path = write_safetensors(tmp_path / "all.safetensors", tensors, {"format": "mlx", "note": "ü"})
    assert not (tmp_path / "all.safetensors.tmp").exists()
    assert (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 8 == 0  # header padded to 8

    with SafetensorsFile(path) as f:
        assert list(f.tensors) == [t[0] for t in tensors]
        assert f.metadata == {"format": "mlx", "note": "ü"}
        for name, dtype, shape, data in tensors:
            info = f.tensors[name]
            assert (info.dtype, info.shape, info.nbytes) == (dtype, shape, data.nbytes)
            got = f.read(name)
            assert got.dtype == DTYPES[dtype][0] and got.shape == shape
            np.testing.assert_array_equal(got, data)
            assert f.read_bytes(name) == data.tobytes()
            assert got.flags.writeable

    # The reference implementation reads every dtype numpy has (not BF16, not F8).
    numpy_ok = {"BOOL", "U8", "I8", "U16", "I16", "F16", "U32", "I32", "F32", "U64", "I64", "F64"}
    with safe_open(str(path), "numpy") as g:
        assert g.metadata() == {"format": "mlx", "note": "ü"}
        for name, dtype, shape, data in tensors:
            if dtype in numpy_ok:
                np.testing.assert_array_equal(g.get_tensor(name), data)

    # ... and we read what it writes.
    ref = {n: d for n, dt, _, d in tensors if dt in numpy_ok}
    ref_path = tmp_path / "ref.safetensors"
    safetensors_numpy.save_file(ref, str(ref_path), metadata={"k": "v"})
    with SafetensorsFile(ref_path) as f:
        assert f.metadata == {"k": "v"}
        for name, data in ref.items():
            np.testing.assert_array_equal(f.read(name), data)


def test_roundtrip_with_mlx(tmp_path):
    mx = pytest.importorskip("mlx.core")
    # mlx reads every dtype it has: not F64, not the F8 formats
    tensors = [t for t in _all_dtype_tensors(1) if not t[1].startswith("F8_") and t[1] != "F64"]
    path = write_safetensors(tmp_path / "a.safetensors", tensors)
    loaded = mx.load(str(path))
    assert set(loaded) == {t[0] for t in tensors}
    for name, dtype, shape, data in tensors:
        arr = loaded[name]
        assert tuple(arr.shape) == shape
        if dtype == "BF16":
            assert arr.dtype == mx.bfloat16
            np.testing.assert_array_equal(np.array(arr.astype(mx.float32)), bf16_to_f32(data))
        else:
            np.testing.assert_array_equal(np.array(arr), data)

    # mlx's own writer (bf16 included) is read back bit-exactly
    x = mx.random.normal((5, 7)).astype(mx.bfloat16)
    q = mx.arange(12, dtype=mx.uint32).reshape(3, 4)
    mx.save_safetensors(str(tmp_path / "m.safetensors"), {"x": x, "q": q}, metadata={"format": "mlx"})
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        assert f.tensors["x"].dtype == "BF16" and f.metadata == {"format": "mlx"}
        np.testing.assert_array_equal(f.read("x"), np.array(x.view(mx.uint16)))
        np.testing.assert_array_equal(f.read("q"), np.array(q))
        np.testing.assert_array_equal(bf16_to_f32(f.read("x")), np.array(x.astype(mx.float32)))


def test_bf16_conversion_rounds_to_nearest_even():
    vals = np.array([1.0, -2.5, 0.0, np.inf, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.0e38], np.float32)
    bits = f32_to_bf16(vals)
    assert bits.dtype == np.uint16
    assert bits[0] == 0x3F80 and bits[1] == 0xC020 and bits[2] == 0 and bits[3] == 0x7F80
    assert bits[4] == 0x3F80  # tie -> even (down)
    assert bits[5] == 0x3F82  # tie -> even (up)
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]
    mx = pytest.importorskip("mlx.core")
    r = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    np.testing.assert_array_equal(f32_to_bf16(r), np.array(mx.array(r).astype(mx.bfloat16).view(mx.uint16)))


def test_lazy_producers_bytes_and_read_into(tmp_path):
    calls = []

    def producer():
        calls.append(1)
        return np.arange(6, dtype=np.float32).reshape(2, 3)

    path = write_safetensors(
        tmp_path / "x.safetensors",
        [("lazy", "F32", (2, 3), producer), ("raw", "U8", [4], b"\x01\x02\x03\x04"), ("bf", "BF16", (2,), bytes(4))],
    )
    assert calls == [1]
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("lazy"), np.arange(6, dtype=np.float32).reshape(2, 3))
        assert f.read_bytes("raw") == b"\x01\x02\x03\x04"
        out = bytearray(24)
        f.read_into("lazy", out)
        assert bytes(out) == np.arange(6, dtype=np.float32).tobytes()
        with pytest.raises(ValueError):
            f.read_into("lazy", bytearray(8))
        with pytest.raises(SourceError, match="no tensor named 'nope'"):
            f.read("nope")
        assert isinstance(f.tensors["raw"], TensorInfo) and f.tensors["raw"].nbytes == 4


def test_short_reads_are_completed(tmp_path, monkeypatch):
    data = np.random.default_rng(0).standard_normal((33, 17)).astype(np.float32)
    path = write_safetensors(tmp_path / "s.safetensors", [("w", "F32", data.shape, data)])
    real_preadv, real_pread = os.preadv, os.pread

    def stingy_preadv(fd, buffers, offset):
        return real_preadv(fd, [memoryview(buffers[0])[:5]], offset)

    def stingy_pread(fd, n, offset):
        return real_pread(fd, min(n, 7), offset)

    monkeypatch.setattr(os, "preadv", stingy_preadv, raising=False)
    monkeypatch.setattr(os, "pread", stingy_pread)
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("w"), data)
        assert f.read_bytes("w") == data.tobytes()
    monkeypatch.delattr(os, "preadv", raising=False)
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("w"), data)


def test_file_truncated_after_open_is_reported(tmp_path):
    data = np.ones((64,), np.float32)
    path = write_safetensors(tmp_path / "t.safetensors", [("a", "F32", (64,), data), ("b", "F32", (64,), data)])
    f = SafetensorsFile(path)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CorruptFileError, match="changed size|end of file"):
        f.read("b")
    f.close()


# ------------------------------------------------------------------ hostile files
def _raw(header: dict | bytes, data: bytes = b"", n: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if n is None else n) + body + data


def _t(dtype, shape, offsets) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _ok_header():
    return {"a": _t("F32", [2, 2], [0, 16]), "b": _t("U8", [4], [16, 20])}


_DUP = (
    b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
    b' "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
)

HOSTILE = {  # case -> (file bytes, expected text in the one-line message)
    "too_short": (b"\x01\x00\x00", "too short"),
    "empty": (b"", "too short"),
    "header_len_past_eof": (_raw(_ok_header(), bytes(20), n=10_000), "runs past the end"),
    "huge_header_len": (_raw(_ok_header(), bytes(20), n=2**63 + 5), "exceeds"),
    "not_json": (_raw(b"{this is not json}", bytes(20)), "not valid JSON"),
    "not_utf8": (_raw(b'{"a\xff\xfe": 1}'), "UTF-8"),
    "not_object": (_raw(b"[1, 2, 3]"), "JSON object"),
    "nan_constant": (_raw(b'{"__metadata__": {"x": NaN}}'), "not valid JSON"),
    "duplicate_key": (_raw(_DUP, bytes(2)), "duplicate"),
    "truncated_data": (_raw(_ok_header(), bytes(18)), "truncated: tensor 'b'"),
    "overlap": (_raw({"a": _t("F32", [4], [0, 16]), "b": _t("F32", [2], [8, 16])}, bytes(16)), "overlap"),
    "hole": (_raw({"a": _t("U8", [4], [0, 4]), "b": _t("U8", [4], [8, 12])}, bytes(12)), "unindexed"),
    "trailing_bytes": (_raw(_ok_header(), bytes(24)), "after the last tensor"),
    "size_shape_mismatch": (_raw({"a": _t("F32", [2, 3], [0, 16])}, bytes(16)), "needs 24"),
    "unknown_dtype": (_raw({"a": _t("F128", [1], [0, 16])}, bytes(16)), "unknown dtype 'F128'"),
    "negative_dim": (_raw({"a": _t("U8", [-1, 4], [0, 4])}, bytes(4)), "non-negative"),
    "float_dim": (_raw({"a": _t("U8", [4.0], [0, 4])}, bytes(4)), "non-negative"),
    "bool_dim": (_raw({"a": _t("U8", [True], [0, 1])}, bytes(1)), "non-negative"),
    "offsets_reversed": (_raw({"a": _t("U8", [0], [4, 0])}, bytes(4)), "end before"),
    "offsets_missing": (_raw({"a": {"dtype": "U8", "shape": [4]}}, bytes(4)), "data_offsets"),
    "entry_not_object": (_raw({"a": [1, 2]}), "not an object"),
    "bad_metadata": (_raw({"__metadata__": {"k": 1}}), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_refused(tmp_path, case):
    blob, expected = HOSTILE[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CorruptFileError) as err:
        SafetensorsFile(path)
    msg = str(err.value)
    assert expected in msg
    assert str(path) in msg and "\n" not in msg
    assert err.value.hint


def test_valid_handmade_file_with_padding_is_accepted(tmp_path):
    body = json.dumps(_ok_header()).encode() + b"    "
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_raw(body, np.arange(4, dtype=np.float32).tobytes() + b"\x01\x02\x03\x04"))
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("a"), np.arange(4, dtype=np.float32).reshape(2, 2))
        assert f.read("b").tolist() == [1, 2, 3, 4]


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        SafetensorsFile(tmp_path / "absent.safetensors")
    with pytest.raises(SourceError, match="not a regular file"):
        SafetensorsFile(tmp_path)


# ------------------------------------------------------------------ writer
def test_atomic_write_leaves_nothing_when_producer_fails(tmp_path):
    path = tmp_path / "out.safetensors"

    def boom():
        raise RuntimeError("source went away")

    tensors = [("a", "F32", (1024,), np.zeros(1024, np.float32)), ("b", "F32", (4,), boom)]
    with pytest.raises(RuntimeError, match="source went away"):
        write_safetensors(path, tensors)
    assert not path.exists() and not (tmp_path / "out.safetensors.tmp").exists()

    # an existing file is left untouched by a failed rewrite
    write_safetensors(path, [("old", "U8", (3,), b"abc")])
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        write_safetensors(path, tensors)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["out.safetensors"]


@pytest.mark.parametrize(
    "tensors, match",
    [
        ([("a", "F32", (3,), np.zeros(4, np.float32))], "does not fit shape"),
        ([("a", "F32", (3,), lambda: b"\x00" * 8)], "needs 12"),
        ([("a", "BF16", (3,), np.zeros(3, np.float32))], "does not carry BF16"),
        ([("a", "Q4", (3,), b"")], "unknown dtype"),
        ([("a", "U8", (-1,), b"")], "non-negative"),
        ([("a", "U8", (1,), b"x"), ("a", "U8", (1,), b"y")], "listed twice"),
        ([("a", "U8", (1,), [1])], "expected a numpy array or bytes"),
    ],
)
def test_writer_rejects_bad_input(tmp_path, tensors, match):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(ShapeError, match=match):
        write_safetensors(path, tensors)
    assert os.listdir(tmp_path) == []


def test_writer_converts_byte_order_and_layout(tmp_path):
    big = np.arange(6, dtype=">u4").reshape(2, 3)
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    path = write_safetensors(tmp_path / "b.safetensors", [("big", "U32", (2, 3), big), ("s", "F32", (3, 2), strided)])
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("big"), big)
        np.testing.assert_array_equal(f.read("s"), strided)


def test_write_into_missing_folder_is_output_error(tmp_path):
    with pytest.raises(MoepackError, match="cannot write"):
        write_safetensors(tmp_path / "no" / "such" / "x.safetensors", [("a", "U8", (1,), b"x")])


def test_chunked_io_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(stf, "_IO_CHUNK", 7)  # exercise multi-call reads and writes
    data = np.random.default_rng(1).integers(0, 2**32, 101, dtype=np.uint32)
    path = write_safetensors(tmp_path / "c.safetensors", [("w", "U32", (101,), data)])
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("w"), data)
        assert f.read_bytes("w") == data.tobytes()

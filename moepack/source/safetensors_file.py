"""Raw, validated safetensors access without loading a whole file.

The safetensors format (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 ``N``, then ``N``
bytes of UTF-8 JSON (an object mapping tensor names to ``{"dtype", "shape", "data_offsets"}`` plus an optional
``"__metadata__"`` str->str map; it may be padded at the end with spaces), then the byte buffer. ``data_offsets``
are ``[begin, end)`` relative to the start of the byte buffer; the tensors tile the buffer without overlaps or holes.

Everything in a header is checked before it is used (the file may be truncated, hostile or half-downloaded).
Tensor data is read with ``os.pread``/``os.preadv`` on a descriptor opened on first use, so readers in several
threads can share one :class:`SafetensorsFile`.

numpy has no bfloat16: BF16 tensors are carried as ``uint16`` arrays holding the raw bits
(:func:`bf16_to_f32` / :func:`f32_to_bf16` convert). All multi-byte dtypes are little-endian, as the format demands.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import numpy as np

from ..errors import CorruptFileError, DiskSpaceError, OutputError, ShapeError, SourceError
from ..layout.atomic import fsync_dir

# safetensors dtype string -> (numpy dtype used to carry it, itemsize in bytes)
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "BOOL": (np.dtype("bool"), 1),
    "U8": (np.dtype("u1"), 1),
    "I8": (np.dtype("i1"), 1),
    "F8_E4M3": (np.dtype("u1"), 1),  # raw bits
    "F8_E5M2": (np.dtype("u1"), 1),  # raw bits
    "F8_E8M0": (np.dtype("u1"), 1),  # raw bits
    "U16": (np.dtype("<u2"), 2),
    "I16": (np.dtype("<i2"), 2),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),  # raw bits
    "U32": (np.dtype("<u4"), 4),
    "I32": (np.dtype("<i4"), 4),
    "F32": (np.dtype("<f4"), 4),
    "U64": (np.dtype("<u8"), 8),
    "I64": (np.dtype("<i8"), 8),
    "F64": (np.dtype("<f8"), 8),
    "C64": (np.dtype("<c8"), 8),
}

MAX_HEADER_BYTES = 100_000_000  # the limit the reference implementation enforces
_IO_CHUNK = 1 << 30  # macOS refuses single reads/writes above INT_MAX; stay well below

TensorData = Union[np.ndarray, bytes, bytearray, memoryview]
TensorSource = Union[TensorData, Callable[[], TensorData]]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. ``start``/``end`` are ABSOLUTE byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype][0]


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32, exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 expects uint16 raw bits, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest, ties to even; NaN stays NaN), as uint16 raw bits."""
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-standard JSON constant {token}")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


class SafetensorsFile:
    """A validated safetensors file: header parsed on construction, tensor bytes read on demand.

    Attributes: ``path`` (Path), ``tensors`` (name -> :class:`TensorInfo`, in header order), ``metadata``
    (the ``__metadata__`` map, ``{}`` when absent), ``header_size`` (8 + N: where the byte buffer starts),
    ``file_size``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._parse()

    # ---------------------------------------------------------------- header
    def _corrupt(self, what: str, hint: str | None = None) -> CorruptFileError:
        return CorruptFileError(f"{self.path}: {what}", hint)

    def _parse(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise SourceError(f"{self.path}: no such file", "check the path; the download may be incomplete") from None
        except OSError as e:
            raise SourceError(f"{self.path}: cannot open ({e.strerror})", "check the file's permissions") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SourceError(f"{self.path}: not a regular file", "pass a .safetensors file")
            size = st.st_size
            self.file_size = size
            if size < 8:
                raise self._corrupt(f"{size} bytes, too short for a safetensors file (needs at least 8)")
            n = int.from_bytes(_pread_exact(fd, 8, 0, self.path, "the header length"), "little")
            if n > MAX_HEADER_BYTES:
                raise self._corrupt(f"header length {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + n > size:
                raise self._corrupt(f"header length {n} bytes runs past the end of the {size}-byte file")
            raw = _pread_exact(fd, n, 8, self.path, "the header")
        finally:
            os.close(fd)
        self.header_size = 8 + n
        self._parse_header(raw, size)

    def _parse_header(self, raw: bytes, size: int) -> None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._corrupt(f"header is not valid UTF-8 (byte {e.start})") from None
        if not text.startswith("{"):
            raise self._corrupt("header does not start with a JSON object ('{')")
        try:
            header = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
        except ValueError as e:  # JSONDecodeError is a ValueError
            raise self._corrupt(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")

        meta = header.pop("__metadata__", None)
        if meta is not None:
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise self._corrupt("__metadata__ must be a map of strings to strings")
            self.metadata = dict(meta)

        base = self.header_size
        buffer_len = size - base
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            where = f"tensor {name!r}"
            if not isinstance(entry, dict):
                raise self._corrupt(f"{where}: header entry is not an object")
            dtype = entry.get("dtype")
            shape = entry.get("shape")
            offsets = entry.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise self._corrupt(
                    f"{where}: unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})",
                    "this file uses a dtype moepack cannot read; "
                    "re-export it in BF16/F16/F32 or a supported quantization",
                )
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise self._corrupt(f"{where}: shape {shape!r} is not a list of non-negative integers")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(_is_int(o) and o >= 0 for o in offsets)
            ):
                raise self._corrupt(f"{where}: data_offsets {offsets!r} is not a pair of non-negative integers")
            begin, end = offsets
            if begin > end:
                raise self._corrupt(f"{where}: data_offsets [{begin}, {end}] end before they begin")
            expected = math.prod(shape) * DTYPES[dtype][1]
            if end - begin != expected:
                raise self._corrupt(
                    f"{where}: {end - begin} bytes of data but shape {tuple(shape)} x {dtype} needs {expected}"
                )
            if end > buffer_len:
                raise self._corrupt(
                    f"truncated: {where} ends at byte {base + end} but the file has only {size} bytes",
                    "the file is incomplete (interrupted download or copy); download or convert it again",
                )
            tensors[name] = TensorInfo(name, dtype, tuple(shape), base + begin, base + end)

        # The spec demands the tensors tile the byte buffer: no overlaps, no holes, nothing after the last one.
        ordered = sorted((t for t in tensors.values() if t.nbytes > 0), key=lambda t: (t.start, t.end))
        pos = base
        prev: TensorInfo | None = None
        for t in ordered:
            if t.start < pos:
                raise self._corrupt(f"tensors {prev.name!r} and {t.name!r} overlap (bytes {t.start}..{pos})")
            if t.start > pos:
                raise self._corrupt(f"{t.start - pos} unindexed bytes before tensor {t.name!r} (at byte {pos})")
            pos = t.end
            prev = t
        if pos != size:
            raise self._corrupt(f"{size - pos} bytes after the last tensor are not indexed by the header")
        self.tensors = tensors

    # ---------------------------------------------------------------- access
    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SourceError(
                f"{self.path}: no tensor named {name!r}", "the checkpoint does not match what the caller expects"
            ) from None

    def _descriptor(self) -> int:
        fd = self._fd
        if fd is not None:
            return fd
        with self._lock:
            if self._fd is None:
                try:
                    fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise SourceError(f"{self.path}: cannot open ({e.strerror})") from None
                now = os.fstat(fd).st_size
                if now != self.file_size:
                    os.close(fd)
                    raise self._corrupt(
                        f"changed size since its header was read ({self.file_size} -> {now} bytes)",
                        "another process is writing this file; wait for it to finish and retry",
                    )
                self._fd = fd
            return self._fd

    def read_into(self, name: str, out: Any) -> None:
        """Read tensor ``name``'s raw bytes into the writable buffer ``out`` (exactly ``nbytes`` long)."""
        info = self.info(name)
        view = memoryview(out).cast("B")
        if view.readonly or view.nbytes != info.nbytes:
            raise ValueError(f"read_into({name!r}): needs a writable buffer of {info.nbytes} bytes")
        _pread_into(self._descriptor(), view, info.start, self.path, f"tensor {name!r}")

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a fresh, writable numpy array of its dtype (BF16 as uint16 bits) and shape."""
        info = self.info(name)
        buf = np.empty(info.nbytes, dtype=np.uint8)
        if info.nbytes:
            _pread_into(self._descriptor(), memoryview(buf), info.start, self.path, f"tensor {name!r}")
        return buf.view(info.np_dtype).reshape(info.shape)

    def read_bytes(self, name: str) -> bytes:
        """Tensor ``name``'s raw little-endian bytes."""
        info = self.info(name)
        if not info.nbytes:
            return b""
        return _pread_exact(self._descriptor(), info.nbytes, info.start, self.path, f"tensor {name!r}")

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.tensors)} tensors)"


def _pread_into(fd: int, view: memoryview, offset: int, path: Path, what: str) -> None:
    got = 0
    total = view.nbytes
    preadv = getattr(os, "preadv", None)
    while got < total:
        want = min(total - got, _IO_CHUNK)
        if preadv is not None:
            n = preadv(fd, [view[got : got + want]], offset + got)
        else:
            data = os.pread(fd, want, offset + got)
            n = len(data)
            view[got : got + n] = data
        if n == 0:
            raise CorruptFileError(
                f"{path}: end of file while reading {what} (got {got} of {total} bytes)",
                "the file was truncated after it was opened; download or convert it again",
            )
        got += n


def _pread_exact(fd: int, nbytes: int, offset: int, path: Path, what: str) -> bytes:
    data = os.pread(fd, min(nbytes, _IO_CHUNK), offset)  # one call in the common case
    if len(data) == nbytes:
        return data
    buf = bytearray(nbytes)
    buf[: len(data)] = data
    if len(data) == 0 and nbytes:
        raise CorruptFileError(f"{path}: end of file while reading {what} (got 0 of {nbytes} bytes)")
    _pread_into(fd, memoryview(buf)[len(data) :], offset + len(data), path, what)
    return bytes(buf)


# -------------------------------------------------------------------- writing
def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise ShapeError(f"tensor {name!r}: shape {shape!r} is not a sequence of integers") from None
    for d in dims:
        if not (isinstance(d, (int, np.integer)) and not isinstance(d, bool)) or d < 0:
            raise ShapeError(f"tensor {name!r}: shape {shape!r} is not a sequence of non-negative integers")
    return tuple(int(d) for d in dims)


def _as_byte_view(name: str, dtype: str, shape: tuple[int, ...], nbytes: int, data: Any) -> memoryview:
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        if not view.c_contiguous:
            raise ShapeError(f"tensor {name!r}: buffer is not contiguous")
        view = view.cast("B")
    else:
        if not isinstance(data, np.ndarray):
            raise ShapeError(
                f"tensor {name!r}: data is a {type(data).__name__}, expected a numpy array or bytes",
                "convert the tensor with numpy (bf16 as uint16 raw bits) before writing",
            )
        expected = DTYPES[dtype][0]
        if data.dtype != expected:
            same_kind = data.dtype.kind == expected.kind and data.dtype.itemsize == expected.itemsize
            if not same_kind:  # only a byte-order difference may be converted
                raise ShapeError(
                    f"tensor {name!r}: array dtype {data.dtype} does not carry {dtype} (expects {expected})",
                    "bf16 tensors are written from uint16 raw bits; convert the array first",
                )
        if data.size != math.prod(shape):
            raise ShapeError(f"tensor {name!r}: array of shape {data.shape} does not fit shape {shape}")
        arr = np.ascontiguousarray(data, dtype=expected)
        view = memoryview(arr.reshape(-1).view(np.uint8))
    if view.nbytes != nbytes:
        raise ShapeError(f"tensor {name!r}: {view.nbytes} bytes of data but shape {shape} x {dtype} needs {nbytes}")
    return view


def _output_error(path: Path, e: OSError) -> Exception:
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return DiskSpaceError(f"{path}: disk full while writing ({e.strerror})")
    return OutputError(f"{path}: cannot write ({e.strerror})", "check that the folder exists and is writable")


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, str, Sequence[int], TensorSource]],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a safetensors file atomically, streaming one tensor at a time.

    ``tensors`` is an ordered iterable of ``(name, dtype, shape, data)``: ``dtype`` a safetensors dtype string
    (``'BF16'``, ``'U32'``, ...), ``data`` a numpy array (BF16 as uint16 bits), bytes, or a zero-argument callable
    returning one of those (called when the tensor's turn comes, so tensors can be streamed from another file).
    The data's size must match ``shape`` x ``dtype``. The file is written to ``path + '.tmp'``, fsynced, then
    renamed over ``path``; on any error the temporary file is removed and ``path`` is left untouched.
    Returns ``Path(path)``.
    """
    path = Path(path)
    entries: list[tuple[str, str, tuple[int, ...], Any, int]] = []
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ShapeError(f"{path}: safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for item in tensors:
        name, dtype, shape, data = item
        if not isinstance(name, str) or name == "__metadata__":
            raise ShapeError(f"{path}: invalid tensor name {name!r}")
        if name in header:
            raise ShapeError(f"{path}: tensor {name!r} listed twice")
        if dtype not in DTYPES:
            raise ShapeError(
                f"{path}: tensor {name!r} has unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
            )
        dims = _check_shape(name, shape)
        nbytes = math.prod(dims) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
        entries.append((name, dtype, dims, data, nbytes))
        offset += nbytes

    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # the spec allows trailing spaces; align the byte buffer to 8

    tmp = Path(str(path) + ".tmp")
    try:
        f = open(tmp, "wb")
    except OSError as e:
        raise _output_error(tmp, e) from None
    done = False
    try:
        try:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
        except OSError as e:
            raise _output_error(tmp, e) from None
        for name, dtype, dims, data, nbytes in entries:
            if callable(data):
                data = data()  # the producer's own errors propagate unchanged
            view = _as_byte_view(name, dtype, dims, nbytes, data)
            try:
                for start in range(0, nbytes, _IO_CHUNK):
                    f.write(view[start : start + _IO_CHUNK])
            except OSError as e:
                raise _output_error(tmp, e) from None
            del view, data
        try:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, path)
        except OSError as e:
            raise _output_error(path, e) from None
        done = True
    finally:
        if not done:
            f.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
    fsync_dir(path.parent)
    return path

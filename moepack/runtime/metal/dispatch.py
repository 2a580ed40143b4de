"""One kernel launch (`Dispatch`) and the `Executor` protocol every Metal-plan executor implements.

A launch plan is a list of Dispatch records: which kernel of which `metal/*.metal` file, which numpy
array or scalar at which `[[buffer(n)]]` index, and the grid geometry. The same list runs on the CPU
emulator ("metal-emu"), on NVIDIA through PTX ("cuda") and on Apple Metal ("metal").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from moepack.errors import MoepackError


class KernelError(MoepackError):
    """A kernel source, launch or kernel run the Metal backend cannot accept: compile errors, dtype or
    buffer-index mismatches, barrier divergence. The emulator exports it as `EmulatorError`."""

    default_hint = "see metal-interface.md for the kernel ABI conventions"


@dataclass(frozen=True)
class Dispatch:
    source: str                        # file name inside metal/, e.g. "norm.metal"
    kernel: str                        # kernel function name in that file
    args: Mapping[int, Any]            # [[buffer(n)]] index -> numpy array (device buffer; kernels write
                                       #   non-const buffers IN PLACE), a DeviceBuffer of the executor
                                       #   (stays on the device), or python/numpy scalar (constant T&)
    grid: tuple[int, int, int]         # threadgroups per grid (Metal dispatchThreadgroups / CUDA gridDim)
    threadgroup: tuple[int, int, int]  # threads per threadgroup (blockDim); x*y*z <= 1024
    label: str = ""


class Executor(Protocol):
    name: str  # "metal-emu", "cuda", "metal"

    def run(self, dispatches: Sequence[Dispatch]) -> None:
        """Run the dispatches as one command buffer, in order, synchronously."""
        ...

    # Optional (executors that keep state on the device between runs: see DeviceBuffer and has_buffers):
    #   alloc(shape, dtype) -> DeviceBuffer     zero-filled persistent device memory
    #   upload(buf, array) -> None              host -> device (array's size and dtype must match buf's)
    #   download(buf) -> np.ndarray             device -> host (a new array of buf's shape and dtype)


class DeviceBuffer:
    """Persistent memory of one executor (the KV cache, activations of the resident decode step).

    A Dispatch may carry it in ``args`` where a kernel takes a buffer: the executor binds its own memory,
    nothing is copied to or from the host by ``run()``. ``storage`` is the executor's object for the whole
    allocation (a numpy uint8 array on the emulator, a cupy uint8 array on CUDA, an MTLBuffer on Metal);
    ``offset`` (bytes) and ``shape``/``dtype`` select a contiguous part of it, so ``view()`` gives a
    sub-buffer (a head's rows, the KV cache row of one position) without a copy.
    """

    __slots__ = ("storage", "offset", "shape", "dtype", "capacity")

    def __init__(self, storage, shape, dtype, offset: int = 0, capacity: int | None = None):
        self.storage = storage
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.offset = int(offset)
        self.capacity = int(capacity if capacity is not None else offset + self.nbytes)  # bytes of storage

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def view(self, start: int = 0, shape=None, dtype=None) -> "DeviceBuffer":
        """The contiguous part from element `start` (in this buffer's dtype) with `shape` (default: the rest,
        flat), read as `dtype` (default: this one's)."""
        dt = self.dtype if dtype is None else np.dtype(dtype)
        off = self.offset + int(start) * self.dtype.itemsize
        if shape is None:
            shape = ((self.offset + self.nbytes - off) // dt.itemsize,)
        v = DeviceBuffer(self.storage, shape if isinstance(shape, tuple) else (shape,), dt, off, self.capacity)
        if int(start) < 0 or off + v.nbytes > self.offset + self.nbytes or off % dt.itemsize:
            raise KernelError(f"device buffer view [{start}:+{v.size}] as {dt} does not fit {self!r}")
        return v

    def reshape(self, *shape) -> "DeviceBuffer":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        v = DeviceBuffer(self.storage, shape, self.dtype, self.offset, self.capacity)
        if v.size != self.size:
            raise KernelError(f"cannot reshape {self!r} to {shape}")
        return v

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.dtype}[{', '.join(map(str, self.shape))}] @ {self.offset})"


def has_buffers(executor) -> bool:
    """Whether `executor` keeps DeviceBuffers (alloc / upload / download)."""
    return all(callable(getattr(executor, m, None)) for m in ("alloc", "upload", "download"))


def host_view(storage: np.ndarray, buf: DeviceBuffer) -> np.ndarray:
    """The numpy view of `buf` inside a host-memory storage array (uint8): emulator and plan executors."""
    return storage[buf.offset : buf.offset + buf.nbytes].view(buf.dtype).reshape(buf.shape)


def host_alloc(shape, dtype) -> DeviceBuffer:
    """A DeviceBuffer in host memory (zeroed, 64-byte aligned): the emulator's device memory is the host's."""
    dt = np.dtype(dtype)
    n = max(1, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
    raw = np.zeros(n + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    return DeviceBuffer(raw[start : start + n], shape, dt)


class HostBuffers:
    """alloc / upload / download of DeviceBuffers in host memory: executors whose device memory is the host's
    (the emulator, the plan checker)."""

    def alloc(self, shape, dtype) -> DeviceBuffer:
        return host_alloc(shape, dtype)

    def upload(self, buf: DeviceBuffer, array) -> None:
        host_view(buf.storage, buf)[...] = np.asarray(array, dtype=buf.dtype).reshape(buf.shape)

    def download(self, buf: DeviceBuffer) -> np.ndarray:
        return host_view(buf.storage, buf).copy()


def resolve_host_args(d: Dispatch) -> Dispatch:
    """`d` with every host-memory DeviceBuffer replaced by its numpy view (no copy)."""
    if not any(isinstance(v, DeviceBuffer) for v in d.args.values()):
        return d
    args = {i: host_view(v.storage, v) if isinstance(v, DeviceBuffer) else v for i, v in d.args.items()}
    return Dispatch(d.source, d.kernel, args, d.grid, d.threadgroup, d.label)

"""Apple Metal executor (macOS, PyObjC): runs Dispatch lists on the system's default GPU.

At first use of a `.metal` file it compiles the source with ``newLibraryWithSource`` (Apple's compiler, at
run time) and builds one compute pipeline per kernel. A dispatch list is encoded into ONE command buffer
(one compute encoder, dispatches in order, Metal's default serial encoder keeps them ordered), committed,
and waited for.

Kernels are compiled with IEEE float semantics (fast math off), as on the other two executors.

Buffers: an array whose memory is page-aligned and a whole number of pages long (the expert reader's
2 MiB-aligned record buffers) is wrapped without a copy (``newBufferWithBytesNoCopy``), so a pread lands
directly in GPU-visible memory; the wrapper is cached by address. That PyObjC passes the array's own memory
is checked once at start (``nocopy_in_place``, in the selftest report); where it does not, arrays are copied.
Any other array is copied into a shared buffer, and copied back after the command buffer completes when the
kernel may write it (non-const ``device`` pointer). ``constant T&`` parameters go through ``setBytes``.
``DeviceBuffer`` arguments (``alloc``: persistent MTLBuffers in shared storage, the resident decode step's
state) are bound at their offset with no copy; ``upload``/``download`` copy through the buffer's CPU-visible
contents.

This module is the one part of the Metal backend no Linux machine executes; ``moepack selftest`` on a
Mac compiles every kernel with Apple's compiler and checks each against the numpy reference.
"""

from __future__ import annotations

import platform
import sys
from typing import Sequence

import numpy as np

from ...errors import MoepackError
from .dispatch import DeviceBuffer, Dispatch, KernelError
from .signature import KernelSignature, parse_kernels
from .sources import read_source

_PAGE = 16384  # Apple silicon page size; NoCopy needs page-aligned address and length


def available() -> tuple[bool, str]:
    """(usable, why not) without raising."""
    if sys.platform != "darwin":
        return False, "the metal backend needs macOS (use --backend metal-emu to run the same kernels here)"
    release = platform.mac_ver()[0]
    if release and int(release.split(".")[0]) < 14:
        return False, f"the kernels use bfloat (Metal 3.1): macOS 14 or later, this is macOS {release}"
    try:
        import Metal  # noqa: F401
    except ImportError:
        return False, "pyobjc-framework-Metal is not installed (pip install 'moepack[metal]')"
    import Metal

    if Metal.MTLCreateSystemDefaultDevice() is None:
        return False, "this Mac reports no Metal device"
    return True, ""


class MetalExecutor:
    name = "metal"

    def __init__(self):
        ok, why = available()
        if not ok:
            raise MoepackError(f"the metal backend is not available: {why}",
                               hint="use --backend cpu, or --backend metal-emu to check the kernels")
        import Metal

        self._M = Metal
        self.device = Metal.MTLCreateSystemDefaultDevice()
        self.queue = self.device.newCommandQueue()
        self._pipelines: dict[tuple[str, str], object] = {}
        self._signatures: dict[str, dict[str, KernelSignature]] = {}
        self._libraries: dict[str, object] = {}
        self._nocopy: dict[tuple[int, int], object] = {}  # (address, nbytes) -> MTLBuffer wrapping it
        self._readonly: dict[tuple[int, int, str], object] = {}  # read-only host arrays copied to the GPU once
        self.nocopy_in_place = self._probe_nocopy()

    def _probe_nocopy(self) -> bool:
        """Whether newBufferWithBytesNoCopy wraps a numpy array's own memory here (PyObjC hands Metal the
        array's pointer rather than a temporary copy): checked once on a page of our own, by the buffer's
        contents address and by a write through the array read back through the buffer. If not, every array
        is copied (correct, slower) and describe() says so."""
        raw = np.zeros(2 * _PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % _PAGE
        page = raw[start : start + _PAGE]
        try:
            buf = self.device.newBufferWithBytesNoCopy_length_options_deallocator_(
                page, _PAGE, self._M.MTLResourceStorageModeShared, None)
        except (TypeError, ValueError, BufferError):
            return False
        if buf is None:
            return False
        seen = np.frombuffer(buf.contents().as_buffer(_PAGE), dtype=np.uint8)
        page[:] = 0x5A
        return bool(seen.ctypes.data == page.ctypes.data and np.all(seen == 0x5A))

    def describe(self) -> dict:
        """What `moepack selftest` reports about this Mac's GPU."""
        d = self.device
        return {"device": str(d.name()), "unified_memory": bool(d.hasUnifiedMemory()),
                "max_threads_per_threadgroup": int(d.maxThreadsPerThreadgroup().width),
                "recommended_working_set_GB": round(d.recommendedMaxWorkingSetSize() / 1e9, 1),
                "nocopy_in_place": self.nocopy_in_place}

    # ------------------------------------------------------------------------------------------ compile
    def library(self, source: str):
        lib = self._libraries.get(source)
        if lib is None:
            path, text = read_source(source)
            opts = self._M.MTLCompileOptions.alloc().init()
            # IEEE float semantics, as the emulator and the PTX path compile them (clang without fast math) and
            # as MLX compiles its own run-time kernels: the kernels mask with -inf, rely on exp overflowing to
            # inf, and turn codes into floats by an exact subtraction; Metal's default is fast math.
            if hasattr(opts, "setMathMode_") and hasattr(self._M, "MTLMathModeSafe"):  # macOS 15 and later
                opts.setMathMode_(self._M.MTLMathModeSafe)
            else:
                opts.setFastMathEnabled_(False)
            lib, err = self.device.newLibraryWithSource_options_error_(text, opts, None)
            if lib is None:
                raise KernelError(f"Apple's Metal compiler rejected {path.name}: {err}",
                                  hint="report this with `moepack selftest` output")
            self._libraries[source] = lib
            self._signatures[source] = parse_kernels(text, path.name)
        return lib

    def pipeline(self, source: str, kernel: str):
        key = (source, kernel)
        p = self._pipelines.get(key)
        if p is None:
            fn = self.library(source).newFunctionWithName_(kernel)
            if fn is None:
                raise KernelError(f"{source} has no kernel {kernel!r}")
            p, err = self.device.newComputePipelineStateWithFunction_error_(fn, None)
            if p is None:
                raise KernelError(f"cannot build the pipeline of {kernel}: {err}")
            self._pipelines[key] = p
        return p

    # ------------------------------------------------------------------------------------------ buffers
    def _buffer(self, a: np.ndarray):
        """(MTLBuffer, copied) for a C-contiguous array."""
        addr, n = a.ctypes.data, a.nbytes
        if self.nocopy_in_place and n and addr % _PAGE == 0 and n % _PAGE == 0:
            buf = self._nocopy.get((addr, n))
            if buf is None:
                try:  # a read-only array (a record used in place from a read-only mapping) may be refused
                    buf = self.device.newBufferWithBytesNoCopy_length_options_deallocator_(
                        a, n, self._M.MTLResourceStorageModeShared, None)
                except (TypeError, ValueError, BufferError):
                    buf = None
                if buf is not None:
                    if len(self._nocopy) >= 4096:  # wrappers of records used in place: keep the table bounded
                        self._nocopy.clear()
                    self._nocopy[(addr, n)] = buf
            if buf is not None:
                return buf, False
        src = a if n else bytes(4)  # (PyObjC checks the source holds `length` bytes; Metal wants length > 0)
        if not a.flags.writeable:  # the memory-mapped dense weights: copied once, kept (as executor_cuda does)
            buf = self._readonly.get((addr, n, a.dtype.str))
            if buf is None:
                buf = self._readonly[(addr, n, a.dtype.str)] = self.device.newBufferWithBytes_length_options_(
                    src, max(n, 4), self._M.MTLResourceStorageModeShared)
            return buf, False
        buf = self.device.newBufferWithBytes_length_options_(src, max(n, 4), self._M.MTLResourceStorageModeShared)
        return buf, True

    # ------------------------------------------------------------------------------------------ persistent buffers
    def alloc(self, shape, dtype) -> DeviceBuffer:
        """A zeroed MTLBuffer in shared storage (CPU and GPU see the same memory on Apple silicon)."""
        dt = np.dtype(dtype)
        n = max(4, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        buf = self.device.newBufferWithLength_options_(n, self._M.MTLResourceStorageModeShared)
        if buf is None:
            raise KernelError(f"the Metal device could not allocate {n} bytes",
                              hint="the model's decode state does not fit the GPU's memory")
        out = DeviceBuffer(buf, shape, dt)
        self._bytes_of(out)[:] = 0
        return out

    @staticmethod
    def _bytes_of(buf: DeviceBuffer) -> np.ndarray:
        """A writable uint8 numpy view of `buf`'s bytes in the shared MTLBuffer."""
        whole = np.frombuffer(buf.storage.contents().as_buffer(buf.capacity), dtype=np.uint8)
        return whole[buf.offset : buf.offset + buf.nbytes]

    def upload(self, buf: DeviceBuffer, array) -> None:
        src = np.ascontiguousarray(np.asarray(array, dtype=buf.dtype).reshape(buf.shape))
        self._bytes_of(buf)[:] = src.reshape(-1).view(np.uint8)  # run() waits for its command buffer: no race

    def download(self, buf: DeviceBuffer) -> np.ndarray:
        return self._bytes_of(buf).copy().view(buf.dtype).reshape(buf.shape)

    # ------------------------------------------------------------------------------------------ run
    def run(self, dispatches: Sequence[Dispatch]) -> None:
        if isinstance(dispatches, Dispatch):
            dispatches = [dispatches]
        M = self._M
        cb = self.queue.commandBuffer()
        enc = cb.computeCommandEncoder()
        copy_back: list[tuple[object, np.ndarray]] = []
        for d in dispatches:
            enc.setComputePipelineState_(self.pipeline(d.source, d.kernel))
            sig = self._signatures[d.source][d.kernel]
            for idx, value in d.args.items():
                param = sig.buffers.get(idx)
                if param is None:
                    raise KernelError(f"{d.kernel} has no [[buffer({idx})]]")
                if isinstance(value, DeviceBuffer):  # a persistent MTLBuffer: bound at its offset, no copies
                    enc.setBuffer_offset_atIndex_(value.storage, value.offset, idx)
                elif isinstance(value, np.ndarray):
                    if not value.flags.c_contiguous:
                        raise KernelError(f"{d.kernel}: buffer {idx} is not C-contiguous")
                    buf, copied = self._buffer(value)
                    enc.setBuffer_offset_atIndex_(buf, 0, idx)
                    if copied and param.writable:
                        copy_back.append((buf, value))
                else:
                    raw = np.asarray(value, dtype=param.dtype).tobytes()
                    enc.setBytes_length_atIndex_(raw, len(raw), idx)
            enc.dispatchThreadgroups_threadsPerThreadgroup_(M.MTLSizeMake(*d.grid), M.MTLSizeMake(*d.threadgroup))
        enc.endEncoding()
        cb.commit()
        cb.waitUntilCompleted()
        if cb.error() is not None:
            raise KernelError(f"the Metal command buffer failed: {cb.error()}")
        for buf, arr in copy_back:
            view = buf.contents().as_buffer(arr.nbytes)
            arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(view, dtype=np.uint8, count=arr.nbytes)

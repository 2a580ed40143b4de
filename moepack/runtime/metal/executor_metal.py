"""Apple Metal executor (macOS, PyObjC): runs Dispatch lists on the system's default GPU.

At first use of a `.metal` file it compiles the source with ``newLibraryWithSource`` (Apple's compiler, at
run time) and builds one compute pipeline per kernel. A dispatch list is encoded into ONE command buffer
(one compute encoder, dispatches in order, Metal's default serial encoder keeps them ordered), committed,
and waited for.

Buffers: an array whose memory is page-aligned and a whole number of pages long (the expert reader's
2 MiB-aligned record buffers) is wrapped without a copy (``newBufferWithBytesNoCopy``), so a pread lands
directly in GPU-visible memory; the wrapper is cached by address. Any other array is copied into a shared
buffer, and copied back after the command buffer completes when the kernel may write it (non-const
``device`` pointer). ``constant T&`` parameters go through ``setBytes``.

This module is the one part of the Metal backend no Linux machine executes; ``moepack selftest`` on a
Mac compiles every kernel with Apple's compiler and checks each against the numpy reference.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from ...errors import MoepackError
from .dispatch import Dispatch, KernelError
from .signature import KernelSignature, parse_kernels
from .sources import read_source

_PAGE = 16384  # Apple silicon page size; NoCopy needs page-aligned address and length


def available() -> tuple[bool, str]:
    """(usable, why not) without raising."""
    if sys.platform != "darwin":
        return False, "the metal backend needs macOS (use --backend metal-emu to run the same kernels here)"
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

    # ------------------------------------------------------------------------------------------ compile
    def library(self, source: str):
        lib = self._libraries.get(source)
        if lib is None:
            path, text = read_source(source)
            opts = self._M.MTLCompileOptions.alloc().init()
            opts.setFastMathEnabled_(True)
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
        if n and addr % _PAGE == 0 and n % _PAGE == 0:
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
        return self.device.newBufferWithBytes_length_options_(a, max(n, 4), self._M.MTLResourceStorageModeShared), True

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
                if isinstance(value, np.ndarray):
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

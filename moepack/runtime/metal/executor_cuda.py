"""NVIDIA executor: the `metal/*.metal` kernels compiled to PTX (``ptx.py``, clang-19, no CUDA toolkit) and
launched with CuPy. Apple simdgroups and CUDA warps are both 32 lanes wide, so the kernels run unchanged.

PTX comes from ``ptx.compile_ptx`` where clang-19 is installed, else from a prebuilt *bundle* folder
(``$MOEPACK_PTX_BUNDLE``, written by ``export_bundle`` on a machine that has clang): per `.metal` file its
PTX and a JSON of every kernel's launch parameters, keyed by the source's SHA-256 so a stale bundle is
refused. A GPU machine needs only CuPy and the driver.

Memory: within one ``run()`` each host array is uploaded once (dispatches that share an array share the
device copy) and arrays a kernel may write are copied back at the end. Read-only host arrays (the
memory-mapped dense weights: numpy marks them not writeable) stay on the GPU across runs, keyed by address
and size; writeable arrays (activations, the expert reader's reused record buffers) are uploaded each run.
``DeviceBuffer`` arguments (``alloc``/``upload``/``download``: the resident decode step's KV cache, states
and activations) are cupy allocations passed by device address, never copied by ``run()``. Large 2 MiB-aligned
uint8 host arrays (the expert reader's record blocks) are page-locked once, so their uploads run at PCIe speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ...errors import MoepackError
from . import sources
from .dispatch import DeviceBuffer, Dispatch, KernelError

ENV_BUNDLE = "MOEPACK_PTX_BUNDLE"
PIN_MIN = 1 << 21  # writeable uint8 host arrays this large and 2 MiB-aligned (expert record blocks) are
PIN_ALIGN = 1 << 21  # page-locked once (cudaHostRegister) so their per-run uploads run at full PCIe speed


def available() -> tuple[bool, str]:
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        return False, f"no CUDA device ({type(e).__name__}: {e})"
    return (n > 0), ("" if n > 0 else "no CUDA device")


@dataclass(frozen=True)
class LaunchParam:
    index: int  # [[buffer(n)]]
    kind: str  # "pointer" | "scalar" (by value)
    dtype: str | None
    writable: bool


@dataclass(frozen=True)
class CudaKernel:
    name: str
    params: tuple[LaunchParam, ...]


def _source_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _from_ptx_module(mod) -> tuple[str, dict[str, CudaKernel]]:
    kernels = {}
    for name, k in mod.kernels.items():
        writable = {p.index: p.writable for p in k.signature.params if p.index is not None}
        kernels[name] = CudaKernel(name, tuple(
            LaunchParam(p.index, p.kind, None if p.dtype is None else np.dtype(p.dtype).str, writable[p.index])
            for p in k.params))
    return mod.ptx, kernels


def export_bundle(out_dir: os.PathLike, arch: str = "sm_90") -> list[Path]:
    """Compile every metal/*.metal to PTX and write <stem>.ptx + <stem>.json into out_dir."""
    from .ptx import compile_ptx

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sources.list_sources():
        ptx, kernels = _from_ptx_module(compile_ptx(src, arch))
        (out / f"{src.stem}.ptx").write_text(ptx)
        meta = {"source": src.name, "sha256": _source_sha(src), "arch": arch,
                "kernels": {n: [p.__dict__ for p in k.params] for n, k in kernels.items()}}
        (out / f"{src.stem}.json").write_text(json.dumps(meta, indent=1))
        written += [out / f"{src.stem}.ptx", out / f"{src.stem}.json"]
    return written


def _load_bundle(source: str) -> tuple[str, dict[str, CudaKernel]]:
    path = sources.resolve(source)
    folder = os.environ.get(ENV_BUNDLE)
    if not folder:
        raise KernelError("clang-19 is not installed here and no prebuilt PTX bundle is set",
                          hint=f"install clang-19, or set {ENV_BUNDLE} to a folder written by "
                               "`python -m moepack.runtime.metal.executor_cuda export DIR` on a machine with it")
    meta_path = Path(folder) / f"{path.stem}.json"
    try:
        meta = json.loads(meta_path.read_text())
        ptx = (Path(folder) / f"{path.stem}.ptx").read_text()
    except OSError as e:
        raise KernelError(f"the PTX bundle {folder} lacks {path.stem}: {e.strerror}") from None
    if meta.get("sha256") != _source_sha(path):
        raise KernelError(f"the PTX bundle's {path.name} was built from another version of the file",
                          hint="re-export the bundle from this checkout")
    kernels = {n: CudaKernel(n, tuple(LaunchParam(**p) for p in ps)) for n, ps in meta["kernels"].items()}
    return ptx, kernels


class CudaExecutor:
    name = "cuda"

    def __init__(self):
        ok, why = available()
        if not ok:
            raise MoepackError(f"the cuda backend is not available: {why}",
                               hint="use --backend cpu, or --backend metal-emu to check the kernels")
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device()
        self._modules: dict[str, tuple[Any, dict[str, CudaKernel]]] = {}
        self._functions: dict[tuple[str, str], Any] = {}
        self._resident: dict[tuple[int, int, str], Any] = {}  # read-only host arrays kept on the GPU
        # page-locked allocations (expert record blocks): kept alive while registered, unregistered when the
        # executor goes (freeing registered pages would leave CUDA a stale mapping)
        self._pinned: dict[int, tuple[np.ndarray, int | None]] = {}
        weakref.finalize(self, _unpin, cupy, self._pinned)
        self.uploaded_bytes = 0

    def describe(self) -> dict:
        props = self.cp.cuda.runtime.getDeviceProperties(self.device.id)
        name = props["name"]
        return {"device": name.decode() if isinstance(name, bytes) else str(name)}

    def _module(self, source: str):
        m = self._modules.get(source)
        if m is None:
            try:
                from .emulator.build import clang

                clang()
                from .ptx import compile_ptx

                ptx, kernels = _from_ptx_module(compile_ptx(source))
            except KernelError as e:
                if "clang" not in e.message:
                    raise
                ptx, kernels = _load_bundle(source)
            raw = _raw_module_from_ptx(self.cp, ptx)
            m = self._modules[source] = (raw, kernels)
        return m

    def _function(self, source: str, kernel: str):
        key = (source, kernel)
        f = self._functions.get(key)
        if f is None:
            raw, kernels = self._module(source)
            if kernel not in kernels:
                raise KernelError(f"{source} has no kernel {kernel!r}")
            f = self._functions[key] = (raw.get_function(kernel), kernels[kernel])
        return f

    def _pin(self, a: np.ndarray) -> None:
        """Page-lock the allocation under a large 2 MiB-aligned writeable array (the expert reader's record
        blocks, reused for the reader's life) once, so uploading its records runs at full PCIe speed. The
        executor keeps a reference to the allocation, so registered pages are never freed under CUDA."""
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        start, end = root.ctypes.data, root.ctypes.data + root.nbytes
        if start in self._pinned:
            return
        page = 4096
        lo, hi = -(-start // page) * page, end // page * page
        registered = False
        if hi > lo:
            try:
                self.cp.cuda.runtime.hostRegister(lo, hi - lo, 0)
                registered = True
            except Exception:  # noqa: BLE001 - pinning is an optimisation: pageable uploads still work
                pass
        self._pinned[start] = (root, lo if registered else None)

    def _device_array(self, a: np.ndarray, staged: dict):
        key = (a.ctypes.data, a.nbytes, a.dtype.str)
        d = staged.get(key)
        if d is not None:
            return d
        if a.dtype == np.uint8 and a.flags.writeable and a.nbytes >= PIN_MIN and a.ctypes.data % PIN_ALIGN == 0:
            self._pin(a)
        if not a.flags.writeable:
            d = self._resident.get(key)
            if d is None:
                d = self._resident[key] = self.cp.asarray(a)
                self.uploaded_bytes += a.nbytes
        else:
            d = self.cp.asarray(a)
            self.uploaded_bytes += a.nbytes
        staged[key] = d
        return d

    # ------------------------------------------------------------------------------- persistent buffers
    def alloc(self, shape, dtype) -> DeviceBuffer:
        dt = np.dtype(dtype)
        n = max(1, int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
        return DeviceBuffer(self.cp.zeros(n, dtype=self.cp.uint8), shape, dt)

    def _view(self, buf: DeviceBuffer):
        return buf.storage[buf.offset : buf.offset + buf.nbytes].view(buf.dtype).reshape(buf.shape)

    def upload(self, buf: DeviceBuffer, array) -> None:
        self._view(buf).set(np.ascontiguousarray(np.asarray(array, dtype=buf.dtype).reshape(buf.shape)))
        self.uploaded_bytes += buf.nbytes

    def download(self, buf: DeviceBuffer) -> np.ndarray:
        return self._view(buf).get()

    def run(self, dispatches: Sequence[Dispatch]) -> None:
        if isinstance(dispatches, Dispatch):
            dispatches = [dispatches]
        staged: dict = {}
        back: dict[tuple, tuple[np.ndarray, Any]] = {}
        for d in dispatches:
            fn, k = self._function(d.source, d.kernel)
            args = []
            for p in k.params:
                if p.index not in d.args:
                    raise KernelError(f"kernel {d.kernel}: missing argument for [[buffer({p.index})]]")
                v = d.args[p.index]
                if p.kind == "scalar":
                    args.append(np.dtype(p.dtype).type(v))
                    continue
                if isinstance(v, DeviceBuffer):  # stays on the GPU: no upload, no copy back
                    if p.dtype is not None and v.dtype.itemsize != np.dtype(p.dtype).itemsize:
                        raise KernelError(f"kernel {d.kernel}: buffer {p.index} is {v.dtype}, the kernel reads "
                                          f"{np.dtype(p.dtype)}")
                    args.append(np.uint64(v.storage.data.ptr + v.offset))  # its device address: no array made
                    continue
                if not isinstance(v, np.ndarray):
                    v = np.frombuffer(bytes(v), dtype=np.uint8).copy()
                if not v.flags.c_contiguous:
                    raise KernelError(f"kernel {d.kernel}: buffer {p.index} is not C-contiguous")
                if p.dtype is not None and v.dtype.str != p.dtype and not (v.dtype.itemsize == np.dtype(p.dtype).itemsize
                                                                          and v.dtype.kind in "uif"):
                    raise KernelError(f"kernel {d.kernel}: buffer {p.index} is {v.dtype}, the kernel reads "
                                      f"{np.dtype(p.dtype)}")
                dv = self._device_array(v, staged)
                if p.writable:
                    back[(v.ctypes.data, v.nbytes, v.dtype.str)] = (v, dv)
                args.append(dv)
            fn(tuple(int(x) for x in d.grid), tuple(int(x) for x in d.threadgroup), tuple(args))
        self.cp.cuda.get_current_stream().synchronize()
        for host, dev in back.values():
            host[...] = self.cp.asnumpy(dev).reshape(host.shape)


def _unpin(cp, pinned: dict) -> None:
    for _, lo in pinned.values():
        if lo is not None:
            try:
                cp.cuda.runtime.hostUnregister(lo)
            except Exception:  # noqa: BLE001 - at exit the context may be gone already
                pass
    pinned.clear()


def _raw_module_from_ptx(cp, ptx: str):
    """A cupy RawModule from PTX text. RawModule(path=...) loads .ptx/.cubin files lazily, so the file is
    kept (in the temp folder, named by the PTX's hash: written once per content)."""
    import tempfile

    path = Path(tempfile.gettempdir()) / f"moepack-{hashlib.sha256(ptx.encode()).hexdigest()[:24]}.ptx"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(suffix=".ptx", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(ptx)
        os.replace(tmp, path)
    return cp.RawModule(path=str(path))


def _main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m moepack.runtime.metal.executor_cuda",
                                 description="Export the metal/*.metal kernels as a prebuilt PTX bundle.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write <stem>.ptx + <stem>.json per kernel file into DIR")
    ex.add_argument("dir")
    ex.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    for p in export_bundle(args.dir, args.arch):
        print(p)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())

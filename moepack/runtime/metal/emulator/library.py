"""One `.metal` file compiled for the CPU emulator: glue generation, build, ctypes loading, launches.

    lib = Library.load("norm.metal", strict_address_spaces=False)
    lib.kernels["rmsnorm_f32"]            # KernelSignature
    lib.launch(dispatch, schedule=0, seed=0, strict_simd=False)
"""

from __future__ import annotations

import ctypes
import mmap
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moepack.runtime.metal.dispatch import Dispatch, KernelError
from moepack.runtime.metal.emulator.build import METAL_VERSION_DEFINE, compile_cached, parsed_source
from moepack.runtime.metal.emulator.rewrite import rewrite
from moepack.runtime.metal.signature import BUILTINS, KernelSignature, Param

CPU_FLAGS = ["-x", "c++", "-std=c++14", METAL_VERSION_DEFINE, "-Werror=c++17-extensions", "-O2", "-fPIC", "-shared",
             "-fno-strict-aliasing", "-fno-exceptions", "-fno-rtti", "-Wno-unknown-attributes"]
STRICT_AS_FLAGS = ["-DMOEPACK_EMU_STRICT_AS"]
GARBAGE_BYTE = 0xFF  # threadgroup memory at group start: NaN for every float type, -1 for ints
_ERRLEN = 2048


def pointee(p: Param) -> str:
    """The element type of a pointer/reference parameter, as C++ text."""
    t = p.type.rstrip()
    return t[:-1].rstrip() if t.endswith(("*", "&")) else t


def cpu_glue(kernels: dict[str, KernelSignature]) -> str:
    """C++ appended to the rewritten source: one thunk, launch entry and size table per kernel."""
    out = ["", "#undef double", '#line 1 "<moepack-emu-glue>"', '#include "moepack_emu_runtime.h"']
    for k in kernels.values():
        args = []
        for p in k.params:
            if p.kind == "buffer":
                args.append(f"({p.type})b[{p.index}]")
            elif p.kind == "scalar":
                args.append(f"*({pointee(p)}*)b[{p.index}]")
            else:
                field = BUILTINS[p.builtin]
                args.append(f"({p.base})32" if field is None else f"moepack_glue::builtin<{p.base}>::from(t->{field})")
        joined = ",\n    ".join(args)
        sizes = [p for p in k.params if p.kind != "builtin"]
        size_lines = " ".join(
            f"o[{2 * j}] = {'0' if pointee(p).split()[-1] == 'void' else f'sizeof({pointee(p)})'}; "
            f"o[{2 * j + 1}] = {'1' if pointee(p).split()[-1] == 'void' else f'alignof({pointee(p)})'};"
            for j, p in enumerate(sizes))
        out.append(f"""
static void moepack_thunk_{k.name}(void** b, const moepack_emu::ThreadInfo* t) {{
  (void)b; (void)t;
  {k.name}(
    {joined});
}}
extern "C" int moepack_launch_{k.name}(void** b, const unsigned* g, const long long* o, char* e, int n) {{
  return moepack_emu::launch("{k.name}", moepack_thunk_{k.name}, b, g, o, e, n);
}}
extern "C" void moepack_sizes_{k.name}(unsigned long long* o) {{ (void)o; {size_lines} }}""")
    return "\n".join(out) + "\n"


@dataclass
class _Kernel:
    sig: KernelSignature
    launch: Any                      # ctypes function
    sizes: dict[int, tuple[int, int]]  # buffer index -> (sizeof element, alignof element)


class Library:
    """A compiled `.metal` file: its kernels' signatures and a launcher for each."""

    def __init__(self, path: Path, so_path: Path, kernels: dict[str, KernelSignature], built: bool):
        self.path = path
        self.so_path = so_path
        self.kernels = kernels
        self.built = built  # False: loaded from the compile cache
        self._dll = ctypes.CDLL(str(so_path))
        self._lock = threading.Lock()  # the runtime keeps one scheduler state per shared object
        self._entries: dict[str, _Kernel] = {}
        for name, sig in kernels.items():
            fn = getattr(self._dll, f"moepack_launch_{name}")
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
            fn.restype = ctypes.c_int
            bufs = [p for p in sig.params if p.kind != "builtin"]
            table = (ctypes.c_ulonglong * max(2 * len(bufs), 1))()
            getattr(self._dll, f"moepack_sizes_{name}")(table)
            sizes = {p.index: (int(table[2 * j]), int(table[2 * j + 1])) for j, p in enumerate(bufs)}
            self._entries[name] = _Kernel(sig, fn, sizes)

    @classmethod
    def load(cls, source: str | Path, strict_address_spaces: bool = False) -> "Library":
        path, text, kernels = parsed_source(source)
        body = rewrite(text, path.name)
        full = f'#include <metal_stdlib>\n{body}{cpu_glue(kernels)}'
        flags = CPU_FLAGS + (STRICT_AS_FLAGS if strict_address_spaces else [])
        so, built = compile_cached(full, flags, ".so", path.name, path)
        return cls(path, so, kernels, built)

    def launch(self, d: Dispatch, schedule: int, seed: int, strict_simd: bool, guard: bool = True) -> None:
        entry = self._entries.get(d.kernel)
        if entry is None:
            raise KernelError(f"{self.path.name} has no kernel {d.kernel!r}",
                              hint=f"kernels in this file: {', '.join(self.kernels)}")
        grid = _dims(d.grid, "grid", d)
        tg = _dims(d.threadgroup, "threadgroup", d)
        n = tg[0] * tg[1] * tg[2]
        if n > 1024:
            raise KernelError(f"kernel {d.kernel}: threadgroup {tuple(tg)} has {n} threads (Metal's limit is 1024)",
                              hint="use at most 1024 threads per threadgroup")
        keep, ptrs = bind_args(entry.sig, entry.sizes, d.args, self.path.name)
        guards: dict[int, _Guarded] = {}
        if guard:
            # one guarded copy per distinct memory range (an array bound at two indices stays one buffer);
            # views that partly overlap another buffer run unguarded, in place, to keep their aliasing
            ranges = {i: (keep[i].ctypes.data, keep[i].ctypes.data + keep[i].nbytes)
                      for i, p in entry.sig.buffers.items() if p.kind == "buffer" and keep[i].size}
            shared: dict[tuple[int, int], _Guarded] = {}
            for idx, r in sorted(ranges.items()):
                if any(o != r and o[0] < r[1] and r[0] < o[1] for o in ranges.values()):
                    continue
                if r not in shared:
                    shared[r] = _Guarded(keep[idx], max(entry.sizes[i][1] for i in ranges if ranges[i] == r))
                guards[idx] = shared[r]
                ptrs[idx] = guards[idx].address
        nslots = max(entry.sig.buffers, default=-1) + 1
        bufs = (ctypes.c_void_p * max(nslots, 1))(*[ptrs.get(i) for i in range(nslots)])
        geom = (ctypes.c_uint * 6)(*grid, *tg)
        opts = (ctypes.c_longlong * 4)(schedule, seed, int(strict_simd), GARBAGE_BYTE)
        err = ctypes.create_string_buffer(_ERRLEN)
        try:
            with self._lock:
                rc = entry.launch(bufs, geom, opts, err, _ERRLEN)
            if rc == 0:
                for idx, g in guards.items():
                    if entry.sig.buffers[idx].writable:
                        g.copy_back(keep[idx])
        finally:
            for g in {id(g): g for g in guards.values()}.values():
                g.close()
        if rc != 0:
            where = f" [{d.label}]" if d.label else ""
            msg = err.value.decode(errors="replace")
            m = re.search(r"at address (0x[0-9a-f]+|\(nil\))", msg)
            if rc == 2 and m and m.group(1).startswith("0x"):
                addr = int(m.group(1), 16)
                for idx, g in guards.items():
                    if g.end <= addr < g.end + _PAGE:
                        p = entry.sig.buffers[idx]
                        msg += (f"; the address is {addr - g.end} bytes past the end of buffer({idx}) '{p.name}' "
                                f"({g.end - g.address} bytes)")
            raise KernelError(f"{self.path.name}: {msg}{where}",
                              hint="fix the kernel (see metal-interface.md: every thread reaches every barrier, "
                                   "simd_* in simdgroup-uniform code) or the dispatch geometry")


_libc = ctypes.CDLL(None, use_errno=True)
_PAGE = mmap.PAGESIZE


class _Region:
    """An anonymous mapping of `data_pages` read-write pages followed by one PROT_NONE page."""

    def __init__(self, data_pages: int):
        self.data_pages = data_pages
        self.mm = mmap.mmap(-1, (data_pages + 1) * _PAGE)
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(anchor)
        del anchor
        if _libc.mprotect(ctypes.c_void_p(self.base + data_pages * _PAGE), ctypes.c_size_t(_PAGE), 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")


_POOL: dict[int, list[_Region]] = {}  # reused across dispatches: fresh mappings cost a page fault per page
_POOL_LIMIT = 512 * 2**20
_pool_lock = threading.Lock()


class _Guarded:
    """A copy of an array placed so that its last byte sits just before a PROT_NONE page: a kernel that
    reads or writes past the end faults, and the fault is reported naming the buffer."""

    def __init__(self, arr: np.ndarray, align: int):
        n = arr.nbytes
        a = max(align, 1)
        rounded = -(-n // a) * a
        pages = max(1, -(-rounded // _PAGE))
        with _pool_lock:
            free = _POOL.get(pages)
            self.region = free.pop() if free else None
        if self.region is None:
            self.region = _Region(pages)
        offset = pages * _PAGE - rounded
        self.address = self.region.base + offset
        self.end = self.address + n
        self.view = np.frombuffer(self.region.mm, dtype=np.uint8, count=n, offset=offset)
        self.view[:] = arr.reshape(-1).view(np.uint8)

    def copy_back(self, arr: np.ndarray) -> None:
        arr.reshape(-1).view(np.uint8)[:] = self.view

    def close(self) -> None:
        del self.view
        r = self.region
        with _pool_lock:
            pooled = sum(pages * len(free) for pages, free in _POOL.items()) * _PAGE
            if pooled + r.data_pages * _PAGE <= _POOL_LIMIT:
                _POOL.setdefault(r.data_pages, []).append(r)
                return
        r.mm.close()


def _dims(v: Any, what: str, d: Dispatch) -> list[int]:
    try:
        dims = [int(x) for x in v]
    except TypeError:
        dims = []
    if len(dims) != 3 or min(dims) < 1 or max(dims) > 2**31:
        raise KernelError(f"kernel {d.kernel}: {what} must be three positive ints, got {v!r}",
                          hint="pass grid=(gx, gy, gz) threadgroups and threadgroup=(tx, ty, tz) threads")
    return dims


def _dtype_ok(p: Param, dt: np.dtype) -> bool:
    want = p.dtype
    if want is None:
        return True
    if p.scalar == "bfloat" and dt.name == "bfloat16":
        return True
    return dt == want


def scalar_argument(p: Param, value: Any, size: int, where: str) -> np.ndarray:
    """A `constant T&` argument as a small array holding the value in the parameter's type."""
    want = p.dtype
    if want is None:  # struct: raw bytes of exactly its size
        raw = value.tobytes() if isinstance(value, np.ndarray) else bytes(value) if isinstance(value, (bytes, bytearray)) else None
        if raw is None or len(raw) != size:
            got = f"{len(raw)} bytes" if raw is not None else type(value).__name__
            raise KernelError(f"{where}: needs the {size} bytes of a {p.base}, got {got}",
                              hint="pass a numpy structured scalar/array or bytes of exactly the struct's size")
        return np.frombuffer(raw, dtype=np.uint8).copy()
    if isinstance(value, np.ndarray):
        if not _dtype_ok(p, value.dtype) or value.size != p.width:
            raise KernelError(f"{where}: needs {p.width} value(s) of {want} ({p.base}), got array {value.dtype} "
                              f"of size {value.size}", hint=f"pass a python number or a numpy {want} scalar")
        return np.ascontiguousarray(value).reshape(-1)
    vals = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(vals) != p.width:
        raise KernelError(f"{where}: needs {p.width} value(s) for {p.base}, got {len(vals)}",
                          hint="pass a python number (or a sequence of the vector's width)")
    out = np.empty(p.width, dtype=want)
    for i, v in enumerate(vals):
        if isinstance(v, (bool, np.bool_)) and want != np.bool_:
            v = int(v)
        if not isinstance(v, (int, float, np.integer, np.floating, np.bool_)):
            raise KernelError(f"{where}: expected a number, got {type(v).__name__}",
                              hint=f"pass a python int/float or a numpy {want} scalar")
        if p.scalar == "bfloat":
            f = np.asarray(v, dtype=np.float32)
            out[i] = (f.view(np.uint32) + 0x7FFF + ((f.view(np.uint32) >> 16) & 1)) >> 16
            continue
        if want.kind in "iu":
            if isinstance(v, (float, np.floating)):
                raise KernelError(f"{where}: {p.base} parameter got the float {v!r}",
                                  hint="pass an int for an integer parameter")
            info = np.iinfo(want)
            if not info.min <= int(v) <= info.max:
                raise KernelError(f"{where}: {v} does not fit in {p.base}", hint=f"range is {info.min}..{info.max}")
        out[i] = v
    return out


def bind_args(sig: KernelSignature, sizes: dict[int, tuple[int, int]], args: Any,
              file: str) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Check every argument against its parameter; return (arrays to keep alive, index -> address)."""
    if not hasattr(args, "items"):
        raise KernelError(f"kernel {sig.name}: args must map [[buffer(n)]] index -> array or scalar",
                          hint="pass args={0: x, 1: out, 2: n}")
    extra = sorted(set(args) - set(sig.buffers))
    if extra:
        raise KernelError(f"{file}: kernel {sig.name} has no [[buffer({extra[0]})]] parameter",
                          hint=f"its buffer indices are {sorted(sig.buffers)}")
    keep: dict[int, np.ndarray] = {}
    ptrs: dict[int, int] = {}
    for idx, p in sorted(sig.buffers.items()):
        where = f"{file}: kernel {sig.name}, buffer({idx}) '{p.name}' ({p.type})"
        if idx not in args:
            raise KernelError(f"{file}: kernel {sig.name}: missing argument for [[buffer({idx})]] '{p.name}'",
                              hint=f"the dispatch must give every buffer index {sorted(sig.buffers)}")
        value = args[idx]
        size, align = sizes[idx]
        if p.kind == "scalar":
            arr = scalar_argument(p, value, size, where)
        else:
            if not isinstance(value, np.ndarray):
                raise KernelError(f"{where}: expected a numpy array, got {type(value).__name__}",
                                  hint="pass device buffers as numpy arrays")
            arr = value
            if not _dtype_ok(p, arr.dtype):
                want = p.dtype
                raise KernelError(f"{where}: array dtype {arr.dtype} does not match the parameter (needs {want})",
                                  hint=f"convert with .astype(np.{want.name})" + (" (bfloat travels as uint16 bits)" if p.scalar == "bfloat" else ""))
            if not arr.flags.c_contiguous:
                raise KernelError(f"{where}: array is not C-contiguous", hint="pass np.ascontiguousarray(x)")
            if p.writable and not arr.flags.writeable:
                raise KernelError(f"{where}: the kernel writes this buffer but the array is read-only",
                                  hint="pass a writable array (e.g. x.copy())")
            if size and arr.nbytes % size:
                raise KernelError(f"{where}: {arr.nbytes} bytes is not a whole number of {p.base} ({size} bytes)",
                                  hint=f"the array size must be a multiple of {p.width}" if p.width > 1 else "check the array's size")
            if arr.size and arr.ctypes.data % align:
                raise KernelError(f"{where}: array address is not {align}-byte aligned as {p.base} needs",
                                  hint="pass a freshly allocated array (np.empty/np.zeros), not an offset view")
        keep[idx] = arr
        ptrs[idx] = arr.ctypes.data
    return keep, ptrs

"""Compile a `.metal` file to PTX for NVIDIA GPUs, with clang-19 and no CUDA toolkit.

The same source the Mac and the CPU emulator use, with the stand-in header's CUDA branch
(threadgroup arrays -> __shared__, simd_* -> 32-lane warp shuffles with a full mask, threadgroup_barrier
-> __syncthreads, builtins from threadIdx/blockIdx/blockDim/gridDim) and one generated
`extern "C" __global__` entry per kernel, named like the kernel.

    mod = compile_ptx("quant.metal")          # cached by content hash under the emulator's cache dir
    mod.ptx                                   # text for cupy.RawModule(code=mod.ptx)
    k = mod.kernels["qmv_b4"]
    k.params                                  # launch order: PtxParam(index, name, kind, dtype)
    k.launch_args(dispatch.args)              # the arguments in that order (numpy; the executor
                                              #   swaps arrays for device arrays)

Parameter passing: every `device T*` buffer is a pointer; a `constant T&` of a scalar type is passed BY
VALUE as a numpy scalar of `dtype` (bfloat as its uint16 bits); a `constant` struct or vector reference is
passed as a pointer to a device buffer holding its bytes (kind "pointer"). Launch with grid = the
Dispatch's grid (threadgroups) and block = its threadgroup size; no dynamic shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from moepack.runtime.metal.dispatch import KernelError
from moepack.runtime.metal.emulator.build import METAL_VERSION_DEFINE, compile_cached, parsed_source
from moepack.runtime.metal.emulator.library import scalar_argument, pointee
from moepack.runtime.metal.emulator.rewrite import rewrite
from moepack.runtime.metal.signature import BUILTINS, KernelSignature, Param

DEFAULT_ARCH = "sm_90"
KERNEL_PREFIX = "moepack_kernel_"  # the kernel body's C++ name; the __global__ entry takes the plain name


def cuda_flags(arch: str = DEFAULT_ARCH) -> list[str]:
    return ["-x", "cuda", "--cuda-device-only", f"--cuda-gpu-arch={arch}", "-nocudainc", "-nocudalib", "-S",
            "-std=c++14", "-Werror=c++17-extensions", "-O3", "-DMOEPACK_EMU_CUDA", METAL_VERSION_DEFINE,
            "-fno-exceptions", "-Wno-unknown-attributes", "-Wno-unknown-cuda-version"]


@dataclass(frozen=True)
class PtxParam:
    index: int             # [[buffer(n)]]
    name: str
    kind: str              # "pointer" or "scalar" (by value)
    dtype: np.dtype | None  # element dtype (pointer) or value dtype (scalar); None for a struct


@dataclass(frozen=True)
class PtxKernel:
    name: str                       # entry name in the PTX
    signature: KernelSignature
    params: tuple[PtxParam, ...]    # launch order

    def launch_args(self, args: Mapping[int, Any]) -> tuple:
        """Dispatch args in launch order: arrays as given (pointer params; a struct/vector `constant&`
        becomes a small uint8/elem array), scalars as numpy scalars of the parameter's dtype."""
        missing = [p.index for p in self.params if p.index not in args]
        if missing:
            raise KernelError(f"kernel {self.name}: missing argument for [[buffer({missing[0]})]]",
                              hint=f"give every buffer index {[p.index for p in self.params]}")
        out = []
        for p, sp in zip(self.params, (q for q in self.signature.params if q.kind != "builtin")):
            v = args[p.index]
            if p.kind == "scalar":
                out.append(scalar_argument(sp, v, sp.dtype.itemsize, f"kernel {self.name}, buffer({p.index})")[0])
            elif sp.kind == "scalar":  # struct / vector constant& -> its bytes in a small array
                out.append(v if isinstance(v, np.ndarray) else np.frombuffer(bytes(v), np.uint8).copy())
            else:
                out.append(v)
        return tuple(out)


@dataclass(frozen=True)
class PtxModule:
    source: Path
    path: Path                      # the cached .ptx file
    ptx: str
    kernels: dict[str, PtxKernel]
    built: bool

    @property
    def entries(self) -> list[str]:
        return list(self.kernels)


def _by_value(p: Param) -> bool:
    return p.kind == "scalar" and p.dtype is not None and p.width == 1


_SREG = {
    "tid": "uint3{(uint)__nvvm_read_ptx_sreg_tid_x(), (uint)__nvvm_read_ptx_sreg_tid_y(), (uint)__nvvm_read_ptx_sreg_tid_z()}",
    "ctaid": "uint3{(uint)__nvvm_read_ptx_sreg_ctaid_x(), (uint)__nvvm_read_ptx_sreg_ctaid_y(), (uint)__nvvm_read_ptx_sreg_ctaid_z()}",
    "ntid": "uint3{(uint)__nvvm_read_ptx_sreg_ntid_x(), (uint)__nvvm_read_ptx_sreg_ntid_y(), (uint)__nvvm_read_ptx_sreg_ntid_z()}",
    "nctaid": "uint3{(uint)__nvvm_read_ptx_sreg_nctaid_x(), (uint)__nvvm_read_ptx_sreg_nctaid_y(), (uint)__nvvm_read_ptx_sreg_nctaid_z()}",
}


# CUDA occupancy hints, {kernel name: (threads per threadgroup, threadgroups to fit on one SM)}: the entry gets
# launch bounds, so ptxas keeps a thread's registers under 65536 / (threads x groups) (80 for 3 x 256). Without
# them ptxas spends registers freely (96-168 for the matvecs: 2 or 1 threadgroups per SM). Measured on an H200
# (benchmarks/gpu.py --only bandwidth, L2-cold): the 10-expert 4-bit batch 42.9 -> 39.2 us, 65536 x 4096 4-bit
# unchanged (58.1 / 58.4 us), 65536 x 4096 2-bit 63.3 -> 56.9 us. The threads must equal the dispatch's
# threadgroup (ops_quant: 32 x QMV_SG; a test checks): a launch with more threads than its bound fails.
_MATVECS = ("qmv_b2", "qmv_b4", "qmv_b8", "qmv_rec_b2", "qmv_rec_b4", "qmv_rec_b8", "gate_up_swiglu",
            "gate_up_swiglu_rec", "gate_up_swiglu_rec_b2", "gate_up_swiglu_rec_b4", "gate_up_swiglu_rec_b8")
OCCUPANCY: dict[str, tuple[int, int]] = {name: (256, 3) for name in _MATVECS}


def cuda_glue(kernels: dict[str, KernelSignature]) -> str:
    out = ["", "#pragma clang force_cuda_host_device end", "#undef double", '#line 1 "<moepack-cuda-glue>"']
    for k in kernels.values():
        decl, call = [], []
        for p in k.params:
            if p.kind == "buffer":
                decl.append(f"{p.type} p{p.index}")
                call.append(f"p{p.index}")
            elif p.kind == "scalar" and _by_value(p):
                decl.append(f"{p.base} p{p.index}")
                call.append(f"p{p.index}")
            elif p.kind == "scalar":
                decl.append(f"{pointee(p)}* p{p.index}")
                call.append(f"*p{p.index}")
            else:
                field = BUILTINS[p.builtin]
                call.append(f"({p.base})32" if field is None else f"moepack_glue::builtin<{p.base}>::from(b_{field})")
        occ = OCCUPANCY.get(k.name)
        bounds = f"__attribute__((launch_bounds({occ[0]}, {occ[1]}))) " if occ else ""
        body = f"""
extern "C" __global__ {bounds}void {k.name}({', '.join(decl)}) {{
  const uint3 b_tpitg = {_SREG['tid']};
  const uint3 b_tgpig = {_SREG['ctaid']};
  const uint3 b_tptg = {_SREG['ntid']};
  const uint3 b_tgpg = {_SREG['nctaid']};
  const uint3 b_tpig = b_tgpig * b_tptg + b_tpitg;
  const uint3 b_tpg = b_tptg * b_tgpg;
  const uint b_tiitg = b_tpitg.x + b_tptg.x * (b_tpitg.y + b_tptg.y * b_tpitg.z);
  const uint b_tiisg = b_tiitg % 32u;
  const uint b_sgitg = b_tiitg / 32u;
  const uint b_sgptg = (b_tptg.x * b_tptg.y * b_tptg.z + 31u) / 32u;
  (void)b_tpig; (void)b_tpg; (void)b_tiisg; (void)b_sgitg; (void)b_sgptg; (void)b_tgpg; (void)b_tiitg;
  {KERNEL_PREFIX}{k.name}({', '.join(call)});
}}"""
        out.append(body)
    return "\n".join(out) + "\n"


def _ptx_params(sig: KernelSignature) -> tuple[PtxParam, ...]:
    out = []
    for p in sig.params:
        if p.kind == "builtin":
            continue
        kind = "scalar" if _by_value(p) else "pointer"
        out.append(PtxParam(p.index, p.name, kind, p.dtype))
    return tuple(out)


def compile_ptx(source: str | Path, arch: str = DEFAULT_ARCH) -> PtxModule:
    """PTX for every kernel of one .metal file (a name inside metal/ or a path), cached by content."""
    path, text, kernels = parsed_source(source)
    body = rewrite(text, path.name, cuda_kernel_prefix=KERNEL_PREFIX)
    full = f"#include <metal_stdlib>\n{body}{cuda_glue(kernels)}"
    out, built = compile_cached(full, cuda_flags(arch), ".ptx", f"{path.name} (PTX {arch})", path)
    ptx = out.read_text()
    mod = {name: PtxKernel(name, sig, _ptx_params(sig)) for name, sig in kernels.items()}
    for name in mod:
        if f".entry {name}(" not in ptx:
            raise KernelError(f"{path.name}: PTX has no entry {name}", hint="report this: the glue generator failed")
    return PtxModule(path, out, ptx, mod, built)

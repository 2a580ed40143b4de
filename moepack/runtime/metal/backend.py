"""The Metal kernels as a runtime backend: the kernel-module interface of ``kernels_ref`` over an Executor.

The model code (``moepack/runtime/models``) calls every numeric kernel through a kernel module
(``ctx.K.qmatmul(...)``, ``ctx.K.rmsnorm(...)``, ...). ``GpuKernels(executor)`` is such a module whose
functions build the launches of ``metal/*.metal`` (``ops_quant``, ``ops_seq``) and run them on the executor:
the CPU emulator (``metal-emu``), NVIDIA through PTX (``cuda``) or Apple Metal (``metal``). So the three
executors run the same model code, the same launch geometry and the same kernel files as each other.

Every launch is logged (``launches``: kernel, grid, threadgroup, the layer and phase the model was in) so
the launch plan of a forward pass can be printed and checked (``moepack.runtime.metal.plan``).

What still runs on the CPU in this backend (numpy glue in the model code): residual adds, the sigmoid
output gates, reshapes, unquantized (float) linears, and the 3-bit matvec (no 3-bit kernel: 3-bit codes
straddle 32-bit words), which falls back to the numpy reference and is counted in ``cpu_fallbacks``.
That is the prefill's path (and decode's with MOEPACK_RESIDENT=0); decode steps otherwise run device-resident
(``resident.py``: state in DeviceBuffers, glue in ``metal/glue.metal``), logging their launches here too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .. import kernels_ref
from . import ops_quant, ops_seq
from .dispatch import Dispatch, Executor

KERNELS = ("qmatmul", "expert_ffn", "rmsnorm", "gated_rmsnorm", "rope", "attention", "conv1d_step",
           "gated_delta", "router_topk", "qembedding")


@dataclass
class Launch:
    """One logged dispatch (no arrays kept: shapes only)."""

    layer: int | None
    phase: str
    source: str
    kernel: str
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    buffers: dict[int, str]  # [[buffer(n)]] -> "float32[3, 64]" or a scalar's value

    def to_json(self) -> dict:
        return {"layer": self.layer, "phase": self.phase, "source": self.source, "kernel": self.kernel,
                "grid": list(self.grid), "threadgroup": list(self.threadgroup),
                "buffers": {str(k): v for k, v in sorted(self.buffers.items())}}


def _describe(v) -> str:
    if isinstance(v, np.ndarray):
        return f"{v.dtype}[{', '.join(map(str, v.shape))}]"
    return repr(v.item() if isinstance(v, np.generic) else v)


@dataclass
class LaunchLog:
    """Dispatches issued through a GpuKernels, with the model position they belong to."""

    keep: int = 100_000  # most launches kept (a long generation issues many)
    launches: list[Launch] = field(default_factory=list)
    count: int = 0
    gpu_s: float = 0.0  # wall time inside executor.run

    def add(self, d: Dispatch, layer: int | None, phase: str) -> None:
        self.count += 1
        if len(self.launches) < self.keep:
            self.launches.append(Launch(layer, phase, d.source, d.kernel, tuple(d.grid), tuple(d.threadgroup),
                                        {i: _describe(v) for i, v in d.args.items()}))

    def clear(self) -> None:
        self.launches.clear()
        self.count = 0
        self.gpu_s = 0.0


class GpuKernels:
    """Kernel module over an executor: the functions of kernels_ref, same names and signatures."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.name = executor.name
        self.log = LaunchLog()
        self.cpu_fallbacks = 0
        self.layer: int | None = None  # where the model is: set through mark()
        self.phase = "embed"

    # ---------------------------------------------------------------------------------------- plumbing
    def mark(self, layer: int | None, phase: str) -> None:
        """Called by the model code at phase boundaries (attention / routing / experts / head)."""
        self.layer, self.phase = layer, phase

    def _run(self, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            self.log.add(d, self.layer, self.phase)
        t0 = time.perf_counter()
        self.executor.run(dispatches)
        self.log.gpu_s += time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------- kernels
    def qmatmul(self, x, w, scales, biases, bits, group_size):
        if bits not in ops_quant.KERNEL_BITS:
            self.cpu_fallbacks += 1
            return kernels_ref.qmatmul(x, w, scales, biases, bits, group_size)
        return ops_quant.qmatmul(self._recording(), x, w, scales, biases, bits, group_size)

    def expert_ffn(self, x, gw, gs_, gb, uw, us, ub, dw, ds_, db, bits, group_size):
        b = (bits, bits, bits) if np.isscalar(bits) else tuple(bits)
        if any(v not in ops_quant.KERNEL_BITS for v in b):
            self.cpu_fallbacks += 1
            return kernels_ref.expert_ffn(x, gw, gs_, gb, uw, us, ub, dw, ds_, db, bits, group_size)
        return ops_quant.expert_ffn(self._recording(), x, gw, gs_, gb, uw, us, ub, dw, ds_, db, bits, group_size)

    def expert_ffn_record(self, x, record, layout):
        """A routed expert straight from its raw packed record (uint8) and RecordLayout: x [T, D] -> [T, D]."""
        bits = tuple(layout.proj_bits(p) for p in ("gate", "up", "down"))
        if any(v not in ops_quant.KERNEL_BITS for v in bits):
            self.cpu_fallbacks += 1
            c = {comp.name: comp.view(record) for comp in layout.components}
            parts = [c[f"{p}.{k}"] for p in ("gate", "up", "down") for k in ("weight", "scales", "biases")]
            return kernels_ref.expert_ffn(x, *parts, bits, layout.components[0].group_size)
        return ops_quant.expert_ffn_record(self._recording(), x, record, layout)

    def moe_experts(self, x, block, layout):
        """Every routed expert of a request on the same tokens, in two launches: block uint8 [n, stride] (the
        reader's record rows, Pending.record_block()), x [T, D] -> [n, T, D]."""
        bits = tuple(layout.proj_bits(p) for p in ("gate", "up", "down"))
        if any(v not in ops_quant.KERNEL_BITS for v in bits):
            self.cpu_fallbacks += 1
            return np.stack([self.expert_ffn_record(x, row, layout) for row in block])
        return ops_quant.expert_ffn_record(self._recording(), x, block, layout)

    def moe_combine(self, residual, y, weights):
        """residual [T, D] + sum_k weights[t, k] * y[t, k] (y [T, K, D]) in one launch."""
        return ops_quant.moe_combine(self._recording(), residual, y, weights)

    def qembedding(self, ids, w, scales, biases, bits, group_size):
        if bits not in ops_quant.KERNEL_BITS:
            self.cpu_fallbacks += 1
            return kernels_ref.qembedding(ids, w, scales, biases, bits, group_size)
        return ops_quant.qembedding(self._recording(), ids, w, scales, biases, bits, group_size)

    def rmsnorm(self, x, weight, eps):
        return ops_seq.rmsnorm(self._recording(), x, weight, eps)

    def gated_rmsnorm(self, x, z, weight, eps):
        return ops_seq.gated_rmsnorm(self._recording(), x, z, weight, eps)

    def rope(self, x, positions, rotary_dim, base):
        return ops_seq.rope(self._recording(), x, positions, rotary_dim, base)

    def attention(self, q, k, v, q_positions, scale):
        return ops_seq.attention(self._recording(), q, k, v, q_positions, scale)

    def conv1d_step(self, x, state, weight):
        return ops_seq.conv1d_step(self._recording(), x, state, weight)

    def gated_delta(self, q, k, v, g, beta, state):
        return ops_seq.gated_delta(self._recording(), q, k, v, g, beta, state)

    def router_topk(self, logits, k, norm_topk_prob):
        return ops_seq.router_topk(self._recording(), logits, k, norm_topk_prob)

    def _recording(self) -> "_Recording":
        return _Recording(self)


class _Recording:
    """An Executor that logs through its GpuKernels and runs on its executor (for the ops' convenience
    functions, which pick their own outputs)."""

    def __init__(self, gk: GpuKernels):
        self._gk = gk
        self.name = gk.executor.name

    def run(self, dispatches) -> None:
        if isinstance(dispatches, Dispatch):
            dispatches = [dispatches]
        self._gk._run(list(dispatches))


def make_kernels(executor: Executor) -> GpuKernels:
    return GpuKernels(executor)

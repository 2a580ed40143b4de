"""One kernel launch (`Dispatch`) and the `Executor` protocol every Metal-plan executor implements.

A launch plan is a list of Dispatch records: which kernel of which `metal/*.metal` file, which numpy
array or scalar at which `[[buffer(n)]]` index, and the grid geometry. The same list runs on the CPU
emulator ("metal-emu"), on NVIDIA through PTX ("cuda") and on Apple Metal ("metal").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

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
                                       #   non-const buffers IN PLACE) or python/numpy scalar (constant T&)
    grid: tuple[int, int, int]         # threadgroups per grid (Metal dispatchThreadgroups / CUDA gridDim)
    threadgroup: tuple[int, int, int]  # threads per threadgroup (blockDim); x*y*z <= 1024
    label: str = ""


class Executor(Protocol):
    name: str  # "metal-emu", "cuda", "metal"

    def run(self, dispatches: Sequence[Dispatch]) -> None:
        """Run the dispatches as one command buffer, in order, synchronously."""
        ...

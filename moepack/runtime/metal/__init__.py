"""Metal backend: the `metal/*.metal` kernels, their launch records, and executors of them.

`Dispatch`/`Executor` (dispatch.py) are the shared interface; the CPU emulator lives in `emulator/`,
the PTX compile path for NVIDIA in `ptx.py`.
"""

from moepack.runtime.metal.dispatch import Dispatch, Executor, KernelError

__all__ = ["Dispatch", "Executor", "KernelError"]

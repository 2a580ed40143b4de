"""Executors of the Metal launch plan, by backend name: 'metal-emu' (CPU emulator, any Linux/macOS with
clang-19), 'cuda' (PTX through CuPy on an NVIDIA GPU), 'metal' (Apple GPU through PyObjC)."""

from __future__ import annotations

import os

from ...errors import MoepackError
from .dispatch import Executor

EXECUTORS = ("metal-emu", "cuda", "metal")
ENV_SCHEDULE = "MOEPACK_EMU_SCHEDULE"  # forward | reverse | random: the emulator's thread resume order


def make_executor(name: str) -> Executor:
    if name == "metal-emu":
        from .emulator import Emulator
        from .emulator.build import clang

        clang()  # no clang-19: one clear error now, not one per kernel later
        return Emulator(schedule=os.environ.get(ENV_SCHEDULE, "forward"))
    if name == "cuda":
        from .executor_cuda import CudaExecutor

        return CudaExecutor()
    if name == "metal":
        from .executor_metal import MetalExecutor

        return MetalExecutor()
    raise MoepackError(f"unknown executor {name!r}", hint=f"use one of {', '.join(EXECUTORS)}")

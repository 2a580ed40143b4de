"""CPU emulator of the Metal kernels: the repo's `metal/*.metal` files compiled with clang-19 against a
stand-in `<metal_stdlib>` (include/), each GPU thread run as a fiber, one threadgroup at a time.

    emu = Emulator(schedule="reverse", strict_address_spaces=False, strict_simd=False, seed=0)
    emu.run([Dispatch("norm.metal", "rmsnorm_f32", {0: x, 1: w, 2: out, 3: eps}, (rows, 1, 1), (256, 1, 1))])
    emu.library("norm.metal").kernels["rmsnorm_f32"]      # parsed KernelSignature

Schedules: "forward" / "reverse" / "random" (seeded) resume order of threads and groups; a missing
barrier shows as a wrong result under some of them, so tests run at least two. strict_address_spaces
makes device/threadgroup/constant real clang address spaces (misuse fails to compile, as on a Mac);
strict_simd demands all 32 lanes in every simd collective (what CUDA's full-mask shuffles need).
guard_buffers (default on) runs each buffer from a copy that ends at an inaccessible page, so reading
or writing past a buffer's end is an error naming the buffer (turn off to save the copies).
Check a file by hand: `python -m moepack.runtime.metal.emulator check metal/norm.metal`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from moepack.runtime.metal.dispatch import Dispatch, HostBuffers, KernelError, resolve_host_args
from moepack.runtime.metal.emulator.library import Library

EmulatorError = KernelError  # a MoepackError; the name the interface promises

SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}

_LIBRARIES: dict[tuple[str, bool], Library] = {}  # process-wide: (resolved path + mtime, strict) -> Library


class Emulator(HostBuffers):
    """Executor of Dispatch lists on the CPU (name "metal-emu"); persistent DeviceBuffers live in host memory."""

    name = "metal-emu"

    def __init__(self, schedule: str = "forward", strict_address_spaces: bool = False, strict_simd: bool = False,
                 seed: int = 0, guard_buffers: bool = True):
        if schedule not in SCHEDULES:
            raise EmulatorError(f"unknown schedule {schedule!r}", hint=f"choose one of {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self.strict_address_spaces = bool(strict_address_spaces)
        self.strict_simd = bool(strict_simd)
        self.seed = int(seed)
        self.guard_buffers = bool(guard_buffers)

    def __repr__(self) -> str:
        return (f"Emulator(schedule={self.schedule!r}, strict_address_spaces={self.strict_address_spaces}, "
                f"strict_simd={self.strict_simd}, seed={self.seed})")

    def library(self, source: str | Path) -> Library:
        """The compiled library of one .metal file (a name inside metal/ or a path); compiled once per
        content (disk cache), loaded once per process."""
        from moepack.runtime.metal import sources

        path = sources.resolve(source)
        st = path.stat()
        key = (f"{path}:{st.st_mtime_ns}:{st.st_size}", self.strict_address_spaces)
        lib = _LIBRARIES.get(key)
        if lib is None:
            lib = Library.load(path, strict_address_spaces=self.strict_address_spaces)
            _LIBRARIES[key] = lib
        return lib

    def run(self, dispatches: Sequence[Dispatch]) -> None:
        """Run the dispatches in order, synchronously; output buffers are written in place."""
        if isinstance(dispatches, Dispatch):
            dispatches = [dispatches]
        for d in dispatches:
            self.library(d.source).launch(resolve_host_args(d), SCHEDULES[self.schedule], self.seed,
                                          self.strict_simd, guard=self.guard_buffers)


__all__ = ["Emulator", "EmulatorError", "Library", "SCHEDULES"]

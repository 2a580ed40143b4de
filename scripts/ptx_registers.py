#!/usr/bin/env python3
"""Registers, spills and SASS of the `.metal` kernels as NVIDIA's assembler builds them, on any x86-64 Linux
machine, GPU or not (a developer tool, not run in CI).

The PTX executor (`moepack run --backend cuda`) hands PTX to the driver, which assembles it for the GPU at
load time: the registers a kernel gets there decide how many threadgroups share a multiprocessor, which is
most of what a matvec's bandwidth depends on (see `moepack.runtime.metal.ptx.OCCUPANCY`). This script runs
the same assembler (`ptxas`, from NVIDIA's `nvidia-cuda-nvcc-cu12` wheel) on the PTX clang-19 makes of a
`.metal` file, and prints per kernel: registers, spill bytes and stack frame; `--sass KERNEL` also writes
that kernel's machine code with a count of its instructions by opcode (`cuobjdump` and `nvdisasm`, from
NVIDIA's wheels of those names). The wheels are downloaded once with pip into `--tools` (PyPI access needed).

    python scripts/ptx_registers.py                       # quant.metal, every kernel
    python scripts/ptx_registers.py attention.metal
    python scripts/ptx_registers.py --sass qmv_rec_b4     # + /tmp/moepack-sass/qmv_rec_b4.sass
    python scripts/ptx_registers.py --arch sm_90 --tools ~/.cache/moepack/cuda-tools
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moepack.runtime.metal.ptx import DEFAULT_ARCH, compile_ptx  # noqa: E402

WHEELS = {"ptxas": "nvidia-cuda-nvcc-cu12", "cuobjdump": "nvidia-cuda-cuobjdump", "nvdisasm": "nvidia-cuda-nvdisasm"}


def tool(name: str, tools: Path) -> Path:
    """Path of `name` unpacked from its NVIDIA wheel under `tools` (downloaded with pip the first time)."""
    found = sorted(tools.glob(f"**/bin/{name}"))
    if found:
        return found[-1]
    tools.mkdir(parents=True, exist_ok=True)
    print(f"fetching {WHEELS[name]} (for {name}) into {tools} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(tools), WHEELS[name]], check=True)
    for whl in tools.glob(f"{WHEELS[name].replace('-', '_')}-*.whl"):
        with zipfile.ZipFile(whl) as z:
            z.extractall(tools / whl.stem)
    found = sorted(tools.glob(f"**/bin/{name}"))
    if not found:
        raise SystemExit(f"error: {WHEELS[name]} has no bin/{name} for this platform")
    found[-1].chmod(0o755)
    return found[-1]


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def ptxas_report(text: str) -> dict[str, dict]:
    """{entry: {registers, stack, spill_stores, spill_loads}} from `ptxas -v` output."""
    out: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            cur = out.setdefault(m.group(1), {})
        elif cur is not None and (m := _PROPS.search(line)) and "stack" not in cur:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif cur is not None and (m := _USED.search(line)):
            cur["registers"] = int(m.group(1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("source", nargs="?", default="quant.metal", help="a .metal file (name in metal/ or a path)")
    ap.add_argument("--arch", default=DEFAULT_ARCH, help=f"GPU architecture (default {DEFAULT_ARCH})")
    ap.add_argument("--tools", type=Path, default=Path.home() / ".cache" / "moepack" / "cuda-tools",
                    help="where the NVIDIA wheels are unpacked")
    ap.add_argument("--sass", metavar="KERNEL", default=None, help="also dump this kernel's SASS")
    ap.add_argument("--out", type=Path, default=Path("/tmp/moepack-sass"), help="folder for the cubin and SASS")
    a = ap.parse_args()

    mod = compile_ptx(a.source, a.arch)
    a.out.mkdir(parents=True, exist_ok=True)
    cubin = a.out / f"{Path(a.source).stem}.cubin"
    run = subprocess.run([str(tool("ptxas", a.tools)), f"-arch={a.arch}", "-O3", "-v", str(mod.path), "-o",
                          str(cubin)], capture_output=True, text=True)
    if run.returncode:
        print(run.stderr, file=sys.stderr)
        return 1
    rep = ptxas_report(run.stderr)
    print(f"{'kernel':<26} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6}")
    for name, r in rep.items():
        print(f"{name:<26} {r.get('registers', 0):>5} {r.get('spill_stores', 0):>9} {r.get('spill_loads', 0):>9} "
              f"{r.get('stack', 0):>6}")
    if a.sass:
        disasm = tool("nvdisasm", a.tools)  # cuobjdump runs it: on PATH
        env = dict(os.environ, PATH=f"{disasm.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        dump = subprocess.run([str(tool("cuobjdump", a.tools)), "-sass", "-fun", a.sass, str(cubin)],
                              capture_output=True, text=True, env=env)
        if dump.returncode:
            print(f"error: cuobjdump: {dump.stderr.strip()}", file=sys.stderr)
            return 1
        text = dump.stdout
        path = a.out / f"{a.sass}.sass"
        path.write_text(text)
        ops = collections.Counter(m.group(1).split(".")[0] for m in
                                  re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text))
        print(f"\n{a.sass}: {sum(ops.values())} instructions -> {path}")
        print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

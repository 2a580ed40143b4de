"""`python -m moepack.runtime.metal.emulator check [--strict] [--ptx] FILE...`: compile .metal files the way
the emulator (and optionally the PTX path) does and print the full compiler output and each kernel's
signature. Exit status 1 when any file fails."""

from __future__ import annotations

import argparse
import sys
import time

from moepack.runtime.metal.dispatch import KernelError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moepack.runtime.metal.emulator",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python -m moepack.runtime.metal.emulator check --strict --ptx metal/norm.metal")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="compile files and list their kernels")
    c.add_argument("files", nargs="+")
    c.add_argument("--strict", action="store_true", help="also compile with strict address spaces")
    c.add_argument("--ptx", action="store_true", help="also compile to PTX (CUDA branch of the header)")
    args = ap.parse_args(argv)

    from moepack.runtime.metal.emulator.library import Library

    bad = 0
    for f in args.files:
        modes = [("cpu", False)] + ([("cpu-strict", True)] if args.strict else [])
        for label, strict in modes:
            t = time.perf_counter()
            try:
                lib = Library.load(f, strict_address_spaces=strict)
            except KernelError as e:
                bad += 1
                print(f"FAIL {f} [{label}]: {e}\n{getattr(e, 'log', '')}", file=sys.stderr)
                continue
            took = time.perf_counter() - t
            print(f"ok   {f} [{label}] {'compiled' if lib.built else 'cached'} in {took:.2f} s")
            if not strict:
                for k in lib.kernels.values():
                    params = ", ".join(f"{p.name}:{p.builtin or f'buffer({p.index}) {p.type}'}" for p in k.params)
                    print(f"       {k.name}({params})")
        if args.ptx:
            from moepack.runtime.metal.ptx import compile_ptx

            t = time.perf_counter()
            try:
                mod = compile_ptx(f)
                print(f"ok   {f} [ptx] in {time.perf_counter() - t:.2f} s: {', '.join(mod.entries)}")
            except KernelError as e:
                bad += 1
                print(f"FAIL {f} [ptx]: {e}\n{getattr(e, 'log', '')}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

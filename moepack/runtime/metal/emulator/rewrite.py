"""Source rewrites that let clang compile MSL as C++14 (for the CPU emulator and for PTX).

Only constructs plain C++ cannot express are touched, and every rewrite keeps the line count, so
compiler diagnostics point at the real line of the `.metal` file:
- vector constructors `float4(a, b, c, d)`, `float4(xy, z, w)`, `float4(x)`, `float4(int4v)` ->
  `metal::moepack_make<float4>(...)` (clang rejects multi-argument functional casts, and a one-argument
  cast between vectors would be a bit cast instead of Metal's element-wise conversion);
- `threadgroup T name[N];` declarations -> `MOEPACK_TG_ARRAY(name, id, [N], T);` (one shared instance
  per threadgroup on the CPU, `__shared__` on CUDA);
- program-scope `constant T x = ...;` -> `MOEPACK_PROGRAM_CONSTANT T x = ...;` (`__constant__` on CUDA);
- half literals `1.5h` -> `((half)1.5f)`.
"""

from __future__ import annotations

import re

from moepack.runtime.metal.dispatch import KernelError
from moepack.runtime.metal.signature import find_kernels, mask_comments

_SCALARS = "float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool"
_VEC_CTOR = re.compile(rf"(?<![\w.>])(?:metal::)?((?:packed_)?(?:{_SCALARS})[234])\s*\(")
_HALF_LIT = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_TG_DECL = re.compile(r"^threadgroup\s+(.+?)\s*\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", re.S)
_TYPE_PREFIX = re.compile(r"^((?:static\s+|constexpr\s+|const\s+)*)constant\b")


def _statement_start(masked: str, i: int) -> bool:
    j = i - 1
    while j >= 0 and masked[j] in " \t\r\n":
        j -= 1
    return j < 0 or masked[j] in ";{}" or (masked[j] == ":" and masked[j - 1:j + 1] != "::")


def _same_lines(old: str, new: str) -> str:
    return new + "\n" * (old.count("\n") - new.count("\n"))


def rewrite(src: str, file: str = "<source>", cuda_kernel_prefix: str | None = None) -> str:
    """The source with the rewrites above applied; `cuda_kernel_prefix` also renames each `kernel void f(`
    to `kernel void <prefix>f(` (so a CUDA `extern "C" __global__ f` entry can take the plain name)."""
    masked = mask_comments(src)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) on the original text

    for m in _VEC_CTOR.finditer(masked):
        edits.append((m.start(), m.end(), f"metal::moepack_make<{m.group(1)}>("))

    for m in _HALF_LIT.finditer(masked):
        lit = m.group(1)
        edits.append((m.start(), m.end(), f"((half){lit}{'' if ('.' in lit or 'e' in lit.lower()) else '.0'}f)"))

    tg_id = 0
    depth = 0
    i, n = 0, len(masked)
    while i < n:
        c = masked[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "t" and masked.startswith("threadgroup", i) and not (i and (masked[i - 1].isalnum() or masked[i - 1] in "_")) \
                and not (i + 11 < n and (masked[i + 11].isalnum() or masked[i + 11] == "_")) and _statement_start(masked, i):
            end = masked.find(";", i)
            stmt = masked[i:end]
            head = stmt.split("[")[0]  # `threadgroup float a[N * M];` is an array, `threadgroup float* p` is not
            if depth > 0 and "(" not in head and "*" not in head and "&" not in head:
                line = masked.count("\n", 0, i) + 1
                if "=" in stmt or "{" in stmt:
                    raise KernelError(f"{file}:{line}: threadgroup variable with an initialiser",
                                      hint="Metal threadgroup memory cannot be initialised in its declaration; "
                                           "fill it in the kernel, then threadgroup_barrier")
                if "," in stmt.replace(" ", "").split("[")[0] or re.search(r"\]\s*,", stmt):
                    raise KernelError(f"{file}:{line}: several threadgroup variables in one declaration",
                                      hint="declare one threadgroup array per statement")
                d = _TG_DECL.match(" ".join(stmt.split()))
                if not d:
                    raise KernelError(f"{file}:{line}: cannot parse threadgroup declaration '{' '.join(stmt.split())}'",
                                      hint="write `threadgroup float name[N];` at kernel scope")
                type_, name, dims = d.group(1).strip(), d.group(2), d.group(3).replace(" ", "")
                original = src[i:end]
                new = f"MOEPACK_TG_ARRAY({name}, {tg_id}, {dims}, {type_})"
                edits.append((i, end, _same_lines(original, new)))
                tg_id += 1
                i = end
                continue
        elif c == "c" and depth == 0 and masked.startswith("constant", i) and _statement_start(masked, i) \
                and not (i + 8 < n and (masked[i + 8].isalnum() or masked[i + 8] == "_")):
            end = masked.find(";", i)
            stmt = masked[i:end]
            if "(" not in stmt.split("=")[0]:  # a variable, not a function returning a constant pointer
                edits.append((i, i + 8, "MOEPACK_PROGRAM_CONSTANT"))
        i += 1

    if cuda_kernel_prefix is not None:
        for name, _start, open_, _close in find_kernels(masked):
            j = masked.rindex(name, 0, open_ + 1)
            edits.append((j, j + len(name), cuda_kernel_prefix + name))

    edits.sort()
    out, pos = [], 0
    for start, end, rep in edits:
        if start < pos:
            continue  # overlapping edit (e.g. a half literal inside a rewritten declaration): first wins
        out.append(src[pos:start])
        out.append(rep)
        pos = end
    out.append(src[pos:])
    return "".join(out)


"""Parse the `kernel void name(...)` entry points of a `.metal` file.

Every executor needs the same facts about a kernel: which parameter sits at which `[[buffer(n)]]`
index, its type and address space (to check a numpy array's dtype, and to know which buffers the kernel
may write), and which parameters are builtins (`[[thread_position_in_grid]]`, ...).

    sigs = parse_kernels(source_text, "norm.metal")
    sigs["rmsnorm_f32"].buffers[0]   # Param(name='x', type='device const float*', dtype=float32, ...)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from moepack.runtime.metal.dispatch import KernelError

# MSL scalar type -> numpy dtype ("bfloat" travels as its uint16 bit pattern)
SCALAR_DTYPES: dict[str, np.dtype] = {
    "float": np.dtype(np.float32),
    "half": np.dtype(np.float16),
    "bfloat": np.dtype(np.uint16),
    "uint": np.dtype(np.uint32),
    "int": np.dtype(np.int32),
    "ushort": np.dtype(np.uint16),
    "short": np.dtype(np.int16),
    "uchar": np.dtype(np.uint8),
    "char": np.dtype(np.int8),
    "bool": np.dtype(np.bool_),
    "ulong": np.dtype(np.uint64),
    "long": np.dtype(np.int64),
}
for _alias, _base in (("uint32_t", "uint"), ("int32_t", "int"), ("uint16_t", "ushort"), ("int16_t", "short"),
                      ("uint8_t", "uchar"), ("int8_t", "char"), ("uint64_t", "ulong"), ("int64_t", "long"),
                      ("unsigned", "uint"), ("size_t", "ulong")):
    SCALAR_DTYPES[_alias] = SCALAR_DTYPES[_base]

# builtin attribute -> field of the emulator's ThreadInfo (None: a constant)
BUILTINS: dict[str, str | None] = {
    "thread_position_in_grid": "tpig",
    "thread_position_in_threadgroup": "tpitg",
    "threadgroup_position_in_grid": "tgpig",
    "threads_per_threadgroup": "tptg",
    "dispatch_threads_per_threadgroup": "tptg",
    "threadgroups_per_grid": "tgpg",
    "threads_per_grid": "tpg",
    "dispatch_threads_per_grid": "tpg",
    "thread_index_in_threadgroup": "tiitg",
    "thread_index_in_simdgroup": "tiisg",
    "simdgroup_index_in_threadgroup": "sgitg",
    "simdgroups_per_threadgroup": "sgptg",
    "dispatch_simdgroups_per_threadgroup": "sgptg",
    "thread_execution_width": None,
    "threads_per_simdgroup": None,
}

ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")
_VECTOR = re.compile(r"^(?:packed_)?([a-z]+?)([234])$")


@dataclass(frozen=True)
class Param:
    name: str
    type: str                    # the type as written, without attributes: "device const float*"
    kind: str                    # "buffer" (pointer), "scalar" (constant T& at a buffer index), "builtin"
    index: int | None = None     # [[buffer(n)]]
    builtin: str | None = None   # builtin attribute name
    address_space: str | None = None
    const: bool = False
    base: str = ""               # element type name: "float", "float4", "MyParams"
    pointer: bool = False
    reference: bool = False

    @property
    def scalar(self) -> str | None:
        """The MSL scalar type of one element ('float' for float4, 'uint' for atomic_uint), None for a struct."""
        m = re.fullmatch(r"atomic_(\w+)|atomic\s*<\s*(\w+)\s*>", self.base)
        if m and (m.group(1) or m.group(2)) in SCALAR_DTYPES:
            return m.group(1) or m.group(2)
        if self.base in SCALAR_DTYPES:
            return self.base
        m = _VECTOR.match(self.base)
        if m and m.group(1) in SCALAR_DTYPES:
            return m.group(1)
        return None

    @property
    def width(self) -> int:
        """Vector width of one element (1 for scalars)."""
        m = _VECTOR.match(self.base)
        return int(m.group(2)) if (m and m.group(1) in SCALAR_DTYPES) else 1

    @property
    def dtype(self) -> np.dtype | None:
        """numpy dtype an argument array must have (None for a struct element type)."""
        s = self.scalar
        return SCALAR_DTYPES[s] if s else None

    @property
    def writable(self) -> bool:
        return self.kind == "buffer" and self.address_space in ("device", None) and not self.const


@dataclass(frozen=True)
class KernelSignature:
    name: str
    params: tuple[Param, ...]
    line: int                                    # 1-based line of `kernel void name(` in the file
    buffers: dict[int, Param] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.buffers:
            self.buffers.update({p.index: p for p in self.params if p.index is not None})


def mask_comments(src: str) -> str:
    """The source with comments, preprocessor lines and string/char literal contents blanked; same length,
    newlines kept."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == "#" and src[src.rfind("\n", 0, i) + 1:i].strip() == "":  # preprocessor line / line marker
            j = i
            while j < n and src[j] != "\n":
                j += 2 if src.startswith("\\\n", j) else 1
            for k in range(i, min(j, n)):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                if out[k] != "\n":
                    out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def matching(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    """Index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise KernelError(f"unbalanced '{open_}' at offset {start}", hint="check the kernel source for a missing bracket")


def split_top_level(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([<{":
            depth += 1
        elif ch in ")]>}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


_MARKER = re.compile(r'^#\s*(?:line\s+)?(\d+)\s+"[^"]*"', re.M)


def source_line(src: str, offset: int) -> int:
    """1-based line of `offset` in the original file, following `# N "file"` line markers (clang -E output)."""
    last = None
    for m in _MARKER.finditer(src, 0, offset):
        last = m
    if last is None:
        return src.count("\n", 0, offset) + 1
    return int(last.group(1)) + src.count("\n", last.end() + 1, offset)


_KERNEL = re.compile(r"(?:\bkernel|\[\[\s*kernel\s*\]\])\s+void\s+([A-Za-z_]\w*)\s*\(")
_ATTR = re.compile(r"\[\[\s*(.*?)\s*\]\]", re.S)


def find_kernels(masked: str) -> list[tuple[str, int, int, int]]:
    """(name, start of `kernel`, offset of '(', offset of ')') for every kernel entry point."""
    found = []
    for m in _KERNEL.finditer(masked):
        open_ = m.end() - 1
        found.append((m.group(1), m.start(), open_, matching(masked, open_)))
    return found


def parse_param(text: str, kernel: str, file: str) -> Param:
    attrs = _ATTR.findall(text)
    decl = " ".join(_ATTR.sub(" ", text).split())
    where = f"{file}: kernel {kernel}, parameter '{decl}'"
    m = re.match(r"^(.*?)([A-Za-z_]\w*)$", decl)
    if not m or not m.group(1).strip():
        raise KernelError(f"{where}: cannot parse the parameter", hint="write parameters as `<type> <name> [[attribute]]`")
    type_, name = m.group(1).strip(), m.group(2)
    tokens = re.findall(r"[A-Za-z_][\w:]*|\*|&", type_)
    space = next((t for t in tokens if t in ADDRESS_SPACES), None)
    const = "const" in tokens
    pointer, reference = "*" in tokens, "&" in tokens
    base_tokens = [t for t in tokens if t not in ADDRESS_SPACES + ("const", "volatile", "*", "&", "restrict", "__restrict")]
    base = " ".join(base_tokens).replace("metal::", "")
    if base == "unsigned int":
        base = "uint"
    if not attrs:
        raise KernelError(f"{where}: no [[buffer(n)]] or builtin attribute",
                          hint="every kernel parameter needs an explicit [[buffer(n)]] or a builtin attribute")
    attr = attrs[0].strip()
    bm = re.fullmatch(r"buffer\s*\(\s*(\d+)\s*\)", attr)
    if bm:
        index = int(bm.group(1))
        if pointer:
            kind = "buffer"
        elif reference:
            kind = "scalar"
        else:
            raise KernelError(f"{where}: a [[buffer(n)]] parameter must be a pointer or a `constant T&` reference",
                              hint="write `device const float* x [[buffer(0)]]` or `constant uint& n [[buffer(1)]]`")
        return Param(name, type_, kind, index=index, address_space=space, const=const or space == "constant",
                     base=base, pointer=pointer, reference=reference)
    if attr in BUILTINS:
        if base not in ("uint", "ushort", "int", "short", "uint2", "ushort2", "uint3", "ushort3", "int2", "int3",
                        "short2", "short3"):
            raise KernelError(f"{where}: builtin [[{attr}]] must be uint, uint2, uint3 (or ushort*)",
                              hint="declare builtins as uint / uint2 / uint3")
        return Param(name, type_, "builtin", builtin=attr, const=const, base=base)
    raise KernelError(f"{where}: unsupported attribute [[{attr}]]",
                      hint="the backends support [[buffer(n)]] and the builtins listed in metal-interface.md")


_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)


def expand_kernel_macros(src: str) -> str:
    """Expand function-like macros whose body defines a `kernel` (e.g. `QMV(4)` -> `kernel void qmv_b4(...)`),
    so executors without a C preprocessor (the macOS one) still see every entry point. Handles parameter
    substitution and `##` pasting; other macros inside the body are left as written (the signature
    parser does not need them)."""
    macros = {}
    for m in _DEFINE.finditer(src):
        body = m.group(3).replace("\\\n", " ")
        if re.search(r"\bkernel\b", mask_comments(body)):
            macros[m.group(1)] = ([a.strip() for a in m.group(2).split(",") if a.strip()], body)
    if not macros:
        return src
    masked = mask_comments(src)
    call = re.compile(r"\b(" + "|".join(map(re.escape, macros)) + r")\s*\(")
    out, pos = [], 0
    for m in call.finditer(masked):
        if m.start() < pos:
            continue
        close = matching(masked, m.end() - 1)
        params, body = macros[m.group(1)]
        args = [a.strip() for a in split_top_level(src[m.end():close])]
        if len(args) != len(params):
            continue
        expanded = re.sub(r"\b\w+\b", lambda t: dict(zip(params, args)).get(t.group(0), t.group(0)), body)
        expanded = re.sub(r"\s*##\s*", "", expanded)
        out.append(src[pos:m.start()])
        out.append(expanded + "\n" * src.count("\n", m.start(), close))
        pos = close + 1
    out.append(src[pos:])
    return "".join(out)


def parse_kernels(src: str, file: str = "<source>") -> dict[str, KernelSignature]:
    """Every `kernel void` entry point of a .metal source, by name, in file order (kernels written by a
    function-like macro included)."""
    src = expand_kernel_macros(src)
    masked = mask_comments(src)
    out: dict[str, KernelSignature] = {}
    for name, start, open_, close in find_kernels(masked):
        before = masked[:start].rstrip()
        if before.endswith(">") and re.search(r"template\s*<[^;{}]*>$", before):
            raise KernelError(f"{file}: kernel {name} is a template",
                              hint="entry points must be plain functions; keep templates in inline helpers "
                                   "and add one `kernel void` per instantiation")
        if name in out:
            raise KernelError(f"{file}: kernel {name} is defined twice", hint="give every entry point its own name")
        body = masked[open_ + 1:close]
        params = tuple(parse_param(p, name, file) for p in split_top_level(body) if p.strip() and p.strip() != "void")
        seen: dict[int, str] = {}
        for p in params:
            if p.index is not None:
                if p.index in seen:
                    raise KernelError(f"{file}: kernel {name}: [[buffer({p.index})]] used by both {seen[p.index]} "
                                      f"and {p.name}", hint="give every buffer parameter its own index")
                seen[p.index] = p.name
        out[name] = KernelSignature(name, params, source_line(src, start))
    return out

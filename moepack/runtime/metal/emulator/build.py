"""Compile a rewritten `.metal` source with clang-19, cached by content hash.

Used by the CPU emulator (a shared object per file) and by the PTX path. The cache key covers the
rewritten source, the generated glue, the flags, every stand-in header and the compiler's version, so a
header change rebuilds everything. Builds write to a temporary name and rename, so concurrent test
processes never load a half-written file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from moepack.runtime.metal.dispatch import KernelError

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
STUB_DIR = INCLUDE_DIR / "preprocess"  # empty <metal_stdlib> for the macro-expansion pass
METAL_VERSION_DEFINE = "-D__METAL_VERSION__=310"
ENV_CLANG = "MOEPACK_CLANG"
ENV_CACHE = "MOEPACK_METAL_CACHE"


def cache_dir() -> Path:
    """$MOEPACK_METAL_CACHE, else $MOEPACK_CACHE_DIR/metal-emu, else ~/.cache/moepack/metal-emu."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    if os.environ.get("MOEPACK_CACHE_DIR"):
        return Path(os.environ["MOEPACK_CACHE_DIR"]) / "metal-emu"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moepack" / "metal-emu"


def writable_cache_dir() -> Path:
    """cache_dir(), or a per-user folder under the temp dir when that cannot be created (read-only HOME)."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = Path(tempfile.gettempdir()) / f"moepack-metal-emu-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.lru_cache(maxsize=None)
def clang() -> str:
    """Path of clang 19 (or newer): $MOEPACK_CLANG, clang-19, clang-20, then plain clang if new enough."""
    names = [os.environ[ENV_CLANG]] if os.environ.get(ENV_CLANG) else ["clang-19", "clang-20", "clang-21", "clang"]
    for name in names:
        path = shutil.which(name)
        if not path:
            continue
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"clang version (\d+)", out)
        if m and int(m.group(1)) >= 19:
            return path
    raise KernelError("clang 19 or newer not found (needed to compile the .metal kernels on Linux)",
                      hint="install it: `apt-get install -y clang-19`, or set MOEPACK_CLANG to a clang >= 19")


@functools.lru_cache(maxsize=None)
def _toolchain_key() -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([clang(), "--version"], capture_output=True, text=True).stdout.encode())
    for p in sorted(INCLUDE_DIR.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _first_errors(log: str, limit: int = 3) -> str:
    lines = [ln for ln in log.splitlines() if ": error:" in ln or ": fatal error:" in ln]
    return "; ".join(lines[:limit]) if lines else (log.strip().splitlines() or ["(no output)"])[-1]


def compile_cached(text: str, flags: list[str], suffix: str, label: str, file: Path | str) -> tuple[Path, bool]:
    """Compile `text` (C++ or CUDA source, language given in flags) to a cached output with `suffix`.

    Returns (path, built): built is False when the cache already held it.
    """
    key = hashlib.sha256("\0".join([_toolchain_key(), " ".join(flags), text]).encode()).hexdigest()[:32]
    out_dir = writable_cache_dir()
    out = out_dir / f"{Path(str(file)).stem}-{key}{suffix}"
    if out.exists():
        return out, False
    fd, tmp_src = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".cu" if "cuda" in flags else ".cpp", dir=out_dir)
    tmp_out = tmp_src + suffix
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        cmd = [clang(), *flags, "-isystem", str(INCLUDE_DIR), tmp_src, "-o", tmp_out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            log = proc.stderr.replace(tmp_src, str(file))
            err = KernelError(f"{label}: compile failed: {_first_errors(log)}",
                              hint="the full compiler output is in this error's `log`; run "
                                   "`python -m moepack.runtime.metal.emulator check FILE` to print it")
            err.log = log
            raise err
        os.replace(tmp_out, out)
    finally:
        for p in (tmp_src, tmp_out):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    return out, True


def preprocess(path: Path, text: str) -> str:
    """The kernel file with its own macros expanded (kernels written by a macro become visible to the
    signature parser and the rewrites) and `# N "file"` line markers; cached by content.

    The metal headers resolve to empty stubs here, so address-space words, simd_* calls and header
    constants pass through untouched; the real header is included when the result is compiled.
    """
    flags = ["-E", "-x", "c++", "-std=c++14", METAL_VERSION_DEFINE, "-nostdinc", "-isystem", str(STUB_DIR)]
    key = hashlib.sha256("\0".join([_toolchain_key(), " ".join(flags), str(path), text]).encode()).hexdigest()[:32]
    out = writable_cache_dir() / f"{path.stem}-{key}.i"
    if out.exists():
        return out.read_text()
    proc = subprocess.run([clang(), *flags, "-"], input=text, capture_output=True, text=True, cwd=str(path.parent))
    if proc.returncode != 0:
        log = proc.stderr.replace("<stdin>", str(path))
        err = KernelError(f"{path.name}: preprocessing failed: {_first_errors(log)}",
                          hint="fix the #include / #define lines of the kernel file")
        err.log = log
        raise err
    result = proc.stdout.replace('"<stdin>"', f'"{path}"')
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".i", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        f.write(result)
    os.replace(tmp, out)
    return result


def parsed_source(source) -> tuple[Path, str, dict]:
    """(path, preprocessed text, {kernel name: KernelSignature}) of one .metal file (a name inside metal/ or a
    path): what both the emulator and the PTX path compile. A file without a kernel is an error."""
    from moepack.runtime.metal import sources
    from moepack.runtime.metal.signature import parse_kernels

    path, raw = sources.read_source(source)
    text = preprocess(path, raw)
    kernels = parse_kernels(text, path.name)
    if not kernels:
        raise KernelError(f"{path.name}: no `kernel void` entry point found",
                          hint="a .metal file must define at least one kernel")
    return path, text, kernels

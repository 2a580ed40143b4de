"""Where the `.metal` kernel sources live, and reading them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from moepack.errors import MoepackError

ENV_KERNEL_DIR = "MOEPACK_METAL_DIR"


def kernel_dir() -> Path:
    """The `metal/` folder: $MOEPACK_METAL_DIR, else the repository root's `metal/` (a checkout),
    else `moepack/metal/` shipped inside the package."""
    env = os.environ.get(ENV_KERNEL_DIR)
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    candidates = [here.parents[3] / "metal", here.parents[2] / "metal"]
    for c in candidates:
        if c.is_dir():
            return c
    raise MoepackError(
        "cannot find the metal/ kernel folder",
        hint=f"run from a moepack checkout or set {ENV_KERNEL_DIR} to the folder holding the .metal files",
    )


def resolve(source: str | os.PathLike) -> Path:
    """A `.metal` file: a bare name ("norm.metal") inside kernel_dir(), else a path as given."""
    p = Path(source)
    if len(p.parts) == 1:
        try:
            q = kernel_dir() / p
        except MoepackError:
            q = None
        if q is not None and q.is_file():
            return q.resolve()
    if p.is_file():
        return p.resolve()
    raise MoepackError(
        f"no kernel source {source!s} (looked in {kernel_dir()})",
        hint="give a file name inside metal/, e.g. 'norm.metal', or a path to a .metal file",
    )


def list_sources() -> list[Path]:
    """Every `.metal` file in kernel_dir(), sorted by name."""
    return sorted(kernel_dir().glob("*.metal"))


def read_source(source: str | os.PathLike) -> tuple[Path, str]:
    path = resolve(source)
    return path, path.read_text()


def content_hash(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:24]

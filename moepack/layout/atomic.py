"""Atomic file writes: write to a temporary sibling, fsync, rename over the target."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""Progress bars on stderr (rich), or nothing when quiet / not wanted."""

from __future__ import annotations

import sys
from contextlib import contextmanager


class _Null:
    def advance(self, n: float = 1) -> None:
        pass

    def describe(self, text: str) -> None:
        pass


class _Bar:
    def __init__(self, progress, task):
        self._p, self._t = progress, task

    def advance(self, n: float = 1) -> None:
        self._p.advance(self._t, n)

    def describe(self, text: str) -> None:
        self._p.update(self._t, description=text)


@contextmanager
def progress_bar(description: str, total: float, *, unit_bytes: bool = True, enabled: bool = True):
    """A bar over `total` (bytes when unit_bytes: shows GB done, GB/s and time left)."""
    if not enabled:
        yield _Null()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    cols = [TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn(binary_units=False), TransferSpeedColumn()] if unit_bytes else [MofNCompleteColumn()]
    cols += [TimeRemainingColumn()]
    console = Console(file=sys.stderr)
    with Progress(*cols, console=console, transient=False, disable=not console.is_terminal) as p:
        yield _Bar(p, p.add_task(description, total=total))

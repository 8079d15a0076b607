"""Progress bars for long work (rich), or a caller's own callback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

ProgressCallback = Callable[[int], None]


@contextlib.contextmanager
def byte_progress(
    progress: bool | ProgressCallback, total: int, description: str
) -> Iterator[ProgressCallback]:
    """Yield ``advance(nbytes)``: a rich progress bar if ``progress`` is True, else a no-op.

    A callable ``progress`` is called with each increment instead.
    """
    if callable(progress):
        yield progress
        return
    if not progress:
        yield lambda _n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)

"""Progress bars for long work (rich), or a caller's own callback.

Bars are drawn on stderr, so that what a command prints on stdout (``ucp inspect --json``,
``ucp validate --json``) stays machine-readable while a bar runs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

ProgressCallback = Callable[[int], None]


@contextlib.contextmanager
def byte_progress(
    progress: bool | ProgressCallback, total: int, description: str
) -> Iterator[ProgressCallback]:
    """Yield ``advance(nbytes)``: a rich progress bar if ``progress`` is True and stderr is
    a terminal (or a Jupyter notebook), else a no-op.

    A callable ``progress`` is called with each increment instead.
    """
    if callable(progress):
        yield progress
        return
    if not progress:
        yield lambda _n: None
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not (sys.stderr.isatty() or console.is_jupyter):
        # off a terminal a bar is only escape sequences in a log (even with FORCE_COLOR)
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
        console=console,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)

"""Fixed defects of issue 13 put back, for the harnesses' own tests: each function undoes
one fix in the process that calls it (a worker of ``ucpformat.testing.gloo_writers``,
started with ``setup="tests.reliability.regressions:<name>"``), so that a test can show
that the harness notices the defect, in distributed saves too.

Never imported by the library; each function changes classes and modules of this process
for the rest of its life.
"""

from __future__ import annotations

import os
from typing import Any

from ucpformat.checkpoint import commit as writer
from ucpformat.store import LocalStore, StoreClaim, posix


def no_claim() -> None:
    """Defect 3: two saves into one location are not serialised. The in-progress marker
    is no claim (written over, never locked), every writer believes it holds the
    location, and a stored object already there is replaced instead of refused."""

    def claim(self: LocalStore, key: str, body: bytes, *, take_over: bool,
              keep: bool = False) -> StoreClaim:
        self.put(key, [body])
        return StoreClaim(key)

    def create(self: LocalStore, key: str, buffers: Any, *, atomic: bool = False) -> int:
        return self.put(key, buffers, atomic=atomic)

    LocalStore.claim = claim  # type: ignore[method-assign]
    LocalStore.create = create  # type: ignore[method-assign]
    writer._owns = lambda store, claim: True  # type: ignore[attr-defined]


def follow_links() -> None:
    """Defect 1: the writer follows a symbolic link to a directory inside the
    destination. A listing does not show links (a destination holding only
    ``model -> ../outside`` looks empty), and directories are opened through them."""
    listing = LocalStore.list

    def list_no_links(self: LocalStore, prefix: str = "") -> Any:
        for key in listing(self, prefix):
            if not os.path.islink(os.path.join(self.location, key)):
                yield key

    LocalStore.list = list_no_links  # type: ignore[method-assign]
    posix.DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # type: ignore[attr-defined]
    posix.OPENAT2 = None  # type: ignore[attr-defined]


def marker_in_place() -> None:
    """Defect 10: the in-progress marker is written in place, so that a marker that is
    a hard (or symbolic) link writes over the file it links to."""
    claim = LocalStore.claim

    def in_place(self: LocalStore, key: str, body: bytes, *, take_over: bool,
                 keep: bool = False) -> StoreClaim:
        path = os.path.join(self.location, key)
        if os.path.lexists(path):
            with open(path, "r+b") as f:
                f.write(body)
                f.truncate()
        return claim(self, key, body, take_over=take_over, keep=keep)

    LocalStore.claim = in_place  # type: ignore[method-assign]


def rank_1_stops_writing() -> None:
    """Not a defect of the library (a rank that stops is torch.distributed's timeout to
    detect): rank 1 of a distributed save stops before it writes, from its third save
    on (the first two are the concurrency harness's timing saves), so that a test can
    show that the harness bounds the time a group may take and counts a hang."""
    import itertools
    import time

    import torch.distributed as dist

    from ucpformat.distributed import pipeline

    write = pipeline.write
    saves = itertools.count(1)

    def stopped(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1 and next(saves) > 2:
            time.sleep(3600)
        return write(*args, **kwargs)

    pipeline.write = stopped  # type: ignore[assignment]

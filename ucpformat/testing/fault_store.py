"""A store that counts a save's storage operations and fails or crashes at a chosen one.

The crash-consistency harness (:mod:`ucpformat.testing.faults`) saves through a
:class:`FaultyStore` that kills the writer (or fills the disk, :class:`DiskFull`) at the
n-th operation, and names the save's phase at each operation (:func:`phase_of`).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ucpformat.checkpoint.metadata import IN_PROGRESS_KEY, MANIFEST_KEY, ZARR_JSON
from ucpformat.store import ForwardingStore, Store, StoreClaim

MODES = ("before", "torn", "after")
PHASES = ("prepare", "data", "metadata", "manifest", "flush", "commit", "cleanup")
SCENARIOS = ("new", "overwrite", "threads")
_DATA_KEY = re.compile(r"(^|/)c(/[0-9]+)*$")




class OpCounter:
    """Counts operations across threads, and across stores that share it."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            n = self._n
            self._n += 1
            return n


class DiskFull:
    """A disk that fills up: from its ``after``-th write on (counted across the stores that
    share it), every write fails with ENOSPC, until :meth:`free` is called; deletions
    always work. ``after=None``: never full until :meth:`fill`."""

    def __init__(self, after: int | None = None) -> None:
        self.after = after
        self.writes = 0
        self.full = False
        self._lock = threading.Lock()

    def charge(self, key: str) -> None:
        with self._lock:
            self.writes += 1
            if self.after is not None and self.writes >= self.after:
                self.full = True
            full = self.full
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), key)

    def fill(self) -> None:
        self.full = True

    def free(self) -> None:
        with self._lock:
            self.full = False
            self.after = None


class FaultyStore(ForwardingStore):
    """A store that kills its process at the ``kill_at``-th mutating operation.

    Mutating operations are ``put``, ``delete``, ``delete_all`` and ``flush``, counted
    from 0 across threads. ``mode`` is ``before`` (the operation never happens),
    ``torn`` (a ``put`` writes the first half of its bytes, to the key itself or, for an
    atomic put, to a temporary name beside it, as a crash during the write would; other
    operations behave as ``before``) or ``after`` (the operation completes). ``delay``
    seconds are slept before each operation (for kills at random times). ``trace``
    collects ``(operation, key)`` of every operation; stores given the same ``counter``
    count together (a manager opens one store per location). ``disk``: writes fail with
    ENOSPC while it is full (the process lives on).
    """

    def __init__(
        self,
        inner: Store,
        *,
        kill_at: int | None = None,
        mode: str = "before",
        delay: float = 0.0,
        trace: list[tuple[str, str]] | None = None,
        counter: OpCounter | None = None,
        disk: DiskFull | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        super().__init__(inner)
        self.kill_at = kill_at
        self.mode = mode
        self.delay = delay
        self.trace = trace if trace is not None else []
        self.counter = counter if counter is not None else OpCounter()
        self.disk = disk

    def _tick(self, op: str, key: str) -> bool:
        """Count an operation; True if the process must die at this one (a write on a
        full disk raises ENOSPC instead)."""
        if self.delay:
            time.sleep(self.delay)
        n = self.counter.next()
        self.trace.append((op, key))
        if self.disk is not None and op == "put":
            self.disk.charge(key)
        return n == self.kill_at

    @staticmethod
    def die() -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # pragma: no cover - the signal is not deliverable

    # reads pass through (ForwardingStore); writes count
    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        if self._tick("put", key):
            self._die_writing(key, buffers, atomic=atomic,
                              complete=lambda: self.inner.put(key, buffers, atomic=atomic))
        return self.inner.put(key, buffers, atomic=atomic)

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        return self.inner.atomic_create

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        if self._tick("put", key):
            self._die_writing(key, buffers, atomic=atomic,
                              complete=lambda: self.inner.create(key, buffers, atomic=atomic))
        return self.inner.create(key, buffers, atomic=atomic)

    def claim(self, key: str, body: bytes, *, take_over: bool, keep: bool = False
              ) -> StoreClaim:
        # kept as it is, a marker already there costs no write (and no space)
        kept = keep and take_over and self.inner.exists(key)
        if self._tick("claim" if kept else "put", key):
            # a torn claim: a partial new marker, or a partial temporary file beside the
            # marker it was replacing
            self._die_writing(key, [body], atomic=self.inner.exists(key),
                              complete=lambda: self.inner.claim(key, body, take_over=take_over,
                                                                keep=keep))
        return self.inner.claim(key, body, take_over=take_over, keep=keep)

    def _die_writing(self, key: str, buffers: Sequence[Any], *, atomic: bool,
                     complete: Callable[[], object]) -> None:
        if self.mode == "torn":
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            target = f"{key}.tmp-{uuid.uuid4().hex}" if atomic else key
            self.inner.put(target, [data[: len(data) // 2]])
        elif self.mode == "after":
            complete()
        self.die()

    def delete(self, key: str) -> None:
        if self._tick("delete", key):
            if self.mode == "after":
                self.inner.delete(key)
            self.die()
        self.inner.delete(key)

    def delete_all(self) -> None:
        if self._tick("delete_all", ""):
            if self.mode == "after":
                self.inner.delete_all()
            self.die()
        self.inner.delete_all()

    def flush(self) -> None:
        if self._tick("flush", ""):
            if self.mode == "after":
                self.inner.flush()
            self.die()
        self.inner.flush()


def phase_of(ops: Sequence[tuple[str, str]], index: int) -> str:
    """The phase of a save that operation ``index`` of a dry run's trace belongs to."""
    op, key = ops[index]
    if op == "put" and _DATA_KEY.search(key):
        return "data"
    if op == "put" and key == ZARR_JSON:
        return "commit"
    if op == "put" and key == MANIFEST_KEY:
        return "manifest"
    if op == "put" and key.endswith("/" + ZARR_JSON):
        return "metadata"
    if op == "delete" and key == IN_PROGRESS_KEY:
        return "cleanup"
    before_data = not any(
        o == "put" and (_DATA_KEY.search(k) or k.endswith(ZARR_JSON)) for o, k in ops[:index]
    )
    if before_data:
        return "prepare"
    return "flush" if op == "flush" else "data"



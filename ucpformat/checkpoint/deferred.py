"""Values that arrive while a save writes: the contract between a writer and a staging area.

A save normally holds every array's values before it writes. Values that live elsewhere
(on an accelerator) are better copied to host memory one after another, while earlier
ones are encoded and written, through a bounded set of host buffers: a *feed*. The
writer learns each such array's shape and data type up front (a :class:`Deferred`
placeholder, enough to plan and describe it), tells the feed in which order it will ask
for the values (:meth:`Feed.schedule`, so the feed can copy ahead), takes each value
when it needs it (:meth:`Feed.get`, which waits for the copy) and hands it back once
written (:meth:`Feed.release`, so the buffer serves the next one). :meth:`Feed.stop`
ends it all, after success or failure.

The format core knows only this protocol; :mod:`ucpformat.torch.staging` implements it
for torch tensors (pinned host buffers, copies on a side CUDA stream).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Deferred:
    """An array known by its shape and data type; a :class:`Feed` gives its values
    under ``key`` (unique within one save)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    key: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@runtime_checkable
class Prefetching(Protocol):
    """A source of values that copies ahead of its consumer, into bounded buffers."""

    def schedule(self, keys: Sequence[str]) -> None:
        """The keys whose values will be asked for, in this order (copying may start)."""
        ...

    def release(self, key: str) -> None:
        """The consumer is done with the value of ``key``: its buffer may be reused."""
        ...

    def stop(self) -> None:
        """No more values are needed (after success or failure): copies end, buffers
        are returned, and a consumer still waiting raises."""
        ...


class Feed(Prefetching, Protocol):
    """Values of :class:`Deferred` arrays by their key."""

    def get(self, key: str) -> np.ndarray[Any, Any]:
        """The value of ``key`` (waits for its copy; raises the copy's error)."""
        ...


def schedule(source: object, keys: Sequence[str]) -> None:
    """:meth:`Prefetching.schedule` if ``source`` prefetches, else nothing."""
    if isinstance(source, Prefetching):
        source.schedule(keys)


def release(source: object, key: str) -> None:
    """:meth:`Prefetching.release` if ``source`` prefetches, else nothing."""
    if isinstance(source, Prefetching):
        source.release(key)


def stop(source: object) -> None:
    """:meth:`Prefetching.stop` if ``source`` prefetches, else nothing."""
    if isinstance(source, Prefetching):
        source.stop()


__all__ = ["Deferred", "Feed", "Prefetching", "release", "schedule", "stop"]

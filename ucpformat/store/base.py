"""The Store interface: the key rules, the claim on a location, the calls backends answer.

Keys are ``/``-separated paths relative to the checkpoint root (``model/fc.weight/c/0/0``).
Every key is checked before use (:func:`check_key`, UCP-1.0-R091); how a backend keeps
links out of reach is its own (:mod:`ucpformat.store.local`, UCP-1.0-R089).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from ucpformat.errors import (
    UnsafePathError,
)

_KEY_PART = re.compile(r"[A-Za-z0-9._%-]+\Z")  # \Z: "$" would accept a final newline
# a whole key that check_key accepts, in one match: components of 1 to 255 safe
# characters, none of them "." or ".." (the per-component checks below say why not)
_PART = r"(?!\.\.?(?:/|\Z))[A-Za-z0-9._%-]{1,255}"
_SAFE_KEY = re.compile(rf"{_PART}(?:/{_PART})*")


def is_safe_key_part(part: str) -> bool:
    """One component of a key that :func:`check_key` accepts."""
    return part not in (".", "..") and len(part) <= 255 and _KEY_PART.match(part) is not None


def check_key(key: str) -> None:
    """Refuse keys that are empty, absolute, or contain ``.``/``..``/odd characters."""
    if isinstance(key, str) and _SAFE_KEY.fullmatch(key) is not None:
        return
    if not isinstance(key, str) or not key:
        raise UnsafePathError(f"storage key {key!r} is empty or not a string", rule="UCP-1.0-R091")
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART.match(part):
            raise UnsafePathError(
                f"storage key {key!r} has an unsafe component {part!r}", rule="UCP-1.0-R091"
            )
        if len(part) > 255:  # no file system takes it (and no node name may be longer)
            raise UnsafePathError(
                f"storage key {key[:80]!r}... has a component of {len(part)} bytes; the limit "
                "is 255",
                rule="UCP-1.0-R012",
            )


def is_safe_key(key: str) -> bool:
    """True if :func:`check_key` accepts ``key``."""
    if isinstance(key, str) and _SAFE_KEY.fullmatch(key) is not None:
        return True
    try:
        check_key(key)
    except UnsafePathError:
        return False
    return True


_Item = TypeVar("_Item")


class StoreClaim:
    """A writer's hold on a location, from :meth:`Store.claim` until :meth:`release`.

    ``locked``: the store holds a lock that excludes every other claim of the location
    until this one is released or its process ends (a local file system); otherwise only
    the marker's content tells who holds the location (object stores). ``took_over``: the
    marker of an earlier writer was there and was replaced (its writer had stopped, or,
    without a lock, was taken to have stopped).
    """

    def __init__(self, key: str, *, lock_fd: int | None = None, took_over: bool = False) -> None:
        self.key = key
        self.locked = lock_fd is not None
        self.took_over = took_over
        self._close: Callable[[], None] | None = (
            weakref.finalize(self, close_quietly, lock_fd) if lock_fd is not None else None
        )

    def release(self) -> None:
        """Give the location up (idempotent); the marker itself is left as it is."""
        if self._close is not None:
            self._close()
            self._close = None


def close_quietly(fd: int) -> None:
    """Close a descriptor, ignoring the operating system's errors (clean-up paths)."""
    with contextlib.suppress(OSError):
        os.close(fd)


class Store(ABC):
    """What a checkpoint reader and writer need from storage."""

    #: Human-readable location, used in messages.
    location: str

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The whole object, or None if it does not exist."""

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        """``length`` bytes from ``offset``; fewer if the object is shorter; None if absent."""

    @abstractmethod
    def get_suffix(self, key: str, length: int) -> bytes | None:
        """The last ``length`` bytes (all of them if shorter), or None if absent."""

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        """Fill ``buffers`` in order from ``offset``.

        Returns the bytes read (fewer at the end of the object), or None if it is absent.
        """
        total = sum(memoryview(b).nbytes for b in buffers)
        data = self.get_range(key, offset, total)
        if data is None:
            return None
        pos = 0
        for b in buffers:
            view = memoryview(b).cast("B")
            n = min(len(view), len(data) - pos)
            view[:n] = data[pos : pos + n]
            pos += n
        return len(data)

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size in bytes, or None if absent."""

    def get_suffix_and_size(self, key: str, length: int) -> tuple[bytes, int | None] | None:
        """:meth:`get_suffix` and :meth:`size` of one object, or None if it is absent (a
        shard's index and the size its entries are checked against). A store that opens
        an object once for both overrides it; the default asks for each (the size None if
        the object went away in between)."""
        data = self.get_suffix(key, length)
        if data is None:
            return None
        return data, self.size(key)

    #: Whether :meth:`map_copy_on_write` hands out views of one mapping made once (no
    #: system call, no new mapping per object), so that mapping a small object costs
    #: less than reading it; a store that maps each object on its own says False.
    maps_from_one_mapping: bool = False

    def map_copy_on_write(self, key: str, size: int, *, view_only: bool = False
                          ) -> Any | None:
        """The object mapped into memory copy-on-write, if it holds exactly ``size``
        bytes: a writable buffer whose writes never reach the object, valid for as long
        as anything refers to it. None where the store does not map (this default: every
        store but a local file system's), or the object is absent or of another size:
        the caller then reads it. ``view_only``: None too where the object would need a
        mapping of its own rather than a view of one already made (a small object, which
        a read costs less than a mapping)."""
        return None

    @abstractmethod
    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        """Write an object from buffers, in order; returns the byte count.

        ``atomic``: a concurrent reader sees the old object or the new one, never a part.
        """

    #: True when :meth:`create` is atomic: of two writers creating the same key at the
    #: same time, exactly one succeeds (the default implementation checks, then writes).
    atomic_create: bool = False

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        """Write a new object, as :meth:`put`; FileExistsError if ``key`` already exists."""
        if self.exists(key):
            raise FileExistsError(errno.EEXIST, "the object already exists", key)
        return self.put(key, buffers, atomic=atomic)

    def claim(self, key: str, body: bytes, *, take_over: bool, keep: bool = False
              ) -> StoreClaim:
        """Write the marker ``key`` (content ``body``) as a writer's claim on the location.

        Created with :meth:`create`, so that of two writers only one gets it (where
        :attr:`atomic_create` holds). A marker already there may belong to a writer that is
        still running: it is taken over only if ``take_over`` (FileExistsError otherwise):
        replaced by ``body``, or, if ``keep``, kept as it is (nothing is written: a
        deletion can claim the remains of a save on a full disk). Stores that can lock
        (:class:`LocalStore`) refuse a live writer with BlockingIOError, and take over the
        marker of a stopped one whatever ``take_over`` says.
        """
        try:
            self.create(key, [body], atomic=True)
        except FileExistsError:
            if not take_over:
                raise
            if not keep:
                self.put(key, [body], atomic=True)
            return StoreClaim(key, took_over=True)
        return StoreClaim(key)

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete an object if it exists (durably, before returning)."""

    def delete_keys(self, keys: Iterable[str]) -> None:
        """Delete objects that may exist; durable once :meth:`flush` returns."""
        for key in keys:
            self.delete(key)

    @abstractmethod
    def delete_all(self) -> None:
        """Delete every object of this store (the whole checkpoint)."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key under ``prefix`` (recursively), in no particular order.

        Everything there is listed, also what no checkpoint holds: names that
        :func:`check_key` refuses and, on file systems, links and other entries that are
        not regular files (never followed), so that a writer sees all it would replace.
        """

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int | None]]:
        """The keys :meth:`list` gives, in its order, each with the size :meth:`size`
        would return where the listing tells it without another request; None where it
        does not (ask :meth:`size`, which also makes that key's checks). This default
        tells none."""
        for key in self.list(prefix):
            yield key, None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def flush(self) -> None:  # noqa: B027 - a no-op is the right default
        """Make everything written so far durable."""

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Hold the location for a batch of calls (a save's writes, from every thread):
        while it lasts, the store may keep what it opened for one call for the next (a
        :class:`LocalStore` keeps its descriptor of the location). Batches nest. The
        default keeps nothing."""
        return contextlib.nullcontext()

    def is_empty(self) -> bool:
        return next(iter(self.list()), None) is None

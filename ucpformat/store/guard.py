"""Reads of another store whose operating-system failures are raised as errors naming the file."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from ucpformat.errors import (
    CheckpointNotFoundError,
    StorageError,
    UCPError,
)
from ucpformat.store.base import Store, StoreClaim

_Item = TypeVar("_Item")


class ReadGuard(Store):
    """The reads of another store, with every failure of the operating system (permission
    denied, a file where a directory should be, a name too long, an I/O error) raised as a
    :class:`~ucpformat.errors.StorageError` that names the file (UCP-1.0-R099).

    ``open`` and ``validate`` read through it, so that no public read call lets a raw
    ``OSError`` escape; writes pass through unchanged (the writer reports its own).
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.location = inner.location

    def _error(self, key: str, exc: OSError) -> UCPError:
        if isinstance(exc, NotADirectoryError) and key.count("/") == 0:
            return CheckpointNotFoundError(
                "not a directory: a checkpoint is a directory, or one file (.ucpz)",
                rule="UCP-1.0-R051",
                path=self.location,
            )
        reason = exc.strerror or str(exc) or type(exc).__name__
        where = self.location if key in ("", ".") else f"{self.location}/{key}"
        return StorageError(f"cannot read it: {reason}", rule="UCP-1.0-R099", path=where)

    def _call(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except UCPError:
            raise
        except OSError as exc:
            raise self._error(key, exc) from exc

    def get(self, key: str) -> bytes | None:
        result: bytes | None = self._call(key, lambda: self.inner.get(key))
        return result

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        result: bytes | None = self._call(key, lambda: self.inner.get_range(key, offset, length))
        return result

    def get_suffix(self, key: str, length: int) -> bytes | None:
        result: bytes | None = self._call(key, lambda: self.inner.get_suffix(key, length))
        return result

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        result: int | None = self._call(key, lambda: self.inner.read_into(key, offset, buffers))
        return result

    def map_copy_on_write(self, key: str, size: int, *, view_only: bool = False
                          ) -> Any | None:
        return self._call(key, lambda: self.inner.map_copy_on_write(
            key, size, view_only=view_only))

    @property
    def maps_from_one_mapping(self) -> bool:  # type: ignore[override]
        return self.inner.maps_from_one_mapping

    def size(self, key: str) -> int | None:
        result: int | None = self._call(key, lambda: self.inner.size(key))
        return result

    def get_suffix_and_size(self, key: str, length: int) -> tuple[bytes, int | None] | None:
        result: tuple[bytes, int | None] | None = self._call(
            key, lambda: self.inner.get_suffix_and_size(key, length))
        return result

    def exists(self, key: str) -> bool:
        return bool(self._call(key, lambda: self.inner.exists(key)))

    def list(self, prefix: str = "") -> Iterator[str]:
        return self._guarded(prefix, lambda: self.inner.list(prefix))

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int | None]]:
        return self._guarded(prefix, lambda: self.inner.list_sizes(prefix))

    def _guarded(self, prefix: str, listing: Callable[[], Iterable[_Item]]) -> Iterator[_Item]:
        """The items of ``listing()``, an OSError while listing turned into a StorageError."""
        items = iter(self._call(prefix or ".", listing))
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except UCPError:
                raise
            except OSError as exc:
                raise self._error(prefix or ".", exc) from exc
            yield item

    def is_empty(self) -> bool:
        return bool(self._call(".", self.inner.is_empty))

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        return self.inner.put(key, buffers, atomic=atomic)

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        return self.inner.atomic_create

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        return self.inner.create(key, buffers, atomic=atomic)

    def claim(self, key: str, body: bytes, *, take_over: bool, keep: bool = False
              ) -> StoreClaim:
        return self.inner.claim(key, body, take_over=take_over, keep=keep)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_keys(self, keys: Iterable[str]) -> None:
        self.inner.delete_keys(keys)

    def delete_all(self) -> None:
        self.inner.delete_all()

    def flush(self) -> None:
        self.inner.flush()

    def batch(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.batch()


def unguarded(store: Store) -> Store:
    """The store a :class:`ReadGuard` reads through (any other store as it is)."""
    return store.inner if isinstance(store, ReadGuard) else store


def read_guarded(location: str | os.PathLike[str] | Store) -> Store:
    """The store of a location for reading (``durable=False``), behind a :class:`ReadGuard`."""
    if not isinstance(location, Store) and "\x00" in os.fspath(location):
        raise StorageError("a location cannot contain a NUL character", rule="UCP-1.0-R099",
                           path=repr(os.fspath(location)))
    from ucpformat.store import open_store  # the package's opener (it imports this module)

    store = open_store(location, durable=False)
    return store if isinstance(store, ReadGuard) else ReadGuard(store)

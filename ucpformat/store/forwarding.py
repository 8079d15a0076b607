"""A store over another one: the base of wrappers that change what writes do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from ucpformat.store.base import Store


class ForwardingStore(Store):
    """A store over another one (``inner``), for wrappers: every read and the listing go
    to ``inner`` unchanged; a subclass says what its writes do (``put``, ``delete``,
    ``delete_all``)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.location = inner.location

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        return self.inner.get_range(key, offset, length)

    def get_suffix(self, key: str, length: int) -> bytes | None:
        return self.inner.get_suffix(key, length)

    def read_into(self, key: str, offset: int, buffers: Sequence[Any]) -> int | None:
        return self.inner.read_into(key, offset, buffers)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def batch(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.batch()

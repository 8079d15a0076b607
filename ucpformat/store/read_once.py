"""A read-only store serving held stored objects from memory: deep validation reads each
object once, and a reader plans a small shard it read whole from its bytes."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ucpformat.errors import WriteError
from ucpformat.store.base import Store


class ReadOnceStore(Store):
    """The checkpoint's store, read-only, that serves held stored objects from memory.

    A deep validation reads each stored object once: :meth:`hold` reads it whole (and
    checks its SHA-256 against the manifest), and the chunk checks that follow read their
    ranges from that copy until :meth:`release`. A reader that read a small shard whole
    holds the bytes it has (``hold(key, data)``) and plans its chunks from them.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.location = store.location
        self._held: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def hold(self, key: str, data: bytes | None = None) -> bytes | None:
        """Hold ``data``, the object's bytes already read, or read it whole (None if it
        is absent)."""
        if data is None:
            data = self.store.get(key)
        if data is not None:
            with self._lock:
                self._held[key] = data
        return data

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def _copy(self, key: str) -> bytes | None:
        with self._lock:
            return self._held.get(key)

    def get(self, key: str) -> bytes | None:
        held = self._copy(key)
        return held if held is not None else self.store.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        held = self._copy(key)
        if held is None:
            return self.store.get_range(key, offset, length)
        return held[offset : offset + max(0, length)]

    def get_suffix(self, key: str, length: int) -> bytes | None:
        held = self._copy(key)
        if held is None:
            return self.store.get_suffix(key, length)
        return held[max(0, len(held) - length) :]

    def size(self, key: str) -> int | None:
        held = self._copy(key)
        return len(held) if held is not None else self.store.size(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.store.list(prefix)

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        raise WriteError("a store that serves held objects is read only", path=self.location)

    def delete(self, key: str) -> None:
        raise WriteError("a store that serves held objects is read only", path=self.location)

    def delete_all(self) -> None:
        raise WriteError("a store that serves held objects is read only", path=self.location)

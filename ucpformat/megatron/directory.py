"""The checkpoint directory as the save strategy sees it: Megatron's own files left alone.

``megatron.core.dist_checkpointing.save`` writes ``common.pt`` (the state that is not
sharded, with ``torch.save``) before the sharded strategy runs and ``metadata.json``
(which strategy wrote the checkpoint) after it, both in the checkpoint directory. The
UCP checkpoint shares that directory: :class:`BesideFiles` hides those files from the
writer, so that it neither refuses the directory as foreign nor clears them when it
prepares the location or replaces a checkpoint, and refuses to write over them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, Final

from ucpformat.errors import WriteError
from ucpformat.store import ForwardingStore, Store

#: The files megatron.core.dist_checkpointing writes beside any strategy's.
MEGATRON_FILES: Final = ("common.pt", "metadata.json")


class BesideFiles(ForwardingStore):
    """``inner`` without the top-level files ``keep``: they are not listed, and cannot be
    written or deleted through this store."""

    def __init__(self, inner: Store, keep: Collection[str] = MEGATRON_FILES) -> None:
        super().__init__(inner)
        self.keep = frozenset(keep)

    def _writable(self, key: str) -> None:
        if key in self.keep:
            raise WriteError(f"{key} belongs to Megatron, not to the UCP checkpoint",
                             path=self.location)

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        self._writable(key)
        return self.inner.put(key, buffers, atomic=atomic)

    def delete(self, key: str) -> None:
        self._writable(key)
        self.inner.delete(key)

    def delete_keys(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self._writable(key)
        self.inner.delete_keys(keys)

    def delete_all(self) -> None:
        self.inner.delete_keys(list(self.list()))
        self.inner.flush()

    def list(self, prefix: str = "") -> Iterator[str]:
        return (k for k in self.inner.list(prefix) if k not in self.keep)

    def flush(self) -> None:
        self.inner.flush()


__all__ = ["MEGATRON_FILES", "BesideFiles"]

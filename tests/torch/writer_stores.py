"""Stores that travel to a writer process (pickled) and misbehave there: the tests of
``AsyncSaver(writer="process")`` (the child imports this module to unpickle them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ucpformat.store.local import LocalStore


def _data(key: str) -> bool:
    """A stored object's data (not metadata, markers or the root)."""
    return not key.endswith(".json")


class DiskFullStore(LocalStore):
    """Every write of tensor data raises OSError (ENOSPC), as a full disk would."""

    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        if _data(key):
            raise OSError(28, "No space left on device", key)
        return super().create(key, buffers, atomic=atomic)


class StallingStore(LocalStore):
    """The first write of tensor data creates ``started`` and then waits for ``go`` (a
    test kills the writer process meanwhile)."""

    def __init__(self, root: Path, started: Path, go: Path) -> None:
        super().__init__(root, durable=False)
        self.started, self.go = str(started), str(go)

    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        if _data(key):
            Path(self.started).touch()
            while not Path(self.go).exists():
                time.sleep(0.05)
        return super().create(key, buffers, atomic=atomic)

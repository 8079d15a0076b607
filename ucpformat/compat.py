"""Modules that moved in 0.2 (issue 24's package layout): their old import paths still work
for one release, with a :class:`DeprecationWarning` naming the new path.

An import of an old path finds the new module and binds it under the old name too, so
``import ucpformat.writer`` and ``from ucpformat.storage import LocalStore`` keep working
and give the same objects as the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Each package's moved modules: old name -> new dotted path (".name": in the same package).
MOVED_IN: dict[str, dict[str, str]] = {
    "ucpformat": {
        "dtypes": "ucpformat.format.dtypes",
        "names": "ucpformat.format.names",
        "jsonvalues": "ucpformat.format.jsonvalues",
        "schemas": "ucpformat.format.schemas",
        "zarr_dtypes": "ucpformat.format.zarr_dtypes",
        "storage": "ucpformat.store",
        "storage_fsspec": "ucpformat.store.fsspec_store",
        "metadata": "ucpformat.checkpoint.metadata",
        "reader": "ucpformat.checkpoint.reader",
        "feed": "ucpformat.checkpoint.deferred",
        "validation": "ucpformat.checkpoint.validation",
        "rng": "ucpformat.checkpoint.rng",
        "manager": "ucpformat.checkpoint.manager",
        "writer": "ucpformat.checkpoint.writer",
        "comm": "ucpformat.distributed.comm",
        "description": "ucpformat.distributed.rank_description",
        "saveplan": "ucpformat.distributed.save_plan",
        "pipeline": "ucpformat.distributed.pipeline",
        "conversion": "ucpformat.interchange",
    },
    "ucpformat.layout": {"framework": "ucpformat.distributed.framework",
                         "sharding": ".rank_slices"},
    "ucpformat.engine": {"sharding": ".shard_index"},
    "ucpformat.torch": {"planner": ".load_plan", "convert": ".numpy_bridge"},
    "ucpformat.deepspeed": {"holdings": ".rank_fragments"},
    "ucpformat.megatron": {"store": ".directory"},
    "ucpformat.testing": {"links": ".link_attacks", "conformance": ".conformance_kit"},
}
#: old dotted path -> new dotted path
MOVED: dict[str, str] = {
    f"{package}.{old}": package + new if new.startswith(".") else new
    for package, moved in MOVED_IN.items() for old, new in moved.items()
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        warnings.warn(f"{old} moved to {self.new}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=2)
        # the import system returns what sys.modules holds under the name after this
        sys.modules[old] = importlib.import_module(self.new)


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` (installed on ``sys.meta_path`` by
    ``ucpformat``'s ``__init__``)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())


install()

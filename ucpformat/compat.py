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
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

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


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes away in the next release",
                  DeprecationWarning, stacklevel=stacklevel)


def moved_attribute(package: str, name: str) -> ModuleType:
    """``package.name`` where ``name`` is a module that moved (``ucpformat.storage`` after a
    plain ``import ucpformat``), with the warning; AttributeError for any other name.
    A package whose modules moved calls this from its ``__getattr__``."""
    new = MOVED.get(f"{package}.{name}")
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", new)
    return importlib.import_module(new)


class _Alias(importlib.abc.InspectLoader):
    def __init__(self, new: str) -> None:
        self.new = new

    def get_source(self, fullname: str) -> str | None:
        return None

    def get_code(self, fullname: str) -> Any:
        """``python -m <old path>`` runs the new module as ``__main__``."""
        _warn(fullname, self.new)
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, importlib.abc.InspectLoader):
            raise ImportError(f"{fullname} moved to {self.new}: run python -m {self.new}")
        return loader.get_code(self.new)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        _warn(old, self.new)
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

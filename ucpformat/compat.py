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

#: old dotted path -> new dotted path
MOVED: dict[str, str] = {
    "ucpformat.dtypes": "ucpformat.format.dtypes",
    "ucpformat.names": "ucpformat.format.names",
    "ucpformat.jsonvalues": "ucpformat.format.jsonvalues",
    "ucpformat.schemas": "ucpformat.format.schemas",
    "ucpformat.zarr_dtypes": "ucpformat.format.zarr_dtypes",
    "ucpformat.storage": "ucpformat.store",
    "ucpformat.storage_fsspec": "ucpformat.store.fsspec_store",
    "ucpformat.metadata": "ucpformat.checkpoint.metadata",
    "ucpformat.reader": "ucpformat.checkpoint.reader",
    "ucpformat.feed": "ucpformat.checkpoint.deferred",
    "ucpformat.validation": "ucpformat.checkpoint.validation",
    "ucpformat.rng": "ucpformat.checkpoint.rng",
    "ucpformat.manager": "ucpformat.checkpoint.manager",
    "ucpformat.writer": "ucpformat.checkpoint.writer",
    "ucpformat.comm": "ucpformat.distributed.comm",
    "ucpformat.description": "ucpformat.distributed.rank_description",
    "ucpformat.saveplan": "ucpformat.distributed.save_plan",
    "ucpformat.pipeline": "ucpformat.distributed.pipeline",
    "ucpformat.layout.framework": "ucpformat.distributed.framework",
    "ucpformat.layout.sharding": "ucpformat.layout.rank_slices",
    "ucpformat.engine.sharding": "ucpformat.engine.shard_index",
    "ucpformat.conversion": "ucpformat.interchange",
    "ucpformat.torch.planner": "ucpformat.torch.load_plan",
    "ucpformat.torch.convert": "ucpformat.torch.numpy_bridge",
    "ucpformat.deepspeed.holdings": "ucpformat.deepspeed.rank_fragments",
    "ucpformat.megatron.store": "ucpformat.megatron.directory",
    "ucpformat.testing.links": "ucpformat.testing.link_attacks",
    "ucpformat.testing.conformance": "ucpformat.testing.conformance_kit",
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

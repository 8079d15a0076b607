"""The distributed layer: one checkpoint written by many ranks, each its own part.

- :mod:`~ucpformat.distributed.comm`: what a save needs from a process group;
- :mod:`~ucpformat.distributed.rank_description`: what a rank tells the coordinator;
- :mod:`~ucpformat.distributed.save_plan`: the plan (coverage, grid, one owner per shard);
- :mod:`~ucpformat.distributed.pipeline`: the one distributed save, its public interface
  (:class:`~ucpformat.distributed.pipeline.DistributedSave`) and how it fails;
- :mod:`~ucpformat.distributed.fragments`: numpy fragments saved (:func:`save_fragments`)
  and read back by box (:func:`read_local`, :func:`read_locals`, :func:`read_flat`);
- :mod:`~ucpformat.distributed.framework`: a framework's per-rank state through a rule file.
"""

from __future__ import annotations

import warnings
from typing import Any

from ucpformat.distributed.exchange import FragmentList, FragmentSource
from ucpformat.distributed.fragments import (
    DEFAULT_MIN_SHARD_BYTES,
    DistributedSaveResult,
    Fragment,
    MeshPosition,
    MeshTensor,
    TensorSpec,
    check_coverage,
    choose_grid,
    make_plan,
    merge_group_attributes,
    read_flat,
    read_local,
    read_locals,
    save_fragments,
)


def __getattr__(name: str) -> Any:
    if name == "save_distributed":  # the core's old name, beside torch's save_distributed
        warnings.warn(
            "ucpformat.distributed.save_distributed is now ucpformat.distributed.save_fragments "
            "(the old name goes away in the next release)", DeprecationWarning, stacklevel=2)
        return save_fragments
    if name == "PlanOptions":  # the plan's options before 0.2: the save's options now
        from ucpformat.checkpoint.options import SaveOptions

        return SaveOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MIN_SHARD_BYTES",
    "DistributedSaveResult",
    "Fragment",
    "FragmentList",
    "FragmentSource",
    "MeshPosition",
    "MeshTensor",
    "TensorSpec",
    "check_coverage",
    "choose_grid",
    "make_plan",
    "merge_group_attributes",
    "read_flat",
    "read_local",
    "read_locals",
    "save_fragments",
]

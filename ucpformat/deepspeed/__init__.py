"""DeepSpeed engines saved straight into UCP, and resumed from any UCP checkpoint.

::

    import ucpformat.deepspeed as ucp_ds

    ucp_ds.save(engine, "ckpt", tag=f"step{engine.global_steps}")   # every rank
    ...
    result = ucp_ds.load(engine, "ckpt")   # any world size, ZeRO stage, precision

:func:`save` writes each rank's fragments (flat ZeRO partitions, 16-bit weights,
optimizer state) straight into the consolidated arrays: no per-rank files, no pickle,
nothing to convert afterwards. :func:`load` reads only each rank's own regions.
:class:`UCPCheckpointEngine` does the same from ``engine.save_checkpoint``. DeepSpeed
is imported only when an engine is saved or loaded. See docs/deepspeed.md.
"""

from __future__ import annotations

from typing import Any

from ucpformat.deepspeed.load import LoadResult, load, resolve_location
from ucpformat.deepspeed.plugin import UCPCheckpointEngine
from ucpformat.deepspeed.save import checkpoint_location, save, wait


def __getattr__(name: str) -> Any:
    from ucpformat.compat import moved_attribute  # the modules that moved in 0.2

    return moved_attribute(__name__, name)


__all__ = ["LoadResult", "UCPCheckpointEngine", "checkpoint_location", "load",
           "resolve_location", "save", "wait"]

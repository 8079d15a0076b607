"""Exporters: UCP -> other frameworks' formats, streaming, tensor by tensor.

One module per target format, each with ``FORMAT`` and ``export(ckpt, destination,
**options)``. Tensors are read from the checkpoint on a pool of threads with at most
``memory_limit`` bytes in memory at once, and written as they arrive::

    from ucpformat import exporters
    exporters.export("ckpt", "hf-model/", to="safetensors", max_shard_size="5GB")
    exporters.export("ckpt", "model.pt", to="torch")
    exporters.export("ckpt", "ds-universal/", to="deepspeed-universal")
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.errors import InvalidValueError
from ucpformat.interchange import result_to_json

FORMATS: dict[str, str] = {
    "safetensors": "ucpformat.exporters.safetensors",
    "torch": "ucpformat.exporters.torch_save",
    "deepspeed-universal": "ucpformat.exporters.deepspeed_universal",
}


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    source: str
    destination: str
    format: str
    tensors: int
    nbytes: int
    files: tuple[str, ...]
    seconds: float = 0.0
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return result_to_json(self)


def module(format: str) -> ModuleType:
    if format not in FORMATS:
        raise InvalidValueError(f"unknown export format {format!r}; known: {sorted(FORMATS)}")
    return importlib.import_module(FORMATS[format])


def export(
    source: str | os.PathLike[str] | Checkpoint,
    destination: str | os.PathLike[str],
    *,
    to: str,
    overwrite: bool = False,
    workers: int | None = None,
    memory_limit: int | None = None,
    progress: bool | Callable[[int], None] = False,
    **options: Any,
) -> ExportResult:
    """Export the UCP checkpoint ``source`` to ``destination`` in format ``to``."""
    mod = module(to)
    start = time.perf_counter()
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    try:
        result: ExportResult = mod.export(
            ckpt, destination, overwrite=overwrite, workers=workers,
            memory_limit=memory_limit, progress=progress, **options,
        )
    finally:
        if not isinstance(source, Checkpoint):
            ckpt.close()
    return replace(result, seconds=time.perf_counter() - start)


__all__ = ["FORMATS", "ExportResult", "export"]

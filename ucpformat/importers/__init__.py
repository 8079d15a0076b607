"""Importers: other frameworks' checkpoints -> UCP, streaming, tensor by tensor.

One module per source format, each with ``FORMAT`` (its name), ``detect(path)`` (a
cheap look at file names and magic bytes, never unpickling anything) and
``scan(path, **options)`` (metadata only; returns a :class:`Scan` whose tensors are
read later, by the engine, with bounded memory)::

    from ucpformat import importers
    importers.detect("hf-model/")                  # "safetensors"
    importers.convert("hf-model/", "ckpt")         # format detected
    importers.convert("dcp-dir/", "ckpt", format="dcp", allow_pickle=True)

Formats: ``hf-trainer`` (a Hugging Face ``Trainer`` checkpoint directory: weights,
optimizer by parameter name, scheduler, trainer state and generators; its ``.pt`` files
are read only with ``allow_pickle=True``), ``safetensors`` (file or sharded
directory), ``torch`` (``torch.save`` files, loaded with ``weights_only=True``),
``dcp`` (PyTorch Distributed Checkpoint; its ``.metadata`` is a pickle, read only with
``allow_pickle=True``), ``deepspeed`` (ZeRO stage 0-3 checkpoints), ``megatron``
(Megatron-LM legacy per-rank checkpoints) and ``orbax`` (Orbax PyTree checkpoints, read
through TensorStore; needs the ``jax`` extra).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from ucpformat.engine import chunking
from ucpformat.errors import FormatError, InvalidValueError
from ucpformat.importers._engine import ImportResult, Scan, TensorSource, write_scan

#: Format name -> module, in the order detection tries them.
FORMATS: dict[str, str] = {
    "hf-trainer": "ucpformat.importers.hf_trainer",
    "safetensors": "ucpformat.importers.safetensors",
    "orbax": "ucpformat.importers.orbax",
    "dcp": "ucpformat.importers.dcp",
    "deepspeed": "ucpformat.importers.deepspeed",
    "megatron": "ucpformat.importers.megatron",
    "torch": "ucpformat.importers.torch_save",
}


def module(format: str) -> ModuleType:
    """The importer module of a format."""
    if format not in FORMATS:
        raise InvalidValueError(f"unknown source format {format!r}; known: {sorted(FORMATS)}")
    return importlib.import_module(FORMATS[format])


def detect(path: str | os.PathLike[str]) -> str:
    """The format of the checkpoint at ``path`` (from names and magic bytes only)."""
    p = Path(path)
    if not p.exists():
        raise FormatError("no such file or directory", path=str(p))
    if p.is_dir() and (p / "zarr.json").is_file():
        raise FormatError("this is already a UCP (zarr) checkpoint", path=str(p))
    for name in FORMATS:
        detector: Callable[[Path], bool] = module(name).detect
        if detector(p):
            return name
    raise FormatError(
        f"cannot tell the format of this checkpoint; name it (one of {sorted(FORMATS)})",
        path=str(p),
    )


def scan(path: str | os.PathLike[str], *, format: str | None = None, **options: Any) -> Scan:
    """Read a checkpoint's metadata: what :func:`convert` would write, nothing read yet."""
    fmt = format or detect(path)
    result: Scan = module(fmt).scan(Path(path), **options)
    return result


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    format: str | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    memory_limit: int | None = None,
    progress: bool | Callable[[int], None] = False,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = "sha256",
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    durable: bool = True,
    **options: Any,
) -> ImportResult:
    """Convert the checkpoint at ``source`` into a UCP checkpoint at ``destination``.

    ``format`` is detected when not given. ``options`` go to the format's importer
    (``allow_pickle``, ``rules``, ``rule_params``, ``tag``, ...; see docs/importers.md).
    Tensors are read and written on ``workers`` threads with at most ``memory_limit``
    bytes of tensor data in memory (default 1 GiB; one larger tensor runs alone).
    """
    the_scan = scan(source, format=format, **options)
    try:
        return write_scan(
            the_scan,
            destination,
            overwrite=overwrite,
            workers=workers,
            memory_limit=memory_limit,
            progress=progress,
            compression=compression,
            hash_algorithm=hash_algorithm,
            chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes,
            durable=durable,
        )
    finally:
        the_scan.close()


__all__ = ["FORMATS", "ImportResult", "Scan", "TensorSource", "convert", "detect", "scan"]

"""Shared pieces of the exporters: what to export, bounded parallel reads, safe output."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat.checkpoint.reader import Checkpoint, Tensor
from ucpformat.checkpoint.write_loop import default_workers
from ucpformat.errors import CheckpointExistsError, InvalidValueError
from ucpformat.format import names
from ucpformat.interchange import DEFAULT_MEMORY_LIMIT, bounded_map
from ucpformat.progress import byte_progress


def model_tensors(ckpt: Checkpoint, *, include_aliases: bool = False) -> list[tuple[str, Tensor]]:
    """(logical name, tensor) of every tensor of ``model``, aliases too if asked."""
    out: list[tuple[str, Tensor]] = []
    for path in ckpt:
        parts = path.split("/")
        if len(parts) == 2 and parts[0] == "model":
            out.append((names.unescape(parts[1]), ckpt[path]))
    if not out:
        raise InvalidValueError("the checkpoint has no model tensors", path=ckpt.location)
    if include_aliases and "model" in ckpt.groups:
        aliases = ckpt.groups["model"].ucp.get("aliases", {})
        for alias, target in sorted(dict(aliases).items()):
            out.append((alias, ckpt.tensor("model", target)))
    return out


def optimizer_states(ckpt: Checkpoint) -> dict[str, dict[str, Tensor]]:
    """parameter name -> state name -> tensor, for every array under ``optimizer/state``."""
    out: dict[str, dict[str, Tensor]] = {}
    for path in ckpt:
        parts = path.split("/")
        if len(parts) == 4 and parts[0] == "optimizer" and parts[1] == "state":
            out.setdefault(names.unescape(parts[2]), {})[names.unescape(parts[3])] = ckpt[path]
    return out


def read_stream(
    tensors: Sequence[tuple[Any, Tensor]],
    *,
    workers: int | None,
    memory_limit: int | None,
    progress: bool | Callable[[int], None],
    description: str,
) -> Iterator[tuple[Any, np.ndarray[Any, Any]]]:
    """(key, data) of each tensor, in order, read ahead on threads with bounded memory."""
    total = sum(t.nbytes for _, t in tensors)
    with byte_progress(progress, total, description) as advance:
        for key, data in bounded_map(
            lambda item: (item[0], item[1].read()),
            tensors,
            lambda item: item[1].nbytes,
            workers=workers or default_workers(),
            memory_limit=memory_limit or DEFAULT_MEMORY_LIMIT,
        ):
            yield key, data
            advance(data.nbytes)


def check_destination(path: Path, *, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        if path.is_dir() and not any(path.iterdir()):
            return
        raise CheckpointExistsError(f"{path} exists; pass overwrite=True to replace it",
                                    path=str(path))


@contextmanager
def atomic_file(path: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary file beside ``path``, renamed onto it only if the block succeeds."""
    check_destination(path, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_dir(path: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary directory beside ``path``, moved onto it only if the block succeeds."""
    check_destination(path, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)

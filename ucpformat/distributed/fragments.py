"""A rank's numpy fragments saved straight into the consolidated format, and resharding reads.

Every rank describes what it holds as *fragments*: a box of a consolidated tensor and
the values in it (from tensor, pipeline, expert or data parallelism, fused parts, flat
ZeRO partitions...). :func:`save_fragments` runs the distributed save pipeline
(:mod:`ucpformat.distributed.pipeline`, which says how a save fails) over them: rank 0 plans from
every rank's boxes and hands each rank its share (:mod:`ucpformat.distributed.save_plan`: coverage,
a shard grid per tensor, one owner per shard), owners receive the cells of their shards that they
lack, each rank writes the shards it owns, and rank 0 commits after every rank has
succeeded, and not at all if any failed (UCP-1.0-R132).

Loading needs no plan: each rank reads the boxes its target layout needs, which
touches only the inner chunks that overlap them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.reader import Checkpoint, Region
from ucpformat.distributed.comm import Communicator
from ucpformat.distributed.pipeline import (
    DistributedSave,
    DistributedSaveResult,
    Fragment,
    FragmentList,
    FragmentSource,
)
from ucpformat.distributed.rank_description import MeshPosition, MeshTensor
from ucpformat.distributed.save_plan import (
    DEFAULT_MIN_SHARD_BYTES,
    TensorSpec,
    check_coverage,
    choose_grid,
    make_plan,
    merge_group_attributes,
)
from ucpformat.engine import chunking
from ucpformat.engine.memory import new_array
from ucpformat.errors import LayoutError
from ucpformat.layout.boxes import Box, LocalMap, as_slices, box_shape
from ucpformat.store import Store


def save_fragments(
    path: str | os.PathLike[str] | Store,
    comm: Communicator,
    *,
    specs: Sequence[TensorSpec],
    fragments: Sequence[Fragment] | FragmentSource,
    group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    meshes: Sequence[MeshPosition] = (),
    on_mesh: Sequence[MeshTensor] = (),
    root_values: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    overwrite: bool = False,
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    workers: int | None = None,
    durable: bool = True,
    progress: bool = False,
    options: SaveOptions | None = None,
) -> DistributedSaveResult:
    """Collective save: every rank passes the specs of the tensors it knows and its fragments.

    ``group_attributes`` (group path -> ``attributes.ucp``, e.g. optimizer ``values`` or
    model ``aliases``) are merged over all ranks; ``root_values`` and ``metadata`` are
    taken from rank 0. Rank 0 holds the location for the whole save (UCP-1.0-R059).
    Raises on every rank if any rank fails; then nothing is committed, what the ranks
    wrote is removed (UCP-1.0-R049), and a checkpoint being replaced (``overwrite=True``) is
    left intact unless the failure came while writing (see :mod:`ucpformat.distributed.pipeline`).

    ``fragments`` are the values in memory, or a
    :class:`~ucpformat.distributed.pipeline.FragmentSource` that gives them when asked (a staging
    area copying them from a device).

    Tensors laid out over device meshes as DTensors are (``on_mesh``, with this rank's
    place in each mesh in ``meshes``) are described by their mesh and placements
    instead of their fragments' boxes (their fragments must be the rank's local part):
    at thousands of ranks holding a piece of every tensor (FSDP), this keeps what the
    coordinator receives and plans from growing with ranks times tensors.

    The settings (``compression`` to ``progress``) may instead be given as one
    :class:`~ucpformat.checkpoint.options.SaveOptions` (``options=``), not both.
    """
    saving = SaveOptions.merged(
        options, compression=compression, hash_algorithm=hash_algorithm, overwrite=overwrite,
        chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, min_shard_bytes=min_shard_bytes,
        workers=workers, durable=durable, progress=progress)
    return DistributedSave(path, comm, saving).run(
        specs,
        FragmentList(fragments) if isinstance(fragments, Sequence) else fragments,
        group_attributes=group_attributes,
        meshes=meshes,
        on_mesh=on_mesh,
        root_values=root_values,
        metadata=metadata,
    )


# -- reading for a target layout ---------------------------------------------------------


def read_local(
    ckpt: Checkpoint,
    path: str,
    local: LocalMap,
    *,
    fill: Any = 0,
    out: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """A rank's local tensor: each piece read from its box; padding set to ``fill``.

    ``out`` (the local shape, the tensor's data type, writeable): read into it, e.g. the
    memory of a framework's local tensor, with no intermediate copy of box pieces.
    """
    return read_locals(ckpt, [(path, local, out)], fill=fill)[0]


def read_locals(
    ckpt: Checkpoint,
    items: Sequence[tuple[str, LocalMap, np.ndarray[Any, Any] | None]],
    *,
    fill: Any = 0,
) -> list[np.ndarray[Any, Any]]:
    """:func:`read_local` of many (tensor path, local map, ``out``) at once: every box
    of every tensor is read in one batch (:meth:`Checkpoint.read_regions`), so the
    checkpoint's threads read the chunks of small and large tensors together."""
    outs: list[np.ndarray[Any, Any]] = []
    regions: list[Region] = []
    flat: list[tuple[np.ndarray[Any, Any], int, int, int]] = []  # (out, a, b, region index)
    ckpt.check_new_arrays([
        (path, math.prod(local.local_shape) * ckpt[path].dtype.itemsize)
        for path, local, out in items if out is None])
    for path, local, out in items:
        tensor = ckpt[path]
        if out is None:
            # every element is read unless the map has padding: no need to fill first
            out = (np.full(local.local_shape, fill, dtype=tensor.dtype) if local.has_padding
                   else new_array(local.local_shape, tensor.dtype))
        else:
            if tuple(out.shape) != tuple(local.local_shape) or out.dtype != tensor.dtype:
                raise LayoutError(
                    f"out is {out.dtype} of shape {list(out.shape)}; the local tensor is "
                    f"{tensor.dtype} of shape {list(local.local_shape)}",
                    tensor=path,
                )
            if local.has_padding:
                out[...] = fill
        outs.append(out)
        for piece in local.pieces:
            lo = [a for a, _ in piece.glob]
            hi = [b for _, b in piece.glob]
            if box_shape(piece.local) == box_shape(piece.glob):
                view = out[as_slices(piece.local)] if out.ndim else out
                regions.append(Region(path, lo, hi, view))
                continue
            if not out.flags.c_contiguous:
                raise LayoutError("a flat piece needs a C-contiguous out array", tensor=path)
            ((a, b),) = piece.local
            flat.append((out, a, b, len(regions)))
            regions.append(Region(path, lo, hi))
    values = ckpt.read_regions(regions)
    for out, a, b, index in flat:
        out.reshape(-1)[a:b] = values[index].reshape(-1)
    return outs


def read_flat(
    ckpt: Checkpoint, pieces: Iterable[tuple[str, int, Box]], size: int, dtype: Any
) -> np.ndarray[Any, Any]:
    """A flat partition buffer of ``size`` elements from (tensor path, offset, box) pieces."""
    out = np.zeros(size, dtype=dtype)
    for path, offset, box in pieces:
        values = ckpt[path].read_region([a for a, _ in box], [b for _, b in box])
        out[offset : offset + values.size] = values.reshape(-1)
    return out


__all__ = [
    "DEFAULT_MIN_SHARD_BYTES",
    "DistributedSaveResult",
    "Fragment",
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

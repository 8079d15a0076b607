"""DTensor-style placements over a device mesh, without torch.

A placement per mesh dimension: :class:`Shard` (split a tensor dimension, torch.chunk
semantics: ceil-sized chunks, the last ones smaller or empty), :class:`Replicate`, and
:class:`StridedShard` (FSDP2 on top of tensor parallelism: the dimension is already cut
into ``split_factor`` blocks by a later mesh dimension, and this one shards each block).
Mesh dimensions apply left to right, so nested sharding of one tensor dimension works.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ucpformat.errors import LayoutError
from ucpformat.layout.boxes import LocalMap
from ucpformat.layout.rank_slices import DimMap, chunk_bounds, product


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class StridedShard:
    dim: int
    split_factor: int


Placement = Shard | Replicate | StridedShard


def placement_from_json(doc: object) -> Placement:
    """``{"shard": d}``, ``{"replicate": true}`` or ``{"strided_shard": d, "split_factor": k}``."""
    if isinstance(doc, dict):
        if "shard" in doc:
            return Shard(int(doc["shard"]))
        if "strided_shard" in doc:
            return StridedShard(int(doc["strided_shard"]), int(doc["split_factor"]))
        if doc.get("replicate"):
            return Replicate()
    raise LayoutError(f"unknown placement {doc!r}", rule="UCP-1.0-R114")


def placement_to_json(p: Placement) -> dict[str, object]:
    if isinstance(p, Shard):
        return {"shard": p.dim}
    if isinstance(p, StridedShard):
        return {"strided_shard": p.dim, "split_factor": p.split_factor}
    return {"replicate": True}


def dtensor_local_map(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coords: Sequence[int],
    *,
    tensor: str | None = None,
) -> LocalMap:
    """The local tensor of the mesh position ``coords`` as pieces of the global tensor."""
    if not len(mesh_shape) == len(placements) == len(coords):
        raise LayoutError(
            "mesh shape, placements and coordinates differ in length",
            rule="UCP-1.0-R114",
            tensor=tensor,
        )
    dims = [DimMap.identity(int(n)) for n in global_shape]
    for size, placement, c in zip(mesh_shape, placements, coords, strict=True):
        if not 0 <= c < size:
            raise LayoutError(
                f"mesh coordinate {c} outside size {size}", rule="UCP-1.0-R114", tensor=tensor
            )
        if isinstance(placement, Replicate):
            continue
        d = placement.dim
        if not 0 <= d < len(dims):
            raise LayoutError(
                f"placement {placement} is out of range for rank {len(dims)}",
                rule="UCP-1.0-R114",
                tensor=tensor,
            )
        if isinstance(placement, Shard):
            dims[d] = dims[d].restrict(*chunk_bounds(dims[d].length, size, c))
        else:
            length = dims[d].length
            blocks = []
            for b in range(placement.split_factor):
                b_lo, b_hi = chunk_bounds(length, placement.split_factor, b)
                lo, hi = chunk_bounds(b_hi - b_lo, size, c)
                blocks.append(dims[d].restrict(b_lo + lo, b_lo + hi))
            dims[d] = DimMap.concat(blocks)
    return product(dims)

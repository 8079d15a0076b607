"""The shard grid of a tensor in a distributed save, chosen from the ranks' fragments.

:func:`check_coverage` proves every element is held (UCP-1.0-R131) and gives the
fragment boundaries; :func:`choose_grid` picks shards aligned with them where that keeps
shards of a useful size, so that each shard lies inside one rank's fragment
(UCP-1.0-R134), capped at the shard size of the save's options.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ucpformat.distributed.rank_description import TensorSpec
from ucpformat.engine import chunking
from ucpformat.errors import LayoutError
from ucpformat.layout.boxes import Box, contains, full_box


def _boundaries(shape: Sequence[int], boxes: Iterable[Box]) -> list[list[int]]:
    cuts: list[set[int]] = [{0, n} for n in shape]
    for box in boxes:
        for d, (a, b) in enumerate(box):
            cuts[d].update((a, b))
    return [sorted(c) for c in cuts]


def check_coverage(path: str, shape: Sequence[int], boxes: Sequence[Box]) -> list[list[int]]:
    """Refuse unless the boxes cover every element; returns the refinement cuts."""
    boxes = list(dict.fromkeys(boxes))  # replicas: each distinct box once
    whole = full_box(shape)
    for box in boxes:
        if len(box) != len(shape) or not contains(whole, box):
            raise LayoutError(
                f"fragment {list(box)} lies outside shape {list(shape)}",
                rule="UCP-1.0-R131",
                tensor=path,
            )
    if math.prod(shape) == 0:
        return [[0, n] for n in shape]
    cuts = _boundaries(shape, boxes)
    covered = np.zeros(tuple(len(c) - 1 for c in cuts), dtype=bool)
    for box in boxes:
        sl = tuple(
            slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
            for c, (a, b) in zip(cuts, box, strict=True)
        )
        covered[sl] = True
    if not covered.all():
        hole = tuple(int(i) for i in np.argwhere(~covered)[0])
        cell = [(cuts[d][i], cuts[d][i + 1]) for d, i in enumerate(hole)]
        raise LayoutError(
            f"no rank holds the region {cell}: the fragments do not cover the tensor",
            rule="UCP-1.0-R131",
            tensor=path,
        )
    return cuts


def _aligned_edges(shape: Sequence[int], cuts: Sequence[Sequence[int]]) -> list[int]:
    return [
        chunking.regular_grid_for_boundaries(n, c) if n else 1
        for n, c in zip(shape, cuts, strict=True)
    ]


def _cap_edges(edges: list[int], itemsize: int, limit: int) -> list[int]:
    """Shrink edges to divisors of themselves until a shard is at most ``limit`` bytes."""
    edges = list(edges)
    while math.prod(edges) * itemsize > limit:
        d = max(range(len(edges)), key=lambda i: edges[i])
        if edges[d] == 1:
            break
        for k in range(2, edges[d] + 1):
            if edges[d] % k == 0:
                edges[d] //= k
                break
    return edges


def chunk_alignment(
    shape: Sequence[int],
    itemsize: int,
    edges: Sequence[int],
    cuts: Sequence[Sequence[int]],
    min_bytes: int = chunking.DEFAULT_MIN_CHUNK_BYTES,
) -> list[int | None]:
    """Per dimension, the edge inner chunks must divide (None: free) under a coarse grid.

    Inner chunks follow the fragments' boundaries along the dimensions the fragments
    cut, unless the largest chunk that alignment allows is under ``min_bytes``: then the
    alignment of the last such dimension is dropped, and so on. Flat ZeRO partitions end
    anywhere inside a row: following their column cuts gave chunks of a few elements
    (a 256 x 256 tensor cut at column 2: 32,768 chunks of 8 bytes, a shard index larger
    than the data, every read of the tensor reading all of it), and more than the
    2^24 inner chunks a shard may hold for large tensors (UCP-1.0-R028). The cells across such a
    boundary are exchanged to the shard's writer like any other.
    """
    align: list[int | None] = [e if len(c) > 2 else None
                               for e, c in zip(edges, cuts, strict=True)]
    for d in reversed(range(len(shape))):
        largest = math.prod(a if a is not None else n for a, n in zip(align, shape,
                                                                       strict=True))
        if largest * itemsize >= min_bytes:
            break
        align[d] = None
    return align


def choose_grid(
    spec: TensorSpec,
    itemsize: int,
    cuts: Sequence[Sequence[int]],
    *,
    chunk_bytes: int,
    shard_bytes: int,
    min_shard_bytes: int,
) -> chunking.Chunking:
    """Shard and inner chunk shapes of a tensor saved from fragments with these ``cuts``.

    Inner chunk edges always fall on the fragments' boundaries (the saving layout's
    cuts), also where the shards are coarser than the fragments: a load that splits the
    tensor as the saving layout did, or in fewer parts, reads only what it needs.
    """
    shape = spec.shape
    splittable = split_dims(spec)
    if len(shape) == 0 or math.prod(shape) == 0:
        return chunking.choose(
            shape, itemsize, chunk_bytes=chunk_bytes, shard_bytes=shard_bytes,
            split_dims=splittable,
        )
    nbytes = math.prod(shape) * itemsize
    edges = _aligned_edges(shape, cuts)
    count = math.prod(-(-n // e) for n, e in zip(shape, edges, strict=True))
    if count > 1 and count > max(1, nbytes // max(1, min_shard_bytes)):  # 0: no minimum
        # Too fine for shards: a coarse shard grid, boundary cells exchanged; the inner
        # chunks still follow the fragments along the dimensions they cut, as long as
        # that leaves them of a useful size (:func:`chunk_alignment`).
        align = chunk_alignment(shape, itemsize, edges, cuts)
        chunk = chunking.tile_shape(
            shape, itemsize, chunk_bytes, align=align, split_dims=splittable,
        )
        return chunking.Chunking(chunk, chunking.shard_shape_for(
            shape, chunk, itemsize, shard_bytes=shard_bytes))
    edges = _cap_edges(edges, itemsize, shard_bytes)
    if count == 1 and nbytes <= chunk_bytes:
        return chunking.Chunking(tuple(max(1, n) for n in shape), None)
    chunk = chunking.tile_shape(
        edges, itemsize, chunk_bytes, align=edges, full_shape=shape, split_dims=splittable,
    )
    return chunking.Chunking(chunk, tuple(edges))


def split_dims(spec: TensorSpec) -> tuple[int, ...]:
    """The dimensions a tensor's grid may split (its layout's)."""
    ucp = spec.attributes.get("ucp", {})
    return chunking.split_dims_of(ucp if isinstance(ucp, Mapping) else {})



"""How a tensor is cut into inner chunks (the unit of reading) and shards (the unit of writing).

Inner chunks are tiles of about ``chunk_bytes``, made by halving the longest dimension
until they fit: for power-of-two (and most transformer) sizes their edges fall on every
tensor-parallel split boundary, so a resharded load reads little it does not need.
Shards are whole multiples of the inner chunk; one writer owns each shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_SHARD_BYTES = 1 << 30

#: Aligned shards smaller than this on average make the planner use a coarse grid and
#: exchange boundary cells instead (too many tiny files otherwise). Measured
#: (benchmarks/bench_distributed.py, 2 GiB, TP4 on 4 gloo ranks): 4 MiB sent most of the
#: bf16 and fp32 weights through the exchange, and the save took 4.6 s; 1 MiB (shards
#: smaller than an inner chunk are the tiny ones) 1.3 s with 1,059 files; no exchange at
#: all 1.3 s with 1,299 files.
DEFAULT_MIN_SHARD_BYTES = 1 << 20
#: Inner chunk edges are cut so that splitting any dimension into up to this many equal
#: parts (tensor parallelism, FSDP) falls on chunk boundaries ...
DEFAULT_SPLITS = 8
#: ... unless chunks would become smaller than this.
DEFAULT_MIN_CHUNK_BYTES = 16 << 10


@dataclass(frozen=True)
class Chunking:
    """Inner chunk shape and shard shape of one array (``shard_shape`` None: unsharded)."""

    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...] | None


def tile_shape(
    shape: Sequence[int],
    itemsize: int,
    target_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    align: Sequence[int | None] | None = None,
    full_shape: Sequence[int] | None = None,
    split_dims: Iterable[int] = (0,),
    splits: int = DEFAULT_SPLITS,
    min_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
) -> tuple[int, ...]:
    """A chunk shape of at most ``target_bytes`` (or one element) for ``shape``.

    Only ``split_dims`` (the dimensions parallel layouts split: 0 for FSDP/ZeRO-3, the
    tensor-parallel dimension, stacked experts or layers) are cut, unless a chunk cannot
    otherwise fit; then other dimensions are cut too, longest first. Chunks that span
    every other dimension fully are contiguous in memory, so a reader can place them
    without a copy. After the size cap, edges of split dimensions longer than ``1/splits``
    of the tensor's dimension (``full_shape``, default ``shape``) are halved while chunks
    stay at least ``min_bytes``: splitting a dimension up to ``splits`` ways then falls
    on chunk boundaries. ``align`` holds per-dimension sizes each edge must divide (a
    shard edge, or the fragments' grid; None: free) and halving then picks divisors of it.
    """
    ndim = len(shape)
    chunk = [max(1, s) for s in shape]
    if align is not None:
        chunk = [c if a is None else min(c, a) for c, a in zip(chunk, align, strict=True)]
    preferred = sorted({d for d in split_dims if 0 <= d < ndim})

    def halve(d: int) -> bool:
        before = chunk[d]
        chunk[d] = _halve(chunk[d], None if align is None else align[d])
        return chunk[d] != before

    while math.prod(chunk) * itemsize > target_bytes:
        candidates = [d for d in preferred if chunk[d] > 1] or [
            d for d in range(ndim) if chunk[d] > 1
        ]
        if not candidates or not halve(max(candidates, key=lambda d: (chunk[d], -d))):
            break
    full = list(full_shape if full_shape is not None else shape)
    limits = [max(1, -(-n // splits)) for n in full]
    while True:
        over = [d for d in preferred if chunk[d] > limits[d] and chunk[d] > 1]
        if not over or math.prod(chunk) * itemsize // 2 < min_bytes:
            break
        if not halve(max(over, key=lambda i: (chunk[i] / limits[i], -i))):
            break
    return tuple(chunk)


def _halve(n: int, align: int | None) -> int:
    """About half of n; when aligning, the largest divisor of ``align`` <= n // 2 (or n / 2)."""
    half = -(-n // 2)
    if align is None:
        return half
    for candidate in range(n // 2 if n > 1 else 1, 0, -1):
        if align % candidate == 0:
            return candidate
    return 1


def choose(
    shape: Sequence[int],
    itemsize: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    split_dims: Iterable[int] = (0,),
    splits: int = DEFAULT_SPLITS,
) -> Chunking:
    """Chunking for a tensor written by a single writer (``splits``: :func:`tile_shape`'s)."""
    shape = tuple(shape)
    if len(shape) == 0:
        return Chunking((), None)
    chunk = tile_shape(shape, itemsize, chunk_bytes, split_dims=split_dims, splits=splits)
    # an empty dimension still has one (empty) row of chunks: shard edges must be >= 1
    grid = [max(1, -(-s // c)) for s, c in zip(shape, chunk, strict=True)]
    if all(g <= 1 for g in grid):
        # Fits in one chunk: store it unsharded, exactly the tensor's shape (at least 1).
        return Chunking(tuple(max(1, s) for s in shape), None)
    return Chunking(chunk, shard_shape_for(shape, chunk, itemsize, shard_bytes=shard_bytes))


def shard_shape_for(
    shape: Sequence[int], chunk: Sequence[int], itemsize: int, *, shard_bytes: int
) -> tuple[int, ...]:
    """The whole tensor in one shard of ``chunk``-sized inner chunks, split along the
    outermost dimensions (in whole chunks) where that is over ``shard_bytes``."""
    grid = [max(1, -(-s // c)) for s, c in zip(shape, chunk, strict=True)]
    shard = [c * g for c, g in zip(chunk, grid, strict=True)]
    for d in range(len(shard)):
        if math.prod(shard) * itemsize <= shard_bytes:
            break
        slab = math.prod(shard[:d]) * chunk[d] * math.prod(shard[d + 1 :]) * itemsize
        shard[d] = chunk[d] * min(max(1, shard_bytes // slab), grid[d])
    return tuple(shard)


def split_dims_of(attributes: Mapping[str, Any]) -> tuple[int, ...]:
    """Dimensions parallel layouts split, from an array's ``attributes.ucp.layout``."""
    dims = {0}
    layout = attributes.get("layout") if isinstance(attributes, Mapping) else None
    if isinstance(layout, Mapping):
        for key in ("tp", "experts", "layers"):
            obj = layout.get(key)
            if isinstance(obj, Mapping) and isinstance(obj.get("dim"), int):
                dims.add(obj["dim"])
    return tuple(sorted(dims))


def regular_grid_for_boundaries(
    extent: int, boundaries: Sequence[int]
) -> int:
    """Largest regular edge such that every boundary (besides 0 and extent) is on the grid."""
    g = 0
    for b in boundaries:
        if 0 < b < extent:
            g = math.gcd(g, b)
    return extent if g == 0 else g

"""How a tensor is cut into inner chunks (the unit of reading) and shards (the unit of writing).

Inner chunks are tiles of about ``chunk_bytes``, made by halving the longest dimension
until they fit: for power-of-two (and most transformer) sizes their edges fall on every
tensor-parallel split boundary, so a resharded load reads little it does not need.
Shards are whole multiples of the inner chunk; one writer owns each shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_SHARD_BYTES = 1 << 30


@dataclass(frozen=True)
class Chunking:
    """Inner chunk shape and shard shape of one array (``shard_shape`` None: unsharded)."""

    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...] | None


def tile_shape(
    shape: Sequence[int], itemsize: int, target_bytes: int = DEFAULT_CHUNK_BYTES,
    *, align: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """A chunk shape of at most ``target_bytes`` (or one element) for ``shape``.

    ``align``, if given, holds per-dimension sizes the chunk edge must divide (for
    example a shard edge); halving then stops at divisors of it.
    """
    chunk = [max(1, s) for s in shape]
    if align is not None:
        chunk = [min(c, a) for c, a in zip(chunk, align, strict=True)]
    while math.prod(chunk) * itemsize > target_bytes:
        # the dimension with the longest extent that can still be halved
        candidates = [i for i, c in enumerate(chunk) if c > 1]
        if not candidates:
            break
        i = max(candidates, key=lambda d: (chunk[d], -d))
        chunk[i] = _halve(chunk[i], None if align is None else align[i])
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
) -> Chunking:
    """Chunking for a tensor written by a single writer."""
    shape = tuple(shape)
    if len(shape) == 0:
        return Chunking((), None)
    chunk = tile_shape(shape, itemsize, chunk_bytes)
    # an empty dimension still has one (empty) row of chunks: shard edges must be >= 1
    grid = [max(1, -(-s // c)) for s, c in zip(shape, chunk, strict=True)]
    if all(g <= 1 for g in grid):
        # Fits in one chunk: store it unsharded, exactly the tensor's shape (at least 1).
        return Chunking(tuple(max(1, s) for s in shape), None)
    shard = [c * g for c, g in zip(chunk, grid, strict=True)]
    # Split oversized shards along the outermost dimensions, in whole chunks.
    for d in range(len(shard)):
        if math.prod(shard) * itemsize <= shard_bytes:
            break
        slab = math.prod(shard[:d]) * chunk[d] * math.prod(shard[d + 1 :]) * itemsize
        shard[d] = chunk[d] * min(max(1, shard_bytes // slab), grid[d])
    return Chunking(chunk, tuple(shard))


def regular_grid_for_boundaries(
    extent: int, boundaries: Sequence[int]
) -> int:
    """Largest regular edge such that every boundary (besides 0 and extent) is on the grid."""
    g = 0
    for b in boundaries:
        if 0 < b < extent:
            g = math.gcd(g, b)
    return extent if g == 0 else g

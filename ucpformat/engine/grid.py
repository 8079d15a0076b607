"""The grid of stored objects of an array: coordinates, regions and storage keys.

A stored object is a shard, or a chunk where the array is unsharded
(:attr:`ArrayMeta.object_shape`). The object at grid coordinates (i, j, …) of the array
at node path P has the key ``P/c/i/j/…`` (zarr v3 ``default`` chunk key encoding with
separator ``/``, UCP-1.0-R021); a zero-dimensional array's one object has the key ``P/c``.

Keys are parsed by one rule: a key names a stored object exactly when it is the key
:func:`object_key` writes for coordinates inside the grid, so every component is the
canonical decimal of a coordinate (ASCII digits, no sign, no leading zero).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ucpformat.checkpoint.metadata import ArrayMeta


def object_key(path: str, coords: Sequence[int]) -> str:
    """Storage key of the stored object at grid ``coords`` of the array at node ``path``."""
    suffix = "/".join(str(c) for c in coords)
    base = f"{path}/c"
    return f"{base}/{suffix}" if suffix else base


def coords_of_key(meta: ArrayMeta, key: str) -> tuple[int, ...] | None:
    """The grid coordinates ``key`` names, if it is the key of a stored object of ``meta``
    (the key :func:`object_key` writes for coordinates inside the grid); otherwise None."""
    base = f"{meta.path}/c"
    if key == base:
        return () if not meta.shape else None
    if not key.startswith(base + "/"):
        return None
    grid = meta.object_grid
    parts = key[len(base) + 1 :].split("/")
    if len(parts) != len(grid) or not all(
        p.isascii() and p.isdigit() and str(int(p)) == p for p in parts
    ):
        return None
    coords = tuple(int(p) for p in parts)
    if any(c >= g for c, g in zip(coords, grid, strict=True)):
        return None
    return coords


def stored_object_coords(meta: ArrayMeta, keys: Iterable[str]) -> list[tuple[int, ...]]:
    """Grid coordinates of the stored objects of ``meta`` among storage ``keys``, sorted.

    Keys under the array's ``c/`` that are not objects of its grid are ignored.
    """
    out = []
    for key in keys:
        coords = coords_of_key(meta, key)
        if coords is not None:
            out.append(coords)
    return sorted(out)


def object_coords(meta: ArrayMeta) -> Iterator[tuple[int, ...]]:
    """Grid coordinates of every stored object of an array (none if it has no elements)."""
    if math.prod(meta.shape) == 0:
        return iter(())
    return itertools.product(*(range(n) for n in meta.object_grid))


def region_bounds(meta: ArrayMeta, coords: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dimension of the part of the array the object at ``coords``
    covers (clipped at the array's edge)."""
    return tuple(
        (c * e, min((c + 1) * e, s))
        for c, e, s in zip(coords, meta.object_shape, meta.shape, strict=True)
    )


def object_region(meta: ArrayMeta, coords: Sequence[int]) -> tuple[slice, ...]:
    """The part of the array the object at ``coords`` covers, as slices."""
    return tuple(slice(a, b) for a, b in region_bounds(meta, coords))


def objects_overlapping(
    meta: ArrayMeta, starts: Sequence[int], stops: Sequence[int]
) -> list[tuple[int, ...]]:
    """Grid coordinates of the stored objects overlapping a (non-empty) box."""
    ranges = [
        range(a // e, -(-b // e))
        for a, b, e in zip(starts, stops, meta.object_shape, strict=True)
    ]
    return list(itertools.product(*ranges))


def inner_chunk_ranges(
    meta: ArrayMeta, coords: Sequence[int], starts: Sequence[int], stops: Sequence[int]
) -> list[range]:
    """Per dimension, the inner chunks (indices within the shard at ``coords``) that
    overlap the box ``[starts, stops)``: what a read of that box reads of this shard."""
    cs = meta.chunk_shape
    out = []
    for d in range(len(cs)):
        origin = coords[d] * meta.object_shape[d]
        lo = max(starts[d], origin) - origin
        hi = min(stops[d], origin + meta.object_shape[d], meta.shape[d]) - origin
        out.append(range(lo // cs[d], -(-hi // cs[d])))
    return out

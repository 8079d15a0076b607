"""The write path of stored objects: encode an object's region, pack it, put it.

An unsharded object is one encoded chunk; a shard is its inner chunks encoded one by one
and packed with their index (:func:`ucpformat.engine.shard_index.pack_shard`). Edge chunks
are stored whole, padded beyond the array (zarr semantics).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ucpformat.engine.grid import region_bounds
from ucpformat.engine.shard_index import pack_shard
from ucpformat.errors import InvalidValueError, WriteError
from ucpformat.store import Store

if TYPE_CHECKING:
    from ucpformat.checkpoint.metadata import ArrayMeta


@dataclass(frozen=True)
class StoredObject:
    """One file (object) written into the checkpoint, as the manifest records it."""

    key: str
    nbytes: int
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"nbytes": self.nbytes}
        if self.sha256 is not None:
            doc["sha256"] = self.sha256
        return doc


def _padded(block: np.ndarray[Any, Any], shape: Sequence[int], fill: Any) -> np.ndarray[Any, Any]:
    """``block`` extended to ``shape`` with the fill value (zarr edge chunks are full size)."""
    if tuple(block.shape) == tuple(shape):
        return block
    out = np.full(tuple(shape), fill, dtype=block.dtype)
    out[tuple(slice(0, n) for n in block.shape)] = block
    return out


def encode_object(
    meta: ArrayMeta,
    coords: Sequence[int],
    data: np.ndarray[Any, Any],
    *,
    pad: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]] | None = None,
) -> list[Any]:
    """Buffers of the stored object at ``coords``, given ``data`` = that object's region.

    ``pad`` makes a whole chunk of an edge chunk's block (default: the fill value beyond
    the array, UCP-1.0-R034).
    """
    if pad is None:
        def pad(block: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            return _padded(block, meta.chunk_shape, meta.fill_value)
    region = region_bounds(meta, coords)
    expected = tuple(b - a for a, b in region)
    if tuple(data.shape) != expected:
        raise WriteError(
            f"object {coords} needs data of shape {expected}, got {tuple(data.shape)}",
            tensor=meta.path,
        )
    if data.dtype == np.bool_ and data.size and int(data.view(np.uint8).max()) > 1:
        raise InvalidValueError(
            "a bool element is held as a byte other than 0x00 or 0x01 (a view of other "
            "bytes as bool?): it would be stored as damage",
            rule="UCP-1.0-R008",
            tensor=meta.path,
        )
    codec = meta.codec
    if meta.shard_shape is None:
        return codec.encode(pad(data))

    def chunks() -> Iterator[tuple[tuple[int, ...], list[Any]]]:
        for local in itertools.product(*(range(n) for n in meta.chunks_per_shard)):
            lo = [i * c for i, c in zip(local, meta.chunk_shape, strict=True)]
            if any(low >= n for low, n in zip(lo, expected, strict=True)):
                continue  # wholly outside the array: not stored (zarr semantics)
            if math.prod(meta.chunk_shape) == 0:
                continue
            block = data[
                tuple(
                    slice(low, min(low + c, n))
                    for low, c, n in zip(lo, meta.chunk_shape, expected, strict=True)
                )
            ]
            yield local, codec.encode(pad(block))

    return pack_shard(meta.chunks_per_shard, chunks())


def write_object(
    store: Store,
    meta: ArrayMeta,
    coords: Sequence[int],
    data: np.ndarray[Any, Any],
    *,
    hash_algorithm: str | None = None,
) -> StoredObject:
    """Encode and write one stored object; the caller owns it alone (one writer per shard)."""
    buffers = encode_object(meta, coords, data)
    digest = None
    if hash_algorithm == "sha256":
        h = hashlib.sha256()
        for b in buffers:
            h.update(b)
        digest = h.hexdigest()
    key = meta.object_key(coords)
    # never replaced: another writer's is refused (UCP-1.0-R059)
    nbytes = store.create(key, buffers)
    return StoredObject(key, nbytes, digest)

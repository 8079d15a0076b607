"""The shard format (zarr v3 ``sharding_indexed``, index at the end).

A shard is its encoded inner chunks, back to back, followed by an index of little-endian
``uint64`` (offset, nbytes) pairs in C order of the inner chunk grid, itself followed by
its CRC32C. An inner chunk that is not stored has the entry (EMPTY, EMPTY).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ucpformat.engine import checksum
from ucpformat.engine.checksum import CRC_BYTES, crc_bytes
from ucpformat.errors import ChecksumError, CorruptDataError

#: Offset and size of an index entry whose inner chunk is not stored.
EMPTY = np.uint64(2**64 - 1)
INDEX_ENTRY_BYTES = 16


def index_codecs_json() -> list[dict[str, Any]]:
    """The ``index_codecs`` of every shard: bytes (little-endian), then crc32c."""
    return [{"name": "bytes", "configuration": {"endian": "little"}}, checksum.codec_json()]


def index_nbytes(chunks_per_shard: Sequence[int]) -> int:
    """Size of the encoded index (the last bytes of a shard), its CRC included."""
    return math.prod(chunks_per_shard) * INDEX_ENTRY_BYTES + CRC_BYTES


def encode_index(index: np.ndarray[Any, Any]) -> bytes:
    """Encode an index array of shape (*chunks_per_shard, 2) of uint64."""
    body = np.ascontiguousarray(index, dtype="<u8").tobytes()
    return body + crc_bytes(body)


def decode_index(
    data: Any, chunks_per_shard: Sequence[int], *, tensor: str, shard: str
) -> np.ndarray[Any, Any]:
    """Check the CRC of an encoded index; the index array, shape (*chunks_per_shard, 2)."""
    view = memoryview(data).cast("B")
    expected = index_nbytes(chunks_per_shard)
    if len(view) != expected:
        raise CorruptDataError(
            f"shard {shard}: index is {len(view)} bytes, expected {expected} (truncated shard?)",
            rule="UCP-1.0-R041",
            tensor=tensor,
        )
    body, stored = view[:-CRC_BYTES], bytes(view[-CRC_BYTES:])
    if crc_bytes(body) != stored:
        raise ChecksumError(
            f"shard {shard}: the shard index fails its CRC32C check",
            rule="UCP-1.0-R041",
            tensor=tensor,
        )
    return np.frombuffer(body, dtype="<u8").reshape((*chunks_per_shard, 2))


def pack_shard(
    chunks_per_shard: Sequence[int], chunks: Iterable[tuple[tuple[int, ...], list[Any]]]
) -> list[Any]:
    """A shard's buffers: each encoded chunk (its coordinates in the shard, its buffers),
    back to back in the order given, then the index; chunks not given are absent."""
    index = np.full((*chunks_per_shard, 2), EMPTY, dtype="<u8")
    buffers: list[Any] = []
    offset = 0
    for local, parts in chunks:
        size = sum(memoryview(p).nbytes for p in parts)
        index[local] = (offset, size)
        offset += size
        buffers.extend(parts)
    buffers.append(encode_index(index))
    return buffers

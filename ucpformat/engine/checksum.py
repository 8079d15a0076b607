"""The ``crc32c`` codec: the CRC32C (Castagnoli) that ends every chunk and shard index.

Its four bytes, little-endian, follow the bytes they check (zarr v3 ``crc32c`` codec).
"""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

#: Size of the checksum that ends every encoded chunk and shard index.
CRC_BYTES = 4


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of a bytes-like object, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def crc_bytes(data: Any) -> bytes:
    """The ``crc32c`` codec's suffix for ``data``: its CRC32C, 4 bytes little-endian."""
    return crc32c(data).to_bytes(CRC_BYTES, "little")


def codec_json() -> dict[str, Any]:
    """The codec's zarr v3 metadata."""
    return {"name": "crc32c"}

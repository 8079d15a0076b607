"""The codec chain of a chunk: ``bytes`` -> optional compressor -> ``crc32c``.

A chunk is its elements' bytes (little-endian, C order), compressed if the array says so
(:mod:`ucpformat.engine.compression`), followed by their CRC32C
(:mod:`ucpformat.engine.checksum`). Encoding and decoding happen here, so that every
failure names the tensor and the chunk it concerns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ucpformat.engine import checksum
from ucpformat.engine.checksum import CRC_BYTES, crc_bytes
from ucpformat.engine.compression import Compression, FrameRefused, SizeMismatch, decompress
from ucpformat.errors import ChecksumError, CorruptDataError
from ucpformat.format.dtypes import DataType


class ChunkCodec:
    """Encodes and decodes one chunk: bytes -> [compressor] -> crc32c."""

    def __init__(self, dtype: DataType, compression: Compression | None) -> None:
        self.dtype = dtype
        self.compression = compression
        self._numcodec = compression.numcodec() if compression else None

    def bytes_codec_json(self) -> dict[str, Any]:
        if self.dtype.itemsize == 1:
            return {"name": "bytes"}
        return {"name": "bytes", "configuration": {"endian": "little"}}

    def to_json(self) -> list[dict[str, Any]]:
        chain: list[dict[str, Any]] = [self.bytes_codec_json()]
        if self.compression:
            chain.append(self.compression.to_json())
        chain.append(checksum.codec_json())
        return chain

    def encode(self, chunk: np.ndarray[Any, Any]) -> list[Any]:
        """Encode a C-contiguous little-endian chunk; returns buffers to write in order."""
        raw = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data
        payload: Any = raw if self._numcodec is None else self._numcodec.encode(raw)
        return [payload, crc_bytes(payload)]

    def decode(
        self, data: Any, shape: Sequence[int], *, tensor: str, chunk: str
    ) -> np.ndarray[Any, Any]:
        """Verify and decode one stored chunk into an array of ``shape``."""
        view = memoryview(data).cast("B")
        if len(view) < CRC_BYTES:
            raise CorruptDataError(
                f"chunk {chunk} is truncated ({len(view)} bytes)", rule="UCP-1.0-R041",
                tensor=tensor,
            )
        payload, stored = view[:-CRC_BYTES], bytes(view[-CRC_BYTES:])
        if crc_bytes(payload) != stored:
            raise ChecksumError(
                f"chunk {chunk} fails its CRC32C check (stored {stored.hex()}, "
                f"computed {crc_bytes(payload).hex()})",
                rule="UCP-1.0-R041",
                tensor=tensor,
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        if self._numcodec is not None and self.compression is not None:
            try:
                payload = decompress(self.compression, self._numcodec, payload, nbytes)
            except FrameRefused as exc:
                raise CorruptDataError(
                    f"chunk {chunk} is refused before decompressing: {exc}",
                    rule="UCP-1.0-R047",
                    tensor=tensor,
                ) from exc
            except SizeMismatch as exc:
                raise CorruptDataError(
                    f"chunk {chunk} is refused before decompressing ({self.compression.name}): "
                    f"{exc}",
                    rule="UCP-1.0-R093",
                    tensor=tensor,
                ) from exc
            except Exception as exc:
                raise CorruptDataError(
                    f"chunk {chunk} cannot be decompressed ({self.compression.name}): {exc}",
                    rule="UCP-1.0-R041",
                    tensor=tensor,
                ) from exc
        if len(payload) != nbytes:
            raise CorruptDataError(
                f"chunk {chunk} holds {len(payload)} bytes"
                f"{' once decompressed' if self.compression else ''}, expected {nbytes}",
                rule="UCP-1.0-R093" if self.compression else "UCP-1.0-R041",
                tensor=tensor,
            )
        if self.dtype.kind == "bool" and nbytes:
            largest = int(np.frombuffer(payload, dtype=np.uint8).max())
            if largest > 1:
                raise CorruptDataError(
                    f"chunk {chunk} stores the byte 0x{largest:02x} for a bool element: a bool "
                    "is 0x00 or 0x01, anything else is damage, never read as true",
                    rule="UCP-1.0-R008",
                    tensor=tensor,
                )
        return np.frombuffer(payload, dtype=self.dtype.numpy).reshape(tuple(shape))

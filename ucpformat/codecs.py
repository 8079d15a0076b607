"""The closed codec set of format 1.0: encode and decode chunks and shard indexes.

A chunk is ``bytes`` (little-endian, C order) -> optional compressor (zstd, gzip or
blosc) -> ``crc32c``. A shard (``sharding_indexed``, index at the end) is the encoded
inner chunks followed by an index of little-endian ``uint64`` (offset, nbytes) pairs in
C order of the inner chunk grid, itself followed by its CRC32C. Compression is done by
numcodecs; this module only arranges bytes, so that every failure can name the tensor
and the chunk it concerns.
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c
import numcodecs
import numpy as np

from ucpformat.dtypes import DataType
from ucpformat.errors import ChecksumError, CorruptDataError, UnsupportedFeatureError

EMPTY = np.uint64(2**64 - 1)
INDEX_ENTRY_BYTES = 16
CRC_BYTES = 4

COMPRESSORS = ("zstd", "gzip", "blosc")
BLOSC_CNAMES = ("lz4", "lz4hc", "blosclz", "zstd", "zlib")
BLOSC_SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of a bytes-like object, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def crc_bytes(data: Any) -> bytes:
    return crc32c(data).to_bytes(4, "little")


@dataclass(frozen=True)
class Compression:
    """A compressor of the closed list, with its zarr v3 configuration."""

    name: str
    configuration: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def parse(spec: str | Mapping[str, Any] | Compression | None, dtype: DataType) -> Compression | None:
        """Accept ``None``, ``"zstd"``, ``"zstd:5"``, ``"gzip"``, ``"blosc"`` or a zarr codec dict."""
        if spec is None or isinstance(spec, Compression):
            return spec
        if isinstance(spec, str):
            name, _, level = spec.partition(":")
            if name == "zstd":
                return Compression("zstd", {"level": int(level or 3), "checksum": False})
            if name == "gzip":
                return Compression("gzip", {"level": int(level or 5)})
            if name == "blosc":
                return Compression(
                    "blosc",
                    {
                        "cname": "zstd",
                        "clevel": int(level or 3),
                        "shuffle": "shuffle" if dtype.itemsize > 1 else "bitshuffle",
                        "typesize": dtype.itemsize,
                        "blocksize": 0,
                    },
                )
            raise UnsupportedFeatureError(
                f"compressor {spec!r} is not in the closed list {COMPRESSORS}",
                rule="UCP-1.0-R024",
            )
        return Compression.from_json(spec)

    @staticmethod
    def from_json(data: Mapping[str, Any], *, tensor: str | None = None) -> Compression:
        name = data.get("name")
        cfg = dict(data.get("configuration") or {})
        if name not in COMPRESSORS:
            raise UnsupportedFeatureError(
                f"codec {name!r} is not allowed; compressors are {COMPRESSORS}",
                rule="UCP-1.0-R024",
                tensor=tensor,
            )
        return Compression(str(name), cfg)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": dict(self.configuration)}

    def numcodec(self) -> Any:
        cfg = self.configuration
        if self.name == "zstd":
            return numcodecs.Zstd(level=int(cfg.get("level", 0)), checksum=bool(cfg.get("checksum", False)))
        if self.name == "gzip":
            return _ReproducibleGZip(int(cfg.get("level", 5)))
        shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[str(cfg.get("shuffle", "noshuffle"))]
        return numcodecs.Blosc(
            cname=str(cfg.get("cname", "zstd")),
            clevel=int(cfg.get("clevel", 5)),
            shuffle=shuffle,
            blocksize=int(cfg.get("blocksize", 0)),
        )


class _ReproducibleGZip:
    """gzip with a zero modification time in its header, so that equal chunks encode equally.

    numcodecs' GZip stores the current time in every gzip header: the same state saved
    twice gave different chunk bytes (and SHA-256 digests). Decoding is numcodecs'.
    """

    def __init__(self, level: int) -> None:
        self.level = level
        self._decoder = numcodecs.GZip(level=level)

    def encode(self, buf: Any) -> bytes:
        return gzip.compress(memoryview(buf).cast("B"), compresslevel=self.level, mtime=0)

    def decode(self, buf: Any) -> Any:
        return self._decoder.decode(buf)


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
        chain.append({"name": "crc32c"})
        return chain

    def encode(self, chunk: np.ndarray[Any, Any]) -> list[Any]:
        """Encode a C-contiguous little-endian chunk; returns buffers to write in order."""
        raw = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        payload: Any = raw if self._numcodec is None else self._numcodec.encode(raw)
        return [payload, crc_bytes(payload)]

    def decode(
        self, data: Any, shape: Sequence[int], *, tensor: str, chunk: str
    ) -> np.ndarray[Any, Any]:
        """Verify and decode one stored chunk into an array of ``shape``."""
        view = memoryview(data).cast("B")
        if len(view) < CRC_BYTES:
            raise CorruptDataError(
                f"chunk {chunk} is truncated ({len(view)} bytes)", rule="UCP-1.0-R041", tensor=tensor
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
        if self._numcodec is not None:
            try:
                payload = memoryview(self._numcodec.decode(payload)).cast("B")
            except Exception as exc:
                raise CorruptDataError(
                    f"chunk {chunk} cannot be decompressed ({self.compression.name if self.compression else ''}): {exc}",
                    rule="UCP-1.0-R041",
                    tensor=tensor,
                ) from exc
        if len(payload) != nbytes:
            raise CorruptDataError(
                f"chunk {chunk} holds {len(payload)} bytes, expected {nbytes}",
                rule="UCP-1.0-R041",
                tensor=tensor,
            )
        return np.frombuffer(payload, dtype=self.dtype.numpy).reshape(tuple(shape))


# -- shard index ------------------------------------------------------------------------


def index_codecs_json() -> list[dict[str, Any]]:
    return [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def index_nbytes(chunks_per_shard: Sequence[int]) -> int:
    return int(np.prod(chunks_per_shard, dtype=np.int64)) * INDEX_ENTRY_BYTES + CRC_BYTES


def encode_index(index: np.ndarray[Any, Any]) -> bytes:
    """Encode an index array of shape (*chunks_per_shard, 2) of uint64."""
    body = np.ascontiguousarray(index, dtype="<u8").tobytes()
    return body + crc_bytes(body)


def decode_index(
    data: Any, chunks_per_shard: Sequence[int], *, tensor: str, shard: str
) -> np.ndarray[Any, Any]:
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

"""The closed codec set of format 1.0: encode and decode chunks and shard indexes.

A chunk is ``bytes`` (little-endian, C order) -> optional compressor (zstd, gzip or
blosc) -> ``crc32c``. A shard (``sharding_indexed``, index at the end) is the encoded
inner chunks followed by an index of little-endian ``uint64`` (offset, nbytes) pairs in
C order of the inner chunk grid, itself followed by its CRC32C. Compression is done by
numcodecs; this module only arranges bytes, so that every failure can name the tensor
and the chunk it concerns.
"""

from __future__ import annotations

import math
import zlib
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
            return numcodecs.GZip(level=int(cfg.get("level", 5)))
        shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[str(cfg.get("shuffle", "noshuffle"))]
        return numcodecs.Blosc(
            cname=str(cfg.get("cname", "zstd")),
            clevel=int(cfg.get("clevel", 5)),
            shuffle=shuffle,
            blocksize=int(cfg.get("blocksize", 0)),
        )


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
        nbytes = math.prod(shape) * self.dtype.itemsize
        if self.compression is not None:
            try:
                payload = decompress(self.compression.name, payload, nbytes)
            except CorruptDataError as exc:
                raise CorruptDataError(
                    f"chunk {chunk} {exc.message}", rule=exc.rule, tensor=tensor
                ) from None
            except Exception as exc:
                raise CorruptDataError(
                    f"chunk {chunk} cannot be decompressed ({self.compression.name}): {exc}",
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


# -- bounded decompression --------------------------------------------------------------

_ZSTD_MAGIC = 0xFD2FB528
_GZIP_WBITS = 16 + 15
_BLOSC_HEADER = 16


def _too_big(name: str, claimed: int | str, nbytes: int) -> CorruptDataError:
    return CorruptDataError(
        f"decompresses ({name}) to {claimed} bytes, not the chunk's {nbytes}: refused before "
        "decompressing",
        rule="UCP-1.0-R093",
    )


def zstd_content_size(frame: Any) -> int | None:
    """The content size a zstd frame header declares (RFC 8878, 3.1.1.1), None if absent."""
    view = memoryview(frame).cast("B")
    if len(view) < 6 or int.from_bytes(view[:4], "little") != _ZSTD_MAGIC:
        raise CorruptDataError("is not a zstd frame", rule="UCP-1.0-R041")
    descriptor = view[4]
    fcs_flag, single_segment, dict_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 3
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if size == 0:
        return None
    if len(view) < pos + size:
        raise CorruptDataError("has a truncated zstd frame header", rule="UCP-1.0-R041")
    value = int.from_bytes(view[pos : pos + size], "little")
    return value + 256 if size == 2 else value


def decompress(name: str, payload: Any, nbytes: int) -> memoryview:
    """Decompress ``payload`` to exactly ``nbytes`` bytes, never producing more.

    UCP-1.0-R093: the output buffer is allocated from the chunk's size (which the caller
    has checked against its limit), never from a size the compressed data claims; a
    frame that claims or produces another size is refused before or while decoding.
    """
    if name == "zstd":
        import numcodecs.zstd

        declared = zstd_content_size(payload)
        if declared is not None and declared != nbytes:
            raise _too_big(name, declared, nbytes)
        out = bytearray(nbytes)
        # numcodecs decodes into ``out`` and fails if the frame produces more (or, with
        # no declared size, a different number of) bytes.
        numcodecs.zstd.decompress(payload, out)
        return memoryview(out)
    if name == "gzip":
        return memoryview(_gunzip(payload, nbytes))
    if name == "blosc":
        import numcodecs.blosc

        view = memoryview(payload).cast("B")
        if len(view) < _BLOSC_HEADER:
            raise CorruptDataError("is shorter than a blosc header", rule="UCP-1.0-R041")
        declared = int.from_bytes(view[4:8], "little")
        cbytes = int.from_bytes(view[12:16], "little")
        if declared != nbytes:
            raise _too_big(name, declared, nbytes)
        if cbytes != len(view):
            raise CorruptDataError(
                f"has a blosc header for {cbytes} compressed bytes, but holds {len(view)}",
                rule="UCP-1.0-R041",
            )
        out = bytearray(nbytes)
        numcodecs.blosc.decompress(view, out)
        return memoryview(out)
    raise UnsupportedFeatureError(f"compressor {name!r} is not in {COMPRESSORS}",
                                  rule="UCP-1.0-R024")


def _gunzip(payload: Any, nbytes: int) -> bytearray:
    """gzip members, one after another, decompressed into at most ``nbytes`` bytes."""
    out = bytearray()
    rest = bytes(payload)
    while True:
        d = zlib.decompressobj(_GZIP_WBITS)
        out += d.decompress(rest, nbytes - len(out) + 1)
        if len(out) > nbytes:
            raise _too_big("gzip", "more than that", nbytes)
        if not d.eof:
            raise CorruptDataError("is a truncated gzip stream", rule="UCP-1.0-R041")
        rest = d.unused_data
        if not rest:
            break
    if len(out) != nbytes:
        raise CorruptDataError(
            f"decompresses (gzip) to {len(out)} bytes, expected {nbytes}", rule="UCP-1.0-R041"
        )
    return out


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

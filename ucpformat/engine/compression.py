"""The compressors of format 1.0's closed codec set: zstd, gzip and blosc.

Compression is done by numcodecs; this module parses a compressor's configuration (its
shorthand and its zarr v3 metadata), makes gzip reproducible and decompresses with the
output size bounded, so that a chunk that declares or produces another size than its
own is refused before it is expanded.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numcodecs
import numpy as np

from ucpformat.errors import UnsupportedFeatureError
from ucpformat.format.dtypes import DataType

COMPRESSORS = ("zstd", "gzip", "blosc")
BLOSC_CNAMES = ("lz4", "lz4hc", "blosclz", "zstd", "zlib")
BLOSC_SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")


@dataclass(frozen=True)
class Compression:
    """A compressor of the closed list, with its zarr v3 configuration."""

    name: str
    configuration: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def parse(
        spec: str | Mapping[str, Any] | Compression | None, dtype: DataType
    ) -> Compression | None:
        """Accept ``None``, ``"zstd"``, ``"zstd:5"``, ``"gzip"``, ``"blosc"``, a codec dict.

        ``"blosc"`` takes optional ``:``-separated parts in any order: a compressor
        (``lz4``, ``zstd``, ...), a level, a shuffle (``shuffle``, ``bitshuffle``,
        ``noshuffle``): ``"blosc:lz4:5"``. Blosc defaults to zstd level 3 with byte-shuffle
        (bit-shuffle for 1-byte types); its ``typesize`` is the data type's item size, also
        where a codec dict that shuffles leaves it out (as zarr-python fills it in), so
        that shuffling moves whole elements' bytes.
        """
        if spec is None or isinstance(spec, Compression):
            return spec
        if isinstance(spec, str):
            name, _, rest = spec.partition(":")
            if name == "zstd":
                return Compression("zstd", {"level": int(rest or 3), "checksum": False})
            if name == "gzip":
                return Compression("gzip", {"level": int(rest or 5)})
            if name == "blosc":
                cfg: dict[str, Any] = {
                    "cname": "zstd",
                    "clevel": 3,
                    "shuffle": "shuffle" if dtype.itemsize > 1 else "bitshuffle",
                    "typesize": dtype.itemsize,
                    "blocksize": 0,
                }
                for part in filter(None, rest.split(":")):
                    if part.isdigit():
                        cfg["clevel"] = int(part)
                    elif part in BLOSC_CNAMES:
                        cfg["cname"] = part
                    elif part in BLOSC_SHUFFLES:
                        cfg["shuffle"] = part
                    else:
                        raise UnsupportedFeatureError(
                            f"blosc option {part!r} is none of the compressors "
                            f"{BLOSC_CNAMES}, shuffles {BLOSC_SHUFFLES} or a level",
                            rule="UCP-1.0-R024",
                        )
                return Compression("blosc", cfg)
            raise UnsupportedFeatureError(
                f"compressor {spec!r} is not in the closed list {COMPRESSORS}",
                rule="UCP-1.0-R024",
            )
        parsed = Compression.from_json(spec)
        given = parsed.configuration
        if (
            parsed.name == "blosc"
            and "typesize" not in given
            and given.get("shuffle", "noshuffle") != "noshuffle"
        ):
            parsed = Compression("blosc", {**given, "typesize": dtype.itemsize})
        return parsed

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
            return numcodecs.Zstd(
                level=int(cfg.get("level", 0)), checksum=bool(cfg.get("checksum", False))
            )
        if self.name == "gzip":
            return _ReproducibleGZip(int(cfg.get("level", 5)))
        shuffles = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
        shuffle = shuffles[str(cfg.get("shuffle", "noshuffle"))]
        # Chunks are handed over as bytes: without the typesize, blosc would shuffle
        # single bytes (a no-op) whatever the configuration says.
        return numcodecs.Blosc(
            cname=str(cfg.get("cname", "zstd")),
            clevel=int(cfg.get("clevel", 5)),
            shuffle=shuffle,
            blocksize=int(cfg.get("blocksize", 0)),
            typesize=int(cfg["typesize"]) if "typesize" in cfg else None,
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


def decompress(compression: Compression, codec: Any, payload: memoryview, nbytes: int
               ) -> memoryview:
    """Decompress ``payload`` with ``codec`` (``compression.numcodec()``) into at most
    ``nbytes`` (plus one, to tell "too long"): a hostile chunk of a few KB that expands to
    gigabytes (a decompression bomb) is refused before it is expanded (spec UCP-1.0-R090,
    UCP-1.0-R093). Raises :class:`SizeMismatch` for data of another size, and
    :class:`FrameRefused` for zstd data that is not one frame declaring its size (UCP-1.0-R047)."""
    name = compression.name
    if name == "gzip":
        return memoryview(_gunzip(payload, nbytes))
    declared = _blosc_nbytes(payload) if name == "blosc" else _zstd_frame_size(payload, nbytes)
    if name == "blosc" and _blosc_cbytes(payload) != len(payload):
        # c-blosc trusts this header field and would read past the buffer (UCP-1.0-R093)
        raise SizeMismatch(
            f"its blosc header says {_blosc_cbytes(payload)} compressed bytes, it holds "
            f"{len(payload)}"
        )
    if declared is not None and declared != nbytes:
        raise SizeMismatch(f"it declares {declared} decompressed bytes, expected {nbytes}")
    out = np.empty(nbytes, dtype=np.uint8)
    codec.decode(payload, out=out)  # numcodecs refuses output beyond ``out``
    return out.data


class SizeMismatch(ValueError):
    """Compressed data that declares, or would produce, another size than the chunk's."""


class FrameRefused(ValueError):
    """A zstd chunk that is not one frame declaring its size (UCP-1.0-R047)."""


#: Compressed bytes handed to zlib at the start of each gzip member (doubled while the
#: member goes on): what zlib copies out as ``unused_data`` at a member's end is bounded
#: by the member's own size, so decoding is linear in the size of the chunk.
_GZIP_FIRST_WINDOW = 256
_GZIP_MAX_WINDOW = 1 << 20


def _gunzip(data: Any, limit: int) -> bytearray:
    """Decompress (possibly concatenated) gzip members, refusing more than ``limit`` bytes.

    One pass over the input (UCP-1.0-R098): each member reads its input through a window
    that starts small and doubles, so a chunk of a million empty members costs what its
    size costs, not a copy of the rest of the chunk per member.
    """
    view = memoryview(data).cast("B")
    out = bytearray()
    pos = 0
    while True:  # one member
        member = zlib.decompressobj(16 + zlib.MAX_WBITS)
        window = _GZIP_FIRST_WINDOW
        while not member.eof:
            if pos >= len(view):
                raise ValueError("the gzip stream is truncated")
            piece = view[pos : pos + window]
            # at most one byte more than the limit: enough to tell "too long"
            out += member.decompress(piece, limit + 1 - len(out))
            if len(out) > limit:
                raise SizeMismatch(f"it decompresses to more than the {limit} bytes expected")
            pos += len(piece) - len(member.unused_data)
            window = min(2 * window, _GZIP_MAX_WINDOW)
        if pos >= len(view):
            return out


def _blosc_nbytes(data: Any) -> int:
    """The uncompressed size a blosc (1.x) buffer declares in its 16-byte header."""
    view = memoryview(data).cast("B")
    if len(view) < 16:
        raise ValueError("the blosc header is truncated")
    return int.from_bytes(view[4:8], "little")


def _blosc_cbytes(data: Any) -> int:
    """The compressed size a blosc (1.x) buffer declares (its header is checked already)."""
    return int.from_bytes(memoryview(data).cast("B")[12:16], "little")


_ZSTD_MAGIC = 0xFD2FB528


def _zstd_frame_size(data: Any, nbytes: int) -> int:
    """The content size of a zstd chunk's one frame (RFC 8878), read from its header.

    UCP-1.0-R047: one frame, no dictionary, a declared content size, a window no larger
    than the chunk's decoded size ``nbytes``, nothing after it. Walks frame and block
    headers only; decompresses nothing.
    """
    view = memoryview(data).cast("B")
    if len(view) < 6:
        raise ValueError("the zstd frame header is truncated")
    magic = int.from_bytes(view[0:4], "little")
    if magic & 0xFFFFFFF0 == 0x184D2A50:
        raise FrameRefused("it starts with a skippable zstd frame")
    if magic != _ZSTD_MAGIC:
        raise ValueError("not a zstd frame")
    fhd = view[4]
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    if fhd & 3:
        raise FrameRefused("its zstd frame names a dictionary")
    if fcs_flag == 0 and not single:
        raise FrameRefused("its zstd frame does not declare its content size")
    pos = 5
    window = None
    if not single:
        exponent, mantissa = view[pos] >> 3, view[pos] & 7
        base = 1 << (10 + exponent)
        window = base + (base >> 3) * mantissa
        pos += 1
    fcs_len = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if pos + fcs_len > len(view):
        raise ValueError("the zstd frame header is truncated")
    size = int.from_bytes(view[pos : pos + fcs_len], "little") + (256 if fcs_len == 2 else 0)
    pos += fcs_len
    while True:  # blocks
        if pos + 3 > len(view):
            raise ValueError("a zstd block header is truncated")
        header = int.from_bytes(view[pos : pos + 3], "little")
        block_type, block_size = (header >> 1) & 3, header >> 3
        pos += 3 + (1 if block_type == 1 else block_size)
        if header & 1:
            break
    pos += 4 if fhd & 4 else 0
    if pos < len(view):
        raise FrameRefused("its data go on after one zstd frame")
    if pos > len(view):
        raise ValueError("the zstd data is truncated")
    if size != nbytes:
        raise SizeMismatch(f"it declares {size} decompressed bytes, expected {nbytes}")
    if window is not None and window > nbytes:
        raise FrameRefused(f"its zstd frame declares a window of {window} bytes, more than "
                            f"the chunk's {nbytes}")
    return size



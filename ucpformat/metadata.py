"""Metadata objects of a checkpoint: build them for writing, parse them strictly for reading.

The JSON Schemas in schemas/1.0 are the normative, machine-readable description of these
objects; this module is the fast path used on every open. Both refuse the same
documents; tests/test_schema_code_agreement.py proves it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ucpformat import dtypes
from ucpformat.codecs import (
    BLOSC_CNAMES,
    BLOSC_SHUFFLES,
    COMPRESSORS,
    ChunkCodec,
    Compression,
    index_codecs_json,
)
from ucpformat.dtypes import DataType
from ucpformat.errors import FormatError, UnsupportedFeatureError, VersionError

FORMAT_VERSION: Final = "1.0"
FORMAT_MAJOR: Final = 1
FORMAT_MINOR: Final = 0
ZARR_JSON: Final = "zarr.json"
MANIFEST_KEY: Final = "manifest.ucp.json"
IN_PROGRESS_KEY: Final = "write-in-progress.ucp.json"
RESERVED_ROOT_SUFFIX: Final = ".ucp.json"
#: Top-level groups whose meaning the spec defines (UCP-1.0-R004).
RESERVED_GROUPS: Final = ("model", "optimizer", "training")

#: Largest number of bytes an array may describe: numpy and most languages index with int64.
MAX_ARRAY_BYTES: Final = 2**63 - 1
MAX_NDIM: Final = 64
#: Largest number of inner chunks per shard (the shard index must stay small to read).
MAX_CHUNKS_PER_SHARD: Final = 2**24

_VERSION_RE = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")


def _fail(message: str, rule: str, where: str | None) -> FormatError:
    return FormatError(message, rule=rule, tensor=where)


# -- arrays -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayMeta:
    """One tensor: a zarr v3 array as format 1.0 allows it."""

    path: str
    shape: tuple[int, ...]
    dtype: DataType
    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...] | None
    compression: Compression | None
    fill_value: Any
    attributes: Mapping[str, Any] = field(default_factory=dict)
    dimension_names: tuple[str | None, ...] | None = None

    @property
    def ucp(self) -> Mapping[str, Any]:
        """The array's ``attributes.ucp`` object (empty if absent)."""
        value = self.attributes.get("ucp", {})
        return value if isinstance(value, Mapping) else {}

    @property
    def sparse(self) -> bool:
        return bool(self.ucp.get("sparse", False))

    @property
    def object_shape(self) -> tuple[int, ...]:
        """Shape of one stored object: the shard, or the chunk when unsharded."""
        return self.shard_shape or self.chunk_shape

    @property
    def object_grid(self) -> tuple[int, ...]:
        """Number of stored objects along each dimension."""
        return tuple(-(-s // c) for s, c in zip(self.shape, self.object_shape, strict=True))

    @property
    def chunks_per_shard(self) -> tuple[int, ...]:
        if self.shard_shape is None:
            return tuple(1 for _ in self.shape)
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape, strict=True))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def codec(self) -> ChunkCodec:
        return ChunkCodec(self.dtype, self.compression)

    def object_key(self, coords: Sequence[int]) -> str:
        """Storage key of the stored object (shard or chunk) at grid ``coords``."""
        suffix = "/".join(str(c) for c in coords)
        base = f"{self.path}/c"
        return f"{base}/{suffix}" if suffix else base

    def to_zarr_json(self) -> dict[str, Any]:
        codec = self.codec
        if self.shard_shape is None:
            codecs: list[dict[str, Any]] = codec.to_json()
            grid = list(self.chunk_shape)
        else:
            codecs = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.chunk_shape),
                        "codecs": codec.to_json(),
                        "index_codecs": index_codecs_json(),
                        "index_location": "end",
                    },
                }
            ]
            grid = list(self.shard_shape)
        doc: dict[str, Any] = {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": dtypes.fill_value_to_json(self.dtype, self.fill_value),
            "codecs": codecs,
            "attributes": dict(self.attributes),
        }
        if self.dimension_names is not None:
            doc["dimension_names"] = list(self.dimension_names)
        return doc


def _int_list(value: Any, what: str, where: str, *, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise _fail(f"{what} must be a list of at most {MAX_NDIM} integers", "UCP-1.0-R027", where)
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum or v > 2**63 - 1:
            raise _fail(
                f"{what} must hold integers >= {minimum} (and < 2**63), got {value!r}",
                "UCP-1.0-R027",
                where,
            )
        out.append(v)
    return tuple(out)


def _parse_bytes_codec(codec: Any, dt: DataType, where: str) -> None:
    if not isinstance(codec, Mapping) or codec.get("name") != "bytes":
        raise _fail(
            f"the first codec must be 'bytes', got {codec!r}", "UCP-1.0-R022", where
        )
    cfg = codec.get("configuration")
    endian = cfg.get("endian") if isinstance(cfg, Mapping) else None
    if cfg is not None and not isinstance(cfg, Mapping):
        raise _fail("'bytes' configuration must be an object", "UCP-1.0-R022", where)
    if dt.itemsize == 1:
        if endian is not None:
            raise _fail(
                f"the 'bytes' codec of a 1-byte type ({dt.name}) must not declare 'endian'",
                "UCP-1.0-R023",
                where,
            )
    elif endian != "little":
        raise _fail(
            f"the 'bytes' codec of {dt.name} must declare endian 'little', got {endian!r}",
            "UCP-1.0-R023",
            where,
        )


def _parse_compression(codec: Mapping[str, Any], where: str) -> Compression:
    name = codec.get("name")
    cfg = codec.get("configuration", {})
    if name not in COMPRESSORS:
        raise UnsupportedFeatureError(
            f"codec {name!r} is not allowed here; the allowed compressors are {COMPRESSORS}",
            rule="UCP-1.0-R024",
            tensor=where,
        )
    if not isinstance(cfg, Mapping):
        raise _fail(f"{name} configuration must be an object", "UCP-1.0-R024", where)

    def int_in(key: str, lo: int, hi: int, *, required: bool = True) -> None:
        v = cfg.get(key)
        if v is None and not required:
            return
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise _fail(f"{name}.{key} must be an integer in [{lo}, {hi}], got {v!r}",
                        "UCP-1.0-R024", where)

    if name == "zstd":
        int_in("level", -131072, 22)
        if not isinstance(cfg.get("checksum", False), bool):
            raise _fail("zstd.checksum must be a boolean", "UCP-1.0-R024", where)
    elif name == "gzip":
        int_in("level", 0, 9)
    else:
        if cfg.get("cname") not in BLOSC_CNAMES:
            raise _fail(f"blosc.cname must be one of {BLOSC_CNAMES}", "UCP-1.0-R024", where)
        int_in("clevel", 0, 9)
        if cfg.get("shuffle") not in BLOSC_SHUFFLES:
            raise _fail(f"blosc.shuffle must be one of {BLOSC_SHUFFLES}", "UCP-1.0-R024", where)
        int_in("typesize", 1, 255, required=False)
        int_in("blocksize", 0, 2**31 - 1)
    return Compression(str(name), dict(cfg))


def _parse_chain(chain: Any, dt: DataType, where: str) -> Compression | None:
    """bytes -> [compressor] -> crc32c."""
    if not isinstance(chain, list) or not 2 <= len(chain) <= 3:
        raise _fail(
            "a codec chain must be bytes, an optional compressor, then crc32c",
            "UCP-1.0-R022",
            where,
        )
    _parse_bytes_codec(chain[0], dt, where)
    last = chain[-1]
    if (
        not isinstance(last, Mapping)
        or last.get("name") != "crc32c"
        or set(last) - {"name", "configuration"}
        or last.get("configuration", {}) != {}
    ):
        raise _fail(
            f"every chunk must end with the crc32c codec, got {last!r}", "UCP-1.0-R040", where
        )
    if len(chain) == 3:
        if not isinstance(chain[1], Mapping):
            raise _fail("codecs must be objects", "UCP-1.0-R022", where)
        return _parse_compression(chain[1], where)
    return None


def parse_array(path: str, doc: Any) -> ArrayMeta:
    """Parse and check one array's zarr.json document."""
    where = path
    if not isinstance(doc, Mapping):
        raise _fail("array metadata must be a JSON object", "UCP-1.0-R001", where)
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise _fail("not a zarr v3 array (zarr_format 3, node_type 'array')", "UCP-1.0-R001", where)
    name = doc.get("data_type")
    if not isinstance(name, str) or name not in dtypes.BY_NAME:
        raise UnsupportedFeatureError(
            f"data type {name!r} is not in the closed list of format 1.0", rule="UCP-1.0-R020",
            tensor=where,
        )
    dt = dtypes.BY_NAME[name]
    shape = _int_list(doc.get("shape"), "shape", where, minimum=0)
    total = dt.itemsize
    for s in shape:
        total *= s
        if total > MAX_ARRAY_BYTES:
            raise _fail(
                f"shape {list(shape)} of {dt.name} describes more than 2**63-1 bytes",
                "UCP-1.0-R027",
                where,
            )
    grid = doc.get("chunk_grid")
    if (
        not isinstance(grid, Mapping)
        or grid.get("name") != "regular"
        or not isinstance(grid.get("configuration"), Mapping)
    ):
        raise _fail("chunk_grid must be 'regular'", "UCP-1.0-R021", where)
    grid_shape = _int_list(grid["configuration"].get("chunk_shape"), "chunk_shape", where, minimum=1)
    if len(grid_shape) != len(shape):
        raise _fail(
            f"chunk_shape {list(grid_shape)} and shape {list(shape)} differ in rank",
            "UCP-1.0-R021",
            where,
        )
    cke = doc.get("chunk_key_encoding")
    if cke != {"name": "default", "configuration": {"separator": "/"}}:
        raise _fail(
            f"chunk_key_encoding must be 'default' with separator '/', got {cke!r}",
            "UCP-1.0-R021",
            where,
        )
    if doc.get("storage_transformers") not in (None, []):
        raise _fail("storage_transformers are not allowed", "UCP-1.0-R025", where)
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs:
        raise _fail("codecs must be a non-empty list", "UCP-1.0-R022", where)
    first = codecs[0]
    shard_shape: tuple[int, ...] | None
    if isinstance(first, Mapping) and first.get("name") == "sharding_indexed":
        if len(codecs) != 1:
            raise _fail("sharding_indexed must be the only array-level codec", "UCP-1.0-R022",
                        where)
        cfg = first.get("configuration")
        if not isinstance(cfg, Mapping):
            raise _fail("sharding_indexed needs a configuration", "UCP-1.0-R022", where)
        chunk_shape = _int_list(cfg.get("chunk_shape"), "inner chunk_shape", where, minimum=1)
        if len(chunk_shape) != len(shape) or any(
            g % c for g, c in zip(grid_shape, chunk_shape, strict=True)
        ):
            raise _fail(
                f"shard shape {list(grid_shape)} must be a multiple of the inner chunk shape "
                f"{list(chunk_shape)}",
                "UCP-1.0-R028",
                where,
            )
        if math.prod(g // c for g, c in zip(grid_shape, chunk_shape, strict=True)) > MAX_CHUNKS_PER_SHARD:
            raise _fail(
                f"a shard holds more than {MAX_CHUNKS_PER_SHARD} inner chunks", "UCP-1.0-R028",
                where,
            )
        if cfg.get("index_codecs") != index_codecs_json():
            raise _fail(
                "shard index_codecs must be bytes (little endian) then crc32c",
                "UCP-1.0-R040",
                where,
            )
        if cfg.get("index_location", "end") != "end":
            raise _fail("shard index_location must be 'end'", "UCP-1.0-R022", where)
        compression = _parse_chain(cfg.get("codecs"), dt, where)
        shard_shape = grid_shape
    else:
        compression = _parse_chain(codecs, dt, where)
        chunk_shape = grid_shape
        shard_shape = None
    if "fill_value" not in doc:
        raise _fail("fill_value is required", "UCP-1.0-R026", where)
    fill = dtypes.fill_value_from_json(dt, doc["fill_value"], tensor=where)
    attributes = doc.get("attributes", {})
    if not isinstance(attributes, Mapping):
        raise _fail("attributes must be an object", "UCP-1.0-R001", where)
    ucp = attributes.get("ucp", {})
    if not isinstance(ucp, Mapping):
        raise _fail("attributes.ucp must be an object", "UCP-1.0-R029", where)
    sparse = ucp.get("sparse", False)
    if not isinstance(sparse, bool):
        raise _fail("attributes.ucp.sparse must be a boolean", "UCP-1.0-R029", where)
    names = doc.get("dimension_names")
    dim_names: tuple[str | None, ...] | None = None
    if names is not None:
        if not isinstance(names, list) or len(names) != len(shape) or not all(
            n is None or isinstance(n, str) for n in names
        ):
            raise _fail("dimension_names must list one string or null per dimension",
                        "UCP-1.0-R001", where)
        dim_names = tuple(names)
    return ArrayMeta(
        path=path,
        shape=shape,
        dtype=dt,
        chunk_shape=chunk_shape,
        shard_shape=shard_shape,
        compression=compression,
        fill_value=fill,
        attributes=attributes,
        dimension_names=dim_names,
    )


# -- groups and the root ----------------------------------------------------------------


@dataclass(frozen=True)
class GroupMeta:
    """One group; ``values`` are the JSON values stored in ``attributes.ucp.values``."""

    path: str
    attributes: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ucp(self) -> Mapping[str, Any]:
        value = self.attributes.get("ucp", {})
        return value if isinstance(value, Mapping) else {}

    @property
    def values(self) -> Mapping[str, Any]:
        value = self.ucp.get("values", {})
        return value if isinstance(value, Mapping) else {}

    def to_zarr_json(self) -> dict[str, Any]:
        return {"zarr_format": 3, "node_type": "group", "attributes": dict(self.attributes)}


def parse_group(path: str, doc: Any) -> GroupMeta:
    if not isinstance(doc, Mapping):
        raise _fail("group metadata must be a JSON object", "UCP-1.0-R001", path or "/")
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise _fail("not a zarr v3 group", "UCP-1.0-R001", path or "/")
    attributes = doc.get("attributes", {})
    if not isinstance(attributes, Mapping):
        raise _fail("attributes must be an object", "UCP-1.0-R001", path or "/")
    ucp = attributes.get("ucp", {})
    if not isinstance(ucp, Mapping):
        raise _fail("attributes.ucp must be an object", "UCP-1.0-R029", path or "/")
    values = ucp.get("values", {})
    if not isinstance(values, Mapping):
        raise _fail("attributes.ucp.values must be an object", "UCP-1.0-R070", path or "/")
    return GroupMeta(path=path, attributes=attributes)


def parse_version(value: Any, *, where: str) -> tuple[int, int]:
    """Parse ``"MAJOR.MINOR"``; refuse anything else or another major version."""
    if value is None:
        raise VersionError(
            "attributes.ucp.version is missing: this is not a UCP checkpoint (or a damaged one)",
            rule="UCP-1.0-R003",
            path=where,
        )
    if not isinstance(value, str) or not _VERSION_RE.match(value):
        raise VersionError(
            f"attributes.ucp.version must be a string 'MAJOR.MINOR', got {value!r}",
            rule="UCP-1.0-R003",
            path=where,
        )
    major, minor = (int(x) for x in value.split("."))
    if major != FORMAT_MAJOR:
        raise VersionError(
            f"format version {value} is not readable by this reader, which reads "
            f"{FORMAT_MAJOR}.x (it was written with {FORMAT_VERSION})",
            rule="UCP-1.0-R060",
            path=where,
        )
    return major, minor


def dumps(doc: Any) -> bytes:
    """Canonical JSON encoding used for every metadata document."""
    return json.dumps(doc, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


#: Deepest nesting of a metadata document (JSON values nest at most 64 levels, R070,
#: below at most 8 levels of document structure); deeper documents are refused before
#: anything walks them recursively (UCP-1.0-R096).
MAX_DOCUMENT_DEPTH: Final = 80


def json_depth(doc: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0), computed without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((v, depth + 1) for v in children)
    return deepest


def loads(data: bytes, *, what: str, rule: str = "UCP-1.0-R001") -> Any:
    """Parse a metadata document as strict RFC 8259 JSON (no NaN, no duplicate keys)."""
    try:
        text = data.decode("utf-8")
        doc = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"not valid JSON: {exc}", rule=rule, path=what) from None
    if json_depth(doc) > MAX_DOCUMENT_DEPTH:
        raise FormatError(
            f"the document nests deeper than {MAX_DOCUMENT_DEPTH} levels", rule="UCP-1.0-R096",
            path=what,
        )
    return doc


def native_scalar(value: Any) -> Any:
    """A numpy scalar as a plain Python value (for JSON)."""
    return value.item() if isinstance(value, np.generic) else value

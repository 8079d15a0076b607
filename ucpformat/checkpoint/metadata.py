"""Metadata objects of a checkpoint: build them for writing, parse them strictly for reading.

The JSON Schemas in schemas/1.0 are the normative, machine-readable description of these
objects; this module is the fast path used on every open. Both refuse the same
documents; tests/test_schema_code_agreement.py proves it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import gc
import hashlib
import json
import math
import platform
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeGuard

from ucpformat._version import __version__
from ucpformat.engine.codecs import ChunkCodec
from ucpformat.engine.compression import BLOSC_CNAMES, BLOSC_SHUFFLES, COMPRESSORS, Compression
from ucpformat.engine.grid import object_key
from ucpformat.engine.shard_index import index_codecs_json
from ucpformat.errors import (
    FormatError,
    InvalidValueError,
    UnsupportedFeatureError,
    VersionError,
)
from ucpformat.format import dtypes, jsonvalues
from ucpformat.format.dtypes import DataType
from ucpformat.format.jsonvalues import MAX_DOCUMENT_DEPTH, json_depth
from ucpformat.format.schemas import DATE_TIME

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
#: Largest value of a shape or chunk shape entry.
MAX_INT: Final = 2**63 - 1
#: Largest number of inner chunks per shard (the shard index must stay small to read).
MAX_CHUNKS_PER_SHARD: Final = 2**24

_VERSION_RE = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")


def _is_map(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)``, fast for the dicts that JSON parsing makes.

    Opening a checkpoint runs this about ten times per array; the ABC check costs a
    quarter of a microsecond more each time.
    """
    return type(value) is dict or isinstance(value, Mapping)


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
        return value if _is_map(value) else {}

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
    def object_count(self) -> int:
        """How many stored objects a non-sparse array has (computed, never enumerated)."""
        return math.prod(self.object_grid) if math.prod(self.shape) else 0

    @property
    def chunks_per_shard(self) -> tuple[int, ...]:
        if self.shard_shape is None:
            return tuple(1 for _ in self.shape)
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape, strict=True))

    @functools.cached_property
    def nbytes(self) -> int:
        """The tensor's size in bytes (worked out once: a load asks several times)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def codec(self) -> ChunkCodec:
        return ChunkCodec(self.dtype, self.compression)

    def object_key(self, coords: Sequence[int]) -> str:
        """Storage key of the stored object (shard or chunk) at grid ``coords``."""
        return object_key(self.path, coords)

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
    if type(value) is list and len(value) <= MAX_NDIM:
        ints = tuple(value)
        if all(type(v) is int and minimum <= v <= MAX_INT for v in ints):
            return ints  # the common case; the checks below name what is wrong
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise _fail(f"{what} must be a list of at most {MAX_NDIM} integers", "UCP-1.0-R027", where)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum or v > MAX_INT:
            raise _fail(
                f"{what} must hold integers >= {minimum} (and < 2**63), got {value!r}",
                "UCP-1.0-R027",
                where,
            )
    return tuple(value)


#: The one chunk key encoding of format 1.0, in its three spellings (UCP-1.0-R035: zarr v3
#: makes the configuration and its separator optional, '/' by default; tensorstore omits
#: the configuration).
CHUNK_KEY_ENCODINGS: Final = (
    {"name": "default", "configuration": {"separator": "/"}},
    {"name": "default", "configuration": {}},
    {"name": "default"},
)
ARRAY_ROLES: Final = ("parameter", "buffer", "optimizer_state", "training_state", "other")
_CODEC_KEYS: Final = frozenset({"name", "configuration"})
_COMPRESSOR_KEYS: Final[dict[str, frozenset[str]]] = {
    "zstd": frozenset({"level", "checksum"}),
    "gzip": frozenset({"level"}),
    "blosc": frozenset({"cname", "clevel", "shuffle", "typesize", "blocksize"}),
}
#: Members a compressor's configuration must have (UCP-1.0-R039; blosc's typesize too when
#: it shuffles).
_COMPRESSOR_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    "zstd": ("level",),
    "gzip": ("level",),
    "blosc": ("cname", "clevel", "shuffle", "blocksize"),
}
_SHARDING_KEYS: Final = frozenset({"chunk_shape", "codecs", "index_codecs", "index_location"})
_INDEX_CODECS: Final = index_codecs_json()


def _check_keys(obj: Mapping[str, Any], allowed: frozenset[str], what: str, rule: str,
                where: str) -> None:
    if obj.keys() <= allowed:
        return
    extra = sorted(str(k) for k in set(obj) - allowed)
    raise _fail(f"{what} has unknown members {extra}", rule, where)


_BYTES_LITTLE: Final = {"name": "bytes", "configuration": {"endian": "little"}}
#: The crc32c codec in a chunk chain and in index_codecs alike (UCP-1.0-R046).
CRC32C_SPELLINGS: Final = ({"name": "crc32c"}, {"name": "crc32c", "configuration": {}})
_BYTES_NO_ENDIAN: Final = {"name": "bytes"}


def _parse_bytes_codec(codec: Any, dt: DataType, where: str) -> None:
    if codec == (_BYTES_NO_ENDIAN if dt.itemsize == 1 else _BYTES_LITTLE):
        return  # the canonical spelling, the common case: nothing more to check
    if not _is_map(codec) or codec.get("name") != "bytes":
        raise _fail(
            f"the first codec must be 'bytes', got {codec!r}", "UCP-1.0-R022", where
        )
    _check_keys(codec, _CODEC_KEYS, "the 'bytes' codec", "UCP-1.0-R023", where)
    cfg = codec.get("configuration")
    endian = cfg.get("endian") if _is_map(cfg) else None
    if "configuration" in codec and not _is_map(cfg):
        raise _fail("'bytes' configuration must be an object", "UCP-1.0-R023", where)
    if _is_map(cfg):
        _check_keys(cfg, frozenset({"endian"}), "the 'bytes' configuration", "UCP-1.0-R023",
                    where)
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
    if name not in COMPRESSORS:
        raise UnsupportedFeatureError(
            f"codec {name!r} is not allowed here; the allowed compressors are {COMPRESSORS}",
            rule="UCP-1.0-R024",
            tensor=where,
        )
    _check_keys(codec, _CODEC_KEYS, f"the {name} codec", "UCP-1.0-R024", where)
    cfg = codec.get("configuration")
    if not _is_map(cfg):
        raise _fail(f"{name} needs a configuration object", "UCP-1.0-R024", where)
    _check_keys(cfg, _COMPRESSOR_KEYS[str(name)], f"the {name} configuration", "UCP-1.0-R024",
                where)
    required = _COMPRESSOR_REQUIRED[str(name)]
    if name == "blosc" and cfg.get("shuffle") in ("shuffle", "bitshuffle"):
        required = (*required, "typesize")  # shuffling moves elements of typesize bytes
    missing = [k for k in required if k not in cfg]
    if missing:
        raise _fail(f"the {name} configuration lacks {missing}, which it requires",
                    "UCP-1.0-R039", where)

    def int_in(key: str, lo: int, hi: int, *, required: bool = True) -> None:
        if key not in cfg and not required:
            return
        v = cfg.get(key)
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
    if not isinstance(chain, list) or not chain:
        raise _fail(
            "a codec chain must be bytes, an optional compressor, then crc32c",
            "UCP-1.0-R022",
            where,
        )
    last = chain[-1]
    if not _is_map(last) or last.get("name") != "crc32c":
        raise _fail(
            f"every chunk must end with the crc32c codec, got {last!r}", "UCP-1.0-R040", where
        )
    if last not in CRC32C_SPELLINGS:
        raise _fail(f"the crc32c codec takes no configuration, got {last!r}", "UCP-1.0-R046",
                    where)
    if not 2 <= len(chain) <= 3:
        raise _fail(
            "a codec chain must be bytes, an optional compressor, then crc32c",
            "UCP-1.0-R022",
            where,
        )
    _parse_bytes_codec(chain[0], dt, where)
    if len(chain) == 3:
        if not _is_map(chain[1]):
            raise _fail("codecs must be objects", "UCP-1.0-R022", where)
        return _parse_compression(chain[1], where)
    return None


def parse_array(path: str, doc: Any) -> ArrayMeta:
    """Parse and check one array's zarr.json document."""
    where = path
    if not _is_map(doc):
        raise _fail("array metadata must be a JSON object", "UCP-1.0-R001", where)
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise _fail("not a zarr v3 array (zarr_format 3, node_type 'array')", "UCP-1.0-R001", where)
    check_node_members(doc, ARRAY_MEMBERS, where)
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
        not _is_map(grid)
        or grid.get("name") != "regular"
        or not _is_map(grid.get("configuration"))
    ):
        raise _fail("chunk_grid must be 'regular'", "UCP-1.0-R021", where)
    grid_shape = _int_list(
        grid["configuration"].get("chunk_shape"), "chunk_shape", where, minimum=1
    )
    if len(grid_shape) != len(shape):
        raise _fail(
            f"chunk_shape {list(grid_shape)} and shape {list(shape)} differ in rank",
            "UCP-1.0-R021",
            where,
        )
    cke = doc.get("chunk_key_encoding")
    if cke not in CHUNK_KEY_ENCODINGS:
        raise _fail(
            f"chunk_key_encoding must be 'default' with separator '/', got {cke!r}",
            "UCP-1.0-R035",
            where,
        )
    if "storage_transformers" in doc and doc["storage_transformers"] != []:
        raise _fail("storage_transformers are not allowed", "UCP-1.0-R025", where)
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs:
        raise _fail("codecs must be a non-empty list", "UCP-1.0-R022", where)
    first = codecs[0]
    shard_shape: tuple[int, ...] | None
    if _is_map(first) and first.get("name") == "sharding_indexed":
        if len(codecs) != 1:
            raise _fail("sharding_indexed must be the only array-level codec", "UCP-1.0-R022",
                        where)
        _check_keys(first, _CODEC_KEYS, "the sharding_indexed codec", "UCP-1.0-R022", where)
        cfg = first.get("configuration")
        if not _is_map(cfg):
            raise _fail("sharding_indexed needs a configuration", "UCP-1.0-R022", where)
        _check_keys(cfg, _SHARDING_KEYS, "the sharding_indexed configuration", "UCP-1.0-R022",
                    where)
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
        per_shard = math.prod(g // c for g, c in zip(grid_shape, chunk_shape, strict=True))
        if per_shard > MAX_CHUNKS_PER_SHARD:
            raise _fail(
                f"a shard holds more than {MAX_CHUNKS_PER_SHARD} inner chunks", "UCP-1.0-R028",
                where,
            )
        index_chain = cfg.get("index_codecs")
        if index_chain != _INDEX_CODECS:  # the common spelling: nothing more to check
            if (not isinstance(index_chain, list) or len(index_chain) != 2
                    or index_chain[0] != _BYTES_LITTLE or not _is_map(index_chain[1])
                    or index_chain[1].get("name") != "crc32c"):
                raise _fail(
                    "shard index_codecs must be bytes (little endian) then crc32c",
                    "UCP-1.0-R040",
                    where,
                )
            if index_chain[1] not in CRC32C_SPELLINGS:
                raise _fail(f"the crc32c codec takes no configuration, got {index_chain[1]!r}",
                            "UCP-1.0-R046", where)
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
    if not _is_map(attributes):
        raise _fail("attributes must be an object", "UCP-1.0-R001", where)
    ucp = _parse_node_ucp(attributes, where)
    sparse = ucp.get("sparse", False)
    if not isinstance(sparse, bool):
        raise _fail("attributes.ucp.sparse must be a boolean", "UCP-1.0-R032", where)
    if "role" in ucp and ucp["role"] not in ARRAY_ROLES:
        raise _fail(f"attributes.ucp.role must be one of {ARRAY_ROLES}, got {ucp['role']!r}",
                    "UCP-1.0-R084", where)
    names = doc.get("dimension_names")
    dim_names: tuple[str | None, ...] | None = None
    if "dimension_names" in doc:
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
        return value if _is_map(value) else {}

    @property
    def values(self) -> Mapping[str, Any]:
        value = self.ucp.get("values", {})
        return value if _is_map(value) else {}

    def to_zarr_json(self) -> dict[str, Any]:
        return {"zarr_format": 3, "node_type": "group", "attributes": dict(self.attributes)}


#: The members zarr v3 defines for an array's and a group's zarr.json (UCP-1.0-R007).
ARRAY_MEMBERS: Final = frozenset({
    "zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
    "fill_value", "codecs", "storage_transformers", "dimension_names", "attributes",
})
GROUP_MEMBERS: Final = frozenset({"zarr_format", "node_type", "attributes"})


def check_node_members(doc: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    """Refuse a member zarr v3 does not define unless it is marked ``"must_understand":
    false`` (UCP-1.0-R007, zarr v3's rule for extensions): such a one is ignored."""
    if doc.keys() <= known:
        return
    for key, value in doc.items():
        if key not in known and not (_is_map(value) and value.get("must_understand") is False):
            raise _fail(f"member {key!r} is not one zarr v3 defines for this node, and is not "
                        'marked "must_understand": false', "UCP-1.0-R007", where)


def _parse_node_ucp(attributes: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """``attributes.ucp`` of a node other than the root (empty if absent)."""
    ucp = attributes.get("ucp", {})
    if not _is_map(ucp):
        raise _fail("attributes.ucp must be an object", "UCP-1.0-R029", where)
    if "version" in ucp:
        raise _fail("attributes.ucp.version belongs to the root group only", "UCP-1.0-R003",
                    where)
    return ucp


def check_values(values: Any, *, what: str, where: str) -> None:
    """Refuse a ``values`` (or ``metadata``) member that is not an object of JSON values."""
    if not _is_map(values):
        raise _fail(f"{what} must be an object", "UCP-1.0-R070", where)
    if values:
        jsonvalues.decode(values, where=where)


def parse_group(path: str, doc: Any, *, root: bool = False) -> GroupMeta:
    """Parse and check one group's zarr.json document (``root``: the root, whose
    ``attributes.ucp`` is checked by :func:`ucpformat.checkpoint.reader.parse_root`)."""
    where = path or "/"
    if not _is_map(doc):
        raise _fail("group metadata must be a JSON object", "UCP-1.0-R001", where)
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise _fail("not a zarr v3 group", "UCP-1.0-R001", where)
    if not root:  # the root's members are UCP-1.0-R057's
        check_node_members(doc, GROUP_MEMBERS, where)
    attributes = doc.get("attributes", {})
    if not _is_map(attributes):
        raise _fail("attributes must be an object", "UCP-1.0-R001", where)
    if not root:
        ucp = _parse_node_ucp(attributes, where)
        check_values(ucp.get("values", {}), what="attributes.ucp.values", where=where)
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
            f"format version {value} is not readable by this reader, which reads versions "
            f"{FORMAT_MAJOR}.x (it implements {FORMAT_VERSION})",
            rule="UCP-1.0-R060",
            path=where,
        )
    return major, minor


# -- the root's attributes.ucp ---------------------------------------------------------


def utc_now() -> str:
    """The current time as an RFC 3339 UTC date-time to the second (``...T12:00:00Z``)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def default_producer() -> dict[str, Any]:
    """The ``producer`` of the checkpoints this library writes."""
    return {"name": "ucpformat", "version": __version__, "python": platform.python_version()}


def build_root_ucp(
    *,
    metadata: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
    producer: Mapping[str, Any] | None = None,
    created: str | None = None,
    saved_by: Mapping[str, Any] | None = None,
    extensions: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The root group's ``attributes.ucp`` of a new checkpoint, but for ``version`` and
    ``manifest``, which the commit adds (:func:`ucpformat.checkpoint.commit.commit_checkpoint`).

    Members, in this order: ``producer`` (default: :func:`default_producer`), ``created``
    (an RFC 3339 date-time; default: now), ``saved_by`` (how the checkpoint was saved:
    world size, ...), the members of ``extensions`` (further members of
    ``attributes.ucp`` a writer defines, JSON as it is to be stored), ``metadata``
    (free-form) and ``values`` (the root's JSON values). ``producer``, ``saved_by``,
    ``metadata`` and ``values`` are Python values, encoded here
    (:func:`ucpformat.format.jsonvalues.encode`); an empty ``values`` is left out.
    """
    if created is not None and (not isinstance(created, str) or not DATE_TIME.match(created)):
        raise InvalidValueError(
            f"created must be an RFC 3339 date-time such as 2026-01-01T00:00:00Z, got {created!r}",
            rule="UCP-1.0-R002",
        )
    ucp: dict[str, Any] = {
        "producer": default_producer()
        if producer is None
        else jsonvalues.encode(dict(producer), where="producer"),
        "created": utc_now() if created is None else created,
    }
    if saved_by is not None:
        ucp["saved_by"] = jsonvalues.encode(dict(saved_by), where="saved_by")
    ucp.update(extensions or {})
    if metadata is not None:
        ucp["metadata"] = jsonvalues.encode(dict(metadata), where="metadata")
    if values:
        ucp["values"] = jsonvalues.encode(dict(values), where="values")
    return ucp


def dumps(doc: Any, *, compact: bool = False) -> bytes:
    """JSON encoding of metadata documents: indented, or compact for the large root.

    json's C encoder only runs without indentation: compact is 4 to 40 times faster (7 µs
    against 30 µs for an array's zarr.json on a quiet machine, 270 µs on a busy one), so
    documents nobody reads as files (checks, the root) are compact."""
    if compact:
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    else:
        text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # built in C; a duplicate key makes it shorter than the pairs
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


class gc_paused:  # (lower case: it reads as the function it replaced, ``with gc_paused():``)
    """Pause the cyclic garbage collector while a large metadata document is parsed, or a
    batch of tensors read.

    Parsing the consolidated metadata of 10,000 tensors allocates about a million
    containers; each allocation burst triggers a collection that traverses all of them
    again (a third of the parse time). A batch read allocates a few containers per
    tensor, and the collections they set off traverse the whole process's heap (torch's
    alone is 200,000 objects). Neither forms reference cycles.

    Pauses nest and overlap across threads: the first to begin disables the collector
    (remembering whether it ran), the last to end enables it again if it did. (Each
    remembering on its own left it disabled for good when two threads interleaved.) A
    class, not a generator: it is entered once per ``get_tensor``.
    """

    _lock = threading.Lock()
    _depth = 0
    _was_enabled = False

    def __enter__(self) -> None:
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                cls._was_enabled = gc.isenabled()
                gc.disable()
            cls._depth += 1

    def __exit__(self, *exc: object) -> None:
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and cls._was_enabled:
                gc.enable()


#: The decoder of :func:`loads`, made once (``json.loads`` with options makes one per call).
_STRICT_JSON: Final = json.JSONDecoder(parse_constant=_refuse_constant,
                                       object_pairs_hook=_no_duplicates)


def loads(data: bytes, *, what: str, rule: str = "UCP-1.0-R001") -> Any:
    """Parse a metadata document as strict RFC 8259 JSON (no NaN, no duplicate keys, no
    byte order mark, UCP-1.0-R009), whose strings are all Unicode scalar values (no
    unpaired surrogate escape, UCP-1.0-R006)."""
    if data[:3] == b"\xef\xbb\xbf":
        raise FormatError("the document begins with a UTF-8 byte order mark",
                          rule="UCP-1.0-R009", path=what)
    try:
        text = data.decode("utf-8")
        with gc_paused():
            doc = _STRICT_JSON.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"not valid JSON: {exc}", rule=rule, path=what) from None
    # A surrogate can only come from a \uD800-\uDFFF escape (raw surrogate bytes are not
    # UTF-8): only a document that has such an escape needs its strings walked.
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        check_scalar_strings(doc, what=what)
    return doc


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def check_scalar_strings(doc: Any, *, what: str) -> None:
    """Refuse a document any of whose strings (member names included) holds an unpaired
    surrogate: it has no UTF-8 encoding, so no writer, printer or other language can
    carry it (UCP-1.0-R006). Walks without recursion."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, pointer = stack.pop()
        if isinstance(value, str):
            strings: list[tuple[str, str]] = [(value, pointer)]
            children: list[tuple[Any, str]] = []
        elif isinstance(value, dict):
            strings = [(k, f"{pointer}/{k!r}") for k in value]
            children = [(v, f"{pointer}/{k!r}") for k, v in value.items()]
        elif isinstance(value, list):
            strings = []
            children = [(v, f"{pointer}/{i}") for i, v in enumerate(value)]
        else:
            continue
        for string, at in strings:
            try:
                string.encode("utf-8")
            except UnicodeEncodeError:
                raise FormatError(
                    f"the string {string!r} at {at or '/'} holds an unpaired surrogate "
                    "escape (\\uD800 to \\uDFFF not in a pair): it is not Unicode text",
                    rule="UCP-1.0-R006",
                    path=what,
                ) from None
        stack.extend(children)


def check_depth(doc: Any, *, what: str) -> None:
    """Refuse a document nested deeper than MAX_DOCUMENT_DEPTH (UCP-1.0-R096).

    Validators call it before any recursive walk (schemas, comparisons); ``open`` does
    not walk JSON values recursively before decoding them, which bounds its own depth
    (UCP-1.0-R070), so it skips this walk over every node of the consolidated metadata.
    """
    if json_depth(doc) > MAX_DOCUMENT_DEPTH:
        raise FormatError(
            f"the document nests deeper than {MAX_DOCUMENT_DEPTH} levels", rule="UCP-1.0-R096",
            path=what,
        )


# -- the root's digest (UCP-1.0-R058) ---------------------------------------------------

#: Member of the root's ``attributes.ucp`` that holds the SHA-256 of the root zarr.json.
ROOT_DIGEST: Final = "root_sha256"
_ZERO_DIGEST: Final = b"0" * 64
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def encode_root(doc: Mapping[str, Any]) -> bytes:
    """The bytes of a root zarr.json, sealed: ``attributes.ucp.root_sha256`` is the SHA-256
    of these bytes with its own 64 digits written as ``0`` (UCP-1.0-R058).

    Compact JSON: the root holds every node's metadata and is parsed on every open.
    """
    attributes = doc["attributes"]
    nonce = secrets.token_hex(32)  # a placeholder whose one occurrence is easy to find
    ucp = {**attributes["ucp"], ROOT_DIGEST: nonce}
    body = dumps({**doc, "attributes": {**attributes, "ucp": ucp}}, compact=True)
    pos = body.index(nonce.encode())
    assert body.find(nonce.encode(), pos + 1) < 0
    zeroed = body[:pos] + _ZERO_DIGEST + body[pos + 64 :]
    return zeroed[:pos] + hashlib.sha256(zeroed).hexdigest().encode() + zeroed[pos + 64 :]


def check_root_digest_member(ucp: Mapping[str, Any], *, where: str) -> str:
    """The root's digest (64 lower-case hex digits), or a FormatError naming UCP-1.0-R058."""
    digest = ucp.get(ROOT_DIGEST)
    if digest is None:
        raise FormatError(
            f"the root has no attributes.ucp.{ROOT_DIGEST}, so damage to it could go unseen: "
            "a checkpoint written by a draft of format 1.0 older than this reader (save it "
            "again with this version), or a damaged root",
            rule="UCP-1.0-R058",
            path=where,
        )
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise FormatError(
            f"attributes.ucp.{ROOT_DIGEST} must be 64 lower-case hexadecimal digits, "
            f"got {digest!r}",
            rule="UCP-1.0-R058",
            path=where,
        )
    return digest


def root_digest_problem(raw: bytes, digest: str) -> str | None:
    """Why ``raw`` (the root's bytes) does not match its ``digest``, or None if it does."""
    token = f'"{digest}"'.encode()
    pos = raw.find(token)
    if pos < 0 or raw.find(token, pos + 1) >= 0:
        return (f"its {ROOT_DIGEST} must appear exactly once in the file, as written "
                "(no escapes)")
    view = memoryview(raw)
    h = hashlib.sha256(view[: pos + 1])
    h.update(_ZERO_DIGEST)
    h.update(view[pos + 65 :])
    computed = h.hexdigest()
    if computed != digest:
        return (f"the root zarr.json is damaged: its SHA-256 (with {ROOT_DIGEST} zeroed) is "
                f"{computed}, it says {digest}")
    return None


def check_root_digest(raw: bytes, doc: Any, *, where: str) -> None:
    """UCP-1.0-R058: refuse a root whose bytes differ from those its digest was made of.

    A root that is no UCP root at all (no ``attributes.ucp`` object) is left to the
    structural checks, which name what it lacks; a version other than 1.x is refused as
    such (UCP-1.0-R003, UCP-1.0-R060) before the digest is looked at.
    """
    attributes = doc.get("attributes") if _is_map(doc) else None
    ucp = attributes.get("ucp") if _is_map(attributes) else None
    if not _is_map(ucp):
        return
    parse_version(ucp.get("version"), where=where)  # another major version: say that first
    problem = root_digest_problem(raw, check_root_digest_member(ucp, where=where))
    if problem is not None:
        raise FormatError(problem, rule="UCP-1.0-R058", path=where)

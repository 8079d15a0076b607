"""Writing checkpoints: data first, metadata next, the root last (the commit).

The commit protocol (spec section "Commit"): a writer marks the directory as being
written, writes every stored object (shards or chunks) and every non-root ``zarr.json``,
then the manifest, and finally the root ``zarr.json`` with the consolidated metadata.
Until that last write succeeds, what is on disk is not a checkpoint and every reader
refuses it. A committed checkpoint is never modified; ``overwrite=True`` first
un-commits it (deletes the root) before anything else is touched.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import math
import os
import platform
import re
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat import chunking, dtypes, jsonvalues, names
from ucpformat._version import __version__
from ucpformat.codecs import EMPTY, Compression, encode_index
from ucpformat.errors import (
    CheckpointExistsError,
    InvalidValueError,
    UCPError,
    WriteError,
)
from ucpformat.metadata import (
    FORMAT_VERSION,
    IN_PROGRESS_KEY,
    MANIFEST_KEY,
    RESERVED_GROUPS,
    RESERVED_ROOT_SUFFIX,
    ZARR_JSON,
    ArrayMeta,
    GroupMeta,
    dumps,
)
from ucpformat.storage import Store, open_store

HASH_ALGORITHMS = ("sha256",)


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


# -- encoding stored objects -----------------------------------------------------------


def _region_of(meta: ArrayMeta, coords: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The part of the array covered by the stored object at ``coords``, clipped."""
    return tuple(
        (c * e, min((c + 1) * e, s))
        for c, e, s in zip(coords, meta.object_shape, meta.shape, strict=True)
    )


def _padded(block: np.ndarray[Any, Any], shape: Sequence[int], fill: Any) -> np.ndarray[Any, Any]:
    """``block`` extended to ``shape`` with the fill value (zarr edge chunks are full size)."""
    if tuple(block.shape) == tuple(shape):
        return block
    out = np.full(tuple(shape), fill, dtype=block.dtype)
    out[tuple(slice(0, n) for n in block.shape)] = block
    return out


def encode_object(meta: ArrayMeta, coords: Sequence[int], data: np.ndarray[Any, Any]) -> list[Any]:
    """Buffers of the stored object at ``coords``, given ``data`` = that object's region."""
    region = _region_of(meta, coords)
    expected = tuple(b - a for a, b in region)
    if tuple(data.shape) != expected:
        raise WriteError(
            f"object {coords} needs data of shape {expected}, got {tuple(data.shape)}",
            tensor=meta.path,
        )
    codec = meta.codec
    if meta.shard_shape is None:
        return codec.encode(_padded(data, meta.chunk_shape, meta.fill_value))
    cps = meta.chunks_per_shard
    index = np.full((*cps, 2), EMPTY, dtype="<u8")
    buffers: list[Any] = []
    offset = 0
    for local in itertools.product(*(range(n) for n in cps)):
        lo = [i * c for i, c in zip(local, meta.chunk_shape, strict=True)]
        if any(low >= n for low, n in zip(lo, expected, strict=True)):
            continue  # wholly outside the array: not stored (zarr semantics)
        if math.prod(meta.chunk_shape) == 0:
            continue
        block = data[
            tuple(slice(low, min(low + c, n)) for low, c, n in zip(lo, meta.chunk_shape, expected, strict=True))
        ]
        parts = codec.encode(_padded(block, meta.chunk_shape, meta.fill_value))
        size = sum(memoryview(p).nbytes for p in parts)
        index[local] = (offset, size)
        offset += size
        buffers.extend(parts)
    buffers.append(encode_index(index))
    return buffers


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
    nbytes = store.put(key, buffers)
    return StoredObject(key, nbytes, digest)


def object_coords(meta: ArrayMeta) -> Iterator[tuple[int, ...]]:
    """Grid coordinates of every stored object of an array (none if it has no elements)."""
    if math.prod(meta.shape) == 0:
        return iter(())
    return itertools.product(*(range(n) for n in meta.object_grid))


def object_region(meta: ArrayMeta, coords: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in _region_of(meta, coords))


# -- the commit protocol -----------------------------------------------------------------


def prepare_destination(store: Store, *, overwrite: bool) -> None:
    """Make ``store`` ready for a new checkpoint, or refuse (never damaging a committed one)."""
    committed = store.exists(ZARR_JSON)
    in_progress = store.exists(IN_PROGRESS_KEY)
    if committed and not overwrite:
        raise CheckpointExistsError(
            "a committed checkpoint is already here; pass overwrite=True to replace it",
            rule="UCP-1.0-R053",
            path=store.location,
        )
    if not committed and not in_progress and not store.is_empty() and not overwrite:
        raise CheckpointExistsError(
            "the destination holds files that are not a UCP checkpoint; refusing to mix them",
            rule="UCP-1.0-R053",
            path=store.location,
        )
    marker = dumps(
        {
            "writer": f"ucpformat {__version__}",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": _now(),
        }
    )
    # Mark first, then un-commit, then clear: a crash at any point leaves either the old
    # committed checkpoint intact or something every reader refuses.
    store.put(IN_PROGRESS_KEY, [marker], atomic=True)
    if committed:
        store.delete(ZARR_JSON)
    for key in list(store.list()):
        if key != IN_PROGRESS_KEY:
            store.delete(key)
    store.flush()


def commit(
    store: Store,
    *,
    arrays: Sequence[ArrayMeta],
    groups: Sequence[GroupMeta],
    objects: Sequence[StoredObject],
    root_ucp: Mapping[str, Any],
    root_attributes: Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
) -> dict[str, Any]:
    """Write node metadata, the manifest and, last, the root: the checkpoint exists after this.

    Returns the root ``zarr.json`` document.
    """
    files: dict[str, dict[str, Any]] = {o.key: o.to_json() for o in objects}
    consolidated: dict[str, Any] = {}
    for node in sorted([*groups, *arrays], key=lambda n: n.path):
        doc = node.to_zarr_json()
        body = dumps(doc)
        store.put(f"{node.path}/{ZARR_JSON}", [body])
        files[f"{node.path}/{ZARR_JSON}"] = _describe(body, hash_algorithm)
        consolidated[node.path] = doc
    manifest = {
        "hash_algorithm": hash_algorithm,
        "files": dict(sorted(files.items())),
    }
    manifest_body = dumps(manifest)
    store.put(MANIFEST_KEY, [manifest_body])
    store.flush()  # every byte before the commit is durable before the commit is written
    ucp = dict(root_ucp)
    ucp["version"] = FORMAT_VERSION
    ucp["manifest"] = {"path": MANIFEST_KEY, **_describe(manifest_body, "sha256")}
    attributes = dict(root_attributes or {})
    attributes["ucp"] = ucp
    root = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": attributes,
        "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": consolidated},
    }
    store.put(ZARR_JSON, [dumps(root)], atomic=True)
    store.delete(IN_PROGRESS_KEY)
    return root


def _describe(body: bytes, hash_algorithm: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"nbytes": len(body)}
    if hash_algorithm == "sha256":
        doc["sha256"] = hashlib.sha256(body).hexdigest()
    return doc


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def default_producer() -> dict[str, Any]:
    return {"name": "ucpformat", "version": __version__, "python": platform.python_version()}


#: Former name of :func:`default_producer` (``save`` has a ``producer`` argument now).
producer = default_producer

_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})$"
)


def _check_created(created: str) -> str:
    if not isinstance(created, str) or not _RFC3339.match(created):
        raise InvalidValueError(
            f"created must be an RFC 3339 date-time such as 2026-01-01T00:00:00Z, got {created!r}",
            rule="UCP-1.0-R002",
        )
    return created


# -- planning a save from a nested mapping ------------------------------------------------


@dataclass
class Plan:
    """What a save writes: array metadata with its data, groups, root values."""

    arrays: list[tuple[ArrayMeta, np.ndarray[Any, Any]]] = field(default_factory=list)
    groups: list[GroupMeta] = field(default_factory=list)
    root_values: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m, _ in self.arrays)


def _has_array(value: Any) -> bool:
    if isinstance(value, np.ndarray | np.generic):
        return True
    if isinstance(value, Mapping):
        return any(_has_array(v) for v in value.values())
    return False


ArrayAttributes = Callable[[str, np.ndarray[Any, Any]], Mapping[str, Any] | None]


def plan(
    state: Mapping[str, Any],
    *,
    compression: str | Mapping[str, Any] | None = None,
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    array_attributes: ArrayAttributes | None = None,
) -> Plan:
    """Turn a nested mapping into the arrays and groups of a checkpoint.

    Arrays (numpy arrays and numpy scalars) become zarr arrays; mappings that contain an
    array somewhere become groups; every other value must be JSON and is stored in its
    group's ``attributes.ucp.values``.
    """
    if not isinstance(state, Mapping):
        raise InvalidValueError(f"the state must be a mapping, got {type(state).__name__}")
    result = Plan()

    def visit(mapping: Mapping[str, Any], prefix: str, group_values: dict[str, Any]) -> None:
        node_names = []
        for key, value in mapping.items():
            where = f"{prefix}/{key}" if prefix else str(key)
            node = names.escape(key, where=where) if isinstance(key, str) else None
            if node is None:
                raise InvalidValueError(
                    f"keys must be strings, got {type(key).__name__} {key!r}", path=where,
                    rule="UCP-1.0-R011",
                )
            if not prefix and node.lower().endswith(RESERVED_ROOT_SUFFIX):
                raise InvalidValueError(
                    f"top-level names ending in {RESERVED_ROOT_SUFFIX!r} are reserved",
                    rule="UCP-1.0-R004",
                    path=where,
                )
            reserved_group = not prefix and key in RESERVED_GROUPS
            if reserved_group and not isinstance(value, Mapping):
                raise InvalidValueError(
                    f"{key!r} is a reserved group: give it a mapping, not "
                    f"{type(value).__name__}",
                    rule="UCP-1.0-R004",
                    path=where,
                )
            path = f"{prefix}/{node}" if prefix else node
            if isinstance(value, np.ndarray | np.generic):
                arr = np.asarray(value)
                attrs = dict(array_attributes(path, arr) or {}) if array_attributes else {}
                result.arrays.append(
                    (_array_meta(path, arr, compression, chunk_bytes, shard_bytes, attrs), arr)
                )
                node_names.append(node)
            elif isinstance(value, Mapping) and (reserved_group or _has_array(value)):
                sub_values: dict[str, Any] = {}
                visit(value, path, sub_values)
                ucp = {"values": sub_values} if sub_values else {}
                result.groups.append(GroupMeta(path, {"ucp": ucp} if ucp else {}))
                node_names.append(node)
            else:
                if _looks_like_tensor(value):
                    raise InvalidValueError(
                        f"{type(value).__name__} is not a numpy array; convert tensors first "
                        "(ucpformat.torch does this for torch tensors)",
                        path=where,
                    )
                group_values[key] = jsonvalues.encode(value, where=where)
        names.check_case_collisions(node_names, parent=prefix)

    visit(state, "", result.root_values)
    return result


def _looks_like_tensor(value: Any) -> bool:
    return hasattr(value, "__array__") or hasattr(value, "__dlpack__")


def _array_meta(
    path: str,
    arr: np.ndarray[Any, Any],
    compression: str | Mapping[str, Any] | None,
    chunk_bytes: int,
    shard_bytes: int,
    attributes: Mapping[str, Any],
) -> ArrayMeta:
    dt = dtypes.from_numpy(arr.dtype, tensor=path)
    ucp = attributes.get("ucp", {})
    ch = chunking.choose(
        arr.shape,
        dt.itemsize,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        split_dims=chunking.split_dims_of(ucp if isinstance(ucp, Mapping) else {}),
    )
    return ArrayMeta(
        path=path,
        shape=tuple(int(s) for s in arr.shape),
        dtype=dt,
        chunk_shape=ch.chunk_shape,
        shard_shape=ch.shard_shape,
        compression=Compression.parse(compression, dt),
        fill_value=zero_bits(dt),
        attributes=attributes,
    )


def zero_bits(dt: dtypes.DataType) -> Any:
    """The value whose bits are all zero: the fill value ucpformat writes for every type."""
    return np.frombuffer(bytes(dt.itemsize), dtype=dt.numpy)[0]


# -- save ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote."""

    location: str
    tensors: int
    nbytes: int
    objects: int


ProgressCallback = Callable[[int], None]


def save(
    path: str | os.PathLike[str] | Store,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    overwrite: bool = False,
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    workers: int | None = None,
    durable: bool = True,
    progress: bool | ProgressCallback = False,
    array_attributes: ArrayAttributes | None = None,
    created: str | None = None,
    producer: Mapping[str, Any] | None = None,
) -> SaveResult:
    """Write ``state`` (a nested mapping of numpy arrays and JSON values) as a checkpoint.

    The top-level keys ``model``, ``optimizer`` and ``training`` have the meaning the spec
    gives them; any other key is stored as an extension group. ``metadata`` is free-form
    JSON kept in the root (``attributes.ucp.metadata``). A failed save leaves nothing
    that opens as a checkpoint and never touches a committed one unless ``overwrite``.

    ``created`` (an RFC 3339 date-time, default: now) and ``producer`` (an object with
    ``name`` and ``version``, default: this library) are stored in the root as given,
    so that a save of the same state can be byte-for-byte reproducible (the conformance
    cases are generated this way).
    """
    if hash_algorithm not in (None, *HASH_ALGORITHMS):
        raise InvalidValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS} or None")
    the_plan = plan(
        state,
        compression=compression,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        array_attributes=array_attributes,
    )
    store = open_store(path, durable=durable)
    prepare_destination(store, overwrite=overwrite)
    objects = write_arrays(
        store, the_plan.arrays, hash_algorithm=hash_algorithm, workers=workers, progress=progress
    )
    root_ucp: dict[str, Any] = {
        "producer": jsonvalues.encode(dict(producer), where="producer")
        if producer is not None
        else default_producer(),
        "created": _now() if created is None else _check_created(created),
    }
    if metadata is not None:
        root_ucp["metadata"] = jsonvalues.encode(dict(metadata), where="metadata")
    if the_plan.root_values:
        root_ucp["values"] = the_plan.root_values
    commit(
        store,
        arrays=[m for m, _ in the_plan.arrays],
        groups=the_plan.groups,
        objects=objects,
        root_ucp=root_ucp,
        hash_algorithm=hash_algorithm,
    )
    return SaveResult(store.location, len(the_plan.arrays), the_plan.nbytes, len(objects))


def default_workers() -> int:
    return max(2, min(16, 2 * (os.cpu_count() or 1)))


def write_arrays(
    store: Store,
    arrays: Sequence[tuple[ArrayMeta, np.ndarray[Any, Any]]],
    *,
    hash_algorithm: str | None,
    workers: int | None = None,
    progress: bool | ProgressCallback = False,
) -> list[StoredObject]:
    """Write every stored object of ``arrays`` with a pool of threads."""
    tasks = [
        (meta, coords, data)
        for meta, data in arrays
        for coords in object_coords(meta)
    ]
    total = sum(meta.nbytes for meta, _ in arrays)
    from ucpformat.progress import byte_progress

    with byte_progress(progress, total, "saving") as advance, ThreadPoolExecutor(
        workers or default_workers()
    ) as pool:

        def run(task: tuple[ArrayMeta, tuple[int, ...], np.ndarray[Any, Any]]) -> StoredObject:
            meta, coords, data = task
            region = data[object_region(meta, coords)]
            le = region.astype(meta.dtype.numpy, copy=False)
            try:
                obj = write_object(store, meta, coords, le, hash_algorithm=hash_algorithm)
            except UCPError:
                raise
            except OSError as exc:
                raise WriteError(f"writing {meta.object_key(coords)} failed: {exc}",
                                 path=store.location) from exc
            advance(region.nbytes)
            return obj

        return list(pool.map(run, tasks))

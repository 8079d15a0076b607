"""Writing checkpoints: data first, metadata next, the root last (the commit).

The commit protocol (spec section "Commit"): a writer marks the directory as being
written, writes every stored object (shards or chunks) and every non-root ``zarr.json``,
then the manifest, and finally the root ``zarr.json`` with the consolidated metadata.
Until that last write succeeds, what is on disk is not a checkpoint and every reader
refuses it. A committed checkpoint is never modified; ``overwrite=True`` first
un-commits it (deletes the root) before anything else is touched.

This module holds the API (save, adopt, StreamingWriter, the commit); how a stored
object's bytes are encoded is the array engine's (:mod:`ucpformat.engine.write`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat import dtypes, jsonvalues, names
from ucpformat import feed as feeds
from ucpformat._version import __version__
from ucpformat.engine import chunking
from ucpformat.engine.compression import Compression
from ucpformat.engine.grid import object_coords, object_region, stored_object_coords
from ucpformat.engine.write import StoredObject, write_object
from ucpformat.errors import (
    CheckpointExistsError,
    InvalidValueError,
    MissingChunkError,
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
    build_root_ucp,
    dumps,
    encode_root,
    loads,
    parse_array,
    parse_group,
    utc_now,
)
from ucpformat.storage import Store, open_store

HASH_ALGORITHMS = ("sha256",)


# -- the commit protocol -----------------------------------------------------------------


def prepare_destination(store: Store, *, overwrite: bool) -> None:
    """Make ``store`` ready for a new checkpoint, or refuse (never damaging a committed one)."""
    clear_destination(store, committed=mark_destination(store, overwrite=overwrite))


def mark_destination(store: Store, *, overwrite: bool) -> bool:
    """The first half of :func:`prepare_destination`: refuse as it does, else write the
    in-progress marker (UCP-1.0-R056), which leaves a committed checkpoint committed (UCP-1.0-R053).
    True if a committed checkpoint is here, to be replaced."""
    committed = store.exists(ZARR_JSON)
    in_progress = store.exists(IN_PROGRESS_KEY)
    if committed and not overwrite:
        raise CheckpointExistsError(
            "a committed checkpoint is already here; pass overwrite=True to replace it",
            rule="UCP-1.0-R053",
            path=store.location,
        )
    if not in_progress and not store.is_empty() and not (committed and _holds_checkpoint(store)):
        # overwrite=True replaces a checkpoint; it never deletes a directory of other files.
        raise CheckpointExistsError(
            "the destination holds files that are not a UCP checkpoint; refusing to mix them "
            "with a checkpoint or to delete them (even with overwrite=True)",
            rule="UCP-1.0-R053",
            path=store.location,
        )
    # Mark first, then un-commit, then clear: a crash at any point leaves either the old
    # committed checkpoint intact or something every reader refuses. The marker is not
    # written atomically: a crash while writing it leaves a partial marker, which still
    # marks the location as ours to retry into (an atomic write would leave a temporary
    # file that a retry must refuse as foreign).
    store.put(IN_PROGRESS_KEY, [_in_progress_marker()])
    return committed


def clear_destination(store: Store, *, committed: bool) -> None:
    """The second half of :func:`prepare_destination`, after :func:`mark_destination`:
    un-commit the checkpoint being replaced (``committed``), then remove all but the
    marker."""
    if committed:
        store.delete(ZARR_JSON)
    store.delete_keys([key for key in store.list() if key != IN_PROGRESS_KEY])
    store.flush()


def unmark_destination(store: Store) -> None:
    """Withdraw the marker of a save abandoned between :func:`mark_destination` and
    :func:`clear_destination`: a checkpoint it was to replace is then as it was."""
    store.delete(IN_PROGRESS_KEY)


def _in_progress_marker() -> bytes:
    return dumps(
        {
            "writer": f"ucpformat {__version__}",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": utc_now(),
        }
    )


def _holds_checkpoint(store: Store) -> bool:
    """True if the root zarr.json is a UCP root (a JSON object with ``attributes.ucp``)."""
    raw = store.get(ZARR_JSON)
    try:
        doc = json.loads(raw or b"")
    except ValueError:
        return False
    attrs = doc.get("attributes") if isinstance(doc, Mapping) else None
    return isinstance(attrs, Mapping) and isinstance(attrs.get("ucp"), Mapping)


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
    nodes: list[ArrayMeta | GroupMeta] = [*groups, *arrays]
    bodies: list[tuple[str, bytes]] = []
    for node in sorted(nodes, key=lambda n: n.path):
        doc = node.to_zarr_json()
        body = dumps(doc)
        bodies.append((f"{node.path}/{ZARR_JSON}", body))
        files[f"{node.path}/{ZARR_JSON}"] = _describe(body, hash_algorithm)
        consolidated[node.path] = doc
    # Creating files is system calls (the GIL is released): a few threads overlap them.
    with ThreadPoolExecutor(min(8, max(1, len(bodies)))) as pool:
        for _ in pool.map(lambda kb: store.put(kb[0], [kb[1]]), bodies):
            pass
    ucp = dict(root_ucp)
    ucp["version"] = FORMAT_VERSION
    attributes = dict(root_attributes or {})
    attributes["ucp"] = ucp
    manifest = {
        "hash_algorithm": hash_algorithm,
        # A copy of the root's attributes (but the manifest reference): the manifest's
        # digest in the root seals it, so damage to the root's own values is detectable
        # (UCP-1.0-R045); everything else in the root is sealed by the node documents.
        "root_attributes": attributes,
        "files": dict(sorted(files.items())),
    }
    manifest_body = dumps(manifest)
    store.put(MANIFEST_KEY, [manifest_body])
    store.flush()  # every byte before the commit is durable before the commit is written
    ucp = {**ucp, "manifest": {"path": MANIFEST_KEY, **_describe(manifest_body, "sha256")}}
    attributes = {**attributes, "ucp": ucp}
    root = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": attributes,
        "consolidated_metadata": {
            "kind": "inline", "must_understand": False, "metadata": consolidated
        },
    }
    store.put(ZARR_JSON, [encode_root(root)], atomic=True)  # sealed by its digest (UCP-1.0-R058)
    store.delete(IN_PROGRESS_KEY)
    return root


def _describe(body: bytes, hash_algorithm: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"nbytes": len(body)}
    if hash_algorithm == "sha256":
        doc["sha256"] = hashlib.sha256(body).hexdigest()
    return doc


# -- planning a save from a nested mapping ------------------------------------------------


@dataclass
class Plan:
    """What a save writes: array metadata with its data, groups, root values.

    ``root_values`` are the JSON values of the root as given (checked); the values of
    other groups are in their ``GroupMeta``, encoded.
    """

    arrays: list[tuple[ArrayMeta, ArrayValue]] = field(default_factory=list)
    groups: list[GroupMeta] = field(default_factory=list)
    root_values: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m, _ in self.arrays)


class Group(dict[str, Any]):
    """A mapping that ``save`` always stores as a group, even when it holds no array.

    A plain mapping becomes a group only if it holds an array somewhere; otherwise it is
    a JSON value of its parent. Wrap it in ``Group`` where the layout needs a group (for
    example ``optimizer/state/<parameter>`` whose state has no tensor). The top-level
    names ``model``, ``optimizer`` and ``training`` are always groups.

    ``ucp`` holds further members of the group's ``attributes.ucp`` (``aliases`` of tied
    tensors, UCP-1.0-R108); its ``values`` are the mapping's JSON entries.
    """

    def __init__(self, *args: Any, ucp: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if ucp is not None and "values" in ucp:
            raise InvalidValueError("a Group's JSON values are its entries, not ucp['values']")
        self.ucp: dict[str, Any] = dict(ucp or {})


def _has_array(value: Any) -> bool:
    """True if ``value`` must be stored as a group (it holds an array or a Group)."""
    if isinstance(value, np.ndarray | np.generic | Group | feeds.Deferred):
        return True
    if isinstance(value, Mapping):
        return any(_has_array(v) for v in value.values())
    return False


#: An array's values, or a placeholder whose values a :class:`ucpformat.feed.Feed` gives.
ArrayValue = np.ndarray[Any, Any] | feeds.Deferred
ArrayAttributes = Callable[[str, ArrayValue], Mapping[str, Any] | None]


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
    array (or a :class:`Group`) somewhere become groups, as do the reserved top-level
    mappings ``model``, ``optimizer`` and ``training``; every other value must be JSON and
    is stored in its group's ``attributes.ucp.values``.
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
            if isinstance(value, np.ndarray | np.generic | feeds.Deferred):
                arr = value if isinstance(value, feeds.Deferred) else np.asarray(value)
                attrs = dict(array_attributes(path, arr) or {}) if array_attributes else {}
                result.arrays.append(
                    (_array_meta(path, arr, compression, chunk_bytes, shard_bytes, attrs), arr)
                )
                node_names.append(node)
            elif isinstance(value, Mapping) and (reserved_group or _has_array(value)):
                sub_values: dict[str, Any] = {}
                visit(value, path, sub_values)
                ucp = (
                    jsonvalues.encode(value.ucp, where=f"{where}.ucp")
                    if isinstance(value, Group) else {}
                )
                if sub_values:
                    ucp["values"] = sub_values
                result.groups.append(GroupMeta(path, {"ucp": ucp} if ucp else {}))
                node_names.append(node)
            else:
                if _looks_like_tensor(value):
                    raise InvalidValueError(
                        f"{type(value).__name__} is not a numpy array; convert tensors first "
                        "(ucpformat.torch does this for torch tensors)",
                        path=where,
                    )
                if key == jsonvalues.FLOAT_TAG:
                    raise InvalidValueError(
                        f"the key {jsonvalues.FLOAT_TAG!r} is reserved for non-finite floats",
                        rule="UCP-1.0-R070",
                        path=where,
                    )
                encoded = jsonvalues.encode(value, where=where)
                # the root's values are stored as given: build_root_ucp encodes them (a bad
                # one is refused here all the same, named by its key)
                group_values[key] = encoded if prefix else value
        names.check_case_collisions(node_names, parent=prefix)

    visit(state, "", result.root_values)
    return result


def _looks_like_tensor(value: Any) -> bool:
    return hasattr(value, "__array__") or hasattr(value, "__dlpack__")


def _array_meta(
    path: str,
    arr: ArrayValue,
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
    meta = ArrayMeta(
        path=path,
        shape=tuple(int(s) for s in arr.shape),
        dtype=dt,
        chunk_shape=ch.chunk_shape,
        shard_shape=ch.shard_shape,
        compression=Compression.parse(compression, dt),
        fill_value=zero_bits(dt),
        attributes=attributes,
    )
    # Write nothing a reader would refuse (a bad attribute, a chunking bug): check first.
    parse_array(path, json.loads(dumps(meta.to_zarr_json(), compact=True)))
    return meta


def zero_bits(dt: dtypes.DataType) -> Any:
    """The value whose bits are all zero: the fill value ucpformat writes for every type
    (UCP-1.0-R033)."""
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
    feed: feeds.Feed | None = None,
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

    ``feed`` gives the values of the :class:`ucpformat.feed.Deferred` arrays of
    ``state``, which are written in the order given, each as soon as the feed has it
    (:mod:`ucpformat.torch.staging` copies tensors from a GPU this way); the feed is
    started when the writes start and stopped when they end (a save that fails before
    never starts it).
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
    ucp = build_root_ucp(metadata=metadata, values=the_plan.root_values, producer=producer,
                         created=created)
    store = open_store(path, durable=durable)
    with _storage_errors(store):
        prepare_destination(store, overwrite=overwrite)
        objects = write_arrays(
            store, the_plan.arrays, hash_algorithm=hash_algorithm, workers=workers,
            progress=progress, feed=feed,
        )
        commit(
            store,
            arrays=[m for m, _ in the_plan.arrays],
            groups=the_plan.groups,
            objects=objects,
            root_ucp=ucp,
            hash_algorithm=hash_algorithm,
        )
    return SaveResult(store.location, len(the_plan.arrays), the_plan.nbytes, len(objects))


@contextlib.contextmanager
def _storage_errors(store: Store) -> Iterator[None]:
    """Report a failure of the storage (OSError) as a WriteError naming the checkpoint."""
    try:
        yield
    except UCPError:
        raise
    except OSError as exc:
        raise WriteError(
            f"the save failed and nothing was committed: {exc}", path=store.location
        ) from exc


def default_workers() -> int:
    return max(2, min(16, 2 * (os.cpu_count() or 1)))


def write_arrays(
    store: Store,
    arrays: Sequence[tuple[ArrayMeta, ArrayValue]],
    *,
    hash_algorithm: str | None,
    workers: int | None = None,
    progress: bool | ProgressCallback = False,
    feed: feeds.Feed | None = None,
) -> list[StoredObject]:
    """Write every stored object of ``arrays`` with a pool of threads.

    The values of :class:`ucpformat.feed.Deferred` arrays come from ``feed``, asked for
    in the order of ``arrays`` and released once their last stored object is written;
    the feed is stopped at the end, whatever happens.
    """
    try:
        deferred = [data.key for _, data in arrays if isinstance(data, feeds.Deferred)]
        if deferred and feed is None:
            raise InvalidValueError("placeholder arrays (ucpformat.feed.Deferred) need a feed "
                                    "that gives their values", path=deferred[0])
        tasks = [
            (meta, coords, data)
            for meta, data in arrays
            for coords in object_coords(meta)
        ]
        remaining = {meta.path: itertools.count(1) for meta, _ in arrays}  # next() is atomic
        counts = {meta.path: meta.object_count for meta, _ in arrays}
        total = sum(meta.nbytes for meta, _ in arrays)
        from ucpformat.progress import byte_progress

        if feed is not None:
            feed.schedule(deferred)
        with byte_progress(progress, total, "saving") as advance, ThreadPoolExecutor(
            workers or default_workers()
        ) as pool:

            def run(task: tuple[ArrayMeta, tuple[int, ...], ArrayValue]) -> StoredObject:
                meta, coords, value = task
                data = feed.get(value.key) if isinstance(value, feeds.Deferred) and feed \
                    else value
                assert isinstance(data, np.ndarray)
                region = data[object_region(meta, coords)]
                le = region.astype(meta.dtype.numpy, copy=False)
                try:
                    obj = write_object(store, meta, coords, le, hash_algorithm=hash_algorithm)
                except UCPError:
                    raise
                except OSError as exc:
                    raise WriteError(f"writing {meta.object_key(coords)} failed: {exc}",
                                     path=store.location) from exc
                if isinstance(value, feeds.Deferred) and feed is not None and \
                        next(remaining[meta.path]) == counts[meta.path]:
                    feed.release(value.key)
                advance(region.nbytes)
                return obj

            try:
                return list(pool.map(run, tasks))
            except BaseException:
                if feed is not None:
                    feed.stop()  # threads still waiting for a value raise at once
                raise
    finally:
        if feed is not None:
            feed.stop()


# -- adopting arrays written by another writer ----------------------------------------------


def adopt(
    path: str | os.PathLike[str] | Store,
    *,
    attributes: Mapping[str, Mapping[str, Any]] | None = None,
    values: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    hash_algorithm: str | None = "sha256",
    durable: bool = True,
) -> SaveResult:
    """Commit, as a checkpoint, the zarr v3 arrays another writer put under ``path``.

    For producers that write the arrays themselves (tensorstore, zarr-python, a C++ or
    JAX exporter, ranks that each write their own shards) and need only the commit.
    Every ``<node>/zarr.json`` under ``path`` is read and checked against format 1.0
    (closed data types and codecs, crc32c, canonical escaped names); every stored object
    of every non-sparse array must exist (a missing one is a MissingChunkError, never
    fill values); groups the writer left implicit are added; then node metadata, the
    manifest (with SHA-256s when ``hash_algorithm`` is set) and, last, the root are
    written by :func:`commit`, exactly as :func:`save` commits.

    ``attributes`` maps node paths (``model/fc.weight``) to attributes merged into that
    node's ``attributes`` (e.g. ``{"ucp": {"role": "parameter"}}``). ``values`` are the
    root's JSON values (what :func:`save` stores for non-array entries of the state, e.g.
    ``{"training": {"step": 10}}``); ``metadata`` is free-form JSON, as for :func:`save`.

    Node ``zarr.json`` files are rewritten in ucpformat's canonical spelling (same
    meaning), so that each equals its entry in the consolidated metadata. A root
    ``zarr.json`` that is a plain zarr group is replaced (its attributes are kept). Refuses
    a directory that already holds a committed checkpoint (UCP-1.0-R053) and files that
    belong to no node (the manifest could not list them, UCP-1.0-R044). The stored
    objects are read once, to size and hash them; they are never modified.
    """
    if hash_algorithm not in (None, *HASH_ALGORITHMS):
        raise InvalidValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS} or None")
    ucp = build_root_ucp(metadata=metadata, values=values)
    extra_attributes = dict(attributes or {})
    store = open_store(path, durable=durable)
    with _storage_errors(store):
        root_attributes: dict[str, Any] = {}
        if store.exists(ZARR_JSON):
            if _holds_checkpoint(store):
                raise CheckpointExistsError(
                    "a committed checkpoint is already here; adopt commits arrays only once",
                    rule="UCP-1.0-R053",
                    path=store.location,
                )
            old_root = parse_group("", loads(store.get(ZARR_JSON) or b"", what=ZARR_JSON),
                                   root=True)
            root_attributes = dict(old_root.attributes)
        keys = sorted(store.list())
        # every node's zarr.json, checked strictly
        arrays: dict[str, ArrayMeta] = {}
        groups: dict[str, GroupMeta] = {}
        for key in keys:
            if not key.endswith(f"/{ZARR_JSON}"):
                continue
            node_path = key[: -len(ZARR_JSON) - 1]
            names.check_path(node_path, where=key)
            doc = loads(store.get(key) or b"", what=key)
            extra = extra_attributes.pop(node_path, None)
            if extra is not None and isinstance(doc, Mapping):
                old = doc.get("attributes", {})
                doc = {**doc, "attributes": {**(old if isinstance(old, Mapping) else {}), **extra}}
            if isinstance(doc, Mapping) and doc.get("node_type") == "array":
                arrays[node_path] = parse_array(node_path, doc)
            else:
                groups[node_path] = parse_group(node_path, doc)
        if extra_attributes:
            raise InvalidValueError(
                f"attributes given for nodes that do not exist: {sorted(extra_attributes)}",
                path=store.location,
            )
        if not arrays:
            raise InvalidValueError("no zarr arrays to adopt", path=store.location)
        # implicit groups, the tree's shape, names
        for node_path in [*arrays, *groups]:
            parent = node_path.rpartition("/")[0]
            while parent:
                if parent in arrays:
                    raise InvalidValueError(
                        f"{node_path!r} lies inside the array {parent!r}", rule="UCP-1.0-R005",
                        path=store.location,
                    )
                groups.setdefault(parent, GroupMeta(parent))
                parent = parent.rpartition("/")[0]
        children: dict[str, list[str]] = {}
        for node_path in [*arrays, *groups]:
            parent, _, leaf = node_path.rpartition("/")
            children.setdefault(parent, []).append(leaf)
            if not parent and leaf.endswith(RESERVED_ROOT_SUFFIX):
                raise InvalidValueError(
                    f"top-level names ending in {RESERVED_ROOT_SUFFIX!r} are reserved",
                    rule="UCP-1.0-R004",
                    path=node_path,
                )
        for parent, kids in children.items():
            names.check_case_collisions(kids, parent=parent)
        # every stored object: present, sized, hashed
        owned = {ZARR_JSON, IN_PROGRESS_KEY} | {f"{p}/{ZARR_JSON}" for p in [*arrays, *groups]}
        objects: list[StoredObject] = []
        for meta in arrays.values():
            present = stored_object_coords(meta, keys)
            if not meta.sparse and len(present) != meta.object_count:
                have = set(present)
                # stops at the first gap: at most len(present) + 1 steps, whatever the shape
                first = next(c for c in object_coords(meta) if c not in have)
                raise MissingChunkError(
                    f"{meta.object_count - len(present)} of its {meta.object_count} stored "
                    f"objects are missing (the first is {meta.object_key(first)}); a "
                    "non-sparse array needs every one (mark it attributes.ucp.sparse to have "
                    "absent ones read as fill values)",
                    rule="UCP-1.0-R030",
                    tensor=meta.path,
                )
            for coords in present:
                key = meta.object_key(coords)
                data = store.get(key)
                if data is None:  # removed while we looked
                    raise MissingChunkError(f"stored object {key} vanished", rule="UCP-1.0-R030",
                                            tensor=meta.path)
                digest = hashlib.sha256(data).hexdigest() if hash_algorithm == "sha256" else None
                objects.append(StoredObject(key, len(data), digest))
                owned.add(key)
        foreign = [k for k in keys if k not in owned]
        if foreign:
            raise WriteError(
                f"{len(foreign)} file(s) belong to no node of the checkpoint (first: "
                f"{foreign[0]!r}); remove them or write them as arrays",
                rule="UCP-1.0-R044",
                path=store.location,
            )
        store.put(IN_PROGRESS_KEY, [_in_progress_marker()], atomic=True)
        ordered = sorted(arrays.values(), key=lambda m: m.path)
        commit(
            store,
            arrays=ordered,
            groups=sorted(groups.values(), key=lambda g: g.path),
            objects=objects,
            root_ucp=ucp,
            root_attributes=root_attributes,
            hash_algorithm=hash_algorithm,
        )
    return SaveResult(store.location, len(ordered), sum(m.nbytes for m in ordered), len(objects))

# -- streaming: declare every array first, then give each tensor's data ------------------


class StreamingWriter:
    """Write a checkpoint tensor by tensor, holding only what the caller hands over.

    Every array is declared up front (path, shape, data type, attributes), so the
    metadata is known before any data exists; then each tensor's data is given with
    :meth:`write` (the whole tensor) or :meth:`write_object` (one stored object, for
    tensors too large to hold at once), in any order and from any number of threads.
    :meth:`commit` refuses unless every stored object of every declared array was
    written exactly once; a writer that is never committed leaves a directory every
    reader refuses (the in-progress marker), as a failed :func:`save` does::

        with StreamingWriter("ckpt") as w:
            w.declare("model/fc.weight", (4096, 4096), "bfloat16")
            w.group("optimizer", values={"type": "torch.optim.AdamW"})
            w.write("model/fc.weight", array)
            w.commit(root_values={"step": 10})
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Store,
        *,
        overwrite: bool = False,
        compression: str | Mapping[str, Any] | None = None,
        hash_algorithm: str | None = "sha256",
        chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
        shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
        durable: bool = True,
    ) -> None:
        if hash_algorithm not in (None, *HASH_ALGORITHMS):
            raise InvalidValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS} or None")
        self.store = open_store(path, durable=durable)
        self.compression = compression
        self.hash_algorithm = hash_algorithm
        self.chunk_bytes = chunk_bytes
        self.shard_bytes = shard_bytes
        self._arrays: dict[str, ArrayMeta] = {}
        self._pending: dict[str, set[tuple[int, ...]]] = {}
        self._groups: dict[str, dict[str, Any]] = {}
        self._objects: list[StoredObject] = []
        self._lock = threading.Lock()
        self._committed = False
        prepare_destination(self.store, overwrite=overwrite)

    @property
    def location(self) -> str:
        return self.store.location

    @property
    def arrays(self) -> dict[str, ArrayMeta]:
        """The declared arrays, by node path."""
        return dict(self._arrays)

    # -- declaring -------------------------------------------------------------------

    def declare(
        self,
        path: str,
        shape: Sequence[int],
        dtype: str | dtypes.DataType | np.dtype[Any],
        *,
        attributes: Mapping[str, Any] | None = None,
    ) -> ArrayMeta:
        """Declare the array at node ``path`` (escaped names joined by ``/``)."""
        if self._committed:
            raise WriteError("this checkpoint is already committed", path=self.location)
        parts = names.split_path(path, where=path)
        if len(parts) < 1:
            raise InvalidValueError("an array needs a name", path=path)
        if path.split("/")[0].endswith(RESERVED_ROOT_SUFFIX):
            raise InvalidValueError(
                f"top-level names ending in {RESERVED_ROOT_SUFFIX!r} are reserved",
                rule="UCP-1.0-R004", path=path,
            )
        if isinstance(dtype, dtypes.DataType):
            dt = dtype
        elif isinstance(dtype, str):
            dt = dtypes.by_name(dtype, tensor=path)
        else:
            dt = dtypes.from_numpy(np.dtype(dtype), tensor=path)
        dims = tuple(int(s) for s in shape)
        if any(s < 0 for s in dims):
            raise InvalidValueError(f"shape {list(dims)} has a negative size", path=path)
        encoded_attrs = jsonvalues.encode(dict(attributes or {}), where=f"{path} attributes")
        ucp = encoded_attrs.get("ucp", {})
        ch = chunking.choose(
            dims, dt.itemsize, chunk_bytes=self.chunk_bytes, shard_bytes=self.shard_bytes,
            split_dims=chunking.split_dims_of(ucp if isinstance(ucp, Mapping) else {}),
        )
        meta = ArrayMeta(
            path=path,
            shape=dims,
            dtype=dt,
            chunk_shape=ch.chunk_shape,
            shard_shape=ch.shard_shape,
            compression=Compression.parse(self.compression, dt),
            fill_value=zero_bits(dt),
            attributes=encoded_attrs,
        )
        # Write nothing a reader would refuse (a bad attribute, a chunking bug): check first.
        parse_array(path, json.loads(dumps(meta.to_zarr_json())))
        with self._lock:
            if path in self._arrays:
                raise InvalidValueError("this array is already declared", path=path)
            if path in self._groups:
                raise InvalidValueError("a group of this name is already declared", path=path)
            self._arrays[path] = meta
            self._pending[path] = set(object_coords(meta))
        return meta

    def group(
        self,
        path: str,
        *,
        values: Mapping[str, Any] | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """Declare the group at ``path`` with JSON ``values`` and other ``attributes.ucp`` members.

        Parent groups of declared arrays and groups exist without being declared; calling
        this again for the same group merges the members.
        """
        names.check_path(path, where=path)
        if not path:
            raise InvalidValueError("the root's values are given to commit()", path=path)
        ucp: dict[str, Any] = {}
        if attributes:
            ucp.update(jsonvalues.encode(dict(attributes), where=f"{path} attributes"))
        if values:
            ucp["values"] = jsonvalues.encode(dict(values), where=f"{path} values")
        with self._lock:
            if path in self._arrays:
                raise InvalidValueError("an array of this name is already declared", path=path)
            target = self._groups.setdefault(path, {})
            if "values" in ucp and "values" in target:
                merged = dict(target["values"])
                merged.update(ucp.pop("values"))
                target["values"] = merged
            target.update(ucp)

    # -- writing ---------------------------------------------------------------------

    def _meta(self, path: str) -> ArrayMeta:
        meta = self._arrays.get(path)
        if meta is None:
            raise InvalidValueError("no array of this name was declared", path=path)
        return meta

    def _checked(self, meta: ArrayMeta, data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        arr = np.asarray(data)
        got = dtypes.from_numpy(arr.dtype, tensor=meta.path)
        if got is not meta.dtype:
            raise InvalidValueError(
                f"data of type {got.name} given for an array declared {meta.dtype.name} "
                "(convert explicitly; writers never cast)",
                path=meta.path,
            )
        return arr.astype(meta.dtype.numpy, copy=False)

    def object_regions(self, path: str) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
        """(grid coordinates, region) of every stored object of a declared array."""
        meta = self._meta(path)
        return [(c, object_region(meta, c)) for c in object_coords(meta)]

    def write_object(self, path: str, coords: Sequence[int], data: np.ndarray[Any, Any]) -> int:
        """Write one stored object; ``data`` is that object's region of the tensor."""
        meta = self._meta(path)
        key = tuple(int(c) for c in coords)
        with self._lock:
            pending = self._pending[path]
            if key not in pending:
                raise WriteError(
                    f"stored object {list(key)} was already written or is outside the grid "
                    "(one writer per stored object)",
                    rule="UCP-1.0-R130", tensor=path,
                )
            pending.discard(key)
        try:
            obj = write_object(self.store, meta, key, self._checked(meta, data),
                               hash_algorithm=self.hash_algorithm)
        except BaseException:
            with self._lock:
                self._pending[path].add(key)
            raise
        with self._lock:
            self._objects.append(obj)
        return obj.nbytes

    def write(self, path: str, data: np.ndarray[Any, Any]) -> int:
        """Write a whole declared tensor; returns the bytes stored."""
        meta = self._meta(path)
        arr = self._checked(meta, data)
        if tuple(arr.shape) != meta.shape:
            raise InvalidValueError(
                f"data of shape {list(arr.shape)} given for an array declared "
                f"{list(meta.shape)}",
                path=path,
            )
        total = 0
        for coords in object_coords(meta):
            try:
                total += self.write_object(path, coords, arr[object_region(meta, coords)])
            except OSError as exc:
                raise WriteError(f"writing {meta.object_key(coords)} failed: {exc}",
                                 path=self.location) from exc
        return total

    def missing(self) -> dict[str, int]:
        """Declared arrays with stored objects not yet written (path -> count)."""
        with self._lock:
            return {p: len(s) for p, s in self._pending.items() if s}

    # -- commit ------------------------------------------------------------------------

    def commit(
        self,
        *,
        metadata: Mapping[str, Any] | None = None,
        root_values: Mapping[str, Any] | None = None,
        root_attributes: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """Write the metadata and, last, the root: refused while any object is missing."""
        if self._committed:
            raise WriteError("this checkpoint is already committed", path=self.location)
        missing = self.missing()
        if missing:
            listed = ", ".join(f"{p} ({n})" for p, n in sorted(missing.items())[:5])
            raise WriteError(
                f"{len(missing)} declared arrays are not completely written: {listed}; "
                "nothing was committed",
                rule="UCP-1.0-R031", path=self.location,
            )
        groups: dict[str, GroupMeta] = {}
        for path in [*self._arrays, *self._groups]:
            parts = path.split("/")
            for i in range(1, len(parts)):
                gp = "/".join(parts[:i])
                if gp in self._arrays:
                    raise InvalidValueError(f"{gp!r} is an array and the parent of {path!r}",
                                            path=path)
                groups.setdefault(gp, GroupMeta(gp, {}))
        for gp, ucp in self._groups.items():
            groups[gp] = GroupMeta(gp, {"ucp": dict(ucp)} if ucp else {})
        children: dict[str, list[str]] = {}
        for path in [*self._arrays, *groups]:
            parent, _, leaf = path.rpartition("/")
            children.setdefault(parent, []).append(leaf)
        for parent, leaves in children.items():
            names.check_case_collisions(leaves, parent=parent)
        commit(
            self.store,
            arrays=list(self._arrays.values()),
            groups=list(groups.values()),
            objects=self._objects,
            root_ucp=build_root_ucp(metadata=metadata, values=root_values),
            root_attributes=root_attributes,
            hash_algorithm=self.hash_algorithm,
        )
        self._committed = True
        return SaveResult(
            self.store.location,
            len(self._arrays),
            sum(m.nbytes for m in self._arrays.values()),
            len(self._objects),
        )

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # Not committed: the in-progress marker stays, and every reader refuses the directory.
        return None

"""Commit, as a checkpoint, the zarr v3 arrays another writer put in a location."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Mapping
from typing import Any

from ucpformat.checkpoint.commit import (
    WriteClaim,
    commit_checkpoint,
    hold_location,
    holds_checkpoint,
    release,
    storage_errors,
)
from ucpformat.checkpoint.metadata import (
    IN_PROGRESS_KEY,
    RESERVED_ROOT_SUFFIX,
    ZARR_JSON,
    ArrayMeta,
    GroupMeta,
    build_root_ucp,
    loads,
    parse_array,
    parse_group,
)
from ucpformat.checkpoint.options import HASH_ALGORITHMS
from ucpformat.checkpoint.writer import SaveResult
from ucpformat.engine.grid import object_coords, stored_object_coords
from ucpformat.engine.write import StoredObject
from ucpformat.errors import (
    CheckpointExistsError,
    InvalidValueError,
    MissingChunkError,
    WriteError,
)
from ucpformat.format import names
from ucpformat.store import Store, open_store


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
    with storage_errors(store):
        root_attributes: dict[str, Any] = {}
        if store.exists(ZARR_JSON):
            if holds_checkpoint(store):
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
        claim = WriteClaim(token := uuid.uuid4().hex, hold_location(store, token, take_over=True))
        ordered = sorted(arrays.values(), key=lambda m: m.path)
        try:
            commit_checkpoint(
                store,
                arrays=ordered,
                groups=sorted(groups.values(), key=lambda g: g.path),
                objects=objects,
                root_ucp=ucp,
                root_attributes=root_attributes,
                hash_algorithm=hash_algorithm,
                claim=claim,
                replace=True,
            )
        finally:  # adopt removes nothing: the arrays are another writer's
            release(store, claim)
    return SaveResult(store.location, len(ordered), sum(m.nbytes for m in ordered), len(objects))


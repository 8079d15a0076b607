"""Generate the conformance cases and writer scenarios, deterministically.

Run from the repository root::

    python -m conformance.generate            # rewrite conformance/cases and scenarios
    python -m conformance.generate --out DIR  # write them under DIR instead
    python -m conformance.generate --check    # regenerate in a temporary folder and compare

Every run writes the same bytes: fixed contents (the splitmix64 generator of the spec),
a fixed ``created`` time and producer, explicit chunk shapes (never the library's
chunking heuristics), sorted JSON. Which parts of a case were written by which software
is recorded in its ``expected.json`` (``writer``):

* ``ucpformat``: the reference library's writer primitives (``ArrayMeta``,
  ``write_object``, ``commit``), called here with explicit chunkings;
* ``tensorstore`` / ``zarr-python``: those libraries wrote every array (chunks, shards
  and their ``zarr.json``); :func:`commit_foreign` (json and hashlib only, no ucpformat)
  wrote the groups, the manifest and the root;
* invalid cases are valid checkpoints damaged on purpose by :class:`Damage`, which keeps
  every other part consistent (manifest sizes and digests, the root's manifest digest,
  the consolidated metadata), so that each case breaks what it says and nothing else.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat.checkpoint.commit import commit_checkpoint as commit
from ucpformat.checkpoint.metadata import ArrayMeta, GroupMeta, build_root_ucp
from ucpformat.conformance import contents
from ucpformat.conformance.layouts import Target, local_from_array, source_maps
from ucpformat.engine.checksum import crc_bytes
from ucpformat.engine.codecs import ChunkCodec
from ucpformat.engine.compression import Compression
from ucpformat.engine.grid import object_coords, object_region
from ucpformat.engine.shard_index import pack_shard
from ucpformat.engine.write import StoredObject, encode_object, write_object
from ucpformat.errors import LayoutError
from ucpformat.format import dtypes, names
from ucpformat.layout.boxes import as_slices
from ucpformat.layout.semantics import TensorLayout
from ucpformat.store import LocalStore

HERE = Path(__file__).resolve().parent
SCHEMA_ID = "https://ucpformat.org/schemas/1.0/conformance-expected.schema.json"
SCENARIO_SCHEMA_ID = "https://ucpformat.org/schemas/1.0/conformance-scenario.schema.json"
CREATED = "2026-01-01T00:00:00Z"
PRODUCER = {"name": "ucpformat-conformance-generator", "version": "1.0"}
REFERENCE_WRITER = "ucpformat (reference writer primitives, explicit chunkings)"


def seed_of(index: int) -> int:
    """Seeds far apart, so that no two tensors share part of their content stream."""
    return (index + 1) << 32


def write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False, sort_keys=False) + "\n",
                    encoding="utf-8")


# -- arrays and checkpoints written with the reference primitives -------------------------


@dataclass
class Arr:
    """One tensor of a generated checkpoint."""

    name: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any] | None  # the full tensor (None: too big, see ``present``)
    chunk: tuple[int, ...] | None = None  # None: one chunk of the whole shape
    shard: tuple[int, ...] | None = None
    compression: str | Mapping[str, Any] | None = None
    fill: Any = None  # a numpy scalar (default: zero bits)
    ucp: dict[str, Any] = field(default_factory=dict)
    #: for sparse arrays: the inner chunks that are stored, by global chunk coordinates,
    #: with their values (every other chunk is fill value)
    present: dict[tuple[int, ...], np.ndarray[Any, Any]] | None = None
    slices: list[list[list[int]]] | None = None  # None: chosen automatically
    whole: bool = True  # the expected sha256 of the whole tensor is given
    garbage_edges: bool = False  # edge chunks padded with non-fill bytes (R034)

    @property
    def path(self) -> str:
        return names.path_of(*self.name)

    @property
    def dt(self) -> dtypes.DataType:
        return dtypes.by_name(self.dtype)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return self.chunk if self.chunk is not None else tuple(max(1, s) for s in self.shape)

    def meta(self) -> ArrayMeta:
        fill = self.fill if self.fill is not None else np.zeros((), self.dt.numpy)[()]
        return ArrayMeta(
            path=self.path,
            shape=self.shape,
            dtype=self.dt,
            chunk_shape=self.chunk_shape,
            shard_shape=self.shard,
            compression=Compression.parse(self.compression, self.dt),
            fill_value=fill,
            attributes={"ucp": dict(self.ucp)} if self.ucp else {},
        )

    def full(self) -> np.ndarray[Any, Any] | None:
        """The logical contents (sparse arrays: fill value where nothing is stored)."""
        if self.data is not None:
            return self.data
        return None


def arr(name: str, dtype: str, shape: Sequence[int], index: int, **kw: Any) -> Arr:
    """An array whose contents are the splitmix64 stream of ``seed_of(index)``."""
    data = contents.generate(dtype, shape, seed_of(index))
    return Arr(tuple(name.split("/")), dtype, tuple(shape), data, **kw)


def zero_arr(name: str, dtype: str, shape: Sequence[int], **kw: Any) -> Arr:
    return Arr(tuple(name.split("/")), dtype, tuple(shape), contents.zeros(dtype, shape), **kw)


@dataclass
class Group:
    name: tuple[str, ...]
    values: dict[str, Any] = field(default_factory=dict)
    ucp: dict[str, Any] = field(default_factory=dict)  # other members of attributes.ucp

    @property
    def path(self) -> str:
        return names.path_of(*self.name)

    def meta(self) -> GroupMeta:
        ucp = dict(self.ucp)
        if self.values:
            ucp["values"] = self.values
        return GroupMeta(self.path, {"ucp": ucp} if ucp else {})


def _sparse_object(meta: ArrayMeta, coords: tuple[int, ...], a: Arr) -> list[Any]:
    """Buffers of one stored object of a sparse array: only its present chunks."""
    codec = ChunkCodec(meta.dtype, meta.compression)
    assert a.present is not None
    if meta.shard_shape is None:
        return codec.encode(a.present[coords])
    present = a.present
    cps = meta.chunks_per_shard
    locals_present = (
        (local, tuple(c * n + i for c, n, i in zip(coords, cps, local, strict=True)))
        for local in itertools.product(*(range(n) for n in cps))
    )
    return pack_shard(cps, ((local, codec.encode(present[glob]))
                            for local, glob in locals_present if glob in present))


def _garbage_object(meta: ArrayMeta, coords: tuple[int, ...], data: np.ndarray[Any, Any],
                    seed: int) -> list[Any]:
    """Like the writer's encoding, but chunk elements outside the array are not fill (R034)."""
    cs = meta.chunk_shape

    def padded(block: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        out = contents.generate(meta.dtype.name, cs, seed)
        out[tuple(slice(0, n) for n in block.shape)] = block
        return out

    return encode_object(meta, coords, data, pad=padded)


def parent_groups(arrays: Iterable[Arr], groups: Iterable[Group]) -> list[Group]:
    """The given groups plus every parent group the arrays and groups need (R005)."""
    out = {g.name: g for g in groups}
    for item in [*arrays, *out.values()]:
        for depth in range(1, len(item.name)):
            out.setdefault(item.name[:depth], Group(item.name[:depth]))
    return [out[k] for k in sorted(out)]


def write_reference(
    dest: Path,
    arrays: Sequence[Arr],
    groups: Sequence[Group] = (),
    *,
    root_values: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    hash_algorithm: str | None = "sha256",
    root_extra: Mapping[str, Any] | None = None,
    root_attributes: Mapping[str, Any] | None = None,
) -> None:
    """A checkpoint written with ucpformat's writer primitives and explicit chunkings."""
    store = LocalStore(dest, durable=False)
    metas: list[ArrayMeta] = []
    objects: list[StoredObject] = []
    for i, a in enumerate(arrays):
        meta = a.meta()
        metas.append(meta)
        if a.present is not None:
            coords_set = sorted({
                tuple(c // (s // cc) for c, s, cc in
                      zip(g, meta.object_shape, meta.chunk_shape, strict=True))
                for g in a.present
            }) if meta.shard_shape is not None else sorted(a.present)
            for coords in coords_set:
                buffers = _sparse_object(meta, coords, a)
                objects.append(_put(store, meta.object_key(coords), buffers, hash_algorithm))
            continue
        assert a.data is not None
        for coords in object_coords(meta):
            region = a.data[object_region(meta, coords)].astype(meta.dtype.numpy, copy=False)
            if a.garbage_edges:
                buffers = _garbage_object(meta, coords, region, seed_of(1000 + i))
                objects.append(_put(store, meta.object_key(coords), buffers, hash_algorithm))
            else:
                objects.append(write_object(store, meta, coords, region,
                                            hash_algorithm=hash_algorithm))
    root_ucp = build_root_ucp(metadata=metadata, values=root_values, producer=PRODUCER,
                              created=CREATED)
    root_ucp.update(root_extra or {})
    commit(
        store,
        arrays=metas,
        groups=[g.meta() for g in parent_groups(arrays, groups) if g.name],
        objects=objects,
        root_ucp=root_ucp,
        root_attributes=root_attributes,
        hash_algorithm=hash_algorithm,
    )


def _put(store: LocalStore, key: str, buffers: Sequence[Any], hash_algorithm: str | None
         ) -> StoredObject:
    nbytes = store.put(key, buffers)
    digest = None
    if hash_algorithm == "sha256":
        h = hashlib.sha256()
        for b in buffers:
            h.update(b)
        digest = h.hexdigest()
    return StoredObject(key, nbytes, digest)


# -- the independent commit: groups, manifest and root with json and hashlib only -----------


def commit_foreign(dest: Path, root_ucp: Mapping[str, Any],
                   groups: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Commit arrays another library wrote under ``dest`` (no ucpformat code involved).

    ``groups`` maps node paths to their ``attributes``; every parent of an array gets a
    group document. Then the manifest (SHA-256 of every file) and, last, the root with
    the consolidated metadata of every node, as the spec's commit protocol says (R050).
    """
    def dump(doc: Any) -> bytes:
        return json.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8")

    nodes: dict[str, Any] = {}
    for dirpath, _dirs, files in sorted(os.walk(dest)):
        if "zarr.json" in files and Path(dirpath) != dest:
            rel = Path(dirpath).relative_to(dest).as_posix()
            doc = json.loads((Path(dirpath) / "zarr.json").read_text(encoding="utf-8"))
            if doc.get("node_type") == "array":
                nodes[rel] = doc
    wanted = dict(groups or {})
    for path in list(nodes):
        parts = path.split("/")
        for depth in range(1, len(parts)):
            wanted.setdefault("/".join(parts[:depth]), {})
    for path, attributes in wanted.items():
        doc = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}
        (dest / path).mkdir(parents=True, exist_ok=True)
        (dest / path / "zarr.json").write_bytes(dump(doc))
        nodes[path] = doc
    files: dict[str, Any] = {}
    for dirpath, _dirs, names_ in os.walk(dest):
        for name in names_:
            key = (Path(dirpath) / name).relative_to(dest).as_posix()
            data = (Path(dirpath) / name).read_bytes()
            files[key] = {"nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ucp = dict(root_ucp)
    ucp["version"] = "1.0"
    # the manifest seals a copy of the root's attributes, without the manifest reference
    manifest = dump({"hash_algorithm": "sha256", "files": dict(sorted(files.items())),
                     "root_attributes": {"ucp": dict(ucp)}})
    (dest / "manifest.ucp.json").write_bytes(manifest)
    ucp["manifest"] = {"path": "manifest.ucp.json", "nbytes": len(manifest),
                       "sha256": hashlib.sha256(manifest).hexdigest()}
    root = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"ucp": ucp},
        "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                  "metadata": dict(sorted(nodes.items()))},
    }
    (dest / "zarr.json").write_bytes(root_bytes(root))  # sealed by its digest (R058)


# -- expected results ------------------------------------------------------------------------


def auto_slices(shape: Sequence[int], chunk: Sequence[int] | None) -> list[list[list[int]]]:
    """A few selections: a chunk-crossing box, a stepped one, the last element, an empty one."""
    if len(shape) == 0:
        return [[]]
    if math.prod(shape) == 0:
        return [[[0, n, 1] for n in shape]]
    chunk = chunk or shape
    out = []
    box = []
    for n, c in zip(shape, chunk, strict=True):
        lo = max(0, min(c - 1, n - 1)) if c < n else 0
        box.append([lo, min(n, lo + max(2, c // 2 + 1)), 1])
    out.append(box)
    out.append([[1 if n > 1 else 0, n, 2 if n > 2 else 1] for n in shape])
    out.append([[n - 1, n, 1] for n in shape])
    out.append([[0, 0, 1]] + [[0, n, 1] for n in shape[1:]])
    return out


def tensor_expected(a: Arr) -> dict[str, Any]:
    data = a.full()
    slices = a.slices if a.slices is not None else auto_slices(a.shape, a.chunk)
    entry: dict[str, Any] = {
        "name": list(a.name),
        "dtype": a.dtype,
        "shape": list(a.shape),
        "sha256": contents.sha256(data) if (a.whole and data is not None) else None,
        "slices": [],
    }
    for sel in slices:
        if data is not None:
            digest = contents.slice_sha256(data, sel)
        else:
            digest = contents.sha256(sparse_select(a, sel))
        entry["slices"].append({"slice": sel, "sha256": digest})
    if a.ucp:
        entry["ucp"] = dict(a.ucp)
    return entry


def sparse_select(a: Arr, sel: Sequence[Sequence[int]]) -> np.ndarray[Any, Any]:
    """A selection of a sparse array given by its present chunks (fill elsewhere)."""
    meta = a.meta()
    starts, stops = contents.box_of(sel)
    box = np.full([b - s for s, b in zip(starts, stops, strict=True)], meta.fill_value,
                  dtype=meta.dtype.numpy)
    cs = meta.chunk_shape
    assert a.present is not None
    for gchunk, values in a.present.items():
        lo = [g * c for g, c in zip(gchunk, cs, strict=True)]
        src, dst = [], []
        for l0, c, s, e in zip(lo, cs, starts, stops, strict=True):
            a0, b0 = max(l0, s), min(l0 + c, e)
            if a0 >= b0:
                break
            src.append(slice(a0 - l0, b0 - l0))
            dst.append(slice(a0 - s, b0 - s))
        else:
            box[tuple(dst)] = values[tuple(src)]
    shape = contents.selection_shape(sel)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=meta.dtype.numpy)
    rel = [[0, n, int(st)] for n, (_a0, _b0, st) in zip(box.shape, sel, strict=True)]
    return contents.select(box, rel)


def group_values(arrays: Sequence[Arr], groups: Sequence[Group],
                 root_values: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"": dict(root_values or {})}
    for g in parent_groups(arrays, groups):
        if g.name:
            out[g.path] = dict(g.values)
    return dict(sorted(out.items()))


def valid_expected(
    description: str,
    arrays: Sequence[Arr],
    groups: Sequence[Group] = (),
    *,
    root_values: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    writer: str = REFERENCE_WRITER,
    exercises: Sequence[str] = (),
    warnings: Sequence[str] = (),
    targets: Sequence[Mapping[str, Any]] = (),
    version: str = "1.0",
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "$schema": SCHEMA_ID,
        "ucp_conformance": "1.0",
        "kind": "valid",
        "description": description,
        "writer": writer,
        "version": version,
        "exercises": sorted(set(exercises)),
        "warnings": sorted(set(warnings)),
        "tensors": {a.path: tensor_expected(a) for a in sorted(arrays, key=lambda x: x.path)},
        "groups": group_values(arrays, groups, root_values),
        "metadata": dict(metadata or {}),
    }
    if targets:
        doc["targets"] = list(targets)
    return doc


def layout_targets(arrays: Sequence[Arr], configs: Sequence[tuple[str, Target]]
                   ) -> list[dict[str, Any]]:
    """Expected local tensors of every array with a layout, for every target config."""
    out: list[dict[str, Any]] = []
    for a in arrays:
        if "layout" not in a.ucp or a.data is None:
            continue
        layout = TensorLayout.from_json(a.ucp["layout"])
        for label, target in configs:
            entry: dict[str, Any] = {"id": f"{a.path}@{label}", "tensor": a.path,
                                     "config": target.to_json()}
            try:
                lmap = target.local_map(a.shape, layout, tensor=a.path)
            except LayoutError as exc:
                entry["refuse"] = exc.rule
                out.append(entry)
                continue
            if lmap is None:
                entry["held"] = False
            else:
                local = local_from_array(a.data, lmap)
                entry.update({"held": True, "shape": list(local.shape),
                              "sha256": contents.sha256(local)})
            out.append(entry)
    return out


def request_for(arrays: Sequence[Arr]) -> dict[str, Any]:
    """The reader request of an invalid case: every tensor whole (or one slice if huge)."""
    tensors: dict[str, Any] = {}
    for a in sorted(arrays, key=lambda x: x.path):
        if a.data is not None:
            tensors[a.path] = {"whole": True, "slices": []}
        else:
            tensors[a.path] = {"whole": False,
                               "slices": auto_slices(a.shape, a.chunk)[:1]}
    return {"tensors": tensors}


# -- damaging a checkpoint on purpose ---------------------------------------------------------


def _json(doc: Any) -> bytes:
    """The serialisation of every document Damage rewrites (independent of ucpformat's)."""
    return json.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8")


#: Stands for the root's digest while the digest is computed (any 64 hex digits would do).
_DIGEST_PLACEHOLDER = hashlib.sha256(b"the root's digest goes here").hexdigest()


def seal_root_bytes(body: bytes, at: str) -> bytes:
    """UCP-1.0-R058 with hashlib alone: ``body`` with the 64 hex digits ``at`` (found once,
    quoted) replaced by the SHA-256 of ``body`` in which they are 64 ``0`` characters."""
    token = f'"{at}"'.encode()
    pos = body.find(token) + 1
    if pos == 0 or body.find(token, pos) >= 0:
        raise AssertionError("the digest must appear exactly once in the root")
    zeroed = body[:pos] + b"0" * 64 + body[pos + 64 :]
    return zeroed[:pos] + hashlib.sha256(zeroed).hexdigest().encode() + zeroed[pos + 64 :]


def root_bytes(doc: Mapping[str, Any], *, digest: bool = True) -> bytes:
    """A root document's bytes; ``digest``: with its ``root_sha256`` (R058) computed (a
    root without an ``attributes.ucp`` object is written as it is)."""
    attributes = doc.get("attributes")
    if not digest or not isinstance(attributes, dict) or not isinstance(
            attributes.get("ucp"), dict):
        return _json(doc)
    ucp = {**attributes["ucp"], "root_sha256": _DIGEST_PLACEHOLDER}
    body = _json({**doc, "attributes": {**attributes, "ucp": ucp}})
    return seal_root_bytes(body, _DIGEST_PLACEHOLDER)


class Damage:
    """Edit a committed checkpoint in place, keeping every other part consistent.

    Each edit updates what depends on it unless told otherwise: a file's manifest entry
    (size and SHA-256), the manifest's size and digest in the root, and a node's
    consolidated metadata.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def read(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    # root and manifest
    def root_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.read("zarr.json"))
        return doc

    def write_root(self, doc: Mapping[str, Any], *, digest: bool = True) -> None:
        """Write the root; ``digest``: with its digest of the new bytes (R058)."""
        self.path("zarr.json").write_bytes(root_bytes(doc, digest=digest))

    def replace_in_root(self, old: str, new: str) -> None:
        """A textual edit of the root (for what JSON values cannot express), its digest
        computed again over the edited bytes (R058)."""
        doc = self.root_doc()
        text = root_bytes(doc).decode("utf-8")
        if old not in text:
            raise AssertionError(f"{old!r} is not in the root zarr.json")
        body = text.replace(old, new, 1).encode("utf-8")
        digest = json.loads(text)["attributes"]["ucp"]["root_sha256"]
        self.path("zarr.json").write_bytes(seal_root_bytes(body, digest))

    def edit_root(self, fn: Callable[[dict[str, Any]], None], *, seal: bool = True,
                  digest: bool = True) -> None:
        """Edit the root; ``seal``: keep the manifest's copy of its attributes in step (R045);
        ``digest``: give the root the digest of its new bytes (R058)."""
        doc = self.root_doc()
        fn(doc)
        self.write_root(doc, digest=digest)
        if seal:
            self.reseal()

    def ucp(self, fn: Callable[[dict[str, Any]], None], *, seal: bool = True) -> None:
        self.edit_root(lambda doc: fn(doc["attributes"]["ucp"]), seal=seal)

    def reseal(self) -> None:
        """Copy the root's attributes (minus the manifest reference and the root's digest)
        into the manifest."""
        attributes = json.loads(json.dumps(self.root_doc().get("attributes", {})))
        if not isinstance(attributes, dict) or not isinstance(attributes.get("ucp"), dict):
            return  # nothing to seal: the case breaks the root's attributes on purpose
        attributes["ucp"].pop("manifest", None)
        attributes["ucp"].pop("root_sha256", None)
        doc = self.manifest()
        doc["root_attributes"] = attributes
        self.write_manifest(doc)

    def manifest(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.read("manifest.ucp.json"))
        return doc

    def write_manifest(self, doc: Mapping[str, Any], *, update_root: bool = True) -> None:
        body = _json(doc)
        self.path("manifest.ucp.json").write_bytes(body)
        if update_root:
            def fix(ucp: dict[str, Any]) -> None:
                ucp["manifest"] = {"path": "manifest.ucp.json", "nbytes": len(body),
                                   "sha256": hashlib.sha256(body).hexdigest()}
            self.ucp(fix, seal=False)

    def listing(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Edit the manifest's ``files`` (and re-seal the manifest in the root)."""
        doc = self.manifest()
        fn(doc["files"])
        doc["files"] = dict(sorted(doc["files"].items()))
        self.write_manifest(doc)

    # files
    def put(self, key: str, data: bytes, *, listed: bool = True) -> None:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.is_file():
            target.unlink()
        target.write_bytes(data)
        if listed:
            def entry(files: dict[str, Any]) -> None:
                files[key] = {"nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            self.listing(entry)

    def delete(self, key: str, *, unlist: bool = False) -> None:
        target = self.path(key)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        if unlist:
            self.listing(lambda files: [files.pop(k) for k in list(files)
                                        if k == key or k.startswith(key + "/")])

    # nodes
    def node(self, path: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.read(f"{path}/zarr.json"))
        return doc

    def set_node(self, path: str, doc: Mapping[str, Any], *, own: bool = True,
                 consolidated: bool = True) -> None:
        if own:
            self.put(f"{path}/zarr.json", _json(doc))
        if consolidated:
            self.edit_root(lambda root: root["consolidated_metadata"]["metadata"].__setitem__(
                path, dict(doc)))

    def edit_node(self, path: str, fn: Callable[[dict[str, Any]], None]) -> None:
        doc = self.node(path)
        fn(doc)
        self.set_node(path, doc)

    def edit_ucp(self, path: str, fn: Callable[[dict[str, Any]], None]) -> None:
        def edit(doc: dict[str, Any]) -> None:
            doc.setdefault("attributes", {})
            doc["attributes"].setdefault("ucp", {})
            fn(doc["attributes"]["ucp"])
        self.edit_node(path, edit)

    def rename_node(self, old: str, new: str, *, move_files: bool = True) -> None:
        """Give a node (and everything under it) another node path, everywhere.

        ``move_files=False``: only the consolidated metadata changes (files and manifest
        keep the old names).
        """

        def ren(key: str) -> str:
            return new + key[len(old):] if key == old or key.startswith(old + "/") else key

        if move_files:
            self.path(new).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path(old), self.path(new))
            self.listing(lambda files: files.update(
                {ren(k): files.pop(k) for k in sorted(files) if ren(k) != k}))

        def fix(root: dict[str, Any]) -> None:
            meta = root["consolidated_metadata"]["metadata"]
            root["consolidated_metadata"]["metadata"] = {ren(k): v for k, v in meta.items()}
        self.edit_root(fix)

    def drop_node(self, path: str) -> None:
        """Remove a node and its files entirely (metadata, manifest, disk)."""
        self.delete(path, unlist=True)

        def fix(root: dict[str, Any]) -> None:
            meta = root["consolidated_metadata"]["metadata"]
            for k in [k for k in meta if k == path or k.startswith(path + "/")]:
                del meta[k]
        self.edit_root(fix)

    # raw chunk surgery
    def rewrite_chunk(self, key: str, fn: Callable[[bytes], bytes], *, recrc: bool = True,
                      listed: bool = True, offset: int = 0, length: int | None = None) -> None:
        """Replace the payload of the chunk at ``[offset, offset + length)`` of a stored
        object (the whole object by default), then append a correct (or the old) CRC."""
        from ucpformat.engine.checksum import crc_bytes

        data = self.read(key)
        end = len(data) if length is None else offset + length
        chunk = data[offset:end]
        payload, crc = chunk[:-4], chunk[-4:]
        new_payload = fn(payload)
        new_chunk = new_payload + (crc_bytes(new_payload) if recrc else crc)
        self.put(key, data[:offset] + new_chunk + data[end:], listed=listed)

    def shard_index(self, key: str, chunks: int) -> np.ndarray[Any, Any]:
        data = self.read(key)
        body = data[-(chunks * 16 + 4):-4]
        return np.frombuffer(body, dtype="<u8").reshape(chunks, 2).copy()

    def set_shard_index(self, key: str, index: np.ndarray[Any, Any], *, recrc: bool = True
                        ) -> None:
        from ucpformat.engine.checksum import crc_bytes

        data = self.read(key)
        n = index.size * 8 + 4
        body = np.ascontiguousarray(index, dtype="<u8").tobytes()
        crc = crc_bytes(body) if recrc else data[-4:]
        self.put(key, data[:-n] + body + crc)


# -- valid cases ------------------------------------------------------------------------------

ALL_TYPES = dtypes.NAMES
OPTIMIZER_VALUES = {
    "type": "torch.optim.AdamW",
    "param_groups": [{"params": ["fc.weight", "fc.bias", "emb.weight"], "lr": 0.001,
                      "betas": [0.9, 0.999], "weight_decay": 0.01}],
}


@dataclass
class Built:
    """A generated case or scenario: where it goes and its expected.json."""

    name: str
    expected: dict[str, Any]


CaseFn = Callable[[Path], dict[str, Any]]
VALID: dict[str, CaseFn] = {}
INVALID: dict[str, CaseFn] = {}


def valid(name: str) -> Callable[[CaseFn], CaseFn]:
    def register(fn: CaseFn) -> CaseFn:
        VALID[name] = fn
        return fn
    return register


def base_arrays() -> list[Arr]:
    """The small checkpoint most invalid cases damage."""
    return [
        arr("model/fc.weight", "float32", (8, 6), 1, chunk=(2, 6), shard=(4, 6),
            ucp={"role": "parameter"}),
        arr("model/fc.bias", "float32", (6,), 2, chunk=(4,), ucp={"role": "parameter"}),
        arr("model/emb.weight", "bfloat16", (5, 4), 3, ucp={"role": "parameter"}),
        arr("model/scale", "float8_e4m3fn", (4,), 4, ucp={"role": "buffer"}),
        zero_arr("model/norm.bias", "float32", (6,), ucp={"role": "buffer"}),
        arr("optimizer/state/fc.weight/exp_avg", "float32", (8, 6), 5, chunk=(4, 6),
            compression="zstd", ucp={"role": "optimizer_state"}),
        arr("optimizer/state/fc.weight/step", "float32", (), 6, ucp={"role": "optimizer_state"}),
        arr("training/rng", "uint8", (16,), 7, ucp={"role": "training_state"}),
    ]


def base_groups() -> list[Group]:
    return [
        Group(("optimizer",), dict(OPTIMIZER_VALUES)),
        Group(("training",), {"step": 3, "best_loss": {"$ucp_float": "Infinity"}}),
    ]


BASE_METADATA = {"run": "conformance", "note": "base of the invalid cases"}


def write_base(dest: Path, arrays: Sequence[Arr] | None = None,
               groups: Sequence[Group] | None = None, **kw: Any) -> list[Arr]:
    arrays = list(base_arrays() if arrays is None else arrays)
    write_reference(dest, arrays, base_groups() if groups is None else groups,
                    metadata=kw.pop("metadata", BASE_METADATA), **kw)
    return arrays


@valid("basic")
def _basic(dest: Path) -> dict[str, Any]:
    arrays = base_arrays()
    groups = base_groups()
    write_reference(dest, arrays, groups, metadata=BASE_METADATA,
                    root_values={"framework": "conformance"})
    return valid_expected(
        "A small training state as the reference library writes it: sharded and unsharded "
        "arrays, a zstd-compressed optimizer state, a 0-d step counter, an all-zero buffer, "
        "optimizer and training values, a SHA-256 manifest.",
        arrays, groups, root_values={"framework": "conformance"}, metadata=BASE_METADATA,
        exercises=["UCP-1.0-R001", "UCP-1.0-R002", "UCP-1.0-R005", "UCP-1.0-R021",
                   "UCP-1.0-R022", "UCP-1.0-R030", "UCP-1.0-R040", "UCP-1.0-R041",
                   "UCP-1.0-R052", "UCP-1.0-R080", "UCP-1.0-R081"],
    )


@valid("dtypes-unsharded")
def _dtypes_unsharded(dest: Path) -> dict[str, Any]:
    arrays = [arr(f"model/t.{name}", name, (3, 5), 10 + i, chunk=(2, 5),
                  ucp={"role": "parameter"})
              for i, name in enumerate(ALL_TYPES)]
    write_reference(dest, arrays)
    return valid_expected(
        "Every data type of Table 1, 3 x 5, unsharded and uncompressed, two chunks each "
        "(the second one at the edge). Contents use every bit pattern: NaN payloads, "
        "negative zeros, subnormals.",
        arrays, exercises=["UCP-1.0-R020", "UCP-1.0-R023", "UCP-1.0-R034"])


@valid("dtypes-sharded-zstd")
def _dtypes_sharded(dest: Path) -> dict[str, Any]:
    arrays = [arr(f"model/t.{name}", name, (6, 4), 40 + i, chunk=(2, 2), shard=(4, 4),
                  compression="zstd", ucp={"role": "parameter"})
              for i, name in enumerate(ALL_TYPES)]
    write_reference(dest, arrays)
    return valid_expected(
        "Every data type of Table 1, 6 x 4, sharded (shards 4 x 4 of inner chunks 2 x 2, the "
        "last shard row at the edge), zstd-compressed.",
        arrays, exercises=["UCP-1.0-R020", "UCP-1.0-R022", "UCP-1.0-R024", "UCP-1.0-R028"])


@valid("compressors")
def _compressors(dest: Path) -> dict[str, Any]:
    blosc = {"cname": "lz4", "clevel": 5, "blocksize": 0}
    arrays = [
        arr("model/none", "float32", (16, 8), 70, chunk=(8, 8)),
        arr("model/zstd", "float32", (16, 8), 71, chunk=(8, 8),
            compression={"name": "zstd", "configuration": {"level": 5, "checksum": True}}),
        arr("model/gzip", "int32", (16, 8), 72, chunk=(8, 8), shard=(16, 8),
            compression={"name": "gzip", "configuration": {"level": 6}}),
        arr("model/blosc.shuffle", "float16", (16, 8), 73, chunk=(8, 8),
            compression={"name": "blosc", "configuration": {
                **blosc, "shuffle": "shuffle", "typesize": 2}}),
        arr("model/blosc.bitshuffle", "uint8", (16, 8), 74, chunk=(8, 8),
            compression={"name": "blosc", "configuration": {
                **blosc, "shuffle": "bitshuffle", "typesize": 1, "cname": "zstd"}}),
        arr("model/blosc.noshuffle", "int64", (16, 8), 75, chunk=(8, 8), shard=(16, 8),
            compression={"name": "blosc", "configuration": {
                **blosc, "shuffle": "noshuffle", "cname": "blosclz"}}),
        zero_arr("model/zstd.zeros", "float32", (16, 8), chunk=(8, 8), compression="zstd"),
        arr("model/zstd.no-checksum", "bfloat16", (16, 8), 76, chunk=(8, 8),
            compression={"name": "zstd", "configuration": {"level": 1}}),
    ]
    write_reference(dest, arrays)
    return valid_expected(
        "Each compressor of the closed list (zstd with a checksum and without the optional "
        "member checksum, gzip, blosc with each shuffle, without typesize when it does not "
        "shuffle) beside an uncompressed array, sharded and unsharded.",
        arrays, exercises=["UCP-1.0-R022", "UCP-1.0-R024", "UCP-1.0-R039"])


def _zstd_raw_frame(raw: bytes) -> bytes:
    """One zstd frame of ``raw`` made of raw blocks (RFC 8878 Block_Type 0), as a writer
    without a zstd encoder writes it: Single_Segment_flag set, the content size declared."""
    n = len(raw)
    if n < 256:
        fhd, fcs = 0x20, n.to_bytes(1, "little")
    elif n < 65536 + 256:
        fhd, fcs = 0x20 | 0x40, (n - 256).to_bytes(2, "little")
    else:
        fhd, fcs = 0x20 | 0x80, n.to_bytes(4, "little")
    out = (0xFD2FB528).to_bytes(4, "little") + bytes([fhd]) + fcs
    pieces = [raw[i:i + (128 << 10)] for i in range(0, n, 128 << 10)] or [b""]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out += ((len(piece) << 3) | int(last)).to_bytes(3, "little") + piece
    return out


@valid("zstd-raw-blocks")
def _zstd_raw_blocks(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/raw", "float32", (16, 8), 79, chunk=(8, 8), compression="zstd"),
              arr("model/raw.sharded", "int16", (8, 3), 80, chunk=(2, 3), shard=(4, 3),
                  compression="zstd")]
    write_reference(dest, arrays)
    d = Damage(dest)
    for key in ("model/raw/c/0/0", "model/raw/c/1/0"):
        d.rewrite_chunk(key, lambda p: _zstd_raw_frame(_zstd_decode(p)))
    return valid_expected(
        "zstd chunks written without a zstd encoder: each one frame of raw blocks "
        "(Block_Type 0) with Single_Segment_flag and the content size, as R047 allows "
        "(1.0.1: the note after R039); every zstd decoder reads them.",
        arrays, exercises=["UCP-1.0-R024", "UCP-1.0-R047"])


def _zstd_decode(payload: bytes) -> bytes:
    import numcodecs

    return bytes(numcodecs.Zstd(level=1).decode(payload))


@valid("crc32c-spellings")
def _crc32c_spellings(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/unsharded", "float32", (4, 3), 77, chunk=(2, 3)),
              arr("model/sharded", "int16", (8, 3), 78, chunk=(2, 3), shard=(4, 3),
                  compression="zstd")]
    write_reference(dest, arrays)
    empty = {"name": "crc32c", "configuration": {}}

    def sharded(doc: dict[str, Any]) -> None:
        cfg = doc["codecs"][0]["configuration"]
        cfg["index_codecs"][-1] = dict(empty)
        cfg["codecs"][-1] = dict(empty)

    d = Damage(dest)
    d.edit_node("model/unsharded", lambda doc: doc["codecs"].__setitem__(-1, dict(empty)))
    d.edit_node("model/sharded", sharded)
    return valid_expected(
        "The crc32c codec written with an empty configuration, in an unsharded chunk chain, "
        "in the chain of a shard's inner chunks and in its index_codecs (either spelling is "
        "valid in every place).",
        arrays, exercises=["UCP-1.0-R022", "UCP-1.0-R040", "UCP-1.0-R046"])


@valid("edge-shapes")
def _edge_shapes(dest: Path) -> dict[str, Any]:
    arrays = [
        arr("model/scalar.f32", "float32", (), 80),
        arr("model/scalar.i64", "int64", (), 81),
        arr("model/scalar.bool", "bool", (), 82),
        arr("model/scalar.bf16", "bfloat16", (), 83),
        arr("model/empty.1d", "float32", (0,), 84),
        arr("model/empty.3d", "int8", (3, 0, 2), 85, chunk=(2, 1, 2)),
        arr("model/empty.sharded", "float16", (0, 4), 86, chunk=(2, 2), shard=(4, 4)),
        arr("model/ones", "uint16", (1, 1, 1, 1), 87),
        arr("model/ragged.sharded", "float32", (7, 5), 88, chunk=(2, 2), shard=(4, 4)),
        arr("model/ragged.unsharded", "complex64", (5, 3), 89, chunk=(4, 2)),
        arr("model/long", "int32", (1000,), 90, chunk=(96,), shard=(384,)),
        arr("model/rank5", "uint8", (2, 3, 2, 3, 2), 91, chunk=(1, 2, 2, 2, 1),
            shard=(2, 2, 2, 2, 2)),
    ]
    write_reference(dest, arrays)
    return valid_expected(
        "Zero-dimensional tensors (one chunk at key P/c), empty tensors (no chunks), "
        "dimensions of size 1, ragged edges: edge chunks, and edge shards whose inner chunks "
        "wholly outside the array are not stored (empty index entries).",
        arrays, exercises=["UCP-1.0-R021", "UCP-1.0-R027", "UCP-1.0-R030", "UCP-1.0-R034"])


NAMES = [
    "語彙.weight", "café", "lm head", "encoder/embed", "100%", "__init__", "_private",
    ".hidden", "...", "zarr.json", "emoji.🙂", "tab\tname", "CamelCase.Weight",
    "x" * 135 + "é" * 20,  # escapes to exactly 255 bytes
]


@valid("names")
def _names(dest: Path) -> dict[str, Any]:
    arrays = [Arr(("model", n), "float32", (2,),
                  contents.generate("float32", (2,), seed_of(100 + i)))
              for i, n in enumerate(NAMES)]
    deep = ("ext", "a", "b", "c", "d", "e", "f", "g", "h", "深い", "leaf")
    arrays.append(Arr(deep, "int16", (3,), contents.generate("int16", (3,), seed_of(120))))
    groups = [Group(("ext", "a"), {"ключ": "значение", "emoji": "🙂", "nul-free": "a\u00a0b"})]
    write_reference(dest, arrays, groups)
    return valid_expected(
        "Names that need escaping: non-ASCII, '/', '%', a space, a tab, names made of dots, a "
        "leading '__', 'zarr.json', a name whose escape is exactly 255 bytes, and an "
        "extension group eleven levels deep.",
        arrays, groups,
        exercises=["UCP-1.0-R004", "UCP-1.0-R010", "UCP-1.0-R011", "UCP-1.0-R012"])


@valid("huge-sparse")
def _huge_sparse(dest: Path) -> dict[str, Any]:
    u8 = Arr(("model", "huge.u8"), "uint8", (2**40, 2**20), None, chunk=(256, 256),
             ucp={"sparse": True},
             present={
                 (0, 0): contents.generate("uint8", (256, 256), seed_of(130)),
                 (2**32 - 1, 2**12 - 1): contents.generate("uint8", (256, 256), seed_of(131)),
             },
             slices=[[[0, 4, 1], [0, 8, 1]], [[250, 262, 3], [250, 262, 1]],
                     [[2**40 - 3, 2**40, 1], [2**20 - 2, 2**20, 1]],
                     [[2**39, 2**39 + 2, 1], [7, 9, 1]]],
             whole=False)
    bf = Arr(("model", "huge.bf16"), "bfloat16", (2**33, 2**12), None, chunk=(64, 64),
             shard=(512, 512), ucp={"sparse": True},
             present={(0, 1): contents.generate("bfloat16", (64, 64), seed_of(132)),
                      (9, 0): contents.generate("bfloat16", (64, 64), seed_of(133))},
             slices=[[[0, 2, 1], [62, 66, 1]], [[575, 578, 1], [0, 3, 1]],
                     [[2**33 - 1, 2**33, 1], [0, 2**12, 512]]],
             whole=False)
    write_reference(dest, [u8, bf])
    return valid_expected(
        "Sparse tensors of petabyte and terabyte shapes, a few chunks stored: opening costs "
        "no more than reading the metadata, and a slice reads only what it overlaps "
        "(absent chunks of a sparse array read as the fill value).",
        [u8, bf], exercises=["UCP-1.0-R027", "UCP-1.0-R032", "UCP-1.0-R090"])


def _fill(dtype: str, json_value: Any) -> Any:
    return dtypes.fill_value_from_json(dtypes.by_name(dtype), json_value)


@valid("fill-values")
def _fill_values(dest: Path) -> dict[str, Any]:
    specs = [
        ("bfloat16", "0x3f80"), ("float16", "0x3c00"), ("float32", "0x7fc00001"),
        ("float64", "-Infinity"), ("float8_e4m3fn", "0x38"), ("float8_e8m0fnu", "0x7f"),
        ("int8", -1), ("uint64", 2**64 - 1), ("bool", True), ("complex64", [1.0, "NaN"]),
    ]
    arrays = []
    for i, (dtype, fill_json) in enumerate(specs):
        fill = _fill(dtype, fill_json)
        chunk = (2, 3)
        data = np.full((4, 6), fill, dtype=dtypes.by_name(dtype).numpy)
        stored = contents.generate(dtype, chunk, seed_of(140 + i))
        data[0:2, 3:6] = stored
        arrays.append(Arr(("model", f"fill.{dtype}"), dtype, (4, 6), data, chunk=chunk,
                          shard=(4, 6) if i % 2 else None, fill=fill,
                          ucp={"sparse": True}, present={(0, 1): stored}))
    write_reference(dest, arrays)
    return valid_expected(
        "Sparse arrays with fill values other than zero, one chunk stored: absent chunks read "
        "as the fill value, whose hexadecimal form is bits of the array's own type (0x3f80 "
        "is bfloat16 1.0, not float16 1.875); NaN with a payload; complex with a NaN part.",
        arrays, exercises=["UCP-1.0-R026", "UCP-1.0-R032"])


#: JSON fill values whose bits R036 to R038 fix, with those bits written out here from the
#: spec (not computed by ucpformat): a reader that rounds, saturates, picks a NaN or
#: parses hexadecimal digits otherwise reads other fill elements.
FILL_RULES: list[tuple[str, Any, int]] = [
    ("float8_e4m3fn", 464, 0x7E),  # 448: the tie goes to the even mantissa
    ("float16", 65519, 0x7BFF),  # rounds down to 65504, the largest float16
    ("float32", 3.4028235e38, 0x7F7FFFFF),  # above the largest float32 as a decimal
    ("bfloat16", 1.01171875, 0x3F82),  # halfway between 0x3f81 and 0x3f82: even
    ("float16", 1.00048828125, 0x3C00),  # halfway between 1.0 and 0x3c01: even
    ("float16", -1e-10, 0x8000),  # negative zero
    ("float8_e5m2", -0.0, 0x80),
    ("float8_e4m3fnuz", -0.0, 0x00),  # no negative zero: 0x80 is the NaN
    ("float8_e5m2fnuz", -1e-10, 0x00),
    ("float8_e8m0fnu", 0.25, 0x7D),
    ("float8_e8m0fnu", 5.877471754111438e-39, 0x00),  # 2**-127
    ("float16", "NaN", 0x7E00), ("float32", "NaN", 0x7FC00000),
    ("float64", "NaN", 0x7FF8000000000000), ("bfloat16", "NaN", 0x7FC0),
    ("float8_e4m3fn", "NaN", 0x7F), ("float8_e5m2", "NaN", 0x7E),
    ("float8_e4m3fnuz", "NaN", 0x80), ("float8_e8m0fnu", "NaN", 0xFF),
    ("bfloat16", "0x3F80", 0x3F80), ("float32", "0x7FC00001", 0x7FC00001),
    ("complex64", [-0.0, "NaN"], 0x7FC00000_80000000),  # imaginary part, then real part
]


def _scalar_of_bits(dtype: str, bits: int) -> Any:
    dt = dtypes.by_name(dtype)
    return np.frombuffer(bits.to_bytes(dt.itemsize, "little"), dtype=dt.numpy)[0]


@valid("fill-value-rules")
def _fill_value_rules(dest: Path) -> dict[str, Any]:
    arrays = []
    for i, (dtype, _json_fill, bits) in enumerate(FILL_RULES):
        fill = _scalar_of_bits(dtype, bits)
        chunk = (2, 3)
        data = np.full((4, 6), fill, dtype=dtypes.by_name(dtype).numpy)
        stored = contents.generate(dtype, chunk, seed_of(240 + i))
        data[2:4, 0:3] = stored
        arrays.append(Arr(("model", f"fill.{i}.{dtype}"), dtype, (4, 6), data, chunk=chunk,
                          shard=(4, 6) if i % 3 == 0 else None, fill=fill,
                          ucp={"sparse": True}, present={(1, 0): stored}))
    write_reference(dest, arrays)
    d = Damage(dest)
    for a, (_dtype, json_fill, _bits) in zip(arrays, FILL_RULES, strict=True):
        d.edit_node(a.path, _set(["fill_value"], json_fill))
    return valid_expected(
        "Sparse arrays whose fill values are JSON numbers rounded as R036 says (to binary64, "
        "then to the type, ties to even; 464 for float8_e4m3fn is 448; 3.4028235e38 is the "
        "largest float32), negative zeros (none in the fnuz types), powers of two for "
        "float8_e8m0fnu, the NaN of each type (R037) and upper-case hexadecimal digits "
        "(R038). Every absent chunk reads as those bits.",
        arrays, exercises=["UCP-1.0-R026", "UCP-1.0-R032", "UCP-1.0-R036", "UCP-1.0-R037",
                           "UCP-1.0-R038"])


@valid("edge-chunk-padding")
def _edge_padding(dest: Path) -> dict[str, Any]:
    arrays = [
        arr("model/ragged.unsharded", "float32", (5, 3), 150, chunk=(4, 2), garbage_edges=True),
        arr("model/ragged.sharded", "int16", (7, 5), 151, chunk=(2, 2), shard=(4, 4),
            garbage_edges=True),
        arr("model/ragged.bool", "bool", (3,), 152, chunk=(2,), garbage_edges=True),
    ]
    write_reference(dest, arrays)
    return valid_expected(
        "Edge chunks whose elements outside the array are not the fill value (writers "
        "should fill them, readers must ignore them).",
        arrays, exercises=["UCP-1.0-R034"])


@valid("future-minor-version")
def _future_minor(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/w", "float32", (4, 4), 160,
                  ucp={"role": "parameter", "x_quantization_hint": {"bits": 4}}),
              arr("model/b", "int64", (3,), 161, ucp={"role": "buffer"})]
    groups = [Group(("model",), {}, {"x_future_group_member": [1, 2, 3]})]
    write_reference(dest, arrays, groups,
                    root_extra={"x_future_member": {"anything": True}},
                    root_attributes={"other_tool": {"note": "attributes besides ucp"}})
    d = Damage(dest)
    d.ucp(lambda ucp: ucp.__setitem__("version", "1.7"))
    doc = d.manifest()
    doc["x_future_manifest_member"] = "ignored by 1.0 readers"
    d.write_manifest(doc)
    return valid_expected(
        "Version 1.7: a future minor version that a 1.0 reader reads, ignoring the members "
        "it does not know in every ucp object, in the manifest and in attributes.",
        arrays, groups, version="1.7",
        exercises=["UCP-1.0-R060", "UCP-1.0-R062", "UCP-1.0-R063"])


@valid("warnings")
def _warnings(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/w", "float32", (3, 3), 170)]
    groups = [Group(("training",), {"step": 2**60, "seed": -(2**55),
                                    "nan": {"$ucp_float": "NaN"}})]
    write_reference(dest, arrays, groups)
    (dest / "write-in-progress.ucp.json").write_bytes(_json({"writer": "crashed-after-commit"}))
    return valid_expected(
        "Valid, with two SHOULD-level findings: an in-progress marker left next to a "
        "committed root (R056), integers beyond 2**53-1 in JSON values (R071).",
        arrays, groups, warnings=["UCP-1.0-R056", "UCP-1.0-R071"],
        exercises=["UCP-1.0-R056", "UCP-1.0-R070", "UCP-1.0-R071"])


#: JSON values that a reader comparing loosely (as JavaScript's JSON.stringify prints them,
#: or through binary64) would change: R073 keeps 1 and 1.0, -0.0 and 0.0 apart.
EXACT_NUMBERS = {
    "one_float": 1.0, "one_int": 1, "true": True, "zero_float": 0.0, "zero_int": 0,
    "negative_zero": -0.0, "two_60": 2**60, "two_60_plus_1": 2**60 + 1,
    "two_60_float": float(2**60), "minus_two_62": -(2**62), "large": 1e300,
    "smallest": 5e-324, "exponent": 1.5e-7,
    "nested": [1.0, 1, -0.0, {"two_60_plus_1": 2**60 + 1, "half": 0.5}],
}


@valid("json-numbers")
def _json_numbers(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/w", "float32", (2, 2), 175)]
    groups = [Group(("training",), dict(EXACT_NUMBERS))]
    metadata = {"lr": 1.0, "epochs": 1, "offset": -0.0, "seed": 2**60 + 1}
    write_reference(dest, arrays, groups, metadata=metadata,
                    root_values={"scale": 1.0, "count": 1})
    return valid_expected(
        "JSON values whose kinds a reader must keep: 1.0 and 1, -0.0 and 0.0, integers "
        "beyond 2**53 (2**60 + 1 differs from 2**60), in the values of a group, of the root "
        "and in metadata. Equality is R073's: a reader that prints 1.0 as 1 or -0.0 as 0 "
        "fails.",
        arrays, groups, root_values={"scale": 1.0, "count": 1}, metadata=metadata,
        warnings=["UCP-1.0-R071"],
        exercises=["UCP-1.0-R045", "UCP-1.0-R070", "UCP-1.0-R071", "UCP-1.0-R073"])


@valid("must-understand-false-members")
def _must_understand_false(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/w", "float32", (4, 3), 178, chunk=(2, 3), shard=(4, 3)),
              arr("model/b", "bool", (5,), 179, chunk=(2,))]
    groups = [Group(("training",), {"step": 5})]
    write_reference(dest, arrays, groups)
    d = Damage(dest)
    d.edit_node("model/w", _set(["x_prefetch_hint"], {"must_understand": False, "order": "C"}))
    d.edit_node("training", _set(["x_index"], {"must_understand": False, "entries": 3}))
    return valid_expected(
        "An array and a group whose zarr.json carry a member zarr v3 does not define, marked "
        '"must_understand": false: readers ignore it (zarr v3 extensions, R007). The bool '
        "array's edge chunk is padded with 0x00 (R008).",
        arrays, groups, exercises=["UCP-1.0-R007", "UCP-1.0-R008"])


@valid("manifest-without-digests")
def _no_digests(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/w", "float32", (4, 3), 180, chunk=(2, 3)),
              arr("training/rng", "uint8", (8,), 181)]
    write_reference(dest, arrays, hash_algorithm=None)
    return valid_expected(
        "A manifest with hash_algorithm null: sizes only, no SHA-256 of each file (the root "
        "still seals the manifest with its SHA-256).",
        arrays, exercises=["UCP-1.0-R042"])


#: The state of a run's random-number generators (R085): Python's random, NumPy's global
#: MT19937 (its key an array), a named PCG64 (128-bit integers as decimal strings), a
#: named Philox (arrays of uint64), PyTorch's CPU, CUDA and a named generator (uint8).
RNG_TRAINING_STATE = {"role": "training_state"}


def rng_arrays(first: int, *, torch_cpu: str = "uint8") -> list[Arr]:
    at = "training/rng/"
    return [
        arr(at + "torch_cpu", torch_cpu, (64,), first, ucp=RNG_TRAINING_STATE),
        arr(at + "torch_cuda/0", "uint8", (16,), first + 1, ucp=RNG_TRAINING_STATE),
        arr(at + "numpy/state.key", "uint32", (624,), first + 2, ucp=RNG_TRAINING_STATE),
        arr(at + "generators/philox/state.counter", "uint64", (4,), first + 3,
            ucp=RNG_TRAINING_STATE),
        arr(at + "generators/philox/state.key", "uint64", (2,), first + 4,
            ucp=RNG_TRAINING_STATE),
        arr(at + "generators/philox/buffer", "uint64", (4,), first + 5, ucp=RNG_TRAINING_STATE),
        arr(at + "generators/sampler", "uint8", (16,), first + 6, ucp=RNG_TRAINING_STATE),
    ]


def rng_groups(first: int) -> list[Group]:
    words = [int(w) for w in contents.generate("uint32", (624,), seed_of(first))]
    rng = ("training", "rng")
    return [
        Group(("training",), {"step": 3}),
        Group((*rng, "python"), {"kind": "python", "version": 3, "state": [*words, 624],
                                 "gauss_next": None}),
        Group((*rng, "numpy"), {"kind": "numpy", "bit_generator": "MT19937",
                                "state.pos": 624, "has_gauss": 0, "gauss": 0.0}),
        Group((*rng, "generators", "loader"), {
            "kind": "numpy", "bit_generator": "PCG64",
            "state.state": "35399562948360463058890781895381311971",
            "state.inc": "87136372517582989555478159403783844777",
            "has_uint32": 0, "uinteger": 0}),
        Group((*rng, "generators", "philox"), {
            "kind": "numpy", "bit_generator": "Philox", "buffer_pos": 4, "has_uint32": 0,
            "uinteger": 0}),
    ]


@valid("rng-state")
def _rng_state(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/w", "float32", (4, 3), 190), *rng_arrays(191)]
    groups = rng_groups(199)
    write_reference(dest, arrays, groups)
    return valid_expected(
        "The random-number generators of a resumable run in training/rng: Python's random "
        "(its state's 625 integers as values), NumPy's global MT19937 (its key an array), a "
        "named PCG64 whose 128-bit integers are decimal strings, a named Philox (uint64 "
        "arrays), and PyTorch's CPU, CUDA and named generators (uint8 arrays).",
        arrays, groups, exercises=["UCP-1.0-R083", "UCP-1.0-R085"])


#: Per-rank state (R086): a run of 3 processes whose ranks 0 and 2 kept state of their own
#: (rank 1 none): each rank's generators in the form of R085, a data loader's position.
def rank_state_arrays(first: int) -> list[Arr]:
    out: list[Arr] = []
    for i, rank in enumerate((0, 2)):
        at = f"training/ranks/{rank}/"
        out += [arr(at + "rng/torch_cpu", "uint8", (64,), first + 3 * i, ucp=RNG_TRAINING_STATE),
                arr(at + "rng/numpy/state.key", "uint32", (624,), first + 3 * i + 1,
                    ucp=RNG_TRAINING_STATE),
                arr(at + "loader/order", "int64", (8,), first + 3 * i + 2,
                    ucp=RNG_TRAINING_STATE)]
    return out


def rank_state_groups(world_size: int = 3) -> list[Group]:
    out = [Group(("training",), {"step": 3}),
           Group(("training", "ranks"), {"world_size": world_size})]
    for rank in (0, 2):
        at = ("training", "ranks", str(rank))
        out += [Group(at), Group((*at, "rng")),
                Group((*at, "rng", "numpy"), {"kind": "numpy", "bit_generator": "MT19937",
                                              "state.pos": 624, "has_gauss": 0, "gauss": 0.0}),
                Group((*at, "loader"), {"position": 17 + rank, "epoch": 1})]
    return out


@valid("rank-state")
def _rank_state(dest: Path) -> dict[str, Any]:
    arrays = [arr("model/w", "float32", (4, 3), 720), *rank_state_arrays(721)]
    groups = rank_state_groups()
    write_reference(dest, arrays, groups)
    return valid_expected(
        "Each process's own state in training/ranks (R086): a run of 3 processes whose "
        "ranks 0 and 2 kept generators (the form of training/rng, R085) and a data "
        "loader's position, and rank 1 none (it has no group).",
        arrays, groups, exercises=["UCP-1.0-R086", "UCP-1.0-R085"])


@valid("chunk-key-spellings")
def _chunk_key_spellings(dest: Path) -> dict[str, Any]:
    spellings = [{"name": "default", "configuration": {"separator": "/"}},
                 {"name": "default", "configuration": {}},
                 {"name": "default"}]
    arrays = [arr(f"model/w{i}", "float32", (4, 3), 185 + i, chunk=(2, 3),
                  shard=(4, 3) if i == 1 else None) for i in range(len(spellings))]
    write_reference(dest, arrays)
    d = Damage(dest)
    for a, spelling in zip(arrays, spellings, strict=True):
        d.edit_node(a.path, _set(["chunk_key_encoding"], spelling))
    return valid_expected(
        "The three spellings of zarr v3's default chunk key encoding with separator '/': "
        "with the separator, with an empty configuration, without a configuration (as "
        "tensorstore writes it). Chunk keys are P/c/i/j in each.",
        arrays, exercises=["UCP-1.0-R021", "UCP-1.0-R035"])


LAYOUT_CONFIGS: list[tuple[str, Target]] = [
    ("tp1", Target()),
    ("tp2.r1.part", Target(tp=2, tp_rank=1)),
    ("tp2.r0.group", Target(tp=2, tp_rank=0, fused_order="group-major")),
    ("tp4.r3.group.v8", Target(tp=4, tp_rank=3, fused_order="group-major", vocab_multiple=8)),
    ("pp2.r1.ep2.r1", Target(pp=2, pp_rank=1, ep=2, ep_rank=1, num_layers=4, num_experts=4)),
    ("tp3", Target(tp=3, tp_rank=2)),
    ("ep3", Target(ep=3, ep_rank=0, num_layers=4, num_experts=4)),
    ("pp3", Target(pp=3, pp_rank=0, num_layers=4, num_experts=4)),
]


def layout_arrays(first: int) -> list[Arr]:
    """A small transformer's tensors with layout semantics (h=8, 4 layers, 4 experts)."""
    L = {
        "vocab": {"tp": {"dim": 0}, "vocab": {"dim": 0}},
        "qkv": {"tp": {"dim": 0}, "groups": 2, "layer": 1, "parts": [
            {"name": "q", "size": 8}, {"name": "k", "size": 4}, {"name": "v", "size": 4}]},
        "gate_up": {"tp": {"dim": 0}, "layer": 1, "parts": [
            {"name": "gate", "size": 12}, {"name": "up", "size": 12}]},
        "row": {"tp": {"dim": 1}, "layer": 2},
        "norm": {"layer": 3},
        "experts": {"experts": {"dim": 0, "count": 4}, "tp": {"dim": 1}, "layer": 0},
        "expert": {"expert": 2, "tp": {"dim": 0}, "layer": 0},
        "layers": {"layers": {"dim": 0, "count": 4}, "tp": {"dim": 2}},
    }
    spec = [
        ("embedding.word_embeddings.weight", "float32", (50, 8), "vocab"),
        ("layers.1.self_attention.linear_qkv.weight", "bfloat16", (16, 8), "qkv"),
        ("layers.1.mlp.linear_fc1.weight", "float32", (24, 8), "gate_up"),
        ("layers.2.mlp.linear_fc2.weight", "float16", (8, 12), "row"),
        ("layers.3.input_layernorm.weight", "float32", (8,), "norm"),
        ("layers.0.mlp.experts.weight", "float32", (4, 8, 6), "experts"),
        ("layers.0.mlp.experts.2.linear_fc1.weight", "float32", (12, 8), "expert"),
        ("stacked.linear.weight", "bfloat16", (4, 3, 8), "layers"),
    ]
    return [arr(f"model/{name}", dtype, shape, first + i,
                ucp={"role": "parameter", "layout": L[kind]})
            for i, (name, dtype, shape, kind) in enumerate(spec)]


@valid("layout")
def _layout(dest: Path) -> dict[str, Any]:
    arrays = layout_arrays(190)
    groups = [Group(("model",), {}, {"aliases": {
        "output_layer.weight": "embedding.word_embeddings.weight"}})]
    write_reference(dest, arrays, groups)
    return valid_expected(
        "Layout semantics (tensor-parallel split, vocabulary, fused parts with groups, "
        "stacked experts and layers, per-layer and per-expert tensors, a tied alias), with "
        "the local tensors that layout-aware readers produce for several target layouts, "
        "and targets they must refuse.",
        arrays, groups,
        targets=layout_targets(arrays, LAYOUT_CONFIGS),
        exercises=["UCP-1.0-R100", "UCP-1.0-R101", "UCP-1.0-R102", "UCP-1.0-R103",
                   "UCP-1.0-R104", "UCP-1.0-R105", "UCP-1.0-R106", "UCP-1.0-R107",
                   "UCP-1.0-R108", "UCP-1.0-R110", "UCP-1.0-R111", "UCP-1.0-R112",
                   "UCP-1.0-R113"])


#: Targets that pin the layout chapter's R115 to R119: stage conventions, the number of
#: layers and experts a configuration gives or leaves out, uneven stages, vocabulary padding
#: without tp, group-major order at TP 1.
CONVENTION_CONFIGS: list[tuple[str, Target]] = [
    ("tp1.group", Target(fused_order="group-major")),
    ("tp2.r1.v4", Target(tp=2, tp_rank=1, vocab_multiple=4)),
    ("pp2.r1", Target(pp=2, pp_rank=1, num_layers=4)),
    ("pp2.r0.last", Target(pp=2, pp_rank=0, num_layers=4, stage="last")),
    ("pp3.r2.first_and_last", Target(pp=3, pp_rank=2, pp_layers=(1, 1, 2),
                                      stage="first_and_last")),
    ("pp3.r1.first", Target(pp=3, pp_rank=1, num_layers=4, pp_layers=(2, 1, 1),
                            stage="first")),
    ("pp3.r2.uneven", Target(pp=3, pp_rank=2, num_layers=4)),
    ("pp2.r1.no-num-layers", Target(pp=2, pp_rank=1)),
    ("pp2.r0.num-layers-8", Target(pp=2, pp_rank=0, num_layers=8)),
    ("pp2.r0.pp-layers-bad-sum", Target(pp=2, pp_rank=0, num_layers=4, pp_layers=(1, 2))),
    ("ep2.r1.no-num-experts", Target(ep=2, ep_rank=1)),
    ("ep2.r1.num-experts-8", Target(ep=2, ep_rank=1, num_experts=8)),
    ("ep2.r1", Target(ep=2, ep_rank=1, num_experts=4)),
    ("ep1.num-experts-2", Target(num_experts=2)),  # expert 2 of 2 experts: refused (R117)
    ("ep1.no-num-experts", Target()),  # ep 1 and no E: the one rank holds every expert
]


@valid("layout-conventions")
def _layout_conventions(dest: Path) -> dict[str, Any]:
    L = {
        "vocab": {"tp": {"dim": 0}, "vocab": {"dim": 0}},
        "vocab_no_tp": {"vocab": {"dim": 0}},
        "qkv": {"tp": {"dim": 0}, "groups": 2, "layer": 3, "parts": [
            {"name": "q", "size": 4}, {"name": "k", "size": 2}, {"name": "v", "size": 2}]},
        "norm": {},
        "stacked": {"layers": {"dim": 0, "count": 4}},
        "experts": {"experts": {"dim": 0, "count": 4}, "layer": 1},
        "expert": {"expert": 2, "layer": 1},
    }
    spec = [
        ("embedding.word_embeddings.weight", "float32", (50, 4), "vocab"),
        ("output_layer.bias", "float32", (50,), "vocab_no_tp"),
        ("layers.3.self_attention.linear_qkv.weight", "bfloat16", (8, 4), "qkv"),
        ("final_layernorm.weight", "float32", (4,), "norm"),
        ("stacked.mlp.weight", "float16", (4, 3, 2), "stacked"),
        ("layers.1.mlp.experts.weight", "float32", (4, 2, 3), "experts"),
        ("layers.1.mlp.experts.2.linear_fc1.weight", "float32", (3, 2), "expert"),
    ]
    arrays = [arr(f"model/{name}", dtype, shape, 260 + i,
                  ucp={"role": "parameter", "layout": L[kind]})
              for i, (name, dtype, shape, kind) in enumerate(spec)]
    write_reference(dest, arrays)
    return valid_expected(
        "Local tensors that pin the layout chapter's conventions: a tensor with neither "
        "layer nor layers on the stages its convention names (R115); the number of layers "
        "from layers.count, refused when missing for per-layer tensors or different from the "
        "stack, uneven stages given by pp_layers (R116); the number of experts from the "
        "stack, refused when missing or different (R117); a vocabulary without tp padded to "
        "m x tp like the split one (R118); group-major order at TP 1 (R119).",
        arrays, targets=layout_targets(arrays, CONVENTION_CONFIGS),
        exercises=["UCP-1.0-R112", "UCP-1.0-R111", "UCP-1.0-R115", "UCP-1.0-R116",
                   "UCP-1.0-R117", "UCP-1.0-R118", "UCP-1.0-R119", "UCP-1.0-R216"])


# -- valid cases written by other libraries ----------------------------------------------------


def _chunk_key() -> dict[str, Any]:
    return {"name": "default", "configuration": {"separator": "/"}}


def _chain(dtype: str, compressor: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    one_byte = dtypes.by_name(dtype).itemsize == 1
    chain: list[dict[str, Any]] = [
        {"name": "bytes"} if one_byte else {"name": "bytes", "configuration": {"endian": "little"}}
    ]
    if compressor:
        chain.append(dict(compressor))
    chain.append({"name": "crc32c"})
    return chain


@valid("tensorstore-written")
def _tensorstore(dest: Path) -> dict[str, Any]:
    import tensorstore as ts

    zstd = {"name": "zstd", "configuration": {"level": 3, "checksum": False}}
    gzip = {"name": "gzip", "configuration": {"level": 5}}
    items: list[tuple[Arr, Any]] = []
    plan = [
        ("model/w.bf16", "bfloat16", (12, 8), (4, 8), (8, 8), zstd),
        ("model/w.f8e4m3fn", "float8_e4m3fn", (6, 5), (4, 5), None, None),
        ("model/w.f8e5m2", "float8_e5m2", (6, 5), (2, 5), (6, 5), gzip),
        ("model/w.i64", "int64", (9, 3), (4, 3), (8, 3), gzip),
        ("model/w.bool", "bool", (10,), (4,), None, None),
        ("model/w.c128", "complex128", (3, 2), (2, 2), None, zstd),
        ("optimizer/state/w.bf16/exp_avg", "float32", (12, 8), (4, 8), (12, 8), None),
    ]
    for i, (name, dtype, shape, chunk, shard, comp) in enumerate(plan):
        a = arr(name, dtype, shape, 200 + i, chunk=chunk, shard=shard, compression=comp)
        if name.endswith("exp_avg"):
            a = zero_arr(name, dtype, shape, chunk=chunk, shard=shard)
        if shard is None:
            codecs: list[Any] = _chain(dtype, comp)
            grid = list(chunk)
        else:
            codecs = [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(chunk), "codecs": _chain(dtype, comp),
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}],
                "index_location": "end"}}]
            grid = list(shard)
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(dest / a.path)},
            "metadata": {
                "shape": list(shape), "data_type": dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
                "chunk_key_encoding": _chunk_key(),
                "fill_value": dtypes.fill_value_to_json(a.dt, a.meta().fill_value),
                "codecs": codecs,
                "attributes": {"ucp": {"role": "parameter"}},
            },
            "create": True,
            "store_data_equal_to_fill_value": True,
        }
        store = ts.open(spec).result()
        store[...] = a.data
        items.append((a, spec))
    # float8_e8m0fnu is left out: tensorstore 0.1.86 writes its fill values wrongly (0x00,
    # which is 2**-127, as 0.0; 0x7f, which is 1.0, as 1.8e19).
    # tensorstore writes chunk_key_encoding as {"name": "default"}, one of the spellings
    # UCP-1.0-R035 allows: its documents are kept as it wrote them.
    arrays = [a for a, _ in items]
    groups = {"optimizer": {"ucp": {"values": {"type": "torch.optim.Adam", "param_groups": [
        {"params": ["w.bf16"], "lr": 0.01}]}}}}
    commit_foreign(dest, {"producer": {"name": "tensorstore + conformance/generate.py",
                                       "version": "1.0"}, "created": CREATED}, groups)
    gvals = [Group(("optimizer",), {"type": "torch.optim.Adam",
                                    "param_groups": [{"params": ["w.bf16"], "lr": 0.01}]})]
    return valid_expected(
        "Arrays written by tensorstore's zarr3 driver (bfloat16, float8 types, gzip and zstd, "
        "sharded and unsharded, an all-zero state written with store_data_equal_to_fill_value); "
        "groups, manifest and root written by a json+hashlib helper, not by ucpformat.",
        arrays, gvals,
        writer="tensorstore (arrays); conformance/generate.py commit_foreign (groups, manifest, "
               "root)",
        exercises=["UCP-1.0-R020", "UCP-1.0-R030", "UCP-1.0-R035", "UCP-1.0-R050"])


@valid("zarr-python-written")
def _zarr_python(dest: Path) -> dict[str, Any]:
    import zarr
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

    plan: list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...] | None,
                     Any]] = [
        ("model/w", "float32", (16, 6), (4, 6), (8, 6), ZstdCodec(level=3)),
        ("model/b", "float16", (6,), (4,), None, None),
        ("model/ids", "int32", (5, 5), (2, 5), None,
         BloscCodec(cname="zstd", clevel=3, shuffle="shuffle", typesize=4, blocksize=0)),
        ("model/mask", "bool", (7,), (7,), None, None),
        ("training/rng", "uint8", (32,), (16,), None,
         BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=1, blocksize=0)),
        ("optimizer/state/w/exp_avg", "float32", (16, 6), (4, 6), (8, 6), None),
    ]
    arrays = []
    for i, (name, dtype, shape, chunk, shard, comp) in enumerate(plan):
        a = arr(name, dtype, shape, 220 + i, chunk=chunk, shard=shard)
        if name.endswith("exp_avg"):
            a = zero_arr(name, dtype, shape, chunk=chunk, shard=shard)
        one_byte = dtypes.by_name(dtype).itemsize == 1
        z = zarr.create_array(
            store=str(dest / a.path), shape=shape, dtype=dtype, chunks=chunk, shards=shard,
            serializer=BytesCodec(endian=None if one_byte else "little"),
            compressors=[c for c in (comp, Crc32cCodec()) if c is not None],
            filters=None, fill_value=False if dtype == "bool" else 0,
            attributes={"ucp": {"role": "parameter"}}, config={"write_empty_chunks": True},
        )
        z[...] = a.data
        arrays.append(a)
    groups = {"training": {"ucp": {"values": {"step": 11}}}}
    commit_foreign(dest, {"producer": {"name": "zarr-python + conformance/generate.py",
                                       "version": "1.0"}, "created": CREATED}, groups)
    return valid_expected(
        "Arrays written by zarr-python 3 (write_empty_chunks on: the all-zero optimizer state "
        "has every chunk), with zstd, gzip and blosc; groups, manifest and root written by a "
        "json+hashlib helper, not by ucpformat.",
        arrays, [Group(("training",), {"step": 11})],
        writer="zarr-python (arrays); conformance/generate.py commit_foreign (groups, manifest, "
               "root)",
        exercises=["UCP-1.0-R030", "UCP-1.0-R050", "UCP-1.0-R055"])


# -- invalid cases ----------------------------------------------------------------------------

R = "UCP-1.0-R"


#: Other requirements an implementation may name for a case (what a reader sees of it).
ALSO: dict[str, list[str]] = {
    "chunk-parent-is-file": ["031", "072"],
    "sparse-chunk-parent-is-file": ["031", "072"],
    "zstd-declares-other-size": ["047"],
    "shard-index-huge-range": ["098"],
    "root-edited-data-type": ["055"],
    "root-edited-sparse": ["055", "031"],
    "chunk-never-written": ["031"],
    "chunk-key-dot": ["021"],
    "root-byte-order-mark": ["001", "058"],
    "node-byte-order-mark": ["001"],
    "bool-byte-not-0-or-1": ["041"],
    "fill-hex-length": ["026"],
    "fill-hex-upper-case-prefix": ["026"],
    "fill-e4m3fn-rounds-beyond-range": ["026"],
    "fill-bfloat16-rounds-to-infinity": ["026"],
    "fill-e8m0fnu-not-power-of-two": ["026"],
    "chunk-key-short-hand": ["021"],
    "chunk-key-v2": ["021"],
    "sparse-not-boolean": ["029"],
    "name-dot-dot": ["091"],
    "name-too-long": ["010", "091"],
    "compressor-unknown": ["022"],
    "compressor-bad-level": ["022"],
    "blosc-without-blocksize": ["024"],
    "blosc-shuffle-without-typesize": ["024"],
    "index-crc32c-configured": ["040"],
    "no-crc32c": ["022"],
    "endian-big": ["022"],
    "index-codecs-without-crc32c": ["022"],
    "symlink-outside": ["041"],
    "symlink-inside": ["041"],
    "chunk-is-directory": ["031", "041"],
    "layout-parts-without-tp": ["100"],
}


def invalid(name: str, stage: str, violates: Sequence[str], description: str,
            *, arrays: Callable[[], list[Arr]] | None = None,
            groups: Callable[[], list[Group]] | None = None, feature: str | None = None,
            **write_kw: Any) -> Callable[[Callable[[Damage], Any]], Callable[[Damage], Any]]:
    """Register an invalid case: a base checkpoint, then ``fn(Damage)`` breaks it
    (``feature``: the optional form an implementation must declare to be given it)."""

    def register(fn: Callable[[Damage], Any]) -> Callable[[Damage], Any]:
        def build(dest: Path) -> dict[str, Any]:
            arrs = write_base(dest, arrays() if arrays else None,
                              groups() if groups else None, **write_kw)
            request = request_for(arrs)
            override = fn(Damage(dest))
            if isinstance(override, dict):
                request = override
            doc: dict[str, Any] = {
                "$schema": SCHEMA_ID,
                "ucp_conformance": "1.0",
                "kind": "invalid",
                "description": description,
                "violates": [v if v.startswith("UCP-") else R + v for v in violates],
                "stage": stage,
                "request": request,
            }
            if name in ALSO:
                doc["also"] = [R + v for v in ALSO[name]]
            if feature is not None:
                doc["feature"] = feature
            return doc

        INVALID[name] = build
        return fn

    return register


def _set(path: Sequence[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _del(*path: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return edit


# open: the root zarr.json alone shows the problem; readers refuse before returning data


@invalid("no-root-interrupted", "open", ["051"],
         "A save that never committed: data, node metadata and the in-progress marker, but no "
         "root zarr.json.")
def _(d: Damage) -> None:
    d.delete("zarr.json")
    d.path("write-in-progress.ucp.json").write_bytes(_json({"writer": "interrupted"}))


@invalid("no-root", "open", ["051"],
         "Everything but the root zarr.json (and no in-progress marker).")
def _(d: Damage) -> None:
    d.delete("zarr.json")


@invalid("root-nan-token", "open", ["001"],
         "The root zarr.json holds the non-standard JSON token NaN.")
def _(d: Damage) -> None:
    d.replace_in_root('"step": 3', '"step": NaN')


@invalid("root-duplicate-member", "open", ["001"],
         "The root's attributes.ucp has the member version twice (JSON objects must not).")
def _(d: Damage) -> None:
    d.replace_in_root('"version": "1.0"', '"version": "1.0",\n      "version": "2.0"')


BOM = b"\xef\xbb\xbf"


@invalid("root-byte-order-mark", "open", ["009"],
         "The root zarr.json begins with a UTF-8 byte order mark (EF BB BF); RFC 8259 lets "
         "parsers skip it, UCP 1.0 has readers refuse it.")
def _(d: Damage) -> None:
    d.path("zarr.json").write_bytes(BOM + d.read("zarr.json"))


@invalid("node-byte-order-mark", "validate", ["009"],
         "The zarr.json of model/fc.bias begins with a byte order mark (its consolidated copy "
         "in the root is the same document without it).")
def _(d: Damage) -> None:
    key = "model/fc.bias/zarr.json"
    d.put(key, BOM + d.read(key))


@invalid("array-unknown-member", "open", ["007"],
         "The array model/fc.bias has a member zarr v3 does not define, not marked "
         '"must_understand": false: zarr v3 implementations refuse to open it.')
def _(d: Damage) -> None:
    d.edit_node("model/fc.bias", _set(["x_quantization"], {"bits": 4}))


@invalid("group-unknown-member", "open", ["007"],
         "The group training has a member zarr v3 does not define, not marked "
         '"must_understand": false.')
def _(d: Damage) -> None:
    d.edit_node("training", _set(["x_schedule"], "cosine"))


@invalid("root-not-zarr-v3", "open", ["001"], "The root says zarr_format 2.")
def _(d: Damage) -> None:
    d.edit_root(_set(["zarr_format"], 2))


@invalid("root-without-ucp", "open", ["002"], "The root's attributes have no ucp member.")
def _(d: Damage) -> None:
    d.edit_root(_set(["attributes"], {"other": {}}))


@invalid("version-missing", "open", ["003", "002"], "attributes.ucp has no version.")
def _(d: Damage) -> None:
    d.ucp(_del("version"))


@invalid("version-malformed", "open", ["003"], "The version is '1.0.0', not 'MAJOR.MINOR'.")
def _(d: Damage) -> None:
    d.ucp(_set(["version"], "1.0.0"))


@invalid("major-version-2", "open", ["060"],
         "Version 2.0: a future major version, which a 1.x reader refuses cleanly, naming it.")
def _(d: Damage) -> None:
    d.ucp(_set(["version"], "2.0"))


@invalid("must-understand", "open", ["061"],
         "must_understand lists a feature 1.0 does not define.")
def _(d: Damage) -> None:
    d.ucp(_set(["must_understand"], ["chunk-encryption"]))


@invalid("no-consolidated-metadata", "open", ["052"],
         "The root has no consolidated metadata.")
def _(d: Damage) -> None:
    d.edit_root(_del("consolidated_metadata"))


@invalid("missing-parent-group", "open", ["005"],
         "The group optimizer/state is absent, though arrays under it exist.")
def _(d: Damage) -> None:
    d.delete("optimizer/state/zarr.json", unlist=True)
    d.edit_root(lambda root: root["consolidated_metadata"]["metadata"].pop("optimizer/state"))


@invalid("name-lowercase-escape", "open", ["010"],
         "The node name emb%2eweight uses lower-case hexadecimal.")
def _(d: Damage) -> None:
    d.rename_node("model/emb.weight", "model/emb%2eweight")


@invalid("name-needless-escape", "open", ["010"],
         "The node name fc%2Ebias escapes a character that stands for itself: not canonical.")
def _(d: Damage) -> None:
    d.rename_node("model/fc.bias", "model/fc%2Ebias")


@invalid("name-dot-dot", "open", ["010"],
         "A node path with a '..' component (training/../rng), which could reach outside.")
def _(d: Damage) -> None:
    d.edit_root(lambda root: root["consolidated_metadata"]["metadata"].__setitem__(
        "training/../rng", root["consolidated_metadata"]["metadata"].pop("training/rng")))


@invalid("name-empty-path", "open", ["010"],
         "The consolidated metadata has an entry for the empty path (a copy of the group "
         "training): the root is not one of its own nodes, and every node has a name.")
def _(d: Damage) -> None:
    d.edit_root(lambda root: root["consolidated_metadata"]["metadata"].__setitem__(
        "", root["consolidated_metadata"]["metadata"]["training"]))


@invalid("name-nul", "open", ["010"],
         "The node name fc%00bias decodes to a name with U+0000, which is no logical name.")
def _(d: Damage) -> None:
    d.rename_node("model/fc.bias", "model/fc%00bias")


@invalid("name-too-long", "open", ["012"],
         "A node name of 256 bytes (only in the consolidated metadata: the files keep their "
         "names, since no file system would take it).")
def _(d: Damage) -> None:
    d.rename_node("model/fc.bias", "model/" + "b" * 256, move_files=False)


def _array(name: str, fn: Callable[[dict[str, Any]], None]) -> Callable[[Damage], None]:
    def damage(d: Damage) -> None:
        d.edit_node(name, fn)
    return damage


def _codec(name: str, index: int, value: Any, *, inner: bool = False
           ) -> Callable[[Damage], None]:
    def edit(doc: dict[str, Any]) -> None:
        chain = doc["codecs"][0]["configuration"]["codecs"] if inner else doc["codecs"]
        if value is None:
            del chain[index]
        else:
            chain[index] = value
    return _array(name, edit)


ARRAY_CASES: list[tuple[str, str, list[str], str, Callable[[Damage], None]]] = [
    ("dtype-float8-e4m3", "open", ["020"],
     "PyTorch's float8_e4m3fn bits under the name float8_e4m3, a different type that is not "
     "in Table 1.", _array("model/scale", _set(["data_type"], "float8_e4m3"))),
    ("dtype-int4", "open", ["020"], "The data type int4 is not in Table 1.",
     _array("model/scale", _set(["data_type"], "int4"))),
    ("chunk-grid-rectilinear", "open", ["021"], "A chunk grid other than 'regular'.",
     _array("model/fc.bias", _set(["chunk_grid", "name"], "rectilinear"))),
    ("chunk-key-dot", "open", ["035"], "chunk_key_encoding with separator '.'.",
     _array("model/fc.bias", _set(["chunk_key_encoding", "configuration", "separator"], "."))),
    ("chunk-key-short-hand", "open", ["035"],
     "chunk_key_encoding as the short-hand name \"default\" (zarr 3.1), not an object.",
     _array("model/fc.bias", _set(["chunk_key_encoding"], "default"))),
    ("chunk-key-v2", "open", ["035"], "The v2 chunk key encoding, with separator '/'.",
     _array("model/fc.bias", _set(["chunk_key_encoding"],
                                  {"name": "v2", "configuration": {"separator": "/"}}))),
    ("codec-transpose", "open", ["022"], "A transpose codec before bytes.",
     _array("model/emb.weight", lambda doc: doc["codecs"].insert(
         0, {"name": "transpose", "configuration": {"order": [1, 0]}}))),
    ("codec-two-compressors", "open", ["022"], "zstd and gzip in one chunk chain.",
     _array("optimizer/state/fc.weight/exp_avg", lambda doc: doc["codecs"].insert(
         2, {"name": "gzip", "configuration": {"level": 5}}))),
    ("endian-on-one-byte-type", "open", ["023"],
     "The bytes codec of a 1-byte type declares endian.",
     _codec("model/scale", 0, {"name": "bytes", "configuration": {"endian": "little"}})),
    ("endian-big", "open", ["023"], "A big-endian float32 array.",
     _codec("model/fc.bias", 0, {"name": "bytes", "configuration": {"endian": "big"}})),
    ("endian-missing", "open", ["023"],
     "The bytes codec of a 2-byte type (bfloat16) without endian.",
     _codec("model/emb.weight", 0, {"name": "bytes"})),
    ("compressor-unknown", "open", ["024"], "The compressor 'lz4' is not in the closed list.",
     _codec("optimizer/state/fc.weight/exp_avg", 1,
            {"name": "lz4", "configuration": {"level": 1}})),
    ("compressor-bad-level", "open", ["024"], "zstd with level 99.",
     _codec("optimizer/state/fc.weight/exp_avg", 1,
            {"name": "zstd", "configuration": {"level": 99, "checksum": False}})),
    ("blosc-without-blocksize", "open", ["039"],
     "A blosc configuration without blocksize (required: 0 asks for the automatic size).",
     _codec("optimizer/state/fc.weight/exp_avg", 1, {"name": "blosc", "configuration": {
         "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": 4}})),
    ("blosc-shuffle-without-typesize", "open", ["039"],
     "A blosc configuration that shuffles without a typesize.",
     _codec("optimizer/state/fc.weight/exp_avg", 1, {"name": "blosc", "configuration": {
         "cname": "lz4", "clevel": 5, "shuffle": "bitshuffle", "blocksize": 0}})),
    ("storage-transformers", "open", ["025"], "A storage transformer.",
     _array("model/fc.bias", _set(["storage_transformers"], [{"name": "offset"}]))),
    ("fill-infinity-e4m3fn", "open", ["026"],
     "fill_value 'Infinity' for float8_e4m3fn, which has no infinities.",
     _array("model/scale", _set(["fill_value"], "Infinity"))),
    ("fill-hex-length", "open", ["038"],
     "A bfloat16 fill value with three hexadecimal digits.",
     _array("model/emb.weight", _set(["fill_value"], "0x3f8"))),
    ("fill-hex-upper-case-prefix", "open", ["038"],
     "A bfloat16 fill value with the prefix 0X (the digits may be upper case, the x not).",
     _array("model/emb.weight", _set(["fill_value"], "0X3f80"))),
    ("fill-e4m3fn-rounds-beyond-range", "open", ["036"],
     "fill_value 465 for float8_e4m3fn: it rounds to 480, beyond the largest value 448, "
     "which a reader must refuse, not saturate (to 448) or read as NaN.",
     _array("model/scale", _set(["fill_value"], 465))),
    ("fill-bfloat16-rounds-to-infinity", "open", ["036"],
     "fill_value 3.4e38 for bfloat16: it rounds to 2**128, beyond the largest value, which a "
     "reader must refuse, not read as infinity.",
     _array("model/emb.weight", _set(["fill_value"], 3.4e38))),
    ("fill-out-of-range", "open", ["026"], "fill_value 300 for uint8.",
     _array("training/rng", _set(["fill_value"], 300))),
    ("shape-too-many-bytes", "open", ["027"],
     "A shape of 2**62 float32 elements: more than 2**63-1 bytes.",
     _array("model/fc.bias", _set(["shape"], [2**62]))),
    ("chunk-shape-zero", "open", ["027"], "A chunk shape with a 0.",
     _array("model/fc.bias", _set(["chunk_grid", "configuration", "chunk_shape"], [0]))),
    ("shard-not-multiple", "open", ["028"],
     "A shard of 4 x 6 with inner chunks of 3 x 6.",
     _array("model/fc.weight", _set(["codecs", 0, "configuration", "chunk_shape"], [3, 6]))),
    ("shard-too-many-chunks", "open", ["028"],
     "A shard of 2**25 inner chunks (the index alone would be 512 MiB).",
     _array("model/fc.weight", lambda doc: (
         doc["chunk_grid"]["configuration"].__setitem__("chunk_shape", [2**13, 2**12]),
         doc["codecs"][0]["configuration"].__setitem__("chunk_shape", [1, 1])))),
    ("ucp-not-object", "open", ["029"], "An array whose attributes.ucp is a string.",
     _array("model/fc.bias", _set(["attributes", "ucp"], "parameter"))),
    ("sparse-not-boolean", "open", ["032"], "attributes.ucp.sparse is the string 'yes'.",
     _array("model/fc.bias", _set(["attributes", "ucp", "sparse"], "yes"))),
    ("no-crc32c", "open", ["040"], "A chunk chain that ends with zstd, without crc32c.",
     _codec("optimizer/state/fc.weight/exp_avg", 2, None)),
    ("index-codecs-without-crc32c", "open", ["040"], "Shard index codecs without crc32c.",
     _array("model/fc.weight", _set(["codecs", 0, "configuration", "index_codecs"],
                                    [{"name": "bytes", "configuration": {"endian": "little"}}]))),
    ("index-crc32c-configured", "open", ["046"],
     "The crc32c codec of a shard's index_codecs with a configuration member.",
     _array("model/fc.weight", _set(["codecs", 0, "configuration", "index_codecs", 1],
                                    {"name": "crc32c", "configuration": {"seed": 0}}))),
]


def _register_array_cases() -> None:
    for name, stage, violates, description, fn in ARRAY_CASES:
        invalid(name, stage, violates, description)(fn)


_register_array_cases()


# read: the metadata is fine; reading the damaged tensor shows the problem


@invalid("fill-e8m0fnu-not-power-of-two", "open", ["036"],
         "fill_value 3.0 for float8_e8m0fnu, which holds powers of two only: refused, not "
         "rounded (to 2 or 4).",
         arrays=lambda: [*base_arrays(), arr("model/block_scale", "float8_e8m0fnu", (4,), 320)])
def _(d: Damage) -> None:
    d.edit_node("model/block_scale", _set(["fill_value"], 3.0))


@invalid("missing-chunk", "read", ["031"],
         "A chunk of model/fc.bias that the manifest lists is gone.")
def _(d: Damage) -> None:
    d.delete("model/fc.bias/c/1")


@invalid("chunk-never-written", "read", ["030"],
         "The only chunk of the all-zero model/norm.bias was never written (zarr's "
         "write_empty_chunks=False trap): it is neither on disk nor in the manifest.")
def _(d: Damage) -> None:
    d.delete("model/norm.bias/c/0", unlist=True)


@invalid("missing-shard", "read", ["031"], "A shard of model/fc.weight is gone.")
def _(d: Damage) -> None:
    d.delete("model/fc.weight/c/1/0")


@invalid("empty-index-entry", "read", ["031"],
         "A shard index entry of model/fc.weight is empty (2**64-1, 2**64-1), index CRC "
         "correct: the inner chunk was never written.")
def _(d: Damage) -> None:
    key = "model/fc.weight/c/0/0"
    index = d.shard_index(key, 2)
    index[1] = (2**64 - 1, 2**64 - 1)
    d.set_shard_index(key, index)


@invalid("crc-chunk", "read", ["041"],
         "A byte of a chunk of model/fc.bias flipped; the CRC32C no longer matches.")
def _(d: Damage) -> None:
    d.rewrite_chunk("model/fc.bias/c/0", lambda p: bytes([p[0] ^ 0x40]) + p[1:], recrc=False)


@invalid("crc-shard-index", "read", ["041"],
         "A byte of a shard index of model/fc.weight flipped.")
def _(d: Damage) -> None:
    key = "model/fc.weight/c/0/0"
    index = d.shard_index(key, 2)
    index[0, 1] ^= 1
    d.set_shard_index(key, index, recrc=False)


@invalid("truncated-shard", "read", ["041"], "A shard of model/fc.weight cut in half.")
def _(d: Damage) -> None:
    key = "model/fc.weight/c/1/0"
    data = d.read(key)
    d.put(key, data[: len(data) // 2])


@invalid("index-out-of-bounds", "read", ["094"],
         "A shard index entry points past the end of its shard (index CRC correct).")
def _(d: Damage) -> None:
    key = "model/fc.weight/c/0/0"
    index = d.shard_index(key, 2)
    index[1, 0] = 4096
    d.set_shard_index(key, index)


@invalid("zstd-declares-other-size", "read", ["093"],
         "A zstd chunk (its CRC32C correct) whose frame declares twice the chunk's decoded "
         "size: refused before decompressing.")
def _(d: Damage) -> None:
    import numcodecs

    zstd = numcodecs.Zstd(level=1)
    d.rewrite_chunk("optimizer/state/fc.weight/exp_avg/c/0/0",
                    lambda p: bytes(zstd.encode(bytes(zstd.decode(p)) * 2)))


def _zstd_frame(raw: bytes, *, content_size: bool = True, window_log: int | None = None
                ) -> bytes:
    """One zstd frame of ``raw`` (libzstd one-shot, a single-segment frame), its header
    rewritten: without the content size, or with a window of 2**window_log bytes."""
    import numcodecs

    frame = bytes(numcodecs.Zstd(level=1).encode(raw))
    fhd = frame[4]
    assert fhd & 0x20 and not fhd & 3, "numcodecs writes single-segment frames"
    fcs_len = (1, 2, 4, 8)[fhd >> 6]
    blocks = frame[5 + fcs_len:]
    if content_size:
        assert window_log is not None
        header = bytes([(fhd & 0x1F) | 0x80, (window_log - 10) << 3])
        header += len(raw).to_bytes(4, "little")
    else:
        log = max(10, (len(raw) - 1).bit_length())
        header = bytes([fhd & 0x1F, (log - 10) << 3])
    return frame[:4] + header + blocks


@invalid("zstd-two-frames", "read", ["047"],
         "A zstd chunk (its CRC32C correct) made of two frames, each declaring half of the "
         "chunk's decoded size: one frame per chunk, so a reader that allocates from each "
         "frame's header has one bound to check.")
def _(d: Damage) -> None:
    import numcodecs

    zstd = numcodecs.Zstd(level=1)

    def two(p: bytes) -> bytes:
        raw = bytes(zstd.decode(p))
        half = len(raw) // 2
        return bytes(zstd.encode(raw[:half])) + bytes(zstd.encode(raw[half:]))
    d.rewrite_chunk("optimizer/state/fc.weight/exp_avg/c/0/0", two)


@invalid("zstd-no-content-size", "read", ["047"],
         "A zstd chunk (its CRC32C correct) whose frame does not declare its content size, "
         "as streaming compression writes it: the size is checked before decompressing.")
def _(d: Damage) -> None:
    import numcodecs

    zstd = numcodecs.Zstd(level=1)
    d.rewrite_chunk("optimizer/state/fc.weight/exp_avg/c/1/0",
                    lambda p: _zstd_frame(bytes(zstd.decode(p)), content_size=False))


@invalid("zstd-window-beyond-chunk", "read", ["047"],
         "A zstd chunk of 96 bytes (CRC32C correct, content size declared correctly) whose "
         "frame declares a window of 1 MiB: a decoder that allocates the window would "
         "allocate more than the chunk.")
def _(d: Damage) -> None:
    import numcodecs

    zstd = numcodecs.Zstd(level=1)
    d.rewrite_chunk("optimizer/state/fc.weight/exp_avg/c/0/0",
                    lambda p: _zstd_frame(bytes(zstd.decode(p)), window_log=20))


@invalid("zstd-dictionary-id-zero", "read", ["047"],
         "A zstd chunk (its CRC32C correct) whose frame header has a Dictionary_ID field of "
         "value 0: R047 allows no Dictionary_ID field at all (1.0.1), although libzstd "
         "decodes this frame without a dictionary.")
def _(d: Damage) -> None:
    def with_dictionary_id(p: bytes) -> bytes:
        frame = bytes(p)
        fhd = frame[4]
        assert fhd & 0x20 and not fhd & 3, "numcodecs writes single-segment frames"
        # the Dictionary_ID field follows the header descriptor (no window descriptor
        # in a single-segment frame)
        return frame[:4] + bytes([fhd | 1, 0]) + frame[5:]
    d.rewrite_chunk("optimizer/state/fc.weight/exp_avg/c/0/0", with_dictionary_id)


@invalid("zstd-small-chunk-window-1kib", "read", ["047"],
         "A zstd chunk of 96 bytes (CRC32C correct, content size declared) whose frame does "
         "not set Single_Segment_flag and so declares the smallest window a descriptor "
         "can, 1 KiB: more than the chunk, refused as R047 says, literally (1.0.1).")
def _(d: Damage) -> None:
    import numcodecs

    zstd = numcodecs.Zstd(level=1)
    d.rewrite_chunk("optimizer/state/fc.weight/exp_avg/c/1/0",
                    lambda p: _zstd_frame(bytes(zstd.decode(p)), window_log=10))


def _gzip_arrays() -> list[Arr]:
    """The base checkpoint with exp_avg compressed by gzip."""
    return [arr("optimizer/state/fc.weight/exp_avg", "float32", (8, 6), 5, chunk=(4, 6),
                compression={"name": "gzip", "configuration": {"level": 1}},
                ucp={"role": "optimizer_state"}) if a.name[-1] == "exp_avg" else a
            for a in base_arrays()]


@invalid("chunk-over-bound-by-crc", "read", ["098"],
         "An unsharded gzip chunk of 96 bytes stored in 65,729 bytes, one more than 2 x 96 + "
         "65,536, counting its 4-byte CRC32C: without the CRC32C it is within the bound. "
         "One valid gzip member whose header carries a comment (FCOMMENT) as padding; "
         "the stored size counts the CRC32C (1.0.1).", arrays=_gzip_arrays)
def _(d: Damage) -> None:
    import zlib

    key = "optimizer/state/fc.weight/exp_avg/c/0/0"
    bound = 2 * 96 + 65_536

    def padded(p: bytes) -> bytes:
        raw = zlib.decompress(p, 16 + zlib.MAX_WBITS)
        deflate = zlib.compressobj(1, zlib.DEFLATED, -zlib.MAX_WBITS)
        body = deflate.compress(raw) + deflate.flush()
        trailer = zlib.crc32(raw).to_bytes(4, "little") + len(raw).to_bytes(4, "little")
        head = bytes([0x1F, 0x8B, 8, 0x10, 0, 0, 0, 0, 0, 255])
        comment = len(head) + len(body) + len(trailer) + 1  # the comment's zero byte
        member_size = bound + 1 - 4  # the stored chunk is one byte over, with its CRC32C
        return head + b"p" * (member_size - comment) + b"\0" + body + trailer
    d.rewrite_chunk(key, padded)
    assert len(d.read(key)) == bound + 1


def _forge_crc(head: bytes, tail: bytes, target: int) -> bytes:
    """Four bytes X with crc32c(head + X + tail) == target (CRC32C is affine over GF(2))."""
    from ucpformat.engine.checksum import crc32c

    def f(x: int) -> int:
        return crc32c(head + x.to_bytes(4, "little") + tail)

    base = f(0)
    columns = [f(1 << i) ^ base for i in range(32)]  # the image of each bit of X
    want = target ^ base
    # Gaussian elimination over GF(2): rows are (image, the X bits that make it)
    rows = [(columns[i], 1 << i) for i in range(32)]
    basis: list[tuple[int, int]] = []
    for image, combo in rows:
        for b_image, b_combo in basis:
            if image ^ b_image < image:
                image, combo = image ^ b_image, combo ^ b_combo
        if image:
            basis.append((image, combo))
            basis.sort(reverse=True)
    x = 0
    for b_image, b_combo in basis:
        if want ^ b_image < want:
            want, x = want ^ b_image, x ^ b_combo
    assert want == 0 and f(x) == target
    return x.to_bytes(4, "little")


@invalid("index-entry-overlaps-index", "read", ["048"],
         "An inner chunk's index entry points at bytes that run into the shard's own index "
         "(the last 24 of its 52 bytes are index bytes), crafted so that its CRC32C and the "
         "index's CRC32C are both correct: only the range tells the damage.")
def _(d: Damage) -> None:
    from ucpformat.engine.checksum import crc_bytes

    key = "model/fc.weight/c/0/0"
    data = bytearray(d.read(key))
    isize = 2 * 16 + 4
    start = len(data) - isize  # where the index starts
    offset, nbytes = start - 28, 52  # the chunk's last 24 bytes are the index's first 24
    index = d.shard_index(key, 2)
    index[1] = (offset, nbytes)
    body = np.ascontiguousarray(index, dtype="<u8").tobytes()
    data[start:start + len(body)] = body
    # the chunk's CRC is its last 4 bytes (index bytes: the high half of this entry's
    # offset, 0): force bytes [offset, offset + 4) so that the payload's CRC32C is that
    payload_end = offset + nbytes - 4
    stored = int.from_bytes(data[payload_end:payload_end + 4], "little")
    data[offset:offset + 4] = _forge_crc(b"", bytes(data[offset + 4:payload_end]), stored)
    data[start + len(body):] = crc_bytes(body)
    d.put(key, bytes(data))


@invalid("shard-index-huge-range", "read", ["094"],
         "A shard index entry claims 2**40 bytes (index CRC correct): refused at the cost of "
         "the shard's real size.")
def _(d: Damage) -> None:
    key = "model/fc.weight/c/0/0"
    index = d.shard_index(key, 2)
    index[1, 1] = 2**40
    d.set_shard_index(key, index)


@invalid("undecompressable", "read", ["041"],
         "A zstd chunk whose payload is not zstd data (its CRC32C is correct).")
def _(d: Damage) -> None:
    d.rewrite_chunk("optimizer/state/fc.weight/exp_avg/c/0/0", lambda p: b"\x00" * len(p))


@invalid("wrong-chunk-size", "read", ["041"],
         "An uncompressed chunk of 12 bytes where 16 are due (its CRC32C is correct).")
def _(d: Damage) -> None:
    d.rewrite_chunk("model/fc.bias/c/0", lambda p: p[:12])


@invalid("bool-byte-not-0-or-1", "read", ["008"],
         "A chunk of the bool array model/mask stores the byte 0x02 (its CRC32C correct): "
         "damage, which a reader refuses rather than read as true.",
         arrays=lambda: [*base_arrays(), arr("model/mask", "bool", (6,), 322, chunk=(4,))])
def _(d: Damage) -> None:
    d.rewrite_chunk("model/mask/c/0", lambda p: p[:1] + b"\x02" + p[2:])


@invalid("symlink-outside", "read", ["091"],
         "A chunk file that is a symbolic link to a file outside the checkpoint.")
def _(d: Damage) -> None:
    key = "training/rng/c/0"
    d.delete(key)
    os.symlink("../../../../expected.json", d.path(key))


@invalid("symlink-inside", "read", ["089"],
         "A chunk file that is a symbolic link to a file inside the checkpoint with the "
         "same bytes: no link under a checkpoint is followed.")
def _(d: Damage) -> None:
    key = "training/rng/c/0"
    os.replace(d.path(key), d.path("training/rng/c/0-target"))
    os.symlink("0-target", d.path(key))


@invalid("chunk-is-directory", "read", ["091"],
         "Where a chunk file is expected there is a directory.")
def _(d: Damage) -> None:
    key = "training/rng/c/0"
    d.delete(key)
    d.path(key).mkdir()
    (d.path(key) / "placeholder").write_bytes(b"not a chunk")


# validate: readers may read these; validators report them


@invalid("version-outside-root", "validate", ["003"],
         "An array's attributes.ucp has a version member (only the root has one).")
def _(d: Damage) -> None:
    d.edit_ucp("model/fc.bias", _set(["version"], "1.0"))


@invalid("model-is-array", "validate", ["004"],
         "The reserved top-level name model is an array, not a group.",
         arrays=lambda: [arr("model", "float32", (4,), 300),
                         arr("training/rng", "uint8", (4,), 301)],
         groups=lambda: [])
def _(d: Damage) -> None:
    return None


@invalid("reserved-root-suffix", "validate", ["004"],
         "A top-level group named notes.ucp.json (the .ucp.json suffix is reserved).",
         groups=lambda: [*base_groups(), Group(("notes.ucp.json",), {"text": "hello"})])
def _(d: Damage) -> None:
    return None


@invalid("case-collision", "validate", ["013"],
         "Two children of model, fc.bias and FC.BIAS, equal after ASCII case folding. (Only "
         "the consolidated metadata has the second, so that this repository stays usable on "
         "case-insensitive file systems.)")
def _(d: Damage) -> None:
    d.edit_root(lambda root: root["consolidated_metadata"]["metadata"].__setitem__(
        "model/FC.BIAS", root["consolidated_metadata"]["metadata"]["model/fc.bias"]))


@invalid("manifest-missing", "validate", ["042"], "manifest.ucp.json is gone.")
def _(d: Damage) -> None:
    d.delete("manifest.ucp.json")


@invalid("manifest-entry-without-sha256", "validate", ["042"],
         "hash_algorithm is sha256 but one entry has no sha256.")
def _(d: Damage) -> None:
    d.listing(lambda files: files["model/fc.bias/c/0"].pop("sha256"))


@invalid("manifest-incomplete", "validate", ["042"],
         "The manifest does not list model/fc.bias/zarr.json.")
def _(d: Damage) -> None:
    d.listing(lambda files: files.pop("model/fc.bias/zarr.json"))


@invalid("manifest-without-root-copy", "validate", ["045"],
         "The manifest holds no copy of the root's attributes (root_attributes).")
def _(d: Damage) -> None:
    doc = d.manifest()
    del doc["root_attributes"]
    d.write_manifest(doc)


@invalid("root-attributes-unsealed", "validate", ["045"],
         "The root's attributes changed after the commit: they differ from the copy the "
         "manifest seals.")
def _(d: Damage) -> None:
    d.ucp(_set(["metadata"], {"step": 999999}), seal=False)


@invalid("root-extra-member", "open", ["057"],
         "The root zarr.json has a member besides zarr_format, node_type, attributes and "
         "consolidated_metadata.")
def _(d: Damage) -> None:
    d.edit_root(_set(["x_extra"], {"hidden": True}))


# issue 13: the root is checked by its digest on open (R058); strings are Unicode (R006)


@invalid("root-digest-missing", "open", ["058"],
         "The root has no attributes.ucp.root_sha256: damage to it could not be detected.")
def _(d: Damage) -> None:
    d.edit_root(_del("attributes", "ucp", "root_sha256"), seal=False, digest=False)


@invalid("root-edited-data-type", "open", ["058"],
         "The root alone was edited after the commit: model/emb.weight's data type reads "
         "float16 instead of bfloat16 (same size, other values); its digest no longer "
         "matches.")
def _(d: Damage) -> None:
    d.edit_root(_set(["consolidated_metadata", "metadata", "model/emb.weight", "data_type"],
                     "float16"), seal=False, digest=False)


@invalid("root-edited-sparse", "open", ["058"],
         "The root alone was edited after the commit: model/fc.bias is marked sparse and its "
         "chunk deleted, so it would read as fill values; the root's digest no longer "
         "matches.")
def _(d: Damage) -> None:
    d.delete("model/fc.bias/c/0")
    d.edit_root(_set(["consolidated_metadata", "metadata", "model/fc.bias", "attributes",
                      "ucp", "sparse"], True), seal=False, digest=False)


@invalid("value-lone-surrogate", "open", ["006"],
         "A JSON value of the root holds the escape \\ud800, an unpaired surrogate: not "
         "Unicode text (no UTF-8 encoding).")
def _(d: Damage) -> None:
    d.replace_in_root('"step": 3', '"step": "\\ud800"')


@invalid("member-name-lone-surrogate", "open", ["006"],
         "A member name in the root's values holds the escape \\udc00, an unpaired "
         "surrogate.")
def _(d: Damage) -> None:
    d.replace_in_root('"step": 3', '"\\udc00step": 3')


@invalid("chunk-oversized", "read", ["098"],
         "An unsharded zstd chunk of 96 bytes is stored in 70,000 bytes: a valid frame, then "
         "a skippable frame of padding. No compressor needs more than twice a chunk's size "
         "plus 64 KiB; a reader refuses it unread.")
def _(d: Damage) -> None:
    key = "optimizer/state/fc.weight/exp_avg/c/0/0"
    payload = d.read(key)[:-4]
    padding = 70_000 - len(payload) - 12
    skippable = (0x184D2A50).to_bytes(4, "little") + padding.to_bytes(4, "little")
    body = payload + skippable + bytes(padding)
    d.put(key, body + crc_bytes(body))  # standard zstd: any decoder skips the padding


@invalid("chunk-parent-is-file", "read", ["099"],
         "Where model/fc.bias/c/ should be a directory holding the chunk 0, a file stands: "
         "the chunk cannot be read (the file system says 'not a directory').")
def _(d: Damage) -> None:
    d.delete("model/fc.bias/c")
    d.put("model/fc.bias/c", b"not a directory\n", listed=False)


def _sparse_arrays() -> list[Arr]:
    """The base checkpoint with model/fc.bias sparse."""
    return [arr("model/fc.bias", "float32", (6,), 2, chunk=(4,),
                ucp={"role": "parameter", "sparse": True}) if a.name[-1] == "fc.bias" else a
            for a in base_arrays()]


@invalid("sparse-chunk-parent-is-file", "read", ["099"],
         "As chunk-parent-is-file, in a sparse array: a file stands where model/fc.bias/c/ "
         "should be a directory. Something is there, so the chunks are not absent: refused, "
         "never read as fill values (1.0.1, R099).", arrays=_sparse_arrays)
def _(d: Damage) -> None:
    d.delete("model/fc.bias/c")
    d.put("model/fc.bias/c", b"not a directory\n", listed=False)


@invalid("deep-nesting", "validate", ["096"],
         "A JSON value of the root nested 100 levels deep (the limit is 80).")
def _(d: Damage) -> None:
    nested: Any = 0
    for _ in range(100):
        nested = [nested]
    d.ucp(_set(["values"], {"deep": nested}))


@invalid("huge-grid-not-written", "validate", ["030"],
         "A non-sparse array that claims 2**40 stored objects, none written: validators "
         "report it without enumerating them (R095).")
def _(d: Damage) -> None:
    def huge(doc: dict[str, Any]) -> None:
        doc["shape"] = [2**40]
        doc["chunk_grid"]["configuration"]["chunk_shape"] = [1]
        doc["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}},
                         {"name": "crc32c"}]
    d.edit_node("model/fc.bias", huge)


@invalid("manifest-digest-mismatch", "validate", ["043"],
         "The root's SHA-256 of the manifest is wrong.")
def _(d: Damage) -> None:
    d.ucp(_set(["manifest", "sha256"], "0" * 64), seal=False)


@invalid("file-size-mismatch", "validate", ["043"],
         "The manifest gives a chunk one byte more than it has.")
def _(d: Damage) -> None:
    d.listing(lambda files: files["model/fc.bias/c/0"].__setitem__(
        "nbytes", files["model/fc.bias/c/0"]["nbytes"] + 1))


@invalid("node-metadata-differs", "validate", ["055"],
         "model/fc.bias/zarr.json differs from its entry in the consolidated metadata.")
def _(d: Damage) -> None:
    doc = d.node("model/fc.bias")
    doc["attributes"]["ucp"]["role"] = "buffer"
    d.set_node("model/fc.bias", doc, consolidated=False)


@invalid("ucp-float-extra-member", "validate", ["070"],
         "A $ucp_float object with another member.")
def _(d: Damage) -> None:
    d.edit_ucp("training", _set(["values", "best_loss"],
                                {"$ucp_float": "Infinity", "note": "not yet"}))


@invalid("values-not-object", "validate", ["070"], "training's attributes.ucp.values is a list.")
def _(d: Damage) -> None:
    d.edit_ucp("training", _set(["values"], [1, 2, 3]))


def _rng_case_arrays(torch_cpu: str = "uint8") -> list[Arr]:
    return [a for a in base_arrays() if a.path != "training/rng"] + rng_arrays(
        191, torch_cpu=torch_cpu)


def _rng_case_groups() -> list[Group]:
    return [g for g in base_groups() if g.name != ("training",)] + rng_groups(199)


@invalid("rng-integer-rounded", "validate", ["085"],
         "The 128-bit state of a PCG64 generator in training/rng as a JSON number, which "
         "JSON parsers round (it must be a string of decimal digits).",
         arrays=_rng_case_arrays, groups=_rng_case_groups)
def _(d: Damage) -> None:
    d.edit_ucp("training/rng/generators/loader",
               _set(["values", "state.state"], 3.5399562948360463e37))


@invalid("rng-torch-state-float", "validate", ["085"],
         "PyTorch's CPU generator state in training/rng as float32, not the uint8 bytes of "
         "get_state().", arrays=lambda: _rng_case_arrays(torch_cpu="float32"),
         groups=_rng_case_groups)
def _(d: Damage) -> None:
    return None  # the arrays given are the damage


def _rank_case_arrays() -> list[Arr]:
    return [a for a in base_arrays() if a.path != "training/rng"] + rank_state_arrays(721)


def _rank_case_groups(world_size: int = 3) -> list[Group]:
    return [g for g in base_groups() if g.name != ("training",)] + rank_state_groups(
        world_size)


@invalid("rank-beyond-world-size", "validate", ["086"],
         "training/ranks/2 in a checkpoint whose training/ranks says the run had 2 processes "
         "(ranks 0 and 1).", arrays=_rank_case_arrays,
         groups=lambda: _rank_case_groups(world_size=2))
def _(d: Damage) -> None:
    return None  # the groups given are the damage


@invalid("ranks-without-world-size", "validate", ["086"],
         "training/ranks without world_size among its values.",
         arrays=_rank_case_arrays, groups=_rank_case_groups)
def _(d: Damage) -> None:
    d.edit_ucp("training/ranks", _set(["values"], {}))


@invalid("rank-rng-broken", "validate", ["085"],
         "Rank 2's generators (training/ranks/2/rng, R086) with NumPy's state as a group of "
         "kind python: a rank's rng has the form of training/rng.",
         arrays=_rank_case_arrays, groups=_rank_case_groups)
def _(d: Damage) -> None:
    d.edit_ucp("training/ranks/2/rng/numpy", _set(["values", "kind"], "python"))


@invalid("pickle-file", "validate", ["072"],
         "A Python pickle stored as training/rng_state.pkl and listed in the manifest.")
def _(d: Damage) -> None:
    d.put("training/rng_state.pkl", b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x03.")


def _opt(fn: Callable[[dict[str, Any]], None]) -> Callable[[Damage], None]:
    return lambda d: d.edit_ucp("optimizer", lambda ucp: fn(ucp["values"]))


OPT_CASES: list[tuple[str, list[str], str, Callable[[Damage], None]]] = [
    ("param-group-without-params", ["081"], "A parameter group without params.",
     _opt(lambda v: v["param_groups"].append({"lr": 0.1}))),
    ("param-in-two-groups", ["081"], "fc.bias is in two parameter groups.",
     _opt(lambda v: v["param_groups"].append({"params": ["fc.bias"], "lr": 0.1}))),
    ("param-name-nul", ["011", "082"], "A parameter name with U+0000.",
     _opt(lambda v: v["param_groups"][0]["params"].append("fc\u0000bias"))),
    ("param-not-in-model", ["082"], "A parameter group names ghost.weight, not in model.",
     _opt(lambda v: v["param_groups"][0]["params"].append("ghost.weight"))),
]


def _register_opt_cases() -> None:
    for name, violates, description, fn in OPT_CASES:
        invalid(name, "validate", violates, description)(fn)


_register_opt_cases()


@invalid("state-array-misplaced", "validate", ["081"],
         "An optimizer state array at optimizer/state/momentum (not "
         "optimizer/state/<parameter>/<state>).",
         arrays=lambda: [*base_arrays(), arr("optimizer/state/momentum", "float32", (6,), 310)])
def _(d: Damage) -> None:
    return None


@invalid("state-of-unknown-parameter", "validate", ["082"],
         "Optimizer state for ghost.weight, which model does not have.",
         arrays=lambda: [*base_arrays(),
                         arr("optimizer/state/ghost.weight/exp_avg", "float32", (6,), 311)])
def _(d: Damage) -> None:
    return None


@invalid("state-not-in-param-groups", "validate", ["082"],
         "Optimizer state for model/scale, which no parameter group lists.",
         arrays=lambda: [*base_arrays(),
                         arr("optimizer/state/scale/exp_avg", "float32", (4,), 312)])
def _(d: Damage) -> None:
    return None


@invalid("role-invalid", "validate", ["084"], "An array whose role is 'weights'.")
def _(d: Damage) -> None:
    d.edit_ucp("model/fc.bias", _set(["role"], "weights"))


@invalid("model-nested", "validate", ["080"],
         "A parameter stored at model/encoder/fc.weight: the tensors of model are its direct "
         "children, named by their fully-qualified names (model/encoder.fc.weight).",
         arrays=lambda: [*base_arrays(), arr("model/encoder/fc.weight", "float32", (3,), 313)])
def _(d: Damage) -> None:
    return None


LAYOUT_CASES: list[tuple[str, list[str], str, Any]] = [
    ("layout-not-object", ["100"], "attributes.ucp.layout is a string.", "tp0"),
    ("layout-tp-dim", ["101"], "tp.dim 2 of a 2-d tensor.", {"tp": {"dim": 2}}),
    ("layout-parts-sum", ["102"], "Fused parts that sum to 6 on a dimension of 8.",
     {"tp": {"dim": 0}, "parts": [{"name": "q", "size": 4}, {"name": "k", "size": 2}]}),
    ("layout-parts-without-tp", ["102"], "Fused parts without tp.",
     {"parts": [{"name": "q", "size": 4}, {"name": "k", "size": 4}]}),
    ("layout-groups", ["103"], "groups 4 with a part of size 6.",
     {"tp": {"dim": 0}, "groups": 4,
      "parts": [{"name": "q", "size": 6}, {"name": "k", "size": 2}]}),
    ("layout-vocab-dim", ["104"], "A vocabulary dimension that is not the tp dimension.",
     {"tp": {"dim": 1}, "vocab": {"dim": 0}}),
    ("layout-experts-count", ["105"], "experts.count 4 for a dimension of 8.",
     {"experts": {"dim": 0, "count": 4}}),
    ("layout-expert-and-experts", ["105"], "Both expert and experts.",
     {"experts": {"dim": 0, "count": 8}, "expert": 1}),
    ("layout-layers-count", ["106"], "layers.count 3 for a dimension of 8.",
     {"layers": {"dim": 0, "count": 3}}),
    ("layout-layer-and-layers", ["106"], "Both layer and layers.",
     {"layers": {"dim": 0, "count": 8}, "layer": 2}),
    ("layout-same-dim", ["107"], "tp and layers split the same dimension.",
     {"tp": {"dim": 0}, "layers": {"dim": 0, "count": 8}}),
]


def _register_layout_cases() -> None:
    for name, violates, description, layout in LAYOUT_CASES:
        invalid(name, "validate", violates, description)(
            lambda d, lay=layout: d.edit_ucp("model/fc.weight", _set(["layout"], lay)))


_register_layout_cases()


@invalid("alias-also-stored", "validate", ["108"],
         "model/fc.bias is stored and also declared an alias of fc.weight.")
def _(d: Damage) -> None:
    d.edit_ucp("model", _set(["aliases"], {"fc.bias": "fc.weight"}))


@invalid("alias-to-nothing", "validate", ["108"], "An alias whose target is not an array.")
def _(d: Damage) -> None:
    d.edit_ucp("model", _set(["aliases"], {"head.weight": "missing.weight"}))


# deep: only reading every byte shows it


@invalid("file-digest-mismatch", "deep", ["043"],
         "A chunk of model/fc.bias changed after the manifest was written: its CRC32C is "
         "correct, its SHA-256 is not the manifest's.")
def _(d: Damage) -> None:
    d.rewrite_chunk("model/fc.bias/c/0", lambda p: bytes([p[0] ^ 0x40]) + p[1:], listed=False)


# rule files (R120-R122): a rule file and the tensor names it is applied to

# -- the checkpoint in one file (spec section 11.5): cases given to "archive" readers -----------


def _archive_order(root: Path) -> list[str]:
    """The keys of a committed checkpoint in the order of the commit protocol: stored
    objects, node documents, the manifest, the root last (each group sorted)."""
    keys = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    rank = {"zarr.json": 3, "manifest.ucp.json": 2}
    return sorted(keys, key=lambda k: (rank.get(k, 1 if k.endswith("/zarr.json") else 0), k))


def archive_bytes(root: Path, *, aligned: bool = True, compress: str | None = None,
                  rename: Mapping[str, str] | None = None, duplicate: str | None = None,
                  folder: str = "") -> bytes:
    """The checkpoint directory ``root`` as one ZIP file: written as the reference writer
    writes it (``aligned``: every member's data on a 64-byte boundary) or as Python's
    zipfile does (unaligned, with directory entries), with one member compressed,
    renamed, stored twice, or every member put under ``folder``."""
    import io
    import warnings
    import zipfile
    import zlib

    from ucpformat.store import zip_layout

    keys = _archive_order(root)
    data = {k: root.joinpath(*k.split("/")).read_bytes() for k in keys}
    named = {k: folder + (rename or {}).get(k, k) for k in keys}
    if aligned and compress is None and duplicate is None:
        out, members = bytearray(), []
        for k in keys:
            crc = zlib.crc32(data[k])
            members.append(zip_layout.Member(named[k], len(out), len(data[k]), crc))
            out += zip_layout.member_header(named[k], len(out), len(data[k]), crc) + data[k]
        return bytes(out + zip_layout.directory(members, len(out)))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate
        dirs = sorted({k.rsplit("/", 1)[0] + "/" for k in keys if "/" in k}) if not aligned \
            else []
        for d in dirs:
            z.writestr(zipfile.ZipInfo(folder + d, date_time=(1980, 1, 1, 0, 0, 0)), b"")
        for k in keys:
            for _ in range(2 if k == duplicate else 1):
                info = zipfile.ZipInfo(named[k], date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED if k == compress else \
                    zipfile.ZIP_STORED
                z.writestr(info, data[k])
    return buffer.getvalue()


def as_archive(root: Path, **kw: Any) -> None:
    """Replace the checkpoint directory ``root`` by one file of the same name."""
    body = archive_bytes(root, **kw)
    shutil.rmtree(root)
    root.write_bytes(body)


@valid("archive")
def _archive(dest: Path) -> dict[str, Any]:
    doc = _basic(dest)
    as_archive(dest)
    doc["description"] = (
        "valid/basic in one file (spec section 11.5): a ZIP archive as the reference writer "
        "makes it, every member stored and its data on a 64-byte boundary, the root last; "
        "the file's name has no .ucpz: a reader knows it by its content.")
    doc["feature"] = "archive"
    doc["exercises"] = sorted({*doc["exercises"], R + "074", R + "077", R + "078"})
    return doc


@valid("archive-unaligned")
def _archive_unaligned(dest: Path) -> dict[str, Any]:
    doc = _basic(dest)
    as_archive(dest, aligned=False)
    doc["description"] = (
        "valid/basic in one file as Python's zipfile writes it: members stored but not "
        "aligned, directory entries: a reader must not rely on the alignment.")
    doc["feature"] = "archive"
    doc["exercises"] = sorted({*doc["exercises"], R + "076", R + "077"})
    return doc


@invalid("archive-compressed-member", "open", ["075"],
         "The checkpoint in one file, one member (a node's zarr.json) compressed (deflate): "
         "every member is stored.", feature="archive")
def _(d: Damage) -> None:
    as_archive(d.root, aligned=False, compress="model/fc.bias/zarr.json")


@invalid("archive-duplicate-member", "open", ["075"],
         "The checkpoint in one file with the member model/fc.bias/zarr.json twice.",
         feature="archive")
def _(d: Damage) -> None:
    as_archive(d.root, aligned=False, duplicate="model/fc.bias/zarr.json")


ALSO["archive-member-not-a-key"] = ["075"]


@invalid("archive-member-not-a-key", "open", ["091"],
         "The checkpoint in one file with a member named model/../fc.bias/zarr.json: no key "
         "has a '..' component.", feature="archive")
def _(d: Damage) -> None:
    as_archive(d.root, aligned=False,
               rename={"model/fc.bias/zarr.json": "model/../fc.bias/zarr.json"})


@invalid("archive-of-a-folder", "open", ["051"],
         "A ZIP archive of the checkpoint's folder: every member under ckpt/, the root at "
         "ckpt/zarr.json, none at zarr.json.", feature="archive")
def _(d: Damage) -> None:
    as_archive(d.root, folder="ckpt/")


@invalid("archive-cut-short", "open", ["077"],
         "The checkpoint in one file without its last 22 bytes: no end of central directory "
         "record, so no member can be found.", feature="archive")
def _(d: Damage) -> None:
    as_archive(d.root)
    d.root.write_bytes(d.root.read_bytes()[:-22])


@invalid("archive-local-header-mismatch", "read", ["077"],
         "The checkpoint in one file whose member model/fc.weight/c/0/0 has a local header "
         "naming model/fc.weight/c/0/9, not the name of its central directory entry.",
         feature="archive")
def _(d: Damage) -> None:
    as_archive(d.root)
    raw = bytearray(d.root.read_bytes())
    name = b"model/fc.weight/c/0/0"
    at = raw.find(name)  # its local header's copy: the chunks come first in the file
    assert raw[at - 30:at - 26] == b"PK\x03\x04", "not a local header"
    raw[at + len(name) - 1] = ord("9")
    d.root.write_bytes(bytes(raw))


RULES_CASES: list[tuple[str, str, list[str], str, dict[str, Any], dict[str, Any]]] = [
    ("rules-schema", "invalid", ["120"], "A rule file without rules.",
     {"name": "broken", "parameters": []}, {"params": {}, "names": ["w"]}),
    ("rules-code-expression", "invalid", ["121"],
     "A layout integer that is Python code, not an expression over parameters.",
     {"name": "code", "parameters": ["h"], "rules": [
         {"pattern": "w", "layout": {"tp": {"dim": "__import__('os').getpid() // 1"}}}]},
     {"params": {"h": 8}, "names": ["w"]}),
    ("rules-unmatched-name", "invalid", ["122"], "A tensor that no rule matches.",
     {"name": "partial", "parameters": [], "rules": [{"pattern": "layers.{layer}.**"}]},
     {"params": {}, "names": ["layers.0.mlp.weight", "embedding.weight"]}),
    ("rules", "valid", [], "A rule file with parameters, captures and a catch-all rule.",
     {"name": "small", "parameters": ["heads", "groups", "head_dim"],
      "conventions": {"fused_order": "group-major"},
      "rules": [
          {"pattern": "embedding.weight", "layout": {"tp": {"dim": 0}, "vocab": {"dim": 0}},
           "stage": "first"},
          {"pattern": "layers.{layer}.qkv.weight", "layout": {
              "tp": {"dim": 0}, "groups": "groups", "parts": [
                  {"name": "q", "size": "heads * head_dim"},
                  {"name": "k", "size": "groups * head_dim"},
                  {"name": "v", "size": "groups * head_dim"}]}},
          {"pattern": "layers.{layer}.**"},
          {"pattern": "**"}]},
     {"params": {"heads": 4, "groups": 2, "head_dim": 8},
      "names": ["embedding.weight", "layers.3.qkv.weight", "layers.3.norm.weight", "final.w"]}),
]


def rules_case(dest: Path, kind: str, violates: list[str], description: str,
               rules: dict[str, Any], apply: dict[str, Any]) -> dict[str, Any]:
    write_json(dest / "rules.json", rules)
    write_json(dest / "apply.json", apply)
    doc: dict[str, Any] = {"$schema": SCHEMA_ID, "ucp_conformance": "1.0", "kind": kind,
                           "description": description, "rules": "rules.json",
                           "apply": "apply.json"}
    if kind == "invalid":
        doc["violates"] = [R + v for v in violates]
        doc["stage"] = "validate"
    else:
        from ucpformat.layout.rules import RuleSet

        rs = RuleSet.from_json(rules)
        resolved = {}
        for n in apply["names"]:
            res = rs.resolve(n, apply["params"])
            assert res is not None
            resolved[n] = res.layout.to_json()
        doc["resolved"] = resolved
    return doc


# -- writer scenarios ---------------------------------------------------------------------------


@dataclass
class STensor:
    """A scenario tensor: its ground truth, and how the writer is handed its contents."""

    a: Arr
    seed: int | None = None  # splitmix64 seed (None with source None: all zero bits)
    source: dict[str, Any] | None = None  # per-rank local files cut this way
    missing_ranks: tuple[int, ...] = ()


def s_arr(name: str, dtype: str, shape: Sequence[int], index: int, *,
          source: dict[str, Any] | None = None, **kw: Any) -> STensor:
    a = arr(name, dtype, shape, index, **kw)
    return STensor(a, None if source else seed_of(index), source)


def s_zero(name: str, dtype: str, shape: Sequence[int], *,
           source: dict[str, Any] | None = None, **kw: Any) -> STensor:
    return STensor(zero_arr(name, dtype, shape, **kw), None, source)


def build_scenario(
    dest: Path,
    name: str,
    description: str,
    tensors: Sequence[STensor],
    groups: Sequence[Group] = (),
    *,
    metadata: Mapping[str, Any] | None = None,
    features: Sequence[str] = (),
    configs: Sequence[tuple[str, Target]] = (),
    refuse: Sequence[str] = (),
) -> dict[str, Any]:
    entries = []
    for i, t in enumerate(tensors):
        a = t.a
        entry: dict[str, Any] = {"name": list(a.name), "dtype": a.dtype, "shape": list(a.shape)}
        if a.ucp:
            entry["ucp"] = dict(a.ucp)
        if t.source is None:
            entry["content"] = ({"generator": "zeros"} if t.seed is None
                                else {"generator": "splitmix64", "seed": t.seed})
        else:
            assert a.data is not None
            layout = TensorLayout.from_json(a.ucp.get("layout", {}))
            maps = source_maps(t.source, a.shape, layout, tensor=a.path)
            locals_ = []
            for rank, lmap in enumerate(maps):
                if rank in t.missing_ranks:
                    continue
                local = contents.generate(a.dtype, lmap.local_shape, seed_of(5000 + i * 64 + rank))
                for piece in lmap.pieces:
                    local[as_slices(piece.local)] = a.data[as_slices(piece.glob)]
                rel = f"local/{i}/{rank}.bin"
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(contents.le_bytes(local))
                locals_.append({"rank": rank, "file": rel, "shape": list(lmap.local_shape)})
            entry["content"] = {"generator": "local", "source": dict(t.source),
                                "locals": locals_}
        entries.append(entry)
    doc: dict[str, Any] = {
        "$schema": SCENARIO_SCHEMA_ID,
        "ucp_conformance": "1.0",
        "name": name,
        "description": description,
        "features": sorted(features),
        "tensors": entries,
        "groups": [
            {k: v for k, v in (("name", list(g.name)), ("values", g.values), ("ucp", g.ucp))
             if v or k == "name"}
            for g in groups
        ],
        "metadata": dict(metadata or {}),
    }
    write_json(dest / "scenario.json", doc)
    arrays = [t.a for t in tensors]
    root_values = next((g.values for g in groups if not g.name), None)
    expected = valid_expected(description, arrays, [g for g in groups if g.name],
                              root_values=root_values, metadata=metadata, writer="",
                              targets=layout_targets(arrays, configs))
    expected["kind"] = "scenario"
    del expected["writer"], expected["exercises"], expected["warnings"]
    if refuse:
        expected["refuse"] = [R + r for r in refuse]
    return expected


SCENARIOS: dict[str, CaseFn] = {}


def scenario(name: str) -> Callable[[CaseFn], CaseFn]:
    def register(fn: CaseFn) -> CaseFn:
        SCENARIOS[name] = fn
        return fn
    return register


@scenario("basic")
def _s_basic(dest: Path) -> dict[str, Any]:
    tensors = [s_arr(f"model/p.{n}", n, (4, 3), 400 + i, ucp={"role": "parameter"})
               for i, n in enumerate(ALL_TYPES)]
    tensors += [
        s_zero("model/norm.bias", "float32", (3,), ucp={"role": "buffer"}),
        s_arr("model/empty", "float32", (0, 3), 430),
        s_arr("model/語彙.weight", "float32", (3, 2), 431, ucp={"role": "parameter"}),
        s_arr("model/encoder/embed", "int64", (2, 2), 432),
        s_arr("model/big", "float32", (256, 256), 433, ucp={"role": "parameter"}),
        s_zero("optimizer/state/p.float32/exp_avg", "float32", (4, 3),
               ucp={"role": "optimizer_state"}),
        s_arr("optimizer/state/p.float32/step", "float32", (), 434,
              ucp={"role": "optimizer_state"}),
        s_arr("training/rng", "uint8", (16,), 435, ucp={"role": "training_state"}),
        s_arr("ext/deep/er/than/that/leaf", "int8", (5,), 436),
    ]
    # encoder/embed is one logical name with a '/': a single node, model/encoder%2Fembed
    tensors[len(ALL_TYPES) + 3].a.name = ("model", "encoder/embed")
    groups = [
        Group((), {"framework": "conformance", "data_position": {"epoch": 1, "batch": 17}}),
        Group(("optimizer",), {"type": "torch.optim.AdamW", "param_groups": [
            {"params": ["p.float32"], "lr": 0.001, "betas": [0.9, 0.999]}]}),
        Group(("training",), {"step": 12, "best_loss": {"$ucp_float": "Infinity"},
                              "scheduler": {"last_epoch": 11}, "warmup": 1.0,
                              "momentum_floor": -0.0}),
    ]
    return build_scenario(
        dest, "basic",
        "Every data type, a 0-d tensor, an empty tensor, all-zero tensors (every chunk must "
        "still be written), names that need escaping, a 256 KiB tensor, JSON values with a "
        "non-finite float, 1.0 and -0.0 (kept as written, R073), optimizer state.",
        tensors, groups, metadata={"run": "writer-conformance", "seed": 7})


@scenario("many-tensors")
def _s_many(dest: Path) -> dict[str, Any]:
    tensors = [s_arr(f"model/decoder.layers.{i}.self_attention.linear_proj.layer_norm_weight",
                     "float32", (2,), 500 + i) for i in range(64)]
    return build_scenario(
        dest, "many-tensors",
        "Sixty-four small tensors with long names: the root zarr.json (with the consolidated "
        "metadata of every node) is the largest file.", tensors)


TP2 = {"kind": "megatron", "tp": 2, "fused_order": "group-major", "vocab_multiple": 8}
TP4 = {"kind": "megatron", "tp": 4, "fused_order": "part-major", "vocab_multiple": 1}
SCENARIO_TARGETS: list[tuple[str, Target]] = [
    ("tp1", Target()),
    ("tp2.r1.part", Target(tp=2, tp_rank=1)),
    ("tp4.r2.group.v8", Target(tp=4, tp_rank=2, fused_order="group-major", vocab_multiple=8)),
]


def _layout_tensors(source: dict[str, Any], first: int, *, qkv_groups: int) -> list[STensor]:
    q, kv = 8 if qkv_groups == 2 else 16, 4 if qkv_groups == 2 else 8
    lay = {
        "vocab": {"tp": {"dim": 0}, "vocab": {"dim": 0}},
        "qkv": {"tp": {"dim": 0}, "groups": qkv_groups, "layer": 0, "parts": [
            {"name": "q", "size": q}, {"name": "k", "size": kv}, {"name": "v", "size": kv}]},
        "gate_up": {"tp": {"dim": 0}, "layer": 0, "parts": [
            {"name": "gate", "size": 12}, {"name": "up", "size": 12}]},
        "row": {"tp": {"dim": 1}, "layer": 1},
        "norm": {"layer": 1},
        "bias": {"tp": {"dim": 0}, "layer": 0},
    }
    p = {"role": "parameter"}
    return [
        s_arr("model/embedding.word_embeddings.weight", "float32", (50, 8), first,
              source=source, ucp={**p, "layout": lay["vocab"]}),
        s_arr("model/layers.0.self_attention.linear_qkv.weight", "bfloat16", (q + 2 * kv, 8),
              first + 1, source=source, ucp={**p, "layout": lay["qkv"]}),
        s_arr("model/layers.0.mlp.linear_fc1.weight", "float32", (24, 8), first + 2,
              source=source, ucp={**p, "layout": lay["gate_up"]}),
        s_arr("model/layers.1.mlp.linear_fc2.weight", "float16", (8, 12), first + 3,
              source=source, ucp={**p, "layout": lay["row"]}),
        s_arr("model/layers.1.input_layernorm.weight", "float32", (8,), first + 4,
              source=source, ucp={**p, "layout": lay["norm"]}),
        s_zero("model/layers.0.mlp.linear_fc1.bias", "float32", (24,), source=source,
               ucp={**p, "layout": lay["bias"]}),
    ]


@scenario("layout-tp2-group-major")
def _s_tp2(dest: Path) -> dict[str, Any]:
    tensors = _layout_tensors(TP2, 600, qkv_groups=2)
    groups = [Group(("model",), {}, {"aliases": {
        "output_layer.weight": "embedding.word_embeddings.weight"}})]
    return build_scenario(
        dest, "layout-tp2-group-major",
        "Per-rank local tensors of a 2-way tensor-parallel Megatron-style model (fused QKV "
        "interleaved per query group, vocabulary padded to a multiple of 8 x 2 with garbage "
        "rows), to consolidate: split dimension, fused parts and groups, unpadded vocabulary.",
        tensors, groups, features=["layout"], configs=SCENARIO_TARGETS)


@scenario("layout-tp4-part-major")
def _s_tp4(dest: Path) -> dict[str, Any]:
    tensors = _layout_tensors(TP4, 620, qkv_groups=4)
    tensors.append(s_arr("model/layers.1.mlp.experts.weight", "float32", (4, 8, 6), 630,
                         source=TP4, ucp={"role": "parameter", "layout": {
                             "experts": {"dim": 0, "count": 4}, "tp": {"dim": 1},
                             "layer": 1}}))
    return build_scenario(
        dest, "layout-tp4-part-major",
        "Per-rank local tensors of a 4-way tensor-parallel model with part-major fused "
        "tensors and a vocabulary of 50 padded to 52 (13 rows per rank, two of them padding "
        "on the last rank).",
        tensors, features=["layout"], configs=SCENARIO_TARGETS)


@scenario("layout-dtensor")
def _s_dtensor(dest: Path) -> dict[str, Any]:
    def src(*placements: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "dtensor", "mesh": [2, 2], "placements": list(placements)}

    tensors = [
        s_arr("model/a.weight", "float32", (8, 6), 700, source=src({"shard": 0}, {"shard": 1})),
        s_arr("model/b.weight", "bfloat16", (6, 4), 701,
              source=src({"replicate": True}, {"shard": 0})),
        s_arr("model/c.weight", "float32", (8, 4), 702,
              source=src({"strided_shard": 0, "split_factor": 2}, {"shard": 0})),
        s_arr("model/d.weight", "int32", (5, 3), 703, source=src({"shard": 0}, {"shard": 0})),
    ]
    return build_scenario(
        dest, "layout-dtensor",
        "Per-rank local tensors of DTensors on a 2 x 2 device mesh: Shard, Replicate, a "
        "strided shard (FSDP2 over tensor parallelism) and uneven torch.chunk splits.",
        tensors, features=["dtensor", "layout"])


@scenario("coverage-gap")
def _s_gap(dest: Path) -> dict[str, Any]:
    tensors = _layout_tensors(TP2, 800, qkv_groups=2)[:3]
    tensors[2].missing_ranks = (1,)
    return build_scenario(
        dest, "coverage-gap",
        "Rank 1's local tensor of layers.0.mlp.linear_fc1.weight is missing, so half of it is "
        "held by no rank: a writer refuses before writing any data.",
        tensors, features=["layout"], refuse=["131"])


# -- main -------------------------------------------------------------------------------------


def generate(out: Path) -> dict[str, int]:
    """Write every case and scenario under ``out`` (``out/cases``, ``out/scenarios``)."""
    counts = {"valid": 0, "invalid": 0, "scenarios": 0}
    for sub in ("cases", "scenarios"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
    for name, fn in VALID.items():
        dest = out / "cases" / "valid" / name
        expected = fn(dest / "checkpoint")
        write_json(dest / "expected.json", expected)
        counts["valid"] += 1
    for name, fn in INVALID.items():
        dest = out / "cases" / "invalid" / name
        expected = fn(dest / "checkpoint")
        write_json(dest / "expected.json", expected)
        counts["invalid"] += 1
    for name, kind, violates, description, rules, apply in RULES_CASES:
        dest = out / "cases" / kind / name
        write_json(dest / "expected.json",
                   rules_case(dest, kind, violates, description, rules, apply))
        counts[kind] += 1
    for name, fn in SCENARIOS.items():
        dest = out / "scenarios" / name
        write_json(dest / "expected.json", fn(dest))
        counts["scenarios"] += 1
    from ucpformat.conformance import coverage

    write_json(out / "coverage.json", coverage.build(out / "cases", out / "scenarios"))
    return counts


def compare(a: Path, b: Path) -> list[str]:
    """Relative paths that differ between two generated trees (missing on either side too)."""
    diffs: list[str] = []
    for sub in ("cases", "scenarios", "coverage.json"):
        pa, pb = a / sub, b / sub
        if pa.is_file() or pb.is_file():
            if not (pa.is_file() and pb.is_file() and pa.read_bytes() == pb.read_bytes()):
                diffs.append(sub)
            continue
        files_a = {p.relative_to(a).as_posix() for p in pa.rglob("*") if not p.is_dir()}
        files_b = {p.relative_to(b).as_posix() for p in pb.rglob("*") if not p.is_dir()}
        diffs += sorted(files_a ^ files_b)
        for rel in sorted(files_a & files_b):
            x, y = a / rel, b / rel
            if x.is_symlink() or y.is_symlink():
                if not (x.is_symlink() and y.is_symlink()
                        and os.readlink(x) == os.readlink(y)):
                    diffs.append(rel)
            elif not filecmp.cmp(x, y, shallow=False):
                diffs.append(rel)
    return diffs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.generate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE,
                        help="where to write cases/, scenarios/ and coverage.json "
                             "(default: the conformance folder)")
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temporary folder and compare with --out")
    args = parser.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            diffs = compare(args.out, Path(tmp))
        for rel in diffs:
            print(f"differs: {rel}")
        print("up to date" if not diffs else f"{len(diffs)} files differ")
        return 1 if diffs else 0
    counts = generate(args.out)
    print(f"{counts['valid']} valid cases, {counts['invalid']} invalid cases, "
          f"{counts['scenarios']} scenarios under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

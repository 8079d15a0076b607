"""Write a checkpoint tensor by tensor: every array declared first, then each one's data."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ucpformat.checkpoint.commit import (
    abandon,
    commit_checkpoint,
    explain_failure,
    prepare_destination,
    storage_errors,
)
from ucpformat.checkpoint.metadata import (
    RESERVED_ROOT_SUFFIX,
    ArrayMeta,
    GroupMeta,
    build_root_ucp,
    dumps,
    parse_array,
)
from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.tree import zero_bits
from ucpformat.checkpoint.writer import SaveResult
from ucpformat.engine import chunking
from ucpformat.engine.compression import Compression
from ucpformat.engine.grid import object_coords, object_region
from ucpformat.engine.write import StoredObject, write_object
from ucpformat.errors import (
    ConcurrentWriteError,
    InvalidValueError,
    UCPError,
    WriteError,
)
from ucpformat.format import dtypes, jsonvalues, names
from ucpformat.store import ArchiveWriter, Store, open_store, writes_archive


class StreamingWriter:
    """Write a checkpoint tensor by tensor, holding only what the caller hands over.

    Every array is declared up front (path, shape, data type, attributes), so the
    metadata is known before any data exists; then each tensor's data is given with
    :meth:`write` (the whole tensor) or :meth:`write_object` (one stored object, for
    tensors too large to hold at once), in any order and from any number of threads.
    :meth:`commit` refuses unless every stored object of every declared array was
    written exactly once. The writer holds its location from its creation to its commit
    (UCP-1.0-R059); leaving the ``with`` block without a commit (or :meth:`abort`) removes
    what it wrote, as a failed :func:`save` does, and releases the location::

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
        options: SaveOptions | None = None,
    ) -> None:
        opts = SaveOptions.merged(
            options, defaults={"hash_algorithm": "sha256"}, overwrite=overwrite,
            compression=compression, hash_algorithm=hash_algorithm, chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes, durable=durable)
        overwrite = opts.overwrite
        #: One file (a name ending in .ucpz): written beside its path, renamed onto it by
        #: the commit (spec section 11.5); else None.
        self._archive = (ArchiveWriter(path, overwrite=overwrite, durable=opts.durable)
                         if writes_archive(path) else None)
        self.store = self._archive or open_store(path, durable=opts.durable)
        self.compression = opts.compression
        self.hash_algorithm = opts.hash_algorithm
        self.chunk_bytes = opts.chunk_bytes
        self.chunk_splits = opts.chunk_splits
        self.shard_bytes = opts.shard_bytes
        self._arrays: dict[str, ArrayMeta] = {}
        self._pending: dict[str, set[tuple[int, ...]]] = {}
        self._groups: dict[str, dict[str, Any]] = {}
        self._objects: list[StoredObject] = []
        self._lock = threading.Lock()
        self._committed = False
        with storage_errors(self.store, untouched=True):
            self._claim = prepare_destination(self.store, overwrite=overwrite)

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
            splits=self.chunk_splits,
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
        except BaseException as exc:
            with self._lock:
                self._pending[path].add(key)
            if isinstance(exc, FileExistsError):
                raise ConcurrentWriteError(
                    f"{meta.object_key(key)} was written by another writer during this save",
                    rule="UCP-1.0-R059", tensor=path,
                ) from exc
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
        with explain_failure(self.store, self._claim), storage_errors(self.store):
            commit_checkpoint(
                self.store,
                arrays=list(self._arrays.values()),
                groups=list(groups.values()),
                objects=self._objects,
                root_ucp=build_root_ucp(metadata=metadata, values=root_values),
                root_attributes=root_attributes,
                hash_algorithm=self.hash_algorithm,
                claim=self._claim,
            )
            if self._archive is not None:
                self._archive.commit()
        self._committed = True
        return SaveResult(
            self.store.location,
            len(self._arrays),
            sum(m.nbytes for m in self._arrays.values()),
            len(self._objects),
        )

    def __enter__(self) -> StreamingWriter:
        return self

    def abort(self) -> str:
        """Give the save up: remove what it wrote and release the location (nothing if it
        is committed). Returns what became of the location, as a sentence."""
        if self._committed:
            return ""
        fate = abandon(self.store, self._claim)
        if self._archive is not None:
            self._archive.discard()
            fate = "its new file was removed; nothing at its path changed"
        if self._claim.replaced:
            fate = f"the checkpoint that was here is gone (overwrite=True); {fate}"
        return fate

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._committed or self._claim.done:
            return
        fate = self.abort()
        if exc is None or not fate:
            return
        text = f"nothing was committed; {fate}"
        if isinstance(exc, UCPError):
            exc.extend(text)
        else:
            exc.add_note(f"ucpformat: {text}")


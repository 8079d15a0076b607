"""``ucpformat.save``: a nested mapping of arrays and JSON values written as a checkpoint.

Data first, metadata next, the root last: the location is claimed, written and committed
through the commit protocol (:mod:`ucpformat.checkpoint.commit`); the stored objects are
written by the one write loop (:mod:`ucpformat.checkpoint.write_loop`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucpformat.checkpoint import deferred as feeds
from ucpformat.checkpoint.commit import (
    claim_of,
    commit_checkpoint,
    explain_failure,
    prepare_destination,
    storage_errors,
)
from ucpformat.checkpoint.metadata import (
    ArrayMeta,
    build_root_ucp,
)
from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.tree import ArrayAttributes, ArrayValue, TreePlan, plan
from ucpformat.checkpoint.write_loop import write_objects
from ucpformat.engine import chunking
from ucpformat.engine.grid import object_coords, object_region
from ucpformat.engine.write import StoredObject
from ucpformat.errors import (
    InvalidValueError,
)
from ucpformat.progress import ProgressCallback
from ucpformat.store import ArchiveWriter, Store, open_store, writes_archive

# -- save ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote."""

    location: str
    tensors: int
    nbytes: int
    objects: int




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
    chunk_splits: int = chunking.DEFAULT_SPLITS,
    workers: int | None = None,
    durable: bool = True,
    progress: bool | ProgressCallback = False,
    array_attributes: ArrayAttributes | None = None,
    created: str | None = None,
    producer: Mapping[str, Any] | None = None,
    feed: feeds.Feed | None = None,
    options: SaveOptions | None = None,
) -> SaveResult:
    """Write ``state`` (a nested mapping of numpy arrays and JSON values) as a checkpoint.

    The top-level keys ``model``, ``optimizer`` and ``training`` have the meaning the spec
    gives them; any other key is stored as an extension group. ``metadata`` is free-form
    JSON kept in the root (``attributes.ucp.metadata``). A failed save leaves nothing
    that opens as a checkpoint and never touches a committed one unless ``overwrite``.
    A local path whose name ends in ``.ucpz`` (or a regular file) is written as a
    checkpoint in one file, a ZIP archive (:mod:`ucpformat.store.archive`).

    ``created`` (an RFC 3339 date-time, default: now) and ``producer`` (an object with
    ``name`` and ``version``, default: this library) are stored in the root as given,
    so that a save of the same state can be byte-for-byte reproducible (the conformance
    cases are generated this way).

    ``feed`` gives the values of the :class:`ucpformat.checkpoint.deferred.Deferred` arrays of
    ``state``, which are written in the order given, each as soon as the feed has it
    (:mod:`ucpformat.torch.staging` copies tensors from a GPU this way); the feed is
    started when the writes start and stopped when they end (a save that fails before
    never starts it).

    The settings (``compression``, ``hash_algorithm``, ``overwrite``, ``chunk_bytes``,
    ``shard_bytes``, ``chunk_splits``, ``workers``, ``durable``, ``progress``) may
    instead be given as one :class:`~ucpformat.checkpoint.options.SaveOptions`
    (``options=``), not both.
    """
    opts = SaveOptions.merged(
        options, compression=compression, hash_algorithm=hash_algorithm, overwrite=overwrite,
        chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, chunk_splits=chunk_splits,
        workers=workers, durable=durable,
        progress=progress)
    the_plan = plan(
        state,
        compression=opts.compression,
        chunk_bytes=opts.chunk_bytes,
        shard_bytes=opts.shard_bytes,
        array_attributes=array_attributes,
        chunk_splits=opts.chunk_splits,
    )
    ucp = build_root_ucp(metadata=metadata, values=the_plan.root_values, producer=producer,
                         created=created)
    if writes_archive(path):
        # one file (spec §11.5): written beside the path, renamed onto it at the end
        with ArchiveWriter(path, overwrite=opts.overwrite, durable=opts.durable) as archive:
            result = _write(archive, the_plan, ucp, opts, feed)
            archive.commit()
        return result
    return _write(open_store(path, durable=opts.durable), the_plan, ucp, opts, feed)


def _write(store: Store, the_plan: TreePlan, ucp: dict[str, Any], opts: SaveOptions,
           feed: feeds.Feed | None) -> SaveResult:
    """Claim ``store``, write the planned arrays and commit them."""
    # the whole save in one batch: every write, the commit and a failure's clean-up go
    # to the directory it claimed (Store.batch), whatever is put at the path meanwhile
    with storage_errors(store), store.batch():
        with storage_errors(store, untouched=True):
            claim = prepare_destination(store, overwrite=opts.overwrite)
        with explain_failure(store, claim), storage_errors(store):
            objects = write_arrays(
                store, the_plan.arrays, hash_algorithm=opts.hash_algorithm,
                workers=opts.workers, progress=opts.progress, feed=feed,
            )
            commit_checkpoint(
                store,
                arrays=[m for m, _ in the_plan.arrays],
                groups=the_plan.groups,
                objects=objects,
                root_ucp=ucp,
                hash_algorithm=opts.hash_algorithm,
                claim=claim,
            )
    return SaveResult(store.location, len(the_plan.arrays), the_plan.nbytes, len(objects))


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

    The values of :class:`ucpformat.checkpoint.deferred.Deferred` arrays come from ``feed``,
    asked for in the order of ``arrays`` and released once their last stored object is written;
    the feed is stopped at the end, whatever happens.
    """
    try:
        return _write_arrays(store, arrays, hash_algorithm=hash_algorithm, workers=workers,
                             progress=progress, feed=feed)
    finally:
        if feed is not None:
            feed.stop()


def _write_arrays(
    store: Store,
    arrays: Sequence[tuple[ArrayMeta, ArrayValue]],
    *,
    hash_algorithm: str | None,
    workers: int | None,
    progress: bool | ProgressCallback,
    feed: feeds.Feed | None,
) -> list[StoredObject]:
    deferred = [data.key for _, data in arrays if isinstance(data, feeds.Deferred)]
    if deferred and feed is None:
        raise InvalidValueError("placeholder arrays (ucpformat.checkpoint.deferred.Deferred) "
                                "need a feed that gives their values", path=deferred[0])
    jobs = [(meta, coords, data) for meta, data in arrays for coords in object_coords(meta)]
    remaining = {meta.path: itertools.count(1) for meta, _ in arrays}  # next() is atomic
    counts = {meta.path: meta.object_count for meta, _ in arrays}

    def values(job: tuple[ArrayMeta, tuple[int, ...], ArrayValue]) -> np.ndarray[Any, Any]:
        meta, coords, value = job
        data = feed.get(value.key) if isinstance(value, feeds.Deferred) and feed else value
        assert isinstance(data, np.ndarray)
        return data[object_region(meta, coords)]

    def written(job: tuple[ArrayMeta, tuple[int, ...], ArrayValue]) -> None:
        meta, _, value = job
        if isinstance(value, feeds.Deferred) and feed is not None and \
                next(remaining[meta.path]) == counts[meta.path]:
            feed.release(value.key)

    if feed is not None:
        feed.schedule(deferred)
    return write_objects(
        store, jobs, target=lambda job: (job[0], job[1]), values=values, written=written,
        stop=feed.stop if feed is not None else None, claim=claim_of(store),
        hash_algorithm=hash_algorithm, workers=workers, progress=progress,
        total_bytes=sum(meta.nbytes for meta, _ in arrays),
    )


#: Names this module had before 0.2, and the module each moved to (for one release).
MOVED_NAMES = {
    **dict.fromkeys(
        ["WriteClaim", "prepare_destination", "mark_destination", "clear_destination",
         "unmark_destination", "create_owned", "abandon", "explain_failure",
         "delete_checkpoint"], "ucpformat.checkpoint.commit"),
    "commit": "ucpformat.checkpoint.commit",
    **dict.fromkeys(["Group", "plan", "ArrayValue", "ArrayAttributes", "zero_bits"],
                    "ucpformat.checkpoint.tree"),
    "Plan": "ucpformat.checkpoint.tree",
    "default_workers": "ucpformat.checkpoint.write_loop",
    "adopt": "ucpformat.checkpoint.adopt",
    "StreamingWriter": "ucpformat.checkpoint.streaming",
}


def __getattr__(name: str) -> Any:
    import importlib
    import warnings

    where = MOVED_NAMES.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = where, {"commit": "commit_checkpoint", "Plan": "TreePlan"}.get(name, name)
    warnings.warn(f"ucpformat.checkpoint.writer.{name} moved to {module}.{attr}; the old "
                  "name goes away in the next release", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), attr)

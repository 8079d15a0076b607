"""The one loop that writes a save's stored objects: a pool of threads, progress, and the
first failure ending the save.

Every writer runs its objects through :func:`write_objects`: ``ucpformat.save``
(:func:`ucpformat.checkpoint.writer.write_arrays`) and each rank of a distributed save
(:meth:`ucpformat.distributed.pipeline.DistributedSave.write`). The caller says how an
object's values are found (``values``) and what happens once one is written (``written``:
releasing a tensor a staging area holds); the loop creates each object without replacing
another writer's (:func:`ucpformat.checkpoint.commit.create_owned`), turns an OSError into
a :class:`~ucpformat.errors.WriteError` naming the object, reports progress in bytes, and
on the first failure calls ``stop`` (threads waiting for values raise at once) and starts
no further object: on a full disk each would only fail in turn.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ucpformat.checkpoint.commit import WriteClaim, create_owned
from ucpformat.checkpoint.metadata import ArrayMeta
from ucpformat.engine.write import StoredObject, write_object
from ucpformat.errors import UCPError, WriteError
from ucpformat.progress import ProgressCallback, byte_progress
from ucpformat.store import Store

#: One stored object to write, as the caller knows it.
Job = TypeVar("Job")


def default_workers() -> int:
    """The writer threads of a save when the caller names none: twice the CPUs, 2 to 16
    (writes are mostly system calls and compression, which release the GIL)."""
    return max(2, min(16, 2 * (os.cpu_count() or 1)))


def background_workers() -> int:
    """The writer threads of a save that runs beside training (an asynchronous save) when
    the caller names none: half the CPUs, at least 1. A save in the background shares the
    cores with the training step; with :func:`default_workers` (twice the CPUs) its
    threads took the cores from training (``bench_training``: a step 3.1x slower while a
    save ran on 2 cores, 1.2x with one writer thread)."""
    return max(1, (os.cpu_count() or 1) // 2)


def write_objects(
    store: Store,
    jobs: Sequence[Job],
    *,
    target: Callable[[Job], tuple[ArrayMeta, tuple[int, ...]]],
    values: Callable[[Job], np.ndarray[Any, Any]],
    written: Callable[[Job], None] | None = None,
    stop: Callable[[], None] | None = None,
    claim: WriteClaim | None,
    hash_algorithm: str | None,
    workers: int | None = None,
    progress: bool | ProgressCallback = False,
    total_bytes: int = 0,
    label: str = "saving",
    flush: bool = False,
    name_every_os_error: bool = False,
) -> list[StoredObject]:
    """Write the stored object of every job on ``workers`` threads; the objects written, in
    the order of ``jobs``.

    ``target(job)``: the array and grid coordinates of its object; ``values(job)``: its
    values, shaped like the object (cast to the array's data type here); ``written(job)``
    once it is written; ``stop()`` on the first failure; ``claim``: the save's hold on the
    location (None: a rank of a distributed save that does not hold it), which decides
    whether an object found already there is replaced or refused. ``flush``: make the
    objects durable before returning, through what the writes opened (the same batch of
    the store). ``name_every_os_error``: an OSError that is also a UCPError (a storage
    error) is raised as a WriteError naming the object too, as a distributed rank reports
    it (else it passes as it is).
    """
    with byte_progress(progress, total_bytes, label) as advance:

        def run(job: Job) -> StoredObject:
            meta, coords = target(job)
            data = values(job).astype(meta.dtype.numpy, copy=False)
            key = meta.object_key(coords)
            try:
                stored = create_owned(
                    store, claim, key,
                    lambda: write_object(store, meta, coords, data,
                                         hash_algorithm=hash_algorithm),
                )
            except OSError as exc:
                if isinstance(exc, UCPError) and not name_every_os_error:
                    raise
                raise WriteError(f"writing {key} failed: {exc}", path=store.location) from exc
            if written is not None:
                written(job)
            advance(data.nbytes)
            return stored

        pool = ThreadPoolExecutor(workers or default_workers())
        with store.batch():  # the writer threads share what the store opens
            try:
                objects = list(pool.map(run, jobs))
                if flush:
                    store.flush()
                return objects
            except BaseException:
                if stop is not None:
                    stop()  # threads still waiting for a tensor's values raise at once
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            finally:
                pool.shutdown(wait=True)

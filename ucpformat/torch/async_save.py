"""Asynchronous checkpoints: snapshot to host memory, write in the background.

::

    saver = ucpformat.torch.AsyncSaver()          # collective, once, at setup
    for step in ...:
        train_step()
        if step % 1000 == 0:
            saver.save(f"ckpt/{step}", model=model, optimizer=opt, step=step)
    saver.close()                                 # waits for the last save

:meth:`AsyncSaver.save` blocks training only while it copies every local tensor this
rank holds (its DTensor shards and its replicas) into host staging buffers; it then
returns a :class:`concurrent.futures.Future` and a background thread runs the
collective write (:func:`ucpformat.distributed.save_fragments`: plan, exchange,
shards, commit). The next ``save`` first waits for the previous one (and raises its
error, if it failed), so at most one save is in flight and the staging buffers, kept
between saves, are reused: after the first save, the blocked time is the copy itself.

Collectives from a background thread must not share a process group with training,
whose collectives run at the same time on the main thread: the saver uses its own gloo
group, made at construction by :func:`ucpformat.torch.comm.checkpoint_group` (every rank
must construct the saver, in the same order relative to other group creations). Pass
``group=`` to use another. gloo suits the job on GPU clusters too: a snapshot is in
host memory.

The snapshot (:class:`ucpformat.torch.staging.Snapshot`) copies into buffers of a
:class:`~ucpformat.torch.staging.HostBufferPool` (pinned when CUDA is available; by
default unbounded, as a snapshot holds the rank's whole local state until written),
kept from save to save. A CUDA tensor is copied on a side stream that first waits for
the caller's current stream, with one event per tensor; before ``save`` returns, the
caller's current stream is made to wait for every copy's event (no device-wide
synchronisation): training goes on at once, and any kernel it queues on that stream
afterwards (an optimizer step modifying a parameter) runs only once the copy of that
state is complete. The background thread waits for the events before writing. Work on
other streams must wait for the caller's stream as usual. CPU tensors are copied before
``save`` returns.

Where the write runs (``writer=``):

* ``"thread"`` (default): in a thread of the training process, which then shares its
  CPU time and interpreter lock with the writer's hashing, compression and Python;
* ``"process"``: in a long-lived writer process of the saver's own
  (:mod:`ucpformat.torch.writer_process`, started with the saver). The snapshot
  copies into host memory shared with it (:class:`~ucpformat.torch.staging.SharedBuffers`,
  page-locked when CUDA is available; no file name, so nothing can leak), and the
  background thread only waits for the child, which writes and commits through the same
  pipeline. What the child is sent travels as JSON (never pickle): the location is a
  path or URL (or a plain ``LocalStore``/``FsspecStore``), and a ``progress`` callback
  cannot go (``progress=True`` can). Its errors are raised by the future (a
  :class:`~ucpformat.errors.UCPError` with its class, another as a ``WriteError``
  naming it) with the child's traceback; a child that died is a
  :class:`~ucpformat.torch.writer_process.WriterProcessError` naming its exit
  (the next save of a one-process saver starts a new child). With several ranks, each
  rank's child joins a gloo group of the children
  (:func:`ucpformat.torch.comm.writer_connector`: a TCP rendezvous on rank 0's host);
  a child that dies there leaves the others waiting in a collective until the group's
  timeout, and the saver cannot save again (make a new one on every rank).
  The child runs at a lower priority (``writer_nice``, default :data:`WRITER_NICE`):
  on cores that training needs too, training goes first.
  :meth:`AsyncSaver.close` stops the child.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.write_loop import background_workers
from ucpformat.distributed import DistributedSaveResult
from ucpformat.distributed.comm import Communicator
from ucpformat.store import Store, check_directory_location
from ucpformat.torch.comm import ProcessGroup, checkpoint_group, communicator, writer_connector
from ucpformat.torch.distributed import (
    collect_state,
    fragments_of,
    local_parts,
    local_tensors,
    mesh_layout,
    write_collected,
)
from ucpformat.torch.staging import (
    Copier,
    DeviceCopier,
    HostBufferPool,
    Recorder,
    SharedBuffers,
    Snapshot,
)
from ucpformat.torch.state import Stateful
from ucpformat.torch.writer_process import SharedArena, WriterProcess, WriterProcessError
from ucpformat.torch.writer_wire import location_to_json, save_kwargs_to_json

#: Where an :class:`AsyncSaver` writes: a thread of this process, or a process of its own.
Writer = Literal["thread", "process"]
#: The writer process's added niceness by default: it yields the CPU to training.
WRITER_NICE = 10


class AsyncSaver:
    """Saves checkpoints in the background, one at a time, over its own process group."""

    def __init__(
        self,
        group: ProcessGroup | None = None,
        *,
        pool: HostBufferPool | None = None,
        copier: Copier | None = None,
        recorder: Recorder | None = None,
        writer: Writer = "thread",
        writer_nice: int | None = None,
    ) -> None:
        """``pool``: the snapshot's host buffers (default: unbounded, pinned when CUDA is
        available); a bounded pool that cannot hold a snapshot makes ``save`` raise
        :class:`~ucpformat.errors.ResourceLimitError` before anything is copied.
        ``writer``: ``"thread"`` or ``"process"`` (the module docstring; the process
        writer stages into shared memory of its own: no ``pool``); ``writer_nice``: the
        writer process's added niceness (default :data:`WRITER_NICE`: where training and
        the writer want the same cores, training goes first, and saves take longer; 0:
        the writer competes as an equal).
        ``copier`` and ``recorder``: see :mod:`ucpformat.torch.staging` (tests)."""
        if writer not in ("thread", "process"):
            raise ValueError(f"writer is 'thread' or 'process', not {writer!r}")
        if writer == "process" and pool is not None:
            raise ValueError("pool= is for writer='thread': the process writer stages into "
                             "shared memory of its own")
        if writer_nice is not None and writer != "process":
            raise ValueError("writer_nice is for writer='process'")
        self._nice = WRITER_NICE if writer_nice is None else writer_nice
        self.writer: Writer = writer
        self._group = group if group is not None else checkpoint_group()
        self._comm: Communicator = communicator(self._group)
        self._shared: SharedBuffers | None = None
        self._process: WriterProcess | None = None
        if writer == "process":
            self._shared = SharedBuffers(SharedArena())
            self._process = self._start_process()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-async-save")
        self.staging_pool = pool if pool is not None else HostBufferPool(None)
        self._copier: Copier = copier if copier is not None else DeviceCopier()
        self._recorder = recorder
        self._pending: Future[DistributedSaveResult] | None = None
        self._lock = threading.Lock()
        #: Seconds the last ``save`` call blocked its caller once the previous save was
        #: done: collecting the state dicts, the snapshot copy, handing over the write.
        self.last_blocked_s: float = 0.0
        #: Seconds the last ``save`` call waited for the save before it.
        self.last_wait_s: float = 0.0
        self._closed = False

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffers (about the rank's local state)."""
        if self._shared is not None:
            return self._shared.arena.size
        return self.staging_pool.stats.allocated_bytes

    @property
    def writer_pid(self) -> int | None:
        """The process id of the writer process (``writer="process"``), else None."""
        return self._process.pid if self._process is not None else None

    def _start_process(self) -> WriterProcess:
        """Collective with several ranks (the children's rendezvous)."""
        connector = writer_connector(self._comm) if self._comm.world_size > 1 else None
        return WriterProcess(connector, nice=self._nice)

    def _check_process(self) -> None:
        """A writer process that died between saves: a new one (one rank), else raise."""
        if self._process is None or self._process.alive():
            return
        if self._comm.world_size > 1:
            raise WriterProcessError(
                f"the writer process (pid {self._process.pid}) of rank {self.rank} ended; "
                "this saver cannot save again (make a new AsyncSaver on every rank)")
        self._process.close()
        self._process = self._start_process()

    def save(
        self,
        path: str | os.PathLike[str] | Store,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        step: int | None = None,
        extra: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        rng: bool | Mapping[str, Any] = False,
        rank_state: Mapping[str, Any] | None = None,
        **save_kwargs: Any,
    ) -> Future[DistributedSaveResult]:
        """Collective: snapshot now, write in the background; the future gives the result.

        Arguments as for :func:`ucpformat.torch.save_distributed`, ``rng`` and
        ``rank_state`` (this rank's own state, ``training/ranks/<rank>``) included: they
        are taken now, with the snapshot. Waits for the previous save first and raises
        its error if it failed (nothing of this one has started). With
        ``writer="process"``, a location or option that cannot travel to the writer
        process as JSON (a store object other than a ``LocalStore`` or ``FsspecStore``, a
        ``progress`` callback) raises :class:`~ucpformat.errors.InvalidValueError` first.
        """
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed")
        check_directory_location(path)  # refused now, not by the background save
        save_kwargs = _background(save_kwargs)
        if self.writer == "process":  # what cannot travel to the child: refused now
            location_to_json(path)
            save_kwargs_to_json(save_kwargs)
        with self._lock:
            t0 = time.perf_counter()
            self.wait()
            t1 = time.perf_counter()
            self._check_process()
            state = collect_state(
                model=model, optimizer=optimizer, scheduler=scheduler, step=step, extra=extra,
                rng=rng, rank_state=rank_state, rank=self._comm.rank,
                world_size=self._comm.world_size,
            )
            snap = Snapshot(self._shared or self.staging_pool, self._copier)
            try:
                parts = local_parts(state, self._comm.rank)  # once: it walks every tensor
                tensors = local_tensors(state, self._comm.rank, parts)
                if self._shared is not None:
                    self._shared.reserve(sum(HostBufferPool.buffer_bytes(
                        t.numel() * t.element_size()) for t in tensors))
                else:
                    self._check_room(tensors)
                self._copier.begin(tensors)
                specs, frags = fragments_of(
                    state, self._comm.rank,
                    lambda key, tensor: snap.add(key, tensor, self._recorder), parts)
                snap.guard(self._recorder)  # training's stream waits for each copy
            except BaseException:
                snap.wait()
                self._release(snap)
                raise
            state.items = []  # the live tensors are not needed any more
            future = self._pool.submit(
                self._write, snap, path, state, specs, frags, metadata, save_kwargs)
            self._pending = future
            self.last_wait_s = t1 - t0
            self.last_blocked_s = time.perf_counter() - t1
            return future

    def _check_room(self, tensors: list[torch.Tensor]) -> None:
        cap = self.staging_pool.capacity_bytes
        if cap is None:
            return
        need = sum(self.staging_pool.buffer_bytes(t.numel() * t.element_size())
                   for t in tensors)
        if need > cap:
            from ucpformat.errors import ResourceLimitError

            raise ResourceLimitError(
                f"the snapshot needs {need} bytes of host buffers; the staging pool is "
                f"bounded to {cap} (give AsyncSaver a larger pool, or None for no bound)"
            )

    def _write(self, snap: Snapshot, path: Any, state: Any, specs: Any, frags: Any,
               metadata: Mapping[str, Any] | None,
               save_kwargs: dict[str, Any]) -> DistributedSaveResult:
        try:
            snap.wait()  # the host waits for each copy's event
            if self._process is None:
                return write_collected(path, self._comm, state, specs, frags,
                                       metadata=metadata, **save_kwargs)
            assert self._shared is not None
            meshes, on_mesh = mesh_layout(state, self._comm)
            return self._process.save(
                self._shared.arena, path, specs=specs, fragments=frags,
                group_attributes=state.groups, meshes=meshes, on_mesh=on_mesh,
                metadata=metadata, **save_kwargs)
        finally:
            if isinstance(frags, list):
                frags.clear()  # views of the buffers: not kept by an error's traceback
            self._release(snap)  # the buffers serve the next snapshot

    def _release(self, snap: Snapshot) -> None:
        snap.release()
        if self._shared is not None:
            self._shared.reset()

    def wait(self) -> DistributedSaveResult | None:
        """Wait for the save in flight, if any; its result (raises its error)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.result()

    def close(self) -> DistributedSaveResult | None:
        """Wait for the last save, stop the background thread (and the writer process),
        free the staging buffers."""
        if self._closed:
            return None
        try:
            return self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self.staging_pool.clear()
            if self._process is not None:
                self._process.close()
            if self._shared is not None:
                self._shared.close()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: AsyncSaver | None = None


def _background(save_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``save_kwargs`` with the writer threads of a background save where the caller
    named none (:func:`~ucpformat.checkpoint.write_loop.background_workers`: half the
    CPUs, so that the save leaves training its cores)."""
    options = save_kwargs.get("options")
    if isinstance(options, SaveOptions):
        if options.workers is None and "workers" not in save_kwargs:
            return {**save_kwargs,
                    "options": dataclasses.replace(options, workers=background_workers())}
        return save_kwargs
    if save_kwargs.get("workers") in (None, 0):
        return {**save_kwargs, "workers": background_workers()}
    return save_kwargs


def save_async(
    path: str | os.PathLike[str] | Store, *, writer: Writer | None = None, **kwargs: Any
) -> Future[DistributedSaveResult]:
    """:meth:`AsyncSaver.save` on a saver made at the first call (collective, then too).

    ``writer``: the saver's (``"thread"`` unless given at the first call; another one
    later raises ``ValueError``). Call :func:`wait_async` (or :func:`close_async`)
    before the process exits, so that the last save completes.
    """
    global _default
    if _default is None or _default._closed:
        _default = AsyncSaver(writer=writer or "thread")
    elif writer is not None and writer != _default.writer:
        raise ValueError(f"save_async's saver writes in a {_default.writer}; it cannot "
                         f"change to {writer!r} (make an AsyncSaver)")
    return _default.save(path, **kwargs)


def wait_async() -> DistributedSaveResult | None:
    """Wait for the save in flight of :func:`save_async`, if any (raises its error)."""
    return _default.wait() if _default is not None else None


def close_async() -> DistributedSaveResult | None:
    """Wait for the last save of :func:`save_async` and close its saver (a writer
    process stops; it would at the interpreter's exit too). The next ``save_async``
    makes a new saver."""
    return _default.close() if _default is not None else None


__all__ = ["WRITER_NICE", "AsyncSaver", "Writer", "close_async", "save_async", "wait_async"]

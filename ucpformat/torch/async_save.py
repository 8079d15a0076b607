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
collective write (:func:`ucpformat.distributed.save_distributed`: plan, exchange,
shards, commit). The next ``save`` first waits for the previous one (and raises its
error, if it failed), so at most one save is in flight and the staging buffers, kept
between saves, are reused: after the first save, the blocked time is the copy itself.

Collectives from a background thread must not share a process group with training,
whose collectives run at the same time on the main thread: the saver uses its own gloo
group, made at construction by :func:`ucpformat.torch.comm.checkpoint_group` (every rank
must construct the saver, in the same order relative to other group creations). Pass
``group=`` to use another. gloo suits the job on GPU clusters too: a snapshot is in
host memory. The staging buffers are pinned when the source is on a GPU, and the copy
is complete (the device synchronized) before ``save`` returns.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ucpformat.comm import Communicator
from ucpformat.distributed import DistributedSaveResult
from ucpformat.storage import Store
from ucpformat.torch.comm import ProcessGroup, checkpoint_group, communicator
from ucpformat.torch.convert import to_numpy
from ucpformat.torch.distributed import collect_state, fragments_of, write_collected
from ucpformat.torch.state import Stateful


class _Staging:
    """Host buffers for snapshots, one per tensor path, reused from save to save."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.used_device = False

    def copy(self, path: str, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self.buffers[path] = buf
        on_device = tensor.device.type != "cpu"
        self.used_device = self.used_device or on_device
        buf.copy_(tensor, non_blocking=on_device)
        return to_numpy(buf, name=path)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class AsyncSaver:
    """Saves checkpoints in the background, one at a time, over its own process group."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self._group = group if group is not None else checkpoint_group()
        self._comm: Communicator = communicator(self._group)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-async-save")
        self._staging = _Staging()
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
        return self._staging.nbytes

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
        **save_kwargs: Any,
    ) -> Future[DistributedSaveResult]:
        """Collective: snapshot now, write in the background; the future gives the result.

        Arguments as for :func:`ucpformat.torch.save_distributed`. Waits for the previous
        save first and raises its error if it failed (nothing of this one has started).
        """
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed")
        with self._lock:
            t0 = time.perf_counter()
            self.wait()
            t1 = time.perf_counter()
            state = collect_state(
                model=model, optimizer=optimizer, scheduler=scheduler, step=step, extra=extra
            )
            specs, frags = fragments_of(state, self._comm.rank, self._staging.copy)
            if self._staging.used_device and torch.cuda.is_available():
                torch.cuda.synchronize()
            state.items = []  # the live tensors are not needed any more
            future = self._pool.submit(
                write_collected, path, self._comm, state, specs, frags,
                metadata=metadata, **save_kwargs,
            )
            self._pending = future
            self.last_wait_s = t1 - t0
            self.last_blocked_s = time.perf_counter() - t1
            return future

    def wait(self) -> DistributedSaveResult | None:
        """Wait for the save in flight, if any; its result (raises its error)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.result()

    def close(self) -> DistributedSaveResult | None:
        """Wait for the last save, stop the background thread, free the staging buffers."""
        if self._closed:
            return None
        try:
            return self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._staging.buffers.clear()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: AsyncSaver | None = None


def save_async(
    path: str | os.PathLike[str] | Store, **kwargs: Any
) -> Future[DistributedSaveResult]:
    """:meth:`AsyncSaver.save` on a saver made at the first call (collective, then too).

    Call :func:`wait_async` before the process exits, so that the last save completes.
    """
    global _default
    if _default is None or _default._closed:
        _default = AsyncSaver()
    return _default.save(path, **kwargs)


def wait_async() -> DistributedSaveResult | None:
    """Wait for the save in flight of :func:`save_async`, if any (raises its error)."""
    return _default.wait() if _default is not None else None


__all__ = ["AsyncSaver", "save_async", "wait_async"]

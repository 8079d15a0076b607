"""Staging tensors through host memory: a bounded pool of (pinned) buffers, copies
overlapped with writing, and the stream ordering of snapshots.

A tensor on an accelerator must be copied to host memory before it is encoded and
written. Copying the whole state first would need as much host memory as the state and
would not overlap the copy with the write. Here:

* :class:`HostBufferPool` holds host buffers of at most ``capacity_bytes`` in all
  (pinned when CUDA is available, so device-to-host copies run at full speed and
  asynchronously) and reuses them from tensor to tensor and from save to save. A single
  tensor larger than the pool is staged alone, in a buffer of its size that is freed
  when it is released: the pool then holds at most ``max(capacity_bytes, largest
  tensor)``.
* :class:`Stager` is a :class:`ucpformat.checkpoint.deferred.Feed`: once told the order in which the
  writer needs the tensors, a copy thread copies tensor ``i + 1`` (and further, while
  buffers are free) while tensor ``i`` is encoded and written; the writer takes each
  host copy when it needs it and releases it once written. A failed copy is raised to
  the writer (which then commits nothing); a failed write stops the copies.
* :class:`DeviceCopier` does the copies: a CUDA tensor on a side stream that first waits
  for the caller's current stream (so the copy sees every update queued before the
  save), with one event per tensor; a CPU tensor with a plain copy. The copier is an
  interface so that tests on a machine without a GPU can check the ordering.
* :func:`snapshot` copies a whole state at once (asynchronous saves): each tensor's
  copy is enqueued with its own event, and the caller's stream is made to wait for
  every event (:meth:`DeviceCopier.guard`), never the whole device: training goes on
  at once, and a kernel that modifies a parameter runs only after its copy finished.

Pool sizes: :data:`DEFAULT_POOL_BYTES` for synchronous saves (a few hundred MiB keep the
copy and the write busy; raise it for very fast storage), unbounded for snapshots
(they hold the whole local state until written, and are reused from save to save).
"""

from __future__ import annotations

import bisect
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ucpformat.checkpoint.deferred import Deferred
from ucpformat.errors import ResourceLimitError, UCPError, WriteError
from ucpformat.torch.numpy_bridge import data_type, to_numpy
from ucpformat.torch.writer_process import SharedArena

#: Default bound of a synchronous save's staging pool (bytes of host buffers).
DEFAULT_POOL_BYTES = 512 << 20
#: Buffers are allocated in multiples of this (so that nearby sizes share buffers).
ALIGN_BYTES = 4096

#: Records what happens, in order: ``(event, key)`` with event ``"copy-start"``,
#: ``"copy-end"``, ``"get"``, ``"release"``, ``"guard"`` (tests check the ordering).
Recorder = Callable[[str, str], None]


class StagingStopped(WriteError):
    """The staging area was stopped (another part of the save failed) before a value
    it was asked for was copied."""


# -- the pool --------------------------------------------------------------------------------


@dataclass
class PoolStats:
    """What a :class:`HostBufferPool` did (instrumentation for tests and benchmarks)."""

    capacity_bytes: int | None
    allocated_bytes: int = 0  # held now, in use or idle
    peak_allocated_bytes: int = 0
    in_use_bytes: int = 0
    peak_in_use_bytes: int = 0
    allocations: int = 0  # buffers allocated
    reuses: int = 0  # acquisitions served by an idle buffer
    pinned: bool = False


def _rounded(nbytes: int) -> int:
    return max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)


class HostBufferPool:
    """Host byte buffers, at most ``capacity_bytes`` held in all (None: no bound).

    Thread-safe. :meth:`acquire` returns an idle buffer that fits (best fit, at most
    twice the size asked), or allocates one while the bound allows, or takes a larger
    idle buffer, or frees idle buffers to make room; otherwise it waits for a
    :meth:`release`. ``pin`` (default: whether
    CUDA is available) allocates page-locked memory.
    """

    def __init__(self, capacity_bytes: int | None = DEFAULT_POOL_BYTES, *,
                 pin: bool | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        # idle buffers by size (numel), smallest first, and their sizes: a snapshot of n
        # tensors finds each buffer by bisection (scanning was n * n / 2 numel() calls)
        self._idle: list[torch.Tensor] = []
        self._idle_sizes: list[int] = []
        self._cond = threading.Condition()
        self.stats = PoolStats(capacity_bytes, pinned=self.pin)

    @staticmethod
    def buffer_bytes(nbytes: int) -> int:
        """The size of the buffer that holds ``nbytes`` (rounded up to ALIGN_BYTES)."""
        return _rounded(nbytes)

    def _fits(self, nbytes: int) -> bool:
        cap = self.capacity_bytes
        return cap is None or self.stats.allocated_bytes + nbytes <= cap

    def _take_idle(self, nbytes: int, *, most: int) -> torch.Tensor | None:
        """The smallest idle buffer of ``nbytes`` to ``most`` bytes (of those, the one
        idle longest), or None."""
        i = bisect.bisect_left(self._idle_sizes, nbytes)
        if i == len(self._idle_sizes) or self._idle_sizes[i] > most:
            return None
        del self._idle_sizes[i]
        return self._idle.pop(i)

    def _drop_idle(self) -> bool:
        """Free the largest idle buffer; False if none is idle."""
        if not self._idle:
            return False
        self._idle_sizes.pop()
        self.stats.allocated_bytes -= self._idle.pop().numel()
        return True

    def acquire(self, nbytes: int, *, wait: bool = True,
                stopped: threading.Event | None = None) -> torch.Tensor:
        """A 1-D ``uint8`` host buffer of at least ``nbytes`` bytes.

        ``wait=False`` raises :class:`~ucpformat.errors.ResourceLimitError` instead of
        waiting when the bound leaves no room; a set ``stopped`` event makes a waiting
        call raise :class:`StagingStopped`.
        """
        size = _rounded(nbytes)
        with self._cond:
            while True:
                if stopped is not None and stopped.is_set():
                    raise StagingStopped("staging was stopped before this value was copied")
                # an idle buffer of about the size; else a new one if the bound allows;
                # else any idle buffer large enough; else free idle ones to make room
                buf = self._take_idle(size, most=2 * size)
                if buf is None and not self._fits(size):
                    buf = self._take_idle(size, most=1 << 62)
                if buf is not None:
                    self.stats.reuses += 1
                    break
                while not self._fits(size) and self._drop_idle():
                    pass
                # alone in the pool, a buffer larger than the bound is allowed
                if self._fits(size) or self.stats.allocated_bytes == 0:
                    buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                    self.stats.allocations += 1
                    self.stats.allocated_bytes += size
                    self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes,
                                                          self.stats.allocated_bytes)
                    break
                if not wait:
                    raise ResourceLimitError(
                        f"the staging pool holds {self.stats.in_use_bytes} bytes in use of "
                        f"its {self.capacity_bytes}; {size} more do not fit (give the pool "
                        "more room, or None for no bound)"
                    )
                self._cond.wait(timeout=0.1)  # wakes on release (or to see ``stopped``)
            self.stats.in_use_bytes += buf.numel()
            self.stats.peak_in_use_bytes = max(self.stats.peak_in_use_bytes,
                                               self.stats.in_use_bytes)
            return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back: kept for reuse, or freed if the pool is over its bound."""
        with self._cond:
            self.stats.in_use_bytes -= buf.numel()
            cap = self.capacity_bytes
            if cap is not None and self.stats.allocated_bytes > cap:
                self.stats.allocated_bytes -= buf.numel()  # the lone oversized one
            else:
                i = bisect.bisect_right(self._idle_sizes, buf.numel())
                self._idle_sizes.insert(i, buf.numel())
                self._idle.insert(i, buf)
            self._cond.notify_all()

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._cond:
            while self._drop_idle():
                pass


def typed_view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of ``buf`` as a contiguous tensor of ``like``'s shape and type."""
    n = like.numel() * like.element_size()
    if n > buf.numel():
        raise ValueError(f"a buffer of {buf.numel()} bytes cannot hold {n}")
    offset, rest = divmod(int(buf.storage_offset()), like.element_size())
    if rest or not like.is_contiguous():  # the general way: a slice and two views
        return buf[:n].view(like.dtype).view(like.shape)
    # one call where slicing and two views take three (a snapshot makes one per tensor)
    return torch.empty(0, dtype=like.dtype, device=buf.device).set_(
        buf.untyped_storage(), offset, like.shape, like.stride())


# -- copies --------------------------------------------------------------------------------


class Copier(Protocol):
    """Copies device tensors into host buffers; the ordering contract of a save.

    ``begin`` runs on the caller's thread before any copy (copies then see everything
    the caller queued before); ``copy`` enqueues one copy and returns its completion
    handle; ``wait`` blocks the host until a copy is complete; ``guard`` (caller's
    thread) makes the caller's later work wait for a copy, so that it cannot modify the
    source before the copy read it.
    """

    def begin(self, tensors: Iterable[torch.Tensor]) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any: ...

    def wait(self, done: Any) -> None: ...

    def guard(self, done: Any) -> None: ...


class DeviceCopier:
    """CUDA tensors on a side stream (per device) after the caller's stream, one event
    per copy; other tensors copied at once. Events, never a device-wide sync."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._after: dict[torch.device, Any] = {}

    def begin(self, tensors: Iterable[torch.Tensor]) -> None:
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        for dev in devices:
            stream = self._streams.get(dev)
            if stream is None:
                stream = self._streams[dev] = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
            # the caller's stream now: the side stream waits for it before any copy
            stream.wait_stream(torch.cuda.current_stream(dev))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Device to host (a save) or host to device (a load); host to host at once."""
        device_side = src if src.device.type == "cuda" else dst
        if device_side.device.type != "cuda":
            host_copy(dst, src)
            return None
        stream = self._streams.get(device_side.device)
        if stream is None:
            raise WriteError(
                f"no copy stream for {device_side.device}: begin() was not told of it")
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        # the allocator keeps the device memory until the copy ran
        device_side.record_stream(stream)
        return (event, device_side.device)

    def wait(self, done: Any) -> None:
        if done is not None:
            done[0].synchronize()

    def guard(self, done: Any) -> None:
        if done is not None:
            event, device = done
            torch.cuda.current_stream(device).wait_event(event)


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between host tensors: numpy's memory copy where both are plain contiguous
    memory of one type (torch's ``copy_`` slows down badly when the cores are busy),
    else ``copy_``."""
    if dst.dtype == src.dtype and _plain(dst) and _plain(src):
        np.copyto(_bytes_of(dst), _bytes_of(src))
        return
    with torch.no_grad():
        dst.copy_(src)


def _bytes_of(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """numpy's view of the bytes of a plain (see :func:`_plain`) tensor: a few calls,
    where :func:`~ucpformat.torch.numpy_bridge.to_numpy` checks and converts (a snapshot makes
    one copy per tensor: hundreds of small ones)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _plain(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg())


def host_array(t: torch.Tensor, *, name: str) -> np.ndarray[Any, Any]:
    """numpy's view of a contiguous host tensor (extension types included)."""
    return to_numpy(t, name=name)


def deferred_of(key: str, tensor: torch.Tensor) -> Deferred:
    """The placeholder of ``tensor`` for a writer (shape and data type, no values)."""
    dt = data_type(tensor.dtype, tensor=key)
    return Deferred(tuple(int(n) for n in tensor.shape), dt.numpy, key)


def needs_staging(tensor: torch.Tensor) -> bool:
    """True for tensors numpy cannot view as they are: on an accelerator."""
    return tensor.device.type not in ("cpu", "meta")


# -- the streaming feed ----------------------------------------------------------------------


@dataclass
class _Slot:
    tensor: torch.Tensor
    ready: threading.Event = field(default_factory=threading.Event)
    buf: torch.Tensor | None = None
    array: np.ndarray[Any, Any] | None = None
    error: BaseException | None = None


class Stager:
    """A :class:`ucpformat.checkpoint.deferred.Feed` of torch tensors copied through a bounded pool.

    ``tensors`` maps keys to the tensors to stage (any device; CPU tensors are copied
    too, which tests use). :meth:`schedule` starts a copy thread that copies in the given
    order as long as the pool has room; :meth:`get` waits for a key's copy (a key not
    scheduled is copied on the caller's thread); :meth:`release` returns its buffer.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        pool: HostBufferPool,
        *,
        copier: Copier | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self._tensors = dict(tensors)
        self.pool = pool
        self._copier: Copier = copier if copier is not None else DeviceCopier()
        self._record = recorder or (lambda event, key: None)
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Stage ``tensor`` under ``key`` too (before it is scheduled or asked for)."""
        with self._lock:
            self._tensors[key] = tensor

    def _copy(self, key: str, slot: _Slot) -> None:
        """Copy ``slot``'s tensor into a pool buffer (the calling thread waits for it)."""
        src = slot.tensor
        buf = self.pool.acquire(src.numel() * src.element_size(), stopped=self._stopped)
        slot.buf = buf
        self._record("copy-start", key)
        host = typed_view(buf, src)
        try:
            self._copier.wait(self._copier.copy(host, src.detach()))
        except UCPError:
            raise
        except Exception as exc:
            raise WriteError(f"copying to host memory failed: {exc}", tensor=key) from exc
        slot.array = host_array(host, name=key)
        self._record("copy-end", key)

    def schedule(self, keys: Sequence[str]) -> None:
        """Start copying ``keys`` in this order (call it on the thread whose CUDA stream
        last updated the tensors: the copies wait for that stream)."""
        order: list[tuple[str, _Slot]] = []
        with self._lock:
            for key in keys:
                if key not in self._slots:
                    self._slots[key] = _Slot(self._tensors[key])
                    order.append((key, self._slots[key]))
        if not order:
            return
        self._copier.begin([slot.tensor for _, slot in order])

        def run() -> None:
            failed: BaseException | None = None
            for key, slot in order:
                if failed is None and not self._stopped.is_set():
                    try:
                        self._copy(key, slot)
                    except BaseException as exc:
                        failed = slot.error = exc
                elif failed is not None:
                    slot.error = StagingStopped(
                        f"not copied: an earlier copy failed ({failed})", tensor=key)
                else:
                    slot.error = StagingStopped("staging was stopped", tensor=key)
                slot.ready.set()

        thread = threading.Thread(target=run, name="ucp-staging", daemon=True)
        self._threads.append(thread)
        thread.start()

    def get(self, key: str) -> np.ndarray[Any, Any]:
        with self._lock:
            slot = self._slots.get(key)
            fresh = slot is None
            if slot is None:
                slot = self._slots[key] = _Slot(self._tensors[key])
        if fresh:  # not scheduled: copied here and now
            try:
                self._copier.begin([slot.tensor])
                self._copy(key, slot)
            except BaseException as exc:
                slot.error = exc
            slot.ready.set()
        while not slot.ready.wait(0.1):
            if self._stopped.is_set() and not slot.ready.is_set():
                raise StagingStopped("staging was stopped", tensor=key)
        if slot.error is not None:
            raise slot.error
        assert slot.array is not None
        self._record("get", key)
        return slot.array

    def release(self, key: str) -> None:
        with self._lock:
            slot = self._slots.pop(key, None)
        if slot is not None:
            slot.ready.wait()
            if slot.buf is not None:
                slot.array = None
                self.pool.release(slot.buf)
                slot.buf = None
            self._record("release", key)

    def stop(self) -> None:
        self._stopped.set()
        for thread in self._threads:  # every copy thread ends before buffers are returned
            if thread is not threading.current_thread():
                thread.join()
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            if slot.buf is not None:
                slot.array = None
                self.pool.release(slot.buf)
                slot.buf = None


# -- host-to-device uploads (loads) ------------------------------------------------------------


class DeviceUploads:
    """Host-to-device copies through a pool, in batches: :meth:`host_view` gives a host
    buffer shaped like a device target (waiting, if the pool is full, for the oldest
    batch in flight to finish), :meth:`upload` enqueues the copy into the target,
    :meth:`end_batch` closes a batch. :meth:`host_view` returns None where the open batch
    is full, by ``batch_bytes`` (the bytes asked for) or by the pool's buffers (a reused
    idle buffer may be larger than asked), and the caller ends the batch there. A batch's
    buffers return to the pool once all its copies are complete; then its ``then``
    callbacks run, on the caller's thread, after the caller's stream was made to wait for
    the copies (:meth:`Copier.guard`). So the next batch is read while the previous one
    is copied. :meth:`finish` retires every batch; :meth:`abort` too, returning the
    buffers of the open batch unused.
    """

    def __init__(self, pool: HostBufferPool, copier: Copier | None = None,
                 recorder: Recorder | None = None, *, batch_bytes: int | None = None) -> None:
        self.pool = pool
        self.copier: Copier = copier if copier is not None else DeviceCopier()
        self.batch_bytes = batch_bytes
        self._record = recorder or (lambda event, key: None)
        self._bufs: list[torch.Tensor] = []
        self._open_bytes = 0  # asked for by the open batch
        self._done: list[tuple[Any, Callable[[], None] | None]] = []
        self._in_flight: deque[tuple[str, list[tuple[Any, Callable[[], None] | None]],
                                     list[torch.Tensor]]] = deque()

    @property
    def batch_open(self) -> bool:
        """Whether a batch holds buffers that :meth:`end_batch` has not closed."""
        return bool(self._bufs)

    def host_view(self, target: torch.Tensor) -> torch.Tensor | None:
        """A host tensor of ``target``'s shape and type, in a pool buffer; None when the
        open batch is full, by ``batch_bytes`` or by the pool (end the batch, then ask
        again: a first buffer is always given, or the pool raises)."""
        n = target.numel() * target.element_size()
        if self._bufs and self.batch_bytes is not None and \
                self._open_bytes + n > self.batch_bytes:
            return None
        while True:
            try:
                buf = self.pool.acquire(n, wait=False)
                break
            except ResourceLimitError:
                if self._in_flight:
                    self._retire()  # the oldest batch's copies done: its buffers are free
                elif self._bufs:
                    return None
                else:
                    raise  # others hold the pool: this load cannot make room
        self._bufs.append(buf)
        self._open_bytes += n
        return typed_view(buf, target)

    def upload(self, target: torch.Tensor, host: torch.Tensor,
               then: Callable[[], None] | None = None) -> None:
        """Enqueue the copy of ``host`` (from :meth:`host_view`) into ``target``."""
        self.copier.begin([target])
        self._done.append((self.copier.copy(target, host), then))

    def end_batch(self, label: str) -> None:
        self._in_flight.append((label, self._done, self._bufs))
        self._done, self._bufs, self._open_bytes = [], [], 0

    def _retire(self) -> None:
        label, done, bufs = self._in_flight.popleft()
        try:
            for d, _ in done:
                self.copier.wait(d)
                self.copier.guard(d)
        finally:
            for buf in bufs:
                self.pool.release(buf)
        self._record("copied", label)
        for _, then in done:
            if then is not None:
                then()

    def finish(self) -> None:
        if self._done or self._bufs:
            self.end_batch("last")
        while self._in_flight:
            self._retire()

    def abort(self) -> None:
        for buf in self._bufs:
            self.pool.release(buf)
        self._bufs, self._done, self._open_bytes = [], [], 0
        while self._in_flight:
            self._retire()


# -- what a save stages ------------------------------------------------------------------------

_default_pool: HostBufferPool | None = None
_default_lock = threading.Lock()


def default_pool() -> HostBufferPool:
    """The process's shared pool for synchronous saves (:data:`DEFAULT_POOL_BYTES`), made
    at first use; its buffers serve one save after another."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = HostBufferPool(DEFAULT_POOL_BYTES)
        return _default_pool


@dataclass
class Staging:
    """How a save moves tensors to host memory (the ``staging=`` argument of the saves).

    ``pool``: the host buffers (default :func:`default_pool`; pass
    ``HostBufferPool(n)`` for another bound). ``cpu``: stage CPU tensors too (default:
    they are written from their own memory, no copy). ``enabled=False``: copy every
    tensor to the CPU up front, unbounded, as a plain ``tensor.cpu()`` does. ``copier``
    and ``recorder``: see :class:`Copier` and :data:`Recorder` (tests).
    """

    pool: HostBufferPool | None = None
    cpu: bool = False
    enabled: bool = True
    copier: Copier | None = None
    recorder: Recorder | None = None

    def stages(self, tensor: torch.Tensor) -> bool:
        """Whether a save stages ``tensor`` (otherwise numpy views or copies it at once)."""
        return self.enabled and (self.cpu or needs_staging(tensor)) and tensor.layout == \
            torch.strided and tensor.device.type != "meta"

    def stager(self, tensors: Mapping[str, torch.Tensor]) -> Stager:
        return Stager(tensors, self.pool or default_pool(), copier=self.copier,
                      recorder=self.recorder)


# -- snapshots (asynchronous saves) -----------------------------------------------------------


class Buffers(Protocol):
    """Where a :class:`Snapshot` copies: a :class:`HostBufferPool` or
    :class:`SharedBuffers`."""

    def acquire(self, nbytes: int, *, wait: bool = True,
                stopped: threading.Event | None = None) -> torch.Tensor: ...

    def release(self, buf: torch.Tensor) -> None: ...


class SharedBuffers:
    """A snapshot's buffers in host memory shared with a writer process: consecutive
    slices of a :class:`~ucpformat.torch.writer_process.SharedArena` (page-aligned),
    all given back at once by :meth:`reset`. :meth:`reserve` first, with the snapshot's
    size (:meth:`HostBufferPool.buffer_bytes` of each tensor). ``pin`` (default: whether
    CUDA is available) page-locks the arena (``cudaHostRegister``), so that copies from a
    GPU run asynchronously and at full speed (a warning if it cannot be)."""

    def __init__(self, arena: SharedArena, *, pin: bool | None = None) -> None:
        self.arena = arena
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._whole: torch.Tensor | None = None
        self._pinned = 0  # the address registered with CUDA, or 0
        self._next = 0

    def reserve(self, nbytes: int) -> None:
        """Room for ``nbytes`` (the arena grows if need be: no buffer may be in use)."""
        if self._next:
            raise WriteError("the shared staging buffers are in use")
        if self._whole is not None and nbytes <= self.arena.size:
            return
        self._release_arena()
        self.arena.reserve(nbytes)
        self._whole = torch.from_numpy(self.arena.array())
        if self.pin:
            ptr = self._whole.data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                ptr, self.arena.size, 0)
            if int(err) == 0:
                self._pinned = ptr
            else:  # correct unpinned too: the copies are then synchronous
                warnings.warn(f"page-locking {self.arena.size} bytes of shared staging memory "
                              f"failed (CUDA error {int(err)}); copying without", stacklevel=2)

    def _release_arena(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._pinned)  # type: ignore[no-untyped-call]
            self._pinned = 0
        self._whole = None
        self.arena.close()

    def acquire(self, nbytes: int, *, wait: bool = True,
                stopped: threading.Event | None = None) -> torch.Tensor:
        size = _rounded(nbytes)
        if self._whole is None or self._next + size > self.arena.size:
            raise ResourceLimitError(
                f"the shared staging arena holds {self.arena.size} bytes; {size} more do "
                "not fit (reserve() the snapshot's size first)")
        buf = self._whole[self._next:self._next + size]
        self._next += size
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Nothing: :meth:`reset` gives every buffer back."""

    def reset(self) -> None:
        self._next = 0

    def close(self) -> None:
        self._next = 0
        self._release_arena()


class Snapshot:
    """Host copies of a set of tensors, each complete once :meth:`wait` returns."""

    def __init__(self, pool: Buffers, copier: Copier) -> None:
        self.pool = pool
        self._copier = copier
        self._done: list[Any] = []
        self._buffers: list[torch.Tensor] = []

    def add(self, key: str, tensor: torch.Tensor,
            recorder: Recorder | None = None) -> np.ndarray[Any, Any]:
        nbytes = tensor.numel() * tensor.element_size()
        buf = self.pool.acquire(nbytes, wait=False)
        self._buffers.append(buf)
        host = typed_view(buf, tensor)
        if recorder:
            recorder("copy-start", key)
        self._done.append((key, self._copier.copy(host, tensor.detach())))
        return host_array(host, name=key)

    def guard(self, recorder: Recorder | None = None) -> None:
        """Caller's thread: its later work waits for every copy (per-copy events)."""
        for key, done in self._done:
            self._copier.guard(done)
            if recorder:
                recorder("guard", key)

    def wait(self) -> None:
        """The host waits until every copy is complete (the writer's thread)."""
        for _key, done in self._done:
            self._copier.wait(done)
        self._done.clear()

    def release(self) -> None:
        """Return every buffer to the pool (for the next snapshot)."""
        for buf in self._buffers:
            self.pool.release(buf)
        self._buffers.clear()


__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_POOL_BYTES",
    "Buffers",
    "Copier",
    "DeviceCopier",
    "DeviceUploads",
    "HostBufferPool",
    "PoolStats",
    "Recorder",
    "SharedBuffers",
    "Snapshot",
    "Stager",
    "Staging",
    "StagingStopped",
    "default_pool",
    "deferred_of",
    "host_array",
    "host_copy",
    "needs_staging",
    "typed_view",
]

"""Reading many stored tensors into torch tensors at once, checked before anything live changes.

Every load path of :mod:`ucpformat.torch` ends here. The reads of all the tensors asked
for go to :meth:`ucpformat.Checkpoint.read_regions` together, so the checkpoint's threads
read the inner chunks of small and large tensors alike in parallel.

A read either makes a **new** tensor (no target): the chunks land in the new tensor's own
memory, nothing is copied after the read. On another device (a GPU) they land in the
buffers of a bounded pool of pinned host memory (:mod:`ucpformat.torch.staging`, at
most :data:`DEVICE_POOL_BYTES`), a batch at a time (half the pool), and each batch is
copied to the device asynchronously, on a side stream with one event per batch, while
the next batch is read; the caller's stream waits for those events, never the whole
device. Or it fills a **target**, a tensor that
already holds live state (a model's parameter, an optimizer's state), in one of two ways:

* **staged** (the default): the target must not change unless every read of the load has
  succeeded, so the data is read into new host memory (*staging*: a damaged or missing
  chunk fails there, every CRC32C is checked) and handed to the targets only by
  :meth:`StagedReads.apply`, once the caller has checked everything else. A target whose
  memory no one else can see (:func:`can_take_memory`: a plain CPU tensor, not a view,
  sole user of its storage, neither shared between processes nor pinned) takes the
  staging memory itself, as ``module.to()`` gives a parameter new memory: no copy, and
  its old memory is freed. Any other target is copied into. Staging holds one host copy
  of what the targets receive until then.
* **in place** (``in_place=True``): a target that is a contiguous CPU tensor of the stored
  data type is itself the read buffer (no copy, no staging); a contiguous GPU target of
  the stored type is filled from the pinned pool, as new tensors on a device are; other
  targets are read into host memory and copied in right after their batch (batches of
  :data:`STAGED_BATCH_BYTES`). A failed read then leaves the targets read so far changed,
  some of them partly: the error says so and names them (:attr:`StagedReads.written`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucpformat.checkpoint.reader import Checkpoint
from ucpformat.distributed import read_locals
from ucpformat.errors import LoadError, UCPError, restated
from ucpformat.layout.boxes import LocalMap, Piece, full_box
from ucpformat.torch.numpy_bridge import from_numpy, to_numpy, torch_dtype
from ucpformat.torch.staging import (
    Copier,
    DeviceUploads,
    HostBufferPool,
    Recorder,
    host_array,
    host_copy,
)

#: Host bytes read per batch for new tensors on another device before they are moved
#: there, and (in place) for targets that cannot be read into directly.
STAGED_BATCH_BYTES = 1 << 30
#: Bound of the pinned pool through which new tensors reach a device (two batches).
DEVICE_POOL_BYTES = 512 << 20

_device_pool: HostBufferPool | None = None


@dataclass
class DeviceStaging:
    """How new tensors reach a device (the ``staging=`` argument of :func:`read_tensors`):
    the pinned ``pool`` (default: one shared pool of :data:`DEVICE_POOL_BYTES`), each
    batch half of it; ``cpu=True`` stages reads bound for the CPU too (tests);
    ``copier`` and ``recorder``: see :mod:`ucpformat.torch.staging`. The recorder sees
    ``("read", batch)`` before each batch is read and ``("copied", batch)`` once its
    copies are complete."""

    pool: HostBufferPool | None = None
    cpu: bool = False
    copier: Copier | None = None
    recorder: Recorder | None = None

    def the_pool(self) -> HostBufferPool:
        global _device_pool
        if self.pool is not None:
            return self.pool
        if _device_pool is None:
            _device_pool = HostBufferPool(DEVICE_POOL_BYTES)
        return _device_pool

    def stages(self, device: str | torch.device | None) -> bool:
        if device is None:
            return False
        return self.cpu or torch.device(device).type not in ("cpu", "meta")

_MAX_NAMED = 20


@dataclass(frozen=True)
class TensorRead:
    """Read the stored tensor at node ``path`` (``local``: the pieces of it, default all)
    into ``target`` (a tensor of the local shape), or, without a target, into a new tensor
    on the CPU or on ``device``."""

    path: str
    target: torch.Tensor | None = None
    local: LocalMap | None = None
    device: str | torch.device | None = None


def whole(shape: Sequence[int]) -> LocalMap:
    """The local map of a whole tensor (one piece, or none if it is empty)."""
    shape = tuple(int(n) for n in shape)
    box = full_box(shape)
    return LocalMap(shape, (Piece(box, box),) if math.prod(shape) or not shape else ())


@dataclass
class StagedReads:
    """What :func:`read_tensors` read: every read's tensor, the targets not yet filled."""

    #: Per read, in order: the new tensor, or the target (filled by :meth:`apply`).
    tensors: list[torch.Tensor]
    #: (target, staged host copy of what it receives), in read order.
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: In place: the node paths whose targets were written by the read (in read order).
    written: list[str] = field(default_factory=list)
    #: How :meth:`apply` moves staged data to targets on a device (None: plain copies).
    device: DeviceStaging | None = None

    @property
    def staged_bytes(self) -> int:
        """Host bytes held for the targets until :meth:`apply`."""
        return sum(s.numel() * s.element_size() for _, s in self.staged)

    def apply(self) -> None:
        """Hand the staged data to the targets (data type and device kept) and release
        it. Every byte was read and checked before: this step does not fail on the
        checkpoint's account. A target that :func:`can_take_memory` takes the staged
        tensor's memory (``target.data = staged``: the same tensor object, new memory);
        any other is copied into.

        Contiguous targets on a device (a GPU) of the staged data's type are filled
        through the pinned pool of :attr:`device`: the staged bytes are copied into a
        pool buffer, then to the device asynchronously, batch k + 1 copied into pinned
        memory while batch k goes to the device (:func:`upload_staged`); the caller's
        stream waits for those copies. Other targets take a plain copy."""
        how = self.device
        to_device = [(t, d) for t, d in self.staged if how is not None
                     and how.stages(t.device) and _uploadable(t, d)]
        chosen = {id(t) for t, _ in to_device}
        if to_device:
            assert how is not None
            upload_staged(to_device, how)
        for target, data in self.staged:
            if id(target) in chosen:
                continue
            if can_take_memory(target, data):
                with torch.no_grad():
                    target.data = data
            else:
                copy_into(target, data)
        self.staged.clear()


#: Tensor types whose memory a load may replace: others (DTensor, a quantized
#: parameter class, a fake tensor) may keep meaning in their memory beyond its values.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
#: How many references to a storage a tensor that alone uses it shows, counting the
#: handle that asks (the tensor's own and the ``untyped_storage()`` object).
_SOLE_USERS = 2


def can_take_memory(target: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether ``target`` may take ``data``'s memory instead of a copy of its values,
    with nothing but its address telling the two apart: both plain contiguous CPU tensors
    of one type, shape and strides, each the whole of its storage; ``target`` not a view,
    not an inference tensor, no other tensor (a view, an alias, ``.data``) using its
    storage, and its memory neither shared with other processes (``share_memory_()``)
    nor pinned. Where torch cannot count a storage's users, never."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or type(target) not in _PLAIN_TYPES:
        return False
    if not (_plain_memory(target) and _plain_memory(data)) or target.dtype != data.dtype \
            or target.shape != data.shape or target.stride() != data.stride():
        return False
    if target._is_view() or target.is_inference() or target.storage_offset() \
            or data.storage_offset():
        return False
    storage = target.untyped_storage()
    nbytes = target.numel() * target.element_size()
    if storage.nbytes() != nbytes or data.untyped_storage().nbytes() != nbytes:
        return False
    if storage.is_shared() or (torch.cuda.is_available() and target.is_pinned()):
        return False
    return bool(use_count(storage._cdata) == _SOLE_USERS)


def _uploadable(target: torch.Tensor, data: torch.Tensor) -> bool:
    """A target the pinned pool can fill: contiguous and of the staged data's type."""
    return target.layout == torch.strided and target.is_contiguous() and not (
        target.is_conj() or target.is_neg()) and target.dtype == data.dtype


def _device_uploads(how: DeviceStaging) -> DeviceUploads:
    """Uploads through the pinned pool of ``how``, in batches of half the pool."""
    pool = how.the_pool()
    return DeviceUploads(pool, how.copier, how.recorder,
                         batch_bytes=max(1, (pool.capacity_bytes or 2 * STAGED_BATCH_BYTES) // 2))


def upload_staged(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  how: DeviceStaging) -> None:
    """Copy each host tensor into its device target through the pinned pool of ``how``:
    host memory into a pool buffer, then the buffer to the device asynchronously, in
    batches of half the pool, each batch's buffers returned once its copies are complete
    (:class:`~ucpformat.torch.staging.DeviceUploads`). The recorder sees ``("copied",
    "apply <k>")`` once batch k is on the device."""
    uploads = _device_uploads(how)
    index = 0
    try:
        for target, data in pairs:
            host = uploads.host_view(target)
            if host is None:  # the batch is full: by its bytes, or by the pool's buffers
                uploads.end_batch(f"apply {index}")
                index += 1
                host = uploads.host_view(target)
                assert host is not None  # no batch open: a buffer, or the pool raised
            host_copy(host, data)
            uploads.upload(target, host)
        if uploads.batch_open:
            uploads.end_batch(f"apply {index}")
        uploads.finish()
    except BaseException:
        uploads.abort()
        raise


def copy_into(target: torch.Tensor, data: torch.Tensor) -> None:
    """``target.copy_(data)`` without autograd. A contiguous CPU target of ``data``'s type
    is a plain memory copy (numpy's: torch's ``copy_`` slows down badly when the machine's
    cores are busy), of their bytes: the copy is the cost staging adds to a load, and
    for thousands of small tensors the calls around it were most of that cost."""
    if target.dtype == data.dtype and _plain_memory(target) and _plain_memory(data):
        np.copyto(_bytes_of(target), _bytes_of(data))
        return
    with torch.no_grad():
        if _plain_memory(target) and target.dtype == data.dtype:
            np.copyto(to_numpy(target.detach(), name=None), to_numpy(data, name=None))
        else:
            target.copy_(data)


def _bytes_of(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """The bytes of a contiguous CPU tensor, as a numpy array sharing its memory."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _plain_memory(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor that numpy can view as it is."""
    return (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj()
            and not t.is_neg() and t.layout == torch.strided)


def _direct_view(
    ckpt: Checkpoint, path: str, target: torch.Tensor
) -> np.ndarray[Any, Any] | None:
    """A numpy view of ``target``'s memory to read into, or None if it cannot be one."""
    if _plain_memory(target) and target.dtype == torch_dtype(
        ckpt.arrays[path].dtype.name, tensor=path
    ):
        return to_numpy(target.detach(), name=path)
    return None


def named(paths: Sequence[str]) -> str:
    """The first node paths of a list, quoted, and how many more."""
    shown = ", ".join(repr(p) for p in paths[:_MAX_NAMED])
    more = f" and {len(paths) - _MAX_NAMED} more" if len(paths) > _MAX_NAMED else ""
    return shown + more


def partly_changed(exc: BaseException, written: Sequence[str]) -> BaseException:
    """``exc`` restated to say that an in-place load changed the tensors at ``written``
    (a UCPError of the same class; anything else becomes a LoadError)."""
    owners = [o for o in ("model", "optimizer") if any(p.startswith(o + "/") for p in written)]
    what = " and the ".join(owners or ["model"])
    were = "were" if len(owners) > 1 else "was"
    note = (f"; the load was in place (in_place=True), so the {what} {were} partly changed: "
            f"{len(written)} tensor(s) may hold some or all of the checkpoint's data: "
            f"{named(written)} (everything else is as it was; load a good checkpoint to "
            "make the state whole again)")
    if isinstance(exc, UCPError):
        return restated(exc, exc.message + note)
    return LoadError(f"{type(exc).__name__}: {exc}{note}")


def read_tensors(
    ckpt: Checkpoint,
    reads: Sequence[TensorRead],
    *,
    batch_bytes: int = STAGED_BATCH_BYTES,
    in_place: bool = False,
    staging: DeviceStaging | None = None,
    own_targets: bool = False,
) -> StagedReads:
    """Read every request as one batch (where memory allows).

    Staged (the default): no target changes before :meth:`StagedReads.apply`; a failure (a
    damaged or missing chunk, a refused region) raises here with every target as it was.
    ``in_place``: targets are filled by the read itself (:meth:`StagedReads.apply` has
    nothing left to do); a failure raises the error restated by :func:`partly_changed`
    when a target was written, unless ``own_targets``: the targets are tensors the caller
    allocated for this read alone (no model's or optimizer's state), and a failure is
    raised as it is, for the caller to say what it means for its state.

    New tensors for a device (and, in place, contiguous device targets of the stored
    type) go through pinned host buffers, their copies to the device overlapped with the
    next reads (``staging``, see :class:`DeviceStaging`).
    """
    how = staging if staging is not None else DeviceStaging()
    # new tensors are refused before any exists: each over max_read_bytes, and those in host
    # memory together (a device's memory is not the host's: there, each alone)
    new = [(r, (r.path, math.prod(r.local.local_shape if r.local is not None
                                  else ckpt[r.path].shape) * ckpt[r.path].dtype.itemsize))
           for r in reads if r.target is None]
    ckpt.check_new_arrays([size for r, size in new
                           if r.device is None or torch.device(r.device).type == "cpu"])
    for r, size in new:
        if r.device is not None and torch.device(r.device).type != "cpu":
            ckpt.check_new_arrays([size])
    tensors: list[torch.Tensor | None] = [None] * len(reads)
    result = StagedReads([], device=how)
    to_device = [i for i, r in enumerate(reads) if (
        how.stages(r.device) if r.target is None
        else in_place and how.stages(r.target.device) and _device_target(ckpt, r))]
    if to_device:
        try:
            moved = _read_to_device(ckpt, [reads[i] for i in to_device], how, result.written)
        except BaseException as exc:
            if result.written and not own_targets:
                raise partly_changed(exc, result.written) from exc
            raise
        for i, tensor in zip(to_device, moved, strict=True):
            tensors[i] = tensor
    chosen = set(to_device)
    rest = [(i, r) for i, r in enumerate(reads) if i not in chosen]
    pending: list[tuple[int, TensorRead, LocalMap, np.ndarray[Any, Any] | None]] = []
    held = 0  # host bytes of this batch that are not their final tensors' own memory

    def flush() -> None:
        nonlocal held
        values = read_locals(ckpt, [(r.path, lm, out) for _, r, lm, out in pending])
        for (i, r, _, out), value in zip(pending, values, strict=True):
            if r.target is None:
                tensors[i] = from_numpy(value, name=r.path, device=r.device)
                continue
            tensors[i] = r.target
            if out is not None:  # read into the target itself
                continue
            data = from_numpy(value, name=r.path)
            if in_place:
                result.written.append(r.path)
                copy_into(r.target, data)
            else:
                result.staged.append((r.target, data))
        pending.clear()
        held = 0

    def flush_or_explain() -> None:
        # in place, the targets of this batch read into directly may be partly written
        direct = [r.path for _, r, _, out in pending if out is not None]
        try:
            flush()
        except BaseException as exc:
            written = result.written + direct
            if written and not own_targets:
                raise partly_changed(exc, written) from exc
            raise
        result.written.extend(direct)

    for i, read in rest:
        meta = ckpt.arrays[read.path]
        lm = read.local if read.local is not None else whole(meta.shape)
        out = None
        nbytes = math.prod(lm.local_shape) * meta.dtype.itemsize
        if read.target is not None:
            if in_place:
                out = _direct_view(ckpt, read.path, read.target)
                held += 0 if out is not None else nbytes
        elif read.device is not None and torch.device(read.device).type != "cpu":
            held += nbytes
        pending.append((i, read, lm, out))
        # staged, only new tensors are held per batch: every target waits for apply()
        if held >= batch_bytes:
            flush_or_explain()
    if pending:
        flush_or_explain()
    for t in tensors:
        assert t is not None
    result.tensors = [t for t in tensors if t is not None]
    return result


def _device_target(ckpt: Checkpoint, read: TensorRead) -> bool:
    """A target the pinned pool can fill directly: contiguous, of the stored type."""
    t = read.target
    return t is not None and t.is_contiguous() and not t.is_conj() and not t.is_neg() \
        and t.dtype == torch_dtype(ckpt.arrays[read.path].dtype.name, tensor=read.path)


def _read_to_device(
    ckpt: Checkpoint, reads: Sequence[TensorRead], how: DeviceStaging, written: list[str]
) -> list[torch.Tensor]:
    """New tensors on their devices (or the given device targets, in place), read through
    the pinned pool: batch k + 1 is read while batch k is copied to the device
    (:class:`~ucpformat.torch.staging.DeviceUploads`; the paths of targets whose copies
    were enqueued are added to ``written``); the caller's stream waits for every copy."""
    uploads = _device_uploads(how)
    record = how.recorder or (lambda event, key: None)
    outs: list[torch.Tensor] = []
    plans: list[tuple[TensorRead, LocalMap, torch.Tensor]] = []
    for read in reads:
        meta = ckpt.arrays[read.path]
        lm = read.local if read.local is not None else whole(meta.shape)
        dst = read.target.detach() if read.target is not None else torch.empty(
            lm.local_shape, dtype=torch_dtype(meta.dtype, tensor=read.path), device=read.device)
        outs.append(dst)
        plans.append((read, lm, dst))
    batch: list[tuple[TensorRead, LocalMap, torch.Tensor, torch.Tensor]] = []
    index = 0

    def read_batch() -> None:  # read into the batch's host buffers, then enqueue its copies
        record("read", str(index))
        read_locals(ckpt, [(read.path, lm, host_array(host, name=read.path))
                           for read, lm, _, host in batch])
        written.extend(read.path for read, _, _, _ in batch if read.target is not None)
        for _, _, dst, host in batch:
            uploads.upload(dst, host)
        uploads.end_batch(str(index))

    try:
        for read, lm, dst in plans:
            host = uploads.host_view(dst)
            if host is None:  # the batch is full: by its bytes, or by the pool's buffers
                read_batch()
                batch, index = [], index + 1
                host = uploads.host_view(dst)
                assert host is not None  # no batch open: a buffer, or the pool raised
            batch.append((read, lm, dst, host))
        if batch:
            read_batch()
        uploads.finish()
    except BaseException:
        uploads.abort()
        raise
    return outs


__all__ = [
    "DEVICE_POOL_BYTES",
    "STAGED_BATCH_BYTES",
    "DeviceStaging",
    "StagedReads",
    "TensorRead",
    "can_take_memory",
    "copy_into",
    "named",
    "partly_changed",
    "read_tensors",
    "upload_staged",
    "whole",
]

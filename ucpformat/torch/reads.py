"""Reading many stored tensors into torch tensors at once, checked before anything live changes.

Every load path of :mod:`ucpformat.torch` ends here. The reads of all the tensors asked
for go to :meth:`ucpformat.Checkpoint.read_regions` together, so the checkpoint's threads
read the inner chunks of small and large tensors alike in parallel.

A read either makes a **new** tensor (no target): the chunks land in the new tensor's own
memory, nothing is copied after the read (on another device: read into host memory, then
moved, in batches of :data:`STAGED_BATCH_BYTES`). Or it fills a **target**, a tensor that
already holds live state (a model's parameter, an optimizer's state): the target must not
change unless every read of the load has succeeded, so the data is read into new host
memory (*staging*: a damaged or missing chunk fails there, every CRC32C is checked) and
copied into the targets only by :meth:`StagedReads.apply`, once the caller has checked
everything else. Staging holds one host copy of what the targets receive until then.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ucpformat.distributed import read_locals
from ucpformat.layout.boxes import LocalMap, Piece, full_box
from ucpformat.reader import Checkpoint
from ucpformat.torch.convert import from_numpy, to_numpy

#: Host bytes read for new tensors on another device before they are moved there.
STAGED_BATCH_BYTES = 1 << 30


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

    @property
    def staged_bytes(self) -> int:
        """Host bytes held for the targets until :meth:`apply`."""
        return sum(s.numel() * s.element_size() for _, s in self.staged)

    def apply(self) -> None:
        """Copy the staged data into the targets (data type and device kept) and release
        it. Every byte was read and checked before: this step does not fail on the
        checkpoint's account. A contiguous CPU target of the staged type is a plain
        memory copy (numpy's: torch's ``copy_`` slows down badly when the machine's cores
        are busy); others go through ``copy_``."""
        with torch.no_grad():
            for target, data in self.staged:
                if _plain_memory(target) and target.dtype == data.dtype:
                    np.copyto(to_numpy(target.detach(), name=None), to_numpy(data, name=None))
                else:
                    target.copy_(data)
        self.staged.clear()


def _plain_memory(t: torch.Tensor) -> bool:
    """A contiguous CPU tensor that numpy can view as it is."""
    return (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj()
            and not t.is_neg() and t.layout == torch.strided)


def read_tensors(
    ckpt: Checkpoint, reads: Sequence[TensorRead], *, batch_bytes: int = STAGED_BATCH_BYTES
) -> StagedReads:
    """Read every request as one batch; no target changes before :meth:`StagedReads.apply`.

    A failure (a damaged or missing chunk, a refused region) raises here, with every
    target as it was.
    """
    tensors: list[torch.Tensor | None] = [None] * len(reads)
    result = StagedReads([])
    pending: list[tuple[int, TensorRead, LocalMap]] = []
    moving = 0  # host bytes of new tensors bound for another device in this batch

    def flush() -> None:
        nonlocal moving
        values = read_locals(ckpt, [(r.path, lm, None) for _, r, lm in pending])
        for (i, r, _), value in zip(pending, values, strict=True):
            data = from_numpy(value, name=r.path, device=None if r.target is not None
                              else r.device)
            if r.target is None:
                tensors[i] = data
            else:
                tensors[i] = r.target
                result.staged.append((r.target, data))
        pending.clear()
        moving = 0

    for i, read in enumerate(reads):
        meta = ckpt.arrays[read.path]
        lm = read.local if read.local is not None else whole(meta.shape)
        pending.append((i, read, lm))
        if read.target is None and read.device is not None and (
            torch.device(read.device).type != "cpu"
        ):
            moving += math.prod(lm.local_shape) * meta.dtype.itemsize
            if moving >= batch_bytes:
                # only new tensors are in flight: a later failure changes nothing live
                flush()
    if pending:
        flush()
    for t in tensors:
        assert t is not None
    result.tensors = [t for t in tensors if t is not None]
    return result


__all__ = ["STAGED_BATCH_BYTES", "StagedReads", "TensorRead", "read_tensors", "whole"]

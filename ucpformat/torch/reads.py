"""Reading many stored tensors into torch tensors at once, without extra copies.

Every load path of :mod:`ucpformat.torch` ends here. The reads of all the tensors asked
for go to :meth:`ucpformat.Checkpoint.read_regions` together (in batches), so the
checkpoint's threads read the inner chunks of small and large tensors alike in
parallel. A target that is a contiguous CPU tensor of the stored data type is itself the
read buffer: chunks land in its memory and nothing is copied after the read. Other
targets (another device or data type, non-contiguous) get a read into host memory and a
``copy_``; such reads are batched by :data:`STAGED_BATCH_BYTES` so that host memory
holds at most about that much besides the targets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ucpformat.distributed import read_locals
from ucpformat.layout.boxes import LocalMap, Piece, full_box
from ucpformat.reader import Checkpoint
from ucpformat.torch.convert import from_numpy, to_numpy, torch_dtype

#: Host bytes read for targets that cannot be read into directly, per batch.
STAGED_BATCH_BYTES = 1 << 30


@dataclass(frozen=True)
class TensorRead:
    """Read the stored tensor at node ``path`` (``local``: the pieces of it, default all)
    into ``target`` (None: a new CPU tensor, or one on ``device``)."""

    path: str
    target: torch.Tensor | None = None
    local: LocalMap | None = None
    device: str | torch.device | None = None


def whole(shape: Sequence[int]) -> LocalMap:
    """The local map of a whole tensor (one piece, or none if it is empty)."""
    shape = tuple(int(n) for n in shape)
    box = full_box(shape)
    return LocalMap(shape, (Piece(box, box),) if math.prod(shape) or not shape else ())


def direct_view(ckpt: Checkpoint, path: str, target: torch.Tensor) -> np.ndarray[Any, Any] | None:
    """A numpy view of ``target``'s memory to read into, or None if it cannot be one."""
    if (
        target.device.type == "cpu"
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and target.dtype == torch_dtype(ckpt.arrays[path].dtype.name, tensor=path)
    ):
        return to_numpy(target.detach(), name=path)
    return None


def read_tensors(
    ckpt: Checkpoint, reads: Sequence[TensorRead], *, batch_bytes: int = STAGED_BATCH_BYTES
) -> list[torch.Tensor]:
    """Read every request; the tensors read (each target itself, or a new tensor)."""
    results: list[torch.Tensor | None] = [None] * len(reads)
    pending: list[tuple[int, TensorRead, LocalMap, np.ndarray[Any, Any] | None]] = []
    staged = 0

    def flush() -> None:
        nonlocal staged
        values = read_locals(ckpt, [(r.path, lm, out) for _, r, lm, out in pending])
        for (i, r, _, out), value in zip(pending, values, strict=True):
            if r.target is None:
                results[i] = from_numpy(value, name=r.path, device=r.device)
            elif out is None:  # staged: copy into the target (another device or type)
                with torch.no_grad():
                    r.target.copy_(from_numpy(value, name=r.path))
        pending.clear()
        staged = 0

    for i, read in enumerate(reads):
        meta = ckpt.arrays[read.path]
        lm = read.local if read.local is not None else whole(meta.shape)
        out: np.ndarray[Any, Any] | None = None
        if read.target is not None:
            results[i] = read.target
            out = direct_view(ckpt, read.path, read.target)
            if out is None:
                staged += math.prod(lm.local_shape) * meta.dtype.itemsize
        elif read.device is not None and torch.device(read.device).type != "cpu":
            staged += math.prod(lm.local_shape) * meta.dtype.itemsize
        pending.append((i, read, lm, out))
        if staged >= batch_bytes:
            flush()
    if pending:
        flush()
    out_tensors: list[torch.Tensor] = []
    for r in results:
        assert r is not None
        out_tensors.append(r)
    return out_tensors


__all__ = ["STAGED_BATCH_BYTES", "TensorRead", "direct_view", "read_tensors", "whole"]

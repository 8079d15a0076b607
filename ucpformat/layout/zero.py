"""Flat ZeRO-1/2 partitions: one flat buffer per parameter group, split over data-parallel ranks.

DeepSpeed (ZeRO stage 1 and 2) and Megatron's distributed optimizer keep optimizer
state as one flat buffer that concatenates the (tensor-parallel local) parameters of a
group in order, padded to a multiple of the data-parallel size, and give each rank one
equal, contiguous partition. Parameters straddle partition boundaries. Here a partition
is described as flat pieces of consolidated tensors, in both directions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ucpformat.errors import LayoutError
from ucpformat.layout.boxes import Box, LocalMap


@dataclass(frozen=True)
class FlatPiece:
    """Elements [offset, offset + size) of a partition buffer hold box ``glob`` of ``tensor``."""

    tensor: str
    offset: int
    glob: Box

    @property
    def size(self) -> int:
        return math.prod(b - a for a, b in self.glob)


@dataclass(frozen=True)
class ParamSlice:
    """Where a parameter lies in one rank's partition (DeepSpeed's param_slice_mappings)."""

    tensor: str
    param_start: int  # first flat element of the (local) parameter held here
    numel: int
    offset: int  # where it starts in the partition buffer


@dataclass(frozen=True)
class FlatPartition:
    """One data-parallel rank's partition of a flat group buffer."""

    size: int  # elements per partition (equal on every rank; the tail may be padding)
    total: int  # real elements in the whole group (before padding)
    slices: tuple[ParamSlice, ...]
    pieces: tuple[FlatPiece, ...]


def partition_size(total: int, ways: int, align: int = 1) -> int:
    """Elements per rank: the group padded to a multiple of ``ways * align``."""
    step = ways * align
    return -(-total // step) * step // ways if total else 0


def flat_partition(
    params: Sequence[tuple[str, LocalMap]],
    ways: int,
    index: int,
    *,
    align: int = 1,
) -> FlatPartition:
    """Partition ``index`` of ``ways`` of the group made of ``params`` in order.

    ``params`` are (consolidated tensor name, local map of the tensor-parallel local
    parameter). Padding elements of a local map (vocabulary padding) are part of the
    buffer but belong to no tensor.
    """
    if not 0 <= index < ways:
        raise LayoutError(f"partition {index} of {ways}", rule="UCP-1.0-R110")
    total = sum(math.prod(m.local_shape) for _, m in params)
    size = partition_size(total, ways, align)
    lo, hi = index * size, (index + 1) * size
    slices: list[ParamSlice] = []
    pieces: list[FlatPiece] = []
    start = 0
    for name, m in params:
        numel = math.prod(m.local_shape)
        a, b = max(lo, start), min(hi, start + numel)
        if a < b:
            slices.append(ParamSlice(name, a - start, b - a, a - lo))
            for off, glob in m.flat_range(a - start, b - start):
                pieces.append(FlatPiece(name, a - lo + off, glob))
        start += numel
    return FlatPartition(size, total, tuple(slices), tuple(pieces))

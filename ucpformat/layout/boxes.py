"""Boxes and pieces: the geometry under every parallel layout.

A *box* is a half-open region ``((start, stop), ...)`` of an array. A *piece* says that a
region of a rank's local tensor holds a box of the consolidated tensor; both sides have
the same number of elements and correspond in C order (so a flat range of a ZeRO
partition can hold an N-d box). A *local map* is the list of pieces of one rank's local
tensor; local elements no piece covers are padding (e.g. vocabulary padding).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None if it is empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def shift(box: Box, offset: Sequence[int]) -> Box:
    return tuple((a + o, b + o) for (a, b), o in zip(box, offset, strict=True))


def as_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose the C-order flat range [start, stop) of ``shape`` into boxes, in order.

    At most ``2 * ndim - 1`` boxes: a ragged head, a block of whole rows, a ragged tail
    (recursively by dimension).
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside {total} elements")
    if start == stop:
        return []
    if len(shape) == 0:
        return [()]
    return _flat(shape, start, stop)


def _flat(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if len(shape) == 1:
        return [((start, stop),)]
    row = math.prod(shape[1:])
    r0, o0 = divmod(start, row)
    r1, o1 = divmod(stop, row)
    out: list[Box] = []
    if r0 == r1:  # within one row
        return [((r0, r0 + 1), *b) for b in _flat(shape[1:], o0, o1)]
    if o0:
        out += [((r0, r0 + 1), *b) for b in _flat(shape[1:], o0, row)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1), *full_box(shape[1:])))
    if o1:
        out += [((r1, r1 + 1), *b) for b in _flat(shape[1:], 0, o1)]
    return out


def box_flat_ranges(shape: Sequence[int], box: Box) -> Iterator[tuple[int, int]]:
    """The C-order flat ranges of ``shape`` that make up ``box`` (merged where contiguous)."""
    shape = tuple(shape)
    if box_size(box) == 0:
        return
    # innermost dims that the box spans fully are contiguous with each other
    k = len(shape)
    while k > 0 and box[k - 1] == (0, shape[k - 1]):
        k -= 1
    if k == 0:
        yield 0, math.prod(shape)
        return
    inner = math.prod(shape[k:])
    run = (box[k - 1][1] - box[k - 1][0]) * inner
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    outer_ranges = [range(a, b) for a, b in box[: k - 1]]

    def rec(d: int, base: int) -> Iterator[tuple[int, int]]:
        if d == k - 1:
            start = base + box[k - 1][0] * strides[k - 1]
            yield start, start + run
            return
        for i in outer_ranges[d]:
            yield from rec(d + 1, base + i * strides[d])

    yield from rec(0, 0)


@dataclass(frozen=True)
class Piece:
    """``local`` (a box of the local tensor) holds ``glob`` (a box of the consolidated one).

    Both have the same number of elements, matched in C order.
    """

    local: Box
    glob: Box

    def __post_init__(self) -> None:
        if box_size(self.local) != box_size(self.glob):
            raise ValueError(f"piece sides differ in size: {self.local} vs {self.glob}")


@dataclass(frozen=True)
class LocalMap:
    """How one rank's local tensor is made of consolidated data."""

    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def covered(self) -> int:
        return sum(box_size(p.local) for p in self.pieces)

    @property
    def has_padding(self) -> bool:
        return self.covered < math.prod(self.local_shape)

    def sub_box(self, local_box: Box, new_local_origin: Sequence[int] | None = None) -> LocalMap:
        """The map of the region ``local_box`` of this local tensor (re-based at its origin).

        Only valid when every piece is box-to-box with equal shapes (not flat pieces).
        """
        origin = [a for a, _ in local_box] if new_local_origin is None else list(new_local_origin)
        pieces = []
        for p in self.pieces:
            if box_shape(p.local) != box_shape(p.glob):
                raise ValueError("sub_box needs box-shaped pieces")
            inter = intersect(p.local, local_box)
            if inter is None:
                continue
            delta = [g0 - l0 for (l0, _), (g0, _) in zip(p.local, p.glob, strict=True)]
            pieces.append(
                Piece(
                    shift(inter, [-o for o in origin]),
                    shift(inter, delta),
                )
            )
        return LocalMap(box_shape(local_box), tuple(pieces))

    def flat_range(self, start: int, stop: int) -> list[tuple[int, Box]]:
        """Elements [start, stop) of the flattened local tensor, as (flat offset, glob box).

        The flat offset is relative to ``start``. Padding elements are skipped (they are
        not part of the consolidated tensor).
        """
        out: list[tuple[int, Box]] = []
        for p in self.pieces:
            if box_shape(p.local) != box_shape(p.glob):
                raise ValueError("flat_range needs box-shaped pieces")
            delta = [g0 - l0 for (l0, _), (g0, _) in zip(p.local, p.glob, strict=True)]
            for fa, fb in box_flat_ranges(self.local_shape, p.local):
                lo, hi = max(fa, start), min(fb, stop)
                if lo >= hi:
                    continue
                for b in flat_range_to_boxes(self.local_shape, lo, hi):
                    out.append((first_flat_index(self.local_shape, b) - start, shift(b, delta)))
        out.sort(key=lambda item: item[0])
        return out


def first_flat_index(shape: Sequence[int], box: Box) -> int:
    """C-order flat index, in ``shape``, of the first element of ``box``."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return sum(a * s for (a, _), s in zip(box, strides, strict=True))

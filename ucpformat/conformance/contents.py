"""Deterministic tensor contents and digests: the language-neutral core of the suite.

Contents (spec ucp-1.0-conformance.md, "Deterministic contents", UCP-1.0-R240): the
little-endian C-order bytes of a tensor with seed ``s`` are the first ``n * itemsize``
bytes of the stream ``W_0 W_1 W_2 ...``, where ``W_k = splitmix64(s + k mod 2**64)``
written as 8 little-endian bytes. For ``bool``, element ``i`` is bit 0 of stream byte
``i`` (so every stored byte is 0x00 or 0x01). Every bit pattern of every other type is
used as is: NaN payloads, negative zeros and subnormals included, compared bit for bit.

Digests (UCP-1.0-R241): the lower-case hexadecimal SHA-256 of the little-endian C-order
bytes of a tensor or of a selection of it. A selection is one ``[start, stop, step]``
per dimension with ``0 <= start <= stop <= size`` and ``step >= 1``; it takes indices
``start, start + step, ...`` below ``stop``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ucpformat.format import dtypes

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

#: splitmix64(x) for a few x: the test vector of the spec.
TEST_VECTOR: tuple[tuple[int, int], ...] = (
    (0, 0xE220A8397B1DCDAF),
    (1, 0x910A2DEC89025CC1),
    (2, 0x975835DE1C9756CE),
    (2**64 - 1, 0xE4D971771B652C20),
)

Slice = Sequence[Sequence[int]]  # one [start, stop, step] per dimension


def splitmix64(x: int) -> int:
    """The splitmix64 output for state ``x`` (the state is advanced by the golden gamma first)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def words(seed: int, count: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """``splitmix64(seed + k)`` for k in ``range(count)``, vectorised (uint64 wraps)."""
    with np.errstate(over="ignore"):
        z = np.arange(count, dtype=np.uint64) + np.uint64(seed & MASK64)
        z += np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        return z ^ (z >> np.uint64(31))


def stream(seed: int, nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of the content stream of ``seed``."""
    return words(seed, -(-nbytes // 8)).astype("<u8").tobytes()[:nbytes]


def generate(dtype: str, shape: Sequence[int], seed: int) -> np.ndarray[Any, Any]:
    """The tensor of data type ``dtype`` (a name of the closed list) and ``shape`` for ``seed``."""
    dt = dtypes.by_name(dtype)
    n = math.prod(shape)
    raw = stream(seed, n * dt.itemsize)
    if dt.kind == "bool":
        flat = (np.frombuffer(raw, dtype=np.uint8) & 1).astype(np.bool_)
    else:
        flat = np.frombuffer(raw, dtype=dt.numpy).copy()
    return flat.reshape(tuple(shape))


def zeros(dtype: str, shape: Sequence[int]) -> np.ndarray[Any, Any]:
    """A tensor whose bits are all zero."""
    return np.zeros(tuple(shape), dtype=dtypes.by_name(dtype).numpy)


def le_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """The little-endian C-order bytes of ``array`` (bool as 0x00/0x01)."""
    arr = np.asarray(array)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).tobytes(order="C")


def sha256(array: np.ndarray[Any, Any]) -> str:
    return hashlib.sha256(le_bytes(array)).hexdigest()


def as_index(selection: Slice, shape: Sequence[int]) -> tuple[slice, ...]:
    """A selection as numpy slices, checked against ``shape``."""
    if len(selection) != len(shape):
        raise ValueError(f"selection {list(selection)} has {len(selection)} dimensions, "
                         f"the tensor {len(shape)}")
    out = []
    for item, n in zip(selection, shape, strict=True):
        start, stop, step = (int(v) for v in item)
        if not (0 <= start <= stop <= n and step >= 1):
            raise ValueError(f"[{start}, {stop}, {step}] is not a selection of a dimension of "
                             f"size {n}")
        out.append(slice(start, stop, step))
    return tuple(out)


def selection_shape(selection: Slice) -> tuple[int, ...]:
    return tuple(len(range(int(a), int(b), int(s))) for a, b, s in selection)


def box_of(selection: Slice) -> tuple[list[int], list[int]]:
    """The smallest box [starts, stops) that holds a selection (for region readers)."""
    starts, stops = [], []
    for a, b, s in selection:
        picked = range(int(a), int(b), int(s))
        if len(picked) == 0:
            starts.append(int(a))
            stops.append(int(a))
        else:
            starts.append(picked[0])
            stops.append(picked[-1] + 1)
    return starts, stops


def select(array: np.ndarray[Any, Any], selection: Slice) -> np.ndarray[Any, Any]:
    return np.asarray(array)[as_index(selection, array.shape)]


def slice_sha256(array: np.ndarray[Any, Any], selection: Slice) -> str:
    return sha256(select(array, selection))


__all__ = [
    "TEST_VECTOR",
    "as_index",
    "box_of",
    "generate",
    "le_bytes",
    "select",
    "selection_shape",
    "sha256",
    "slice_sha256",
    "splitmix64",
    "stream",
    "words",
    "zeros",
]

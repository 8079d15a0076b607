"""``ucp diff A B``: compare two checkpoints tensor by tensor and value by value.

Tensors are read in blocks of at most :data:`BLOCK_BYTES` (whole rows where they fit, so
memory stays bounded for any tensor size). "equal" means bit-exact; otherwise the largest
absolute and relative difference is computed in float64 (complex128 for complex types).
The relative difference of two elements is ``|a - b| / max(|a|, |b|)``, symmetric in A
and B. With ``--atol``/``--rtol``, a tensor whose every element has
``|a - b| <= atol + rtol * max(|a|, |b|)`` is "close" and does not count as a difference.

JSON values (optimizer hyperparameters, step, scheduler state) are compared per group as
stored. So is the metadata of every node: the root's ``attributes.ucp`` (the user's
``metadata``, the version, ``must_understand``, ...), each group's (tied-tensor aliases,
...) and each array's (role, layout semantics). A metadata difference makes the
checkpoints differ and is listed, unless ``--data-only``: then the text output lists none
and only counts them in its last line (``--json`` still carries them, beside
``"data_only": true``). Not compared:
``producer``, ``created``, ``manifest`` and ``root_sha256``, which differ between any two
saves, and how the data is stored (chunking, compression).
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.text import Text

from ucpformat.checkpoint.reader import Checkpoint, Tensor
from ucpformat.cli.common import (
    ERROR,
    FOUND,
    OK,
    console,
    logical_path,
    open_location,
    shape_text,
    value_text,
    write_json,
)

#: Largest block read from each side at once (and the float64 working copies' size).
BLOCK_BYTES = 64 << 20

EQUAL = "equal"
CLOSE = "close"
DIFFERENT = "different"
ONLY_IN_A = "only_in_a"
ONLY_IN_B = "only_in_b"
SHAPE = "shape_mismatch"
DTYPE = "dtype_mismatch"
#: Statuses that make two checkpoints differ.
DIFFERENCES = frozenset({DIFFERENT, ONLY_IN_A, ONLY_IN_B, SHAPE, DTYPE})


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "diff",
        parents=[common],
        help="compare two checkpoints tensor by tensor",
        description="Compare two checkpoints: per tensor, bit-exact equality or the largest "
        "absolute and relative difference; tensors in only one of them; shape or dtype "
        "mismatches; differing JSON values per group. Reads tensors in bounded memory. "
        "Exit status: 0 identical, 1 different, 2 could not run.",
    )
    p.add_argument("a", metavar="A", help="first checkpoint")
    p.add_argument("b", metavar="B", help="second checkpoint")
    p.add_argument("--json", action="store_true", help="print a machine-readable document")
    p.add_argument("--atol", type=_tolerance, default=None, metavar="X",
                   help="absolute tolerance: tensors within it are 'close', not different")
    p.add_argument("--rtol", type=_tolerance, default=None, metavar="X",
                   help="relative tolerance (of max(|a|, |b|)): tensors within it are 'close'")
    p.add_argument("--all", action="store_true", help="also list the tensors that are equal")
    p.add_argument("--data-only", action="store_true",
                   help="compare tensors and values only: metadata differences (user "
                   "metadata, version, roles, layout semantics, aliases) are neither listed "
                   "nor counted as differences; the last line says how many were skipped")
    p.set_defaults(run=run, invalid_status=ERROR)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


# -- blocks ------------------------------------------------------------------------------


def blocks(
    shape: Sequence[int], itemsize: int, chunk_shape: Sequence[int], limit: int = BLOCK_BYTES
) -> Iterator[tuple[list[int], list[int]]]:
    """Boxes ``[starts, stops)`` that tile ``shape``, each of at most ``limit`` bytes.

    A box is a run of whole rows along the first axis whose rows fit in ``limit``, aligned
    to the chunk edge on that axis when it can be; a single row that is too large is cut
    the same way along the next axis, and so on.
    """
    n = len(shape)
    if n == 0 or math.prod(shape) == 0:
        yield [0] * n, list(shape)
        return
    k = next(d for d in range(n) if math.prod(shape[d + 1 :]) * itemsize <= limit)
    row_bytes = math.prod(shape[k + 1 :]) * itemsize
    step = max(1, limit // row_bytes)
    if step >= chunk_shape[k]:
        step -= step % chunk_shape[k]
    for outer in itertools.product(*(range(s) for s in shape[:k])):
        for start in range(0, shape[k], step):
            yield (
                [*outer, start, *([0] * (n - k - 1))],
                [*(o + 1 for o in outer), min(start + step, shape[k]), *shape[k + 1 :]],
            )


# -- comparing tensors --------------------------------------------------------------------


@dataclass
class TensorDiff:
    """How one tensor compares."""

    path: str
    status: str
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    n_different: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "name": logical_path(self.path),
                               "status": self.status}
        if self.status in (SHAPE, DTYPE):
            doc.update(shape_a=list(self.shape_a or ()), shape_b=list(self.shape_b or ()),
                       dtype_a=self.dtype_a, dtype_b=self.dtype_b)
        elif self.status in (DIFFERENT, CLOSE):
            doc.update(n_different=self.n_different, max_abs=_finite_or_str(self.max_abs),
                       max_rel=_finite_or_str(self.max_rel))
        return doc


def _finite_or_str(x: float) -> float | str:
    """JSON has no inf or nan: those are written as strings."""
    return x if math.isfinite(x) else str(x)


def _bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The elements' bit patterns as unsigned integers (complex: two uint64 per element)."""
    size = a.dtype.itemsize
    c = np.ascontiguousarray(a)
    if size in (1, 2, 4, 8):
        return c.view(f"<u{size}")
    return c.reshape(*c.shape, 1).view("<u8")  # complex128: shape (..., 2)


@dataclass
class _Accumulator:
    atol: float
    rtol: float
    n_different: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    within: bool = True

    def add(self, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> None:
        differ = _bits(a) != _bits(b)
        if differ.ndim > a.ndim:  # complex: either half differs
            differ = differ.reshape(*a.shape, -1).any(axis=-1)
        count = int(np.count_nonzero(differ))
        if count == 0:
            return
        self.n_different += count
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        x = a[differ].astype(wide)
        y = b[differ].astype(wide)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            diff = np.abs(x - y)
            scale = np.maximum(np.abs(x), np.abs(y))
            same = (x == y) | (np.isnan(x) & np.isnan(y))
            diff[same] = 0.0
            diff[np.isnan(diff)] = np.inf  # NaN against a number, or +inf against -inf
            rel = np.where(diff == 0, 0.0, diff / np.where(scale == 0, 1.0, scale))
            rel[np.isnan(rel)] = np.inf
            ok = diff <= self.atol + self.rtol * np.where(np.isfinite(scale), scale, 0.0)
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float(rel.max()))
        self.within = self.within and bool(ok.all())


def compare_tensors(
    a: Tensor, b: Tensor, *, atol: float, rtol: float, tolerant: bool,
    limit: int = BLOCK_BYTES,
) -> TensorDiff:
    """Compare two tensors of the same path block by block."""
    result = TensorDiff(a.path, EQUAL, a.shape, b.shape, a.meta.dtype.name, b.meta.dtype.name)
    if a.shape != b.shape:
        result.status = SHAPE
        return result
    if a.meta.dtype.name != b.meta.dtype.name:
        result.status = DTYPE
        return result
    acc = _Accumulator(atol, rtol)
    # float64 working copies: size blocks by the wider of the stored and the working type
    width = max(a.meta.dtype.itemsize, 16 if a.meta.dtype.kind == "complex" else 8)
    for starts, stops in blocks(a.shape, width, a.meta.chunk_shape, limit):
        acc.add(a.read_region(starts, stops), b.read_region(starts, stops))
    result.n_different, result.max_abs, result.max_rel = acc.n_different, acc.max_abs, acc.max_rel
    if acc.n_different:
        result.status = CLOSE if tolerant and acc.within else DIFFERENT
    return result


# -- comparing values ----------------------------------------------------------------------


@dataclass
class ValueDiff:
    """A JSON value that differs between A and B (``a``/``b`` None when absent there)."""

    group: str
    key: str
    status: str
    a: Any = None
    b: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "key": self.key, "status": self.status,
                "a": self.a, "b": self.b}


def _walk(group: str, key: str, a: Any, b: Any, out: list[ValueDiff]) -> None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in [*a, *(k for k in b if k not in a)]:
            sub = f"{key}.{k}" if key else str(k)
            if k not in b:
                out.append(ValueDiff(group, sub, ONLY_IN_A, a=a[k]))
            elif k not in a:
                out.append(ValueDiff(group, sub, ONLY_IN_B, b=b[k]))
            else:
                _walk(group, sub, a[k], b[k], out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(group, f"{key}[{i}]", x, y, out)
    elif a != b or type(a) is not type(b):  # 1 and 1.0 and True differ as stored JSON
        out.append(ValueDiff(group, key, DIFFERENT, a=a, b=b))


#: Members of the root's ``attributes.ucp`` that differ between any two saves (what wrote
#: it, when, the digests sealing it), or are compared elsewhere (``values``).
_NOT_METADATA = frozenset({"producer", "created", "manifest", "root_sha256", "values"})


def compare_metadata(a: Checkpoint, b: Checkpoint) -> list[ValueDiff]:
    """Differences of the nodes' ``attributes.ucp`` (root, groups, arrays in both), values
    excluded (see :func:`compare_values`); ``group`` is the node path (``""``: root)."""
    out: list[ValueDiff] = []

    def without(ucp: Mapping[str, Any], drop: frozenset[str]) -> dict[str, Any]:
        return {k: v for k, v in ucp.items() if k not in drop}

    _walk("", "", without(a.ucp, _NOT_METADATA), without(b.ucp, _NOT_METADATA), out)
    values = frozenset({"values"})
    empty: Mapping[str, Any] = {}
    for path in sorted(set(a.groups) | set(b.groups)):
        ga, gb = a.groups.get(path), b.groups.get(path)
        _walk(path, "", without(ga.ucp, values) if ga else empty,
              without(gb.ucp, values) if gb else empty, out)
    for path in sorted(set(a.arrays) & set(b.arrays)):
        _walk(path, "", a.arrays[path].ucp, b.arrays[path].ucp, out)
    return out


def compare_values(a: Checkpoint, b: Checkpoint) -> list[ValueDiff]:
    out: list[ValueDiff] = []
    empty: Mapping[str, Any] = {}
    _walk("", "", a.root.values, b.root.values, out)
    for path in sorted(set(a.groups) | set(b.groups)):
        ga, gb = a.groups.get(path), b.groups.get(path)
        _walk(path, "", ga.values if ga else empty, gb.values if gb else empty, out)
    return out


# -- the command ---------------------------------------------------------------------------


@dataclass
class DiffResult:
    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[ValueDiff] = field(default_factory=list)
    metadata: list[ValueDiff] = field(default_factory=list)
    #: Metadata differences are reported but do not count.
    data_only: bool = False

    @property
    def identical(self) -> bool:
        return (
            not self.values
            and (self.data_only or not self.metadata)
            and all(t.status not in DIFFERENCES for t in self.tensors)
        )

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "summary": self.counts(),
            "tensors": [t.to_json() for t in self.tensors],
            "values": [v.to_json() for v in self.values],
            "metadata": [v.to_json() for v in self.metadata],
            "data_only": self.data_only,
        }


def diff_checkpoints(
    a: Checkpoint, b: Checkpoint, *, atol: float | None = None, rtol: float | None = None,
    limit: int = BLOCK_BYTES, data_only: bool = False,
) -> DiffResult:
    tolerant = atol is not None or rtol is not None
    result = DiffResult(a.location, b.location, data_only=data_only)
    for path in sorted(set(a.arrays) | set(b.arrays)):
        if path not in b.arrays:
            result.tensors.append(TensorDiff(path, ONLY_IN_A))
        elif path not in a.arrays:
            result.tensors.append(TensorDiff(path, ONLY_IN_B))
        else:
            result.tensors.append(compare_tensors(
                a[path], b[path], atol=atol or 0.0, rtol=rtol or 0.0, tolerant=tolerant,
                limit=limit,
            ))
    result.values = compare_values(a, b)
    result.metadata = compare_metadata(a, b)
    return result


_LABEL = {
    EQUAL: ("equal", "green"),
    CLOSE: ("close", "yellow"),
    DIFFERENT: ("different", "bold red"),
    ONLY_IN_A: ("only in A", "red"),
    ONLY_IN_B: ("only in B", "red"),
    SHAPE: ("shape", "bold red"),
    DTYPE: ("dtype", "bold red"),
}


def tensor_line(t: TensorDiff) -> Text:
    word, style = _LABEL[t.status]
    line = Text.assemble((f"{word:<10}", style), " ", logical_path(t.path))
    if t.status in (DIFFERENT, CLOSE):
        line.append(f"  max abs {t.max_abs:.6g}  max rel {t.max_rel:.6g}  "
                    f"({t.n_different:,} elements differ)")
    elif t.status == SHAPE:
        line.append(f"  {shape_text(t.shape_a or ())} vs {shape_text(t.shape_b or ())}")
    elif t.status == DTYPE:
        line.append(f"  {t.dtype_a} vs {t.dtype_b}")
    return line


def value_line(v: ValueDiff, label: str = "value", style: str = "bold red") -> Text:
    where = f"{logical_path(v.group)}: {v.key}" if v.group else v.key
    line = Text.assemble((f"{label:<10}", style), " ", where, "  ")
    if v.status == ONLY_IN_A:
        line.append(f"only in A ({value_text(v.a)})")
    elif v.status == ONLY_IN_B:
        line.append(f"only in B ({value_text(v.b)})")
    else:
        line.append(f"{value_text(v.a)} -> {value_text(v.b)}")
    return line


def run(args: argparse.Namespace) -> int:
    a = open_location(args.a)
    b = open_location(args.b)
    with a, b:
        result = diff_checkpoints(a, b, atol=args.atol, rtol=args.rtol,
                                  data_only=args.data_only)
    if args.json:
        write_json(result.to_json())
    else:
        out = console()
        out.print(f"A: {result.a}\nB: {result.b}", soft_wrap=True, markup=False)
        for t in result.tensors:
            if args.all or t.status != EQUAL:
                out.print(tensor_line(t), soft_wrap=True)
        for v in result.values:
            out.print(value_line(v), soft_wrap=True)
        if not args.data_only:
            for v in result.metadata:
                out.print(value_line(v, "metadata"), soft_wrap=True)
        counts = ", ".join(f"{n:,} {_LABEL[s][0]}" for s, n in sorted(result.counts().items()))
        values = f"; {len(result.values)} value(s) differ" if result.values else ""
        if result.metadata:
            ignored = " not shown (--data-only)" if args.data_only else ""
            values += f"; {len(result.metadata)} metadata difference(s){ignored}"
        verdict = ("identical", "bold green") if result.identical else ("different", "bold red")
        out.print(Text.assemble(verdict, f": {counts or 'no tensors'}{values}"), soft_wrap=True)
    return OK if result.identical else FOUND

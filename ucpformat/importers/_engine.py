"""The streaming conversion engine every importer shares.

An importer first *scans* its source: it reads metadata only (names, shapes, data
types, how each tensor is spread over files) and returns a :class:`Scan` whose tensors
carry a ``read`` callable. The engine then declares every array with
:class:`ucpformat.checkpoint.streaming.StreamingWriter`, reads and writes the tensors on a pool of
threads, and commits. At most ``memory_limit`` bytes of tensor data are in flight at
once (a tensor larger than the limit runs alone), so the peak memory of a conversion
is about ``memory_limit`` plus the encoding buffers, whatever the checkpoint's size,
and no temporary copy of the checkpoint is ever made.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat.checkpoint.streaming import StreamingWriter
from ucpformat.checkpoint.write_loop import default_workers
from ucpformat.engine import chunking
from ucpformat.errors import InvalidValueError, LayoutError, UCPError, WriteError
from ucpformat.format import names
from ucpformat.format.dtypes import DataType
from ucpformat.interchange import DEFAULT_MEMORY_LIMIT, bounded_map, result_to_json
from ucpformat.layout.rules import RuleSet
from ucpformat.progress import byte_progress


@dataclass(frozen=True)
class TensorSource:
    """One tensor of the source: where it goes, what it is, and how to read it."""

    path: str  # node path in the checkpoint (escaped names joined by "/")
    shape: tuple[int, ...]
    dtype: DataType
    read: Callable[[], np.ndarray[Any, Any]]
    attributes: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class Scan:
    """What an importer found in its source; no tensor data has been read yet."""

    format: str
    source: str
    tensors: list[TensorSource] = field(default_factory=list)
    #: group path -> members of its ``attributes.ucp`` (``values``, ``aliases``, ...)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    root_values: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: what the importer skipped or assumed, for the user
    notes: list[str] = field(default_factory=list)
    #: called once the conversion is over (closes files, releases maps)
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def group_values(self, path: str) -> dict[str, Any]:
        """The (mutable) ``values`` of a group, created if needed."""
        values: dict[str, Any] = self.groups.setdefault(path, {}).setdefault("values", {})
        return values

    def close(self) -> None:
        for fn in reversed(self.cleanup):
            fn()
        self.cleanup.clear()


@dataclass(frozen=True)
class ImportResult:
    """What a conversion wrote."""

    source: str
    destination: str
    format: str
    tensors: int
    nbytes: int
    objects: int
    seconds: float
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return result_to_json(self)


# -- layout semantics from a rule file ------------------------------------------------


@dataclass
class Annotator:
    """Layout semantics of consolidated tensors from a rule file and its parameters."""

    rules: RuleSet | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def make(rules: str | os.PathLike[str] | RuleSet | None,
             params: Mapping[str, Any] | None = None) -> Annotator:
        if rules is None or isinstance(rules, RuleSet):
            return Annotator(rules, dict(params or {}))
        return Annotator(RuleSet.load(os.fspath(rules)), dict(params or {}))

    def resolve(
        self, name: str, shape: Sequence[int]
    ) -> tuple[str, dict[str, Any] | None, str | None]:
        """(``"keep"``/``"ignore"``/``"alias"``, layout JSON or None, alias target)."""
        if self.rules is None:
            return "keep", None, None
        resolved = self.rules.resolve(name, self.params)
        if resolved is None:
            return "ignore", None, None
        if resolved.tied_to is not None:
            return "alias", None, resolved.tied_to
        layout = resolved.layout
        try:
            layout.check(tuple(shape), tensor=name)
        except LayoutError as exc:
            raise LayoutError(
                f"rule file {self.rules.name!r} does not fit this tensor: {exc.message}",
                rule=exc.rule, tensor=name,
            ) from None
        doc = layout.to_json()
        return "keep", doc or None, None


def model_attributes(role: str | None, layout: Mapping[str, Any] | None) -> dict[str, Any]:
    ucp: dict[str, Any] = {}
    if role is not None:
        ucp["role"] = role
    if layout:
        ucp["layout"] = dict(layout)
    return {"ucp": ucp} if ucp else {}


def node(*logical: str) -> str:
    """The node path of a sequence of logical names."""
    return names.path_of(*logical)


# -- running a scan ---------------------------------------------------------------------


def write_scan(
    scan: Scan,
    destination: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    workers: int | None = None,
    memory_limit: int | None = None,
    progress: bool | Callable[[int], None] = False,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = "sha256",
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    durable: bool = True,
) -> ImportResult:
    """Declare, stream and commit everything a scan found."""
    start = time.perf_counter()
    if not scan.tensors:
        raise InvalidValueError(f"no tensors found in {scan.source} ({scan.format})",
                                path=scan.source)
    if Path(destination).resolve() == Path(scan.source).resolve():
        raise InvalidValueError("the destination is the source", path=str(destination))
    writer = StreamingWriter(
        destination,
        overwrite=overwrite,
        compression=compression,
        hash_algorithm=hash_algorithm,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        durable=durable,
    )
    for t in scan.tensors:
        writer.declare(t.path, t.shape, t.dtype, attributes=t.attributes)
    for gpath, ucp in scan.groups.items():
        other = {k: v for k, v in ucp.items() if k != "values"}
        writer.group(gpath, values=ucp.get("values"), attributes=other)
    total = sum(t.nbytes for t in scan.tensors)

    def convert(t: TensorSource) -> int:
        try:
            data = t.read()
        except UCPError:
            raise
        except Exception as exc:
            raise WriteError(f"reading from the source failed: {type(exc).__name__}: {exc}",
                             tensor=t.path) from exc
        if tuple(data.shape) != t.shape:
            raise WriteError(
                f"the source gave shape {list(data.shape)}, its metadata says {list(t.shape)}",
                tensor=t.path,
            )
        writer.write(t.path, data)
        return t.nbytes

    with byte_progress(progress, total, f"importing {scan.format}") as advance:
        for n in bounded_map(
            convert,
            scan.tensors,
            lambda t: t.nbytes,
            workers=workers or default_workers(),
            memory_limit=memory_limit or DEFAULT_MEMORY_LIMIT,
        ):
            advance(n)
    result = writer.commit(metadata=scan.metadata or None, root_values=scan.root_values or None)
    return ImportResult(
        source=scan.source,
        destination=result.location,
        format=scan.format,
        tensors=result.tensors,
        nbytes=result.nbytes,
        objects=result.objects,
        seconds=time.perf_counter() - start,
        notes=tuple(scan.notes),
    )

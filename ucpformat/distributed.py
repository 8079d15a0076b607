"""Distributed save straight into the consolidated format, and resharding reads.

Every rank describes what it holds as *fragments*: a box of a consolidated tensor and
the values in it (from tensor, pipeline, expert or data parallelism, fused parts, flat
ZeRO partitions...). All ranks then compute the same plan from the gathered boxes:

1. coverage: every element of every tensor is held by at least one rank, and ranks
   holding the same element hold replicas (spec UCP-1.0-R131);
2. a shard grid per tensor, aligned with every fragment boundary when that gives
   shards of reasonable size, so each shard lies inside one rank's fragment;
3. one owner per shard, balancing bytes across the ranks that hold replicas; where no
   single rank holds a whole shard (flat ZeRO partitions cutting through rows), the
   owner receives the missing cells from the ranks that hold them before writing —
   never two writers per shard (UCP-1.0-R130);
4. each rank writes the shards it owns; rank 0 commits after every rank has succeeded,
   and not at all if any failed (UCP-1.0-R132).

Loading needs no plan: each rank reads the boxes its target layout needs, which
touches only the inner chunks that overlap them.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat import dtypes, jsonvalues, names
from ucpformat.comm import Communicator, error_report, failed_ranks, gather_failures
from ucpformat.engine import chunking
from ucpformat.engine.compression import Compression
from ucpformat.engine.grid import object_coords
from ucpformat.engine.write import StoredObject, write_object
from ucpformat.errors import LayoutError, UCPError, WriteError
from ucpformat.layout.boxes import (
    Box,
    LocalMap,
    as_slices,
    box_shape,
    box_size,
    contains,
    full_box,
    intersect,
)
from ucpformat.metadata import ArrayMeta, GroupMeta, build_root_ucp
from ucpformat.progress import byte_progress
from ucpformat.reader import Checkpoint, Region
from ucpformat.storage import Store, open_store
from ucpformat.writer import (
    WriteClaim,
    abandon,
    commit,
    default_workers,
    prepare_destination,
    zero_bits,
)

#: Aligned shards smaller than this on average make the planner use a coarse grid and
#: exchange boundary cells instead (too many tiny files otherwise). Measured
#: (benchmarks/bench_distributed.py, 2 GiB, TP4 on 4 gloo ranks): 4 MiB sent most of the
#: bf16 and fp32 weights through the exchange, and the save took 4.6 s; 1 MiB (shards
#: smaller than an inner chunk are the tiny ones) 1.3 s with 1,059 files; no exchange at
#: all 1.3 s with 1,299 files.
DEFAULT_MIN_SHARD_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """A consolidated tensor: node path, full shape, data type, attributes."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    attributes: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "attributes": dict(self.attributes),
        }

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> TensorSpec:
        return TensorSpec(doc["path"], tuple(doc["shape"]), doc["dtype"], doc.get("attributes", {}))


@dataclass(frozen=True)
class Fragment:
    """Values of box ``box`` of tensor ``path``; ``data`` has as many elements, in C order."""

    path: str
    box: Box
    data: np.ndarray[Any, Any]

    def view(self) -> np.ndarray[Any, Any]:
        """The data shaped like the box (no copy for contiguous data)."""
        return self.data.reshape(box_shape(self.box))


# -- planning ----------------------------------------------------------------------------


@dataclass
class ObjectPlan:
    """One stored object: its region, its writer, and cells it must receive."""

    coords: tuple[int, ...]
    region: Box
    owner: int
    remote: list[tuple[int, Box]] = field(default_factory=list)  # (sender rank, cell)


@dataclass
class TensorPlan:
    meta: ArrayMeta
    objects: list[ObjectPlan]


@dataclass
class Plan:
    tensors: dict[str, TensorPlan]
    groups: dict[str, GroupMeta]

    def transfers(self) -> list[tuple[int, int, str, Box]]:
        """(owner, sender, tensor path, cell) in the order every rank agrees on."""
        out = []
        for path in sorted(self.tensors):
            for obj in self.tensors[path].objects:
                for sender, cell in obj.remote:
                    out.append((obj.owner, sender, path, cell))
        return out


def _boundaries(shape: Sequence[int], boxes: Iterable[Box]) -> list[list[int]]:
    cuts: list[set[int]] = [{0, n} for n in shape]
    for box in boxes:
        for d, (a, b) in enumerate(box):
            cuts[d].update((a, b))
    return [sorted(c) for c in cuts]


def check_coverage(path: str, shape: Sequence[int], boxes: Sequence[Box]) -> list[list[int]]:
    """Refuse unless the boxes cover every element; returns the refinement cuts."""
    for box in boxes:
        if len(box) != len(shape) or not contains(full_box(shape), box):
            raise LayoutError(
                f"fragment {list(box)} lies outside shape {list(shape)}",
                rule="UCP-1.0-R131",
                tensor=path,
            )
    if math.prod(shape) == 0:
        return [[0, n] for n in shape]
    cuts = _boundaries(shape, boxes)
    covered = np.zeros(tuple(len(c) - 1 for c in cuts), dtype=bool)
    for box in boxes:
        sl = tuple(
            slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
            for c, (a, b) in zip(cuts, box, strict=True)
        )
        covered[sl] = True
    if not covered.all():
        hole = tuple(int(i) for i in np.argwhere(~covered)[0])
        cell = [(cuts[d][i], cuts[d][i + 1]) for d, i in enumerate(hole)]
        raise LayoutError(
            f"no rank holds the region {cell}: the fragments do not cover the tensor",
            rule="UCP-1.0-R131",
            tensor=path,
        )
    return cuts


def _aligned_edges(shape: Sequence[int], cuts: Sequence[Sequence[int]]) -> list[int]:
    return [
        chunking.regular_grid_for_boundaries(n, c) if n else 1
        for n, c in zip(shape, cuts, strict=True)
    ]


def _cap_edges(edges: list[int], itemsize: int, limit: int) -> list[int]:
    """Shrink edges to divisors of themselves until a shard is at most ``limit`` bytes."""
    edges = list(edges)
    while math.prod(edges) * itemsize > limit:
        d = max(range(len(edges)), key=lambda i: edges[i])
        if edges[d] == 1:
            break
        for k in range(2, edges[d] + 1):
            if edges[d] % k == 0:
                edges[d] //= k
                break
    return edges


def choose_grid(
    spec: TensorSpec,
    itemsize: int,
    cuts: Sequence[Sequence[int]],
    *,
    chunk_bytes: int,
    shard_bytes: int,
    min_shard_bytes: int,
) -> chunking.Chunking:
    """Shard and inner chunk shapes of a tensor saved from fragments with these ``cuts``.

    Inner chunk edges always fall on the fragments' boundaries (the saving layout's
    cuts), also where the shards are coarser than the fragments: a load that splits the
    tensor as the saving layout did, or in fewer parts, reads only what it needs.
    """
    shape = spec.shape
    split_dims = _split_dims(spec)
    if len(shape) == 0 or math.prod(shape) == 0:
        return chunking.choose(
            shape, itemsize, chunk_bytes=chunk_bytes, shard_bytes=shard_bytes,
            split_dims=split_dims,
        )
    nbytes = math.prod(shape) * itemsize
    edges = _aligned_edges(shape, cuts)
    count = math.prod(-(-n // e) for n, e in zip(shape, edges, strict=True))
    if count > 1 and count > max(1, nbytes // min_shard_bytes):
        # Too fine for shards: a coarse shard grid, boundary cells exchanged; the inner
        # chunks still follow the fragments along the dimensions they cut.
        align = [e if len(c) > 2 else None for e, c in zip(edges, cuts, strict=True)]
        chunk = chunking.tile_shape(
            shape, itemsize, chunk_bytes, align=align, split_dims=split_dims,
        )
        return chunking.Chunking(chunk, chunking.shard_shape_for(
            shape, chunk, itemsize, shard_bytes=shard_bytes))
    edges = _cap_edges(edges, itemsize, shard_bytes)
    if count == 1 and nbytes <= chunk_bytes:
        return chunking.Chunking(tuple(max(1, n) for n in shape), None)
    chunk = chunking.tile_shape(
        edges, itemsize, chunk_bytes, align=edges, full_shape=shape, split_dims=split_dims,
    )
    return chunking.Chunking(chunk, tuple(edges))


def _split_dims(spec: TensorSpec) -> tuple[int, ...]:
    ucp = spec.attributes.get("ucp", {})
    return chunking.split_dims_of(ucp if isinstance(ucp, Mapping) else {})


def make_plan(
    specs: Mapping[str, TensorSpec],
    boxes: Mapping[str, Sequence[tuple[int, Box]]],
    world_size: int,
    *,
    compression: str | Mapping[str, Any] | None,
    chunk_bytes: int,
    shard_bytes: int,
    min_shard_bytes: int,
    group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
) -> Plan:
    """The same plan on every rank, from the gathered specs and fragment boxes."""
    load = [0] * world_size
    counter = 0
    tensors: dict[str, TensorPlan] = {}
    for path in sorted(specs):
        spec = specs[path]
        dt = dtypes.by_name(spec.dtype, tensor=path)
        held = list(boxes.get(path, ()))
        cuts = check_coverage(path, spec.shape, [b for _, b in held])
        grid = choose_grid(
            spec,
            dt.itemsize,
            cuts,
            chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes,
            min_shard_bytes=min_shard_bytes,
        )
        meta = ArrayMeta(
            path=path,
            shape=spec.shape,
            dtype=dt,
            chunk_shape=grid.chunk_shape,
            shard_shape=grid.shard_shape,
            compression=Compression.parse(compression, dt),
            fill_value=zero_bits(dt),
            attributes=dict(spec.attributes),
        )
        objects = []
        for coords in object_coords(meta):
            region = tuple(
                (c * e, min((c + 1) * e, n))
                for c, e, n in zip(coords, meta.object_shape, meta.shape, strict=True)
            )
            nbytes = box_size(region) * dt.itemsize
            candidates = sorted({r for r, b in held if contains(b, region)})
            if candidates:
                owner = min(candidates, key=lambda r: (load[r], (r - counter) % world_size))
                objects.append(ObjectPlan(coords, region, owner))
            else:
                overlap = [0] * world_size
                for r, b in held:
                    inter = intersect(b, region)
                    if inter is not None:
                        overlap[r] += box_size(inter)
                owner = max(range(world_size), key=lambda r: (overlap[r], -load[r], -r))
                mine = [b for r, b in held if r == owner]
                remote = []
                for cell in _cells(region, cuts):
                    if any(contains(b, cell) for b in mine):
                        continue
                    sender = min(r for r, b in held if contains(b, cell))
                    remote.append((sender, cell))
                objects.append(ObjectPlan(coords, region, owner, remote))
            load[owner] += nbytes
            counter += 1
        tensors[path] = TensorPlan(meta, objects)
    groups: dict[str, GroupMeta] = {}
    for path in specs:
        parts = path.split("/")
        for i in range(1, len(parts)):
            gp = "/".join(parts[:i])
            groups.setdefault(gp, GroupMeta(gp, {}))
    for gp, ucp in (group_attributes or {}).items():
        if gp:
            groups[gp] = GroupMeta(gp, {"ucp": dict(ucp)} if ucp else {})
            parts = gp.split("/")
            for i in range(1, len(parts)):
                groups.setdefault("/".join(parts[:i]), GroupMeta("/".join(parts[:i]), {}))
    return Plan(tensors, groups)


def _cells(region: Box, cuts: Sequence[Sequence[int]]) -> list[Box]:
    """The refinement cells (by ``cuts``) inside ``region``, clipped to it, in C order."""
    per_dim = []
    for (a, b), c in zip(region, cuts, strict=True):
        pts = sorted({a, b, *(x for x in c if a < x < b)})
        per_dim.append(list(itertools.pairwise(pts)))
    out: list[Box] = [()]
    for segs in per_dim:
        out = [(*box, seg) for box in out for seg in segs]
    return out


# -- the collective save -----------------------------------------------------------------


@dataclass(frozen=True)
class DistributedSaveResult:
    location: str
    tensors: int
    objects_written_here: int
    bytes_written_here: int
    bytes_received_here: int


def _extract(fragments: Sequence[Fragment], path: str, cell: Box) -> np.ndarray[Any, Any]:
    for frag in fragments:
        if frag.path == path and contains(frag.box, cell):
            rel = tuple((a - f0, b - f0) for (a, b), (f0, _) in zip(cell, frag.box, strict=True))
            return frag.view()[as_slices(rel)]
    raise LayoutError(
        f"this rank holds no fragment containing {list(cell)}", rule="UCP-1.0-R131", tensor=path
    )


def save_distributed(
    path: str | os.PathLike[str] | Store,
    comm: Communicator,
    *,
    specs: Sequence[TensorSpec],
    fragments: Sequence[Fragment],
    group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    root_values: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    overwrite: bool = False,
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    workers: int | None = None,
    durable: bool = True,
    progress: bool = False,
) -> DistributedSaveResult:
    """Collective save: every rank passes the specs of the tensors it knows and its fragments.

    ``group_attributes`` (group path -> ``attributes.ucp``, e.g. optimizer ``values`` or
    model ``aliases``) are merged over all ranks; ``root_values`` and ``metadata`` are
    taken from rank 0. Raises the same error on
    every rank if any rank fails; then nothing is committed.
    """
    store = open_store(path, durable=durable)
    rank = comm.rank
    error: BaseException | None = None
    local_desc: dict[str, Any] = {}
    try:
        for frag in fragments:
            names.check_path(frag.path)
            if frag.data.size != box_size(frag.box):
                raise WriteError(
                    f"fragment data has {frag.data.size} elements, box {list(frag.box)} needs "
                    f"{box_size(frag.box)}",
                    tensor=frag.path,
                )
        local_desc = {
            "specs": [s.to_json() for s in specs],
            "boxes": [[f.path, [list(x) for x in f.box]] for f in fragments],
            "groups": {
                g: jsonvalues.encode(dict(a), where=g) for g, a in (group_attributes or {}).items()
            },
        }
    except BaseException as exc:  # reported collectively below
        error = exc
    gathered = comm.allgather({"desc": local_desc, "error": error_report(error)})
    _raise_if_failed(failed_ranks([g["error"] for g in gathered]), "describing fragments", error)

    specs_by_path: dict[str, TensorSpec] = {}
    boxes: dict[str, list[tuple[int, Box]]] = {}
    for r, item in enumerate(gathered):
        for sdoc in item["desc"]["specs"]:
            spec = TensorSpec.from_json(sdoc)
            known = specs_by_path.setdefault(spec.path, spec)
            if known != spec:
                raise LayoutError(
                    f"ranks disagree on the tensor: {known.to_json()} vs rank {r}: "
                    f"{spec.to_json()}",
                    rule="UCP-1.0-R131",
                    tensor=spec.path,
                )
        for p, box in item["desc"]["boxes"]:
            boxes.setdefault(p, []).append((r, tuple((int(a), int(b)) for a, b in box)))
    unknown = sorted(set(boxes) - set(specs_by_path))
    if unknown:
        raise LayoutError(
            f"fragments of tensors no rank described: {unknown[:5]}", rule="UCP-1.0-R131"
        )

    plan = make_plan(
        specs_by_path,
        boxes,
        comm.world_size,
        compression=compression,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        min_shard_bytes=min_shard_bytes,
        group_attributes=merge_group_attributes([item["desc"]["groups"] for item in gathered]),
    )

    # rank 0 prepares the destination; nobody writes before it has
    prep_error: BaseException | None = None
    claim: WriteClaim | None = None  # rank 0's hold on the location (UCP-1.0-R059)
    if rank == 0:
        try:
            claim = prepare_destination(store, overwrite=overwrite)
        except BaseException as exc:
            prep_error = exc
    _raise_if_failed(gather_failures(comm, prep_error), "preparing the destination", prep_error)

    # exchange boundary cells
    transfers = plan.transfers()
    outgoing: dict[int, list[bytes]] = {}
    for owner, sender, tpath, cell in transfers:
        if sender == rank and owner != rank:
            data = np.ascontiguousarray(_extract(fragments, tpath, cell))
            outgoing.setdefault(owner, []).append(data.reshape(-1).view(np.uint8).tobytes())
    received = comm.exchange({dst: b"".join(parts) for dst, parts in outgoing.items()})
    inbox: dict[tuple[str, Box], np.ndarray[Any, Any]] = {}
    offsets = dict.fromkeys(received, 0)
    for owner, sender, tpath, cell in transfers:
        if owner == rank and sender != rank:
            meta = plan.tensors[tpath].meta
            n = box_size(cell) * meta.dtype.itemsize
            raw = received[sender][offsets[sender] : offsets[sender] + n]
            offsets[sender] += n
            inbox[(tpath, cell)] = np.frombuffer(raw, dtype=meta.dtype.numpy).reshape(
                box_shape(cell)
            )

    # write owned objects
    objects: list[StoredObject] = []
    written = 0
    write_error: BaseException | None = None
    try:
        mine = [
            (tp.meta, obj)
            for p, tp in sorted(plan.tensors.items())
            for obj in tp.objects
            if obj.owner == rank
        ]
        by_path: dict[str, list[Fragment]] = {}
        for frag in fragments:
            by_path.setdefault(frag.path, []).append(frag)

        def assemble(meta: ArrayMeta, obj: ObjectPlan) -> np.ndarray[Any, Any]:
            local = by_path.get(meta.path, [])
            if not obj.remote:
                for frag in local:
                    if contains(frag.box, obj.region):
                        return _extract([frag], meta.path, obj.region)
            out = np.empty(box_shape(obj.region), dtype=meta.dtype.numpy)
            for frag in local:
                inter = intersect(frag.box, obj.region)
                if inter is not None:
                    dst = tuple(
                        (a - r0, b - r0) for (a, b), (r0, _) in zip(inter, obj.region, strict=True)
                    )
                    out[as_slices(dst)] = _extract([frag], meta.path, inter)
            for _sender, cell in obj.remote:
                dst = tuple(
                    (a - r0, b - r0) for (a, b), (r0, _) in zip(cell, obj.region, strict=True)
                )
                out[as_slices(dst)] = inbox[(meta.path, cell)]
            return out

        total = sum(box_size(obj.region) * meta.dtype.itemsize for meta, obj in mine)
        with (
            byte_progress(progress and rank == 0, total, f"rank {rank} saving") as advance,
            ThreadPoolExecutor(workers or default_workers()) as pool,
        ):

            def run(item: tuple[ArrayMeta, ObjectPlan]) -> StoredObject:
                meta, obj = item
                data = assemble(meta, obj).astype(meta.dtype.numpy, copy=False)
                try:
                    stored = write_object(
                        store, meta, obj.coords, data, hash_algorithm=hash_algorithm
                    )
                except OSError as exc:
                    raise WriteError(
                        f"writing {meta.object_key(obj.coords)} failed: {exc}", path=store.location
                    ) from exc
                advance(data.nbytes)
                return stored

            objects = list(pool.map(run, mine))
        store.flush()
        written = sum(o.nbytes for o in objects)
    except BaseException as exc:
        write_error = exc
    results = comm.allgather(
        {
            "error": error_report(write_error),
            "objects": [[o.key, o.nbytes, o.sha256] for o in objects],
        }
    )
    failed = failed_ranks([r["error"] for r in results])
    if failed and claim is not None:
        abandon(store, claim)  # remove what every rank wrote, release the location
    _raise_if_failed(failed, "writing shards", write_error)

    commit_error: BaseException | None = None
    if rank == 0:
        try:
            all_objects = [StoredObject(k, n, h) for item in results for k, n, h in item["objects"]]
            root_ucp = build_root_ucp(metadata=metadata, values=root_values,
                                      saved_by={"world_size": comm.world_size})
            commit(
                store,
                arrays=[tp.meta for tp in plan.tensors.values()],
                groups=list(plan.groups.values()),
                objects=all_objects,
                root_ucp=root_ucp,
                hash_algorithm=hash_algorithm,
            )
        except BaseException as exc:
            commit_error = exc
            if claim is not None:
                abandon(store, claim)
    _raise_if_failed(gather_failures(comm, commit_error), "committing", commit_error)
    return DistributedSaveResult(
        store.location,
        len(plan.tensors),
        len(objects),
        written,
        sum(len(b) for b in received.values()),
    )


def merge_group_attributes(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Union of every rank's group attributes; object values merge key by key.

    Ranks know different parts (the last pipeline stage knows the tied output layer);
    the same key with different values on two ranks is an error.
    """
    merged: dict[str, dict[str, Any]] = {}
    for rank, groups in enumerate(per_rank):
        for gpath, attrs in groups.items():
            target = merged.setdefault(gpath, {})
            for key, value in attrs.items():
                if key not in target:
                    target[key] = value
                elif isinstance(value, Mapping) and isinstance(target[key], Mapping):
                    combined = dict(target[key])
                    for k, v in value.items():
                        if k in combined and combined[k] != v:
                            raise LayoutError(
                                f"ranks disagree on {gpath}.{key}.{k}: {combined[k]!r} vs rank "
                                f"{rank}: {v!r}",
                                rule="UCP-1.0-R131",
                            )
                        combined[k] = v
                    target[key] = combined
                elif target[key] != value:
                    raise LayoutError(
                        f"ranks disagree on {gpath}.{key}: {target[key]!r} vs rank {rank}: "
                        f"{value!r}",
                        rule="UCP-1.0-R131",
                    )
    return merged


def _raise_if_failed(
    failed: Sequence[tuple[int, str]], stage: str, own: BaseException | None
) -> None:
    """Raise on every rank if any failed: this rank's own UCPError, else one naming them."""
    if not failed:
        return
    if own is not None and isinstance(own, UCPError):
        raise own
    detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
    raise WriteError(f"distributed save failed while {stage} ({detail}); nothing was committed")


# -- reading for a target layout ---------------------------------------------------------


def read_local(
    ckpt: Checkpoint,
    path: str,
    local: LocalMap,
    *,
    fill: Any = 0,
    out: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """A rank's local tensor: each piece read from its box; padding set to ``fill``.

    ``out`` (the local shape, the tensor's data type, writeable): read into it, e.g. the
    memory of a framework's local tensor, with no intermediate copy of box pieces.
    """
    return read_locals(ckpt, [(path, local, out)], fill=fill)[0]


def read_locals(
    ckpt: Checkpoint,
    items: Sequence[tuple[str, LocalMap, np.ndarray[Any, Any] | None]],
    *,
    fill: Any = 0,
) -> list[np.ndarray[Any, Any]]:
    """:func:`read_local` of many (tensor path, local map, ``out``) at once: every box
    of every tensor is read in one batch (:meth:`Checkpoint.read_regions`), so the
    checkpoint's threads read the chunks of small and large tensors together."""
    outs: list[np.ndarray[Any, Any]] = []
    regions: list[Region] = []
    flat: list[tuple[np.ndarray[Any, Any], int, int, int]] = []  # (out, a, b, region index)
    for path, local, out in items:
        tensor = ckpt[path]
        if out is None:
            # every element is read unless the map has padding: no need to fill first
            out = (np.full(local.local_shape, fill, dtype=tensor.dtype) if local.has_padding
                   else np.empty(local.local_shape, dtype=tensor.dtype))
        else:
            if tuple(out.shape) != tuple(local.local_shape) or out.dtype != tensor.dtype:
                raise LayoutError(
                    f"out is {out.dtype} of shape {list(out.shape)}; the local tensor is "
                    f"{tensor.dtype} of shape {list(local.local_shape)}",
                    tensor=path,
                )
            if local.has_padding:
                out[...] = fill
        outs.append(out)
        for piece in local.pieces:
            lo = [a for a, _ in piece.glob]
            hi = [b for _, b in piece.glob]
            if box_shape(piece.local) == box_shape(piece.glob):
                view = out[as_slices(piece.local)] if out.ndim else out
                regions.append(Region(path, lo, hi, view))
                continue
            if not out.flags.c_contiguous:
                raise LayoutError("a flat piece needs a C-contiguous out array", tensor=path)
            ((a, b),) = piece.local
            flat.append((out, a, b, len(regions)))
            regions.append(Region(path, lo, hi))
    values = ckpt.read_regions(regions)
    for out, a, b, index in flat:
        out.reshape(-1)[a:b] = values[index].reshape(-1)
    return outs


def read_flat(
    ckpt: Checkpoint, pieces: Iterable[tuple[str, int, Box]], size: int, dtype: Any
) -> np.ndarray[Any, Any]:
    """A flat partition buffer of ``size`` elements from (tensor path, offset, box) pieces."""
    out = np.zeros(size, dtype=dtype)
    for path, offset, box in pieces:
        values = ckpt[path].read_region([a for a, _ in box], [b for _, b in box])
        out[offset : offset + values.size] = values.reshape(-1)
    return out

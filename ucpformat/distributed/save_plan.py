"""The plan of a distributed save: which rank writes which stored object, which cells move.

Every rank describes what it holds (:func:`ucpformat.distributed.rank_description.describe`: the
specs of the tensors it knows and the boxes of its fragments, or, for tensors on device meshes,
its place in each mesh and their placements; no data); from all descriptions one plan
results (:func:`plan_from_descriptions`, or :func:`make_plan` from boxes gathered
otherwise, as the DCP plugin's coordinator does). The plan is a pure function of the
descriptions, so every rank that computes it gets the same one:

1. coverage: every element of every tensor is held by at least one rank, and ranks
   holding the same element hold replicas (spec UCP-1.0-R131);
2. a shard grid per tensor, aligned with every fragment boundary when that gives
   shards of reasonable size, so each shard lies inside one rank's fragment
   (UCP-1.0-R134);
3. one owner per shard, balancing bytes across the ranks that hold replicas
   (UCP-1.0-R133); where no
   single rank holds a whole shard (flat ZeRO partitions cutting through rows), the
   owner receives the missing cells from the ranks that hold them before writing —
   never two writers per shard (UCP-1.0-R130).

Tensors on a mesh laid out alike (:func:`class_key`) are planned once per class
(:class:`ClassPlan`), whatever their number.

:meth:`Plan.tasks` cuts the plan into each rank's share (:class:`RankTasks`: the objects
it writes, the cells it sends and receives; a class's share once for all its members),
which :mod:`ucpformat.distributed.pipeline` carries out.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat.checkpoint.metadata import ArrayMeta, GroupMeta, parse_array
from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.tree import zero_bits
from ucpformat.distributed.mesh_classes import (
    HeldEntry,
    MeshClass,
    class_key,
    class_members,
    distinct_boxes,
    mesh_classes,
)
from ucpformat.distributed.rank_description import (
    Description,
    TensorSpec,
    dumps,
)
from ucpformat.distributed.shard_grid import check_coverage, choose_grid, chunk_alignment
from ucpformat.engine import chunking
from ucpformat.engine.chunking import DEFAULT_MIN_SHARD_BYTES
from ucpformat.engine.compression import Compression
from ucpformat.engine.grid import object_coords
from ucpformat.errors import LayoutError, WriteError
from ucpformat.format import dtypes
from ucpformat.layout.boxes import Box, box_size, contains, intersect

#: How a plan chooses its grids: the ``compression``, ``chunk_bytes``, ``shard_bytes`` and
#: ``min_shard_bytes`` of the save's options (one :class:`SaveOptions` passed through).
PlanOptions = SaveOptions


# -- the plan ----------------------------------------------------------------------------


@dataclass(slots=True)
class ObjectPlan:
    """One stored object: its region, its writer (``owner``), and the cells the owner
    receives from other ranks, which hold them (``remote``: (sender rank, cell))."""

    path: str
    coords: tuple[int, ...]
    region: Box
    owner: int
    remote: tuple[tuple[int, Box], ...] = ()


@dataclass
class TensorPlan:
    meta: ArrayMeta
    objects: list[ObjectPlan]


@dataclass
class ClassTasks:
    """A rank's share of a :class:`ClassPlan`, the same in every member of the class:
    the stored objects it writes (``objects``; their path is irrelevant), the cells it
    sends (owner, cell) and receives (sender, cell). ``count``: the members, ``grid``
    and ``compression``: their arrays' (each rank builds the members' metadata from its
    own specs, :func:`array_meta`)."""

    key: str
    count: int
    grid: chunking.Chunking
    compression: str | Mapping[str, Any] | None
    objects: list[ObjectPlan] = field(default_factory=list)
    sends: list[tuple[int, Box]] = field(default_factory=list)
    recvs: list[tuple[int, Box]] = field(default_factory=list)

    def to_json(self) -> list[Any]:
        return [self.key, self.count, list(self.grid.chunk_shape),
                None if self.grid.shard_shape is None else list(self.grid.shard_shape),
                self.compression,
                [[list(o.coords), _box_json(o.region), [[r, _box_json(c)] for r, c in o.remote]]
                 for o in self.objects],
                [[r, _box_json(c)] for r, c in self.sends],
                [[r, _box_json(c)] for r, c in self.recvs]]

    @staticmethod
    def from_json(doc: Sequence[Any], rank: int) -> ClassTasks:
        key, count, chunk, shard, compression, objects, sends, recvs = doc
        return ClassTasks(
            str(key), int(count),
            chunking.Chunking(tuple(int(n) for n in chunk),
                              None if shard is None else tuple(int(n) for n in shard)),
            compression,
            [ObjectPlan("", tuple(int(c) for c in coords), _box(region), rank,
                        tuple((int(r), _box(c)) for r, c in remote))
             for coords, region, remote in objects],
            [(int(r), _box(c)) for r, c in sends],
            [(int(r), _box(c)) for r, c in recvs],
        )


@dataclass
class RankTasks:
    """One rank's share of a plan.

    ``arrays``: the metadata of every array it writes or sends cells of; ``objects``:
    the stored objects it writes; ``sends`` (owner, path, cell) and ``recvs`` (sender,
    path, cell), both in the order every rank agrees on (the plan's
    :meth:`Plan.transfers`). ``classes``: its share of the plan's classes of tensors on
    meshes, compact, as the coordinator sends it; :meth:`expand` adds them to the rest
    (the pipeline works on expanded tasks).
    """

    rank: int
    arrays: dict[str, ArrayMeta] = field(default_factory=dict)
    objects: list[ObjectPlan] = field(default_factory=list)
    sends: list[tuple[int, str, Box]] = field(default_factory=list)
    recvs: list[tuple[int, str, Box]] = field(default_factory=list)
    classes: list[ClassTasks] = field(default_factory=list)

    def send_sizes(self) -> dict[int, int]:
        """Bytes this rank sends to each owner, as the plan says."""
        return self._sizes(self.sends)

    def recv_sizes(self) -> dict[int, int]:
        """Bytes this rank receives from each sender, as the plan says."""
        return self._sizes(self.recvs)

    def _sizes(self, moves: Sequence[tuple[int, str, Box]]) -> dict[int, int]:
        out: dict[int, int] = {}
        for peer, path, cell in moves:
            out[peer] = out.get(peer, 0) + box_size(cell) * self.arrays[path].dtype.itemsize
        return out

    def expand(
        self,
        members: Mapping[str, Sequence[str]],
        meta_of: Callable[[str, ClassTasks], ArrayMeta],
    ) -> None:
        """Add each class's tasks to the rest, member by member (in place): ``members``:
        each class's member paths in order (:func:`class_members`), ``meta_of``: a
        member's array metadata. Raises when this rank's classes differ from the
        coordinator's (a bug, or ranks that described different things)."""
        for ct in self.classes:
            paths = members.get(ct.key, ())
            if len(paths) != ct.count:
                raise WriteError(
                    f"the coordinator planned {ct.count} tensors laid out as {ct.key}; "
                    f"rank {self.rank} described {len(paths)}"
                    + (f" (the first: {paths[0]!r})" if paths else ""),
                    tensor=paths[0] if paths else None)
            for path in paths:
                self.arrays[path] = meta_of(path, ct)
                self.objects += [ObjectPlan(path, o.coords, o.region, self.rank, o.remote)
                                 for o in ct.objects]
                self.sends += [(owner, path, cell) for owner, cell in ct.sends]
                self.recvs += [(sender, path, cell) for sender, cell in ct.recvs]
        self.classes = []

    def to_json(self, array_docs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A JSON document (array metadata as ``zarr.json``), e.g. for another process.
        ``array_docs``: the ``zarr.json`` documents by path, made once for many shares."""
        docs = array_docs or {}
        out = {
            "rank": self.rank,
            "arrays": {p: docs[p] if p in docs else m.to_zarr_json()
                       for p, m in self.arrays.items()},
            "objects": [[o.path, list(o.coords), _box_json(o.region),
                         [[s, _box_json(c)] for s, c in o.remote]] for o in self.objects],
            "sends": [[r, p, _box_json(c)] for r, p, c in self.sends],
            "recvs": [[r, p, _box_json(c)] for r, p, c in self.recvs],
        }
        if self.classes:
            out["classes"] = [ct.to_json() for ct in self.classes]
        return out

    def to_json_bytes(self, array_docs: Mapping[str, bytes]) -> bytes:
        """:meth:`to_json` as compact JSON bytes (``json.dumps`` with ``(",", ":")``
        separators), the array metadata spliced in from ``array_docs`` (each array's
        ``zarr.json`` encoded so, once for every share that names it): the coordinator
        encodes thousands of shares, and re-encoding the same documents in each was a
        quarter of its time at 16,384 ranks."""
        arrays = b",".join(dumps(p) + b":" + array_docs[p] for p in self.arrays)
        objects = dumps([[o.path, o.coords, o.region, o.remote] for o in self.objects])
        classes = (b',"classes":' + dumps([ct.to_json() for ct in self.classes])
                   if self.classes else b"")
        return b"".join((
            b'{"rank":', dumps(self.rank), b',"arrays":{', arrays, b'},"objects":', objects,
            b',"sends":', dumps(self.sends), b',"recvs":', dumps(self.recvs), classes, b"}",
        ))

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> RankTasks:
        rank = int(doc["rank"])
        return RankTasks(
            rank,
            {p: parse_array(p, m) for p, m in doc["arrays"].items()},
            [ObjectPlan(p, tuple(int(c) for c in coords), _box(region), rank,
                        tuple((int(s), _box(c)) for s, c in remote))
             for p, coords, region, remote in doc["objects"]],
            [(int(r), str(p), _box(c)) for r, p, c in doc["sends"]],
            [(int(r), str(p), _box(c)) for r, p, c in doc["recvs"]],
            [ClassTasks.from_json(c, rank) for c in doc.get("classes", ())],
        )


def _box_json(box: Box) -> list[list[int]]:
    return [[a, b] for a, b in box]


def _box(doc: Iterable[Sequence[int]]) -> Box:
    return tuple((int(a), int(b)) for a, b in doc)


@dataclass
class ClassPlan:
    """Tensors on one mesh laid out alike (placements, shape, data type, split
    dimensions): planned once, for every member alike. ``objects``: the stored objects
    whose writer is the same in every member (the one rank holding the region, or the
    rank the region's cells are gathered to; their path: the first member's);
    ``moves``: (owner, sender, cell) in every member. The objects that several ranks
    hold whole have their writers balanced member by member (in :attr:`Plan.owned`)."""

    key: str
    paths: list[str]
    grid: chunking.Chunking
    compression: str | Mapping[str, Any] | None
    objects: list[ObjectPlan]
    moves: list[tuple[int, int, Box]]


@dataclass
class Plan:
    """Every array's metadata and stored objects, and the groups; ``owned``: each rank's
    objects, ``moves``: (owner, sender, tensor path, cell) of every cell that moves, in
    the order every rank agrees on (both filled by :func:`make_plan`), except those of
    the ``classes`` of tensors on meshes, which hold their own."""

    tensors: dict[str, TensorPlan]
    groups: dict[str, GroupMeta]
    world_size: int = 1
    owned: dict[int, list[ObjectPlan]] = field(default_factory=dict)
    moves: list[tuple[int, int, str, Box]] = field(default_factory=list)
    classes: list[ClassPlan] = field(default_factory=list)

    def transfers(self) -> list[tuple[int, int, str, Box]]:
        """(owner, sender, tensor path, cell) in the order every rank agrees on."""
        return [*self.moves, *((owner, sender, path, cell) for c in self.classes
                               for path in c.paths for owner, sender, cell in c.moves)]

    def object_count(self) -> int:
        return sum(len(tp.objects) for tp in self.tensors.values())

    def move_count(self) -> int:
        """How many cells move (:meth:`transfers` without listing them)."""
        return len(self.moves) + sum(len(c.moves) * len(c.paths) for c in self.classes)

    def object_keys(self) -> set[str]:
        """The storage key of every stored object the plan writes."""
        return {tp.meta.object_key(o.coords) for tp in self.tensors.values() for o in tp.objects}

    def tasks(self, rank: int) -> RankTasks:
        """The share of ``rank``: what it writes, sends and receives (expanded)."""
        return self._tasks([rank], expand=True)[rank]

    def all_tasks(self) -> list[RankTasks]:
        """Every rank's share, compact (for a coordinator that hands each rank its own:
        each rank expands its own, :meth:`RankTasks.expand`)."""
        by_rank = self._tasks(range(self.world_size), expand=False)
        return [by_rank[r] for r in range(self.world_size)]

    def _tasks(self, ranks: Iterable[int], *, expand: bool) -> dict[int, RankTasks]:
        out = {r: RankTasks(r) for r in ranks}
        for rank, tasks in out.items():
            tasks.objects = list(self.owned.get(rank, ()))
            tasks.arrays = {o.path: self.tensors[o.path].meta for o in tasks.objects}
        for owner, sender, path, cell in self.moves:
            mine = out.get(owner)
            if mine is not None:
                mine.recvs.append((sender, path, cell))
            theirs = out.get(sender)
            if theirs is not None:
                theirs.sends.append((owner, path, cell))
                theirs.arrays.setdefault(path, self.tensors[path].meta)
        for c in self.classes:
            shares = {r: ClassTasks(c.key, len(c.paths), c.grid, c.compression) for r in out}
            for o in c.objects:
                if o.owner in shares:
                    shares[o.owner].objects.append(o)
            for owner, sender, cell in c.moves:
                if owner in shares:
                    shares[owner].recvs.append((sender, cell))
                if sender in shares:
                    shares[sender].sends.append((owner, cell))
            for rank, ct in shares.items():
                if ct.objects or ct.sends or ct.recvs:
                    out[rank].classes.append(ct)
        if expand:
            members = {c.key: c.paths for c in self.classes}
            for tasks in out.values():
                tasks.expand(members, lambda path, _: self.tensors[path].meta)
        return out


def plan_from_descriptions(
    descriptions: Sequence[Mapping[str, Any] | Description], options: PlanOptions
) -> Plan:
    """The plan from every rank's :func:`describe` (indexed by rank), or their decoded
    :class:`Description`.

    Refuses ranks that disagree on a tensor, fragments of tensors no rank described, and
    gaps in coverage (UCP-1.0-R131).
    """
    described = [Description.of(d) for d in descriptions]
    specs_by_path: dict[str, TensorSpec] = {}
    checked: set[int] = set()  # spec lists already checked (shared by several ranks)
    for r, desc in enumerate(described):
        listed = desc.specs
        for sdoc in () if id(listed) in checked else listed:
            spec = TensorSpec.from_json(sdoc)
            known = specs_by_path.setdefault(spec.path, spec)
            if known != spec:
                raise LayoutError(
                    f"ranks disagree on the tensor: {known.to_json()} vs rank {r}: "
                    f"{spec.to_json()}",
                    rule="UCP-1.0-R131",
                    tensor=spec.path,
                )
        checked.add(id(listed))
    entries = distinct_boxes(described)
    unknown = sorted(set(entries) - set(specs_by_path))
    if unknown:
        raise LayoutError(
            f"fragments of tensors no rank described: {unknown[:5]}", rule="UCP-1.0-R131"
        )
    classes = mesh_classes(described, specs_by_path)
    both = sorted({p for c in classes for p in c.paths} & set(entries))
    if both:
        raise LayoutError(
            f"tensors described both by fragments and on a mesh: {both[:5]}",
            rule="UCP-1.0-R131", tensor=both[0],
        )
    return _plan(
        specs_by_path,
        entries,
        len(described),
        compression=options.compression,
        chunk_bytes=options.chunk_bytes,
        shard_bytes=options.shard_bytes,
        min_shard_bytes=options.min_shard_bytes,
        group_attributes=merge_group_attributes([d.groups for d in described]),
        classes=classes,
    )


# -- tensors on meshes -------------------------------------------------------------------
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


# -- owners ------------------------------------------------------------------------------


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
    """The plan from the gathered specs and fragment boxes (a pure function: the same
    wherever it is computed). Linear in the objects and fragments: the ranks holding a
    region are looked up among the fragments near it."""
    entries: dict[str, list[HeldEntry]] = {}
    for path, held in boxes.items():
        by_box: dict[Box, list[int]] = {}
        for rank, box in held:
            by_box.setdefault(box, []).append(rank)
        entries[path] = [(box, sorted(set(ranks)), ranks) for box, ranks in by_box.items()]
    return _plan(specs, entries, world_size, compression=compression, chunk_bytes=chunk_bytes,
                 shard_bytes=shard_bytes, min_shard_bytes=min_shard_bytes,
                 group_attributes=group_attributes)


def array_meta(
    spec: TensorSpec, grid: chunking.Chunking, compression: str | Mapping[str, Any] | None
) -> ArrayMeta:
    """The metadata of a planned array: its spec, chunk and shard shapes, compression."""
    dt = dtypes.by_name(spec.dtype, tensor=spec.path)
    return ArrayMeta(
        path=spec.path,
        shape=spec.shape,
        dtype=dt,
        chunk_shape=grid.chunk_shape,
        shard_shape=grid.shard_shape,
        compression=Compression.parse(compression, dt),
        fill_value=zero_bits(dt),
        attributes=dict(spec.attributes),
    )


class _Owners:
    """Bytes each rank writes so far, and a counter rotating with the objects: where
    several ranks hold a region whole, the least loaded writes it, ties taken in turns
    (the replicas of a tensor take turns)."""

    def __init__(self, world_size: int) -> None:
        self.load = [0] * world_size
        self.counter = 0

    def least_loaded(self, candidates: Sequence[int]) -> int:
        least = min(map(self.load.__getitem__, candidates))
        world = len(self.load)
        return min((r for r in candidates if self.load[r] == least),
                   key=lambda r: (r - self.counter) % world)

    def take(self, owner: int, nbytes: int) -> None:
        self.load[owner] += nbytes
        self.counter += 1


@dataclass
class _TensorResult:
    """One tensor's plan: its metadata, its objects, the cells moved (owner, sender,
    cell), and per object the ranks holding it whole (empty: gathered)."""

    meta: ArrayMeta
    objects: list[ObjectPlan]
    moves: list[tuple[int, int, Box]]
    holding: list[list[int]]


def _plan_tensor(
    spec: TensorSpec,
    held: Sequence[HeldEntry],
    owners: _Owners,
    options: PlanOptions,
) -> _TensorResult:
    path = spec.path
    dt = dtypes.by_name(spec.dtype, tensor=path)
    cuts = check_coverage(path, spec.shape, [b for b, _, _ in held])
    grid = choose_grid(
        spec,
        dt.itemsize,
        cuts,
        chunk_bytes=options.chunk_bytes,
        shard_bytes=options.shard_bytes,
        min_shard_bytes=options.min_shard_bytes,
    )
    meta = array_meta(spec, grid, options.compression)
    holders = _Holders(held)
    out = _TensorResult(meta, [], [], [])
    for coords in object_coords(meta):
        region = tuple(
            (c * e, min((c + 1) * e, n))
            for c, e, n in zip(coords, meta.object_shape, meta.shape, strict=True)
        )
        candidates = holders.containing(region)
        if candidates:
            obj = ObjectPlan(path, coords, region, owners.least_loaded(candidates))
        else:
            # the rank holding most of the region writes it (ties: least loaded, then
            # lowest); only ranks holding some of it can
            overlap = holders.overlap(region)
            owner = max(overlap, key=lambda r: (overlap[r], -owners.load[r], -r))
            remote = holders.remote_cells(region, cuts, owner)
            out.moves += [(owner, sender, cell) for sender, cell in remote]
            obj = ObjectPlan(path, coords, region, owner, tuple(remote))
        out.objects.append(obj)
        out.holding.append(candidates)
        owners.take(obj.owner, box_size(region) * dt.itemsize)
    return out


def _plan(
    specs: Mapping[str, TensorSpec],
    entries: Mapping[str, Sequence[HeldEntry]],
    world_size: int,
    *,
    compression: str | Mapping[str, Any] | None,
    chunk_bytes: int,
    shard_bytes: int,
    min_shard_bytes: int,
    group_attributes: Mapping[str, Mapping[str, Any]] | None,
    classes: Sequence[MeshClass] = (),
) -> Plan:
    """:func:`make_plan` from each tensor's distinct boxes (in the order they first
    appear) and their holders, and from the ``classes`` of tensors on meshes."""
    owners = _Owners(world_size)
    options = SaveOptions(compression=compression, chunk_bytes=chunk_bytes,
                          shard_bytes=shard_bytes, min_shard_bytes=min_shard_bytes)
    plan = Plan({}, {}, world_size)
    on_mesh = {p for c in classes for p in c.paths}
    for path in sorted(specs):
        if path in on_mesh:
            continue
        result = _plan_tensor(specs[path], entries.get(path, ()), owners, options)
        plan.tensors[path] = TensorPlan(result.meta, result.objects)
        plan.moves += [(owner, sender, path, cell) for owner, sender, cell in result.moves]
        for obj in result.objects:
            plan.owned.setdefault(obj.owner, []).append(obj)
    for c in classes:
        first = specs[c.paths[0]]
        result = _plan_tensor(first, c.entries(first), owners, options)
        grid = chunking.Chunking(result.meta.chunk_shape, result.meta.shard_shape)
        fixed = [len(h) <= 1 for h in result.holding]  # the same writer in every member
        plan.classes.append(ClassPlan(
            c.key, c.paths, grid, compression,
            [o for o, f in zip(result.objects, fixed, strict=True) if f], result.moves))
        for path in c.paths:
            meta = result.meta if path == first.path else array_meta(specs[path], grid,
                                                                     compression)
            objects = []
            for obj, holding, f in zip(result.objects, result.holding, fixed, strict=True):
                if path != first.path:
                    owner = obj.owner if f else owners.least_loaded(holding)
                    obj = ObjectPlan(path, obj.coords, obj.region, owner, obj.remote)
                    owners.take(owner, box_size(obj.region) * meta.dtype.itemsize)
                if not f:
                    plan.owned.setdefault(obj.owner, []).append(obj)
                objects.append(obj)
            plan.tensors[path] = TensorPlan(meta, objects)
    for path in specs:
        parts = path.split("/")
        for i in range(1, len(parts)):
            gp = "/".join(parts[:i])
            plan.groups.setdefault(gp, GroupMeta(gp, {}))
    for gp, ucp in (group_attributes or {}).items():
        if gp:
            plan.groups[gp] = GroupMeta(gp, {"ucp": dict(ucp)} if ucp else {})
            parts = gp.split("/")
            for i in range(1, len(parts)):
                plan.groups.setdefault("/".join(parts[:i]), GroupMeta("/".join(parts[:i]), {}))
    return plan


class _Holders:
    """The fragments of one tensor, indexed so that finding the ranks that hold a region
    costs the fragments near it, not every rank's: replicas (the same box on several
    ranks) are one entry, and entries are bucketed by the intervals between the
    fragments' boundaries along dimension 0 that they span."""

    def __init__(self, entries: Sequence[HeldEntry]) -> None:
        self._starts = sorted({x for box, _, _ in entries if box for x in box[0]})
        self._buckets: list[list[HeldEntry]] = [
            [] for _ in range(max(1, len(self._starts) - 1))]
        for entry in entries:
            for i in self._span(entry[0]):
                self._buckets[i].append(entry)

    def _span(self, box: Box) -> range:
        """The buckets (dimension-0 intervals) that ``box`` overlaps."""
        if not box or len(self._starts) < 2:
            return range(len(self._buckets))
        (a, b) = box[0]
        lo = max(0, bisect.bisect_right(self._starts, a) - 1)
        hi = bisect.bisect_left(self._starts, b)
        return range(lo, min(hi, len(self._buckets)))

    def _near(self, region: Box) -> list[HeldEntry]:
        span = self._span(region)
        if len(span) == 1:
            return self._buckets[span[0]]
        seen: dict[Box, tuple[Box, list[int], list[int]]] = {}
        for i in span:
            for entry in self._buckets[i]:
                seen.setdefault(entry[0], entry)
        return list(seen.values())

    def containing(self, region: Box) -> list[int]:
        """The ranks holding ``region`` whole, ascending (do not modify the list)."""
        matches = [ranks for box, ranks, _ in self._near(region) if contains(box, region)]
        if len(matches) == 1:
            return matches[0]
        return sorted({r for ranks in matches for r in ranks})

    def overlap(self, region: Box) -> dict[int, int]:
        """Elements of ``region`` held by each rank that holds any of it."""
        out: dict[int, int] = {}
        for box, _, ranks in self._near(region):
            inter = intersect(box, region)
            if inter is not None:
                n = box_size(inter)
                for r in ranks:
                    out[r] = out.get(r, 0) + n
        return out

    def remote_cells(
        self, region: Box, cuts: Sequence[Sequence[int]], owner: int
    ) -> list[tuple[int, Box]]:
        """(sender, box) of the parts of ``region`` that ``owner`` does not hold, in C
        order of their first cell: the refinement cells (by ``cuts``, the sorted
        boundaries of every fragment) it lacks, each from the lowest rank holding it,
        joined into boxes that each lie inside one fragment of their sender.

        A fragment's boundaries are among the cuts, so a fragment either holds a cell
        whole or none of it: the fragments near the region mark the cells they hold on
        a grid of the region's cells (one array operation per fragment). The cells are
        then joined: runs of cells from the same fragment along the last dimension, and
        equal runs of consecutive rows. Sending cells one by one grew with the square of
        the partitions in a tensor (each flat ZeRO partition's whole rows cut by every
        other partition's column boundaries): 13 million cells for Mixtral at 16,384
        ranks, where the joined boxes are three per partition at most."""
        edges: list[list[int]] = []
        for (a, b), c in zip(region, cuts, strict=True):
            if a >= b:
                return []
            edges.append([a, *c[bisect.bisect_right(c, a):bisect.bisect_left(c, b)], b])
        shape = tuple(len(e) - 1 for e in edges)
        lowest = np.full(shape, np.iinfo(np.int64).max, dtype=np.int64)
        source = np.full(shape, -1, dtype=np.int64)  # the fragment (index in near) sent
        held = np.zeros(shape, dtype=bool)
        near = self._near(region)
        for k, (box, ranks, listed) in enumerate(near):
            inter = intersect(box, region)
            if inter is None:
                continue
            at = tuple(slice(bisect.bisect_left(e, a), bisect.bisect_left(e, b))
                       for e, (a, b) in zip(edges, inter, strict=True))
            better = lowest[at] > ranks[0]
            lowest[at][better] = ranks[0]
            source[at][better] = k
            if owner in listed:
                held[at] = True
        if not shape:  # a 0-d tensor: one cell
            return [] if held else [(int(lowest), ())]
        source[held] = -1
        return [(near[k][1][0], box) for k, box in _joined(source, edges)]


def _joined(
    label: np.ndarray[Any, np.dtype[np.int64]], edges: Sequence[Sequence[int]]
) -> list[tuple[int, Box]]:
    """(label, box) of the boxes that join the cells of the grid ``label`` (cells with
    label -1 left out; ``edges``: each dimension's cell boundaries), in C order of their
    first cell: runs of one label along the last dimension, joined with the same run of
    the next rows (the dimension before the last); leading dimensions one cell thick."""
    cols = label.shape[-1]
    rows = label.shape[-2] if label.ndim > 1 else 1
    flat = label.reshape(-1, cols)
    starts_run = np.ones(flat.shape, dtype=bool)
    starts_run[:, 1:] = flat[:, 1:] != flat[:, :-1]
    line, start = np.nonzero(starts_run)  # C order
    end = np.empty_like(start)
    end[:-1] = start[1:]
    last = np.ones(len(start), dtype=bool)
    last[:-1] = line[1:] != line[:-1]
    end[last] = cols
    lab = flat[line, start]
    keep = lab >= 0
    line, start, end, lab = line[keep], start[keep], end[keep], lab[keep]
    if not len(line):
        return []
    outer, row = np.divmod(line, rows)
    # equal runs (same outer index, columns and label) of consecutive rows: one box
    order = np.lexsort((row, lab, end, start, outer))
    o, s, e, lb, r = outer[order], start[order], end[order], lab[order], row[order]
    new = np.ones(len(o), dtype=bool)
    new[1:] = ((o[1:] != o[:-1]) | (s[1:] != s[:-1]) | (e[1:] != e[:-1])
               | (lb[1:] != lb[:-1]) | (r[1:] != r[:-1] + 1))
    first = np.flatnonzero(new)
    stop = np.append(first[1:], len(o)) - 1
    boxes = sorted(zip(o[first].tolist(), r[first].tolist(), s[first].tolist(),
                       r[stop].tolist(), e[first].tolist(), lb[first].tolist(), strict=True))
    lead = edges[:-2]
    out: list[tuple[int, Box]] = []
    for ob, r0, c0, r1, c1, k in boxes:
        box: list[tuple[int, int]] = []
        if lead:
            for e_, i in zip(lead, np.unravel_index(ob, label.shape[:-2]), strict=True):
                box.append((e_[int(i)], e_[int(i) + 1]))
        if label.ndim > 1:
            box.append((edges[-2][r0], edges[-2][r1 + 1]))
        box.append((edges[-1][c0], edges[-1][c1]))
        out.append((k, tuple(box)))
    return out


__all__ = [
    "DEFAULT_MIN_SHARD_BYTES",
    "ClassPlan",
    "ClassTasks",
    "ObjectPlan",
    "Plan",
    "PlanOptions",
    "RankTasks",
    "TensorPlan",
    "TensorSpec",
    "array_meta",
    "check_coverage",
    "choose_grid",
    "chunk_alignment",
    "class_key",
    "class_members",
    "make_plan",
    "merge_group_attributes",
    "plan_from_descriptions",
]

"""Tensors on device meshes in a distributed save: planned once per class of alike tensors.

Ranks describe DTensor-style tensors by their mesh and placements
(:class:`~ucpformat.distributed.rank_description.MeshTensor`), not by boxes. The
coordinator groups alike tensors (:func:`class_key`: same shape, data type, mesh and
placements) into classes (:func:`mesh_classes`), derives every rank's box from its place
in the mesh, and plans each class once. :func:`distinct_boxes` gathers the boxes of the
tensors described by their fragments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucpformat.distributed.rank_description import (
    Description,
    TensorSpec,
    dumps,
    mesh_boxes,
)
from ucpformat.distributed.shard_grid import split_dims
from ucpformat.errors import LayoutError
from ucpformat.layout.boxes import Box
from ucpformat.layout.dtensor import (
    Placement,
    Replicate,
    placement_from_json,
)


def class_key(spec: TensorSpec, mesh: str, placements: Sequence[Any]) -> str:
    """The class of a tensor on a mesh (``placements`` as JSON): tensors of one class
    have the same fragments on the same ranks and the same grid, and are planned once."""
    return dumps([mesh, list(placements), list(spec.shape), spec.dtype,
                   list(split_dims(spec))]).decode()


def class_members(
    spec_of: Mapping[str, TensorSpec], sharded: Iterable[Sequence[Any]]
) -> dict[str, list[str]]:
    """Each class (:func:`class_key`) of the tensors on meshes, (path, mesh, placements
    as JSON) as :func:`describe` lists them: its member paths, sorted. The coordinator
    and each rank compute it alike from what the rank described."""
    out: dict[str, list[str]] = {}
    for path, mesh, placements in sharded:
        spec = spec_of.get(path)
        if spec is None:
            raise LayoutError(f"the tensor on mesh {mesh!r} has no spec", rule="UCP-1.0-R131",
                              tensor=path)
        out.setdefault(class_key(spec, mesh, placements), []).append(path)
    for paths in out.values():
        paths.sort()
    return out


@dataclass
class MeshClass:
    """One class of tensors on a mesh, as the coordinator plans it."""

    key: str
    paths: list[str]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    ranks: Mapping[tuple[int, ...], int]  # each position of the mesh: its rank

    def entries(self, spec: TensorSpec) -> list[HeldEntry]:
        """The distinct boxes of a member and the ranks holding them, from each rank's
        place in the mesh (positions that differ only along replicated mesh
        dimensions hold the same boxes, computed once)."""
        sharded = [i for i, p in enumerate(self.placements) if not isinstance(p, Replicate)]
        maps: dict[tuple[int, ...], list[Box]] = {}
        by_box: dict[Box, list[int]] = {}
        for coords, rank in self.ranks.items():
            seen = tuple(coords[i] for i in sharded)
            boxes = maps.get(seen)
            if boxes is None:
                boxes = maps[seen] = mesh_boxes(spec.shape, self.mesh_shape, coords,
                                                self.placements, tensor=spec.path)
            for box in boxes:
                by_box.setdefault(box, []).append(rank)
        return [(box, sorted(set(ranks)), ranks) for box, ranks in by_box.items()]


def mesh_places(described: Sequence[Description]
                 ) -> dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], int]]]:
    """Each mesh: its shape and the rank at each position. Refuses ranks that disagree
    on a mesh's shape, two ranks at one position, and a position without a rank."""
    places: dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], int]]] = {}
    for rank, d in enumerate(described):
        for name, place in d.meshes.items():
            shape = tuple(int(n) for n in place["shape"])
            coords = tuple(int(c) for c in place["coords"])
            known, at = places.setdefault(name, (shape, {}))
            if known != shape:
                raise LayoutError(f"ranks disagree on the shape of mesh {name!r}: "
                                  f"{list(known)} vs rank {rank}: {list(shape)}",
                                  rule="UCP-1.0-R114")
            if len(coords) != len(shape) or not all(
                    0 <= c < n for c, n in zip(coords, shape, strict=True)):
                raise LayoutError(f"rank {rank} sits at {list(coords)}, outside mesh "
                                  f"{name!r} of shape {list(shape)}", rule="UCP-1.0-R114")
            other = at.setdefault(coords, rank)
            if other != rank:
                raise LayoutError(f"ranks {other} and {rank} both sit at {list(coords)} of "
                                  f"mesh {name!r}", rule="UCP-1.0-R114")
    for name, (shape, at) in places.items():
        if len(at) != math.prod(shape):
            raise LayoutError(f"mesh {name!r} of shape {list(shape)} has {len(at)} ranks: "
                              "every position needs one", rule="UCP-1.0-R114")
    return places


def mesh_classes(
    described: Sequence[Description], specs_by_path: Mapping[str, TensorSpec]
) -> list[MeshClass]:
    """The classes of the tensors on meshes, ordered by their first member. Every rank
    of a mesh must lay out the same tensors on it, and a tensor lies on one mesh."""
    places = mesh_places(described)
    by_list: dict[int, dict[str, list[Sequence[Any]]]] = {}  # id(sharded) -> per mesh
    agreed: dict[str, tuple[int, list[Sequence[Any]]]] = {}
    same: set[tuple[int, int]] = set()
    for rank, d in enumerate(described):
        per_mesh = by_list.get(id(d.sharded))
        if per_mesh is None:
            per_mesh = by_list[id(d.sharded)] = {}
            for entry in d.sharded:
                per_mesh.setdefault(str(entry[1]), []).append(entry)
        for name in sorted(per_mesh.keys() - d.meshes.keys()):
            raise LayoutError(f"rank {rank} lays out tensors on mesh {name!r} but has no "
                              "place in it", rule="UCP-1.0-R114",
                              tensor=str(per_mesh[name][0][0]))
        for name in d.meshes:
            mine = per_mesh.get(name, [])
            first, theirs = agreed.setdefault(name, (rank, mine))
            pair = (id(theirs), id(mine))
            if theirs is not mine and pair not in same:
                if theirs != mine:
                    differ = sorted(
                        {str(e[0]) for e in theirs} ^ {str(e[0]) for e in mine}
                        or {str(a[0]) for a, b in zip(theirs, mine, strict=False) if a != b})
                    raise LayoutError(f"ranks {first} and {rank} lay out different tensors "
                                      f"on mesh {name!r} (differing: {differ[:3]})",
                                      rule="UCP-1.0-R131", tensor=differ[0] if differ else None)
                same.add(pair)
    classes: list[MeshClass] = []
    mesh_of: dict[str, str] = {}
    for name, (_, entries) in agreed.items():
        for path, mesh, _ in entries:
            if path in mesh_of:
                where = (f"listed twice on mesh {mesh!r}" if mesh_of[path] == name else
                         f"laid out on mesh {mesh_of[path]!r} and on mesh {mesh!r}")
                raise LayoutError(f"the tensor is {where}", rule="UCP-1.0-R131",
                                  tensor=str(path))
            mesh_of[path] = name
        shape, at = places[name]
        placements = {path: p for path, _, p in entries}
        for key, paths in class_members(specs_by_path, entries).items():
            classes.append(MeshClass(
                key, paths, shape,
                tuple(placement_from_json(p) for p in placements[paths[0]]), at))
    return sorted(classes, key=lambda c: c.paths[0])


#: One distinct box of a tensor: (box, the ranks holding it ascending, the ranks as they
#: listed it: a rank may list a box twice).
HeldEntry = tuple[Box, list[int], list[int]]


def distinct_boxes(described: Sequence[Description]) -> dict[str, list[HeldEntry]]:
    """Every tensor's distinct boxes in the order they first appear (by rank, then as
    listed), each with its holders. Grouped by sorting every rank's records at once:
    replicas (the same box on data-parallel ranks) cost no Python work each."""
    ids: dict[str, int] = {}
    mapped: dict[int, np.ndarray[Any, np.dtype[np.int64]]] = {}
    width = 2 + 2 * max((d.boxes.shape[1] // 2 - 1 for d in described), default=0)
    parts = []
    for rank, d in enumerate(described):
        if not len(d.boxes):
            continue
        to_global = mapped.get(id(d.paths))
        if to_global is None:
            to_global = mapped[id(d.paths)] = np.array(
                [ids.setdefault(p, len(ids)) for p in d.paths], dtype=np.int64)
        block = np.zeros((len(d.boxes), width + 1), dtype=np.int64)
        block[:, 0] = to_global[d.boxes[:, 0]]
        block[:, 1:d.boxes.shape[1]] = d.boxes[:, 1:]
        block[:, width] = rank
        parts.append(block)
    if not parts:
        return {}
    table = np.concatenate(parts)
    order = np.lexsort(table[:, :width].T[::-1])  # stable: by rank and listing within
    keys = table[order, :width]
    first = np.ones(len(keys), dtype=bool)
    first[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    starts = np.flatnonzero(first)
    ends = [*starts[1:].tolist(), len(keys)]
    holders = table[order, width].tolist()
    rows = keys[starts].tolist()
    names = list(ids)
    out: dict[str, list[HeldEntry]] = {}
    for g in np.argsort(order[starts], kind="stable").tolist():  # first appearance
        p, n, *coords = rows[g]
        listed = holders[starts[g]:ends[g]]
        box = tuple(zip(coords[0:2 * n:2], coords[1:2 * n:2], strict=True))
        out.setdefault(names[p], []).append((box, sorted(set(listed)), listed))
    return out



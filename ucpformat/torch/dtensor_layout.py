"""How a DTensor lies on its device mesh, in the core's terms: its placements, the box
each rank holds (:func:`local_map_of`), and the mesh descriptions a distributed save
sends instead of boxes (:func:`root_layout`, :func:`agreed_meshes`; the state's are
:func:`ucpformat.torch.distributed.mesh_layout`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ucpformat.distributed.comm import Communicator, gather_bytes, scatter_bytes
from ucpformat.distributed.rank_description import MeshPosition, MeshTensor
from ucpformat.errors import (
    LayoutError,
)
from ucpformat.layout.boxes import LocalMap, Piece, full_box
from ucpformat.layout.dtensor import (
    Placement,
    Replicate,
    Shard,
    StridedShard,
    dtensor_local_map,
    placement_to_json,
)

#: Turns a rank's local tensor into the numpy array that is written (a view or a copy).
Snapshot = Callable[[str, torch.Tensor], np.ndarray[Any, Any]]


@functools.lru_cache(maxsize=1 << 16)
def placements_of(dt: DTensor, *, name: str | None = None) -> list[Placement]:
    """A DTensor's placements in the layout language (torch ``_StridedShard`` included).

    ``Partial`` (values pending a reduction) is refused (UCP-1.0-R114).
    """
    from torch.distributed.tensor.placement_types import (
        Replicate as TorchReplicate,
    )
    from torch.distributed.tensor.placement_types import (
        Shard as TorchShard,
    )
    from torch.distributed.tensor.placement_types import (
        _StridedShard,
    )

    out: list[Placement] = []
    for p in dt.placements:
        if isinstance(p, _StridedShard):
            out.append(StridedShard(int(p.dim), int(p.split_factor)))
        elif isinstance(p, TorchShard):
            out.append(Shard(int(p.dim)))
        elif isinstance(p, TorchReplicate):
            out.append(Replicate())
        else:
            raise LayoutError(
                f"placement {p} is not Shard, Replicate or a strided shard; partial values "
                "must be reduced before saving (redistribute the DTensor)",
                rule="UCP-1.0-R114",
                tensor=name,
            )
    return out


_MapKey = tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...], tuple[int, ...],
                tuple[int, ...]]
_LOCAL_MAPS: dict[_MapKey, LocalMap] = {}


def local_map_of(dt: DTensor, *, name: str | None = None) -> LocalMap | None:
    """This rank's local tensor of ``dt`` as pieces of the global tensor (None: not in mesh).

    The map is checked against the local tensor's shape and, where it is one box, against
    torch's ``compute_local_shape_and_global_offset``: a disagreement is an error, never a
    silently misplaced shard. Checked maps are cached by global shape, mesh, placements,
    coordinates and local shape (a save repeats them all).
    """
    mesh = dt.device_mesh
    coords = mesh.get_coordinate()
    if coords is None:
        return None
    placements = tuple(placements_of(dt, name=name))
    global_shape = tuple(int(n) for n in dt.shape)
    local_shape = tuple(int(n) for n in dt.to_local().shape)
    key = (global_shape, tuple(int(n) for n in mesh.shape), placements,
           tuple(int(c) for c in coords), local_shape)
    cached = _LOCAL_MAPS.get(key)
    if cached is not None:
        return cached
    lm = dtensor_local_map(global_shape, key[1], placements, key[3], tensor=name)
    if local_shape != lm.local_shape:
        raise LayoutError(
            f"the local tensor has shape {list(local_shape)}, but placements "
            f"{list(dt.placements)} on mesh {list(mesh.shape)} at {list(coords)} give "
            f"{list(lm.local_shape)}",
            rule="UCP-1.0-R114",
            tensor=name,
        )
    _check_against_torch(dt, lm, name)
    if len(_LOCAL_MAPS) > 1 << 16:
        _LOCAL_MAPS.clear()
    _LOCAL_MAPS[key] = lm
    return lm


def _check_against_torch(dt: DTensor, lm: LocalMap, name: str | None) -> None:
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh, dt.placements
        )
    except Exception:  # a private helper: its absence must not stop a save
        return
    shape = tuple(int(n) for n in shape)
    if shape != lm.local_shape:
        raise LayoutError(
            f"torch computes local shape {list(shape)}, the layout language "
            f"{list(lm.local_shape)} (placements {list(dt.placements)})",
            rule="UCP-1.0-R114", tensor=name,
        )
    if math.prod(lm.local_shape) and len(lm.pieces) == 1 and lm.pieces[0].local == full_box(
        lm.local_shape
    ):
        mine = tuple(a for a, _ in lm.pieces[0].glob)
        theirs = tuple(int(o) for o in offset)
        if mine != theirs:
            raise LayoutError(
                f"torch places this rank's shard at offset {list(theirs)}, the layout "
                f"language at {list(mine)} (placements {list(dt.placements)})",
                rule="UCP-1.0-R114", tensor=name,
            )


def whole_map(shape: tuple[int, ...]) -> LocalMap:
    """The local map of a tensor every rank holds whole."""
    box = full_box(shape)
    return LocalMap(shape, (Piece(box, box),) if math.prod(shape) or not shape else ())


def saved_with(dt: DTensor) -> dict[str, Any]:
    """Informative: the mesh and placements a DTensor was saved with."""
    mesh = dt.device_mesh
    doc: dict[str, Any] = {
        "mesh": [int(n) for n in mesh.shape],
        "placements": [placement_to_json(p) for p in placements_of(dt)],
    }
    if mesh.mesh_dim_names:
        doc["mesh_dim_names"] = list(mesh.mesh_dim_names)
    return doc




def mesh_name(mesh: DeviceMesh) -> str:
    """A device mesh's name for :class:`~ucpformat.distributed.rank_description.MeshPosition`: from
    the global ranks at its positions (so the same on every rank of the mesh, and different
    for a mesh of other ranks or another shape)."""
    ranks = json.dumps(mesh.mesh.tolist()).encode()
    return "torch:" + hashlib.sha256(ranks).hexdigest()[:20]


def root_layout(t: DTensor, *, name: str | None = None
                ) -> tuple[DeviceMesh, tuple[Placement, ...]] | None:
    """A DTensor's mesh and placements, those on a sub-mesh as on its root mesh
    (``Replicate`` along the root's other dimensions: the same local part). FSDP2 puts
    the parameters that tensor parallelism leaves whole on the data-parallel slice of a
    2-D mesh, one slice per tensor-parallel rank: as slices they would be several
    meshes holding one tensor, as the root they are one. None where torch does not say
    how the sub-mesh sits in its root (a flattened dimension): describe it by boxes."""
    mesh = t.device_mesh
    placements = tuple(placements_of(t, name=name))
    get_root = getattr(mesh, "_get_root_mesh", None)  # private in torch 2.13
    root = get_root() if get_root is not None else mesh
    if root is None or root is mesh or root.mesh.tolist() == mesh.mesh.tolist():
        return mesh, placements
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or not set(names) <= set(root_names):
        return None
    index = [root_names.index(n) for n in names]
    if index != sorted(index):
        return None
    by_dim = dict(zip(index, placements, strict=True))
    return root, tuple(by_dim.get(i, Replicate()) for i in range(root.ndim))


def agreed_meshes(
    comm: Communicator, meshes: Sequence[MeshPosition], on_mesh: Sequence[MeshTensor]
) -> tuple[list[MeshPosition], list[MeshTensor]]:
    """The meshes (and their tensors) that every rank of the mesh describes alike, the
    others' tensors left to boxes. Collective: the coordinator gathers a digest of each
    rank's tensors per mesh and tells every rank which meshes agree. A sub-mesh lifted
    to its root (:func:`root_layout`) is one mesh only where its slices hold the same
    tensors: FSDP2's data-parallel slices of a (dp, tp) mesh do, pipeline stages on the
    data-parallel slices of a (pp, dp) mesh do not (each stage its own layers)."""
    mine = {}
    for m in meshes:
        listed = [[t.path, [placement_to_json(p) for p in t.placements]]
                  for t in on_mesh if t.mesh == m.name]
        mine[m.name] = [list(m.shape),
                        hashlib.sha256(json.dumps(listed).encode()).hexdigest()]
    gathered = gather_bytes(comm, json.dumps(mine).encode())
    agreed: list[str] = []
    if gathered is not None:  # the coordinator
        seen: dict[str, list[Any]] = {}
        for raw in gathered:
            for name, (shape, digest) in json.loads(raw).items():
                seen.setdefault(name, []).append((tuple(shape), digest))
        agreed = sorted(name for name, reports in seen.items()
                        if len(set(reports)) == 1 and len(reports) == math.prod(reports[0][0]))
    body = json.dumps(agreed).encode()
    received = scatter_bytes(
        comm, dict.fromkeys(range(comm.world_size), body) if gathered is not None else None)
    ok = set(json.loads(body if gathered is not None else received))
    return ([m for m in meshes if m.name in ok], [t for t in on_mesh if t.mesh in ok])



"""What a rank tells the coordinator of a distributed save: its description.

A rank describes what it holds, no data (:func:`describe`): the specs of the tensors it
knows, the boxes of its fragments, its group attributes, and, for tensors laid out over
device meshes as DTensors are, its place in each mesh and the tensors' placements
(:class:`MeshPosition`, :class:`MeshTensor`), from which the coordinator derives every
rank's fragments. :func:`encode_description` turns it into the compact bytes a rank sends;
:func:`decode_descriptions` reads every rank's on the coordinator, which plans from them
(:func:`ucpformat.distributed.save_plan.plan_from_descriptions`).
"""

from __future__ import annotations

import itertools
import json
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat.errors import LayoutError, WriteError
from ucpformat.format import jsonvalues, names
from ucpformat.layout.boxes import Box, box_size
from ucpformat.layout.dtensor import Placement, dtensor_local_map, placement_to_json


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


# -- describing what a rank holds -------------------------------------------------------


@dataclass(frozen=True)
class MeshPosition:
    """A rank's place in a device mesh: the mesh's name (the same on every rank of the
    mesh, different for every other mesh), its shape, and this rank's coordinates."""

    name: str
    shape: tuple[int, ...]
    coords: tuple[int, ...]


@dataclass(frozen=True)
class MeshTensor:
    """A tensor laid out over a device mesh as a DTensor is: one placement per mesh
    dimension. Every rank of the mesh holds its local part
    (:func:`~ucpformat.layout.dtensor.dtensor_local_map` of its coordinates), so a rank
    describes it by these few values instead of its fragments' boxes, and ranks that
    share the mesh send the same description."""

    path: str
    mesh: str
    placements: tuple[Placement, ...]


def describe(
    specs: Sequence[TensorSpec],
    boxes: Iterable[tuple[str, Box]],
    group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    meshes: Sequence[MeshPosition] = (),
    on_mesh: Sequence[MeshTensor] = (),
) -> dict[str, Any]:
    """What one rank tells the others (JSON): the specs it knows, its fragments' boxes,
    its group attributes (``attributes.ucp`` by group path), its place in each device
    mesh (``meshes``) and the tensors laid out on them (``on_mesh``, whose fragments
    ``boxes`` must not list). Raises on a bad name, and on a tensor on a mesh this rank
    has no place in or no spec of."""
    listed = []
    for path, box in boxes:
        names.check_path(path)
        listed.append([path, [list(x) for x in box]])
    places: dict[str, dict[str, list[int]]] = {}
    for m in meshes:
        if not (len(m.shape) == len(m.coords) and all(
                0 <= c < n for c, n in zip(m.coords, m.shape, strict=True))):
            raise LayoutError(f"coordinates {list(m.coords)} lie outside mesh {m.name!r} of "
                              f"shape {list(m.shape)}", rule="UCP-1.0-R114")
        if m.name in places:
            raise LayoutError(f"mesh {m.name!r} is given twice", rule="UCP-1.0-R114")
        places[m.name] = {"shape": list(m.shape), "coords": list(m.coords)}
    known = {s.path for s in specs} if on_mesh else set()
    sharded = []
    for t in on_mesh:
        names.check_path(t.path)
        if t.path not in known:
            raise LayoutError(f"the tensor on mesh {t.mesh!r} has no spec on this rank",
                              rule="UCP-1.0-R131", tensor=t.path)
        if t.mesh not in places:
            raise LayoutError(f"this rank has no place in mesh {t.mesh!r}",
                              rule="UCP-1.0-R114", tensor=t.path)
        if len(t.placements) != len(places[t.mesh]["shape"]):
            raise LayoutError(f"{len(t.placements)} placements on mesh {t.mesh!r} of "
                              f"{len(places[t.mesh]['shape'])} dimensions",
                              rule="UCP-1.0-R114", tensor=t.path)
        sharded.append([t.path, t.mesh, [placement_to_json(p) for p in t.placements]])
    return {
        "specs": [s.to_json() for s in specs],
        "sharded": sharded,
        "boxes": listed,
        "meshes": places,
        "groups": {
            g: jsonvalues.encode(dict(a), where=g) for g, a in (group_attributes or {}).items()
        },
    }


def mesh_boxes(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coords: Sequence[int],
    placements: Sequence[Placement],
    *,
    tensor: str | None = None,
) -> list[Box]:
    """The boxes of the global tensor that the mesh position ``coords`` holds under
    ``placements`` (its local part's non-empty pieces): what a rank describing a
    :class:`MeshTensor` holds, as the coordinator derives it."""
    local = dtensor_local_map(shape, mesh_shape, placements, coords, tensor=tensor)
    return [p.glob for p in local.pieces if box_size(p.glob)]


def boxes_off_mesh(
    boxes: Iterable[tuple[str, Box]],
    specs: Sequence[TensorSpec],
    meshes: Sequence[MeshPosition],
    on_mesh: Sequence[MeshTensor],
) -> list[tuple[str, Box]]:
    """The boxes of the tensors not on a mesh, for :func:`describe`, after checking that
    this rank's fragments of every tensor on a mesh are the pieces of its local part
    (the coordinator derives them from the mesh, so they must be). Refuses a difference
    (UCP-1.0-R114)."""
    if not on_mesh:
        return list(boxes)
    place = {m.name: m for m in meshes}
    shape_of = {s.path: s.shape for s in specs}
    maps: dict[tuple[Any, ...], list[Box]] = {}
    expected: dict[str, list[Box]] = {}
    for t in on_mesh:
        m, shape = place.get(t.mesh), shape_of.get(t.path)
        if m is None or shape is None:
            raise LayoutError(f"the tensor on mesh {t.mesh!r} has no spec or this rank no "
                              "place in the mesh", rule="UCP-1.0-R114", tensor=t.path)
        key = (shape, m.name, t.placements)
        if key not in maps:
            maps[key] = sorted(mesh_boxes(shape, m.shape, m.coords, t.placements,
                                          tensor=t.path))
        expected[t.path] = maps[key]
    held: dict[str, list[Box]] = {}
    rest = []
    for path, box in boxes:
        if path in expected:
            if box_size(box):  # an empty piece holds nothing (the mesh's parts leave it out)
                held.setdefault(path, []).append(tuple((int(a), int(b)) for a, b in box))
        else:
            rest.append((path, box))
    for path, want in expected.items():
        got = sorted(held.get(path, []))
        if got != want:
            raise LayoutError(f"this rank holds {[list(b) for b in got[:3]]}, not its part "
                              f"{[list(b) for b in want[:3]]} of the tensor's mesh layout",
                              rule="UCP-1.0-R114", tensor=path)
    return rest


#: The description's parts that ranks laid out alike send alike (each compressed on its
#: own, so the coordinator decompresses and parses each distinct one once).
_SHARED = ("specs", "sharded")
_LENGTH = struct.Struct("<Q")
#: Inside the rank's own part: the byte lengths of its three sections (paths, rest,
#: boxes) and the dimensions of its widest box.
_HEADER = struct.Struct("<QQQI")


def encode_description(description: Mapping[str, Any]) -> bytes:
    """A :func:`describe` document as bytes for the coordinator, compressed:
    ``encode_shared_part(d) + encode_own_part(d)``."""
    return encode_shared_part(description) + encode_own_part(description)


def encode_shared_part(description: Mapping[str, Any]) -> bytes:
    """The specs and the tensors on meshes (JSON), each compressed on its own, each
    preceded by its length. Data-parallel replicas, and every rank of a mesh, send the
    same bytes here; a rank that describes itself often (or a simulation of thousands)
    may encode them once."""
    out = []
    for key in _SHARED:
        packed = zlib.compress(dumps(description.get(key, [])), 1)
        out += [_LENGTH.pack(len(packed)), packed]
    return b"".join(out)


def encode_own_part(description: Mapping[str, Any]) -> bytes:
    """The rest, compressed: the paths its boxes name (JSON), the rest of the document
    (JSON: group attributes, mesh places, error report) and the boxes as int64 records
    (path index, number of dimensions, then start and stop per dimension, zero-padded to
    the widest box), which need no parsing."""
    paths: dict[str, int] = {}
    listed = description["boxes"]
    dims = max((len(box) for _, box in listed), default=0)
    flat: list[int] = []
    for path, box in listed:
        flat += (paths.setdefault(path, len(paths)), len(box))
        for a, b in box:
            flat += (int(a), int(b))
        flat += (0,) * (2 * (dims - len(box)))
    sections = (
        dumps(list(paths)),
        dumps({k: v for k, v in description.items() if k not in ("boxes", *_SHARED)}),
        np.asarray(flat, dtype="<i8").tobytes(),
    )
    return zlib.compress(_HEADER.pack(*map(len, sections), dims) + b"".join(sections), 1)


def dumps(value: Any) -> bytes:
    """Compact JSON bytes (``(",", ":")`` separators), as descriptions and shares use."""
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Description:
    """One rank's description as the coordinator holds it (:func:`decode_descriptions`).

    ``specs``, ``sharded`` and ``paths`` are shared by ranks that sent the same;
    ``boxes`` holds one int64 record per fragment: index in ``paths``, number of
    dimensions, then start and stop per dimension (zero-padded); ``sharded``: (path,
    mesh, placements as JSON) of each tensor on a mesh; ``meshes``: the rank's place
    (``shape``, ``coords``) in each mesh by name."""

    specs: Sequence[Mapping[str, Any]]
    paths: Sequence[str]
    boxes: np.ndarray[Any, np.dtype[np.int64]]
    groups: Mapping[str, Any]
    error: str = ""
    sharded: Sequence[Sequence[Any]] = ()
    meshes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @staticmethod
    def of(doc: Mapping[str, Any] | Description) -> Description:
        """A :func:`describe` document (or a Description, as it is) as a Description."""
        if isinstance(doc, Description):
            return doc
        return decode_descriptions([encode_description(doc)])[0]

    def box_list(self) -> list[tuple[str, Box]]:
        """(tensor path, box) of every fragment, as listed."""
        return [(self.paths[p], tuple(zip(c[0:2 * n:2], c[1:2 * n:2], strict=True)))
                for p, n, *c in self.boxes.tolist()]


def decode_descriptions(blobs: Sequence[bytes]) -> list[Description]:
    """The descriptions of :func:`encode_description` blobs, by rank. Ranks that sent the
    same specs (or tensors on meshes, or paths) share one parsed list
    (:func:`plan_from_descriptions` checks it once). Raises
    :class:`~ucpformat.errors.WriteError` on a blob that is not one."""
    parsed: dict[bytes, Any] = {}

    def parse(raw: bytes) -> Any:
        doc = parsed.get(raw)
        if doc is None:
            doc = parsed[raw] = json.loads(raw)
        return doc

    shared_by_bytes: dict[bytes, Any] = {}
    out = []
    for rank, blob in enumerate(blobs):
        try:
            at = 0
            shared = []
            for _ in _SHARED:
                (n,) = _LENGTH.unpack_from(blob, at)
                packed = blob[at + _LENGTH.size:at + _LENGTH.size + n]
                if len(packed) != n:
                    raise ValueError(f"{len(blob)} bytes, too few for the described parts")
                doc = shared_by_bytes.get(packed)
                if doc is None:
                    doc = shared_by_bytes[packed] = json.loads(zlib.decompress(packed))
                shared.append(doc)
                at += _LENGTH.size + n
            specs, sharded = shared
            raw = zlib.decompress(blob[at:])
            *lengths, dims = _HEADER.unpack_from(raw)
            ends = list(itertools.accumulate(lengths, initial=_HEADER.size))
            if ends[-1] != len(raw):
                raise ValueError(f"{len(raw)} bytes where the header says {ends[-1]}")
            paths, rest = (parse(raw[a:b]) for a, b in itertools.pairwise(ends[:3]))
            boxes = np.frombuffer(raw, dtype="<i8", offset=ends[2]).reshape(-1, 2 + 2 * dims)
            if len(boxes) and not (
                boxes[:, 0].min() >= 0 and boxes[:, 0].max() < len(paths)
                and boxes[:, 1].min() >= 0 and boxes[:, 1].max() <= dims
            ):
                raise ValueError("a box names no listed path or has too many dimensions")
            out.append(Description(specs, paths, boxes.astype(np.int64, copy=False),
                                   rest.get("groups", {}), str(rest.get("error", "")),
                                   sharded, rest.get("meshes", {})))
        except (zlib.error, struct.error, ValueError, TypeError, AttributeError) as exc:
            raise WriteError(f"rank {rank} sent a description that cannot be read: {exc}") from exc
    return out


__all__ = [
    "Description",
    "MeshPosition",
    "MeshTensor",
    "TensorSpec",
    "boxes_off_mesh",
    "decode_descriptions",
    "describe",
    "dumps",
    "encode_description",
    "encode_own_part",
    "encode_shared_part",
    "mesh_boxes",
]

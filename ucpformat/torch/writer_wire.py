"""What a save's caller and its writer process send each other: JSON, never pickle.

:class:`~ucpformat.torch.writer_process.WriterProcess` and its child exchange messages
as JSON objects (``{"kind": ..., ...}``), one per frame of their socket
(``Connection.send_bytes``/``recv_bytes``: a length and the bytes; the pickling
``send``/``recv`` are never used). The child reads what its parent sends, as a reader
reads a checkpoint: with no way to make it run code. Every object that travels has a
JSON form here, and what has none is refused in the parent, before the child does
anything, with an :class:`~ucpformat.errors.InvalidValueError` that says what to pass
instead:

* **the location** (:func:`location_to_json`): a path or URL as text; a
  :class:`~ucpformat.store.LocalStore` as its location and settings; an
  :class:`~ucpformat.store.fsspec_store.FsspecStore` as its URL and its file system's
  ``storage_options`` (if they are JSON and rebuild the same file system). Any other
  store (a subclass too: its behaviour is code) is refused: pass a path or URL;
* **the connector** (:func:`connector_to_json`): one of :data:`CONNECTOR_KINDS` (the
  classes whose fields say everything: ``{"kind": "gloo", "address": ..., ...}``);
* **the request** (:func:`request_to_json`): tensor specs
  (:meth:`~ucpformat.distributed.rank_description.TensorSpec.to_json`), fragments as
  their place in the shared arena (:class:`FragmentPlace`: offset, shape, strides, and
  the data type by its format name), mesh positions and placements, group attributes,
  metadata and the save's options (:class:`~ucpformat.checkpoint.options.SaveOptions`
  fields; a ``progress`` callback cannot travel: ``progress=True`` shows a bar);
* **the result**: :class:`~ucpformat.distributed.pipeline.DistributedSaveResult`'s fields;
* **an error** (:func:`error_to_json`): a :class:`~ucpformat.errors.UCPError` as its
  :func:`~ucpformat.errors.error_document` (raised again with its class); any other
  error as its class, module and message (raised as a
  :class:`~ucpformat.errors.WriteError` naming them), with the child's traceback.

Values are Python's JSON: tuples become lists and numpy scalars Python numbers (as a
save stores them), non-finite floats travel (both ends are Python's ``json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.distributed.pipeline import DistributedSaveResult
from ucpformat.distributed.rank_description import MeshPosition, MeshTensor, TensorSpec
from ucpformat.errors import (
    InvalidValueError,
    UCPError,
    WriteError,
    error_document,
    error_from_document,
)
from ucpformat.format import dtypes
from ucpformat.layout.boxes import Box
from ucpformat.layout.dtensor import placement_from_json, placement_to_json
from ucpformat.store import LocalStore, Store
from ucpformat.store.fsspec_store import FsspecStore

_SEND_A_PATH = ("in process mode, pass a path or URL (or save with writer='thread', where "
                "any store works)")


# -- framing --------------------------------------------------------------------------------


def _scalar(value: Any) -> Any:
    """``json.dumps``'s fallback: numpy scalars as Python numbers, nothing else."""
    if isinstance(value, np.generic) and not isinstance(value, np.complexfloating):
        return value.item()
    raise TypeError(f"{type(value).__name__} has no JSON form")


def encode_message(message: Mapping[str, Any]) -> bytes:
    """One message's bytes (a JSON object with a ``kind``)."""
    return json.dumps(message, default=_scalar, separators=(",", ":")).encode()


def decode_message(data: bytes) -> dict[str, Any]:
    """The message of :func:`encode_message`'s bytes (WriteError if it is not one)."""
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise WriteError(f"a message between a writer process and its parent is not "
                         f"JSON: {exc}") from None
    if not (isinstance(message, dict) and isinstance(message.get("kind"), str)):
        raise WriteError(f"a message between a writer process and its parent has no "
                         f"kind: {str(message)[:200]}")
    return message


def _json_value(value: Any, where: str) -> Any:
    """``value`` as JSON (lists for tuples, Python numbers for numpy scalars), or an
    InvalidValueError naming ``where``."""
    try:
        return json.loads(json.dumps(value, default=_scalar))
    except (TypeError, ValueError) as exc:
        raise InvalidValueError(f"{where} cannot be sent to the writer process as JSON: "
                                f"{exc}") from None


# -- the location -----------------------------------------------------------------------------


def location_to_json(path: str | os.PathLike[str] | Store) -> dict[str, Any]:
    """The JSON form of a save's location (InvalidValueError for a store that has none)."""
    if isinstance(path, str | os.PathLike):
        return {"kind": "path", "path": os.fsdecode(path)}
    if type(path) is LocalStore:
        return {"kind": "local", "location": path.location, "durable": path.durable,
                "follow_link": path.follow_link}
    if type(path) is FsspecStore:
        return _fsspec_to_json(path)
    raise InvalidValueError(f"a {type(path).__name__} cannot be sent to the writer process "
                            f"(a store's behaviour is code, and only JSON travels): "
                            f"{_SEND_A_PATH}", path=getattr(path, "location", None))


def _fsspec_to_json(store: FsspecStore) -> dict[str, Any]:
    url = store.location
    protocol, sep, _ = url.partition("://")
    known = store.fs.protocol if isinstance(store.fs.protocol, tuple | list) \
        else (store.fs.protocol,)
    options = getattr(store.fs, "storage_options", None)
    if not sep or protocol not in known or not isinstance(options, dict):
        raise InvalidValueError(f"this FsspecStore (its file system a "
                                f"{type(store.fs).__name__}) cannot be rebuilt from its URL "
                                f"in the writer process: {_SEND_A_PATH}", path=url)
    try:
        options = json.loads(json.dumps(options, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidValueError(f"the storage options of {url} cannot be sent to the writer "
                                f"process as JSON ({exc}): {_SEND_A_PATH} with JSON "
                                f"storage_options", path=url) from None
    rebuilt = FsspecStore(url, storage_options=options)
    if type(rebuilt.fs) is not type(store.fs) or rebuilt.root != store.root:
        raise InvalidValueError(f"this FsspecStore (its file system a "
                                f"{type(store.fs).__name__}) is not the one its URL and "
                                f"storage options make: {_SEND_A_PATH}", path=url)
    return {"kind": "fsspec", "url": url, "storage_options": options}


def location_from_json(doc: Mapping[str, Any]) -> str | Store:
    """The location of :func:`location_to_json`'s form (a store made anew)."""
    kind = doc.get("kind")
    if kind == "path":
        return str(doc["path"])
    if kind == "local":
        return LocalStore(str(doc["location"]), durable=bool(doc["durable"]),
                          follow_link=bool(doc["follow_link"]))
    if kind == "fsspec":
        return FsspecStore(str(doc["url"]), storage_options=dict(doc["storage_options"]))
    raise WriteError(f"the writer process knows no location of kind {kind!r}")


# -- the connector ----------------------------------------------------------------------------


def _gloo() -> type:
    from ucpformat.torch.comm import GlooConnector

    return GlooConnector


#: The connectors that travel to a writer process: their JSON ``kind`` -> their class
#: (imported on use), a dataclass whose JSON fields are all it is.
CONNECTOR_KINDS: Final[Mapping[str, Callable[[], type]]] = {"gloo": _gloo}


def connector_to_json(connector: Any) -> dict[str, Any] | None:
    """The JSON form of a writer process's connector (None for None); InvalidValueError
    for a connector of no kind in :data:`CONNECTOR_KINDS`."""
    if connector is None:
        return None
    for kind, load in CONNECTOR_KINDS.items():
        cls: Any = load()
        if type(connector) is cls:
            fields = {f.name: getattr(connector, f.name) for f in dataclasses.fields(cls)}
            return {"kind": kind, **_json_value(fields, f"the {kind} connector")}
    raise InvalidValueError(
        f"a {type(connector).__name__} cannot be sent to the writer process: its connector "
        f"is one of {', '.join(k().__name__ for k in CONNECTOR_KINDS.values())} (each "
        f"travels as JSON), or None")


def connector_from_json(doc: Mapping[str, Any] | None) -> Any:
    """The connector of :func:`connector_to_json`'s form."""
    if doc is None:
        return None
    load = CONNECTOR_KINDS.get(str(doc.get("kind")))
    if load is None:
        raise WriteError(f"the writer process knows no connector of kind {doc.get('kind')!r}")
    cls: Any = load()
    return cls(**{f.name: doc[f.name] for f in dataclasses.fields(cls) if f.name in doc})


# -- the request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FragmentPlace:
    """A fragment as it travels: its tensor and box, and where its values lie in the
    shared arena (a numpy view: offset, shape, strides in bytes, data type)."""

    path: str
    box: Box
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype[Any]

    def to_json(self) -> dict[str, Any]:
        big = self.dtype.byteorder == ">" or (self.dtype.byteorder == "="
                                              and sys.byteorder == "big")
        return {"path": self.path, "box": [list(x) for x in self.box], "offset": self.offset,
                "shape": list(self.shape), "strides": list(self.strides),
                "dtype": dtypes.from_numpy(self.dtype, tensor=self.path).name,
                "big_endian": big and self.dtype.itemsize > 1}

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> FragmentPlace:
        dtype = np.dtype(dtypes.by_name(doc["dtype"], tensor=doc["path"]).numpy)
        if dtype.itemsize > 1:
            dtype = dtype.newbyteorder(">" if doc["big_endian"] else "<")
        return FragmentPlace(str(doc["path"]), tuple((int(a), int(b)) for a, b in doc["box"]),
                             int(doc["offset"]), tuple(int(n) for n in doc["shape"]),
                             tuple(int(s) for s in doc["strides"]), dtype)


def _mesh_to_json(m: MeshPosition) -> dict[str, Any]:
    return {"name": m.name, "shape": list(m.shape), "coords": list(m.coords)}


def _on_mesh_to_json(t: MeshTensor) -> dict[str, Any]:
    return {"path": t.path, "mesh": t.mesh,
            "placements": [placement_to_json(p) for p in t.placements]}


def _options_to_json(options: SaveOptions) -> dict[str, Any]:
    return {f.name: _kwarg_to_json(f.name, getattr(options, f.name), "SaveOptions.")
            for f in dataclasses.fields(options)}


def _kwarg_to_json(name: str, value: Any, prefix: str = "") -> Any:
    if name == "options" and isinstance(value, SaveOptions):
        return _options_to_json(value)
    if callable(value):
        raise InvalidValueError(
            f"{prefix}{name}={getattr(value, '__name__', type(value).__name__)} cannot be "
            f"sent to the writer process (a callable is code, and only JSON travels)"
            + ("; progress=True shows a progress bar there" if name == "progress" else ""))
    return _json_value(value, f"{prefix}{name}")


def save_kwargs_to_json(save_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON form of a save's keyword arguments (``options=`` a SaveOptions among
    them); InvalidValueError for a callable (a ``progress`` callback) or another value
    without one."""
    return {name: _kwarg_to_json(name, value) for name, value in save_kwargs.items()}


def request_to_json(
    path: str | os.PathLike[str] | Store,
    *,
    specs: Sequence[TensorSpec],
    fragments: Sequence[FragmentPlace],
    group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    meshes: Sequence[MeshPosition] = (),
    on_mesh: Sequence[MeshTensor] = (),
    metadata: Mapping[str, Any] | None = None,
    save_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A save request's JSON form (:class:`SaveRequest` reads it); InvalidValueError,
    naming the argument, for what has none."""
    return {
        "location": location_to_json(path),
        "specs": [_json_value(s.to_json(), f"the spec of {s.path}") for s in specs],
        "fragments": [f.to_json() for f in fragments],
        "group_attributes": None if group_attributes is None
        else _json_value(group_attributes, "group_attributes"),
        "meshes": [_mesh_to_json(m) for m in meshes],
        "on_mesh": [_on_mesh_to_json(t) for t in on_mesh],
        "metadata": None if metadata is None else _json_value(metadata, "metadata"),
        "save_kwargs": save_kwargs_to_json(save_kwargs or {}),
    }


@dataclass(frozen=True)
class SaveRequest:
    """A save request as the writer process reads it (:meth:`from_json`)."""

    location: str | Store
    specs: list[TensorSpec]
    fragments: list[FragmentPlace]
    group_attributes: dict[str, dict[str, Any]] | None
    meshes: list[MeshPosition]
    on_mesh: list[MeshTensor]
    metadata: dict[str, Any] | None
    save_kwargs: dict[str, Any]

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> SaveRequest:
        kwargs = dict(doc["save_kwargs"])
        if isinstance(kwargs.get("options"), dict):
            kwargs["options"] = SaveOptions(**kwargs["options"])
        return SaveRequest(
            location=location_from_json(doc["location"]),
            specs=[TensorSpec.from_json(s) for s in doc["specs"]],
            fragments=[FragmentPlace.from_json(f) for f in doc["fragments"]],
            group_attributes=doc["group_attributes"],
            meshes=[MeshPosition(m["name"], tuple(m["shape"]), tuple(m["coords"]))
                    for m in doc["meshes"]],
            on_mesh=[MeshTensor(t["path"], t["mesh"],
                                tuple(placement_from_json(p) for p in t["placements"]))
                     for t in doc["on_mesh"]],
            metadata=doc["metadata"],
            save_kwargs=kwargs,
        )


# -- the result and errors -----------------------------------------------------------------------


def result_to_json(result: DistributedSaveResult) -> dict[str, Any]:
    return dataclasses.asdict(result)


def result_from_json(doc: Mapping[str, Any]) -> DistributedSaveResult:
    return DistributedSaveResult(**{f.name: doc[f.name]
                                    for f in dataclasses.fields(DistributedSaveResult)})


def error_to_json(exc: BaseException) -> dict[str, Any]:
    """An error in the writer process, as its ``failed`` message: a UCPError's
    :func:`~ucpformat.errors.error_document`, or another error's class, module and
    message; the traceback as text either way."""
    doc: dict[str, Any] = {"kind": "failed",
                           "traceback": "".join(traceback.format_exception(exc))}
    if isinstance(exc, UCPError):
        doc["ucp"] = error_document(exc)
    else:
        doc["error"] = {"type": type(exc).__qualname__, "module": type(exc).__module__,
                        "message": str(exc)}
    return doc


def error_from_json(doc: Mapping[str, Any], pid: int) -> UCPError:
    """The error a ``failed`` message stands for: a UCPError of its class, or a
    WriteError naming another error's class and message; the child's traceback (pid
    ``pid``) as a note."""
    error: UCPError
    if isinstance(doc.get("ucp"), dict):
        error = error_from_document(doc["ucp"])
    else:
        found = doc.get("error")
        other: Mapping[str, Any] = found if isinstance(found, dict) else {}
        module, name = other.get("module"), other.get("type", "an error")
        where = name if module in (None, "builtins") else f"{module}.{name}"
        error = WriteError(f"the writer process failed: {where}: {other.get('message')}")
    error.add_note(f"in the writer process (pid {pid}):\n{doc.get('traceback', '')}")
    return error


__all__ = [
    "CONNECTOR_KINDS",
    "FragmentPlace",
    "SaveRequest",
    "connector_from_json",
    "connector_to_json",
    "decode_message",
    "encode_message",
    "error_from_json",
    "error_to_json",
    "location_from_json",
    "location_to_json",
    "request_to_json",
    "result_from_json",
    "result_to_json",
    "save_kwargs_to_json",
]

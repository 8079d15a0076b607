"""Megatron ``ShardedObject`` values as JSON values and arrays: never a pickle by default.

A ShardedObject is one shard of an object of arbitrary type (RNG states, a module's
extra state, the rerun state machine...). Each is stored under its *unique key*
(``<key>/shard_<offset>_<shape>``, Megatron's own name for it) in the group
:data:`OBJECTS_GROUP`:

* the value, as JSON, is ``values[<unique key>]`` of that group (tuples become lists,
  numpy scalars numbers, non-finite floats the tagged form of UCP-1.0-R070), with
  ``null`` in the place of every tensor;
* every tensor in it (``torch.Tensor`` or numpy array) is an array of that group named
  ``<unique key><JSON pointer>`` (RFC 6901: ``rng_state/shard_0.0_1.1/0/torch_rng_state``),
  whose ``attributes.megatron`` gives ``object``, ``pointer`` and ``kind`` (``"torch"``
  or ``"numpy"``, what the value was).

Anything else (a class instance, ``bytes``, a mapping with non-string keys) is refused
with an error naming the unique key and where in the value it is, unless the user opts
in (``allow_opaque``): then the whole object is ``torch.save``-d into a ``uint8`` array
of the extension group :data:`OPAQUE_GROUP` (UCP-1.0-R004: readers may ignore it), and
loading it needs the same opt-in, since unpickling runs code. A checkpoint holding one
is no longer pickle-free (UCP-1.0-R072); see docs/megatron.md.

On load, lists become tuples where the live object (the load request's value) has a
tuple, and tensors come back as what they were saved from.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from ucpformat.errors import FormatError, InvalidValueError, LoadError
from ucpformat.format import jsonvalues, names
from ucpformat.torch.numpy_bridge import from_numpy, to_numpy

OBJECTS_GROUP: Final = "training/sharded_objects"
OPAQUE_GROUP: Final = "megatron_opaque"
#: How opaque objects are serialised (``attributes.megatron.opaque`` of their arrays).
OPAQUE_ENCODING: Final = "torch.save"
TORCH: Final = "torch"
NUMPY: Final = "numpy"


@dataclass
class EncodedObject:
    """One ShardedObject ready to store: JSON value and tensors, or opaque bytes."""

    unique_key: str
    value: Any = None  # its value for JSON (None where tensors are); unused when opaque
    tensors: list[tuple[str, np.ndarray[Any, Any], str]] = field(default_factory=list)
    opaque: bytes | None = None  # the torch.save bytes of an opaque object

    def tensor_name(self, pointer: str) -> str:
        """The logical name of the array that holds the tensor at ``pointer``."""
        return self.unique_key + pointer


def escape_pointer(token: str) -> str:
    """A JSON pointer reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")


def encode(unique_key: str, data: Any, *, allow_opaque: bool) -> EncodedObject:
    """Split a ShardedObject's value into JSON and tensors, or refuse it (see module)."""
    out = EncodedObject(unique_key)

    def walk(value: Any, pointer: str) -> Any:
        if isinstance(value, torch.Tensor):
            out.tensors.append((pointer, to_numpy(value, name=unique_key + pointer), TORCH))
            return None
        if isinstance(value, np.ndarray):
            out.tensors.append((pointer, np.ascontiguousarray(value), NUMPY))
            return None
        if isinstance(value, Mapping):
            return {k: walk(v, f"{pointer}/{escape_pointer(str(k))}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, f"{pointer}/{i}") for i, v in enumerate(value)]
        return value

    try:
        out.value = walk(data, "")
        jsonvalues.encode(out.value, where=unique_key)  # refuses what JSON cannot hold
        for pointer, _, _ in out.tensors:
            names.check_name(out.tensor_name(pointer))
    except InvalidValueError as exc:
        if not allow_opaque:
            raise InvalidValueError(
                f"ShardedObject {unique_key!r} cannot be stored: {exc.message} (at "
                f"{exc.path or unique_key}). ucpformat writes no pickles: make the object "
                "JSON values and tensors, or pass allow_opaque=True to store it as opaque "
                f"{OPAQUE_ENCODING} bytes in the extension group {OPAQUE_GROUP!r}, which "
                "readers may ignore", rule=exc.rule, path=unique_key,
            ) from None
        buffer = io.BytesIO()
        torch.save(data, buffer)
        return EncodedObject(unique_key, opaque=buffer.getvalue())
    return out


def json_kind(value: Any) -> str | None:
    """The kind of a live value as JSON stores it ("object", "array", "string", "number",
    "boolean", "tensor"), or None for None and what JSON does not hold (no check)."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return "tensor"
    if isinstance(value, bool | np.bool_):
        return "boolean"
    if isinstance(value, int | float | np.integer | np.floating):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return None


def _stored_kind(node: Any, is_tensor: bool) -> str | None:
    return "tensor" if is_tensor else json_kind(node)


def decode(
    unique_key: str,
    value: Any,
    tensors: Mapping[str, tuple[np.ndarray[Any, Any], str]],
    template: Any,
) -> Any:
    """A ShardedObject's value from its (decoded) JSON value and its tensors (pointer ->
    (array, kind)), shaped like ``template`` (the live value, or None). A stored value of
    another JSON kind than the live one (a dict stored as a list, a number as a string, a
    tensor as a value) is refused, naming the object and the place in it, as for tensors
    (None on either side says nothing and is not checked)."""
    used: set[str] = set()

    def build(node: Any, pointer: str, like: Any) -> Any:
        want, got = json_kind(like), _stored_kind(node, pointer in tensors)
        if want is not None and got is not None and want != got:
            raise LoadError(
                f"ShardedObject {unique_key!r} at {pointer or '/'!r}: the checkpoint holds "
                f"a{'n' if got[0] in 'aeiou' else ''} {got} where the object loaded into "
                f"has a{'n' if want[0] in 'aeiou' else ''} {want}: refused, nothing was "
                "loaded", path=unique_key, tensor=unique_key + pointer)
        if pointer in tensors:
            used.add(pointer)
            array, kind = tensors[pointer]
            if kind == NUMPY:
                return array
            tensor = from_numpy(array, name=unique_key + pointer)
            if isinstance(like, torch.Tensor) and like.device.type != "meta":
                tensor = tensor.to(like.device)
            return tensor
        if isinstance(node, list):
            seq = like if isinstance(like, list | tuple) else ()
            items = [build(v, f"{pointer}/{i}", seq[i] if i < len(seq) else None)
                     for i, v in enumerate(node)]
            return tuple(items) if isinstance(like, tuple) else items
        if isinstance(node, dict):
            sub = like if isinstance(like, Mapping) else {}
            return {k: build(v, f"{pointer}/{escape_pointer(k)}", sub.get(k))
                    for k, v in node.items()}
        return node

    result = build(value, "", template)
    stray = sorted(set(tensors) - used)
    if stray:
        raise FormatError(
            f"arrays of ShardedObject {unique_key!r} at {stray[:3]} have no place in its "
            "JSON value (null expected there)", path=unique_key,
        )
    return result


def load_opaque(unique_key: str, raw: np.ndarray[Any, Any], *, allow_opaque: bool) -> Any:
    """Unpickle an opaque object (runs code: only with ``allow_opaque``)."""
    if not allow_opaque:
        raise LoadError(
            f"ShardedObject {unique_key!r} was stored as opaque {OPAQUE_ENCODING} bytes; "
            "loading it unpickles them, which runs code: pass allow_opaque=True to the load "
            "strategy if you trust this checkpoint", path=unique_key,
        )
    return torch.load(io.BytesIO(raw.tobytes()), weights_only=False)


def opaque_array(payload: bytes) -> np.ndarray[Any, Any]:
    return np.frombuffer(payload, dtype=np.uint8)


__all__ = [
    "NUMPY",
    "OBJECTS_GROUP",
    "OPAQUE_ENCODING",
    "OPAQUE_GROUP",
    "TORCH",
    "EncodedObject",
    "decode",
    "encode",
    "escape_pointer",
    "json_kind",
    "load_opaque",
    "opaque_array",
]

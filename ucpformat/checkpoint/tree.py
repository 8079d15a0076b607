"""A nested mapping of arrays and JSON values, turned into the arrays and groups to write.

``ucpformat.save`` writes what :func:`plan` makes of its ``state``: a :class:`TreePlan`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat.checkpoint import deferred as feeds
from ucpformat.checkpoint.metadata import (
    RESERVED_GROUPS,
    RESERVED_ROOT_SUFFIX,
    ArrayMeta,
    GroupMeta,
    dumps,
    parse_array,
)
from ucpformat.engine import chunking
from ucpformat.engine.compression import Compression
from ucpformat.errors import (
    InvalidValueError,
)
from ucpformat.format import dtypes, jsonvalues, names


@dataclass
class TreePlan:
    """What a save writes: array metadata with its data, groups, root values.

    ``root_values`` are the JSON values of the root as given (checked); the values of
    other groups are in their ``GroupMeta``, encoded.
    """

    arrays: list[tuple[ArrayMeta, ArrayValue]] = field(default_factory=list)
    groups: list[GroupMeta] = field(default_factory=list)
    root_values: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m, _ in self.arrays)


class Group(dict[str, Any]):
    """A mapping that ``save`` always stores as a group, even when it holds no array.

    A plain mapping becomes a group only if it holds an array somewhere; otherwise it is
    a JSON value of its parent. Wrap it in ``Group`` where the layout needs a group (for
    example ``optimizer/state/<parameter>`` whose state has no tensor). The top-level
    names ``model``, ``optimizer`` and ``training`` are always groups.

    ``ucp`` holds further members of the group's ``attributes.ucp`` (``aliases`` of tied
    tensors, UCP-1.0-R108); its ``values`` are the mapping's JSON entries.
    """

    def __init__(self, *args: Any, ucp: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if ucp is not None and "values" in ucp:
            raise InvalidValueError("a Group's JSON values are its entries, not ucp['values']")
        self.ucp: dict[str, Any] = dict(ucp or {})


def _has_array(value: Any) -> bool:
    """True if ``value`` must be stored as a group (it holds an array or a Group)."""
    if isinstance(value, np.ndarray | np.generic | Group | feeds.Deferred):
        return True
    if isinstance(value, Mapping):
        return any(_has_array(v) for v in value.values())
    return False


#: An array's values, or a placeholder whose values a
#: :class:`ucpformat.checkpoint.deferred.Feed` gives.
ArrayValue = np.ndarray[Any, Any] | feeds.Deferred
ArrayAttributes = Callable[[str, ArrayValue], Mapping[str, Any] | None]


def plan(
    state: Mapping[str, Any],
    *,
    compression: str | Mapping[str, Any] | None = None,
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    array_attributes: ArrayAttributes | None = None,
    chunk_splits: int = chunking.DEFAULT_SPLITS,
) -> TreePlan:
    """Turn a nested mapping into the arrays and groups of a checkpoint.

    Arrays (numpy arrays and numpy scalars) become zarr arrays; mappings that contain an
    array (or a :class:`Group`) somewhere become groups, as do the reserved top-level
    mappings ``model``, ``optimizer`` and ``training``; every other value must be JSON and
    is stored in its group's ``attributes.ucp.values``.
    """
    if not isinstance(state, Mapping):
        raise InvalidValueError(f"the state must be a mapping, got {type(state).__name__}")
    result = TreePlan()

    def visit(mapping: Mapping[str, Any], prefix: str, group_values: dict[str, Any]) -> None:
        node_names = []
        for key, value in mapping.items():
            where = f"{prefix}/{key}" if prefix else str(key)
            node = names.escape(key, where=where) if isinstance(key, str) else None
            if node is None:
                raise InvalidValueError(
                    f"keys must be strings, got {type(key).__name__} {key!r}", path=where,
                    rule="UCP-1.0-R011",
                )
            if not prefix and node.lower().endswith(RESERVED_ROOT_SUFFIX):
                raise InvalidValueError(
                    f"top-level names ending in {RESERVED_ROOT_SUFFIX!r} are reserved",
                    rule="UCP-1.0-R004",
                    path=where,
                )
            reserved_group = not prefix and key in RESERVED_GROUPS
            if reserved_group and not isinstance(value, Mapping):
                raise InvalidValueError(
                    f"{key!r} is a reserved group: give it a mapping, not "
                    f"{type(value).__name__}",
                    rule="UCP-1.0-R004",
                    path=where,
                )
            path = f"{prefix}/{node}" if prefix else node
            if isinstance(value, np.ndarray | np.generic | feeds.Deferred):
                arr = value if isinstance(value, feeds.Deferred) else np.asarray(value)
                attrs = dict(array_attributes(path, arr) or {}) if array_attributes else {}
                result.arrays.append(
                    (array_meta_of(path, arr, compression, chunk_bytes, shard_bytes, attrs,
                                   chunk_splits), arr)
                )
                node_names.append(node)
            elif isinstance(value, Mapping) and (reserved_group or _has_array(value)):
                sub_values: dict[str, Any] = {}
                visit(value, path, sub_values)
                ucp = (
                    jsonvalues.encode(value.ucp, where=f"{where}.ucp")
                    if isinstance(value, Group) else {}
                )
                if sub_values:
                    ucp["values"] = sub_values
                result.groups.append(GroupMeta(path, {"ucp": ucp} if ucp else {}))
                node_names.append(node)
            else:
                if _looks_like_tensor(value):
                    raise InvalidValueError(
                        f"{type(value).__name__} is not a numpy array; convert tensors first "
                        "(ucpformat.torch does this for torch tensors)",
                        path=where,
                    )
                if key == jsonvalues.FLOAT_TAG:
                    raise InvalidValueError(
                        f"the key {jsonvalues.FLOAT_TAG!r} is reserved for non-finite floats",
                        rule="UCP-1.0-R070",
                        path=where,
                    )
                encoded = jsonvalues.encode(value, where=where)
                # the root's values are stored as given: build_root_ucp encodes them (a bad
                # one is refused here all the same, named by its key)
                group_values[key] = encoded if prefix else value
        names.check_case_collisions(node_names, parent=prefix)

    visit(state, "", result.root_values)
    return result


def _looks_like_tensor(value: Any) -> bool:
    return hasattr(value, "__array__") or hasattr(value, "__dlpack__")


def array_meta_of(
    path: str,
    arr: ArrayValue,
    compression: str | Mapping[str, Any] | None,
    chunk_bytes: int,
    shard_bytes: int,
    attributes: Mapping[str, Any],
    chunk_splits: int = chunking.DEFAULT_SPLITS,
) -> ArrayMeta:
    dt = dtypes.from_numpy(arr.dtype, tensor=path)
    ucp = attributes.get("ucp", {})
    ch = chunking.choose(
        arr.shape,
        dt.itemsize,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        split_dims=chunking.split_dims_of(ucp if isinstance(ucp, Mapping) else {}),
        splits=chunk_splits,
    )
    meta = ArrayMeta(
        path=path,
        shape=tuple(int(s) for s in arr.shape),
        dtype=dt,
        chunk_shape=ch.chunk_shape,
        shard_shape=ch.shard_shape,
        compression=Compression.parse(compression, dt),
        fill_value=zero_bits(dt),
        attributes=attributes,
    )
    # Write nothing a reader would refuse (a bad attribute, a chunking bug): check first.
    parse_array(path, json.loads(dumps(meta.to_zarr_json(), compact=True)))
    return meta


def zero_bits(dt: dtypes.DataType) -> Any:
    """The value whose bits are all zero: the fill value ucpformat writes for every type
    (UCP-1.0-R033)."""
    return np.frombuffer(bytes(dt.itemsize), dtype=dt.numpy)[0]



"""Where the entries of a DCP state dict live in a UCP checkpoint, and back.

``torch.distributed.checkpoint`` flattens a nested state dict into keys joined by dots
(``"model.layers.0.attn.weight"``, ``"optim.state.layers.0.attn.weight.exp_avg"``,
``"optim.param_groups.0.lr"``) and keeps, for each key, the *object path* it came from
(``("optim", "state", "layers.0.attn.weight", "exp_avg")``: DCP's ``planner_data``). The
dotted key is ambiguous (FQNs hold dots); the object path is not, so the mapping below
works on object paths. ``P`` is an object path, ``P[1:]`` its tail.

====================================================  =====================================
DCP object path                                       UCP location
====================================================  =====================================
``(model, *tail)``  (``KeyMap.model``, "model")        array ``model/<fqn>``, or a JSON value
                                                      of group ``model`` keyed by ``<fqn>``;
                                                      ``<fqn>`` is ``".".join(tail)``
``(fqn,)`` tensor, when no key is under ``model``    array ``model/<fqn>`` (``dcp.save(
                                                      model.state_dict())``; torchtitan puts
                                                      model FQNs at the top level)
``(optim, "state", fqn, name)``                       array ``optimizer/state/<fqn>/<name>``,
``(optim, "state.<fqn>.<name>")`` (flattened form)    or a value of group
                                                      ``optimizer/state/<fqn>``
``(optim, "param_groups", i, key)``                   ``param_groups[i][key]`` of the values of
                                                      group ``optimizer`` (``params`` are FQNs;
                                                      a tensor is stored as a number or list)
``(optim, "param_groups.<fqn>.<key>")`` (flattened)   grouped: parameters whose hyperparameters
                                                      are equal share one ``param_groups`` entry
``(optim, *other)``                                   ``optimizer/<other...>``
``(scheduler, *tail)``                                the value ``scheduler`` of group
                                                      ``training``, where
                                                      ``ucpformat.torch.save`` keeps
                                                      ``scheduler.state_dict()``
``("training", *tail)`` or any other ``(key, *tail)``  ``training/<tail...>`` resp.
                                                      ``training/<key>/<tail...>``
====================================================  =====================================

``optim`` is any of ``KeyMap.optimizer_keys`` (``"optim"`` and ``"optimizer"``),
``scheduler`` any of ``KeyMap.scheduler_keys`` (``"lr_scheduler"`` and ``"scheduler"``;
a load derives every spelling). One
wrapper key above everything (the DCP tutorial's ``{"app": AppState(...)}``) is looked
through (``KeyMap.wrapper``, or found when every key is under one that holds ``model``
or ``optim``).
Tensors become arrays at that path; JSON values go to the deepest *group* on their path
(a group exists where arrays live below it, plus ``model``, ``optimizer``, ``training``
and ``optimizer/state/<fqn>``), nested by the rest of the path: ``("lr_scheduler",
"last_epoch")`` becomes the value ``{"lr_scheduler": {"last_epoch": ...}}`` of group
``training``. ``bytes`` become ``uint8`` arrays (see :mod:`ucpformat.torch.dcp`).

The writer records every key's object path and UCP location in the root's
``attributes.ucp.torch_dcp`` (``entries``), so a DCP load gets back exactly the keys that
were saved. A checkpoint without that record (written by ``ucpformat.torch.save``, an
importer, or another language) gets its keys *derived* by the inverse of the table,
with the spellings chosen by a :class:`KeyMap`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ucpformat.errors import FormatError, InvalidValueError
from ucpformat.format import dtypes, jsonvalues, names

PathItem = str | int
ObjectPath = tuple[PathItem, ...]

#: Version of the ``attributes.ucp.torch_dcp`` record.
RECORD_FORMAT: Final = 1
RECORD_KEY: Final = "torch_dcp"
#: Largest tensor stored as a JSON value (a tensor hyperparameter of a param group).
MAX_VALUE_TENSOR: Final = 4096
ENCODINGS: Final = ("bytes", "bytesio")


@dataclass(frozen=True)
class KeyMap:
    """Spellings of the state-dict keys that hold model and optimizer state.

    Saving recognises ``model`` and every name in ``optimizer_keys``, below an optional
    ``wrapper`` key (the DCP tutorial's ``{"app": AppState(...)}``; found on its own
    when every entry is under one key that holds model or optimizer state). Tensors at
    the top level are model tensors when nothing is under ``model`` (``dcp.save(
    model.state_dict())``, torchtitan). Loading a checkpoint without a DCP record derives
    keys with ``model`` (None: FQNs at the top level), ``optimizer`` and ``wrapper``;
    ``flat_optimizer`` derives the flattened optimizer form of
    ``StateDictOptions(flatten_optimizer_state_dict=True)``.
    """

    model: str | None = "model"
    optimizer: str = "optim"
    optimizer_keys: tuple[str, ...] = ("optim", "optimizer")
    flat_optimizer: bool = False
    wrapper: str | None = None
    #: Keys of an LR scheduler's state (stored as ``training/scheduler``).
    scheduler_keys: tuple[str, ...] = ("lr_scheduler", "scheduler")

    @classmethod
    def torchtitan(cls) -> KeyMap:
        """torchtitan's layout: model FQNs at the top level, ``optimizer`` flattened."""
        return cls(model=None, optimizer="optimizer", flat_optimizer=True)

    def is_optimizer(self, key: PathItem) -> bool:
        return key in self.optimizer_keys or key == self.optimizer


def flat_key(path: Sequence[PathItem]) -> str:
    """DCP's flattened key of an object path: the items joined by dots."""
    return ".".join(str(p) for p in path)


def node_path(logical: Sequence[PathItem]) -> str:
    """The node path (escaped, ``/``-joined) of a logical path."""
    return names.path_of(*(str(p) for p in logical))


# -- saving: object path -> logical UCP path -----------------------------------------------


@dataclass(frozen=True)
class ValueTarget:
    """Where a JSON value goes: a logical path, or a flattened param-group entry."""

    logical: tuple[PathItem, ...] = ()
    #: (fqn, hyperparameter) of a ``param_groups.<fqn>.<key>`` entry, grouped at commit.
    param_entry: tuple[str, str] | None = None


@dataclass(frozen=True)
class SaveContext:
    """What locating one entry needs to know about the whole state dict."""

    key_map: KeyMap
    wrapper: str | None
    top_level_model: bool
    fqns: frozenset[str]

    @classmethod
    def of(cls, paths: Iterable[ObjectPath], key_map: KeyMap) -> SaveContext:
        paths = [p for p in paths if p]
        wrapper = key_map.wrapper
        if wrapper is None:
            heads = {p[0] for p in paths}
            if len(heads) == 1:
                (head,) = heads
                if (
                    isinstance(head, str) and head not in (key_map.model, "training")
                    and not key_map.is_optimizer(head)
                    and any(len(p) > 2 and (p[1] == key_map.model or key_map.is_optimizer(p[1]))
                            for p in paths)
                ):
                    wrapper = head
        stripped = [_strip(p, wrapper) for p in paths]
        has_model = key_map.model is not None and any(
            len(p) >= 2 and p[0] == key_map.model for p in stripped
        )
        fqns: set[str] = set()
        for p in stripped:
            if key_map.model is not None and len(p) >= 2 and p[0] == key_map.model:
                fqns.add(flat_key(p[1:]))
            elif not has_model and len(p) == 1:
                fqns.add(str(p[0]))
            elif len(p) == 2 and key_map.is_optimizer(p[0]) and isinstance(p[1], str):
                head, _, rest = p[1].partition(".")
                if head == "param_groups" and "." in rest:
                    fqns.add(rest.rpartition(".")[0])
        return cls(key_map, wrapper, not has_model, frozenset(fqns))

    def to_json(self) -> dict[str, Any]:
        return {"wrapper": self.wrapper, "top_level_model": self.top_level_model}


def _strip(path: ObjectPath, wrapper: str | None) -> ObjectPath:
    if wrapper is not None and len(path) > 1 and path[0] == wrapper:
        return path[1:]
    return path


def _split_flat_state(rest: str, fqns: frozenset[str], key: str) -> tuple[str, str]:
    """``<fqn>.<state name>`` -> (fqn, name): the longest known FQN, else the last dot."""
    best = max((f for f in fqns if rest.startswith(f + ".")), key=len, default=None)
    if best is not None:
        return best, rest[len(best) + 1:]
    fqn, dot, name = rest.rpartition(".")
    if not dot or not fqn or not name:
        raise InvalidValueError(
            f"cannot split {rest!r} into a parameter name and a state name", path=key
        )
    return fqn, name


def locate(full_path: ObjectPath, *, tensor: bool, ctx: SaveContext) -> ValueTarget:
    """The UCP location of one DCP entry (see the module's table)."""
    key = flat_key(full_path)
    if not full_path:
        raise InvalidValueError("an empty object path", path=key)
    key_map = ctx.key_map
    path = _strip(full_path, ctx.wrapper)
    head, tail = path[0], path[1:]
    if key_map.model is not None and head == key_map.model and tail:
        return ValueTarget(("model", flat_key(tail)))
    if ctx.top_level_model and not tail and tensor:
        return ValueTarget(("model", str(head)))
    if key_map.is_optimizer(head) and tail:
        first = tail[0]
        if first == "state":
            if len(tail) == 3 and all(isinstance(t, str) for t in tail):
                return ValueTarget(("optimizer", "state", str(tail[1]), str(tail[2])))
            raise InvalidValueError(
                "optimizer state must be keyed <optimizer>.state.<parameter>.<state name>; "
                "this entry has another shape (pass a KeyMap or restructure the state dict)",
                path=key,
            )
        if first == "param_groups" and len(tail) >= 3 and isinstance(tail[1], int):
            return ValueTarget(("optimizer", *tail))  # a tensor is stored as a number

        if len(tail) == 1 and isinstance(first, str):
            kind, dot, rest = first.partition(".")
            if kind == "state" and dot:
                fqn, name = _split_flat_state(rest, ctx.fqns, key)
                return ValueTarget(("optimizer", "state", fqn, name))
            if kind == "param_groups" and dot and "." in rest:
                fqn, _, hyper = rest.rpartition(".")
                return ValueTarget(param_entry=(fqn, hyper))
        return ValueTarget(("optimizer", *tail))
    if head in key_map.scheduler_keys:
        return ValueTarget(("training", "scheduler", *tail))
    if head == "training" and tail:
        return ValueTarget(("training", *tail))
    return ValueTarget(("training", *path))


# -- the record kept in the checkpoint ------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One DCP key: its object path and where its value is stored."""

    path: ObjectPath
    array: str | None = None  # node path of an array
    encoding: str | None = None  # "bytes" / "bytesio": a uint8 array holding raw bytes
    group: str | None = None  # node path of the group whose values hold it
    pointer: tuple[PathItem, ...] = ()  # inside that group's values
    #: (data type, shape) of a small tensor stored as a JSON value (a tensor hyperparameter)
    tensor: tuple[str, tuple[int, ...]] | None = None

    @property
    def key(self) -> str:
        return flat_key(self.path)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": list(self.path)}
        if self.array is not None:
            doc["array"] = self.array
            if self.encoding is not None:
                doc["encoding"] = self.encoding
        else:
            doc["group"] = self.group
            doc["pointer"] = list(self.pointer)
            if self.tensor is not None:
                doc["tensor"] = {"data_type": self.tensor[0], "shape": list(self.tensor[1])}
        return doc

    @staticmethod
    def from_json(doc: Any, *, where: str) -> Entry:
        def bad(what: str) -> FormatError:
            return FormatError(f"attributes.ucp.{RECORD_KEY}: entry {where!r}: {what}",
                               path=where)

        if not isinstance(doc, Mapping):
            raise bad("not an object")
        path = doc.get("path")
        if not isinstance(path, list) or not path or not all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path
        ):
            raise bad("'path' must be a non-empty list of strings and integers")
        pointer = doc.get("pointer", [])
        if not isinstance(pointer, list) or not all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))
            for p in pointer
        ):
            raise bad("'pointer' must be a list of strings and integers")
        array, group, encoding = doc.get("array"), doc.get("group"), doc.get("encoding")
        if (array is None) == (group is None):
            raise bad("exactly one of 'array' and 'group' is needed")
        for value, what in ((array, "array"), (group, "group")):
            if value is not None:
                if not isinstance(value, str):
                    raise bad(f"'{what}' must be a node path")
                names.check_path(value, where=where)
        if encoding is not None and encoding not in ENCODINGS:
            raise bad(f"'encoding' must be one of {ENCODINGS}")
        tensor = doc.get("tensor")
        as_tensor: tuple[str, tuple[int, ...]] | None = None
        if tensor is not None:
            shape = tensor.get("shape") if isinstance(tensor, Mapping) else None
            dtype = tensor.get("data_type") if isinstance(tensor, Mapping) else None
            if (
                group is None or dtype not in dtypes.BY_NAME or not isinstance(shape, list)
                or len(shape) > 8 or not all(isinstance(n, int) and not isinstance(n, bool)
                                             and 0 <= n <= MAX_VALUE_TENSOR for n in shape)
                or math.prod(shape) > MAX_VALUE_TENSOR
            ):
                raise bad("'tensor' must be {'data_type': <a data type>, 'shape': [a few "
                          f"integers, at most {MAX_VALUE_TENSOR} elements]}} on a value")
            as_tensor = (str(dtype), tuple(shape))
        return Entry(tuple(path), array, encoding, group, tuple(pointer), as_tensor)


def record_to_json(entries: Mapping[str, Entry]) -> dict[str, Any]:
    return {"format": RECORD_FORMAT,
            "entries": {k: entries[k].to_json() for k in sorted(entries)}}


def record_from_json(doc: Any, *, where: str) -> dict[str, Entry] | None:
    """The entries of a stored record; None for a record of a later, unknown format."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("entries"), Mapping):
        raise FormatError(f"attributes.ucp.{RECORD_KEY} must be an object with 'entries'",
                          path=where)
    fmt = doc.get("format")
    if fmt != RECORD_FORMAT:
        return None
    out: dict[str, Entry] = {}
    for key, item in doc["entries"].items():
        entry = Entry.from_json(item, where=str(key))
        if entry.key != key:
            raise FormatError(
                f"attributes.ucp.{RECORD_KEY}: entry {key!r} has path {list(entry.path)}, "
                f"whose key is {entry.key!r}", path=where,
            )
        out[key] = entry
    return out


# -- assembling group values at commit -------------------------------------------------------


class _Leaf:
    """A stored value in a tree being built (never a container)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _set(tree: dict[PathItem, Any], pointer: Sequence[PathItem], value: Any, key: str) -> None:
    node = tree
    for i, item in enumerate(pointer[:-1]):
        child = node.setdefault(item, {})
        if isinstance(child, _Leaf):
            raise InvalidValueError(
                f"the value at {list(pointer[: i + 1])} is both a value and a container",
                path=key,
            )
        node = child
    if pointer[-1] in node:
        raise InvalidValueError(f"two entries are stored at {list(pointer)}", path=key)
    node[pointer[-1]] = _Leaf(value)


def _finish(node: Any) -> Any:
    if isinstance(node, _Leaf):
        return node.value
    keys = list(node)
    if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
        return [_finish(node[i]) for i in range(len(keys))]
    return {str(k): _finish(v) for k, v in node.items()}


def assemble_values(
    values: Sequence[tuple[ObjectPath, ValueTarget, Any]],
    groups: set[str],
) -> tuple[dict[str, dict[str, Any]], dict[str, Entry]]:
    """Group values and record entries of JSON values (already JSON-encoded).

    ``groups`` holds the node paths of every group (arrays' ancestors); groups the values
    need are added to it. Flattened param-group entries are grouped by equal
    hyperparameters, in the order their parameters first appear.
    """
    entries: dict[str, Entry] = {}
    trees: dict[str, dict[PathItem, Any]] = {}
    placed: list[tuple[ObjectPath, tuple[PathItem, ...], Any]] = []

    # flattened param groups -> param_groups[i][key]
    per_param: dict[str, dict[str, Any]] = {}
    flat_paths: dict[tuple[str, str], ObjectPath] = {}
    for path, target, value in values:
        if target.param_entry is not None:
            fqn, hyper = target.param_entry
            per_param.setdefault(fqn, {})[hyper] = value
            flat_paths[(fqn, hyper)] = path
        else:
            placed.append((path, target.logical, value))
    if per_param:
        existing = [
            index for _, t, _ in values
            if t.param_entry is None and t.logical[:2] == ("optimizer", "param_groups")
            and len(t.logical) > 2 and isinstance(index := t.logical[2], int)
        ]
        start = max(existing, default=-1) + 1
        distinct: list[dict[str, Any]] = []
        members: list[list[str]] = []
        for fqn, settings in per_param.items():
            for i, known in enumerate(distinct):
                if known == settings:
                    members[i].append(fqn)
                    break
            else:
                distinct.append(settings)
                members.append([fqn])
        for i, (settings, fqns) in enumerate(zip(distinct, members, strict=True)):
            gi = start + i
            placed.append(((), ("optimizer", "param_groups", gi, "params"), list(fqns)))
            for fqn in fqns:
                for name, value in settings.items():
                    path = flat_paths[(fqn, name)]
                    if fqn == fqns[0]:
                        placed.append((path, ("optimizer", "param_groups", gi, name), value))
                    else:  # stored once per group; later members point at the same value
                        entries[flat_key(path)] = Entry(path, group="optimizer",
                                                        pointer=("param_groups", gi, name))

    for _, logical, _ in placed:
        groups.add(node_path(logical[:1]))
        if logical[:2] == ("optimizer", "state") and len(logical) == 4:
            groups.update((node_path(logical[:2]), node_path(logical[:3])))
    for path, logical, value in placed:
        key = flat_key(path) if path else "optimizer.param_groups"
        for k in range(len(logical) - 1, 0, -1):
            prefix = logical[:k]
            if all(isinstance(p, str) for p in prefix) and node_path(prefix) in groups:
                break
        else:  # pragma: no cover - logical[:1] is always a group
            raise AssertionError(logical)
        gpath = node_path(logical[:k])
        pointer: tuple[PathItem, ...] = (str(logical[k]), *logical[k + 1:])
        _set(trees.setdefault(gpath, {}), pointer, value, key)
        if path:
            entries[flat_key(path)] = Entry(path, group=gpath, pointer=pointer)
    group_values = {g: _finish(tree) for g, tree in trees.items()}
    return group_values, entries


def check_groups_and_arrays(arrays: Iterable[str], groups: Iterable[str]) -> None:
    """Refuse a node that would be both an array and a group."""
    clash = sorted(set(arrays) & set(groups))
    if clash:
        raise InvalidValueError(
            f"{clash[0]!r} would be both a tensor and a group of further entries", path=clash[0]
        )


def ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


# -- loading a checkpoint without a record: derive the keys ----------------------------------


def _dcp_leaves(value: Any, prefix: tuple[PathItem, ...]) -> list[tuple[tuple[PathItem, ...], Any]]:
    """The leaves DCP's flattening produces for a value: mappings and lists of containers."""
    if isinstance(value, Mapping):
        out = []
        for k, v in value.items():
            out.extend(_dcp_leaves(v, (*prefix, str(k))))
        return out
    if isinstance(value, list) and any(isinstance(v, Mapping | list) and _container(v)
                                       for v in value):
        out = []
        for i, v in enumerate(value):
            out.extend(_dcp_leaves(v, (*prefix, i)))
        return out
    return [(prefix, value)]


def _container(value: Any) -> bool:
    if isinstance(value, Mapping):
        return True
    return isinstance(value, list) and any(isinstance(v, Mapping | list) and _container(v)
                                           for v in value)


def _dcp_paths(logical: Sequence[PathItem], key_map: KeyMap) -> list[ObjectPath]:
    """Inverse of :func:`locate` for the conventional locations: every spelling (the LR
    scheduler's state answers to each of ``KeyMap.scheduler_keys``)."""
    path = _dcp_path_unwrapped(logical, key_map)
    if path is None:
        return []
    paths = [path]
    if tuple(logical[:2]) == ("training", "scheduler"):
        paths = [(key, *path[1:]) for key in key_map.scheduler_keys]
    if key_map.wrapper is None:
        return paths
    return [(key_map.wrapper, *p) for p in paths]


def _dcp_path_unwrapped(logical: Sequence[PathItem], key_map: KeyMap) -> ObjectPath | None:
    top, rest = logical[0], tuple(logical[1:])
    if not rest:
        return None
    if top == "model":
        if len(rest) == 1 and isinstance(rest[0], str):
            return (rest[0],) if key_map.model is None else (key_map.model, rest[0])
        return None if key_map.model is None else (key_map.model, *rest)
    if top == "optimizer":
        opt = key_map.optimizer
        if rest[0] == "state" and len(rest) == 3:
            if key_map.flat_optimizer:
                return (opt, f"state.{rest[1]}.{rest[2]}")
            return (opt, *rest)
        return (opt, *rest)
    if top == "training":
        return rest
    return tuple(logical)


def derive_entries(
    arrays: Iterable[str],
    group_values: Mapping[str, Mapping[str, Any]],
    aliases: Mapping[str, str],
    key_map: KeyMap,
) -> dict[str, Entry]:
    """Keys of a checkpoint that has no DCP record, by the inverse of the mapping.

    ``group_values`` holds the decoded values of every group; ``aliases`` the model
    group's tied-tensor aliases (alias FQN -> stored FQN).
    """
    out: dict[str, Entry] = {}

    def add(entry: Entry) -> None:
        out.setdefault(entry.key, entry)  # the first spelling wins on a collision

    for array in sorted(arrays):
        logical = tuple(names.split_path(array))
        for path in _dcp_paths(logical, key_map):
            add(Entry(path, array=array))
        if len(logical) == 2 and logical[0] == "model":
            for alias, target in sorted(aliases.items()):
                if target == logical[1]:
                    for alias_path in _dcp_paths(("model", alias), key_map):
                        add(Entry(alias_path, array=array))
    for gpath in sorted(group_values):
        base = tuple(names.split_path(gpath)) if gpath else ()
        values = group_values[gpath]
        if not base:
            continue  # root values are not part of any DCP layout ucpformat writes
        for name, value in values.items():
            if base == ("optimizer",) and name == "param_groups" and key_map.flat_optimizer \
                    and isinstance(value, list):
                for gi, pg in enumerate(value):
                    if not isinstance(pg, Mapping):
                        continue
                    for fqn in pg.get("params", []):
                        for hyper in pg:
                            if hyper != "params":
                                flat: ObjectPath = (
                                    key_map.optimizer, f"param_groups.{fqn}.{hyper}")
                                if key_map.wrapper is not None:
                                    flat = (key_map.wrapper, *flat)
                                add(Entry(flat, group=gpath,
                                          pointer=("param_groups", gi, hyper)))
                continue
            for sub, _ in _dcp_leaves(value, ()):
                for path in _dcp_paths((*base, name, *sub), key_map):
                    add(Entry(path, group=gpath, pointer=(name, *sub)))
    return out


def lookup(values: Any, pointer: Sequence[PathItem], *, where: str) -> Any:
    """The value at ``pointer`` inside a group's (decoded) values."""
    node = values
    for item in pointer:
        if isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
            node = node[item]
        elif isinstance(node, Mapping) and str(item) in node:
            node = node[str(item)]
        else:
            raise FormatError(f"no value at {list(pointer)} in the group's values", path=where)
    return node


def encode_value(value: Any, *, key: str) -> Any:
    """A non-tensor DCP value as JSON, or a clear error naming its key."""
    from ucpformat.torch.state import to_json

    try:
        return jsonvalues.encode(to_json(value, where=key), where=key)
    except InvalidValueError as exc:
        raise InvalidValueError(
            f"DCP entry {key!r} holds a {type(value).__name__}, which is neither a tensor, "
            f"bytes nor a JSON value ({exc.message}); ucpformat never stores pickles: "
            "convert it to JSON-able values (numbers, strings, lists, dicts), bytes or a tensor",
            path=key,
        ) from None


__all__ = [
    "Entry",
    "KeyMap",
    "SaveContext",
    "ValueTarget",
    "assemble_values",
    "derive_entries",
    "flat_key",
    "locate",
]

"""The state of random-number generators in ``training/rng`` (spec UCP-1.0-R085).

One node per generator, so that any reader finds each by name::

    training/rng/python              group: Python's ``random`` (values, kind "python")
    training/rng/numpy               group: NumPy's global generator (kind "numpy")
    training/rng/torch_cpu           uint8 array: torch.get_rng_state()
    training/rng/torch_cuda/<i>      uint8 array: torch.cuda.get_rng_state(i)
    training/rng/generators/<name>   a generator the user names: a group of either kind,
                                     or a uint8 array (a torch.Generator's get_state())

A ``python`` group's values are ``random.getstate()``: ``version``, ``state`` (the 625
integers) and ``gauss_next``. A ``numpy`` group's values are the numbers of NumPy's
``bit_generator.state`` mapping, the members of its ``state`` mapping named
``state.<member>``; its array members (MT19937's ``key``, Philox's ``counter``...) are
child arrays of the group under the same names. Integers beyond ±(2^53 − 1) (PCG64's
128-bit ``state`` and ``inc``) are written as strings of decimal digits (UCP-1.0-R071). The
values of both kinds are described by ``schemas/1.0/rng.schema.json``.

In Python, a state is a mapping with the same names: ``python`` a tuple as
``random.getstate()`` returns it, ``numpy`` a mapping as
``numpy.random.get_state(legacy=False)`` or ``Generator.bit_generator.state`` returns it,
``torch_cpu`` a uint8 array, ``torch_cuda`` a list of them, ``generators`` a mapping of
names to any of these. :func:`encode` makes the group that ``ucpformat.save`` writes,
:func:`decode` reads it back type for type (tuples as tuples); :func:`problems` lists what
breaks UCP-1.0-R085, for the validator and for :func:`decode`. PyTorch's side is
:mod:`ucpformat.torch.rng`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ucpformat.checkpoint.tree import Group
from ucpformat.errors import FormatError, InvalidValueError
from ucpformat.format import schemas

RULE = "UCP-1.0-R085"
#: The generators the convention names, and the group of user-named ones.
PYTHON, NUMPY, TORCH_CPU, TORCH_CUDA, GENERATORS = (
    "python", "numpy", "torch_cpu", "torch_cuda", "generators")
NAMES = (PYTHON, NUMPY, TORCH_CPU, TORCH_CUDA, GENERATORS)
#: Largest integer a JSON value holds exactly (UCP-1.0-R071).
MAX_SAFE_INTEGER = 2**53 - 1
_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")


# -- Python -> the group ------------------------------------------------------------------


def encode(state: Mapping[str, Any], *, where: str = "training/rng") -> Group:
    """The group ``training/rng`` for a state (see the module docstring for its form)."""
    out = Group()
    for key, value in state.items():
        at = f"{where}/{key}"
        if key == PYTHON:
            out[key] = encode_python(value, where=at)
        elif key == NUMPY:
            out[key] = encode_numpy(value, where=at)
        elif key == TORCH_CPU:
            out[key] = _bytes(value, at)
        elif key == TORCH_CUDA:
            if not isinstance(value, Sequence):
                raise InvalidValueError("a list of the CUDA devices' states", path=at)
            out[key] = Group({str(i): _bytes(v, f"{at}/{i}") for i, v in enumerate(value)})
        elif key == GENERATORS:
            if not isinstance(value, Mapping):
                raise InvalidValueError("a mapping of names to generator states", path=at)
            out[key] = Group({str(name): _generator(v, f"{at}/{name}")
                              for name, v in value.items()})
        else:
            raise InvalidValueError(f"no generator {key!r} in the convention (known: "
                                    f"{', '.join(NAMES)})", path=at, rule=RULE)
    return out


def _generator(value: Any, where: str) -> Any:
    if isinstance(value, tuple):
        return encode_python(value, where=where)
    if isinstance(value, Mapping) and "bit_generator" in value:
        return encode_numpy(value, where=where)
    if isinstance(value, np.ndarray):
        return _bytes(value, where)
    raise InvalidValueError(
        f"a {type(value).__name__} is no generator state (random.getstate()'s tuple, a "
        "numpy bit_generator.state mapping, or a torch generator's uint8 state)", path=where,
    )


def _bytes(value: Any, where: str) -> np.ndarray[Any, Any]:
    array = np.asarray(value)
    if array.dtype != np.uint8 or array.ndim != 1:
        raise InvalidValueError(
            f"a torch generator's state is a 1-D uint8 array, not {array.dtype} of shape "
            f"{list(array.shape)}", path=where, rule=RULE,
        )
    return array


def encode_python(state: Any, *, where: str) -> Group:
    """``random.getstate()`` as the values of a ``python`` group."""
    if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], int)
            and isinstance(state[1], tuple)
            and all(isinstance(i, int) and 0 <= i < 2**32 for i in state[1])
            and (state[2] is None or isinstance(state[2], float))):
        raise InvalidValueError("not a random.getstate() tuple (version, state, gauss_next)",
                                path=where, rule=RULE)
    if state[2] is not None and not math.isfinite(state[2]):
        raise InvalidValueError(f"gauss_next is {state[2]}", path=where, rule=RULE)
    return Group(kind=PYTHON, version=state[0], state=list(state[1]), gauss_next=state[2])


def encode_numpy(state: Any, *, where: str) -> Group:
    """A NumPy bit generator's state (or ``numpy.random.get_state()``'s legacy tuple) as a
    ``numpy`` group: its numbers as values, its arrays as child arrays."""
    if isinstance(state, tuple) and len(state) == 5 and state[0] == "MT19937":
        name, key, pos, has_gauss, gauss = state  # the legacy form of RandomState
        state = {"bit_generator": name, "state": {"key": key, "pos": pos},
                 "has_gauss": has_gauss, "gauss": gauss}
    if not isinstance(state, Mapping) or not isinstance(state.get("bit_generator"), str):
        raise InvalidValueError("not a numpy bit_generator.state mapping", path=where,
                                rule=RULE)
    out = Group(kind=NUMPY, bit_generator=state["bit_generator"])
    for key, value in state.items():
        if key == "bit_generator":
            continue
        if key == "state" and isinstance(value, Mapping):
            for sub, v in value.items():
                out[f"state.{sub}"] = _numpy_member(v, f"{where}/state.{sub}")
        else:
            out[str(key)] = _numpy_member(value, f"{where}/{key}")
    return out


def _numpy_member(value: Any, where: str) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "u" or value.ndim != 1:
            raise InvalidValueError(f"an array of {value.dtype} of shape {list(value.shape)}; "
                                    "expected a 1-D unsigned integer array", path=where,
                                    rule=RULE)
        return value
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidValueError(f"a {type(value).__name__}; expected a number or an array",
                                path=where, rule=RULE)
    if isinstance(value, int) and abs(value) > MAX_SAFE_INTEGER:
        return str(value)  # exact, where a JSON number would be rounded (UCP-1.0-R071)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidValueError(f"{value} is no generator state", path=where, rule=RULE)
    return value


# -- the group -> Python ------------------------------------------------------------------


def problems(values: Mapping[str, Any], arrays: Mapping[str, tuple[str, int]],
             *, torch_state: bool = False) -> list[str]:
    """What breaks UCP-1.0-R085 in one generator node: ``values`` its group's values, ``arrays``
    name -> (data type name, rank) of its child arrays; ``torch_state``: the node is an
    array (a torch generator), given as ``arrays[""]``."""
    if torch_state:
        dtype, rank = arrays[""]
        if dtype != "uint8" or rank != 1:
            return [f"a torch generator's state is a 1-D uint8 array, not {dtype} of rank {rank}"]
        return []
    out = [f"values{v.pointer}: {v.message}" for v in schemas.violations("rng", dict(values))]
    kind = values.get("kind")
    for name, (dtype, rank) in arrays.items():
        if kind != NUMPY:
            out.append(f"{name}: only a numpy state has arrays")
        elif not dtype.startswith("uint") or rank != 1:
            out.append(f"{name}: a numpy state's arrays are 1-D unsigned integers, not "
                       f"{dtype} of rank {rank}")
        elif name in values:
            out.append(f"{name}: both a value and an array")
    return out


def decode(tree: Mapping[str, Any], *, where: str = "training/rng") -> dict[str, Any]:
    """A state from ``Checkpoint.to_dict("training/rng")``: the inverse of :func:`encode`.

    Raises ``FormatError`` (UCP-1.0-R085) naming the node that breaks the convention. Nodes the
    convention does not name are left out.
    """
    out: dict[str, Any] = {}
    for key in (PYTHON, NUMPY):
        if key in tree:
            out[key] = decode_generator(tree[key], where=f"{where}/{key}", kind=key)
    if TORCH_CPU in tree:
        out[TORCH_CPU] = decode_generator(tree[TORCH_CPU], where=f"{where}/{TORCH_CPU}",
                                          kind="torch")
    if TORCH_CUDA in tree:
        devices = tree[TORCH_CUDA]
        at = f"{where}/{TORCH_CUDA}"
        if not isinstance(devices, Mapping) or not all(_INDEX.match(k) for k in devices) \
                or sorted(int(k) for k in devices) != list(range(len(devices))):
            raise FormatError("a group of arrays named 0, 1, ... (one per CUDA device)",
                              rule=RULE, path=at)
        out[TORCH_CUDA] = [decode_generator(devices[str(i)], where=f"{at}/{i}", kind="torch")
                           for i in range(len(devices))]
    if GENERATORS in tree:
        named = tree[GENERATORS]
        if not isinstance(named, Mapping):
            raise FormatError("a group of generators", rule=RULE, path=f"{where}/{GENERATORS}")
        out[GENERATORS] = {name: decode_generator(value, where=f"{where}/{GENERATORS}/{name}")
                           for name, value in named.items()}
    return out


def decode_generator(node: Any, *, where: str, kind: str | None = None) -> Any:
    """One generator's state: a tuple (python), a mapping (numpy), a uint8 array (torch)."""
    if isinstance(node, np.ndarray):
        found = problems({}, {"": (node.dtype.name, node.ndim)}, torch_state=True)
        if kind not in (None, "torch") or found:
            raise FormatError(found[0] if found else f"a {kind} state is a group, not an array",
                              rule=RULE, path=where)
        return node
    if not isinstance(node, Mapping):
        raise FormatError("a generator's state is a group or an array", rule=RULE, path=where)
    values = {k: v for k, v in node.items() if not isinstance(v, np.ndarray | Mapping)}
    arrays = {k: v for k, v in node.items() if isinstance(v, np.ndarray)}
    found = problems(values, {k: (a.dtype.name, a.ndim) for k, a in arrays.items()})
    found += [f"{k}: a group inside a generator's group" for k, v in node.items()
              if isinstance(v, Mapping)]
    if not found and kind not in (None, values.get("kind")):
        found.append(f"the {kind} generator's group has kind {values.get('kind')!r}")
    if found:
        raise FormatError("; ".join(found), rule=RULE, path=where)
    if values["kind"] == PYTHON:
        return (values["version"], tuple(values["state"]), values["gauss_next"])
    state: dict[str, Any] = {"bit_generator": values["bit_generator"]}
    members = {**{k: v for k, v in values.items() if k not in ("kind", "bit_generator")},
               **{k: np.array(a) for k, a in arrays.items()}}
    for name, value in members.items():
        if isinstance(value, str):
            value = int(value)  # a decimal integer beyond 2**53 (the schema checked it)
        head, dot, sub = name.partition(".")
        if dot and head == "state":
            state.setdefault("state", {})[sub] = value
        else:
            state[name] = value
    return state


__all__ = ["NAMES", "RULE", "decode", "decode_generator", "encode", "encode_numpy",
           "encode_python", "problems"]

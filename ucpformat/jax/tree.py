"""Where each leaf of a JAX training state is stored: the naming shared by save and load.

A state is a mapping (or an object with attributes, as Flax's ``TrainState``) whose
entries are, by name:

* ``params``: every leaf at ``model/<fqn>``, the FQN the leaf's path joined by dots
  (``{"Dense_0": {"kernel": k}}`` -> ``model/Dense_0.kernel``), role ``parameter``;
  non-array leaves are JSON values of the ``model`` group, keyed by FQN (as torch's
  extra state).
* ``opt_state``: an Optax state. Each Adam-family state (``ScaleByAdamState``:
  ``count``, ``mu``, ``nu``, as ``adam``, ``adamw``, ``nadam`` keep) is stored as
  torch's Adam is: ``mu`` at ``optimizer/state/<fqn>/exp_avg``, ``nu`` at
  ``.../exp_avg_sq``, ``count`` at ``.../step`` of every parameter (float32 scalars,
  as torch keeps them); every other leaf at ``optimizer/optax/<its path>``.
  The ``optimizer`` group's values are ``type`` and ``param_groups`` (the parameter
  FQNs, and the hyperparameters an ``inject_hyperparams`` state holds, under torch's
  names: ``lr``, ``betas``, ``eps``, ``weight_decay``).
* ``step``: the ``training`` group's value ``step`` (an integer).
* any other name: ``training/<name>/<path>``; arrays as arrays (role
  ``training_state``), PRNG keys as their key data (``jax.random.key_data``, with the
  key implementation in ``attributes.ucp.prng_impl``), other leaves as JSON values of
  their parent group.

A leaf's pytree path becomes node names one element per level (a dict key, an
attribute name, a sequence index).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucpformat.errors import InvalidValueError
from ucpformat.format import names
from ucpformat.optional import require

PARAMS = "params"
OPT_STATE = "opt_state"
STEP = "step"

#: The Optax Adam state's fields (``optax.ScaleByAdamState``), recognised by shape so
#: that this module need not import Optax.
ADAM_FIELDS = ("count", "mu", "nu")
#: Optax hyperparameter names (``inject_hyperparams``) -> torch's ``param_groups`` names.
TORCH_HYPERPARAMETERS = {"learning_rate": "lr", "eps": "eps", "weight_decay": "weight_decay"}


def _jax() -> Any:
    return require("jax", extra="jax", purpose="ucpformat.jax")


@dataclass(frozen=True)
class Rename:
    """How a parameter is stored under another framework's name: ``name`` (the stored
    FQN) and ``perm`` (the stored tensor is the JAX one with its axes permuted:
    ``stored = jnp.transpose(leaf, perm)``; None: the same axes)."""

    name: str
    perm: tuple[int, ...] | None = None


#: A key map: JAX FQN -> the name (and axes) it is stored under (see :mod:`ucpformat.jax.mapping`).
KeyMap = Mapping[str, Rename]


@dataclass(frozen=True)
class Leaf:
    """One leaf of a state and where it is stored.

    ``kind``: ``"array"`` (a tensor at node ``path``), ``"value"`` (a JSON value ``key``
    of group ``path``), ``"count"`` (an Adam count: a float32 scalar at each of
    ``steps``)."""

    at: tuple[str, ...]  # the leaf's pytree path: section name, then one name per level
    kind: str
    path: str
    value: Any
    role: str = ""
    key: str = ""
    perm: tuple[int, ...] | None = None
    steps: tuple[str, ...] = ()
    attributes: Mapping[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """The leaf's pytree path, for messages (``opt_state/0/mu/Dense_0/kernel``)."""
        return "/".join(self.at)


def is_adam(node: Any) -> bool:
    """Whether ``node`` is an Optax ``ScaleByAdamState`` (or alike: a named tuple of
    ``count``, ``mu``, ``nu``)."""
    return isinstance(node, tuple) and getattr(type(node), "_fields", None) == ADAM_FIELDS


def key_name(entry: Any) -> str:
    """One element of a pytree path as a name: a dict key, an attribute, an index."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def where_of(at: Sequence[str]) -> str:
    return "/".join(at)


def is_array(value: Any) -> bool:
    """An array-like leaf (a jax.Array, numpy array, ShapeDtypeStruct): has shape and dtype."""
    return hasattr(value, "shape") and hasattr(value, "dtype")


def is_key(value: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``)."""
    if not is_array(value):
        return False
    jax = _jax()
    try:
        return bool(jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def sections(state: Any) -> list[tuple[str, Any]]:
    """(name, subtree) of the state's top level: a mapping's items, or the fields of a
    pytree dataclass (Flax ``TrainState``: ``step``, ``params``, ``opt_state``)."""
    if isinstance(state, Mapping):
        items = list(state.items())
    else:
        jax = _jax()
        flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is not state)
        items = [(key_name(p[0]), v) for p, v in flat if p]
        if not items:
            raise InvalidValueError(
                f"a state must be a mapping or a pytree with named fields, got "
                f"{type(state).__name__}", path="state")
    for name, _ in items:
        if not isinstance(name, str):
            raise InvalidValueError(f"state entry names must be strings, got {name!r}",
                                    path="state")
    return items


def flat_leaves(tree: Any, leaf: Callable[[Any], bool] | None = None
                ) -> list[tuple[list[str], Any]]:
    """(path as names, leaf) of every leaf of ``tree`` (``leaf``: what else is a leaf)."""
    jax = _jax()
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf)
    return [([key_name(p) for p in path], value) for path, value in flat]


class _Names:
    """Every node path and value key given out, to refuse two leaves in one place."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def claim(self, place: str, where: str) -> None:
        if place in self.seen:
            raise InvalidValueError(
                f"{where} and {self.seen[place]} would both be stored at {place!r}",
                path=where)
        self.seen[place] = where


def fqn_of(parts: Sequence[str], where: str) -> str:
    """A leaf's FQN: its path's names joined by dots (checked as a name)."""
    fqn = ".".join(parts)
    names.check_name(fqn, where=where)
    return fqn


def layout(state: Any, *, keymap: KeyMap | None = None) -> list[Leaf]:
    """Where each leaf of ``state`` is stored; raises InvalidValueError naming a leaf
    that cannot be stored."""
    out: list[Leaf] = []
    taken = _Names()
    keymap = keymap or {}

    def place(fqn: str) -> tuple[str, tuple[int, ...] | None]:
        rule = keymap.get(fqn)
        return (fqn, None) if rule is None else (rule.name, rule.perm)

    for section, subtree in sections(state):
        if section == PARAMS:
            for parts, value in flat_leaves(subtree):
                at = (section, *parts)
                fqn = fqn_of(parts, where_of(at))
                stored, perm = place(fqn)
                if is_array(value):
                    path = names.path_of("model", stored)
                    taken.claim(path, where_of(at))
                    out.append(Leaf(at, "array", path, value, role="parameter", perm=perm))
                else:
                    taken.claim(f"model#{stored}", where_of(at))
                    out.append(Leaf(at, "value", "model", value, key=stored))
        elif section == OPT_STATE:
            out.extend(_optimizer(subtree, taken, place))
        elif section == STEP:
            taken.claim("training#step", section)
            out.append(Leaf((section,), "value", "training", subtree, key="step"))
        else:
            for parts, value in flat_leaves(subtree):
                at = (section, *parts)
                if is_array(value):
                    path = names.path_of("training", section, *parts)
                    taken.claim(path, where_of(at))
                    out.append(Leaf(at, "array", path, value, role="training_state"))
                else:
                    group = names.path_of("training", *at[:-1])
                    taken.claim(f"{group}#{at[-1]}", where_of(at))
                    out.append(Leaf(at, "value", group, value, key=at[-1]))
    return out


def _optimizer(opt_state: Any, taken: _Names,
               place: Callable[[str], tuple[str, tuple[int, ...] | None]]) -> list[Leaf]:
    out: list[Leaf] = []
    for parts, node in flat_leaves(opt_state, is_adam):
        at = (OPT_STATE, *parts)
        where = where_of(at)
        if not is_adam(node):
            if not is_array(node):
                raise InvalidValueError(
                    f"{where}: an optimizer state leaf must be an array, got "
                    f"{type(node).__name__}", path=where)
            path = names.path_of("optimizer", "optax", *parts)
            taken.claim(path, where)
            out.append(Leaf(at, "array", path, node, role="optimizer_state"))
            continue
        steps = []
        for moment, stored_name in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            for sub, value in flat_leaves(getattr(node, moment)):
                a = (*at, moment, *sub)
                stored, perm = place(fqn_of(sub, where_of(a)))
                path = names.path_of("optimizer", "state", stored, stored_name)
                taken.claim(path, where_of(a))
                out.append(Leaf(a, "array", path, value, role="optimizer_state", perm=perm))
                if moment == "mu":
                    steps.append(names.path_of("optimizer", "state", stored, "step"))
        for s in steps:
            taken.claim(s, where_of((*at, "count")))
        out.append(Leaf((*at, "count"), "count", "", node.count,
                        role="optimizer_state", steps=tuple(steps)))
    return out


def rebuild(state: Any, values: Mapping[tuple[str, ...], Any]) -> Any:
    """``state`` with each leaf replaced by ``values[leaf.at]`` (the same structure; an
    Adam state rebuilt as its own type)."""
    jax = _jax()

    def one(path: Any, node: Any) -> Any:
        at = tuple(key_name(p) for p in path)
        if not is_adam(node):
            return values[at]
        moments = {
            moment: jax.tree_util.tree_map_with_path(
                lambda p, _v, m=moment: values[(*at, m, *(key_name(x) for x in p))],
                getattr(node, moment))
            for moment in ("mu", "nu")
        }
        return type(node)(count=values[(*at, "count")], **moments)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=is_adam)


def hyperparameters(opt_state: Any) -> dict[str, Any]:
    """The hyperparameters an ``optax.inject_hyperparams`` state holds, under torch's
    names (``lr``, ``betas``, ``eps``, ``weight_decay``), as numbers."""
    out: dict[str, Any] = {}
    for _, node in flat_leaves(opt_state, lambda x: hasattr(x, "hyperparams")):
        params = getattr(node, "hyperparams", None)
        if not isinstance(params, Mapping):
            continue
        for name, value in params.items():
            if not is_array(value) or getattr(value, "size", 2) != 1:
                continue
            number = float(value)
            if name in TORCH_HYPERPARAMETERS:
                out[TORCH_HYPERPARAMETERS[name]] = number
            elif name in ("b1", "b2"):
                betas = out.setdefault("betas", [None, None])
                betas[0 if name == "b1" else 1] = number
            else:
                out[name] = number
    return out


def param_fqns(leaves: Iterable[Leaf]) -> list[str]:
    """The stored FQNs of the parameters an Adam state covers (from its step arrays)."""
    return [names.split_path(s)[2] for leaf in leaves if leaf.kind == "count"
            for s in leaf.steps]


__all__ = [
    "ADAM_FIELDS",
    "OPT_STATE",
    "PARAMS",
    "STEP",
    "KeyMap",
    "Leaf",
    "Rename",
    "flat_leaves",
    "fqn_of",
    "hyperparameters",
    "is_adam",
    "is_array",
    "is_key",
    "key_name",
    "layout",
    "param_fqns",
    "rebuild",
    "sections",
]

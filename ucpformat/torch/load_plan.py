"""The load planner of ucpformat.torch: what a load will change, checked before it changes it.

Both loads use it, the single-process :func:`ucpformat.torch.state.load` and the
collective :func:`ucpformat.torch.distributed.load_distributed`. Each describes what it
loads into (the model's state dict, an :class:`OptimizerView` of the optimizer, the
scheduler) and the planner matches that against the checkpoint's metadata, reading no
tensor data:

* :func:`plan_model`: every state-dict entry by name (tied tensors through the ``model``
  group's aliases, UCP-1.0-R108), stored shapes against the model's;
* :func:`plan_optimizer`: parameters by FQN, never by position; the param groups and
  their hyperparameters; every per-parameter state, its shape checked against the
  parameter (UCP-1.0-R081) and against the optimizer's own state;
* :func:`plan_scheduler`: the scheduler's stored state against its own.

A stored JSON value must be of the kind the live object holds (a mapping for a mapping,
a number for a number; :func:`value_like`). A load then reads every tensor into staging
(:mod:`ucpformat.torch.reads`) and only then changes the objects, in the order of
:func:`apply_steps`: a checkpoint that does not fit, or whose data is damaged or missing,
changes nothing. (With ``in_place=True`` the model's tensors are read into directly: a
damaged or missing chunk then leaves them partly changed, and the error says so.)

Tensors on the meta device hold nothing to copy into: the model's are refused unless the
load assigns new ones (``assign=True``, :mod:`ucpformat.torch.assign`), an optimizer's
always (:func:`refuse_meta_parameters`).
"""

from __future__ import annotations

import collections
import copy
import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.errors import KeyMismatchError, LoadError, ShapeMismatchError, UCPError
from ucpformat.format import names
from ucpformat.store import Store
from ucpformat.torch.numpy_bridge import from_numpy

#: What a load takes: a location, a store, or an open checkpoint.
PathOrCheckpoint = str | os.PathLike[str] | Store | Checkpoint
Device = str | torch.device

_MAX_LISTED = 20


@contextmanager
def opened(path: PathOrCheckpoint) -> Iterator[Checkpoint]:
    """The checkpoint at ``path`` (closed on exit), or ``path`` itself if already open."""
    if isinstance(path, Checkpoint):
        yield path
        return
    ckpt = open_checkpoint(path)
    try:
        yield ckpt
    finally:
        ckpt.close()


# -- what the checkpoint holds ----------------------------------------------------------


def stored_tensors(ckpt: Checkpoint, group: str) -> dict[str, str]:
    """Logical name -> node path of the arrays directly in ``group``."""
    start = group + "/"
    out: dict[str, str] = {}
    for path in ckpt.arrays:
        if path.startswith(start) and "/" not in path[len(start):]:
            out[names.unescape(path[len(start):])] = path
    return out


def group_values(ckpt: Checkpoint, group: str) -> dict[str, Any]:
    """The JSON values of ``group`` (empty if there is no such group)."""
    return ckpt.values(group) if group in ckpt.groups else {}


@dataclass(frozen=True)
class StoredArray:
    """A per-parameter optimizer state stored as an array (node ``path``), not yet read."""

    path: str


def optimizer_entries(ckpt: Checkpoint) -> dict[str, dict[str, Any]]:
    """FQN -> {state name: :class:`StoredArray` or JSON value} of the stored state."""
    out: dict[str, dict[str, Any]] = {}
    for fqn, value in group_values(ckpt, "optimizer/state").items():
        if isinstance(value, Mapping):
            out.setdefault(fqn, {}).update(value)
    prefix = "optimizer/state/"
    for path in ckpt.groups:
        if path.startswith(prefix) and "/" not in path[len(prefix):]:
            fqn = names.unescape(path[len(prefix):])
            out.setdefault(fqn, {}).update(ckpt.values(path))
    for path in ckpt.arrays:
        parts = path.split("/")
        if len(parts) == 4 and path.startswith(prefix):
            entry = out.setdefault(names.unescape(parts[2]), {})
            entry[names.unescape(parts[3])] = StoredArray(path)
    return out


def saved_param_groups(
    ckpt: Checkpoint, optimizer_type: str, *, strict: bool
) -> list[Mapping[str, Any]]:
    """The param groups of a checkpoint's optimizer, checked; with ``strict``, its type,
    if it names one (UCP-1.0-R081: optional; DCP and the importers do not know it), must be
    ``optimizer_type`` (a qualified class name)."""
    saved: dict[str, Any] = ckpt.values("optimizer")
    saved_type = saved.get("type")
    if strict and saved_type is not None and saved_type != optimizer_type:
        raise LoadError(
            f"the checkpoint holds the state of a {saved_type!r} optimizer, not of a "
            f"{optimizer_type!r}; pass strict=False to load it anyway",
            path="optimizer",
        )
    saved_groups = saved.get("param_groups", [])
    if not isinstance(saved_groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in saved_groups
    ):
        raise LoadError("optimizer param_groups is missing or malformed",
                        rule="UCP-1.0-R081", path="optimizer")
    return saved_groups


# -- JSON values back into live objects -------------------------------------------------


def like(template: Any, value: Any) -> Any:
    """``value`` (decoded JSON) shaped like ``template`` (the live object's own value).

    Lists become tuples, numbers tensors, and string keys integers where the template
    has them, so that a restored state equals the saved one type for type. What cannot
    be shaped is returned as it is (:func:`value_like` refuses it).
    """
    if template is None:
        return value
    if isinstance(template, torch.Tensor):
        if isinstance(value, torch.Tensor):
            return value
        try:
            return torch.tensor(value, dtype=template.dtype, device=template.device)
        except (TypeError, ValueError, RuntimeError):
            return value
    if isinstance(template, tuple) and isinstance(value, list) and len(template) == len(value):
        items = [like(t, v) for t, v in zip(template, value, strict=True)]
        return tuple(items) if type(template) is tuple else type(template)(*items)
    if isinstance(template, list) and isinstance(value, list):
        return [like(template[i] if i < len(template) else None, v) for i, v in enumerate(value)]
    if isinstance(template, Mapping) and isinstance(value, Mapping):
        by_text = {str(k): k for k in template if isinstance(k, int) and not isinstance(k, bool)}
        int_keys = bool(template) and len(by_text) == len(template)
        out: dict[Any, Any] = {}
        for k, v in value.items():
            key: Any = k
            if k not in template:
                if k in by_text:
                    key = by_text[k]
                elif int_keys and isinstance(k, str) and k.lstrip("-").isdigit():
                    key = int(k)
            out[key] = like(template.get(key), v)
        if isinstance(template, collections.Counter):
            return collections.Counter(out)
        if isinstance(template, collections.OrderedDict):
            return collections.OrderedDict(out)
        return out
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    if _is_number(value):
        return "a number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _kind_mismatch(template: Any, value: Any, where: str) -> tuple[str, str] | None:
    """(where, what) of the first place ``value`` is of another kind than ``template``.

    Containers must match containers (a mapping for a mapping, a list for a list or a
    tuple); where the template holds a number or a tensor the value must be a number
    (a list too, for a tensor) or null. Strings, booleans and other leaves are not
    compared: their kinds vary between library versions.
    """
    if isinstance(template, torch.Tensor):
        if value is None or isinstance(value, torch.Tensor | list) or _is_number(value):
            return None
        return where, f"is {_kind(value)}, the live object holds a tensor there"
    if isinstance(template, Mapping):
        if not isinstance(value, Mapping):
            return where, f"is {_kind(value)}, the live object holds a mapping there"
        by_text = {str(k): v for k, v in template.items()}
        for k, v in value.items():
            if str(k) in by_text:
                found = _kind_mismatch(by_text[str(k)], v, f"{where}.{k}")
                if found:
                    return found
        return None
    if isinstance(template, list | tuple):
        if not isinstance(value, list | tuple):
            return where, f"is {_kind(value)}, the live object holds a list there"
        for i, (t, v) in enumerate(zip(template, value, strict=False)):
            found = _kind_mismatch(t, v, f"{where}[{i}]")
            if found:
                return found
        return None
    if _is_number(template) and not (value is None or _is_number(value)):
        return where, f"is {_kind(value)}, the live object holds a number there"
    return None


def value_like(template: Any, value: Any, *, where: str) -> Any:
    """:func:`like`, after checking that ``value`` is of the kinds ``template`` holds
    (``LoadError`` naming the place otherwise): the live object is never handed a value
    it would fail on."""
    found = _kind_mismatch(template, value, where)
    if found is not None:
        raise LoadError(f"the stored value {found[1]}", path=found[0])
    return like(template, value)


def tree_to_torch(value: Any, device: Device | None, where: str) -> Any:
    """Numpy arrays in a tree of mappings made torch tensors (on ``device``)."""
    if isinstance(value, np.ndarray):
        return from_numpy(value, name=where, device=device)
    if isinstance(value, dict):
        return {k: tree_to_torch(v, device, f"{where}/{k}") for k, v in value.items()}
    return value


# -- key checks -------------------------------------------------------------------------


def _listing(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_LISTED])
    more = f" and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return shown + more


def _refuse_mismatch(
    summary: str,
    missing: tuple[str, Sequence[str]],
    unexpected: tuple[str, Sequence[str]],
    *,
    path: str,
) -> None:
    """Raise KeyMismatchError if anything is missing or unexpected: ``summary``, then each
    non-empty (prefix, keys) listed."""
    parts = [prefix + _listing(keys) for prefix, keys in (missing, unexpected) if keys]
    if parts:
        raise KeyMismatchError(
            f"{summary} ({'; '.join(parts)}); pass strict=False to load the common ones",
            path=path,
        )


def _check_tensor(value: torch.Tensor, where: str) -> None:
    if type(value).__name__ == "ShardedTensor":
        raise LoadError(
            "is a ShardedTensor (FSDP1 / sharded state dict); ucpformat.torch loads DTensor "
            "state (FSDP2 fully_shard, parallelize_module)", tensor=where,
        )


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)  # a DTensor's is the full (global) shape


# -- model ------------------------------------------------------------------------------


@dataclass
class ModelPlan:
    """How a model's state dict is loaded (names and shapes checked)."""

    #: State-dict key -> node path of the stored tensor it receives.
    tensors: dict[str, str] = field(default_factory=dict)
    #: State-dict key -> stored JSON value (extra state), shaped like the current entry.
    values: dict[str, Any] = field(default_factory=dict)
    #: Keys of the state dict that the checkpoint lacks (only with ``strict=False``).
    missing: list[str] = field(default_factory=list)
    #: Names in the checkpoint that the state dict lacks (only with ``strict=False``).
    unexpected: list[str] = field(default_factory=list)
    #: Stored tensors of names the load skips (the model's non-persistent buffers).
    ignored: list[str] = field(default_factory=list)


def plan_model(
    ckpt: Checkpoint,
    state_dict: Mapping[str, Any],
    *,
    strict: bool,
    owner: str,
    skip: Collection[str] = (),
    assign: bool = False,
) -> ModelPlan:
    """Match a model's state dict (``owner`` names it in messages) with ``model/``.

    ``skip``: names that are neither loaded nor unexpected when stored (a module's
    non-persistent buffers, which it never loads); they are listed in ``ignored``.
    Raises ``KeyMismatchError`` (with ``strict``), ``ShapeMismatchError``, or
    ``LoadError`` for a stored tensor where the model holds something else, or a stored
    value of another kind than the model's; without ``assign``, for a tensor on the meta
    device (copying into it would load nothing).
    """
    if "model" not in ckpt.groups:
        if strict:
            raise KeyMismatchError("the checkpoint has no model group; pass strict=False to "
                                   "load the rest anyway", path=ckpt.location)
        return ModelPlan(missing=list(state_dict))
    stored = stored_tensors(ckpt, "model")
    group = ckpt.groups.get("model")
    for alias, target in (group.ucp.get("aliases", {}) if group else {}).items():
        if isinstance(target, str) and target in stored and alias not in stored:
            stored[str(alias)] = stored[target]  # a tied tensor stored once (UCP-1.0-R108)
    values = group_values(ckpt, "model")
    skipped = {k for k in skip if k not in state_dict}
    plan = ModelPlan(
        missing=[k for k in state_dict if k not in stored and k not in values],
        unexpected=[k for k in [*stored, *values] if k not in state_dict and k not in skipped],
        ignored=[k for k in stored if k in skipped],
    )
    if strict:
        _refuse_mismatch(f"the checkpoint's model tensors differ from {owner}",
                         ("missing from the checkpoint: ", plan.missing),
                         ("not in the model: ", plan.unexpected), path=ckpt.location)
    for fqn, current in state_dict.items():
        if fqn in values:  # extra state stored as JSON: shaped like the module's own
            where = f"model/{fqn}"
            value = value_like(current, values[fqn], where=where)
            if isinstance(current, torch.Tensor) and (
                not isinstance(value, torch.Tensor) or _shape(value) != _shape(current)
            ):
                raise LoadError(
                    f"the checkpoint stores a JSON value, {owner} has {_describe(current)}",
                    path=where,
                )
            plan.values[fqn] = value
            continue
        path = stored.get(fqn)
        if path is None:
            continue
        if not isinstance(current, torch.Tensor):
            raise LoadError(
                f"the checkpoint stores a tensor, {owner} has a {type(current).__name__}",
                tensor=path,
            )
        _check_tensor(current, path)
        if current.is_meta and not assign:
            more = sum(1 for k, v in state_dict.items()
                       if k in stored and isinstance(v, torch.Tensor) and v.is_meta) - 1
            others = f" and {more} more tensor{'s' if more > 1 else ''}" if more else ""
            raise LoadError(
                f"{owner} holds {fqn!r}{others} on "
                "the meta device (no memory: a model built under torch.device('meta')), so "
                "copying into them would load nothing; pass assign=True to replace them with "
                "the checkpoint's tensors",
                tensor=path,
            )
        shape = ckpt.arrays[path].shape
        if _shape(current) != shape:
            raise ShapeMismatchError(
                f"stored shape {list(shape)} differs from the model's {list(current.shape)}",
                tensor=path,
            )
        plan.tensors[fqn] = path
    return plan


def _describe(t: torch.Tensor) -> str:
    return f"a {t.dtype} tensor of shape {list(t.shape)}"


# -- optimizer --------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerView:
    """What the planner needs of a live optimizer, keyed as its state dict keys
    parameters (torch's integer ids, or FQNs for ``get_optimizer_state_dict``)."""

    #: Qualified class name (``torch.optim.adamw.AdamW``).
    type_name: str
    #: Its param groups as its state dict gives them (``params``: the keys).
    groups: Sequence[Mapping[str, Any]]
    #: The FQN of every parameter of every group, in the same order.
    fqns: Sequence[Sequence[str]]
    #: Its current per-parameter state, by key.
    state: Mapping[Any, Mapping[str, Any]]
    #: FQN -> the parameter (a DTensor's shape is the full one).
    params: Mapping[str, torch.Tensor]


@dataclass
class OptimizerPlan:
    """How an optimizer's state is loaded (names, kinds and shapes checked)."""

    #: ``{"state": {key: {name: value or StoredArray}}, "param_groups": [...]}`` keyed as
    #: the optimizer's state dict; None: nothing to load (no ``optimizer`` group).
    state_dict: dict[str, Any] | None
    #: Parameters (FQNs) the checkpoint has no param group for.
    missing: list[str] = field(default_factory=list)
    #: Parameters (FQNs) in the checkpoint's param groups that the optimizer lacks.
    unexpected: list[str] = field(default_factory=list)

    def stored_arrays(self) -> list[tuple[Any, dict[str, Any], str, StoredArray]]:
        """(key, state entry, state name, stored array) of every state still to read: the
        loader puts the tensor it reads in ``entry[name]``."""
        if self.state_dict is None:
            return []
        return [
            (key, entry, name, value)
            for key, entry in self.state_dict["state"].items()
            for name, value in entry.items()
            if isinstance(value, StoredArray)
        ]


def plan_optimizer(ckpt: Checkpoint, view: OptimizerView, *, strict: bool) -> OptimizerPlan:
    """Match a live optimizer with ``optimizer/`` by parameter FQN.

    The optimizer's param groups keep their parameters and take the hyperparameters of
    the checkpoint's group that holds them (one group only; a hyperparameter it lacks
    keeps the optimizer's value); every stored state is checked against its parameter
    (:func:`check_state_shape`).
    """
    refuse_meta_parameters(view.params)
    current = [f for group in view.fqns for f in group]
    if "optimizer" not in ckpt.groups:
        if strict:
            raise KeyMismatchError("the checkpoint has no optimizer group; pass strict=False "
                                   "to load the rest anyway", path=ckpt.location)
        return OptimizerPlan(None, current, [])
    saved_groups = saved_param_groups(ckpt, view.type_name, strict=strict)
    group_of = {str(f): gi for gi, g in enumerate(saved_groups) for f in g["params"]}
    current_set = set(current)
    plan = OptimizerPlan(
        None,
        missing=[f for f in current if f not in group_of],
        unexpected=[f for f in group_of if f not in current_set],
    )
    if strict:
        _refuse_mismatch("the optimizer's parameters differ from the checkpoint's",
                         ("the checkpoint has no param group for ", plan.missing),
                         ("the optimizer does not hold ", plan.unexpected), path="optimizer")
    entries = optimizer_entries(ckpt)
    groups: list[dict[str, Any]] = []
    state: dict[Any, dict[str, Any]] = {}
    for gi, (group, fqns) in enumerate(zip(view.groups, view.fqns, strict=True)):
        sources = sorted({group_of[f] for f in fqns if f in group_of})
        if len(sources) > 1:
            raise LoadError(
                f"param group {gi} of the optimizer holds parameters of the checkpoint's "
                f"param groups {sources}, whose hyperparameters may differ",
                path="optimizer",
            )
        # the stored hyperparameters; those the checkpoint lacks keep the live value
        hyper = {k: v for k, v in group.items() if k != "params"}
        if sources:
            hyper.update({
                k: value_like(group.get(k), v, where=f"optimizer/param_groups[{sources[0]}].{k}")
                for k, v in saved_groups[sources[0]].items()
                if k != "params"
            })
        hyper["params"] = list(group["params"])
        groups.append(hyper)
        for fqn, key in zip(fqns, group["params"], strict=True):
            live = view.state.get(key, {})
            if fqn not in group_of:  # strict=False: keep what the optimizer has
                if live:
                    state[key] = dict(live)
                continue
            entry = entries.get(fqn)
            if entry is None:
                continue  # stateless in the checkpoint: no state after loading either
            new: dict[str, Any] = {}
            for name, value in entry.items():
                where = f"optimizer/state/{fqn}/{name}"
                if isinstance(value, StoredArray):
                    check_state_shape(ckpt, value.path, fqn, view.params.get(fqn),
                                      live.get(name))
                    new[name] = value
                else:
                    new[name] = value_like(live.get(name), value, where=where)
            state[key] = new
    plan.state_dict = {"state": state, "param_groups": groups}
    return plan


def refuse_meta_parameters(params: Mapping[str, torch.Tensor]) -> None:
    """Refuse an optimizer whose parameters (by FQN) are on the meta device: torch would
    place the loaded state there, where it holds no data."""
    for fqn, param in params.items():
        if param.is_meta:
            raise LoadError(
                f"the optimizer's parameter {fqn!r} is on the meta device: its state would "
                "be loaded there and hold nothing; load the model first (assign=True), "
                "then build the optimizer on its new parameters and load its state",
                path="optimizer",
            )


def check_device(map_location: Device | None) -> None:
    """Refuse ``map_location='meta'``: tensors made there hold no data."""
    if map_location is not None and torch.device(map_location).type == "meta":
        raise LoadError("map_location is the meta device, where the loaded tensors would "
                        "hold nothing; name a device with memory ('cpu', 'cuda', ...)")


def refuse_optimizer_with_assign(assign: bool, optimizer: object | None) -> None:
    """Refuse ``assign=True`` together with an optimizer: assigning replaces the model's
    parameters, so an optimizer built before would hold the old ones (torch's rule for
    ``Module.load_state_dict(assign=True)``)."""
    if assign and optimizer is not None:
        raise LoadError(
            "assign=True replaces the model's parameters, and the optimizer holds the old "
            "ones: load the model alone with assign=True, then build the optimizer on "
            "model.parameters() and load its state in a second call (without assign)",
            path="optimizer",
        )


def check_state_shape(
    ckpt: Checkpoint,
    path: str,
    fqn: str,
    param: torch.Tensor | None,
    live: Any,
) -> None:
    """Refuse a stored optimizer state (node ``path``) whose shape cannot be the state of
    parameter ``fqn`` (``param``: the live one) in this optimizer (``live``: its own
    state of that name, if any).

    A state with one value per element of its parameter has the parameter's shape
    (UCP-1.0-R081); a state stored with the stored parameter's shape must fit the live
    parameter; and where the optimizer already holds that state, the shapes agree.
    Other shapes (0-d steps, factored moments) are the optimizer's business.
    """
    stored = ckpt.arrays[path].shape
    if param is not None:
        shape = _shape(param)
        stored_param = ckpt.arrays.get(names.path_of("model", fqn))
        if stored_param is not None and stored == stored_param.shape and stored != shape:
            raise ShapeMismatchError(
                f"stored shape {list(stored)} differs from the optimizer's parameter "
                f"{fqn!r} of shape {list(shape)}",
                tensor=path,
            )
        if stored and stored != shape and math.prod(stored) == math.prod(shape) > 0:
            raise ShapeMismatchError(
                f"holds one value per element of parameter {fqn!r} but has shape "
                f"{list(stored)}, not the parameter's {list(shape)}",
                rule="UCP-1.0-R081",
                tensor=path,
            )
    if isinstance(live, torch.Tensor) and _shape(live) != stored:
        raise ShapeMismatchError(
            f"stored shape {list(stored)} differs from the optimizer's own state of "
            f"parameter {fqn!r}, of shape {list(live.shape)}",
            tensor=path,
        )


# -- scheduler --------------------------------------------------------------------------


def plan_scheduler(ckpt: Checkpoint, current: Any, *, strict: bool) -> tuple[bool, Any]:
    """(whether to load it, the stored state) of ``training/scheduler``, shaped like
    ``current`` (the scheduler's own ``state_dict()``) and of its kinds."""
    training = group_values(ckpt, "training")
    if "scheduler" not in training:
        if strict:
            raise KeyMismatchError("the checkpoint holds no scheduler state "
                                   "(training/scheduler); pass strict=False to load the rest "
                                   "anyway", path=ckpt.location)
        return False, None
    where = "training/scheduler"
    stored = training["scheduler"]
    if current is not None and stored is None:
        raise LoadError(f"the stored value is null, the scheduler's state is {_kind(current)}",
                        path=where)
    return True, value_like(current, stored, where=where)


# -- applying ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One change a load makes, after everything was read and checked: ``apply`` it;
    ``undo`` restores what it changed (None: it cannot be undone, so it goes last)."""

    what: str  # "the optimizer", for messages
    path: str  # the part of the checkpoint it loads ("optimizer", "training/scheduler")
    apply: Callable[[], object]
    undo: Callable[[], object] | None = None


def apply_steps(steps: Sequence[Step]) -> None:
    """Apply a load's steps in order. If one raises (a live object refusing a state that
    passed every check: a custom scheduler, a module's hooks), every step applied so far
    and the failing one are undone, newest first, and ``LoadError`` names the step and
    says what could not be restored."""
    done: list[Step] = []
    for step in steps:
        try:
            step.apply()
        except Exception as exc:
            kept = [s.what for s in (step, *reversed(done)) if not _undo(s)]
            changed = (f"; {', '.join(kept)} may be partly changed" if kept
                       else "; nothing was changed")
            detail = exc.message if isinstance(exc, UCPError) else f"{type(exc).__name__}: {exc}"
            raise LoadError(f"{step.what} refused the checkpoint's state ({detail}){changed}",
                            path=step.path) from exc
        done.append(step)


def scheduler_step(scheduler: Any, state: Any) -> Step:
    """Loading ``state`` into ``scheduler`` (:func:`stateful_step` of
    ``training/scheduler``)."""
    return stateful_step(scheduler, state, "the scheduler", "training/scheduler")


def stateful_step(obj: Any, state: Any, what: str, path: str) -> Step:
    """Loading ``state`` into ``obj`` (anything with ``state_dict`` and
    ``load_state_dict``; ``what`` names it in messages, ``path`` is where its state is
    stored); undone by reloading a copy of its own state."""
    try:
        previous = copy.deepcopy(obj.state_dict())
    except Exception:  # a state that cannot be copied: the step cannot be undone
        return Step(what, path, lambda: obj.load_state_dict(state))
    return Step(what, path, lambda: obj.load_state_dict(state),
                lambda: obj.load_state_dict(previous))


def _undo(step: Step) -> bool:
    if step.undo is None:
        return False
    try:
        step.undo()
    except Exception:
        return False
    return True


__all__ = [
    "Device",
    "ModelPlan",
    "OptimizerPlan",
    "OptimizerView",
    "PathOrCheckpoint",
    "Step",
    "StoredArray",
    "apply_steps",
    "check_device",
    "check_state_shape",
    "group_values",
    "like",
    "opened",
    "optimizer_entries",
    "plan_model",
    "plan_optimizer",
    "plan_scheduler",
    "refuse_meta_parameters",
    "refuse_optimizer_with_assign",
    "saved_param_groups",
    "scheduler_step",
    "stored_tensors",
    "tree_to_torch",
    "value_like",
]

"""Save and load single-process PyTorch training state as a UCP checkpoint.

Layout (spec ucp-1.0.md section 14, R080-R084; tied tensors R108):

* ``model/<fqn>``: one array per tensor of ``model.state_dict()`` (parameters and
  buffers), ``attributes.ucp.role`` ``"parameter"`` or ``"buffer"``. A tensor held under
  several names (tied weights) is stored once, under the first of its names in
  ``state_dict`` order; the ``model`` group's ``attributes.ucp.aliases`` maps each other
  name to it. Non-tensor entries (a module's extra state) are JSON values of the
  ``model`` group, keyed by FQN. Names are taken inside ``torch.compile`` and
  (Distributed)DataParallel wrappers (no ``_orig_mod.`` / ``module.`` prefix).
* ``optimizer``: values ``type`` (the optimizer's fully qualified class name) and
  ``param_groups`` (every hyperparameter; ``params`` lists parameter FQNs, never torch's
  integer ids). ``optimizer/state/<fqn>/<name>`` holds every tensor of the per-parameter
  state (role ``"optimizer_state"``; any name); other per-parameter values are JSON
  values of the ``optimizer/state/<fqn>`` group.
* ``training``: values ``step`` and ``scheduler`` (``scheduler.state_dict()``), plus the
  entries of ``extra`` (tensors become arrays of role ``"training_state"``).

Naming optimizer parameters: torch numbers them in ``param_groups`` order; each number
is mapped to the parameter object and from there to its name in the model. A tied
parameter is named by the first of its names in ``model.state_dict()`` order: the name
it is stored under.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ucpformat import names
from ucpformat.errors import (
    InvalidValueError,
    KeyMismatchError,
    LoadError,
    ShapeMismatchError,
    TensorNotFoundError,
)
from ucpformat.reader import Checkpoint, open_checkpoint
from ucpformat.storage import Store
from ucpformat.torch.convert import from_numpy, to_numpy
from ucpformat.torch.reads import TensorRead, read_tensors
from ucpformat.writer import Group, SaveResult
from ucpformat.writer import save as _save

PathOrCheckpoint = str | os.PathLike[str] | Store | Checkpoint
Device = str | torch.device

_MAX_LISTED = 20


class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict`` (LR schedulers, ...)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


@dataclass(frozen=True)
class LoadResult:
    """What ``load`` restored and what did not match."""

    step: int | None
    #: Every value and tensor of ``training/`` (``step``, ``scheduler``, ``extra`` entries).
    training: dict[str, Any] = field(default_factory=dict)
    #: Free-form metadata given at save time.
    metadata: dict[str, Any] = field(default_factory=dict)
    #: ``model.state_dict()`` keys the checkpoint lacks (only with ``strict=False``).
    missing_keys: list[str] = field(default_factory=list)
    #: Checkpoint model tensors the model lacks (only with ``strict=False``).
    unexpected_keys: list[str] = field(default_factory=list)
    #: Checkpoint model tensors stored for the model's non-persistent buffers (such as a
    #: Hugging Face model's ``embeddings.position_ids``): not loaded, as the module never
    #: loads those, and not unexpected either.
    ignored_keys: list[str] = field(default_factory=list)
    #: Optimizer parameters (FQNs) the checkpoint has no param group for.
    missing_optimizer_params: list[str] = field(default_factory=list)
    #: Parameters (FQNs) in the checkpoint's param groups that the optimizer lacks.
    unexpected_optimizer_params: list[str] = field(default_factory=list)
    #: Bytes of stored objects read (metadata excluded).
    bytes_read: int = 0


def qualified_name(obj: object) -> str:
    """``module.QualName`` of an object's class: ``torch.optim.adamw.AdamW``."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# -- JSON values ----------------------------------------------------------------------


def to_json(value: Any, *, where: str) -> Any:
    """A non-tensor value made JSON-ready: tensors -> numbers/lists, int keys -> strings.

    What cannot be made JSON raises ``InvalidValueError`` naming ``where``; tuples become
    lists and integer mapping keys strings (``load`` turns both back, guided by the
    live object's own state).
    """
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if isinstance(k, int) and not isinstance(k, bool):
                key = str(k)
            elif isinstance(k, str):
                key = k
            else:
                raise InvalidValueError(
                    f"mapping key {k!r} ({type(k).__name__}) is neither a string nor an "
                    "integer", path=where,
                )
            if key in out:
                raise InvalidValueError(f"mapping keys {key!r} collide as JSON", path=where)
            out[key] = to_json(v, where=f"{where}.{key}")
        return out
    if isinstance(value, list | tuple):
        return [to_json(v, where=f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def like(template: Any, value: Any) -> Any:
    """``value`` (decoded JSON) shaped like ``template`` (the live object's own value).

    Lists become tuples, numbers tensors, and string keys integers where the template
    has them, so that a restored state equals the saved one type for type.
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


# -- naming parameters ----------------------------------------------------------------


def parameter_names(
    model: torch.nn.Module, state_keys: Sequence[str] | None = None
) -> dict[int, str]:
    """``id(parameter)`` -> its FQN; a tied parameter gets its first name in state_dict order."""
    keys = list(model.state_dict().keys()) if state_keys is None else list(state_keys)
    order = {k: i for i, k in enumerate(keys)}
    best: dict[int, tuple[int, str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        rank = order.get(fqn)
        if rank is None:
            continue
        current = best.get(id(param))
        if current is None or rank < current[0]:
            best[id(param)] = (rank, fqn)
    return {k: v[1] for k, v in best.items()}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``torch.compile`` and (Distributed)DataParallel wrappers.

    Their ``_orig_mod.`` and ``module.`` prefixes are not part of a tensor's name
    (UCP-1.0-R014); the wrapped and the bare model hold the same parameter objects.
    """
    wrappers = tuple(
        cls for cls in (getattr(torch.nn.parallel, "DistributedDataParallel", None),
                        getattr(torch.nn, "DataParallel", None))
        if isinstance(cls, type)
    )
    while True:
        original = getattr(model, "_orig_mod", None)
        if type(model).__name__ == "OptimizedModule" and isinstance(original, torch.nn.Module):
            model = original
        elif wrappers and isinstance(model, wrappers):
            inner = model.module
            assert isinstance(inner, torch.nn.Module)
            model = inner
        else:
            return model


def _live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under every one of its names."""
    live: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    live.update(model.named_buffers(remove_duplicate=False))
    return live


def tied_aliases(model: torch.nn.Module, state_keys: Sequence[str]) -> dict[str, str]:
    """alias -> target for tied tensors: a state_dict name of a tensor that an earlier
    name (in state_dict order) already holds maps to that earlier name (UCP-1.0-R108)."""
    live = _live_tensors(model)
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key in state_keys:
        tensor = live.get(key)
        if tensor is None:
            continue
        if id(tensor) in first:
            aliases[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return aliases


def _describe(param: torch.Tensor) -> str:
    return f"a {param.dtype} tensor of shape {list(param.shape)}"


def shared_aliases(tensors: Mapping[str, Any]) -> dict[str, str]:
    """alias -> first name, for the names of a mapping that hold the same tensor: the same
    memory viewed the same way (a tied weight in ``model.state_dict()``, or one tensor
    given twice). Such a tensor is stored once (UCP-1.0-R108); overlapping but different
    views are separate tensors."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided \
                or value.is_meta or value.numel() == 0:
            continue
        view = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(),
                tuple(value.shape), value.stride(), value.dtype)
        if view in first:
            aliases[name] = first[view]
        else:
            first[view] = name
    return aliases


def optimizer_fqns(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | Mapping[str, Any] | None
) -> list[list[str]]:
    """The FQN of every parameter of every param group, in the optimizer's order.

    Names come from ``model`` (a module, or a mapping of names to the parameter objects,
    such as ``dict(model.named_parameters())``); otherwise from the ``param_names`` torch
    keeps in each group when the optimizer was built from ``named_parameters()``.
    """
    module = model if isinstance(model, torch.nn.Module) else None
    if module is not None:
        by_id = parameter_names(unwrap(module))
    else:
        mapping: Mapping[str, Any] = model if isinstance(model, Mapping) else {}
        by_id = {id(t): k for k, t in reversed(list(mapping.items()))}
    out: list[list[str]] = []
    for gi, group in enumerate(optimizer.param_groups):
        group_names = group.get("param_names")
        fqns: list[str] = []
        for pi, param in enumerate(group["params"]):
            fqn = by_id.get(id(param))
            if fqn is None and module is None and isinstance(group_names, list | tuple):
                fqn = str(group_names[pi])
            if fqn is None:
                where = f"optimizer param_groups[{gi}].params[{pi}]"
                if module is None:
                    raise InvalidValueError(
                        f"{where} ({_describe(param)}) has no name: pass model= to name "
                        "the optimizer's parameters",
                    )
                raise InvalidValueError(
                    f"{where} ({_describe(param)}) is not a parameter of the model (not in "
                    "model.named_parameters() under a state_dict key); every parameter "
                    "the optimizer holds must belong to the model",
                )
            fqns.append(fqn)
        out.append(fqns)
    return out


# -- save -----------------------------------------------------------------------------


def _tree_to_numpy(value: Any, *, where: str) -> Any:
    """Tensors -> numpy arrays (any depth of mappings); other values -> JSON-ready."""
    if isinstance(value, torch.Tensor):
        return to_numpy(value, name=where)
    if isinstance(value, Mapping):
        if not any(isinstance(v, torch.Tensor | Mapping) for v in value.values()):
            return to_json(value, where=where)
        return {str(k): _tree_to_numpy(v, where=f"{where}/{k}") for k, v in value.items()}
    if isinstance(value, list | tuple) and _holds_tensor(value):
        raise InvalidValueError(
            "tensors inside a list cannot be stored as arrays; use a mapping "
            "({'0': t0, '1': t1})", path=where,
        )
    return to_json(value, where=where)


def state_of(
    *,
    model: torch.nn.Module | Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The mapping ``ucpformat.save`` writes, and the role of each array path."""
    state: dict[str, Any] = {}
    roles: dict[str, str] = {}
    if isinstance(model, torch.nn.Module):
        model = unwrap(model)
        sd: Mapping[str, Any] = model.state_dict()
        params: set[str] | None = {
            fqn for fqn, _ in model.named_parameters(remove_duplicate=False)}
        aliases = tied_aliases(model, list(sd))
    elif isinstance(model, Mapping):  # a state dict: which tensors are parameters is unknown
        sd, params, aliases = model, None, shared_aliases(model)
    elif model is not None:
        raise InvalidValueError(
            f"model is a {type(model).__name__}: pass an nn.Module, or a mapping of names to "
            "tensors (a state dict)", path="model",
        )
    if model is not None:
        group = Group(ucp={"aliases": aliases} if aliases else None)
        for fqn, value in sd.items():
            where = f"model/{fqn}"
            if not isinstance(fqn, str):
                raise InvalidValueError(f"tensor names are strings, got {fqn!r}", path="model")
            if fqn in aliases:  # tied: stored once, under its first name
                continue
            if isinstance(value, torch.Tensor):
                group[fqn] = to_numpy(value, name=where)
                if params is not None:
                    roles[names.path_of("model", fqn)] = \
                        "parameter" if fqn in params else "buffer"
            else:
                group[fqn] = to_json(value, where=where)
        state["model"] = group
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(optimizer, model)
    training = Group()
    if step is not None:
        training["step"] = int(step)
    if scheduler is not None:
        training["scheduler"] = to_json(scheduler.state_dict(), where="training/scheduler")
    for key, value in (extra or {}).items():
        if key in training:
            raise InvalidValueError(f"extra[{key!r}] would replace training/{key}",
                                    path="training")
        training[key] = _tree_to_numpy(value, where=f"training/{key}")
    if training:
        state["training"] = training
    return state, roles


def _optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | Mapping[str, Any] | None
) -> dict[str, Any]:
    osd = optimizer.state_dict()
    fqns = optimizer_fqns(optimizer, model)
    id_to_fqn: dict[Any, str] = {}
    param_groups: list[dict[str, Any]] = []
    for gi, (packed, group_fqns) in enumerate(zip(osd["param_groups"], fqns, strict=True)):
        for pid, fqn in zip(packed["params"], group_fqns, strict=True):
            id_to_fqn[pid] = fqn
        group = {
            k: to_json(v, where=f"optimizer/param_groups[{gi}].{k}")
            for k, v in packed.items()
            if k != "params"
        }
        group["params"] = group_fqns
        param_groups.append(group)
    per_param = Group()
    for pid, entries in osd["state"].items():
        if pid not in id_to_fqn:
            raise InvalidValueError(
                f"the optimizer holds state for parameter id {pid!r}, which no param group "
                "lists", path="optimizer/state",
            )
        fqn = id_to_fqn[pid]
        entry = Group()
        for key, value in entries.items():
            where = f"optimizer/state/{fqn}/{key}"
            if not isinstance(key, str):
                raise InvalidValueError(f"state names must be strings, got {key!r}",
                                        path=f"optimizer/state/{fqn}")
            if isinstance(value, torch.Tensor):
                entry[key] = to_numpy(value, name=where)
            else:
                if _holds_tensor(value):
                    raise InvalidValueError(
                        "tensors nested in lists or mappings cannot be stored as optimizer "
                        "state (only tensors and JSON values)", tensor=where,
                    )
                entry[key] = to_json(value, where=where)
        per_param[fqn] = entry
    return {
        "type": qualified_name(optimizer),
        "param_groups": param_groups,
        "state": per_param,
    }


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensor(v) for v in value)
    return False


def save(
    path: str | os.PathLike[str] | Store,
    *,
    model: torch.nn.Module | Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    **save_kwargs: Any,
) -> SaveResult:
    """Save a model, optimizer, LR scheduler, step and extra training state.

    ``model`` is an ``nn.Module`` (its ``state_dict()``, parameters and buffers told
    apart by role) or a mapping of names to tensors, a state dict (stored as it is, with
    no role). ``extra`` entries go into ``training/`` (tensors as arrays; other values as
    JSON). ``save_kwargs`` go to ``ucpformat.save`` (``overwrite``, ``compression``, ...).
    Tensors on other devices are copied to the CPU one by one.
    """
    state, roles = state_of(
        model=model, optimizer=optimizer, scheduler=scheduler, step=step, extra=extra
    )
    user_hook = save_kwargs.pop("array_attributes", None)

    def attributes(node_path: str, array: np.ndarray[Any, Any]) -> Mapping[str, Any]:
        top = node_path.partition("/")[0]
        role = roles.get(node_path) or {
            "optimizer": "optimizer_state", "training": "training_state", "model": None
        }.get(top, "other")  # a state dict's tensor: parameter or buffer, unknown
        attrs: dict[str, Any] = dict(user_hook(node_path, array) or {}) if user_hook else {}
        if role is not None:
            attrs["ucp"] = {"role": role, **dict(attrs.get("ucp", {}))}
        return attrs

    return _save(path, state, metadata=metadata, array_attributes=attributes, **save_kwargs)


# -- load -----------------------------------------------------------------------------


@contextmanager
def _opened(path: PathOrCheckpoint) -> Iterator[Checkpoint]:
    if isinstance(path, Checkpoint):
        yield path
        return
    ckpt = open_checkpoint(path)
    try:
        yield ckpt
    finally:
        ckpt.close()


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


def _refuse_model_mismatch(
    missing: Sequence[str], unexpected: Sequence[str], *, state_dict: str, path: str
) -> None:
    _refuse_mismatch(f"the checkpoint's model tensors differ from {state_dict}",
                     ("missing from the checkpoint: ", missing),
                     ("not in the model: ", unexpected), path=path)


def _refuse_optimizer_mismatch(missing: Sequence[str], unexpected: Sequence[str]) -> None:
    _refuse_mismatch("the optimizer's parameters differ from the checkpoint's",
                     ("the checkpoint has no param group for ", missing),
                     ("the optimizer does not hold ", unexpected), path="optimizer")


def _children(ckpt: Checkpoint, group: str) -> dict[str, str]:
    """Logical name -> node path of the arrays directly in ``group``."""
    start = group + "/"
    out: dict[str, str] = {}
    for path in ckpt.arrays:
        if path.startswith(start) and "/" not in path[len(start):]:
            out[names.unescape(path[len(start):])] = path
    return out


def _read_new(
    ckpt: Checkpoint, paths: Sequence[str], device: Device | None = None
) -> list[torch.Tensor]:
    """New tensors of the stored tensors at ``paths``, read as one batch."""
    return read_tensors(ckpt, [TensorRead(p, device=device) for p in paths])


def _values(ckpt: Checkpoint, group: str) -> dict[str, Any]:
    return ckpt.values(group) if group in ckpt.groups else {}


@dataclass
class _ModelPlan:
    copies: list[tuple[str, str, torch.Tensor]]  # (fqn, node path, live tensor)
    fallback_arrays: dict[str, str]  # fqn -> node path, loaded via model.load_state_dict
    fallback_values: dict[str, Any]
    missing: list[str]
    unexpected: list[str]
    ignored: list[str] = field(default_factory=list)


def _plan_model(ckpt: Checkpoint, model: torch.nn.Module, strict: bool) -> _ModelPlan:
    if "model" not in ckpt.groups and strict:
        raise KeyMismatchError("the checkpoint has no model group; pass strict=False to "
                               "load the rest anyway", path=ckpt.location)
    stored = _children(ckpt, "model")
    group = ckpt.groups.get("model")
    for alias, target in (group.ucp.get("aliases", {}) if group else {}).items():
        if isinstance(target, str) and target in stored and alias not in stored:
            stored[str(alias)] = stored[target]  # a tied tensor stored once (R108)
    values = _values(ckpt, "model")
    sd = model.state_dict()
    missing = [k for k in sd if k not in stored and k not in values]
    # a stored non-persistent buffer is the module's own business (it never loads one)
    non_persistent = {n for n, _ in model.named_buffers(remove_duplicate=False)} - set(sd)
    ignored = [k for k in stored if k not in sd and k in non_persistent]
    unexpected = [k for k in [*stored, *values] if k not in sd and k not in non_persistent]
    if strict:
        _refuse_model_mismatch(missing, unexpected, state_dict="model.state_dict()",
                               path=ckpt.location)
    live = _live_tensors(model)
    copied: set[tuple[str, int]] = set()  # a tied tensor is read and copied once
    plan = _ModelPlan([], {}, {}, missing, unexpected, ignored)
    for fqn, current in sd.items():
        if fqn in values:  # extra state stored as JSON: shaped like the module's own
            plan.fallback_values[fqn] = like(current, values[fqn])
            continue
        path = stored.get(fqn)
        if path is None:
            continue
        if not isinstance(current, torch.Tensor):
            raise LoadError(
                f"the checkpoint stores a tensor, the model's state_dict has a "
                f"{type(current).__name__}", tensor=path,
            )
        shape = ckpt.arrays[path].shape
        if tuple(current.shape) != shape:
            raise ShapeMismatchError(
                f"stored shape {list(shape)} differs from the model's {list(current.shape)}",
                tensor=path,
            )
        target = live.get(fqn)
        if (
            target is not None
            and (target.shape, target.dtype) == (current.shape, current.dtype)
            and target.data_ptr() == current.data_ptr()
        ):
            if (path, id(target)) not in copied:
                copied.add((path, id(target)))
                plan.copies.append((fqn, path, target))
        else:  # a state_dict hook made this entry: let the module load it
            plan.fallback_arrays[fqn] = path
    return plan


def _apply_model(ckpt: Checkpoint, model: torch.nn.Module, plan: _ModelPlan) -> None:
    # Straight into the live tensors' memory where it can be (CPU, contiguous, the stored
    # type), else read and copy_: one batch either way.
    read_tensors(ckpt, [TensorRead(path, target) for _fqn, path, target in plan.copies])
    if plan.fallback_arrays or plan.fallback_values:
        keys = list(plan.fallback_arrays)
        values = _read_new(ckpt, [plan.fallback_arrays[k] for k in keys])
        rest: dict[str, Any] = dict(zip(keys, values, strict=True))
        rest.update(plan.fallback_values)
        model.load_state_dict(rest, strict=False)


@dataclass
class _OptimizerPlan:
    state_dict: dict[str, Any] | None  # None: nothing to load
    missing: list[str]
    unexpected: list[str]


def _optimizer_entries(ckpt: Checkpoint) -> dict[str, dict[str, Any]]:
    """FQN -> {state name: node path (arrays) or value (JSON)} of the stored state."""
    out: dict[str, dict[str, Any]] = {}
    for fqn, value in _values(ckpt, "optimizer/state").items():
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
            entry[names.unescape(parts[3])] = _ArrayRef(path)
    return out


@dataclass(frozen=True)
class _ArrayRef:
    path: str



def saved_param_groups(
    ckpt: Checkpoint, optimizer: torch.optim.Optimizer, *, strict: bool
) -> list[Mapping[str, Any]]:
    """The param groups of a checkpoint's optimizer, checked (its type too when ``strict``)."""
    saved: dict[str, Any] = ckpt.values("optimizer")
    saved_type = saved.get("type")  # optional (R081): DCP and the importers do not know it
    if strict and saved_type is not None and saved_type != qualified_name(optimizer):
        raise LoadError(
            f"the checkpoint holds the state of a {saved_type!r} optimizer, not of a "
            f"{qualified_name(optimizer)!r}; pass strict=False to load it anyway",
            path="optimizer",
        )
    saved_groups = saved.get("param_groups", [])
    if not isinstance(saved_groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in saved_groups
    ):
        raise LoadError("optimizer param_groups is missing or malformed",
                        rule="UCP-1.0-R081", path="optimizer")
    return saved_groups

def _plan_optimizer(
    ckpt: Checkpoint,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module | None,
    strict: bool,
) -> _OptimizerPlan:
    if "optimizer" not in ckpt.groups:
        if strict:
            raise KeyMismatchError("the checkpoint has no optimizer group; pass strict=False "
                                   "to load the rest anyway", path=ckpt.location)
        everything = [f for group in optimizer_fqns(optimizer, model) for f in group]
        return _OptimizerPlan(None, everything, [])
    saved_groups = saved_param_groups(ckpt, optimizer, strict=strict)
    group_of: dict[str, int] = {}
    for gi, g in enumerate(saved_groups):
        for fqn in g["params"]:
            group_of[str(fqn)] = gi
    fqns = optimizer_fqns(optimizer, model)
    current = [f for group in fqns for f in group]
    current_set = set(current)
    missing = [f for f in current if f not in group_of]
    unexpected = [f for f in group_of if f not in current_set]
    if strict:
        _refuse_optimizer_mismatch(missing, unexpected)
    current_sd = optimizer.state_dict()
    entries = _optimizer_entries(ckpt)
    groups: list[dict[str, Any]] = []
    state: dict[Any, dict[str, Any]] = {}
    for gi, (packed, group_fqns) in enumerate(
        zip(current_sd["param_groups"], fqns, strict=True)
    ):
        sources = sorted({group_of[f] for f in group_fqns if f in group_of})
        if len(sources) > 1:
            raise LoadError(
                f"param group {gi} of the optimizer holds parameters of the checkpoint's "
                f"param groups {sources}, whose hyperparameters may differ",
                path="optimizer",
            )
        if sources:
            hyper = {
                k: like(packed.get(k), v)
                for k, v in saved_groups[sources[0]].items()
                if k != "params"
            }
        else:
            hyper = {k: v for k, v in packed.items() if k != "params"}
        hyper["params"] = packed["params"]
        groups.append(hyper)
        live = optimizer.param_groups[gi]["params"]
        for fqn, pid, param in zip(group_fqns, packed["params"], live, strict=True):
            entry = entries.get(fqn)
            if fqn not in group_of:  # strict=False: keep what the optimizer has
                if pid in current_sd["state"]:
                    state[pid] = current_sd["state"][pid]
            elif entry is not None:
                _check_state_shapes(ckpt, fqn, entry, tuple(param.shape))
                state[pid] = dict(entry)
    return _OptimizerPlan({"state": state, "param_groups": groups}, missing, unexpected)


def _check_state_shapes(
    ckpt: Checkpoint, fqn: str, entry: Mapping[str, Any], shape: tuple[int, ...]
) -> None:
    """A per-element state (stored with its parameter's stored shape) must fit the live
    parameter; other shapes (0-d steps, factored moments) are the optimizer's business."""
    stored_param = ckpt.arrays.get(names.path_of("model", fqn))
    for value in entry.values():
        if not isinstance(value, _ArrayRef):
            continue
        stored = ckpt.arrays[value.path].shape
        if stored_param is not None and stored == stored_param.shape and stored != shape:
            raise ShapeMismatchError(
                f"stored shape {list(stored)} differs from the optimizer's parameter "
                f"{fqn!r} of shape {list(shape)}",
                tensor=value.path,
            )


def _read_optimizer_arrays(ckpt: Checkpoint, plan: _OptimizerPlan) -> None:
    if plan.state_dict is None:
        return
    refs = [
        (entry, key, value.path)
        for entry in plan.state_dict["state"].values()
        for key, value in entry.items()
        if isinstance(value, _ArrayRef)
    ]
    for (entry, key, _), tensor in zip(
        refs, _read_new(ckpt, [path for _, _, path in refs]), strict=True
    ):
        entry[key] = tensor


def _to_torch(value: Any, device: Device | None, where: str) -> Any:
    if isinstance(value, np.ndarray):
        return from_numpy(value, name=where, device=device)
    if isinstance(value, dict):
        return {k: _to_torch(v, device, f"{where}/{k}") for k, v in value.items()}
    return value


def load(
    path: PathOrCheckpoint,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    strict: bool = True,
    map_location: Device = "cpu",
) -> LoadResult:
    """Load a checkpoint in place into the given objects; read nothing else.

    The model's parameters and buffers are copied into (dtype and device kept). The
    optimizer's state is matched by parameter FQN and handed to
    ``optimizer.load_state_dict`` with the optimizer's current integer ids. The
    scheduler is restored from ``training/scheduler``. Every name and shape is checked
    before anything is modified (``KeyMismatchError``, ``ShapeMismatchError``);
    ``strict=False`` loads what matches and lists the rest in the result. Tensors of
    ``training/`` come back on ``map_location``.
    """
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise LoadError(f"model is a {type(model).__name__}, not an nn.Module to load "
                            "into; for a new mapping of tensors use load_file or "
                            "load_state_dict", path="model")
        model = unwrap(model)
    with _opened(path) as ckpt:
        start = ckpt.stats.bytes_read
        model_plan = _plan_model(ckpt, model, strict) if model is not None else None
        opt_plan = None
        if optimizer is not None:
            opt_plan = _plan_optimizer(ckpt, optimizer, model, strict)
        training_values = _values(ckpt, "training")
        if scheduler is not None and "scheduler" not in training_values and strict:
            raise KeyMismatchError("the checkpoint holds no scheduler state "
                                   "(training/scheduler); pass strict=False to load the rest "
                                   "anyway", path=ckpt.location)
        # Everything is checked: now read and modify.
        if optimizer is not None and opt_plan is not None:
            _read_optimizer_arrays(ckpt, opt_plan)
        training = ckpt.to_dict("training") if "training" in ckpt.groups else {}
        if model is not None and model_plan is not None:
            _apply_model(ckpt, model, model_plan)
        if optimizer is not None and opt_plan is not None and opt_plan.state_dict is not None:
            optimizer.load_state_dict(opt_plan.state_dict)
        if scheduler is not None and "scheduler" in training_values:
            scheduler.load_state_dict(like(scheduler.state_dict(), training_values["scheduler"]))
        step = training.get("step")
        return LoadResult(
            step=int(step) if isinstance(step, int) else None,
            training=_to_torch(training, map_location, "training"),
            metadata=ckpt.metadata,
            missing_keys=model_plan.missing if model_plan else [],
            unexpected_keys=model_plan.unexpected if model_plan else [],
            ignored_keys=model_plan.ignored if model_plan else [],
            missing_optimizer_params=opt_plan.missing if opt_plan else [],
            unexpected_optimizer_params=opt_plan.unexpected if opt_plan else [],
            bytes_read=ckpt.stats.bytes_read - start,
        )


def load_state_dict(
    path: PathOrCheckpoint, *, prefix: str = "model", map_location: Device = "cpu"
) -> dict[str, torch.Tensor]:
    """A new state dict of the tensors under group ``prefix`` (a node path), keyed by name.

    Keys are the logical names relative to ``prefix`` (FQNs for ``model``), joined with
    ``/`` below it; a tied tensor's aliases map to the same tensor object, as in
    ``model.state_dict()``. Non-tensor values (extra state) are not included. The same as
    ``load_file(path, map_location, prefix=prefix)``.
    """
    from ucpformat.torch.flat import load_file

    return load_file(path, map_location, prefix=prefix)


def read_optimizer_state(
    path: PathOrCheckpoint, *, map_location: Device = "cpu"
) -> dict[str, Any]:
    """The stored optimizer state keyed by FQN: ``type``, ``param_groups``, ``state``.

    Unlike ``optimizer.state_dict()``, ``param_groups[i]["params"]`` and the keys of
    ``state`` are parameter FQNs; tuples come back as lists.
    """
    with _opened(path) as ckpt:
        if "optimizer" not in ckpt.groups:
            raise TensorNotFoundError("the checkpoint has no optimizer group",
                                      path=ckpt.location)
        out: dict[str, Any] = _to_torch(ckpt.to_dict("optimizer"), map_location, "optimizer")
        out.setdefault("state", {})
        return out

"""Save and load single-process PyTorch training state as a UCP checkpoint.

Layout (spec ucp-1.0.md section 14, UCP-1.0-R080 to UCP-1.0-R084; tied tensors UCP-1.0-R108):

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
* ``training`` (what a resumed run needs besides model and optimizer, UCP-1.0-R083):
  values ``step`` and ``scheduler`` (``scheduler.state_dict()``), plus the
  entries of ``extra`` (tensors become arrays of role ``"training_state"``).

Naming optimizer parameters: torch numbers them in ``param_groups`` order; each number
is mapped to the parameter object and from there to its name in the model. A tied
parameter is named by the first of its names in ``model.state_dict()`` order: the name
it is stored under.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ucpformat.checkpoint.reader import Checkpoint
from ucpformat.checkpoint.tree import ArrayValue, Group
from ucpformat.checkpoint.writer import SaveResult
from ucpformat.checkpoint.writer import save as _save
from ucpformat.errors import (
    FormatError,
    InvalidValueError,
    KeyMismatchError,
    LoadError,
    TensorNotFoundError,
)
from ucpformat.format import names
from ucpformat.store import Store
from ucpformat.torch.assign import (
    AssignGroup,
    assign_groups,
    assign_step,
    assigned_state,
    live_tensors,
    still_on_meta,
)
from ucpformat.torch.load_plan import (
    Device,
    OptimizerView,
    PathOrCheckpoint,
    Step,
    apply_steps,
    check_device,
    opened,
    plan_model,
    plan_optimizer,
    plan_scheduler,
    refuse_optimizer_with_assign,
    scheduler_step,
    tree_to_torch,
)
from ucpformat.torch.numpy_bridge import to_numpy
from ucpformat.torch.reads import StagedReads, TensorRead, named, read_tensors
from ucpformat.torch.rng import from_layout as rng_from_layout
from ucpformat.torch.rng import rng_state, rng_step
from ucpformat.torch.rng import to_layout as rng_layout
from ucpformat.torch.staging import Staging, deferred_of


class MetaTensorWarning(UserWarning):
    """A load left some of the model's tensors on the meta device (:attr:`LoadResult.on_meta`)."""


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
    #: The random-number generators' state stored in ``training/rng`` (the form of
    #: :func:`ucpformat.torch.rng_state`), or None; ``load(..., rng=True)`` restored it.
    rng: dict[str, Any] | None = None
    #: The model's parameters and buffers still on the meta device after the load (the
    #: checkpoint has nothing for them: non-persistent buffers, missing keys with
    #: ``strict=False``); a warning names them too.
    on_meta: list[str] = field(default_factory=list)
    #: This rank's own stored state, ``training/ranks/<rank>`` (spec UCP-1.0-R086), as
    #: tensors and values, or None where the checkpoint holds none for it (a distributed
    #: load; ``load_distributed(rng=..., rank_state=...)`` restored what was asked).
    rank_state: dict[str, Any] | None = None
    #: The number of processes whose per-rank state the checkpoint holds, or None.
    saved_world_size: int | None = None
    #: What a load of per-rank state could not restore exactly (each also a
    #: ``RankStateWarning``): no state for this rank, another world size (UCP-1.0-R087).
    rank_notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, ckpt: Checkpoint, training: dict[str, Any], model_plan: Any,
           optimizer_plan: Any, *, bytes_read: int, model: torch.nn.Module | None,
           rng: dict[str, Any] | None = None) -> LoadResult:
        """The result of a load planned as ``model_plan`` and ``optimizer_plan`` (either
        None where nothing of it was loaded), every step of it applied."""
        step = training.get("step")
        return cls(
            step=int(step) if isinstance(step, int) else None,
            training=training,
            metadata=ckpt.metadata,
            missing_keys=model_plan.missing if model_plan else [],
            unexpected_keys=model_plan.unexpected if model_plan else [],
            ignored_keys=model_plan.ignored if model_plan else [],
            missing_optimizer_params=optimizer_plan.missing if optimizer_plan else [],
            unexpected_optimizer_params=optimizer_plan.unexpected if optimizer_plan else [],
            bytes_read=bytes_read,
            rng=rng,
            on_meta=meta_left(model),
        )


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


def tied_aliases(model: torch.nn.Module, state_keys: Sequence[str]) -> dict[str, str]:
    """alias -> target for tied tensors: a state_dict name of a tensor that an earlier
    name (in state_dict order) already holds maps to that earlier name (UCP-1.0-R108)."""
    live = live_tensors(model)
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


#: What a save stores for a tensor: a numpy array, or a placeholder that staging fills
#: (arguments: the tensor, where it is stored).
ArrayOf = Callable[[torch.Tensor, str], ArrayValue]


def numpy_of(tensor: torch.Tensor, where: str) -> ArrayValue:
    """The default :data:`ArrayOf`: the tensor's values as numpy (a view on the CPU)."""
    return to_numpy(tensor, name=where)


def _tree_to_numpy(value: Any, *, where: str, convert: ArrayOf = numpy_of) -> Any:
    """Tensors -> numpy arrays (any depth of mappings; numpy arrays stay arrays, a
    ``Group`` stays a group, as ``ucpformat.save`` takes them); other values ->
    JSON-ready."""
    if isinstance(value, torch.Tensor):
        return convert(value, where)
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, Group):
        return Group({str(k): _tree_to_numpy(v, where=f"{where}/{k}", convert=convert)
                      for k, v in value.items()}, ucp=value.ucp)
    if isinstance(value, Mapping):
        if not any(isinstance(v, torch.Tensor | np.ndarray | Mapping) for v in value.values()):
            return to_json(value, where=where)
        return {str(k): _tree_to_numpy(v, where=f"{where}/{k}", convert=convert)
                for k, v in value.items()}
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
    rng: bool | Mapping[str, Any] = False,
    convert: ArrayOf = numpy_of,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The mapping ``ucpformat.save`` writes, and the role of each array path; each
    tensor becomes ``convert(tensor, where)``."""
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
                group[fqn] = convert(value, where)
                if params is not None:
                    roles[names.path_of("model", fqn)] = \
                        "parameter" if fqn in params else "buffer"
            else:
                group[fqn] = to_json(value, where=where)
        state["model"] = group
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(optimizer, model, convert)
    training = Group()
    if step is not None:
        training["step"] = int(step)
    if scheduler is not None:
        training["scheduler"] = to_json(scheduler.state_dict(), where="training/scheduler")
    if rng is not False:
        training["rng"] = rng_layout(rng_state() if rng is True else rng)
    for key, value in (extra or {}).items():
        if key in training:
            raise InvalidValueError(f"extra[{key!r}] would replace training/{key}",
                                    path="training")
        training[key] = _tree_to_numpy(value, where=f"training/{key}", convert=convert)
    if training:
        state["training"] = training
    return state, roles


def _optimizer_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | Mapping[str, Any] | None,
    convert: ArrayOf = numpy_of,
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
                entry[key] = convert(value, where)
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
    rng: bool | Mapping[str, Any] = False,
    staging: Staging | None = None,
    **save_kwargs: Any,
) -> SaveResult:
    """Save a model, optimizer, LR scheduler, step and extra training state.

    ``rng=True`` stores the random-number generators' state (:func:`rng_state`: Python's
    ``random``, NumPy's, torch's CPU and CUDA ones) in ``training/rng`` (spec UCP-1.0-R085); a
    mapping of that form (``rng_state(generators={...})``) stores that state instead.

    ``model`` is an ``nn.Module`` (its ``state_dict()``, parameters and buffers told
    apart by role) or a mapping of names to tensors, a state dict (stored as it is, with
    no role). ``extra`` entries go into ``training/`` (tensors as arrays; other values as
    JSON). ``save_kwargs`` go to ``ucpformat.save`` (``overwrite``, ``compression``, ...).

    Tensors on other devices (a GPU) are copied to host memory through a bounded pool of
    (pinned) buffers, the next one while the previous one is written
    (:mod:`ucpformat.torch.staging`; ``staging`` sets the pool, default
    :func:`~ucpformat.torch.staging.default_pool`). CPU tensors are written from their
    own memory.
    """
    how = staging if staging is not None else Staging()
    staged: dict[str, torch.Tensor] = {}

    def convert(tensor: torch.Tensor, where: str) -> ArrayValue:
        if not how.stages(tensor):
            return to_numpy(tensor, name=where)
        if type(tensor).__name__ == "DTensor":  # refused as the plain path refuses it
            to_numpy(tensor, name=where)
        staged[where] = tensor
        return deferred_of(where, tensor)

    state, roles = state_of(
        model=model, optimizer=optimizer, scheduler=scheduler, step=step, extra=extra, rng=rng,
        convert=convert,
    )
    user_hook = save_kwargs.pop("array_attributes", None)

    def attributes(node_path: str, array: ArrayValue) -> Mapping[str, Any]:
        top = node_path.partition("/")[0]
        role = roles.get(node_path) or {
            "optimizer": "optimizer_state", "training": "training_state", "model": None
        }.get(top, "other")  # a state dict's tensor: parameter or buffer, unknown
        attrs: dict[str, Any] = dict(user_hook(node_path, array) or {}) if user_hook else {}
        if role is not None:
            attrs["ucp"] = {"role": role, **dict(attrs.get("ucp", {}))}
        return attrs

    feed = how.stager(staged) if staged else None
    return _save(path, state, metadata=metadata, array_attributes=attributes, feed=feed,
                 **save_kwargs)


# -- load -----------------------------------------------------------------------------


def _optimizer_view(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None
) -> tuple[OptimizerView, dict[str, Any]]:
    """The planner's view of ``optimizer`` (keyed by torch's integer ids), and its state
    dict (what restores it)."""
    osd = optimizer.state_dict()
    fqns = optimizer_fqns(optimizer, model)
    params = {
        fqn: param
        for group, group_fqns in zip(optimizer.param_groups, fqns, strict=True)
        for fqn, param in zip(group_fqns, group["params"], strict=True)
    }
    view = OptimizerView(qualified_name(optimizer), osd["param_groups"], fqns, osd["state"],
                         params)
    return view, osd


def load(
    path: PathOrCheckpoint,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    strict: bool = True,
    map_location: Device = "cpu",
    rng: bool = False,
    assign: bool = False,
    in_place: bool = False,
) -> LoadResult:
    """Load a checkpoint into the given objects; read nothing else.

    The model's parameters and buffers get the stored values, keeping their dtype, device
    and identity (one that no other tensor sees takes the checked staging memory, as
    ``module.to()`` gives new memory; any other is copied into: docs/torch.md); with
    ``assign``, replaced by new tensors of the checkpoint's dtype on ``map_location``
    (:mod:`ucpformat.torch.assign`: how a model built on the meta device is loaded; a
    meta tensor is refused without it). The optimizer's state is matched by parameter
    FQN and handed to ``optimizer.load_state_dict`` with the optimizer's current integer
    ids. The scheduler is restored from ``training/scheduler``. Every name, shape and
    stored value is checked (``KeyMismatchError``, ``ShapeMismatchError``, ``LoadError``)
    and every tensor read, each chunk's checksum checked, before anything is modified: a
    load that fails changes nothing. ``in_place`` reads straight into the model's tensors
    instead (no staging copy): faster and lighter, but a damaged or missing chunk then
    leaves the model partly changed, and the error says so and names the tensors.
    ``strict=False`` loads what matches and lists the rest in the result. Tensors of
    ``training/`` come back on ``map_location``.

    ``rng=True`` restores the random-number generators from ``training/rng`` (what
    ``save(..., rng=True)`` stored; :func:`set_rng_state`, strict as the load); the
    result's ``rng`` holds the stored state either way, for generators of your own.
    """
    check_device(map_location)
    refuse_optimizer_with_assign(assign, optimizer)
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise LoadError(f"model is a {type(model).__name__}, not an nn.Module to load "
                            "into; for a new mapping of tensors use load_file or "
                            "load_state_dict", path="model")
        model = unwrap(model)
    with opened(path) as ckpt:
        start = ckpt.stats.bytes_read
        model_plan = None
        copies: list[tuple[str, torch.Tensor]] = []
        hooked: dict[str, str] = {}
        groups: list[AssignGroup] = []
        if model is not None:
            sd = model.state_dict()
            model_plan = plan_model(ckpt, sd, strict=strict, owner="model.state_dict()",
                                    skip=non_persistent_buffers(model, sd), assign=assign)
            if assign:
                groups = assign_groups(live_tensors(model), model_plan.tensors)
            else:
                copies, hooked = _model_targets(model, sd, model_plan.tensors)
            # its tensors share the model's memory: a staged tensor may take a target's
            # memory only if nothing else holds it (reads.can_take_memory)
            del sd
        opt_plan = previous = None
        if optimizer is not None:
            view, previous = _optimizer_view(optimizer, model)
            opt_plan = plan_optimizer(ckpt, view, strict=strict)
        load_scheduler, scheduler_state = (
            plan_scheduler(ckpt, scheduler.state_dict(), strict=strict)
            if scheduler is not None else (False, None)
        )
        if rng and strict and "training/rng" not in ckpt.groups:
            raise KeyMismatchError("the checkpoint holds no random-number generator state "
                                   "(training/rng); pass strict=False to load the rest "
                                   "anyway", path=ckpt.location)
        # Everything is checked: read it all as one batch, into staging for the model's
        # own tensors (copied last; in place: into them) and into new tensors for the rest.
        arrays = opt_plan.stored_arrays() if opt_plan else []
        hooked_keys = list(hooked)
        model_reads = (
            [TensorRead(g.path, device=map_location) for g in groups]
            + [TensorRead(p, target) for p, target in copies]
            + [TensorRead(hooked[k]) for k in hooked_keys]
        )
        read = read_tensors(ckpt, model_reads + [TensorRead(a.path) for *_, a in arrays],
                            in_place=in_place)
        new = read.tensors[len(groups) + len(copies):]
        hooked_values: dict[str, Any] = dict(zip(hooked_keys, new, strict=False))
        for (_, entry, name, _), tensor in zip(arrays, new[len(hooked_keys):], strict=True):
            entry[name] = tensor
        training = ckpt.to_dict("training") if "training" in ckpt.groups else {}
        stored_rng = _stored_rng(training, required=rng)
        training = tree_to_torch(training, map_location, "training")
        # Everything is read and checked: now modify, what can be undone first (in place,
        # the model's tensors already are: a later failure says so).
        steps: list[Step] = []
        if read.written:
            steps.append(Step("the model (read in place)", "model", lambda: None))
        if optimizer is not None and opt_plan is not None and opt_plan.state_dict is not None:
            steps.append(_optimizer_step(optimizer, opt_plan.state_dict, previous))
        if scheduler is not None and load_scheduler:
            steps.append(scheduler_step(scheduler, scheduler_state))
        if rng and stored_rng is not None:
            steps.append(rng_step(stored_rng, strict=strict))
        if model is not None and model_plan is not None:
            if assign:
                state = assigned_state(groups, read.tensors[:len(groups)])
                steps.append(assign_step(model, {**state, **model_plan.values}))
            else:
                hooked_values.update(model_plan.values)
                steps.append(_model_step(model, hooked_values, read))
        apply_steps(steps)
        return LoadResult.of(ckpt, training, model_plan, opt_plan,
                             bytes_read=ckpt.stats.bytes_read - start, model=model,
                             rng=stored_rng)


def meta_left(model: torch.nn.Module | None) -> list[str]:
    """The model's tensors still on the meta device after a load, with a warning naming
    them (:attr:`LoadResult.on_meta`)."""
    if model is None:
        return []
    left = still_on_meta(model)
    if left:
        warnings.warn(
            f"{len(left)} parameter(s) or buffer(s) of the model are still on the meta "
            f"device after the load, the checkpoint having nothing for them: {named(left)} "
            "(non-persistent buffers are never saved: make them as the model's own "
            "initialisation does)", MetaTensorWarning, stacklevel=3,
        )
    return left


def _stored_rng(training: Mapping[str, Any], *, required: bool) -> dict[str, Any] | None:
    """The state in ``training/rng`` (UCP-1.0-R085), or None if there is none; a group that breaks
    the convention is a ``FormatError`` where it is to be restored (``required``), else
    None (its arrays and values are still in ``LoadResult.training``)."""
    tree = training.get("rng")
    if not isinstance(tree, Mapping):
        return None
    try:
        return rng_from_layout(tree)
    except FormatError:
        if required:
            raise
        return None


def non_persistent_buffers(model: torch.nn.Module, state_dict: Mapping[str, Any]) -> set[str]:
    """Names of the model's buffers that its state dict leaves out (``persistent=False``):
    a module never loads them, so a checkpoint that stores one is not refused for it."""
    return {n for n, _ in model.named_buffers(remove_duplicate=False)} - set(state_dict)


def _model_targets(
    model: torch.nn.Module, sd: Mapping[str, Any], tensors: Mapping[str, str]
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """(node path, live tensor) for the entries of ``sd`` that are the model's own
    parameters and buffers (a tied tensor once), and FQN -> node path of the entries a
    state-dict hook made (they are loaded through ``model.load_state_dict``)."""
    live = live_tensors(model)
    copies: list[tuple[str, torch.Tensor]] = []
    hooked: dict[str, str] = {}
    seen: set[tuple[str, int]] = set()
    for fqn, path in tensors.items():
        current, target = sd[fqn], live.get(fqn)
        if (
            target is not None
            and (target.shape, target.dtype) == (current.shape, current.dtype)
            and target.data_ptr() == current.data_ptr()
        ):
            if (path, id(target)) not in seen:
                seen.add((path, id(target)))
                copies.append((path, target))
        else:
            hooked[fqn] = path
    return copies, hooked


def _optimizer_step(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], previous: Any
) -> Step:
    """Loading ``state`` into ``optimizer``; undone by reloading its ``previous`` state
    dict (it holds the optimizer's own tensors, which a load never writes to)."""
    return Step("the optimizer", "optimizer", lambda: optimizer.load_state_dict(state),
                lambda: optimizer.load_state_dict(previous))


def _model_step(model: torch.nn.Module, values: dict[str, Any], staged: StagedReads) -> Step:
    """The entries made by state-dict hooks and the extra-state values through
    ``model.load_state_dict``, then the staged tensors into the model's own; cannot be
    undone, so it goes last."""

    def apply() -> None:
        if values:
            model.load_state_dict(values, strict=False)
        staged.apply()

    return Step("the model", "model", apply)


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
    check_device(map_location)
    with opened(path) as ckpt:
        if "optimizer" not in ckpt.groups:
            raise TensorNotFoundError("the checkpoint has no optimizer group",
                                      path=ckpt.location)
        out: dict[str, Any] = tree_to_torch(ckpt.to_dict("optimizer"), map_location,
                                            "optimizer")
        out.setdefault("state", {})
        return out

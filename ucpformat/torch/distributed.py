"""Collective save and load of distributed PyTorch training state.

Every rank calls :func:`save_distributed` (or :func:`load_distributed`) with its part of
the model and optimizer: FSDP2 (``fully_shard``), tensor parallelism
(``parallelize_module``), both on a 2-D mesh (strided shards), HSDP, DTensors of any
``Shard`` / ``Replicate`` / strided placements with uneven shard sizes, and plain
tensors (replicated: every rank holds them). The checkpoint is the same consolidated
one that the single-process API (:mod:`ucpformat.torch.state`) writes, with the same
layout (``model/<fqn>``, ``optimizer/state/<fqn>/<state>``, FQN ``param_groups``,
``training``), so a checkpoint saved on N ranks with one layout loads on M ranks with
another, or in a single process, and the other way round.

Saving: the state dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``get_optimizer_state_dict``: FQN keys, DTensor values).
Each DTensor's local tensor is described, from its mesh, placements and global shape,
as pieces of the consolidated tensor (:func:`ucpformat.layout.dtensor.dtensor_local_map`,
checked against the local tensor's shape and torch's own
``compute_local_shape_and_global_offset``). The format core's distributed writer
(:func:`ucpformat.distributed.save_fragments`) then writes every stored object once,
by one rank that holds it (replicas are written once), and rank 0 commits after every
rank has succeeded.

Loading: for every tensor of the target state dicts, each rank computes the part its
target placements give it and reads only that (the inner chunks overlapping it), into
the local tensor in place; then ``set_model_state_dict`` / ``set_optimizer_state_dict``.
All names, shapes and types are checked on every rank, and the ranks agree on the
outcome, before any tensor is modified.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ucpformat.checkpoint.rank_state import GROUP as RANKS_GROUP
from ucpformat.checkpoint.rank_state import RNG as RANK_RNG
from ucpformat.checkpoint.rank_state import RankState, check_rank, rank_path
from ucpformat.checkpoint.rank_state import group_values as rank_group_values
from ucpformat.checkpoint.rank_state import read as read_rank_state
from ucpformat.checkpoint.reader import Checkpoint
from ucpformat.checkpoint.tree import Group
from ucpformat.distributed import DistributedSaveResult, Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import Communicator, gather_failures
from ucpformat.distributed.pipeline import FragmentSource
from ucpformat.distributed.rank_description import MeshPosition, MeshTensor
from ucpformat.errors import (
    InvalidValueError,
    KeyMismatchError,
    LoadError,
)
from ucpformat.format import names
from ucpformat.layout.boxes import Box, Piece, as_slices, box_shape, box_size
from ucpformat.store import Store
from ucpformat.torch.assign import (
    AssignGroup,
    assign_groups,
    assign_step,
    assigned_state,
    live_tensors,
)
from ucpformat.torch.comm import ProcessGroup, TorchCommunicator, communicator
from ucpformat.torch.dtensor_layout import (
    agreed_meshes,
    local_map_of,
    mesh_name,
    placements_of,
    root_layout,
    saved_with,
    whole_map,
)
from ucpformat.torch.load_plan import (
    Device,
    ModelPlan,
    OptimizerPlan,
    OptimizerView,
    PathOrCheckpoint,
    Step,
    apply_steps,
    check_device,
    opened,
    plan_model,
    plan_optimizer,
    plan_scheduler,
    refuse_meta_parameters,
    refuse_optimizer_with_assign,
    scheduler_step,
    stateful_step,
    tree_to_torch,
    value_like,
)
from ucpformat.torch.numpy_bridge import data_type, to_numpy, torch_dtype
from ucpformat.torch.reads import StagedReads, TensorRead, partly_changed, read_tensors, whole
from ucpformat.torch.rng import from_layout as from_rng_layout
from ucpformat.torch.rng import rng_state, rng_step
from ucpformat.torch.rng import to_layout as rng_layout
from ucpformat.torch.staging import Stager, Staging
from ucpformat.torch.state import (
    LoadResult,
    Stateful,
    non_persistent_buffers,
    qualified_name,
    tied_aliases,
    to_json,
    unwrap,
)

#: The node names of ``training/ranks`` (UCP-1.0-R086).
RANKS_PARTS = tuple(RANKS_GROUP.split("/"))

#: Turns a rank's local tensor into the numpy array that is written (a view or a copy).
Snapshot = Callable[[str, torch.Tensor], np.ndarray[Any, Any]]


@functools.lru_cache(maxsize=1 << 16)
def _path(*logical: str) -> str:
    """``names.path_of``, cached: the same names come back at every save."""
    return names.path_of(*logical)


# -- what a rank holds ------------------------------------------------------------------------


@dataclass
class _Item:
    path: str  # node path
    tensor: torch.Tensor  # a DTensor or a plain tensor (replicated)
    role: str
    only_rank: int | None = None  # extra training tensors: rank 0's values are stored


@dataclass
class _State:
    items: list[_Item] = field(default_factory=list)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> attributes.ucp

    def values(self, group: str) -> dict[str, Any]:
        values: dict[str, Any] = self.groups.setdefault(group, {}).setdefault("values", {})
        return values


def _model_fqns(model: torch.nn.Module, *, renames: bool | None = None
                ) -> tuple[set[str], Callable[[str], str]]:
    """Parameter FQNs (as ``get_model_state_dict`` names them) and the name normaliser;
    ``renames``: :func:`renames_keys` of ``model``, if known."""
    canonical = _same_name  # no wrapper: the names are the FQNs already
    get_fqns = getattr(dcp_state_dict, "_get_fqns", None)
    if get_fqns is not None and _renaming(model, renames):

        def canonical(name: str) -> str:
            fqns = get_fqns(model, name)
            return next(iter(fqns)) if len(fqns) == 1 else name

    params = {canonical(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    return params, canonical


def _same_name(name: str) -> str:
    return name


def _renaming_types() -> tuple[type, ...] | None:
    """The wrappers whose keys DCP renames by their type (DDP, FSDP1); None where torch
    moved them, or the helper that calls a state_dict as DCP does (then every key goes
    through DCP)."""
    types = tuple(w for w in (getattr(dcp_state_dict, "DDP", None),
                              getattr(dcp_state_dict, "FSDP", None)) if isinstance(w, type))
    helper = getattr(dcp_state_dict, "_state_dict_fn", None)
    return types if len(types) == 2 and helper is not None else None


_RENAMING_TYPES: Final = _renaming_types()
#: The method by which a module tells DCP what to drop from its keys.
_FQN_MODIFIERS: Final = "_fqn_modifiers"


def _renames(m: torch.nn.Module) -> bool:
    """DCP's own test for one module (``hasattr(m, "_fqn_modifiers")`` among them), without
    the exception ``nn.Module.__getattr__`` raises for every module that lacks it."""
    assert _RENAMING_TYPES is not None
    children = m._modules
    return (isinstance(m, _RENAMING_TYPES) or "_orig_mod" in children
            or "_checkpoint_wrapped_module" in children or hasattr(type(m), _FQN_MODIFIERS)
            or _FQN_MODIFIERS in m.__dict__ or _FQN_MODIFIERS in children
            or _FQN_MODIFIERS in m._parameters or _FQN_MODIFIERS in m._buffers)


def renames_keys(model: torch.nn.Module) -> bool:
    """Whether a module of ``model``'s tree is a wrapper whose state-dict keys DCP renames
    to FQNs (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1, activation
    checkpointing's ``_checkpoint_wrapped_module.``, a module with ``_fqn_modifiers``),
    or DCP's helpers for this are not where they were (torch moved them: then every key
    goes through DCP)."""
    return _RENAMING_TYPES is None or any(_renames(m) for m in model.modules())


def _renaming(model: torch.nn.Module, renames: bool | None) -> bool:
    """``renames`` if the caller knows it, else :func:`renames_keys` of ``model``."""
    return renames_keys(model) if renames is None else renames


def model_state_dict(model: torch.nn.Module, *, renames: bool | None = None
                     ) -> dict[str, Any]:
    """``get_model_state_dict(model)`` (sharded, not offloaded): FQN keys, DTensor values;
    ``renames``: :func:`renames_keys` of ``model``, if known.

    DCP's call walks the module tree once per key to rename the keys that wrappers
    prefix (:func:`renames_keys`): 50 µs a tensor, 86 ms for 1,776 tensors, a third of an
    async save's blocked time on a GPU. Where the tree has no such wrapper, the module's
    own ``state_dict`` (called as DCP calls it, without autograd) already has those keys,
    and is returned; otherwise, and for an empty one (which DCP refuses), DCP's. (DCP
    also refuses keys that name no attribute of the tree, which a state-dict hook could
    add; this path saves them.)
    """
    if not _renaming(model, renames):
        with torch.no_grad():  # as DCP calls it: hooks that compute make no graph
            sd: dict[str, Any] = dict(dcp_state_dict._state_dict_fn(model, "state_dict")())
        if sd:
            return sd
    options = StateDictOptions(full_state_dict=False, cpu_offload=False)
    return dict(get_model_state_dict(model, options=options))


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                         renames: bool | None = None) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer)`` (sharded, not offloaded): the state
    and ``param_groups`` by parameter FQN; ``renames``: :func:`renames_keys` of ``model``,
    if known.

    DCP's call walks the module tree once per parameter, twice (41 µs a parameter). Where
    no module renames keys (:func:`renames_keys`), the FQNs are ``named_parameters()``'
    names, and this makes DCP's result from them: DCP's own initialisation of an empty
    optimizer state (a step with zero gradients and zero learning rate), then the
    optimizer's ``state_dict()`` with each parameter's index replaced by its FQN;
    otherwise DCP's call.
    """
    init = getattr(dcp_state_dict, "_init_optim_state", None)
    if _renaming(model, renames) or init is None:
        options = StateDictOptions(full_state_dict=False, cpu_offload=False)
        return dict(get_optimizer_state_dict(model, optimizer, options=options))
    init(optimizer)
    osd: dict[str, Any] = dcp_state_dict._state_dict_fn(optimizer, "state_dict")()
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                 for p in g["params"])}
    fqn_of = {index[id(p)]: name for name, p in model.named_parameters() if id(p) in index}
    state = osd["state"]
    for key in list(state):
        state[fqn_of[key]] = state.pop(key)
    for group in osd["param_groups"]:
        group["params"] = [fqn_of[i] for i in group["params"]]
    return {"state": state, "param_groups": osd["param_groups"]}


def _check_tensor(value: torch.Tensor, where: str) -> None:
    kind = type(value).__name__
    if kind == "ShardedTensor":
        raise InvalidValueError(
            "is a ShardedTensor (FSDP1 / sharded state dict); ucpformat.torch saves DTensor "
            "state (FSDP2 fully_shard, parallelize_module)", tensor=where,
        )


def collect_state(
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool | Mapping[str, Any] = False,
    rank_state: Mapping[str, Any] | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> _State:
    """The tensors (DTensors or plain) and JSON values of a training state, by node path;
    ``rng`` and ``rank_state`` are this rank's own (``rank`` of ``world_size``), under
    ``training/ranks/<rank>`` (:func:`collect_rank_state`)."""
    state = _State()
    if optimizer is not None and model is None:
        raise InvalidValueError("saving an optimizer needs model= (it names the parameters)")
    renames = model is not None and renames_keys(model)  # once: it walks every module
    if model is not None:
        msd = model_state_dict(model, renames=renames)
        params, _ = _model_fqns(model, renames=renames)
        aliases = tied_aliases(unwrap(model), list(msd))
        if aliases:
            state.groups.setdefault("model", {})["aliases"] = aliases
        state.groups.setdefault("model", {})
        for fqn, value in msd.items():
            where = f"model/{fqn}"
            if fqn in aliases:
                continue
            if isinstance(value, torch.Tensor):
                _check_tensor(value, where)
                role = "parameter" if fqn in params else "buffer"
                state.items.append(_Item(_path("model", fqn), value, role))
            else:
                state.values("model")[fqn] = to_json(value, where=where)
    if optimizer is not None:
        assert model is not None
        osd = optimizer_state_dict(model, optimizer, renames=renames)
        param_groups = []
        for gi, group in enumerate(osd.get("param_groups", [])):
            doc = {
                k: to_json(v, where=f"optimizer/param_groups[{gi}].{k}")
                for k, v in group.items()
                if k != "params"
            }
            doc["params"] = [str(p) for p in group["params"]]
            param_groups.append(doc)
        state.values("optimizer").update(
            {"type": qualified_name(optimizer), "param_groups": param_groups}
        )
        for fqn, entries in osd.get("state", {}).items():
            group_path = _path("optimizer", "state", str(fqn))
            state.groups.setdefault(group_path, {})
            for key, value in entries.items():
                where = f"optimizer/state/{fqn}/{key}"
                if not isinstance(key, str):
                    raise InvalidValueError(f"state names must be strings, got {key!r}",
                                            path=f"optimizer/state/{fqn}")
                if isinstance(value, torch.Tensor):
                    _check_tensor(value, where)
                    path = _path("optimizer", "state", str(fqn), key)
                    state.items.append(_Item(path, value, "optimizer_state"))
                else:
                    state.values(group_path)[key] = to_json(value, where=where)
    if step is not None or scheduler is not None or extra:
        state.groups.setdefault("training", {})
    if step is not None:
        state.values("training")["step"] = int(step)
    if scheduler is not None:
        state.values("training")["scheduler"] = to_json(
            scheduler.state_dict(), where="training/scheduler"
        )
    for key, value in (extra or {}).items():
        if key in state.groups.get("training", {}).get("values", {}):
            raise InvalidValueError(f"extra[{key!r}] would replace training/{key}",
                                    path="training")
        _collect_extra(state, ("training", str(key)), value)
    if rng is not False or rank_state:
        collect_rank_state(state, rank, world_size, rng=rng, rank_state=rank_state)
    return state


def collect_rank_state(
    state: _State,
    rank: int,
    world_size: int,
    *,
    rng: bool | Mapping[str, Any] = False,
    rank_state: Mapping[str, Any] | None = None,
) -> None:
    """This rank's own state into ``state``, under ``training/ranks/<rank>``
    (UCP-1.0-R086): its generators (``rng=True``: :func:`rng_state`; or a state of that
    form) as ``rng``, and each entry of ``rank_state`` under its name (a ``Stateful``,
    such as a stateful data loader or sampler: its ``state_dict()``; else the value:
    tensors, JSON values, mappings). Only this rank holds these; each of its tensors is
    stored whole, by this rank."""
    check_rank(rank, world_size)
    group = rank_path(rank)
    entries: dict[str, Any] = {}
    for name, value in (rank_state or {}).items():
        if name == RANK_RNG:
            raise InvalidValueError(f"rank_state[{name!r}] would replace this rank's "
                                    "generators; pass them as rng=", path=group)
        entries[str(name)] = value.state_dict() if callable(
            getattr(value, "state_dict", None)) else value
    state.groups.setdefault("training", {})
    state.values(RANKS_GROUP).update(rank_group_values(world_size))
    state.groups.setdefault(group, {})
    if rng is not False:
        layout = rng_layout(rng_state() if rng is True else rng)
        _collect_layout(state, (*RANKS_PARTS, str(rank), RANK_RNG), layout, owner=rank)
    for name, value in entries.items():
        _collect_extra(state, (*RANKS_PARTS, str(rank), name), value, owner=rank)


def _collect_layout(state: _State, where: tuple[str, ...], tree: Mapping[str, Any],
                    *, owner: int) -> None:
    """A tree of arrays (numpy or plain tensors), JSON values and mappings (a ``Group``
    for every group, as ``ucpformat.save`` takes it) into ``state``: every mapping a
    group."""
    state.groups.setdefault(_path(*where), {})
    for key, value in tree.items():
        at = (*where, str(key))
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if isinstance(value, torch.Tensor):
            state.items.append(_Item(_path(*at), value, "training_state", only_rank=owner))
        elif isinstance(value, Mapping):
            _collect_layout(state, at, value, owner=owner)
        else:
            state.values(_path(*where))[str(key)] = to_json(value, where="/".join(at))


def _collect_extra(state: _State, where: tuple[str, ...], value: Any, *, owner: int = 0
                   ) -> None:
    """An ``extra`` entry (``owner``: the rank whose plain tensors are stored): tensors and
    numpy arrays are arrays, a :class:`~ucpformat.checkpoint.tree.Group` is always a
    group (as ``ucpformat.save`` takes it), other mappings only where they hold an array."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, Group):
        _collect_layout(state, where, value, owner=owner)
        return
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            state.items.append(_Item(_path(*where), value, "training_state"))
        else:
            state.items.append(_Item(_path(*where), value, "training_state", only_rank=owner))
        return
    if isinstance(value, Mapping) and any(
        isinstance(v, torch.Tensor | np.ndarray | Mapping) for v in value.values()
    ):
        state.groups.setdefault(_path(*where), {})
        for k, v in value.items():
            _collect_extra(state, (*where, str(k)), v, owner=owner)
        return
    parent = _path(*where[:-1])
    state.values(parent)[where[-1]] = to_json(value, where="/".join(where))


def _plain_copy(path: str, t: torch.Tensor) -> np.ndarray[Any, Any]:
    return to_numpy(t, name=path)


#: What :func:`local_parts` gives: the tensor specs, and (path, local tensor, its
#: non-empty pieces) of what a rank holds.
LocalParts = tuple[list[TensorSpec], list[tuple[str, torch.Tensor, tuple[Piece, ...]]]]


def local_parts(state: _State, rank: int) -> LocalParts:
    """The tensor specs, and (path, local tensor, its non-empty pieces) of what this rank
    holds (worked out once per save: :func:`local_tensors` and :func:`fragments_of` take
    it)."""
    specs: list[TensorSpec] = []
    parts: list[tuple[str, torch.Tensor, tuple[Piece, ...]]] = []
    for item in state.items:
        t = item.tensor
        dt = data_type(t.dtype, tensor=item.path)
        ucp: dict[str, Any] = {"role": item.role}
        if isinstance(t, DTensor):
            ucp["saved_with"] = saved_with(t)
            lm = local_map_of(t, name=item.path)
            pieces = lm.pieces if lm is not None else ()
            local = t.to_local()
        else:
            pieces = whole_map(tuple(t.shape)).pieces
            local = t
            if item.only_rank is not None and item.only_rank != rank:
                pieces = ()
        specs.append(TensorSpec(item.path, tuple(int(n) for n in t.shape), dt.name, {"ucp": ucp}))
        pieces = tuple(p for p in pieces if box_size(p.glob))
        if pieces:
            parts.append((item.path, local.detach(), pieces))
    return specs, parts


def local_tensors(state: _State, rank: int, parts: LocalParts | None = None
                  ) -> list[torch.Tensor]:
    """The local tensors (a DTensor's local shard) whose values this rank saves (what a
    snapshot copies); ``parts``: :func:`local_parts` of ``state``, if known."""
    return [t for _, t, _ in (parts or local_parts(state, rank))[1]]


def _pieces_of(arr: np.ndarray[Any, Any], pieces: Sequence[Piece]) -> list[tuple[Box, Any]]:
    return [(p.glob, arr[as_slices(p.local)] if arr.ndim else arr) for p in pieces]


def fragments_of(
    state: _State, rank: int, snapshot: Snapshot = _plain_copy,
    parts: LocalParts | None = None,
) -> tuple[list[TensorSpec], list[Fragment]]:
    """The tensor specs and this rank's fragments (values from ``snapshot``);
    ``parts``: :func:`local_parts` of ``state``, if known."""
    specs, parts_ = parts or local_parts(state, rank)
    frags = [Fragment(path, box, data) for path, local, pieces in parts_
             for box, data in _pieces_of(snapshot(path, local), pieces)]
    return specs, frags


class StagedFragments:
    """A rank's fragments as a :class:`~ucpformat.distributed.pipeline.FragmentSource` whose device
    tensors are copied to host memory through a :class:`~ucpformat.torch.staging.Stager`
    when the pipeline needs them (bounded memory, copies overlapped with the write);
    the other tensors' values are numpy views."""

    def __init__(self, parts: Sequence[tuple[str, torch.Tensor, tuple[Piece, ...]]],
                 staging: Staging) -> None:
        self._pieces = {path: pieces for path, _, pieces in parts}
        self._order = [path for path, _, _ in parts]
        self._plain = {path: t for path, t, _ in parts if not staging.stages(t)}
        self.stager: Stager = staging.stager(
            {path: t for path, t, _ in parts if path not in self._plain})

    def boxes(self) -> list[tuple[str, Box]]:
        return [(path, p.glob) for path in self._order for p in self._pieces[path]]

    def fragments(self, path: str) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        pieces = self._pieces.get(path, ())
        if not pieces:
            return []
        plain = self._plain.get(path)
        arr = to_numpy(plain, name=path) if plain is not None else self.stager.get(path)
        return [(box, data.reshape(box_shape(box))) for box, data in _pieces_of(arr, pieces)]

    def schedule(self, keys: Sequence[str]) -> None:
        self.stager.schedule([k for k in keys if k in self.stager])

    def release(self, key: str) -> None:
        if key in self.stager:
            self.stager.release(key)

    def stop(self) -> None:
        self.stager.stop()


# -- save -------------------------------------------------------------------------------------


def save_distributed(
    path: str | os.PathLike[str] | Store,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    group: ProcessGroup | None = None,
    staging: Staging | None = None,
    rng: bool | Mapping[str, Any] = False,
    rank_state: Mapping[str, Any] | None = None,
    **save_kwargs: Any,
) -> DistributedSaveResult:
    """Collective: every rank of ``group`` calls it; one consolidated checkpoint results.

    ``model`` may be FSDP2-sharded, tensor-parallel, both, or plain; ``optimizer`` is
    saved by parameter FQN; ``scheduler`` and ``step`` go to ``training``; ``extra``
    entries too (JSON values; tensors are taken from rank 0, DTensors from every rank).

    Each rank's own state goes to ``training/ranks/<rank>`` (spec UCP-1.0-R086):
    ``rng=True`` its random-number generators (:func:`ucpformat.torch.rng_state`, or
    a state of that form), ``rank_state`` named entries (a ``Stateful`` such as a
    stateful data loader: its ``state_dict()``; or tensors and JSON values).
    :func:`load_distributed` gives each rank its own back.
    ``group`` carries the checkpoint's collectives (default: the world; see
    :func:`ucpformat.torch.comm.checkpoint_group`). ``save_kwargs`` go to
    :func:`ucpformat.distributed.save_fragments` (``overwrite``, ``compression``,
    ``hash_algorithm``, ...). Without torch.distributed it saves as one process.

    Local tensors on a device (a GPU) are copied to host memory through a bounded pool
    of pinned buffers while earlier ones are written (``staging``: see
    :class:`ucpformat.torch.staging.Staging`).
    """
    comm = communicator(group)
    state = collect_state(
        model=model, optimizer=optimizer, scheduler=scheduler, step=step, extra=extra,
        rng=rng, rank_state=rank_state, rank=comm.rank, world_size=comm.world_size,
    )
    specs, parts = local_parts(state, comm.rank)
    source = StagedFragments(parts, staging if staging is not None else Staging())
    try:
        return write_collected(path, comm, state, specs, source, metadata=metadata,
                               **save_kwargs)
    finally:
        source.stop()


def write_collected(
    path: str | os.PathLike[str] | Store,
    comm: Communicator,
    state: _State,
    specs: list[TensorSpec],
    frags: list[Fragment] | FragmentSource,
    *,
    metadata: Mapping[str, Any] | None = None,
    **save_kwargs: Any,
) -> DistributedSaveResult:
    """The collective write of collected state (shared by the sync and async paths).
    DTensors are described by their device mesh (:func:`mesh_layout`)."""
    meshes, on_mesh = mesh_layout(state, comm)
    return save_fragments(
        path,
        comm,
        specs=specs,
        fragments=frags,
        group_attributes=state.groups,
        meshes=meshes,
        on_mesh=on_mesh,
        metadata=metadata,
        **save_kwargs,
    )


def mesh_layout(
    state: _State, comm: Communicator
) -> tuple[list[MeshPosition], list[MeshTensor]]:
    """The DTensors of ``state`` described by their device mesh (:func:`root_layout`):
    this rank's place in each mesh and each DTensor's placements (the coordinator
    derives every rank's fragments from them,
    :class:`~ucpformat.distributed.rank_description.MeshTensor`). Collective over ``comm`` (the
    save's). Left to their fragments' boxes: a DTensor whose mesh has ranks outside the save's
    process group (or this rank not in it), and the DTensors of a mesh whose ranks do not all lay
    out the same tensors on it (:func:`agreed_meshes`)."""
    if not isinstance(comm, TorchCommunicator):
        return [], []
    members = set(torch.distributed.get_process_group_ranks(
        comm.group if comm.group is not None else torch.distributed.group.WORLD))
    places: dict[str, MeshPosition | None] = {}
    on_mesh: list[MeshTensor] = []
    for item in state.items:
        t = item.tensor
        if not isinstance(t, DTensor):
            continue
        layout = root_layout(t, name=item.path)
        if layout is None:
            continue
        mesh, placements = layout
        name = mesh_name(mesh)
        if name not in places:
            coords = mesh.get_coordinate()
            inside = coords is not None and set(mesh.mesh.flatten().tolist()) <= members
            places[name] = MeshPosition(name, tuple(int(n) for n in mesh.shape),
                                        tuple(int(c) for c in coords or ())) if inside else None
        if places[name] is not None:
            on_mesh.append(MeshTensor(item.path, name, placements))
    return agreed_meshes(comm, [p for p in places.values() if p is not None], on_mesh)


# -- load -------------------------------------------------------------------------------------


@dataclass
class _Read:
    path: str  # node path in the checkpoint
    target: torch.Tensor  # DTensor or plain tensor: live state, or a new optimizer state


@dataclass
class _LoadPlan:
    reads: list[_Read] = field(default_factory=list)
    model: ModelPlan | None = None
    model_sd: dict[str, Any] | None = None  # for set_model_state_dict (targets filled)
    assign: list[AssignGroup] = field(default_factory=list)  # assign=True: new tensors
    optimizer: OptimizerPlan | None = None
    scheduler: tuple[bool, Any] = (False, None)


def _plan_model(
    ckpt: Checkpoint, model: torch.nn.Module, plan: _LoadPlan, strict: bool, assign: bool
) -> None:
    msd = model_state_dict(model)
    plan.model = plan_model(ckpt, msd, strict=strict, owner="the model's state dict",
                            skip=non_persistent_buffers(model, msd), assign=assign)
    if assign:
        _, canonical = _model_fqns(model)
        live = {canonical(name): t for name, t in live_tensors(model).items()}
        plan.assign = assign_groups(live, plan.model.tensors)
    else:
        for fqn, path in plan.model.tensors.items():
            plan.reads.append(_Read(path, msd[fqn]))
    msd.update(plan.model.values)
    plan.model_sd = msd


def _plan_optimizer(
    ckpt: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: _LoadPlan,
    strict: bool,
) -> None:
    params = _param_tensors(model)
    refuse_meta_parameters(params)  # before torch initialises the state (on meta)
    osd = optimizer_state_dict(model, optimizer)
    groups: list[dict[str, Any]] = list(osd.get("param_groups", []))
    current: dict[str, Any] = osd.get("state", {})
    view = OptimizerView(qualified_name(optimizer), groups,
                         [[str(f) for f in g["params"]] for g in groups], current, params)
    plan.optimizer = plan_optimizer(ckpt, view, strict=strict)
    for fqn, entry, name, array in plan.optimizer.stored_arrays():
        target = current.get(fqn, {}).get(name)  # its shape was checked by the planner
        if not isinstance(target, torch.Tensor):
            target = _new_state_tensor(ckpt, array.path, params.get(fqn))
        plan.reads.append(_Read(array.path, target))
        entry[name] = target


def _param_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    _, canonical = _model_fqns(model)
    return {canonical(n): p for n, p in model.named_parameters()}


def _new_state_tensor(
    ckpt: Checkpoint, path: str, param: torch.Tensor | None
) -> torch.Tensor:
    """A tensor to read a state into that the live optimizer lacks: laid out like its
    parameter if it has the parameter's shape, else whole on every rank."""
    meta = ckpt.arrays[path]
    dtype = torch_dtype(meta.dtype.name, tensor=path)
    ckpt.check_new_arrays([(path, math.prod(meta.shape) * meta.dtype.itemsize)])
    if (
        isinstance(param, DTensor)
        and tuple(int(n) for n in param.shape) == meta.shape
    ):
        local = torch.empty(param.to_local().shape, dtype=dtype, device=param.to_local().device)
        return DTensor.from_local(local, param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
    device = param.device if param is not None and meta.shape else torch.device("cpu")
    return torch.empty(meta.shape, dtype=dtype, device=device)


def _read_all(
    ckpt: Checkpoint, plan: _LoadPlan, map_location: Device, in_place: bool
) -> tuple[StagedReads, list[torch.Tensor]]:
    """Read every target's local part, and the new local part of every tensor assigned,
    as one batch: into staging (no target changes before :meth:`StagedReads.apply`), or
    ``in_place``. The new tensors assigned come back laid out as their live tensors
    (DTensors of the same mesh and placements)."""
    requests: list[TensorRead] = []
    for read in plan.reads:
        target = read.target
        if isinstance(target, DTensor):
            lm = local_map_of(target, name=read.path)
            if lm is None:
                continue
            local = target.to_local()
        else:
            lm = whole(target.shape)
            local = target
        if local.numel() == 0:
            continue
        requests.append(TensorRead(read.path, local, lm))
    first = len(requests)
    layouts: list[Any] = []
    for group in plan.assign:
        like = (plan.model_sd or {}).get(group.names[0])
        lm = None
        if isinstance(like, DTensor):
            lm = local_map_of(like, name=group.path)
            if lm is None:
                raise LoadError("this rank is not in the tensor's device mesh, so it cannot "
                                "be given a local part", tensor=group.path)
        layouts.append(like)
        requests.append(TensorRead(group.path, local=lm, device=map_location))
    staged = read_tensors(ckpt, requests, in_place=in_place)
    new: list[torch.Tensor] = []
    for like, local in zip(layouts, staged.tensors[first:], strict=True):
        if isinstance(like, DTensor):
            local = DTensor.from_local(local, like.device_mesh, like.placements,
                                       run_check=False, shape=like.shape, stride=like.stride())
        new.append(local)
    return staged, new


def _agree(
    comm: Communicator, error: BaseException | None, stage: str, written: Sequence[str] = ()
) -> None:
    """Collective: raise on every rank if any rank failed (its own error where it has one;
    ``written``: what this rank has changed already, read in place)."""
    failed = gather_failures(comm, error)
    if not failed:
        return
    if error is not None:
        raise error
    detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
    failure = LoadError(f"loading failed on other ranks while {stage} ({detail})")
    raise partly_changed(failure, written) if written else failure


def _steps(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Stateful | None,
    plan: _LoadPlan,
    staged: StagedReads,
    assigned: Sequence[torch.Tensor],
    strict: bool,
) -> list[Step]:
    """The changes a load makes, in order: the scheduler (undone on a later failure),
    then the tensors and the state dicts (which cannot be). In place, the tensors were
    changed by the read already: a later failure says so."""
    options = StateDictOptions(full_state_dict=False, cpu_offload=False, strict=strict)
    steps: list[Step] = []
    if staged.written:
        steps.append(Step("the model's and the optimizer's tensors (read in place)", "model",
                          lambda: None))
    load_scheduler, scheduler_state = plan.scheduler
    if scheduler is not None and load_scheduler:
        steps.append(scheduler_step(scheduler, scheduler_state))
    steps.append(Step("the model's and the optimizer's tensors", "model", staged.apply))
    model_sd = plan.model_sd
    if model is not None and model_sd is not None and plan.assign:
        rename: dict[str, list[str]] = {}
        _, canonical = _model_fqns(model)
        for name in live_tensors(model):
            rename.setdefault(canonical(name), []).append(name)
        state = assigned_state(plan.assign, assigned, rename)
        for fqn, value in (plan.model.values if plan.model else {}).items():
            for key in rename.get(fqn, [fqn]):
                state[key] = value
        steps.append(assign_step(model, state))
    elif model is not None and model_sd is not None:
        steps.append(Step("the model", "model",
                          lambda: set_model_state_dict(model, model_sd, options=options)))
    optim = plan.optimizer
    if model is not None and optimizer is not None and optim is not None:
        optim_sd = optim.state_dict
        if optim_sd is not None:
            steps.append(Step("the optimizer", "optimizer", lambda: set_optimizer_state_dict(
                model, optimizer, optim_sd, options=options)))
    return steps


def load_distributed(
    path: PathOrCheckpoint,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Stateful | None = None,
    strict: bool = True,
    group: ProcessGroup | None = None,
    map_location: str | torch.device = "cpu",
    assign: bool = False,
    in_place: bool = False,
    rng: bool = False,
    rank_state: Mapping[str, Stateful] | None = None,
) -> LoadResult:
    """Collective: load a checkpoint into a model and optimizer laid out in any way.

    Each rank reads only the regions its DTensors' placements give it (plain tensors:
    the whole tensor), whatever layout and world size saved the checkpoint (or a single
    process). Names, shapes, stored values and the optimizer type are checked on every
    rank, every rank reads its part into staging (each chunk's checksum checked), and
    the ranks agree before anything is modified: a load that fails on any rank changes
    nothing on any rank (``strict=False`` loads what matches and lists the rest).
    Model-only loading: pass no optimizer. Tensors of ``training/`` come back on
    ``map_location``.

    ``assign``: the model's tensors are replaced by new ones (the checkpoint's dtype; a
    DTensor's local part read on ``map_location``, then on its mesh's device, with the
    same mesh and placements) through ``model.load_state_dict(assign=True)``, as a
    model built on the meta device needs (FSDP2 and TP models too); a meta tensor is
    refused without it. ``in_place``: each rank reads straight into its local tensors
    (no staging); a load that then fails leaves them partly changed, and the error says
    so and names them.

    Per-rank state (spec UCP-1.0-R087): ``rng=True`` restores this rank's generators and
    each ``rank_state`` entry's ``load_state_dict`` gets the state saved under its name,
    both from ``training/ranks/<rank>``, this rank's own group, never another rank's.
    Where the checkpoint holds no state for this rank (saved by fewer processes, or
    without per-rank state), this rank's generators and objects stay as they are, and
    a :class:`~ucpformat.checkpoint.rank_state.RankStateWarning` and the result's
    ``rank_notes`` say so; they also say when the checkpoint was saved by another number
    of processes. A rank group that lacks a requested entry is a ``KeyMismatchError``
    (``strict=False``: left as it is). The result's ``rank_state`` holds this rank's
    stored state either way (``training`` holds no rank's).
    """
    comm = communicator(group)
    if optimizer is not None and model is None:
        raise InvalidValueError("loading an optimizer needs model= (it names the parameters)")
    with opened(path) as ckpt:
        start = ckpt.stats.bytes_read
        plan = _LoadPlan()
        error: BaseException | None = None
        try:
            check_device(map_location)
            refuse_optimizer_with_assign(assign, optimizer)
            if model is not None:
                _plan_model(ckpt, model, plan, strict, assign)
            if optimizer is not None:
                assert model is not None
                _plan_optimizer(ckpt, model, optimizer, plan, strict)
            if scheduler is not None:
                plan.scheduler = plan_scheduler(ckpt, scheduler.state_dict(), strict=strict)
            for read in plan.reads:  # placements that cannot be laid out fail here
                if isinstance(read.target, DTensor):
                    local_map_of(read.target, name=read.path)
        except BaseException as exc:
            error = exc
        _agree(comm, error, "checking the checkpoint")
        staged = StagedReads([])
        assigned: list[torch.Tensor] = []
        training: dict[str, Any] = {}
        own = RankState(comm.rank, None, None)
        own_rng: dict[str, Any] | None = None
        rank_steps: list[Step] = []
        try:
            staged, assigned = _read_all(ckpt, plan, map_location, in_place)
            training = tree_to_torch(
                ckpt.to_dict("training", exclude=(RANKS_GROUP,))
                if "training" in ckpt.groups else {},
                map_location, "training",
            )
            own, own_rng, rank_steps = _plan_rank_state(
                ckpt, comm.rank, rng, rank_state or {}, strict=strict,
                map_location=map_location)
        except BaseException as exc:
            error = exc
        _agree(comm, error, "reading", staged.written)
        try:
            apply_steps([*_steps(model, optimizer, scheduler, plan, staged, assigned, strict),
                         *rank_steps])
        except BaseException as exc:
            error = exc
        _agree(comm, error, "loading the checked state", staged.written)
        notes = own.warn(comm.world_size) if (rng or rank_state) else []
        result = LoadResult.of(ckpt, training, plan.model, plan.optimizer,
                               bytes_read=ckpt.stats.bytes_read - start, model=model)
        stored = tree_to_torch(own.state, map_location, rank_path(comm.rank)) \
            if own.state is not None else None
        return dataclasses.replace(result, rank_state=stored, saved_world_size=own.world_size,
                                   rank_notes=notes, rng=own_rng)


def _plan_rank_state(
    ckpt: Checkpoint, rank: int, rng: bool, objects: Mapping[str, Stateful], *,
    strict: bool, map_location: Device,
) -> tuple[RankState, dict[str, Any] | None, list[Step]]:
    """This rank's stored state (read, checked), its generators decoded, and the steps
    restoring them (UCP-1.0-R087): its generators and each object's state, from its own
    group only."""
    where = rank_path(rank)
    if RANK_RNG in objects:
        raise InvalidValueError(f"rank_state[{RANK_RNG!r}]: this rank's generators are "
                                "restored by rng=True", path=where)
    found = read_rank_state(ckpt, rank)
    stored = found.state
    rng_stored = from_rng_layout(stored[RANK_RNG], where=f"{where}/{RANK_RNG}") \
        if stored is not None and isinstance(stored.get(RANK_RNG), Mapping) else None
    if stored is None:
        return found, rng_stored, []
    wanted = ([RANK_RNG] if rng else []) + list(objects)
    missing = [n for n in wanted if n not in stored]
    if missing and strict:
        raise KeyMismatchError(
            f"this rank's state holds no {missing} (it holds {sorted(stored)}); pass "
            "strict=False to leave those as they are", path=where)
    steps: list[Step] = []
    for name, obj in objects.items():
        if name not in stored:
            continue
        at = f"{where}/{names.escape(name)}"
        value = value_like(obj.state_dict(), tree_to_torch(stored[name], map_location, at),
                           where=at)
        steps.append(stateful_step(obj, value, f"rank_state[{name!r}]", at))
    if rng and rng_stored is not None:
        steps.append(rng_step(rng_stored, strict=strict, path=f"{where}/{RANK_RNG}"))
    return found, rng_stored, steps


__all__ = [
    "LocalParts",
    "StagedFragments",
    "agreed_meshes",
    "collect_state",
    "fragments_of",
    "load_distributed",
    "local_map_of",
    "local_parts",
    "local_tensors",
    "mesh_layout",
    "mesh_name",
    "model_state_dict",
    "optimizer_state_dict",
    "placements_of",
    "renames_keys",
    "root_layout",
    "save_distributed",
]

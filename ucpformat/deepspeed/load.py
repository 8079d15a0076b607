"""Resume a DeepSpeed engine from any UCP checkpoint, on any layout.

Each rank reads only what it holds (:mod:`ucpformat.deepspeed.rank_fragments`): the slots of
its flat fp32 partitions, in the master weights and in every optimizer state, its
frozen parameters' partitions, its buffers. Everything is checked and read into host
buffers first, and the ranks agree that every rank succeeded, before anything of the
engine changes: a refused load leaves the engine as it was.

Then, as DeepSpeed's own ``load_universal`` does: the fp32 masters and the optimizer's
state are written into the flat partitions (new state tensors, zero in the padding,
linked to the parameters' ``_hp_mapping``), the param groups' hyperparameters, gradient
clipping and loss scaler are set, the 16-bit weights are refreshed from the masters
(``update_lp_params``; ZeRO-3 copies its partitions), then the LR scheduler and the
engine's counters. Buffers and frozen parameters are loaded too (DeepSpeed's universal
loader leaves them as they were).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.distributed import read_locals
from ucpformat.distributed.comm import Communicator, error_report, failed_ranks, gather_failures
from ucpformat.distributed.pipeline import raise_if_failed
from ucpformat.errors import (
    CheckpointNotFoundError,
    KeyMismatchError,
    LoadError,
    ShapeMismatchError,
    UCPError,
    UnsafePathError,
)
from ucpformat.format import names
from ucpformat.layout.boxes import LocalMap, Piece, box_size
from ucpformat.store import LocalStore, open_store
from ucpformat.torch import load_plan
from ucpformat.torch.comm import communicator
from ucpformat.torch.numpy_bridge import from_numpy

from .rank_fragments import FP32_COPIES, ZERO, ZERO3, Flat, Holdings, Naming, Placed, holdings
from .rank_fragments import inner_optimizer as _inner
from .save import TRAINING_KEYS, loss_scaler, model_path, state_path

#: training values that are the engine's (or another producer's name for them), not client state
_ENGINE_KEYS = frozenset(TRAINING_KEYS) | {"lr_scheduler", "data_sampler", "random_ltd"}


@dataclass
class LoadResult:
    """What a load did: the checkpoint, its step, the client state, the bytes this rank read."""

    path: str
    step: int | None
    client_state: dict[str, Any]
    bytes_read: int
    notes: list[str] = field(default_factory=list)


def resolve_location(path: str | os.PathLike[str], tag: str | None = None) -> str:
    """The checkpoint to load: ``path/tag``; ``path`` if it is a checkpoint; else the one
    ``path/latest`` names (the file :func:`ucpformat.deepspeed.save` writes with a tag).

    A name read from ``latest`` is content: a link there is refused (UCP-1.0-R089), and
    :func:`load` opens it without following one (:func:`open_location`)."""
    location, from_content = _resolve(path, tag)
    if from_content and "://" not in location:
        _no_link(location)
    return location


def _resolve(path: str | os.PathLike[str], tag: str | None) -> tuple[str, bool]:
    """The location, and whether its last name came from the ``latest`` file."""
    from .save import checkpoint_location

    base = os.fspath(path)
    if tag is not None:
        return checkpoint_location(base, tag), False
    store = open_store(base, durable=False)
    if store.exists("zarr.json"):
        return base, False
    latest = store.get("latest")
    if latest is None:
        raise CheckpointNotFoundError("no checkpoint here (no zarr.json) and no 'latest' file "
                                      "naming one", rule="UCP-1.0-R051", path=base)
    name = latest.decode(errors="replace").strip()
    return checkpoint_location(base, name), True


def _no_link(location: str) -> None:
    local = location[len("file://"):] if location.startswith("file://") else location
    if os.path.islink(local):
        raise UnsafePathError(
            f"'latest' names {os.path.basename(local)!r}, a symbolic link: a name read from a "
            "checkpoint's files is resolved without following links", rule="UCP-1.0-R089",
            path=local)


def open_location(path: str | os.PathLike[str], tag: str | None = None) -> Checkpoint:
    """Open the checkpoint :func:`resolve_location` finds; one that ``latest`` names is
    opened through a store that never follows a link, even at its own name."""
    location, from_content = _resolve(path, tag)
    if not from_content or "://" in location:
        return open_checkpoint(location)
    _no_link(location)
    local = location[len("file://"):] if location.startswith("file://") else location
    return open_checkpoint(LocalStore(local, durable=False, follow_link=False))


# -- the plan: every check, and the reads ------------------------------------------------------


@dataclass
class _FlatPlan:
    flat: Flat
    master: np.ndarray[Any, Any]  # float32, the flat tensor's elements (slots filled)
    shaped: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)  # state -> flat buffer
    scalars: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)  # state -> 0-d
    values: dict[str, Any] = field(default_factory=dict)  # JSON state, shaped like the live one
    raw_values: dict[str, Any] = field(default_factory=dict)  # JSON state as stored


@dataclass
class _Plan:
    flats: list[_FlatPlan] = field(default_factory=list)
    frozen: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)  # name -> local data
    buffers: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)
    hyper: list[dict[str, Any]] | None = None
    deepspeed: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None
    training: dict[str, Any] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _children(ckpt: Checkpoint, group: str) -> dict[str, str]:
    """Logical name -> node path of the arrays directly in ``group``."""
    start = group + "/"
    return {names.unescape(p[len(start):]): p for p in ckpt.arrays
            if p.startswith(start) and "/" not in p[len(start):]}


def _flat_map(placed: Placed, start: int, numel: int) -> LocalMap:
    """Elements [start, start + numel) of a local tensor as a 1-d local map."""
    pieces = tuple(Piece(((rel, rel + box_size(box)),), box)
                   for rel, box in placed.flat_pieces(start, start + numel))
    return LocalMap((numel,), pieces)


def _check_shape(ckpt: Checkpoint, path: str, shape: Sequence[int]) -> None:
    have = ckpt[path].shape
    if tuple(have) != tuple(shape):
        raise ShapeMismatchError(
            f"the checkpoint holds shape {list(have)}, the engine needs {list(shape)}",
            tensor=path)


def _check_names(ckpt: Checkpoint, h: Holdings, every_rank: Sequence[Sequence[str]]) -> None:
    """Refuse a checkpoint whose model tensors differ from the engine's (all ranks')."""
    stored = _children(ckpt, "model")
    group = ckpt.groups.get("model")
    aliases = dict(group.ucp.get("aliases", {})) if group is not None else {}
    known = set(stored) | {a for a, t in aliases.items() if t in stored}
    mine = list(h.params) + list(h.buffers)
    missing = sorted(n for n in mine if n not in known)
    engine = {n for names_ in every_rank for n in names_}
    unexpected = sorted(n for n in stored if n not in engine)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(map(repr, missing[:5]))}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"not in the engine's model: {', '.join(map(repr, unexpected[:5]))}"
                         + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
        raise KeyMismatchError(f"the checkpoint's model tensors differ from the engine's "
                               f"({'; '.join(parts)})",
                               tensor=(missing or unexpected)[0], path=ckpt.location)


def _model_array(ckpt: Checkpoint, name: str) -> str:
    """The node path holding model tensor ``name`` (through the checkpoint's aliases)."""
    path = model_path(name)
    if path in ckpt.arrays:
        return path
    group = ckpt.groups.get("model")
    target = dict(group.ucp.get("aliases", {})).get(name) if group is not None else None
    return model_path(str(target)) if target is not None else path


def _plan(ckpt: Checkpoint, engine: Any, h: Holdings, every_rank: Sequence[Sequence[str]], *,
          load_optimizer_states: bool, load_lr_scheduler_states: bool) -> _Plan:
    """Check everything against the engine and read this rank's part, changing nothing."""
    _check_names(ckpt, h, every_rank)
    plan = _Plan()
    reads: list[tuple[str, LocalMap, np.ndarray[Any, Any] | None]] = []
    after: list[Any] = []  # (callable on the read array) per read
    inner = _inner(engine)
    trained = h.trained

    def read(path: str, lmap: LocalMap, out: np.ndarray[Any, Any] | None, then: Any) -> None:
        reads.append((path, lmap, out))
        after.append(then)

    for name, param in h.params.items():
        path = _model_array(ckpt, name)
        _check_shape(ckpt, path, param.placed.shape)
        if name in trained:
            continue
        placed = param.placed
        if param.partition is not None:
            start, numel = param.partition
            lmap = _flat_map(placed, start, numel)
        else:
            lmap = placed.lmap

        def keep(values: np.ndarray[Any, Any], name: str = name) -> None:
            plan.frozen[name] = values

        read(path, lmap, None, keep)
    for name, (_, placed) in h.buffers.items():
        path = _model_array(ckpt, name)
        _check_shape(ckpt, path, placed.shape)

        def keep_buffer(values: np.ndarray[Any, Any], name: str = name) -> None:
            plan.buffers[name] = values

        read(path, placed.lmap, None, keep_buffer)

    for flat in h.flats:
        size = flat.master.numel()
        fp = _FlatPlan(flat, np.zeros(size, dtype=np.float32))
        plan.flats.append(fp)
        state_keys: set[str] | None = None
        for slot in flat.slots:
            param = h.params[slot.param]
            placed = param.placed
            master = state_path(slot.param, "master")
            source = master if master in ckpt.arrays else _model_array(ckpt, slot.param)
            _check_shape(ckpt, source, placed.shape)
            lmap = _flat_map(placed, slot.start, slot.numel)
            dest = fp.master[slot.offset:slot.offset + slot.numel]
            if ckpt[source].dtype == np.float32:
                read(source, lmap, dest, None)
            else:
                def widen(values: np.ndarray[Any, Any], dest: np.ndarray[Any, Any] = dest,
                          source: str = source) -> None:
                    if values.dtype.kind != "f" and values.dtype.name != "bfloat16":
                        raise LoadError(f"the master weights must be floating point, not "
                                        f"{values.dtype}", tensor=source)
                    dest[...] = values.astype(np.float32)

                read(source, lmap, None, widen)
            if not load_optimizer_states or inner is None:
                continue
            stored = {k: p for k, p in _children(ckpt, names.path_of(
                "optimizer", "state", slot.param)).items() if k != "master"}
            group_path = names.path_of("optimizer", "state", slot.param)
            json_state = ckpt.values(group_path) if group_path in ckpt.groups else {}
            keys = set(stored) | set(json_state)
            if not keys:
                raise LoadError("the checkpoint holds no optimizer state for this parameter; "
                                "pass load_optimizer_states=False to load the weights only",
                                tensor=model_path(slot.param), path=ckpt.location)
            if state_keys is None:
                state_keys = keys
            elif keys != state_keys:
                raise LoadError(f"its optimizer states {sorted(keys)} differ from those of the "
                                f"other parameters of its flat partition {sorted(state_keys)}",
                                tensor=group_path)
            for key, path in stored.items():
                tensor = ckpt[path]
                if tensor.shape == ():
                    def scalar(values: np.ndarray[Any, Any], key: str = key,
                               path: str = path, fp: _FlatPlan = fp) -> None:
                        known = fp.scalars.get(key)
                        if known is not None and known.tobytes() != values.tobytes():
                            raise LoadError(
                                f"{key} is {values.item()} here and {known.item()} for other "
                                "parameters of the same flat partition", tensor=path)
                        fp.scalars[key] = values

                    read(path, LocalMap((), (Piece((), ()),)), None, scalar)
                    continue
                _check_shape(ckpt, path, placed.shape)
                buffer = fp.shaped.get(key)
                if buffer is None:
                    buffer = fp.shaped[key] = np.zeros(size, dtype=tensor.dtype)
                elif buffer.dtype != tensor.dtype:
                    raise LoadError(f"stored as {tensor.dtype}, other parameters of the same "
                                    f"flat partition as {buffer.dtype}", tensor=path)
                read(path, lmap, buffer[slot.offset:slot.offset + slot.numel], None)
            live_state = inner.state.get(flat.master, {})
            for key, value in json_state.items():
                if key in fp.values and fp.raw_values[key] != value:
                    raise LoadError(f"{key} differs between parameters of the same flat "
                                    "partition", tensor=group_path)
                fp.raw_values[key] = value
                fp.values[key] = load_plan.value_like(live_state.get(key), value,
                                            where=f"{group_path}.{key}")
        if load_optimizer_states and inner is not None and state_keys is not None:
            live = set(inner.state.get(flat.master, {}))
            lacking = sorted(live - state_keys)
            if lacking:
                raise LoadError(f"the optimizer keeps states {lacking} that the checkpoint lacks",
                                tensor=state_path(flat.slots[0].param, lacking[0]))

    if load_optimizer_states and inner is not None:
        hyper = _param_group_values(ckpt, h)
        if hyper is not None:
            plan.hyper = [
                {key: load_plan.value_like(group.get(key), value,
                                 where=f"optimizer/param_groups[{g}].{key}")
                 for key, value in stored.items()}
                for g, (group, stored) in enumerate(zip(inner.param_groups, hyper, strict=True))]
        values = ckpt.values("optimizer") if "optimizer" in ckpt.groups else {}
        ds = values.get("deepspeed")
        plan.deepspeed = _global_state(engine.optimizer, ds if isinstance(ds, Mapping) else {})
    training = ckpt.values("training") if "training" in ckpt.groups else {}
    check_counters(training, where=ckpt.location)
    plan.training = training
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        scheduler = training.get("scheduler", training.get("lr_scheduler"))
        if scheduler is None:
            raise LoadError("the engine has an LR scheduler and the checkpoint no scheduler "
                            "state (training/scheduler); pass load_lr_scheduler_states=False",
                            path=ckpt.location)
        plan.scheduler = load_plan.value_like(engine.lr_scheduler.state_dict(), scheduler,
                                    where="training/scheduler")
    plan.client_state = {k: v for k, v in training.items() if k not in _ENGINE_KEYS}
    for key, path in _children(ckpt, "training").items():
        def client(values: np.ndarray[Any, Any], key: str = key) -> None:
            plan.client_state[key] = from_numpy(np.array(values, copy=True))

        tensor = ckpt[path]
        read(path, LocalMap(tensor.shape, (Piece(_whole(tensor.shape), _whole(tensor.shape)),)),
             None, client)
    values_read = read_locals(ckpt, reads)
    for got, then in zip(values_read, after, strict=True):
        if then is not None:
            then(got)
    return plan


def _whole(shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((0, int(n)) for n in shape)


def _param_group_values(ckpt: Checkpoint, h: Holdings) -> list[dict[str, Any]] | None:
    """The checkpoint's hyperparameters for each of the engine's param groups."""
    values = ckpt.values("optimizer") if "optimizer" in ckpt.groups else {}
    groups = values.get("param_groups")
    if not isinstance(groups, list):
        return None
    if len(groups) != len(h.group_names):
        raise LoadError(f"the checkpoint has {len(groups)} optimizer param groups, the engine "
                        f"{len(h.group_names)}", path="optimizer/param_groups")
    out = []
    for g, (stored, held) in enumerate(zip(groups, h.group_names, strict=True)):
        listed = set(stored.get("params", [])) if isinstance(stored, Mapping) else set()
        outside = [n for n in held if n not in listed]
        if outside:
            raise LoadError(f"param group {g} of the checkpoint does not list "
                            f"{outside[:3]}, which the engine's group {g} holds",
                            tensor=model_path(outside[0]), path="optimizer/param_groups")
        out.append({k: v for k, v in stored.items() if k != "params"})
    return out


# -- applying the plan ---------------------------------------------------------------------


def _apply(engine: Any, h: Holdings, plan: _Plan, *, load_optimizer_states: bool) -> None:
    opt = engine.optimizer
    inner = _inner(engine)
    prologue = getattr(opt, "checkpoint_event_prologue", None)
    if h.kind == ZERO3 and prologue is not None:
        prologue()
    with torch.no_grad():
        for fp in plan.flats:
            view = fp.flat.view(fp.flat.master)
            if h.kind == ZERO3:  # as DeepSpeed's loader: the whole partition, zero padding
                view.copy_(torch.from_numpy(fp.master))
            for slot in fp.flat.slots if h.kind != ZERO3 else ():
                view[slot.offset:slot.offset + slot.numel].copy_(
                    torch.from_numpy(fp.master[slot.offset:slot.offset + slot.numel]))
            if not load_optimizer_states or inner is None or not (
                    fp.shaped or fp.scalars or fp.values):
                continue
            state = inner.state.setdefault(fp.flat.master, {})
            for key, buffer in fp.shaped.items():
                new = from_numpy(buffer).view(fp.flat.master.shape)
                old = state.get(key)
                if (isinstance(old, torch.Tensor) and old.shape == new.shape
                        and old.dtype == new.dtype):
                    old.copy_(new)
                else:
                    state[key] = new.clone()
            for key, scalar in fp.scalars.items():
                state[key] = from_numpy(np.array(scalar, copy=True))
            state.update(fp.values)
        if load_optimizer_states and inner is not None and plan.hyper is not None:
            for group, stored in zip(inner.param_groups, plan.hyper, strict=True):
                group.update(stored)
        if load_optimizer_states:
            _load_global_state(opt, plan.deepspeed)
        for name, values in plan.frozen.items():
            param = h.params[name]
            target: torch.Tensor = (getattr(param.tensor, "ds_tensor") if param.partition  # noqa: B009
                                    is not None else param.tensor)
            target.data.view(-1)[:values.size].copy_(from_numpy(values).reshape(-1))
        for name, values in plan.buffers.items():
            buf, _ = h.buffers[name]
            buf.copy_(from_numpy(values).view(buf.shape))
    if h.kind == ZERO:
        if load_optimizer_states and getattr(opt, "_hp_optimizer_states_linked", None) is not None:
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        opt.update_lp_params()  # collective: every data-parallel rank
    elif h.kind == ZERO3:
        _refresh_zero3(opt)
        epilogue = getattr(opt, "checkpoint_event_epilogue", None)
        if epilogue is not None:
            epilogue()
    elif h.kind == FP32_COPIES:
        with torch.no_grad():
            for lps, masters in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
                for lp, master in zip(lps, masters, strict=True):
                    lp.data.copy_(master.data)
    # PLAIN: the parameters are the masters; nothing more to do


def _refresh_zero3(opt: Any) -> None:
    """The 16-bit partitions from the fp32 ones, as DeepSpeed's universal loader does."""
    with torch.no_grad():
        for sg, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
            if fp32.numel() > 0:
                opt.fp16_partitioned_groups_flat[sg].data.copy_(fp32.data)
        for sg, flat in enumerate(opt.fp16_partitioned_groups_flat):
            parts = opt.fp16_partitioned_groups[sg]
            for part, q in zip(parts, opt.unflatten(flat, parts), strict=True):
                part.data = q.data


def _global_state(opt: Any, ds: Mapping[str, Any]) -> dict[str, Any]:
    """Gradient clipping and the loss scaler's values the checkpoint has, shaped like the
    optimizer's own (``LoadError`` naming the value if one is of another kind)."""
    out: dict[str, Any] = {}
    for attr in ("clip_grad", "dynamic_loss_scale", "overflow"):
        if attr in ds and hasattr(opt, attr):
            out[attr] = load_plan.value_like(getattr(opt, attr), ds[attr],
                                   where=f"optimizer/deepspeed.{attr}")
    scaler = loss_scaler(opt)
    stored = ds.get("loss_scaler")
    if scaler is not None and isinstance(stored, Mapping):
        values: dict[str, Any] = {}
        for key, value in stored.items():
            current = getattr(scaler, key, None)
            if not isinstance(current, bool | int | float):
                continue
            if not isinstance(value, bool | int | float):
                raise LoadError(f"the stored value is {type(value).__name__}, the loss scaler "
                                "holds a number there",
                                path=f"optimizer/deepspeed.loss_scaler.{key}")
            values[key] = type(current)(value)
        out["loss_scaler"] = values
    return out


def _load_global_state(opt: Any, ds: Mapping[str, Any]) -> None:
    """Set what :func:`_global_state` planned."""
    for key, value in ds.items():
        if key != "loss_scaler":
            setattr(opt, key, value)
    scaler = loss_scaler(opt)
    for key, value in ds.get("loss_scaler", {}).items():
        setattr(scaler, key, value)


#: The engine's counters in ``training``: integers from 0 to 2**63 - 1 (DeepSpeed keeps
#: them as Python ints and logs them as int64 tensors).
COUNTERS = ("step", "global_samples", "skipped_steps")
_COUNTER_MAX = 2**63 - 1


def check_counters(training: Mapping[str, Any], *, where: str) -> None:
    """Refuse (:class:`~ucpformat.errors.LoadError`, naming the value) a counter of
    ``training`` that is not an integer from 0 to 2**63 - 1 (``"abc"``, ``1.5``, ``True``,
    ``-5``, ``2**70``), before anything of the engine changes; ``global_samples`` and
    ``skipped_steps`` without ``step`` are refused too (nothing would set them)."""
    for key in COUNTERS:
        if key not in training:
            continue
        value = training[key]
        if type(value) is not int or not 0 <= value <= _COUNTER_MAX:
            raise LoadError(
                f"is {value!r} ({type(value).__name__}); the engine's counter is an integer "
                f"from 0 to 2**63 - 1: refused, the engine is unchanged",
                path=where, tensor=f"training/{key}")
    if "step" not in training and any(k in training for k in COUNTERS[1:]):
        raise LoadError("training holds global_samples or skipped_steps but no step: refused, "
                        "the engine is unchanged", path=where, tensor="training/step")


def _apply_training(engine: Any, plan: _Plan, *, load_lr_scheduler_states: bool) -> int | None:
    """Set the engine's counters (checked by :func:`check_counters` when planned)."""
    training = plan.training
    step = training.get("step")
    if load_lr_scheduler_states and plan.scheduler is not None:
        engine.lr_scheduler.load_state_dict(plan.scheduler)
    if step is not None:
        engine.global_steps = step
        engine.global_samples = training.get("global_samples",
                                             step * engine.train_batch_size())
        engine.skipped_steps = training.get("skipped_steps", 0)
    return step if isinstance(step, int) else None


# -- the load ----------------------------------------------------------------------------------


def load(
    engine: Any,
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    rules: Any = None,
    rule_params: Mapping[str, Any] | None = None,
) -> LoadResult:
    """Collective: load the checkpoint at ``path`` (or ``path/tag``, or the one
    ``path/latest`` names) into ``engine``, on any world size, ZeRO stage and precision.

    Refuses, on every rank and before changing anything, a checkpoint whose model tensors
    differ from the engine's in name or shape (naming the tensor), that lacks a state
    the engine needs, or that a rank could not read.
    """
    from ucpformat.layout.rules import RuleSet

    comm: Communicator = communicator()
    error: BaseException | None = None
    h: Holdings | None = None
    ckpt: Checkpoint | None = None
    location = os.fspath(path)
    mine: list[str] = []
    try:
        location = _resolve(path, tag)[0]
        ckpt = open_location(path, tag)
        rule_set = rules if isinstance(rules, RuleSet) or rules is None else RuleSet.load(rules)
        h = holdings(engine, Naming(rule_set, dict(rule_params or {})))
        mine = list(h.params) + list(h.buffers) + list(h.aliases)
    except BaseException as exc:  # reported collectively
        error = exc
    gathered = comm.allgather({"error": error_report(error), "names": mine})
    try:
        raise_if_failed(failed_ranks([g["error"] for g in gathered]),
                        "opening the checkpoint", error)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    assert h is not None and ckpt is not None
    plan: _Plan | None = None
    try:
        plan = _plan(ckpt, engine, h, [g["names"] for g in gathered],
                     load_optimizer_states=load_optimizer_states,
                     load_lr_scheduler_states=load_lr_scheduler_states)
    except BaseException as exc:
        error = exc
    failed = gather_failures(comm, error)
    if failed:
        ckpt.close()
        if error is not None:
            raise error if isinstance(error, UCPError) else LoadError(
                f"loading failed: {error_report(error)}", path=location) from error
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
        raise LoadError(f"loading failed on other ranks ({detail}); the engine is unchanged",
                        path=location)
    assert plan is not None
    try:
        _apply(engine, h, plan, load_optimizer_states=load_optimizer_states)
        step = _apply_training(engine, plan, load_lr_scheduler_states=load_lr_scheduler_states)
        return LoadResult(location, step, plan.client_state, ckpt.stats.bytes_read, plan.notes)
    finally:
        ckpt.close()


__all__ = ["COUNTERS", "LoadResult", "check_counters", "load", "open_location",
           "resolve_location"]

"""Save a DeepSpeed engine straight into a consolidated UCP checkpoint.

Every rank describes what it holds (:mod:`ucpformat.deepspeed.rank_fragments`) as fragments of
consolidated tensors, views of its live tensors, and the distributed save pipeline
(:mod:`ucpformat.distributed.pipeline`) writes them: each stored object once, by one rank, with the
boundary cells of flat ZeRO partitions exchanged first; rank 0 commits after every rank
has written. What is stored (the layout ``ucp convert`` gives a DeepSpeed checkpoint):

* ``model/<p>``: every parameter in the model's data type (bf16/fp16 runs keep their
  16-bit weights: the module's under ZeRO-0/1/2, the partitions of ZeRO-3), frozen
  parameters and persistent buffers;
* ``optimizer/state/<p>/master``: the fp32 master weights of mixed-precision runs (in
  fp32 runs ``model/<p>`` is the master);
* ``optimizer/state/<p>/<s>``: every state the optimizer keeps for the flat tensor
  ``p`` lies in (``exp_avg``, ``exp_avg_sq``, ... cut like it; ``step`` and other
  zero-dimensional states as 0-d arrays, other scalars as JSON values of the group);
* the ``optimizer`` group's values: ``type``, ``param_groups`` (hyperparameters and
  consolidated names), ``master_weights`` and ``deepspeed`` (``clip_grad``, the loss
  scaler's state);
* the ``training`` group: ``step`` (``global_steps``), ``global_samples``,
  ``skipped_steps``, ``scheduler`` (the LR scheduler's ``state_dict``), and the client
  state: JSON values, and tensors as arrays ``training/<key>``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.distributed.comm import Communicator, error_report, failed_ranks
from ucpformat.distributed.pipeline import (
    DistributedSaveResult,
    Fragment,
    FragmentList,
    raise_if_failed,
)
from ucpformat.distributed.pipeline import save as run_pipeline
from ucpformat.distributed.save_plan import TensorSpec
from ucpformat.errors import InvalidValueError, UnsupportedFeatureError
from ucpformat.format import names
from ucpformat.layout.boxes import Box, as_slices, box_shape, box_size
from ucpformat.torch.comm import ProcessGroup, checkpoint_group, communicator
from ucpformat.torch.numpy_bridge import data_type, to_numpy
from ucpformat.torch.staging import (
    Copier,
    DeviceCopier,
    HostBufferPool,
    Recorder,
    Snapshot,
    Stager,
    Staging,
)
from ucpformat.torch.state import to_json

from .rank_fragments import Holdings, Naming, Placed, holdings, inner_optimizer

#: Keys of the ``training`` group that the engine's own counters and scheduler use.
TRAINING_KEYS = ("step", "global_samples", "skipped_steps", "scheduler")
#: Root metadata ``source.format`` of checkpoints this module writes.
PRODUCER = "ucpformat.deepspeed"

Getter = Callable[[], np.ndarray[Any, Any]]


def model_path(name: str) -> str:
    return names.path_of("model", name)


def state_path(name: str, state: str) -> str:
    return names.path_of("optimizer", "state", name, state)


class EngineFragments:
    """A :class:`ucpformat.distributed.pipeline.FragmentSource` over an engine's live tensors.

    Each fragment is a view of an engine tensor (``tensor``, :meth:`add`). Those on a
    device (a GPU) reach host memory through ``staging`` (a
    :class:`~ucpformat.torch.staging.Stager`: a bounded pool of pinned buffers, each
    copied ahead of the write step and returned once written), as in
    ``save_distributed`` and the DCP plugin; the others are numpy views taken when the
    pipeline asks for them. Either way the engine must not change until the save
    returns (an asynchronous save snapshots first: :meth:`snapshot`).
    """

    def __init__(self, staging: Staging | None = None) -> None:
        self.items: dict[str, list[tuple[Box, torch.Tensor, Getter]]] = {}
        self.staging = staging if staging is not None else Staging()
        self._stager: Stager | None = None
        self._lock = threading.Lock()

    def add(self, path: str, box: Box, tensor: torch.Tensor, view: Getter | None = None) -> None:
        """Fragment ``box`` of ``path``: the elements of ``tensor`` (``box_size(box)`` of
        them, a view of an engine tensor); ``view`` gives them as a numpy view without a
        copy where ``tensor`` is a strided slice (default: ``to_numpy(tensor)``)."""
        self.items.setdefault(path, []).append(
            (box, tensor, view if view is not None else lambda: to_numpy(tensor)))

    @staticmethod
    def key(path: str, index: int) -> str:
        """The staging key of the ``index``-th fragment of ``path``."""
        return f"{path}#{index}"

    @property
    def stager(self) -> Stager:
        """The staging area of the fragments ``staging`` stages (made at first use)."""
        with self._lock:  # the pipeline's writing threads may ask first
            if self._stager is None:
                self._stager = self.staging.stager({
                    self.key(path, i): tensor for path, held in self.items.items()
                    for i, (_, tensor, _) in enumerate(held) if self.staging.stages(tensor)})
            return self._stager

    def boxes(self) -> list[tuple[str, Box]]:
        return [(path, box) for path, held in self.items.items() for box, _, _ in held]

    def fragments(self, path: str) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        out = []
        for i, (box, _, view) in enumerate(self.items.get(path, ())):
            key = self.key(path, i)
            arr = self.stager.get(key) if key in self.stager else view()
            out.append((box, arr.reshape(box_shape(box))))
        return out

    def _staged_keys(self, path: str) -> list[str]:
        return [k for k in (self.key(path, i) for i in range(len(self.items.get(path, ()))))
                if k in self.stager]

    def schedule(self, keys: Sequence[str]) -> None:
        """The pipeline's write order: copying may start (the caller's stream first)."""
        self.stager.schedule([k for path in keys for k in self._staged_keys(path)])

    def release(self, key: str) -> None:
        """The pipeline is done with tensor ``key``: its fragments' buffers return."""
        for k in self._staged_keys(key):
            self.stager.release(k)

    def stop(self) -> None:
        """Copies end and every buffer returns to the pool (after success or failure)."""
        self.stager.stop()

    def tensors(self) -> list[torch.Tensor]:
        """Every fragment's tensor (what a snapshot copies)."""
        return [tensor for held in self.items.values() for _, tensor, _ in held]

    def snapshot(self, snap: Snapshot, recorder: Recorder | None = None) -> FragmentList:
        """Copies of every fragment into ``snap``'s host buffers, for a save that runs
        while the engine trains on (each copy enqueued after the caller's stream;
        ``snap.guard()`` then makes that stream wait for them, ``snap.wait()`` the
        host)."""
        return FragmentList([
            Fragment(path, box,
                     snap.add(self.key(path, i), tensor, recorder).reshape(box_shape(box)))
            for path, held in self.items.items() for i, (box, tensor, _) in enumerate(held)])


@dataclass
class Collected:
    """What one rank contributes to a save."""

    specs: dict[str, TensorSpec] = field(default_factory=dict)
    source: EngineFragments = field(default_factory=EngineFragments)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per optimizer param group: the consolidated names of its parameters held here
    param_groups: list[list[str]] = field(default_factory=list)
    hyper: list[dict[str, Any]] = field(default_factory=list)

    def spec(self, path: str, shape: Sequence[int], dtype: torch.dtype, role: str,
             layout: Mapping[str, Any] | None = None) -> None:
        ucp: dict[str, Any] = {"role": role}
        if layout:
            ucp["layout"] = dict(layout)
        self.specs[path] = TensorSpec(path, tuple(shape), data_type(dtype, tensor=path).name,
                                      {"ucp": ucp})

    def values(self, group: str) -> dict[str, Any]:
        values: dict[str, Any] = self.groups.setdefault(group, {}).setdefault("values", {})
        return values


def _box_view(tensor: torch.Tensor, local: Box) -> Getter:
    return lambda: to_numpy(tensor.detach())[as_slices(local)]


def _add_flat(out: Collected, path: str, placed: Placed, start: int, numel: int,
              tensor: torch.Tensor, offset: int) -> None:
    """Elements [start, start + numel) of ``placed``'s local tensor, which lie at
    ``offset`` in the flat ``tensor``, as fragments of ``path``."""
    flat = tensor.detach().view(-1)
    for rel, box in placed.flat_pieces(start, start + numel):
        a = offset + rel
        out.source.add(path, box, flat[a:a + box_size(box)])


def _add_whole(out: Collected, path: str, placed: Placed, tensor: torch.Tensor) -> None:
    for piece in placed.lmap.pieces:
        out.source.add(path, piece.glob, tensor.detach()[as_slices(piece.local)],
                       _box_view(tensor, piece.local))


def collect(engine: Any, h: Holdings, client_state: Mapping[str, Any] | None,
            rank: int, staging: Staging | None = None) -> Collected:
    """This rank's specs, fragments and group values (no values are read yet; device
    tensors will be copied through ``staging``)."""
    out = Collected(source=EngineFragments(staging))
    inner = inner_optimizer(engine)
    slots = h.slots_of()
    trained = h.trained
    for name, param in h.params.items():
        placed = param.placed
        trainable = name in trained
        lp_dtype = param.tensor.dtype
        stored_dtype = lp_dtype if (h.mixed or not trainable) else torch.float32
        out.spec(model_path(name), placed.shape, stored_dtype, "parameter", placed.layout)
        if trainable and h.mixed:
            out.spec(state_path(name, "master"), placed.shape, torch.float32, "optimizer_state")
        # the model's own weights: in mixed precision, and for frozen parameters
        if h.mixed or not trainable:
            if param.partition is not None:  # ZeRO-3: this rank's part of the flat tensor
                start, numel = param.partition
                ds_tensor: torch.Tensor = getattr(param.tensor, "ds_tensor")  # noqa: B009
                _add_flat(out, model_path(name), placed, start, numel, ds_tensor, 0)
            else:
                _add_whole(out, model_path(name), placed, param.tensor)
        for flat, slot in slots.get(name, ()):
            master = state_path(name, "master") if h.mixed else model_path(name)
            _add_flat(out, master, placed, slot.start, slot.numel, flat.master, slot.offset)
            state = h.optimizer_state(inner, flat)
            for key, value in state.items():
                where = state_path(name, str(key))
                if not isinstance(key, str) or key == "master":
                    raise UnsupportedFeatureError(f"optimizer state named {key!r}", tensor=where)
                if isinstance(value, torch.Tensor) and value.shape == flat.master.shape:
                    out.spec(where, placed.shape, value.dtype, "optimizer_state")
                    _add_flat(out, where, placed, slot.start, slot.numel, value, slot.offset)
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    out.spec(where, (), value.dtype, "optimizer_state")
                    out.source.add(where, (), value.detach())
                elif isinstance(value, torch.Tensor):
                    raise UnsupportedFeatureError(
                        f"an optimizer state of shape {list(value.shape)}, neither the shape of "
                        f"the tensor it belongs to ({list(flat.master.shape)}) nor a scalar",
                        tensor=where)
                else:
                    out.values(names.path_of("optimizer", "state", name))[str(key)] = to_json(
                        value, where=where)
    for name, (buf, placed) in h.buffers.items():
        out.spec(model_path(name), placed.shape, buf.dtype, "buffer", placed.layout)
        _add_whole(out, model_path(name), placed, buf)
    if h.aliases:
        out.groups.setdefault("model", {})["aliases"] = dict(h.aliases)
    _param_groups(out, engine, h)
    if rank == 0:
        _training(out, engine, client_state or {})
    return out


def _param_groups(out: Collected, engine: Any, h: Holdings) -> None:
    """The consolidated names and hyperparameters of the optimizer's param groups."""
    inner = inner_optimizer(engine)
    if inner is None:
        return
    out.param_groups = [[] for _ in inner.param_groups]
    for group, held in zip(out.param_groups, h.group_names, strict=True):
        group.extend(held)
    out.hyper = [to_json({k: v for k, v in g.items() if k != "params"},
                         where=f"optimizer/param_groups[{i}]")
                 for i, g in enumerate(inner.param_groups)]


def _training(out: Collected, engine: Any, client_state: Mapping[str, Any]) -> None:
    values = out.values("training")
    values["step"] = int(engine.global_steps)
    values["global_samples"] = int(engine.global_samples)
    values["skipped_steps"] = int(engine.skipped_steps)
    if engine.lr_scheduler is not None:
        values["scheduler"] = to_json(engine.lr_scheduler.state_dict(), where="training/scheduler")
    for key, value in client_state.items():
        where = f"training/{key}"
        if not isinstance(key, str):
            raise InvalidValueError(f"client_state keys must be strings, got {key!r}",
                                    path="training")
        if key in TRAINING_KEYS:
            raise InvalidValueError(f"client_state[{key!r}] would replace the engine's own "
                                    f"{where}", path="training")
        if isinstance(value, torch.Tensor):
            path = names.path_of("training", key)
            tensor = value.detach().cpu().contiguous()
            out.spec(path, tuple(tensor.shape), tensor.dtype, "training_state")
            out.source.add(path, tuple((0, n) for n in tensor.shape), tensor)
        else:
            values[key] = to_json(value, where=where)


def _optimizer_values(engine: Any, h: Holdings, param_groups: list[list[str]],
                      hyper: list[dict[str, Any]]) -> dict[str, Any]:
    inner = inner_optimizer(engine)
    opt = engine.optimizer
    values: dict[str, Any] = {
        "type": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "param_groups": [{**hp, "params": ps} for hp, ps in zip(hyper, param_groups,
                                                               strict=True)],
    }
    if h.mixed:
        values["master_weights"] = "master"
    ds: dict[str, Any] = {"optimizer": type(opt).__name__, "zero_stage": h.zero_stage}
    for attr in ("clip_grad", "dynamic_loss_scale", "overflow"):
        value = getattr(opt, attr, None)
        if isinstance(value, bool | int | float):
            ds[attr] = value
    scaler = loss_scaler(opt)
    if scaler is not None:
        ds["loss_scaler"] = {k: v for k, v in vars(scaler).items()
                             if isinstance(v, bool | int | float | str)}
    values["deepspeed"] = ds
    return values


def loss_scaler(optimizer: Any) -> Any:
    """The object that keeps the loss scale of an fp16 optimizer (None without one)."""
    for attr in ("loss_scaler", "loss_scale_config"):
        scaler = getattr(optimizer, attr, None)
        if scaler is not None:
            return scaler
    return None


def _merge_param_groups(
    gathered: Sequence[Mapping[str, Any]]
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Every rank's param group names in rank order, each name once; rank 0's
    hyperparameters (every rank's must agree)."""
    first = gathered[0]
    groups: list[list[str]] = [[] for _ in first["param_groups"]]
    seen: list[set[str]] = [set() for _ in groups]
    for rank, doc in enumerate(gathered):
        if len(doc["param_groups"]) != len(groups) or doc["hyper"] != first["hyper"]:
            raise InvalidValueError(
                f"rank {rank}'s optimizer param groups differ from rank 0's (their number or "
                "hyperparameters)", path="optimizer/param_groups")
        for g, held in enumerate(doc["param_groups"]):
            for name in held:
                if name not in seen[g]:
                    seen[g].add(name)
                    groups[g].append(name)
    return groups, list(first["hyper"])


def _gather_param_groups(
    comm: Communicator, collected: Collected | None, error: BaseException | None
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Collective: every rank's param groups (raises on every rank if any failed)."""
    mine: dict[str, Any] = {"error": error_report(error), "param_groups": [], "hyper": []}
    if collected is not None:
        mine.update(param_groups=collected.param_groups, hyper=collected.hyper)
    gathered = comm.allgather(mine)
    raise_if_failed(failed_ranks([g["error"] for g in gathered]), "describing the engine",
                    error)
    return _merge_param_groups(gathered)


def checkpoint_location(path: str | os.PathLike[str], tag: str | None) -> str:
    """Where a save with ``tag`` goes: ``path/tag``, or ``path`` itself without a tag."""
    base = os.fspath(path)
    if tag is None:
        return base
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        raise InvalidValueError(f"bad tag {tag!r}: a name of one directory", path=base)
    return base.rstrip("/") + "/" + tag


def _write_latest(path: str | os.PathLike[str], tag: str) -> None:
    from ucpformat.store import open_store

    open_store(os.fspath(path)).put("latest", [tag.encode()], atomic=True)


# -- asynchronous saves ----------------------------------------------------------------------


class _Background:
    """One save at a time in a background thread, over its own gloo group; snapshots
    in host buffers (pinned where CUDA is available) reused from save to save."""

    def __init__(self) -> None:
        self.group: ProcessGroup | None = checkpoint_group()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-ds-save")
        self.pending: Future[DistributedSaveResult] | None = None
        self.lock = threading.Lock()
        #: a snapshot holds the rank's whole share until written: no bound
        self.buffers = HostBufferPool(None)
        self.copier: Copier = DeviceCopier()

    def wait(self) -> DistributedSaveResult | None:
        pending, self.pending = self.pending, None
        return None if pending is None else pending.result()


_background: _Background | None = None


def wait() -> DistributedSaveResult | None:
    """Wait for the asynchronous save in flight, if any; its result (raises its error)."""
    return _background.wait() if _background is not None else None


# -- the save ----------------------------------------------------------------------------------


def save(
    engine: Any,
    path: str | os.PathLike[str],
    *,
    client_state: Mapping[str, Any] | None = None,
    tag: str | None = None,
    async_: bool = False,
    rules: Any = None,
    rule_params: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    workers: int | None = None,
    durable: bool = True,
    metadata: Mapping[str, Any] | None = None,
    staging: Staging | None = None,
) -> DistributedSaveResult | Future[DistributedSaveResult]:
    """Collective: save ``engine`` (every rank calls it) into a UCP checkpoint at ``path``
    (``path/tag`` with a tag, and then ``path/latest`` names it, as DeepSpeed does).

    ``client_state``: JSON values and tensors of rank 0, stored in ``training``.
    ``rules`` (a rule file name, path or :class:`~ucpformat.layout.rules.RuleSet`) and
    ``rule_params``: how a tensor-parallel model's tensors are split. With ``async_``
    every rank copies what it holds and returns a future at once; the write runs in the
    background over a separate gloo group (:func:`wait` waits for it).

    Tensors on a device (a GPU) reach host memory as in ``save_distributed``: a
    synchronous save copies them through ``staging``'s bounded pool of pinned buffers,
    each ahead of its write (:class:`~ucpformat.torch.staging.Staging`, default: the
    shared pool); an asynchronous one copies every fragment into pinned buffers kept
    from save to save, on a side stream with one event per copy, and the caller's stream
    waits for those events (not the device) before training goes on (``staging``'s
    ``copier`` and ``recorder`` apply to it too).
    """
    global _background
    from ucpformat.layout.rules import RuleSet

    # first: a refused setting raises before any collective and before staging buffers
    # are taken
    options = SaveOptions(compression=compression, hash_algorithm=hash_algorithm,
                          overwrite=overwrite, workers=workers, durable=durable)
    comm = communicator()
    location = checkpoint_location(path, tag)
    error: BaseException | None = None
    collected: Collected | None = None
    h: Holdings | None = None
    try:
        rule_set = rules if isinstance(rules, RuleSet) or rules is None else RuleSet.load(rules)
        h = holdings(engine, Naming(rule_set, dict(rule_params or {})))
        collected = collect(engine, h, client_state, comm.rank, staging)
    except BaseException as exc:  # reported collectively
        error = exc
    param_groups, hyper = _gather_param_groups(comm, collected, error)
    assert collected is not None and h is not None
    groups = dict(collected.groups)
    meta: dict[str, Any] = {}
    if comm.rank == 0:
        if param_groups:
            groups.setdefault("optimizer", {})["values"] = _optimizer_values(
                engine, h, param_groups, hyper)
        meta = {"source": _source(engine, h, rules, rule_params), **dict(metadata or {})}
    kwargs: dict[str, Any] = dict(
        specs=list(collected.specs.values()), group_attributes=groups, metadata=meta,
        options=options,
    )

    def finish(result: DistributedSaveResult) -> DistributedSaveResult:
        if tag is not None and comm.rank == 0:
            _write_latest(path, tag)
        return result

    if not async_:
        try:
            return finish(run_pipeline(location, comm, source=collected.source, **kwargs))
        finally:
            collected.source.stop()  # every staging buffer returns, whatever happened
    if _background is None:
        _background = _Background()  # collective: a new process group
    background = _background
    with background.lock:
        background.wait()
        copier = staging.copier if staging is not None and staging.copier else background.copier
        recorder = staging.recorder if staging is not None else None
        snap = Snapshot(background.buffers, copier)
        try:
            copier.begin(collected.source.tensors())
            snapshot = collected.source.snapshot(snap, recorder)
            snap.guard(recorder)  # the caller's stream waits for each copy
        except BaseException:
            snap.wait()
            snap.release()
            raise
        bg_comm = communicator(background.group)

        def run() -> DistributedSaveResult:
            try:
                snap.wait()  # the host waits for each copy's event
                return finish(run_pipeline(location, bg_comm, source=snapshot, **kwargs))
            finally:
                snap.release()  # the buffers serve the next snapshot

        background.pending = background.pool.submit(run)
        return background.pending


def _source(engine: Any, h: Holdings, rules: Any, rule_params: Mapping[str, Any] | None
            ) -> dict[str, Any]:
    import deepspeed

    source: dict[str, Any] = {
        "format": "deepspeed",
        "producer": PRODUCER,
        "ds_version": str(deepspeed.__version__),
        "zero_stage": h.zero_stage,
        "optimizer": type(engine.optimizer).__name__ if engine.optimizer is not None else None,
        "model_dtype": str(h.model_dtype).removeprefix("torch."),
        "dp_world_size": h.dp[1],
        "tp_world_size": h.tp[1],
        "pp_world_size": h.pp[1],
    }
    if rules is not None:
        source["rules"] = getattr(rules, "name", str(rules))
        source["rule_params"] = to_json(dict(rule_params or {}), where="rule_params")
    return source


__all__ = ["PRODUCER", "TRAINING_KEYS", "EngineFragments", "checkpoint_location", "collect",
           "loss_scaler", "model_path", "save", "state_path", "wait"]

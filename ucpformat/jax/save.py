"""Save a JAX training state from every process, straight into one UCP checkpoint.

Each process describes the boxes of the arrays its devices hold and hands them to the
one distributed save (:meth:`ucpformat.distributed.pipeline.DistributedSave.run`). A box
several devices hold (a replicated mesh axis) is written once: by the process of the
lowest device id that holds it, a rule every process applies to the sharding alone,
without talking to the others. Host values (numpy arrays), and in a run of several
processes the arrays that live on one process's devices alone (a ``jax.random.key`` made
locally), are taken from process 0, as torch's plain tensors are from rank 0. Values are
copied from a device only when the pipeline asks for them (:func:`save`), or all at once
before the write starts (:func:`save_async`, which then writes in a thread)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.distributed.comm import Communicator
from ucpformat.distributed.pipeline import DistributedSave, DistributedSaveResult
from ucpformat.distributed.rank_description import TensorSpec
from ucpformat.engine.chunking import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MIN_SHARD_BYTES,
    DEFAULT_SHARD_BYTES,
)
from ucpformat.errors import InvalidValueError
from ucpformat.format import dtypes, names
from ucpformat.jax.comm import communicator
from ucpformat.jax.tree import (
    OPT_STATE,
    PARAMS,
    KeyMap,
    Leaf,
    hyperparameters,
    is_array,
    is_key,
    layout,
    param_fqns,
    sections,
)
from ucpformat.layout.boxes import Box, box_shape, box_size
from ucpformat.optional import require
from ucpformat.store import Store

#: Gives a fragment's values on the host, shaped like its box (stored orientation).
Getter = Callable[[], np.ndarray[Any, Any]]


def _jax() -> Any:
    return require("jax", extra="jax", purpose="ucpformat.jax")


def box_of(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """The box ``[(start, stop), ...]`` of a shard's ``index`` (a tuple of slices)."""
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise InvalidValueError(f"a shard index with step {step} is not a box")
        out.append((start, stop))
    return tuple(out)


def permuted(box: Box, perm: tuple[int, ...] | None) -> Box:
    """The box in stored axes (``perm``: see :class:`~ucpformat.jax.tree.Rename`)."""
    return box if perm is None else tuple(box[p] for p in perm)


def owned_shards(array: Any) -> list[tuple[Box, Any]]:
    """(box, shard) of every box this process writes: each distinct non-empty box of a
    ``jax.Array`` is written by the process of the lowest device id that holds it."""
    shape = tuple(int(n) for n in array.shape)
    owner: dict[Box, int] = {}
    for device, index in array.sharding.devices_indices_map(shape).items():
        box = box_of(index, shape)
        if box_size(box) and (box not in owner or device.id < owner[box]):
            owner[box] = device.id
    local = {shard.device.id: shard for shard in array.addressable_shards}
    return [(box, local[d]) for box, d in owner.items() if d in local]


def host_value(value: Any) -> np.ndarray[Any, Any]:
    """A small array's whole value on this host (a replicated jax.Array's local copy)."""
    shards = getattr(value, "addressable_shards", None)
    if shards is not None and not getattr(value, "is_fully_addressable", True):
        return np.asarray(shards[0].data)
    return np.asarray(value)


def _to_host(data: Any, perm: tuple[int, ...] | None) -> np.ndarray[Any, Any]:
    arr = np.asarray(data)
    return arr if perm is None else np.ascontiguousarray(np.transpose(arr, perm))


def saved_with(array: Any) -> dict[str, Any] | None:
    """Informative: the mesh and PartitionSpec a ``NamedSharding`` array was saved with."""
    sharding = getattr(array, "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return None
    return {
        "framework": "jax",
        "mesh": [int(n) for n in mesh.devices.shape],
        "mesh_axis_names": [str(a) for a in mesh.axis_names],
        "partition_spec": [None if p is None else [str(a) for a in p] if isinstance(p, tuple)
                           else str(p) for p in spec],
    }


def _json(value: Any, where: str) -> Any:
    """A non-array leaf as a JSON value (a scalar array becomes its number)."""
    if is_array(value):
        return host_value(value).tolist()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise InvalidValueError(f"{where}: a {type(value).__name__} is neither an array nor a "
                            "JSON value", path=where)


@dataclass
class Collected:
    """What one process saves: every tensor's spec, the boxes it writes with a way to
    get their values, and the JSON values by group."""

    specs: list[TensorSpec] = field(default_factory=list)
    parts: dict[str, list[tuple[Box, Getter]]] = field(default_factory=dict)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)

    def values(self, group: str) -> dict[str, Any]:
        values: dict[str, Any] = self.groups.setdefault(group, {}).setdefault("values", {})
        return values

    def boxes(self) -> list[tuple[str, Box]]:
        return [(path, box) for path, parts in self.parts.items() for box, _ in parts]

    def fragments(self, path: str) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        return [(box, get().reshape(box_shape(box))) for box, get in self.parts.get(path, ())]

    def snapshot(self) -> Collected:
        """The same with every value copied to the host now (device copies started
        together, then awaited)."""
        jax = _jax()
        for parts in self.parts.values():
            for _, get in parts:
                source = getattr(get, "device_data", None)
                if isinstance(source, jax.Array):
                    source.copy_to_host_async()
        held = {path: [(box, _constant(get())) for box, get in parts]
                for path, parts in self.parts.items()}
        return Collected(self.specs, held, self.groups)


class _FromDevice:
    """A getter of one shard's values: the device buffer, copied when called."""

    def __init__(self, data: Any, perm: tuple[int, ...] | None) -> None:
        self.device_data = data
        self.perm = perm

    def __call__(self) -> np.ndarray[Any, Any]:
        return _to_host(self.device_data, self.perm)


def shard_parts(array: Any, perm: tuple[int, ...] | None = None
                ) -> list[tuple[Box, Getter]]:
    """(box in stored axes, getter of its values) of every box of ``array`` (a
    ``jax.Array``) that this process writes (:func:`owned_shards`)."""
    return [(permuted(box, perm), _FromDevice(shard.data, perm))
            for box, shard in owned_shards(array)]


def _constant(value: np.ndarray[Any, Any]) -> Getter:
    return lambda: value


def collect(state: Any, *, rank: int, step: int | None = None, keymap: KeyMap | None = None,
            optimizer_type: str | None = None) -> Collected:
    """Every leaf of ``state`` placed (:func:`ucpformat.jax.tree.layout`), with the boxes
    this process writes (process ``rank``: host values are written by rank 0)."""
    jax = _jax()
    leaves = layout(state, keymap=keymap)
    out = Collected()
    names_given = {name for name, _ in sections(state)}
    if step is not None:
        if "step" in names_given:
            raise InvalidValueError("step= is given and the state has a step", path="step")
        leaves.append(Leaf(("step",), "value", "training", int(step), key="step"))
    if PARAMS in names_given:
        out.groups.setdefault("model", {})
    for leaf in leaves:
        if leaf.kind == "value":
            value = _json(leaf.value, leaf.where)
            if (leaf.key == "step" and leaf.path == "training"
                    and (not isinstance(value, int) or isinstance(value, bool))):
                raise InvalidValueError(f"the step must be an integer, got {value!r}",
                                            path="step")
            out.values(leaf.path)[leaf.key] = value
        elif leaf.kind == "count":
            count = host_value(leaf.value)
            if count.shape != ():
                raise InvalidValueError("an Adam count must be a scalar", path=leaf.where)
            step_value = np.asarray(count, dtype=np.float32)
            for path in leaf.steps:
                out.specs.append(TensorSpec(path, (), "float32",
                                            {"ucp": {"role": "optimizer_state"}}))
                if rank == 0:
                    out.parts[path] = [((), _constant(step_value))]
        else:
            _collect_array(jax, out, leaf, rank)
    if OPT_STATE in names_given:
        opt_state = dict(sections(state))[OPT_STATE]
        fqns = param_fqns(leaves) or [
            names.split_path(leaf.path)[1] for leaf in leaves
            if leaf.kind == "array" and leaf.role == "parameter"]
        out.values("optimizer").update({
            "type": optimizer_type or "optax",
            "param_groups": [{**hyperparameters(opt_state), "params": fqns}],
        })
    return out


def _collect_array(jax: Any, out: Collected, leaf: Leaf, rank: int) -> None:
    value = leaf.value
    ucp: dict[str, Any] = {"role": leaf.role}
    if is_key(value):
        ucp["prng_impl"] = str(jax.random.key_impl(value))
        value = jax.random.key_data(value)
    if isinstance(value, jax.ShapeDtypeStruct):
        raise InvalidValueError("a ShapeDtypeStruct has no values to save", path=leaf.where)
    shape = tuple(int(n) for n in value.shape)
    perm = leaf.perm
    if perm is not None and sorted(perm) != list(range(len(shape))):
        raise InvalidValueError(f"axes {list(perm)} do not permute a {len(shape)}-d array",
                                path=leaf.where)
    stored_shape = shape if perm is None else tuple(shape[p] for p in perm)
    dt = dtypes.from_numpy(np.dtype(value.dtype), tensor=leaf.path)
    info = saved_with(value)
    if info is not None:
        ucp["saved_with"] = info
    out.specs.append(TensorSpec(leaf.path, stored_shape, dt.name, {"ucp": ucp}))
    if isinstance(value, jax.Array) and (jax.process_count() == 1
                                         or not value.is_fully_addressable):
        parts = shard_parts(value, perm)
    elif rank == 0 and box_size(tuple((0, n) for n in stored_shape)):
        # a host value, or an array on this process's devices alone: rank 0's is stored
        host = host_value(value)
        parts = [(tuple((0, n) for n in stored_shape), _constant(_to_host(host, perm)))]
    else:
        parts = []
    if parts:
        out.parts[leaf.path] = parts


def save(
    path: str | os.PathLike[str] | Store,
    state: Any,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    keymap: KeyMap | None = None,
    optimizer_type: str | None = None,
    comm: Communicator | None = None,
    options: SaveOptions | None = None,
    overwrite: bool = False,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    workers: int | None = None,
    durable: bool = True,
    progress: bool = False,
) -> DistributedSaveResult:
    """Collective: every process calls it with its view of the same ``state`` (a pytree:
    see :mod:`ucpformat.jax.tree` for what goes where); one checkpoint results.

    Each process writes only boxes its devices hold, each box once over all processes.
    ``step`` goes to ``training`` (unless the state has one); ``keymap`` stores
    parameters under other names and axes (:mod:`ucpformat.jax.mapping`);
    ``optimizer_type`` is the ``optimizer`` group's ``type`` (default ``"optax"``).
    ``comm``: default :func:`ucpformat.jax.comm.communicator`. The save's settings are
    ``options`` or the same fields as keywords (:class:`ucpformat.checkpoint.options.SaveOptions`).
    Raises on every process if any fails; then nothing is committed (see
    :mod:`ucpformat.distributed.pipeline`)."""
    settings = SaveOptions.merged(
        options, overwrite=overwrite, compression=compression, hash_algorithm=hash_algorithm,
        chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, min_shard_bytes=min_shard_bytes,
        workers=workers, durable=durable, progress=progress)
    comm = comm if comm is not None else communicator()
    collected = collect(state, rank=comm.rank, step=step, keymap=keymap,
                        optimizer_type=optimizer_type)
    return _write(path, comm, collected, settings, metadata)


def _write(path: str | os.PathLike[str] | Store, comm: Communicator, collected: Collected,
           settings: SaveOptions, metadata: Mapping[str, Any] | None) -> DistributedSaveResult:
    return DistributedSave(path, comm, settings).run(
        collected.specs, collected, group_attributes=collected.groups, metadata=metadata)


def save_async(
    path: str | os.PathLike[str] | Store,
    state: Any,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    keymap: KeyMap | None = None,
    optimizer_type: str | None = None,
    comm: Communicator | None = None,
    options: SaveOptions | None = None,
    overwrite: bool = False,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    workers: int | None = None,
    durable: bool = True,
) -> Future[DistributedSaveResult]:
    """:func:`save` that returns once this process's boxes are copied to host memory;
    the write runs in a thread. The future's ``result()`` raises what the save raised.
    Every process must call it (and the next collective of this communicator) in the
    same order; the state may change as soon as it returns."""
    settings = SaveOptions.merged(
        options, overwrite=overwrite, compression=compression, hash_algorithm=hash_algorithm,
        chunk_bytes=chunk_bytes, shard_bytes=shard_bytes, min_shard_bytes=min_shard_bytes,
        workers=workers, durable=durable)
    comm = comm if comm is not None else communicator()
    collected = collect(state, rank=comm.rank, step=step, keymap=keymap,
                        optimizer_type=optimizer_type).snapshot()
    future: Future[DistributedSaveResult] = Future()

    def run() -> None:
        try:
            future.set_result(_write(path, comm, collected, settings, metadata))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="ucpformat-jax-save", daemon=False).start()
    return future


__all__ = ["Collected", "box_of", "collect", "owned_shards", "save", "save_async",
           "shard_parts"]

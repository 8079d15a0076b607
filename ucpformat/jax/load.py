"""Load a UCP checkpoint into a JAX training state on any mesh, or onto the host.

With a target (a pytree of ``jax.ShapeDtypeStruct`` with shardings, as ``jax.eval_shape``
gives, or of arrays), every leaf is placed as :func:`ucpformat.jax.save.save` places it,
every name, shape and data type is checked against the checkpoint's metadata before
anything is read, and then each process reads only the boxes its own devices need
(``sharding.addressable_devices_indices_map``), each box once, in one batch, and builds
the arrays (``jax.make_array_from_single_device_arrays``), a batch of leaves placed on
the devices while the next is read. No process talks to another.

The reads land in host buffers aligned to :data:`HOST_ALIGNMENT` bytes, and each device
is given a contiguous, aligned view of its box where the read holds one (a box of whole
rows, or the whole array): JAX's CPU client then uses that memory as the device buffer
instead of copying it, so a CPU load copies only the boxes that are not such views (one
copy per distinct box, shared by the devices that hold it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucpformat.checkpoint.reader import Checkpoint, Region, open_checkpoint
from ucpformat.errors import KeyMismatchError, LoadError, ShapeMismatchError
from ucpformat.jax.save import box_of, permuted
from ucpformat.jax.tree import (
    OPT_STATE,
    PARAMS,
    STEP,
    KeyMap,
    Leaf,
    is_array,
    is_key,
    layout,
    rebuild,
)
from ucpformat.layout.boxes import Box, box_shape, box_size
from ucpformat.optional import require
from ucpformat.store import Store

#: A load reads its boxes in batches of about this many bytes, and places each batch on
#: the devices (a thread) while the next is read.
BATCH_BYTES = 32 << 20
#: The alignment, in bytes, of the host buffers a load reads into: XLA's CPU client
#: takes a host buffer as a device buffer without a copy only when it is this aligned.
HOST_ALIGNMENT = 64


def _jax() -> Any:
    return require("jax", extra="jax", purpose="ucpformat.jax")


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
    """A new C-contiguous array whose data starts on a :data:`HOST_ALIGNMENT` boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    out: np.ndarray[Any, Any] = raw[start : start + nbytes].view(dtype).reshape(shape)
    return out


def _is_aligned(data: np.ndarray[Any, Any]) -> bool:
    return bool(data.flags.c_contiguous) and data.ctypes.data % HOST_ALIGNMENT == 0


@dataclass
class _Planned:
    """One array leaf's reads: the target's shape and sharding, and its boxes."""

    leaf: Leaf
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any  # None: the whole array on the host (numpy) or the default device
    boxes: list[Box]  # the distinct boxes this process's devices need
    reads: list[Box]  # what is read: their bounding box where they tile it, else them
    prng_impl: str | None = None


def covering(boxes: list[Box]) -> list[Box]:
    """The boxes to read for ``boxes`` (distinct, not overlapping, as a sharding's are):
    their bounding box when they tile it, so that each stored chunk is read once, not
    once per box that overlaps it; else the boxes themselves."""
    if len(boxes) < 2:
        return list(boxes)
    bound = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes))
                  for d in range(len(boxes[0])))
    if box_size(bound) == sum(box_size(b) for b in boxes):
        return [bound]
    return list(boxes)


def _within(box: Box, reads: list[Box]) -> tuple[int, tuple[slice, ...]]:
    """The read holding ``box``, and ``box``'s place in it."""
    for i, r in enumerate(reads):
        if all(r0 <= b0 and b1 <= r1 for (b0, b1), (r0, r1) in zip(box, r, strict=True)):
            return i, tuple(slice(b0 - r0, b1 - r0) for (b0, b1), (r0, _) in
                            zip(box, r, strict=True))
    raise AssertionError(f"box {box} lies in no read")  # covering() always covers


def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def _plan_array(jax: Any, ckpt: Checkpoint, leaf: Leaf) -> _Planned:
    target = leaf.value
    stored = ckpt.arrays.get(leaf.path)
    if stored is None:
        raise KeyMismatchError(f"{leaf.where}: the checkpoint has no tensor {leaf.path!r}",
                               tensor=leaf.path)
    shape = tuple(int(n) for n in target.shape)
    dtype = target.dtype
    impl = None
    if is_key(target):
        impl = stored.ucp.get("prng_impl")
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        shape, dtype = tuple(data.shape), data.dtype
        if impl is None:
            raise LoadError(f"{leaf.where}: the target is a PRNG key, but {leaf.path!r} is "
                            "not stored as one (no attributes.ucp.prng_impl)", tensor=leaf.path)
    perm = leaf.perm
    want = shape if perm is None else tuple(shape[p] for p in perm)
    have = tuple(int(n) for n in stored.shape)
    stored_dtype = ckpt[leaf.path].dtype
    if want != have or np.dtype(dtype) != stored_dtype:
        raise ShapeMismatchError(
            f"{leaf.where}: the target is {np.dtype(dtype).name} of shape {list(want)}"
            f"{' (axes permuted)' if perm else ''}; the checkpoint holds "
            f"{stored_dtype.name} of shape {list(have)}", tensor=leaf.path)
    sharding = None if impl else getattr(target, "sharding", None)
    if sharding is None:
        boxes = [_whole(shape)]
    else:
        boxes = list(dict.fromkeys(
            box_of(index, shape)
            for index in sharding.addressable_devices_indices_map(shape).values()))
    return _Planned(leaf, shape, dtype, sharding, boxes, covering(boxes), impl)


def _check_count(ckpt: Checkpoint, leaf: Leaf) -> None:
    for path in leaf.steps:
        stored = ckpt.arrays.get(path)
        if stored is None:
            raise KeyMismatchError(f"{leaf.where}: the checkpoint has no tensor {path!r} "
                                   "(an Adam state's step)", tensor=path)
        if tuple(stored.shape) != ():
            raise ShapeMismatchError(f"{leaf.where}: {path!r} is not a scalar", tensor=path)
    if not leaf.steps:
        raise LoadError(f"{leaf.where}: an Adam state of no parameters", path=leaf.where)


def _value_of(ckpt: Checkpoint, leaf: Leaf) -> Any:
    if leaf.path not in ckpt.groups and leaf.path != "":
        raise KeyMismatchError(f"{leaf.where}: the checkpoint has no group {leaf.path!r}",
                               path=leaf.path)
    values = ckpt.values(leaf.path)
    if leaf.key not in values:
        raise KeyMismatchError(f"{leaf.where}: the checkpoint has no value {leaf.key!r} in "
                               f"{leaf.path!r}", path=leaf.path)
    return values[leaf.key]


def _as_target(jax: Any, value: Any, target: Any, where: str) -> Any:
    """A JSON value as the target leaf is: an array of its dtype (and sharding), or as is."""
    if not is_array(target):
        return value
    arr = np.asarray(value, dtype=target.dtype)
    if tuple(arr.shape) != tuple(target.shape):
        raise ShapeMismatchError(f"{where}: the target has shape {list(target.shape)}; the "
                                 f"checkpoint holds {value!r}", path=where)
    if isinstance(target, np.ndarray):
        return arr
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        return jax.numpy.asarray(arr)
    # each process builds its own devices' shards: no communication
    return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])


def load(
    path: str | os.PathLike[str] | Store | Checkpoint,
    target: Any = None,
    *,
    keymap: KeyMap | None = None,
    workers: int | None = None,
) -> Any:
    """``target`` with every leaf loaded from the checkpoint at ``path`` (same structure,
    each array on the target's sharding); with no target, the checkpoint on the host
    (:func:`host_state`). Leaves are placed as :func:`ucpformat.jax.save.save` places
    them (``keymap``: the same map the save used, or one from another framework's names:
    :mod:`ucpformat.jax.mapping`). A missing tensor or value, or a shape or data type
    that differs, raises a :class:`~ucpformat.errors.LoadError` naming the leaf before
    anything is read. Not collective: each process reads what its devices hold."""
    if target is None:
        return host_state(path)
    jax = _jax()
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path, workers=workers)
    try:
        leaves = layout(target, keymap=keymap)
        planned: list[_Planned] = []
        values: dict[tuple[str, ...], Any] = {}
        counts: list[Leaf] = []
        for leaf in leaves:  # every check before any read
            if leaf.kind == "array":
                planned.append(_plan_array(jax, ckpt, leaf))
            elif leaf.kind == "count":
                _check_count(ckpt, leaf)
                counts.append(leaf)
            else:
                values[leaf.at] = _as_target(jax, _value_of(ckpt, leaf), leaf.value, leaf.where)
        stored = [(p, permuted(box, p.leaf.perm)) for p in planned for box in p.reads]
        ckpt.check_new_arrays([(p.leaf.path, box_size(sb) * np.dtype(p.dtype).itemsize)
                               for p, sb in stored])
        with ThreadPoolExecutor(1, thread_name_prefix="ucp-jax-place") as placer:
            placed = []
            for batch in _batches(planned):  # placed on the devices while the next is read
                regions = [Region(p.leaf.path, [a for a, _ in sb], [b for _, b in sb],
                                  aligned_empty(box_shape(sb), ckpt[p.leaf.path].dtype))
                           for p in batch for sb in (permuted(box, p.leaf.perm)
                                                     for box in p.reads)]
                placed.append(placer.submit(_place, jax, batch, ckpt.read_regions(regions)))
            for done in placed:
                values.update(done.result())
        read = iter(ckpt.read_regions([Region(s, [], []) for leaf in counts
                                       for s in leaf.steps]))
        for leaf in counts:
            steps = {float(next(read)) for _ in leaf.steps}
            if len(steps) != 1 or not float(next(iter(steps))).is_integer():
                raise LoadError(f"{leaf.where}: the parameters' steps differ or are not whole "
                                f"numbers: {sorted(steps)}", path=leaf.where)
            values[leaf.at] = _as_target(jax, int(steps.pop()), leaf.value, leaf.where)
        return rebuild(target, values)
    finally:
        if not isinstance(path, Checkpoint):
            ckpt.close()


def _batches(planned: list[_Planned]) -> list[list[_Planned]]:
    """The leaves in order, in batches of at least :data:`BATCH_BYTES` (but the last)."""
    out: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if size >= BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += sum(box_size(b) for b in p.reads) * np.dtype(p.dtype).itemsize
    return out


def _place(jax: Any, batch: list[_Planned],
           reads: list[np.ndarray[Any, Any]]) -> dict[tuple[str, ...], Any]:
    """The arrays of a batch of leaves, from their reads (in the batch's order)."""
    out = {}
    it = iter(reads)
    for p in batch:
        mine = [_unpermute(next(it), p.leaf.perm) for _ in p.reads]
        boxes = {}
        for box in p.boxes:
            i, where = _within(box, p.reads)
            boxes[box] = mine[i][where] if where else mine[i]
        out[p.leaf.at] = _build(jax, p, boxes)
    return out


def _unpermute(data: np.ndarray[Any, Any], perm: tuple[int, ...] | None) -> np.ndarray[Any, Any]:
    if perm is None:
        return data
    view = np.transpose(data, tuple(int(i) for i in np.argsort(perm)))
    out = aligned_empty(view.shape, view.dtype)
    np.copyto(out, view)
    return out


def _build(jax: Any, p: _Planned, boxes: Mapping[Box, np.ndarray[Any, Any]]) -> Any:
    target = p.leaf.value
    if p.prng_impl is not None:
        (data,) = boxes.values()
        key = jax.random.wrap_key_data(data, impl=p.prng_impl)
        sharding = getattr(target, "sharding", None)
        return jax.device_put(key, sharding) if sharding is not None else key
    if p.sharding is None:
        (data,) = boxes.values()
        return data if isinstance(target, np.ndarray) else jax.numpy.asarray(data)
    hosts: dict[Box, np.ndarray[Any, Any]] = {}
    for box, data in boxes.items():  # a view that is not contiguous and aligned is copied
        if _is_aligned(data):
            hosts[box] = data
        else:
            hosts[box] = aligned_empty(data.shape, data.dtype)
            np.copyto(hosts[box], data)
    devices = p.sharding.addressable_devices_indices_map(p.shape)
    arrays = jax.device_put([hosts[box_of(index, p.shape)] for index in devices.values()],
                            list(devices), may_alias=True)
    return jax.make_array_from_single_device_arrays(p.shape, p.sharding, arrays)


def host_state(path: str | os.PathLike[str] | Store | Checkpoint) -> dict[str, Any]:
    """A checkpoint as host values: ``params`` (nested by the FQNs' dots), ``opt_state``
    (the ``optimizer`` group as stored: ``state/<fqn>/exp_avg``, ``optax/...``, and its
    values), ``step`` and every other entry of ``training``. PRNG keys come as their
    key data."""
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    try:
        out: dict[str, Any] = {}
        if "model" in ckpt.groups:
            params: dict[str, Any] = {}
            for fqn, value in ckpt.to_dict("model").items():
                node = params
                *parents, last = fqn.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[last] = value
            out[PARAMS] = params
        if "optimizer" in ckpt.groups:
            out[OPT_STATE] = ckpt.to_dict("optimizer")
        if "training" in ckpt.groups:
            training = ckpt.to_dict("training")
            if "step" in training:
                out[STEP] = training.pop("step")
            out.update(training)
        return out
    finally:
        if not isinstance(path, Checkpoint):
            ckpt.close()


__all__ = ["host_state", "load"]

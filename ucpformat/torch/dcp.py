"""A storage plugin for PyTorch DCP: ``torch.distributed.checkpoint`` saves and loads UCP.

Switch a DCP training loop by one argument::

    import torch.distributed.checkpoint as dcp
    from ucpformat.torch.dcp import UCPReader, UCPWriter

    dcp.save(state_dict, storage_writer=UCPWriter("ckpt/step-100"))
    dcp.load(state_dict, storage_reader=UCPReader("ckpt/step-100"))
    # or: dcp.save(state_dict, checkpoint_id=path, storage_writer=UCPWriter())

What lands on disk is an ordinary UCP checkpoint: every tensor consolidated at its full
shape (``model/<fqn>``, ``optimizer/state/<fqn>/<state>``, ...; the mapping of DCP keys
is in :mod:`ucpformat.torch.dcp_keys`), non-tensor values as JSON, no pickle anywhere.

Saving runs the distributed save pipeline (:mod:`ucpformat.distributed.pipeline`, which says how a
save fails), in DCP's order of calls:

1. every rank: DCP's planner makes write items (a chunk of a tensor, or a non-tensor
   value); the default planner removes replicas so each chunk has one writer.
2. the coordinator (``prepare_global_plan``) sees every rank's items: it checks coverage,
   chooses each array's shard grid from the chunk boundaries with
   :func:`ucpformat.distributed.save_plan.make_plan` and assigns every shard one owner, who holds
   it; where chunks are too small to shard on their boundaries, the owner of a coarser
   shard receives the missing cells from their holders (in ``write_data``). Each rank's
   share goes back in its plan. It then marks the destination (refusing a committed
   checkpoint unless ``overwrite=True``, and a location another save holds: its marker
   is its claim until the commit, UCP-1.0-R059); nothing else is written before step 3
   agrees.
3. every rank (``write_data``): reads its non-tensor values (JSON), exchanges boundary
   cells over ``process_group``, agrees with the others that none failed; the
   coordinator then un-commits a checkpoint being replaced; every rank writes its shards
   whole and returns its values and what it wrote.
4. the coordinator (``finish``, called by DCP only if every rank succeeded): checks that
   every planned shard was written, writes values and the metadata, and commits last. A
   failure anywhere leaves no committed checkpoint, and one before the un-commit leaves
   the checkpoint being replaced as it was. A failed save's files are removed (UCP-1.0-R049):
   by the coordinator at once where it sees the failure (steps 3 and 4), else by its
   writer's next ``reset`` (DCP calls it when the next save begins) or the next save to
   that location.

Loading is :class:`~ucpformat.torch.dcp_reader.UCPReader`
(:mod:`ucpformat.torch.dcp_reader`), importable from here too.
"""

from __future__ import annotations

import io
import math
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ucpformat.checkpoint.commit import abandon, explain_failure
from ucpformat.checkpoint.metadata import ZARR_JSON, ArrayMeta, GroupMeta, build_root_ucp
from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.tree import zero_bits
from ucpformat.distributed.comm import Communicator, SingleProcess
from ucpformat.distributed.pipeline import DistributedSave, check_written
from ucpformat.distributed.save_plan import (
    DEFAULT_MIN_SHARD_BYTES,
    RankTasks,
    TensorSpec,
    make_plan,
)
from ucpformat.engine import chunking
from ucpformat.engine.compression import Compression
from ucpformat.engine.grid import object_coords, object_region
from ucpformat.engine.write import StoredObject, write_object
from ucpformat.errors import (
    CheckpointExistsError,
    InvalidValueError,
    LayoutError,
    WriteError,
)
from ucpformat.format import dtypes, names, schemas
from ucpformat.layout.boxes import Box, box_shape, box_size
from ucpformat.store import Store, check_directory_location, open_store
from ucpformat.torch.comm import TorchCommunicator
from ucpformat.torch.dcp_keys import (
    MAX_VALUE_TENSOR,
    RECORD_KEY,
    Entry,
    KeyMap,
    ObjectPath,
    SaveContext,
    ValueTarget,
    ancestors,
    assemble_values,
    check_groups_and_arrays,
    encode_value,
    locate,
    node_path,
    record_to_json,
)
from ucpformat.torch.numpy_bridge import data_type, to_numpy
from ucpformat.torch.staging import Staging
from ucpformat.torch.state import qualified_name, unwrap

CheckpointId = str | os.PathLike[str]

_ROLES = {"optimizer": "optimizer_state", "training": "training_state"}


def completed(value: Any) -> Future[Any]:
    """A future that is already done, with ``value`` (DCP's storage calls return futures)."""
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _box(offsets: Sequence[int], sizes: Sequence[int]) -> Box:
    return tuple((int(o), int(o) + int(s)) for o, s in zip(offsets, sizes, strict=True))


def _is_tensor_item(item: WriteItem) -> bool:
    return item.type != WriteItemType.BYTE_IO


# -- what the coordinator tells each rank -----------------------------------------------


@dataclass
class _RankShare:
    """A rank's share of a save, sent in its ``SavePlan.storage_data``."""

    tasks: dict[str, Any]  # its RankTasks (ucpformat.distributed.save_plan), as JSON
    key_of: dict[str, str]  # node path -> DCP key, of the arrays in its tasks
    tensor_values: list[str]  # DCP keys of tensors stored as JSON values


@dataclass
class _SavePlanState:
    """What the coordinator keeps between ``prepare_global_plan`` and ``finish``."""

    world_size: int
    metas: dict[str, ArrayMeta]
    expected: set[str]  # keys of every stored object
    tensor_entries: dict[str, Entry]
    values: dict[str, tuple[ObjectPath, ValueTarget]]
    context: SaveContext
    tensor_values: dict[str, tuple[str, tuple[int, ...]]]
    save: DistributedSave  # the coordinator's part in the save: it holds the location


# -- the writer -----------------------------------------------------------------------------


class UCPWriter(StorageWriter):
    """Write a UCP checkpoint from ``torch.distributed.checkpoint.save``.

    ``path`` may be given later as DCP's ``checkpoint_id``. ``overwrite=True`` replaces a
    committed checkpoint (un-committing it first); otherwise saving over one is refused.
    ``key_map`` says which state-dict keys hold model and optimizer state (default:
    ``model`` and ``optim``/``optimizer``, see :mod:`ucpformat.torch.dcp_keys`). ``model``
    (optional) tells parameters from buffers for the arrays' roles; without it, model
    tensors named in the optimizer's param groups are parameters and the rest get no
    role. ``optimizer`` (optional) names the optimizer's class in the ``optimizer`` group
    (``type``), as ``ucpformat.torch.save`` does. ``metadata`` is free-form JSON stored in
    the root.

    ``min_shard_bytes``: chunks whose aligned shards would be smaller than this on average
    are written as coarser shards, each assembled by one owner from cells sent by the
    ranks that hold them (over ``process_group``, default: the default group, which must
    be the group DCP saves with). ``0`` never moves data between ranks: shards then follow
    every chunk boundary, however small.

    ``staging``: how tensors on a device (a GPU) reach host memory: through a bounded
    pool of pinned buffers, the next tensor copied while the previous one is written
    (:class:`ucpformat.torch.staging.Staging`; default: the shared default pool).
    """

    def __init__(
        self,
        path: CheckpointId | None = None,
        *,
        overwrite: bool = False,
        key_map: KeyMap | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        metadata: Mapping[str, Any] | None = None,
        compression: str | Mapping[str, Any] | None = None,
        hash_algorithm: str | None = "sha256",
        chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
        shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
        workers: int | None = None,
        durable: bool = True,
        process_group: dist.ProcessGroup | None = None,
        staging: Staging | None = None,
    ) -> None:
        super().__init__()
        self.staging = staging if staging is not None else Staging()
        self.path: CheckpointId | None = path
        self.overwrite = overwrite
        self.key_map = key_map or KeyMap()
        self.metadata = dict(metadata) if metadata is not None else None
        self.compression = compression
        self.hash_algorithm = hash_algorithm
        self.chunk_bytes = chunk_bytes
        self.shard_bytes = shard_bytes
        self.min_shard_bytes = min_shard_bytes
        self.workers = workers
        self.durable = durable
        self.process_group = process_group
        self._roles: dict[str, str] = {}
        if model is not None:
            bare = unwrap(model)  # names as get_state_dict gives them (no wrapper prefixes)
            self._roles.update((n, "buffer") for n, _ in bare.named_buffers())
            self._roles.update((n, "parameter") for n, _ in bare.named_parameters())
        self._optimizer_type = qualified_name(optimizer) if optimizer is not None else None
        self._is_coordinator = False
        self._state: _SavePlanState | None = None
        self._store: Store | None = None
        self._save_options = SaveOptions()
        #: This save's id, as FileSystemWriter's: new at every reset, stored in the
        #: checkpoint (``saved_by.save_id``) and given back by UCPReader's StorageMeta.
        self.save_id = uuid.uuid4().hex

    # -- StorageWriter API ------------------------------------------------------------------

    @property
    def checkpoint_id(self) -> CheckpointId | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        if self._store is not None:  # a save of this writer that never finished: remove
            abandon(self._store)      # its remains, give its location up (UCP-1.0-R059)
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self._state = None
        self._store = None
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        return is_supported_location(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.path is None else os.fspath(self.path),
                           save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise WriteError("UCPWriter needs a path: UCPWriter(path) or dcp.save(..., "
                             "checkpoint_id=path)")
        if kwargs.get("use_collectives", True) is False and dist.is_available() \
                and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            raise WriteError(
                "UCPWriter needs DCP's collectives (use_collectives=True): one checkpoint is "
                "planned, written and committed by all ranks together",
                path=os.fspath(self.path),
            )
        self._is_coordinator = is_coordinator
        # built here, on every rank (DCP gathers a failure here): never in write_data,
        # where a rank that failed before the exchange would leave its peers waiting
        self._save_options = self._options()
        check_directory_location(self.path)
        self._store = open_store(self.path, durable=self.durable)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store = self._require_store()
        if any(not p.usable for p in plans):
            raise WriteError("UCPWriter does not support DCP's plan caching "
                             "(DefaultSavePlanner(enable_plan_caching=True))",
                             path=store.location)
        world = len(plans)
        object_paths: dict[str, ObjectPath] = {}
        for p in plans:
            if isinstance(p.planner_data, Mapping):
                for key, opath in p.planner_data.items():
                    object_paths.setdefault(str(key), tuple(opath))
        tensor_keys: dict[str, WriteItem] = {}
        value_keys: dict[str, None] = {}  # in first-seen order
        boxes: dict[str, list[tuple[int, Box]]] = {}
        for rank, p in enumerate(plans):
            for item in p.items:
                key = item.index.fqn
                object_paths.setdefault(key, (key,))
                if not _is_tensor_item(item):
                    value_keys[key] = None
                    continue
                td = item.tensor_data
                if td is None:  # pragma: no cover - DCP always sets it for tensors
                    raise WriteError("a tensor write item without tensor data", path=key)
                known = tensor_keys.setdefault(key, item)
                known_td = known.tensor_data
                assert known_td is not None
                if (tuple(known_td.size), known_td.properties.dtype) != (
                    tuple(td.size), td.properties.dtype
                ):
                    raise LayoutError(
                        f"ranks disagree on the tensor: {tuple(known_td.size)} "
                        f"{known_td.properties.dtype} vs rank {rank}: {tuple(td.size)} "
                        f"{td.properties.dtype}", rule="UCP-1.0-R131", tensor=key,
                    )
                box = _box(td.chunk.offsets, td.chunk.sizes)
                if box_size(box) > 0 or not box:
                    boxes.setdefault(key, []).append((rank, box))
        ctx = SaveContext.of(
            (object_paths[k] for k in [*tensor_keys, *value_keys]), self.key_map
        )

        # tensors -> arrays
        specs: dict[str, TensorSpec] = {}
        path_of_key: dict[str, str] = {}
        key_of_path: dict[str, str] = {}
        tensor_entries: dict[str, Entry] = {}
        tensor_values: dict[str, tuple[str, tuple[int, ...]]] = {}
        values: dict[str, tuple[ObjectPath, ValueTarget]] = {}
        for key, item in tensor_keys.items():
            target = locate(object_paths[key], tensor=True, ctx=ctx)
            td = item.tensor_data
            assert td is not None
            if target.param_entry is not None or target.logical[:2] == ("optimizer",
                                                                          "param_groups"):
                # a tensor hyperparameter: stored as a JSON number (list), as the spec says
                shape = tuple(int(n) for n in td.size)
                if math.prod(shape) > MAX_VALUE_TENSOR:
                    raise InvalidValueError(
                        f"a tensor of shape {list(shape)} in param_groups is too large to "
                        f"store as a JSON value (at most {MAX_VALUE_TENSOR} elements)", path=key)
                dt = data_type(td.properties.dtype, tensor=key)
                tensor_values[key] = (dt.name, shape)
                values[key] = (object_paths[key], target)
                continue
            apath = node_path(target.logical)
            other = key_of_path.get(apath)
            if other is not None:
                raise InvalidValueError(
                    f"DCP entries {other!r} and {key!r} would both be stored at {apath!r}; "
                    "pass UCPWriter(key_map=...) to tell them apart", path=key,
                )
            path_of_key[key], key_of_path[apath] = apath, key
            dt = data_type(td.properties.dtype, tensor=key)
            specs[apath] = TensorSpec(apath, tuple(int(s) for s in td.size), dt.name)
            tensor_entries[key] = Entry(object_paths[key], array=apath)

        # values: located now so that a clash fails before anything is written
        groups = {a for p in specs for a in ancestors(p)}
        for key in value_keys:
            target = locate(object_paths[key], tensor=False, ctx=ctx)
            if target.param_entry is None:
                vpath = node_path(target.logical) if all(
                    isinstance(x, str) for x in target.logical) else None
                if vpath is not None and vpath in key_of_path:
                    raise InvalidValueError(
                        f"DCP entries {key_of_path[vpath]!r} (a tensor) and {key!r} (a value) "
                        f"would both be stored at {vpath!r}", path=key,
                    )
            values[key] = (object_paths[key], target)
        check_groups_and_arrays(specs, groups)

        with_boxes = {path_of_key[k]: b for k, b in boxes.items() if k in path_of_key}
        plan = make_plan(
            specs, with_boxes, world,
            compression=self.compression, chunk_bytes=self.chunk_bytes,
            shard_bytes=self.shard_bytes, min_shard_bytes=self.min_shard_bytes,
        )
        shares = plan.all_tasks()
        self._check_group(world, any(t.sends for t in shares))
        # Claim the destination now; write_data un-commits a checkpoint it replaces only
        # after the exchange, so that a rank failing until then leaves it intact.
        _refuse_existing(store, overwrite=self.overwrite)
        save = DistributedSave(store, self._communicator(), self._save_options,
                               coordinator=True)
        save.claim(plan)
        self._state = _SavePlanState(
            world, {p: tp.meta for p, tp in plan.tensors.items()}, plan.object_keys(),
            tensor_entries, values, ctx, tensor_values, save,
        )
        return [
            replace(p, storage_data=_RankShare(
                tasks.to_json(), {a: key_of_path[a] for a in tasks.arrays},
                sorted(tensor_values)))
            for p, tasks in zip(plans, shares, strict=True)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Steps 3 to 6 of the save pipeline (:mod:`ucpformat.distributed.pipeline`) on this
        rank."""
        store = self._require_store()
        share = plan.storage_data
        if not isinstance(share, _RankShare):
            raise WriteError("the save plan carries no UCPWriter tasks (was prepare_global_plan "
                             "of a UCPWriter run on the coordinator?)", path=store.location)
        results: list[WriteResult] = []
        items_of: dict[str, list[WriteItem]] = {}
        tasks: RankTasks | None = None
        # Every rank must reach the exchange and the agreement after it, or its peers
        # wait forever: an error before them is carried through them.
        error: BaseException | None = None
        try:
            as_value = set(share.tensor_values)
            for item in plan.items:
                if _is_tensor_item(item) and item.index.fqn not in as_value:
                    items_of.setdefault(item.index.fqn, []).append(item)
                elif _is_tensor_item(item):
                    data = planner.resolve_data(item)
                    assert isinstance(data, torch.Tensor)
                    results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data={
                        "value": encode_value(data.detach().cpu().tolist(), key=item.index.fqn)}))
                else:
                    results.append(self._value_result(item, planner))
            tasks = RankTasks.from_json(share.tasks)
        except BaseException as exc:
            error = exc
        source = _ItemFragments(planner, items_of, share.key_of,
                                tasks.arrays if tasks is not None else {}, self.staging)
        # the coordinator's save holds the destination from prepare_global_plan (claim) on
        save = self._state.save if self._is_coordinator and self._state else DistributedSave(
            store, self._communicator(), self._save_options, coordinator=False)
        save.take(tasks, error)
        save.exchange(source)
        # A failure from here on is DCP's to gather: the coordinator's writer removes what
        # the ranks wrote in its next reset (no rank may still be writing then).
        stored = save.write(source)  # stops the staging
        by_path: dict[str, list[StoredObject]] = {}
        for obj, written in zip(save.tasks.objects, stored, strict=True):
            by_path.setdefault(obj.path, []).append(written)
        for apath, objs in sorted(by_path.items()):
            key = share.key_of[apath]
            index = items_of[key][0].index if key in items_of else MetadataIndex(key)
            results.append(WriteResult(
                index=index, size_in_bytes=sum(o.nbytes for o in objs),
                storage_data={"objects": [[o.key, o.nbytes, o.sha256] for o in objs]},
            ))
        return completed(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Step 7 of the save pipeline (the coordinator, once every rank has written): a
        failure abandons the save (nothing committed, what the ranks wrote removed)."""
        store = self._require_store()
        state = self._state
        if state is None:
            raise WriteError("finish() without a global plan: this UCPWriter was not the "
                             "coordinator's", path=store.location)
        claim = state.save.location_claim
        if claim is None:  # pragma: no cover - claim() sets it, or raised
            raise WriteError("the coordinator's save holds no claim", path=store.location)
        with explain_failure(store, claim):
            self._commit(store, state, results, _save_id(metadata, self.save_id))
        self._state = None

    def _commit(self, store: Store, state: _SavePlanState,
                results: list[list[WriteResult]], save_id: str) -> None:
        objects: list[StoredObject] = []
        value_of: dict[str, Any] = {}
        raw_of: dict[str, tuple[bytes, str]] = {}
        for rank_results in results:
            for wr in rank_results:
                sd = wr.storage_data
                if not isinstance(sd, Mapping):
                    continue
                for k, n, h in sd.get("objects", []):
                    objects.append(StoredObject(str(k), int(n), h))
                if "value" in sd:
                    value_of[wr.index.fqn] = sd["value"]
                if "bytes" in sd:
                    raw_of[wr.index.fqn] = (bytes(sd["bytes"]), str(sd["encoding"]))
        check_written(state.expected, (o.key for o in objects), store.location)
        absent = sorted(set(state.values) - set(value_of) - set(raw_of))
        if absent:
            raise WriteError(f"no rank wrote the value of {absent[:5]}; nothing was committed",
                             rule="UCP-1.0-R132", path=store.location)

        metas = dict(state.metas)
        entries = dict(state.tensor_entries)
        # raw bytes -> uint8 arrays, written here by the coordinator alone
        for key, (raw, encoding) in sorted(raw_of.items()):
            opath, target = state.values[key]
            if target.param_entry is not None:
                raise InvalidValueError("a param_groups entry holds bytes", path=key)
            apath = node_path(target.logical)
            if apath in metas:
                raise InvalidValueError(f"{apath!r} is stored twice", path=key)
            meta = _bytes_meta(apath, len(raw), self.compression, self.chunk_bytes,
                               self.shard_bytes)
            arr = np.frombuffer(raw, dtype=np.uint8)
            for coords in object_coords(meta):
                objects.append(write_object(store, meta, coords, arr[object_region(meta, coords)],
                                            hash_algorithm=self.hash_algorithm))
            metas[apath] = meta
            entries[key] = Entry(opath, array=apath, encoding=encoding)

        groups = {a for p in metas for a in ancestors(p)}
        json_values = [
            (state.values[k][0], state.values[k][1], v) for k, v in value_of.items()
        ]
        group_values, value_entries = assemble_values(json_values, groups)
        for key, spec in state.tensor_values.items():
            value_entries[key] = replace(value_entries[key], tensor=spec)
        if self._optimizer_type is not None and "optimizer" in groups:
            group_values.setdefault("optimizer", {}).setdefault("type", self._optimizer_type)
        entries.update(value_entries)
        check_groups_and_arrays(metas, groups)
        _check_siblings([*metas, *groups])

        _check_optimizer_values(group_values.get("optimizer", {}), metas)
        roles = self._model_roles(group_values.get("optimizer", {}))
        final_metas = []
        for apath, meta in sorted(metas.items()):
            top = apath.partition("/")[0]
            role = roles.get(names.unescape(apath.partition("/")[2])) if top == "model" \
                else _ROLES.get(top, "other")
            if role is not None:
                meta = replace(meta, attributes={**meta.attributes, "ucp": {
                    **dict(meta.attributes.get("ucp", {})), "role": role}})
            final_metas.append(meta)
        group_metas = [
            GroupMeta(g, {"ucp": {"values": group_values[g]}} if g in group_values else {})
            for g in sorted(groups)
        ]
        root_ucp = build_root_ucp(
            metadata=self.metadata,
            saved_by={"world_size": state.world_size, "via": "torch.distributed.checkpoint",
                      "save_id": save_id},
            extensions={
                RECORD_KEY: {**record_to_json(entries), "context": state.context.to_json()}
            },
        )
        state.save.commit_objects(objects, arrays=final_metas, groups=group_metas,
                                  # checked at the start of this commit, before the
                                  # byte arrays were written: not again
                                  root_ucp=root_ucp, expected=())

    # -- helpers ----------------------------------------------------------------------------

    def _options(self) -> SaveOptions:
        return SaveOptions(
            compression=self.compression, chunk_bytes=self.chunk_bytes,
            shard_bytes=self.shard_bytes, min_shard_bytes=self.min_shard_bytes,
            hash_algorithm=self.hash_algorithm, overwrite=self.overwrite, workers=self.workers,
            durable=self.durable)

    def _require_store(self) -> Store:
        if self._store is None:
            raise WriteError("UCPWriter is not set up (set_up_storage_writer was not called)")
        return self._store

    def _check_group(self, world: int, moves: bool) -> None:
        """Refuse a process group that is not the one DCP planned for (write_data's
        collectives run over it)."""
        if not (dist.is_available() and dist.is_initialized()):
            if moves:
                raise WriteError(
                    "shards must be assembled from several ranks' chunks, which needs "
                    "torch.distributed; pass UCPWriter(min_shard_bytes=0) to shard on chunk "
                    "boundaries instead"
                )
            return
        size = dist.get_world_size(self.process_group)
        if size != world:
            raise WriteError(
                f"DCP planned for {world} ranks but UCPWriter's process group has {size}; "
                "pass UCPWriter(process_group=...) the group given to dcp.save"
            )

    def _communicator(self) -> Communicator:
        """The ranks of this save (one, when DCP runs without torch.distributed)."""
        if dist.is_available() and dist.is_initialized():
            return TorchCommunicator(self.process_group)
        return SingleProcess()

    def _value_result(self, item: WriteItem, planner: SavePlanner) -> WriteResult:
        key = item.index.fqn
        lookup_object = getattr(planner, "lookup_object", None)
        if callable(lookup_object):
            obj = lookup_object(item.index)
        else:  # a planner without the default planner's lookup: undo its torch.save
            data = planner.resolve_data(item)
            if not isinstance(data, io.BytesIO):
                raise WriteError(f"resolve_data returned a {type(data).__name__}", path=key)
            data.seek(0)
            obj = torch.load(data, weights_only=True)
        if isinstance(obj, bytes | bytearray | memoryview):
            raw = bytes(obj)
            return WriteResult(index=item.index, size_in_bytes=len(raw),
                               storage_data={"bytes": raw, "encoding": "bytes"})
        if isinstance(obj, io.BytesIO):
            raw = obj.getvalue()
            return WriteResult(index=item.index, size_in_bytes=len(raw),
                               storage_data={"bytes": raw, "encoding": "bytesio"})
        value = encode_value(obj, key=key)
        return WriteResult(index=item.index, size_in_bytes=0, storage_data={"value": value})

    def _model_roles(self, optimizer_values: Mapping[str, Any]) -> dict[str, str]:
        if self._roles:
            return self._roles
        roles: dict[str, str] = {}
        groups = optimizer_values.get("param_groups", [])
        for g in groups if isinstance(groups, list) else []:
            params = g.get("params", []) if isinstance(g, Mapping) else []
            for p in params if isinstance(params, list) else []:
                if isinstance(p, str):
                    roles[p] = "parameter"
        return roles


class _ItemFragments:
    """A rank's DCP write items as a :class:`ucpformat.distributed.pipeline.FragmentSource`: each
    tensor's chunks resolved through the planner when the pipeline asks for them; chunks
    on a device are copied to host memory through a :class:`~ucpformat.torch.staging.Stager`
    (one key per chunk), ahead of the write step and released after it."""

    def __init__(self, planner: SavePlanner, items_of: Mapping[str, Sequence[WriteItem]],
                 key_of: Mapping[str, str], arrays: Mapping[str, ArrayMeta],
                 staging: Staging) -> None:
        self._planner = planner
        self._items_of = items_of
        self._key_of = key_of
        self._arrays = arrays
        self._staging = staging
        self._stager = staging.stager({})
        self._resolved: dict[str, list[tuple[Box, str, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    def boxes(self) -> list[tuple[str, Box]]:
        return [(path, _item_box(item)) for path, key in self._key_of.items()
                for item in self._items_of.get(key, [])]

    def _resolve(self, path: str) -> list[tuple[Box, str, torch.Tensor]]:
        """(box, staging key, tensor) of each chunk of ``path``, resolved once."""
        with self._lock:
            found = self._resolved.get(path)
            if found is not None:
                return found
            key = self._key_of[path]
            out = []
            for i, item in enumerate(self._items_of.get(key, [])):
                data = self._planner.resolve_data(item)
                if not isinstance(data, torch.Tensor):  # pragma: no cover - DCP contract
                    raise WriteError("resolve_data returned no tensor", tensor=path)
                chunk = f"{path}#{i}"
                if self._staging.stages(data):
                    self._stager.add(chunk, data)
                out.append((_item_box(item), chunk, data))
            self._resolved[path] = out
            return out

    def fragments(self, path: str) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        meta = self._arrays[path]
        out = []
        for box, chunk, data in self._resolve(path):
            arr = self._stager.get(chunk) if chunk in self._stager \
                else to_numpy(data, name=self._key_of[path])
            out.append((box, arr.reshape(box_shape(box)).astype(meta.dtype.numpy, copy=False)))
        return out

    def schedule(self, keys: Sequence[str]) -> None:
        chunks = [chunk for path in keys for _, chunk, _ in self._resolve(path)]
        self._stager.schedule([c for c in chunks if c in self._stager])

    def release(self, key: str) -> None:
        with self._lock:
            chunks = self._resolved.pop(key, [])
        for _, chunk, _ in chunks:
            if chunk in self._stager:
                self._stager.release(chunk)

    def stop(self) -> None:
        self._stager.stop()


def _item_box(item: WriteItem) -> Box:
    td = item.tensor_data
    assert td is not None
    return _box(td.chunk.offsets, td.chunk.sizes)


def _bytes_meta(
    path: str, size: int, compression: str | Mapping[str, Any] | None, chunk_bytes: int,
    shard_bytes: int,
) -> ArrayMeta:
    dt = dtypes.by_name("uint8", tensor=path)
    ch = chunking.choose((size,), 1, chunk_bytes=chunk_bytes, shard_bytes=shard_bytes)
    return ArrayMeta(path=path, shape=(size,), dtype=dt, chunk_shape=ch.chunk_shape,
                     shard_shape=ch.shard_shape, compression=Compression.parse(compression, dt),
                     fill_value=zero_bits(dt), attributes={})


def _check_optimizer_values(values: Mapping[str, Any], arrays: Mapping[str, ArrayMeta]) -> None:
    """Refuse param groups the spec refuses (UCP-1.0-R081, UCP-1.0-R082), before anything is
    committed."""
    if not values:
        return
    hint = ("save the optimizer state of torch.distributed.checkpoint.state_dict."
            "get_state_dict / get_optimizer_state_dict, which names parameters by FQN")
    for v in schemas.violations("optimizer", dict(values)):
        raise InvalidValueError(f"optimizer values{v.pointer}: {v.message} ({hint})",
                                rule=v.rule, path="optimizer")
    model = {names.unescape(p.partition("/")[2]) for p in arrays
             if p.startswith("model/") and p.count("/") == 1}
    if not model:
        return
    for group in values.get("param_groups", []):
        for param in group.get("params", []):
            if param not in model:
                raise InvalidValueError(
                    f"param_groups names {param!r}, which is not a tensor of the model state "
                    f"({hint})", rule="UCP-1.0-R082", path="optimizer",
                )


def _check_siblings(paths: Sequence[str]) -> None:
    children: dict[str, list[str]] = {}
    for p in paths:
        parent, _, name = p.rpartition("/")
        children.setdefault(parent, []).append(name)
    for parent, kids in children.items():
        names.check_case_collisions(kids, parent=parent)


def is_supported_location(checkpoint_id: Any) -> bool:
    """True for what UCPWriter and UCPReader can open: a path (``str`` without a scheme,
    ``file://``, or ``os.PathLike``) or a URL of a protocol fsspec knows and can load (its
    package installed: s3fs for ``s3://``). DCP asks this to pick a storage plugin for a
    ``checkpoint_id``; anything else (``abc://abc.abc``) is not ours, so DCP says it
    cannot detect one."""
    if isinstance(checkpoint_id, os.PathLike):
        return True
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        return False
    scheme, sep, _ = checkpoint_id.partition("://")
    if not sep or scheme == "file":
        return True
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError):
        return False
    return True


def _refuse_existing(store: Store, *, overwrite: bool) -> None:
    """Refuse a committed checkpoint without ``overwrite`` in FileSystemWriter's words
    ("Checkpoint already exists"), which code written for DCP matches; the writer's own
    check (UCP-1.0-R053) still runs, once the location is claimed."""
    if not overwrite and store.exists(ZARR_JSON):
        raise CheckpointExistsError(
            "Checkpoint already exists and overwrite=False: a committed checkpoint is here; "
            "pass UCPWriter(overwrite=True) to replace it", rule="UCP-1.0-R053",
            path=store.location)


def _save_id(metadata: Metadata, default: str) -> str:
    """The coordinator's save id, as DCP passed it to the planner (or this writer's)."""
    meta = metadata.storage_meta
    return meta.save_id if meta is not None and meta.save_id else default


def __getattr__(name: str) -> Any:
    if name == "UCPReader":  # the loading half lives in its own module, which imports this one
        from ucpformat.torch.dcp_reader import UCPReader

        return UCPReader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KeyMap", "UCPReader", "UCPWriter"]  # noqa: F822 (UCPReader: __getattr__)

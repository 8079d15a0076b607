"""The loading half of the DCP storage plugin: ``dcp.load`` reads a UCP checkpoint.

``read_metadata`` builds DCP's metadata from the root ``zarr.json`` (one chunk per
tensor, no pickle); DCP's planner turns each rank's target layout into read requests
(offsets and lengths), which :meth:`ucpformat.Tensor.read_region` serves by reading only
the inner chunks that overlap them. The saving half, and how to switch a DCP loop, is
:mod:`ucpformat.torch.dcp`.
"""

from __future__ import annotations

import functools
import io
import os
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ucpformat.checkpoint.metadata import ZARR_JSON
from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.checkpoint.write_loop import default_workers
from ucpformat.errors import (
    FormatError,
    LoadError,
)
from ucpformat.format import dtypes
from ucpformat.torch.dcp import CheckpointId, completed, is_supported_location
from ucpformat.torch.dcp_keys import (
    RECORD_KEY,
    Entry,
    KeyMap,
    derive_entries,
    lookup,
    record_from_json,
)
from ucpformat.torch.load_plan import like
from ucpformat.torch.numpy_bridge import from_numpy, to_numpy, torch_dtype
from ucpformat.torch.reads import DeviceStaging
from ucpformat.torch.staging import DeviceUploads, host_array


class UCPReader(StorageReader):
    """Read a UCP checkpoint with ``torch.distributed.checkpoint.load``.

    Any UCP checkpoint loads, not only those written by :class:`UCPWriter`: one written
    by UCPWriter gets back exactly the keys it was saved with; for any other, the keys
    are derived from the layout with ``key_map`` (default: ``model.<fqn>``,
    ``optim.state.<fqn>.<state>``, ``optim.param_groups.<i>.<key>``, the contents of
    ``training`` at the top level; :meth:`KeyMap.torchtitan` for torchtitan's keys).
    Each tensor is one DCP chunk; each rank reads only the inner chunks that overlap the
    regions its state dict needs.

    A target that is a contiguous CPU tensor of the stored type is itself the read
    buffer; a contiguous GPU target of the stored type is filled from pinned host
    buffers, copied while the next reads run (``staging``, a
    :class:`ucpformat.torch.reads.DeviceStaging`; see docs/gpu.md); other targets get a
    copy of what was read.
    """

    def __init__(
        self,
        path: CheckpointId | None = None,
        *,
        key_map: KeyMap | None = None,
        workers: int | None = None,
        max_read_bytes: int | None = None,
        staging: DeviceStaging | None = None,
    ) -> None:
        super().__init__()
        self.staging = staging if staging is not None else DeviceStaging()
        self.path: CheckpointId | None = path
        self.key_map = key_map or KeyMap()
        self.workers = workers
        self.max_read_bytes = max_read_bytes
        self._ckpt: Checkpoint | None = None
        self._entries: dict[str, Entry] = {}
        #: This load's id, as FileSystemReader's: new at every reset.
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> CheckpointId | None:
        return self.path

    @property
    def checkpoint(self) -> Checkpoint:
        """The open checkpoint (after ``read_metadata``); ``checkpoint.stats`` counts reads."""
        if self._ckpt is None:
            raise LoadError("UCPReader has not read the checkpoint's metadata yet")
        return self._ckpt

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
        self.close()
        self.load_id = uuid.uuid4().hex

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        """True for a local UCP checkpoint (its root ``zarr.json`` is there), so that a
        choice between readers picks this one only where it can read; for a URL of a
        supported protocol, True without a request."""
        if not is_supported_location(checkpoint_id):
            return False
        text = os.fspath(checkpoint_id)
        if "://" in text and not text.startswith("file://"):
            return True
        local = text[len("file://"):] if text.startswith("file://") else text
        return os.path.isfile(os.path.join(local, ZARR_JSON))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise LoadError("UCPReader needs a path: UCPReader(path) or dcp.load(..., "
                            "checkpoint_id=path)")
        self.close()
        ckpt = open_checkpoint(self.path, max_read_bytes=self.max_read_bytes,
                               workers=self.workers)
        self._ckpt = ckpt
        self._entries = self._load_entries(ckpt)
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for key, entry in self._entries.items():
            if entry.tensor is not None:  # a small tensor stored as a JSON value
                dtype_name, dims = entry.tensor
            elif entry.array is None or entry.encoding is not None:
                md[key] = BytesStorageMetadata()
                continue
            else:
                meta = ckpt.arrays[entry.array]
                dtype_name, dims = meta.dtype.name, meta.shape
            shape = torch.Size(dims)
            md[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(dtype_name, tensor=key)),
                size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)],
            )
        return Metadata(
            state_dict_metadata=md,
            planner_data={k: e.path for k, e in self._entries.items()},
            storage_meta=StorageMeta(checkpoint_id=os.fspath(self.path),
                                     save_id=_stored_save_id(ckpt), load_id=self.load_id),
            version=CURRENT_DCP_VERSION,
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.checkpoint  # noqa: B018 - raises unless read_metadata ran

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ckpt = self.checkpoint
        templates = getattr(planner, "state_dict", None)
        tensor_items: list[ReadItem] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                template = templates.get(item.dest_index.fqn) if isinstance(
                    templates, Mapping) else None
                buf = io.BytesIO()
                torch.save(self._value(item.storage_index.fqn, template), buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
            else:
                tensor_items.append(item)

        def read(item: ReadItem, out: np.ndarray[Any, Any] | None) -> np.ndarray[Any, Any]:
            entry = self._entry(item.storage_index.fqn)
            lo, hi = _item_bounds(item)
            if entry.tensor is not None:
                assert entry.group is not None
                value = lookup(ckpt.values(entry.group), entry.pointer, where=entry.key)
                dtype_name, dims = entry.tensor
                full = np.asarray(value, dtype=dtypes.by_name(dtype_name).numpy)
                if full.shape != dims:
                    raise FormatError(f"the value has shape {list(full.shape)}, the entry "
                                      f"says {list(dims)}", path=entry.key)
                return full[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
            assert entry.array is not None
            return ckpt[entry.array].read_region(lo, hi, out=out)

        def direct(item: ReadItem, target: torch.Tensor) -> str | None:
            """How the target is filled: "memory" (read into it), "device" (through the
            pinned pool) or None (a copy of what was read)."""
            entry = self._entry(item.storage_index.fqn)
            if entry.array is None or tuple(target.shape) != tuple(
                    int(n) for n in item.lengths):
                return None
            stored = torch_dtype(ckpt.arrays[entry.array].dtype, tensor=entry.array)
            plain = target.layout == torch.strided and target.is_contiguous() and not (
                target.is_conj() or target.is_neg())
            if not plain or target.dtype != stored:
                return None
            if self.staging.stages(target.device):
                return "device"
            return "memory" if target.device.type == "cpu" else None

        uploads: DeviceUploads | None = None
        window = 4 * (self.workers or default_workers())
        with ThreadPoolExecutor(self.workers or default_workers()) as pool:
            try:
                start = 0
                resolved: list[torch.Tensor] = []  # targets of a window cut short, resolved once
                while start < len(tensor_items):
                    batch = tensor_items[start:start + window]
                    targets = resolved + [planner.resolve_tensor(item).detach()
                                          for item in batch[len(resolved):]]
                    ways = [direct(item, t) for item, t in zip(batch, targets, strict=True)]
                    outs: list[np.ndarray[Any, Any] | None] = []
                    hosts: list[torch.Tensor | None] = []
                    for target, way in zip(targets, ways, strict=True):
                        host = None
                        if way == "device":
                            if uploads is None:
                                uploads = DeviceUploads(self.staging.the_pool(),
                                                        self.staging.copier,
                                                        self.staging.recorder)
                            host = uploads.host_view(target)
                            if host is None:  # the pool is full: the batch ends here
                                break
                        hosts.append(host)
                        outs.append(to_numpy(target, name=None) if way == "memory" else
                                    host_array(host, name="") if host is not None else None)
                    batch, targets, resolved = (batch[:len(hosts)], targets[:len(hosts)],
                                                targets[len(hosts):])
                    label, start = str(start), start + len(batch)
                    regions = pool.map(read, batch, outs)
                    for item, target, region, host, out in zip(batch, targets, regions, hosts,
                                                               outs, strict=True):
                        if host is not None:
                            assert uploads is not None
                            uploads.upload(target, host, functools.partial(
                                planner.commit_tensor, item, target))
                            continue
                        if region is not out:
                            source = from_numpy(region, name=item.storage_index.fqn)
                            if tuple(target.shape) != tuple(source.shape):
                                raise LoadError(
                                    f"read {tuple(source.shape)} for a target of "
                                    f"{tuple(target.shape)}", tensor=item.dest_index.fqn,
                                )
                            target.copy_(source)
                        planner.commit_tensor(item, target)
                    if uploads is not None:
                        uploads.end_batch(label)
                if uploads is not None:
                    uploads.finish()
            except BaseException:
                # the window's other reads may still write into pool buffers: they end
                # before the buffers go back to the pool (shared with other loads)
                pool.shutdown(wait=True, cancel_futures=True)
                if uploads is not None:
                    uploads.abort()
                raise
        return completed(None)

    # -- helpers ----------------------------------------------------------------------------

    def _entry(self, key: str) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise LoadError(f"the checkpoint has no entry {key!r}", path=key)
        return entry

    def _load_entries(self, ckpt: Checkpoint) -> dict[str, Entry]:
        record = ckpt.ucp.get(RECORD_KEY)
        entries = record_from_json(record, where=ckpt.location) if record is not None else None
        if entries is None:
            group_values = {g: ckpt.values(g) for g in ckpt.groups}
            model = ckpt.groups.get("model")
            aliases = model.ucp.get("aliases", {}) if model is not None else {}
            entries = derive_entries(
                ckpt.arrays, group_values,
                {str(a): str(t) for a, t in aliases.items() if isinstance(t, str)}
                if isinstance(aliases, Mapping) else {},
                self.key_map,
            )
        for key, entry in entries.items():
            if entry.array is not None:
                meta = ckpt.arrays.get(entry.array)
                if meta is None:
                    raise FormatError(f"entry {key!r} names the array {entry.array!r}, which the "
                                      "checkpoint lacks", path=ckpt.location)
                if entry.encoding is not None and (meta.dtype.name != "uint8"
                                                   or len(meta.shape) != 1):
                    raise FormatError(f"bytes entry {key!r} must be a 1-D uint8 array",
                                      tensor=entry.array)
            elif entry.group not in ckpt.groups:
                raise FormatError(f"entry {key!r} names the group {entry.group!r}, which the "
                                  "checkpoint lacks", path=ckpt.location)
        return entries

    def _value(self, key: str, template: Any) -> Any:
        entry = self._entry(key)
        ckpt = self.checkpoint
        if entry.array is not None:
            raw = ckpt[entry.array].read().tobytes()
            return io.BytesIO(raw) if entry.encoding == "bytesio" else raw
        assert entry.group is not None
        values = ckpt.values(entry.group)
        return like(template, lookup(values, entry.pointer, where=key))




def _item_bounds(item: ReadItem) -> tuple[list[int], list[int]]:
    """The box of the stored tensor a read item asks for: ``[lo, hi)``."""
    base = item.storage_index.offset or ()
    lo = [int(b) + int(o) for b, o in zip(base, item.storage_offsets, strict=True)] \
        if base else [int(o) for o in item.storage_offsets]
    return lo, [a + int(n) for a, n in zip(lo, item.lengths, strict=True)]



def _stored_save_id(ckpt: Checkpoint) -> str | None:
    saved_by = ckpt.ucp.get("saved_by")
    save_id = saved_by.get("save_id") if isinstance(saved_by, Mapping) else None
    return save_id if isinstance(save_id, str) else None



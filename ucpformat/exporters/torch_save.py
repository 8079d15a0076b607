"""UCP -> a ``torch.save`` file, written tensor by tensor.

The file is what ``torch.save`` writes (a zip archive: ``data.pkl`` naming storages
``data/0``, ``data/1``, ..., each record 64-byte aligned, so that
``torch.load(mmap=True)`` maps it); ``torch.load(weights_only=True)`` reads it. It is
written without holding the checkpoint in memory: the pickle that describes the
structure is built from the metadata first, then each tensor is read from the
checkpoint and written as its storage record.

Layouts (``layout=``):

* ``"state_dict"`` (default): ``{name: tensor}`` of the model, as ``model.state_dict()``
  (tied tensors included, sharing their target's storage);
* ``"training"``: ``{"model": {...}, "optimizer": {"state": {i: {...}}, "param_groups":
  [...]}, ...}``, the optimizer as ``torch.optim.Optimizer.state_dict()`` gives it
  (parameters numbered in ``param_groups`` order, with ``param_names``), plus the
  values and tensors of ``training/`` at the top level.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from ucpformat.checkpoint.reader import Checkpoint, Tensor
from ucpformat.errors import InvalidValueError
from ucpformat.exporters import ExportResult
from ucpformat.exporters._common import atomic_file, model_tensors, optimizer_states, read_stream
from ucpformat.format import names
from ucpformat.interchange import torch_dtype_of, torch_module

FORMAT: Final = "torch"
ALIGNMENT: Final = 64
#: data types torch pickles with a legacy typed storage (``_rebuild_tensor_v2``)
_LEGACY: Final = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
    "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "bfloat16": "BFloat16Storage", "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
}


class _Storage:
    def __init__(self, key: str, tensor: Tensor) -> None:
        self.key = key
        self.tensor = tensor


class _Ref:
    """A tensor in the pickled structure whose data is written later."""

    def __init__(self, storage: _Storage) -> None:
        self.storage = storage


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, torch: Any) -> None:
        super().__init__(file, protocol=2)
        self.torch = torch

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            meta = obj.tensor.meta
            legacy = _LEGACY.get(meta.dtype.name)
            if legacy is not None:
                return ("storage", getattr(self.torch, legacy), obj.key, "cpu",
                        math.prod(meta.shape))
            return ("storage", self.torch.storage.UntypedStorage, obj.key, "cpu", meta.nbytes)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, _Ref):
            return NotImplemented
        meta = obj.storage.tensor.meta
        shape = tuple(meta.shape)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        hooks: OrderedDict[Any, Any] = OrderedDict()
        if meta.dtype.name in _LEGACY:
            return (self.torch._utils._rebuild_tensor_v2,
                    (obj.storage, 0, shape, stride, False, hooks))
        return (self.torch._utils._rebuild_tensor_v3,
                (obj.storage, 0, shape, stride, False, hooks, torch_dtype_of(meta.dtype)))


class _Archive:
    """The zip container of ``torch.save``: stored records, data 64-byte aligned."""

    def __init__(self, path: Path) -> None:
        self.zf = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.prefix = "archive/"

    def write(self, name: str, data: Any, nbytes: int) -> None:
        full = self.prefix + name
        info = zipfile.ZipInfo(full, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = nbytes
        zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT
        assert self.zf.fp is not None
        start = self.zf.fp.tell() + 30 + len(full.encode()) + 4 + (20 if zip64 else 0)
        pad = -start % ALIGNMENT
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        with self.zf.open(info, "w", force_zip64=zip64) as f:
            f.write(data)

    def close(self) -> None:
        self.zf.close()


class TorchFile:
    """A ``torch.save`` file whose structure refers to checkpoint tensors, written streaming.

    Build the structure with :meth:`ref` placeholders (one storage per stored tensor,
    shared by every reference to it), then :meth:`write` pickles the structure and
    writes each storage as it is read from the checkpoint.
    """

    def __init__(self) -> None:
        self.storages: dict[str, _Storage] = {}

    def ref(self, tensor: Tensor) -> _Ref:
        storage = self.storages.get(tensor.path)
        if storage is None:
            storage = self.storages[tensor.path] = _Storage(str(len(self.storages)), tensor)
        return _Ref(storage)

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.nbytes for s in self.storages.values())

    def write(
        self,
        path: Path,
        structure: Any,
        *,
        workers: int | None = None,
        memory_limit: int | None = None,
        progress: bool | Callable[[int], None] = False,
    ) -> None:
        buf = io.BytesIO()
        _Pickler(buf, torch_module()).dump(structure)
        archive = _Archive(path)
        try:
            pkl = buf.getvalue()
            archive.write("data.pkl", pkl, len(pkl))
            archive.write(".format_version", b"1", 1)
            archive.write(".storage_alignment", str(ALIGNMENT).encode(), len(str(ALIGNMENT)))
            archive.write("byteorder", sys.byteorder.encode(), len(sys.byteorder))
            items = [(s.key, s.tensor) for s in self.storages.values()]
            for key, data in read_stream(items, workers=workers, memory_limit=memory_limit,
                                         progress=progress, description=f"writing {path.name}"):
                archive.write(f"data/{key}", data.reshape(-1).view("u1").data, data.nbytes)
            archive.write("version", b"3\n", 2)
        finally:
            archive.close()


def _training_structure(ckpt: Checkpoint, refs: Mapping[str, _Ref]) -> dict[str, Any]:
    """``{"model", "optimizer", ...}`` with ``_Ref`` placeholders for tensors."""
    model = model_tensors(ckpt, include_aliases=True)
    out: dict[str, Any] = {"model": OrderedDict((n, refs[t.path]) for n, t in model)}
    states = optimizer_states(ckpt)
    opt_values = ckpt.values("optimizer") if "optimizer" in ckpt.groups else {}
    if states or opt_values:
        groups_doc = opt_values.get("param_groups")
        if not isinstance(groups_doc, list) or not groups_doc:
            groups_doc = [{"params": sorted(states)}]
        order: list[str] = []
        param_groups = []
        for g in groups_doc:
            params = [str(p) for p in g.get("params", [])]
            ids = list(range(len(order), len(order) + len(params)))
            order.extend(params)
            doc = {k: v for k, v in g.items() if k != "params"}
            doc["params"] = ids
            doc["param_names"] = params
            param_groups.append(doc)
        state: dict[int, dict[str, Any]] = {}
        for i, pname in enumerate(order):
            entry: dict[str, Any] = {}
            group = f"optimizer/state/{names.escape(pname)}"
            if group in ckpt.groups:
                entry.update(ckpt.values(group))
            for sname, t in sorted(states.get(pname, {}).items()):
                entry[sname] = refs[t.path]
            if entry:
                state[i] = entry
        missing = sorted(set(states) - set(order))
        if missing:
            raise InvalidValueError(f"optimizer state of parameters in no param group: "
                                    f"{missing[:5]}", path=ckpt.location)
        out["optimizer"] = {"state": state, "param_groups": param_groups}
    for key, value in ckpt.values("").items():
        out.setdefault(key, value)
    if "training" in ckpt.groups:
        for key, value in ckpt.values("training").items():
            out.setdefault(key, value)
        for path, ref in refs.items():
            if path.startswith("training/"):
                node = out
                parts = [names.unescape(p) for p in path.split("/")[1:]]
                for part in parts[:-1]:
                    node = node.setdefault(part, {})
                node[parts[-1]] = ref
    return out


def export(
    ckpt: Checkpoint,
    destination: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    workers: int | None = None,
    memory_limit: int | None = None,
    progress: bool | Callable[[int], None] = False,
    layout: str = "state_dict",
) -> ExportResult:
    """Write ``ckpt`` as one ``torch.save`` file (see the module's layouts)."""
    dest = Path(destination)
    if layout not in ("state_dict", "training"):
        raise InvalidValueError(f"layout must be 'state_dict' or 'training', got {layout!r}")
    tf = TorchFile()
    refs: dict[str, _Ref] = {}
    wanted: list[Tensor] = [t for _, t in model_tensors(ckpt)]
    if layout == "training":
        wanted += [t for per in optimizer_states(ckpt).values() for t in per.values()]
        wanted += [ckpt[p] for p in ckpt if p.startswith("training/")]
    for t in wanted:
        refs[t.path] = tf.ref(t)
    if layout == "state_dict":
        structure: Any = OrderedDict(
            (n, refs[t.path]) for n, t in model_tensors(ckpt, include_aliases=True)
        )
    else:
        structure = _training_structure(ckpt, refs)
    with atomic_file(dest, overwrite=overwrite) as tmp:
        tf.write(tmp, structure, workers=workers, memory_limit=memory_limit, progress=progress)
    total = tf.nbytes
    return ExportResult(ckpt.location, str(dest), FORMAT, len(wanted), total, (dest.name,))


__all__ = ["FORMAT", "TorchFile", "export"]

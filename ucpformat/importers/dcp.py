"""PyTorch Distributed Checkpoint (DCP) directories -> UCP.

A DCP directory (``.metadata`` and ``__<rank>_<n>.distcp`` files) is what
``torch.distributed.checkpoint.save`` writes from FSDP2, tensor-parallel and 2-D
(FSDP2 x TP) runs: each tensor's global shape, and where each saved chunk of it lies in
which file. The importer assembles each tensor from its chunks (whatever placements
produced them: ``Shard``, ``_StridedShard``, replicas saved once) and writes it whole,
tensor by tensor, reading each chunk with DCP's own ``FileSystemReader``.

**``.metadata`` is a Python pickle**: reading it can run code. It is read only with
``allow_pickle=True`` (``--allow-pickle``), and then with an unpickler that accepts
only DCP's metadata classes, ``torch.Size``, dtypes and a few builtins. The chunks
themselves are ``torch.save`` archives, loaded with ``weights_only=True``; non-tensor
values (saved as pickled bytes) are loaded the same way.

Where things go (the metadata's ``planner_data`` gives each flattened key its path in
the saved state dict): ``model.<fqn>`` (or ``model_key``) -> ``model/<fqn>``;
``optim.state.<fqn>.<name>`` (``get_state_dict``'s optimizer) ->
``optimizer/state/<fqn>/<name>``, its ``param_groups`` -> the ``optimizer`` group's
values; an LR scheduler's state (``lr_scheduler`` or ``scheduler``) -> the value
``scheduler`` of group ``training``, where ``ucpformat.torch.load`` finds it (the
convention of :mod:`ucpformat.torch.dcp_keys`); anything else -> ``training/``
(``training/step``, ...). A DCP checkpoint of a
bare model state dict goes to ``model/``. DCP records no parallel layout, so layout
semantics come from a rule file (``rules=``).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ucpformat.errors import FormatError, InvalidValueError
from ucpformat.format import jsonvalues
from ucpformat.importers._engine import Annotator, Scan, TensorSource, model_attributes, node
from ucpformat.importers._torch import plain
from ucpformat.interchange import data_type_of, to_numpy, torch_module
from ucpformat.layout.rules import RuleSet

FORMAT: Final = "dcp"
MODEL_KEYS: Final = ("model", "state_dict", "module", "model_state_dict")
OPTIMIZER_KEYS: Final = ("optim", "optimizer", "optimizer_state_dict")
MAX_METADATA_BYTES: Final = 1 << 30

_DCP_CLASSES: Final = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
              "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "Path"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that constructs only DCP metadata objects (defence in depth)."""

    def find_class(self, module: str, name: str) -> Any:
        torch = torch_module()
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the DCP metadata names {module}.{name}, which is not a DCP metadata class"
        )


def read_metadata(path: Path, *, allow_pickle: bool) -> Any:
    """The DCP ``Metadata`` object of a checkpoint directory."""
    meta = path / ".metadata"
    if not allow_pickle:
        raise FormatError(
            "a PyTorch DCP checkpoint's .metadata is a Python pickle, and unpickling can run "
            "code. Convert it only if you trust its origin, with allow_pickle=True "
            "(--allow-pickle); ucpformat then accepts only DCP's own metadata classes.",
            path=str(meta),
        )
    size = meta.stat().st_size
    if size > MAX_METADATA_BYTES:
        raise FormatError(f".metadata is {size} bytes; refusing more than {MAX_METADATA_BYTES}",
                          path=str(meta))
    torch_module()  # the classes live in torch.distributed.checkpoint
    import torch.distributed.checkpoint  # noqa: F401

    with open(meta, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise FormatError(f"cannot read the DCP metadata: {exc}", path=str(meta)) from None


def detect(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and any(path.glob("*.distcp"))


class _Planner:
    """The part of DCP's ``LoadPlanner`` protocol ``FileSystemReader.read_data`` uses."""

    def __init__(self, dest: Any = None) -> None:
        self.dest = dest
        self.values: dict[str, Any] = {}

    def resolve_tensor(self, item: Any) -> Any:
        t = self.dest
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, item: Any, tensor: Any) -> None:
        return None

    def load_bytes(self, item: Any, value: io.BytesIO) -> None:
        torch = torch_module()
        self.values[item.storage_index.fqn] = torch.load(value, weights_only=True)


class _Reader:
    """Reads whole tensors and byte values of one DCP directory."""

    def __init__(self, path: Path, metadata: Any) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        self.metadata = metadata
        self.reader = FileSystemReader(path)
        self.reader.set_up_storage_reader(metadata, True)

    def _read(self, items: list[Any], planner: _Planner) -> None:
        from torch.distributed.checkpoint.planner import LoadPlan

        self.reader.read_data(LoadPlan(items), planner).wait()  # type: ignore[arg-type]

    def tensor(self, key: str) -> np.ndarray[Any, Any]:
        torch = torch_module()
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

        md = self.metadata.state_dict_metadata[key]
        dest = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        items = []
        for chunk in md.chunks:
            index = MetadataIndex(key, chunk.offsets)
            items.append(ReadItem(
                type=LoadItemType.TENSOR, dest_index=index, dest_offsets=chunk.offsets,
                storage_index=index, storage_offsets=torch.Size([0] * len(chunk.offsets)),
                lengths=chunk.sizes,
            ))
        self._read(items, _Planner(dest))
        return to_numpy(dest, name=key)

    def values(self, keys: list[str]) -> dict[str, Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

        torch = torch_module()
        planner = _Planner()
        items = [
            ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(k),
                     dest_offsets=torch.Size([0]), storage_index=MetadataIndex(k),
                     storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
            for k in keys
        ]
        if items:
            self._read(items, planner)
        return planner.values


def _covered(md: Any) -> bool:
    """Do the chunks tile the tensor exactly (no hole, no overlap)?"""
    import math

    total = math.prod(md.size)
    return sum(math.prod(c.sizes) for c in md.chunks) == total and all(
        all(o >= 0 and o + s <= n for o, s, n in zip(c.offsets, c.sizes, md.size, strict=True))
        for c in md.chunks
    )


def scan(
    path: Path,
    *,
    allow_pickle: bool = False,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    rules: str | os.PathLike[str] | RuleSet | None = None,
    rule_params: Mapping[str, Any] | None = None,
) -> Scan:
    """The tensors and values of a DCP checkpoint directory."""
    metadata = read_metadata(path, allow_pickle=allow_pickle)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from ucpformat.torch.dcp_keys import KeyMap

    scheduler_keys = KeyMap().scheduler_keys  # one convention with the DCP plugin

    reader = _Reader(path, metadata)
    out = Scan(FORMAT, str(path))
    annotator = Annotator.make(rules, rule_params)
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    entries = metadata.state_dict_metadata
    paths: dict[str, tuple[Any, ...]] = {
        k: tuple(planner_data.get(k, (k,))) for k in entries
    }
    tops = {p[0] for p in paths.values() if len(p) > 1}
    mkey = model_key or next((k for k in MODEL_KEYS if k in tops), None)
    okey = optimizer_key or next((k for k in OPTIMIZER_KEYS if k in tops), None)
    bare_model = mkey is None and all(len(p) == 1 for p in paths.values())
    if model_key is not None and model_key not in tops:
        raise InvalidValueError(f"no entries under model_key {model_key!r}; found {sorted(tops)}")

    byte_keys = [k for k, md in entries.items() if isinstance(md, BytesStorageMetadata)]
    values = reader.values(byte_keys)
    param_groups: dict[int, dict[str, Any]] = {}
    aliases: dict[str, str] = {}
    model_tensors: list[tuple[int, str, Mapping[str, Any] | None]] = []

    def tensor_source(key: str, where: tuple[str, ...], attrs: dict[str, Any]) -> TensorSource:
        md = entries[key]
        if not _covered(md):
            raise FormatError("the saved chunks do not tile the tensor", path=str(path),
                              tensor=key)
        dt = data_type_of(md.properties.dtype, tensor=key)

        def read() -> np.ndarray[Any, Any]:
            return reader.tensor(key)

        return TensorSource(node(*where), tuple(int(s) for s in md.size), dt, read, attrs)

    for key, md in entries.items():
        p = paths[key]
        is_tensor = isinstance(md, TensorStorageMetadata)
        if bare_model or (mkey is not None and p[0] == mkey and len(p) == 2):
            name = str(p[-1])
            if not is_tensor:
                out.group_values("model")[name] = _json(values[key], out, f"model/{name}")
                continue
            action, layout, target = annotator.resolve(name, tuple(md.size))
            if action == "ignore":
                out.notes.append(f"{name}: ignored (rule file)")
                continue
            if action == "alias" and target is not None:
                aliases[name] = target
                continue
            # the role is known only for tensors the optimizer's param groups name (below)
            model_tensors.append((len(out.tensors), name, layout))
            out.tensors.append(tensor_source(key, ("model", name), model_attributes(None, layout)))
        elif okey is not None and p[0] == okey and len(p) == 4 and p[1] == "state":
            pname, sname = str(p[2]), str(p[3])
            if is_tensor:
                out.tensors.append(tensor_source(key, ("optimizer", "state", pname, sname),
                                                 {"ucp": {"role": "optimizer_state"}}))
            else:
                out.group_values(node("optimizer", "state", pname))[sname] = _json(
                    values[key], out, key)
        elif p[0] in scheduler_keys and len(p) > 1:
            value = reader.tensor(key).tolist() if is_tensor else _json(values[key], out, key)
            _place(out.group_values("training"), ("scheduler", *p[1:]), value)
        elif okey is not None and p[0] == okey and len(p) == 4 and p[1] == "param_groups":
            if is_tensor:
                raise FormatError("a tensor among the param_groups", path=str(path), tensor=key)
            param_groups.setdefault(int(p[2]), {})[str(p[3])] = plain(values[key])
        else:
            where = tuple(str(x) for x in p)
            if is_tensor:
                out.tensors.append(tensor_source(key, ("training", *where),
                                                 {"ucp": {"role": "training_state"}}))
            else:
                group = node("training", *where[:-1])
                out.group_values(group)[where[-1]] = _json(values[key], out, key)
    if param_groups:
        groups = [param_groups[i] for i in sorted(param_groups)]
        for g in groups:
            g["params"] = [str(x) for x in g.get("params", [])]
        out.group_values("optimizer")["param_groups"] = groups
    # DCP does not say which model tensors are parameters: those the param groups name are
    # (as the DCP plugin decides); a buffer or a frozen parameter cannot be told apart, so
    # the others get no role rather than a guess
    named = {p for g in param_groups.values() for p in g.get("params", [])}
    for index, name, semantics in model_tensors:
        if name in named:
            out.tensors[index] = dataclasses.replace(
                out.tensors[index], attributes=model_attributes("parameter", semantics))
    if aliases:
        out.groups.setdefault("model", {})["aliases"] = aliases
    if rules is None:
        out.notes.append("DCP records no parallel layout: tensors are stored without layout "
                         "semantics (give a rule file for them)")
    for gp in list(out.groups):
        if not any(t.path.startswith(gp + "/") for t in out.tensors) and not out.groups[gp]:
            del out.groups[gp]
    out.metadata["source"] = {"format": FORMAT, "model_key": mkey, "optimizer_key": okey,
                              "files": sorted(p.name for p in path.glob("*.distcp"))}
    return out


def _place(tree: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in a tree of dicts, and of lists where DCP's flattening
    indexed a list (integer items)."""
    node: Any = tree
    for item, after in itertools.pairwise(path):
        empty: Any = [] if isinstance(after, int) else {}
        if isinstance(node, list):
            node.extend([None] * (int(item) + 1 - len(node)))
            if node[item] is None:
                node[item] = empty
            node = node[item]
        else:
            node = node.setdefault(str(item), empty)
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (int(last) + 1 - len(node)))
        node[last] = value
    else:
        node[str(last)] = value


def _json(value: Any, out: Scan, where: str) -> Any:
    converted = plain(value)
    try:
        jsonvalues.encode(converted, where=where)
    except InvalidValueError:
        out.notes.append(f"{where}: a {type(value).__name__}, not JSON; stored as its repr")
        return repr(value)
    return converted


__all__ = ["FORMAT", "detect", "read_metadata", "scan"]

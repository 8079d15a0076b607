"""The save and load strategies for ``megatron.core.dist_checkpointing`` (imports megatron).

Saving (:class:`UCPSaveStrategy`): every rank describes the main replicas of its
``ShardedTensor`` fragments as boxes of the consolidated arrays
(:mod:`ucpformat.megatron.regions`) with the layout semantics the rule file gives each
tensor, its ``ShardedObject`` values as JSON and tensors
(:mod:`ucpformat.megatron.objects`), and hands both to the distributed save pipeline
(:func:`ucpformat.distributed.pipeline.save`): every rank writes its own fragments, rank 0 commits.
A rank that cannot describe its state (a value that is not JSON, a tensor no rule
knows) fails the save on every rank before anything is written.

Loading (:class:`UCPLoadStrategy`): each rank maps every ``ShardedTensor`` it asks for
to pieces of stored arrays and reads only the inner chunks they overlap, whatever
layout saved the checkpoint; the stored layout semantics, not a rule file, say how.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from megatron.core import __version__ as megatron_version
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
)

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.distributed.pipeline import save as run_pipeline
from ucpformat.distributed.save_plan import TensorSpec
from ucpformat.errors import (
    InvalidValueError,
    LayoutError,
    TensorNotFoundError,
    UCPError,
    UnsupportedFeatureError,
    restated,
)
from ucpformat.format import dtypes, names
from ucpformat.layout.boxes import Box, LocalMap
from ucpformat.layout.rules import RuleSet
from ucpformat.layout.semantics import TensorLayout, layout_of
from ucpformat.megatron import objects
from ucpformat.megatron.directory import BesideFiles
from ucpformat.megatron.regions import (
    fragment_box,
    index_range,
    locate,
    megatron_map,
    stored_shape,
)
from ucpformat.store import open_store
from ucpformat.torch.comm import ProcessGroup, communicator
from ucpformat.torch.numpy_bridge import data_type, to_numpy, torch_dtype
from ucpformat.torch.reads import TensorRead, read_tensors

BACKEND: Final = "ucp"
VERSION: Final = 1
#: ``attributes.megatron`` of every array: what Megatron called it.
ATTRIBUTE: Final = "megatron"


# -- saving ----------------------------------------------------------------------------------


@dataclass
class _Piece:
    tensor: torch.Tensor  # the fragment's local data
    local: Box  # region of ``tensor``
    glob: Box  # region of the stored array


@dataclass
class Described:
    """What one rank hands the pipeline."""

    specs: dict[str, TensorSpec] = field(default_factory=dict)
    pieces: dict[str, list[_Piece]] = field(default_factory=dict)
    arrays: dict[str, np.ndarray[Any, Any]] = field(default_factory=dict)  # whole, from objects
    objects: dict[str, Any] = field(default_factory=dict)  # unique key -> JSON value
    aliases: dict[str, str] = field(default_factory=dict)

    def add_spec(self, spec: TensorSpec) -> None:
        known = self.specs.setdefault(spec.path, spec)
        if known != spec:
            raise LayoutError(f"two fragments disagree: {known.to_json()} vs {spec.to_json()}",
                              rule="UCP-1.0-R131", tensor=spec.path)

    def group_attributes(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        if self.objects:
            out[objects.OBJECTS_GROUP] = {"values": dict(self.objects)}
        if self.aliases:
            out["model"] = {"aliases": dict(self.aliases)}
        return out


class _Source:
    """The pipeline's :class:`~ucpformat.distributed.pipeline.FragmentSource` of one rank.
    ``error``: this rank could not describe its state; :meth:`boxes` raises it, inside the
    pipeline's first collective step, so that every rank fails there and nothing is written."""

    def __init__(self, described: Described, error: BaseException | None = None) -> None:
        self._d = described
        self._error = error

    def boxes(self) -> list[tuple[str, Box]]:
        if self._error is not None:
            raise self._error
        out = [(path, p.glob) for path, pieces in self._d.pieces.items() for p in pieces]
        out += [(path, tuple((0, n) for n in a.shape)) for path, a in self._d.arrays.items()]
        return out

    def fragments(self, path: str) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        whole = self._d.arrays.get(path)
        if whole is not None:
            return [(tuple((0, n) for n in whole.shape), whole)]
        out = []
        for p in self._d.pieces.get(path, ()):
            data = to_numpy(p.tensor, name=path)
            out.append((p.glob, data[tuple(slice(a, b) for a, b in p.local)]))
        return out


class UCPSaveStrategy(SaveShardedStrategy):  # type: ignore[misc]
    """Saves a Megatron sharded state dict as a UCP checkpoint (collective: every rank).

    ``rule_params``: the model's description for the rule file (``rules``, default the
    shipped ``megatron-gpt``): ``num_attention_heads``, ``num_query_groups``,
    ``kv_channels``, ``ffn_hidden_size``, ``vocab_size`` (the real, unpadded one),
    ``gated_linear_unit``, ``tie_word_embeddings``, and for MoE ``num_experts`` and
    ``moe_ffn_hidden_size`` (:func:`ucpformat.megatron.rule_params` builds them from a
    ``TransformerConfig``). ``allow_opaque``: store ShardedObjects that are neither JSON
    nor tensors as opaque ``torch.save`` bytes (see :mod:`ucpformat.megatron.objects`).
    ``overwrite``: replace a committed UCP checkpoint in the directory. ``group``: the
    process group (default: the world). ``metadata``: free-form JSON for the root.
    """

    def __init__(
        self,
        rule_params: Mapping[str, Any],
        *,
        rules: str | os.PathLike[str] | RuleSet = "megatron-gpt",
        backend: str = BACKEND,
        version: int = VERSION,
        allow_opaque: bool = False,
        overwrite: bool = False,
        compression: str | Mapping[str, Any] | None = None,
        hash_algorithm: str | None = None,
        workers: int | None = None,
        durable: bool = True,
        group: ProcessGroup | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(backend, version)
        self.rules = rules if isinstance(rules, RuleSet) else RuleSet.load(os.fspath(rules))
        self.params = dict(rule_params)
        self.allow_opaque = allow_opaque
        self.overwrite = overwrite
        #: The grid and codec of every save (``compression``, ``chunk_bytes``, ...); the
        #: other settings are the attributes below, read when a save starts.
        self.options = SaveOptions(compression=compression, hash_algorithm=hash_algorithm,
                                   overwrite=overwrite, workers=workers, durable=durable)
        self.hash_algorithm = hash_algorithm
        self.workers = workers
        self.durable = durable
        self.group = group
        self.metadata = dict(metadata or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        comm = communicator(self.group)
        error: BaseException | None = None
        described = Described()
        try:
            described = self.describe(nested_values(sharded_state_dict))
        except BaseException as exc:  # every rank learns it in the pipeline's first step
            error = exc
        store = BesideFiles(open_store(checkpoint_dir, durable=self.durable))
        run_pipeline(
            store,
            comm,
            specs=list(described.specs.values()),
            source=_Source(described, error),
            group_attributes=described.group_attributes(),
            metadata={**self.metadata, ATTRIBUTE: self.root_metadata()},
            options=self.options.replace(hash_algorithm=self.hash_algorithm,
                                         overwrite=self.overwrite, workers=self.workers,
                                         durable=self.durable),
        )

    def root_metadata(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "version": self.version,
            "megatron_core": megatron_version,
            "rules": self.rules.name,
            "rule_params": {k: v for k, v in self.params.items()
                            if isinstance(v, bool | int | float | str)},
        }

    def describe(self, items: Iterable[Any]) -> Described:
        """Specs, fragments and values of this rank's sharded state (no collective)."""
        out = Described()
        for item in items:
            if isinstance(item, ShardedTensor):
                self._describe_tensor(item, out)
            elif isinstance(item, ShardedObject):
                if is_main_replica(item.replica_id):
                    self._describe_object(item, out)
            else:
                raise InvalidValueError(
                    f"the sharded state dict holds a {type(item).__name__}; the strategy "
                    "saves ShardedTensors and ShardedObjects", path=getattr(item, "key", None),
                )
        self._describe_aliases(out)
        return out

    def _describe_tensor(self, st: ShardedTensor, out: Described) -> None:
        key = st.key
        if st.flattened_range is not None:
            raise UnsupportedFeatureError(
                "a flattened ShardedTensor (flattened_range) is a slice of a flat buffer, "
                "not a region: save the distributed optimizer with sharding type "
                "'fully_reshardable'", tensor=key,
            )
        p = st.prepend_axis_num
        index = tuple(int(i) for i in st.global_offset[:p])
        loc = locate(key, index)
        resolved = self.rules.resolve(loc.name, self.params)
        if resolved is None:  # the rule file says: not part of the checkpoint
            return
        if resolved.tied_to is not None:
            raise LayoutError(
                f"the rules make this tensor an alias of {resolved.tied_to!r}, but Megatron "
                "saves it as a tensor of its own: does tie_word_embeddings match the model?",
                rule="UCP-1.0-R108", tensor=key,
            )
        layout = resolved.layout
        megatron_shape = tuple(int(n) for n in st.global_shape[p:])
        shape = stored_shape(megatron_shape, layout,
                             self.rules.vocab_size_hint(loc.name, self.params), tensor=key)
        ucp: dict[str, Any] = ({"role": "parameter", "layout": layout.to_json()}
                               if loc.state is None else {"role": "optimizer_state"})
        attrs = {"ucp": ucp, ATTRIBUTE: {"key": key, "index": list(index),
                                         "shape": [int(n) for n in st.global_shape]}}
        out.add_spec(TensorSpec(loc.path, shape, data_type(st.dtype, tensor=key).name, attrs))
        if not is_main_replica(st.replica_id):
            return
        box = fragment_box(st.global_offset[p:], st.local_shape)
        lmap = megatron_map(shape, layout, megatron_shape, tensor=key).sub_box(box)
        if tuple(st.data.shape) != lmap.local_shape:
            raise LayoutError(f"the fragment's data has shape {list(st.data.shape)}, its "
                              f"region {list(box)}", rule="UCP-1.0-R131", tensor=key)
        pieces = out.pieces.setdefault(loc.path, [])
        pieces.extend(_Piece(st.data, piece.local, piece.glob) for piece in lmap.pieces)

    def _describe_object(self, obj: ShardedObject, out: Described) -> None:
        enc = objects.encode(obj.unique_key, obj.data, allow_opaque=self.allow_opaque)
        where = {ATTRIBUTE: {"object": obj.unique_key}}
        if enc.opaque is not None:
            path = f"{objects.OPAQUE_GROUP}/{names.escape(obj.unique_key)}"
            data = objects.opaque_array(enc.opaque)
            where[ATTRIBUTE]["opaque"] = objects.OPAQUE_ENCODING
            out.add_spec(TensorSpec(path, data.shape, "uint8", {"ucp": {"role": "other"},
                                                                **where}))
            out.arrays[path] = data
            return
        out.objects[obj.unique_key] = enc.value
        for pointer, array, kind in enc.tensors:
            path = f"{objects.OBJECTS_GROUP}/{names.escape(enc.tensor_name(pointer))}"
            attrs = {"ucp": {"role": "training_state"},
                     ATTRIBUTE: {"object": obj.unique_key, "pointer": pointer, "kind": kind}}
            dtype = dtypes.from_numpy(array.dtype, tensor=path).name
            out.add_spec(TensorSpec(path, tuple(array.shape), dtype, attrs))
            out.arrays[path] = array

    def _describe_aliases(self, out: Described) -> None:
        """Tied tensors of the rule file (a literal pattern with ``tied_to``) whose target
        this rank saves: the model group's aliases (UCP-1.0-R108)."""
        for rule in self.rules.rules:
            if rule.tied_to is None or any(c in rule.pattern for c in "{*"):
                continue
            found = self.rules.match(rule.pattern, self.params)
            if found is None or found[0] is not rule:
                continue
            if locate(rule.tied_to, ()).path in out.specs:
                out.aliases[rule.pattern] = rule.tied_to


# -- loading ---------------------------------------------------------------------------------

#: What a failed load adds to its error: the caller's state is as it was.
UNCHANGED: Final = (
    "; nothing was changed: the model and the optimizer are as they were, and so is the "
    "sharded state dict (this strategy reads into tensors of its own, which Megatron "
    "copies in only after a load that succeeded)")


class UCPLoadStrategy(LoadShardedStrategy):  # type: ignore[misc]
    """Loads a UCP checkpoint into any Megatron sharded state dict (TP, PP, EP degree,
    with or without the distributed optimizer): each rank reads only the regions its
    ``ShardedTensor``s ask for. ``allow_opaque``: unpickle ShardedObjects stored as
    opaque bytes (runs code; refused otherwise). ``workers``: reading threads."""

    def __init__(
        self,
        *,
        backend: str = BACKEND,
        version: int = VERSION,
        allow_opaque: bool = False,
        workers: int | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.version = version
        self.allow_opaque = allow_opaque
        self.workers = workers

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != self.backend:
            raise CheckpointingException(
                f"the checkpoint was saved by backend {loaded_backend!r}, this strategy loads "
                f"{self.backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != self.version:
            raise CheckpointingException(
                f"the checkpoint was saved by {self.backend!r} version {loaded_version}, this "
                f"strategy loads version {self.version}")

    def _open(self, checkpoint_dir: str | Path) -> Checkpoint:
        return open_checkpoint(checkpoint_dir, workers=self.workers)

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """New tensors for every ShardedTensor, objects for every ShardedObject, put in
        ``sharded_state_dict`` in their place. Nothing of the model or the optimizer is
        written: Megatron copies the result in after the load. A failure raises before
        ``sharded_state_dict`` is changed, its message saying so (:data:`UNCHANGED`)."""
        try:
            return self._load(sharded_state_dict, checkpoint_dir)
        except UCPError as exc:
            raise restated(exc, exc.message + UNCHANGED) from exc

    def _load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        ckpt = self._open(checkpoint_dir)
        stored = _StoredKeys(ckpt)
        reads: list[TensorRead] = []
        loaded: dict[int, Any] = {}
        for item in nested_values(sharded_state_dict):
            if isinstance(item, ShardedTensor):
                out, item_reads = _plan_tensor(ckpt, stored, item)
                reads.extend(item_reads)
                loaded[id(item)] = out
            elif isinstance(item, ShardedObject):
                loaded[id(item)] = stored.object(item.unique_key, item.data,
                                                 allow_opaque=self.allow_opaque)
        # the tensors are new (Megatron copies them into the model): read straight in
        read_tensors(ckpt, reads, in_place=True, own_targets=True)

        def swap(x: Any) -> Any:
            return loaded.get(id(x), x)

        dict_list_map_inplace(swap, sharded_state_dict)
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        ckpt = self._open(checkpoint_dir)
        out: dict[str, Any] = {}
        for path, meta in ckpt.arrays.items():
            info = meta.attributes.get(ATTRIBUTE)
            if not isinstance(info, Mapping) or "key" not in info or info["key"] in out:
                continue
            dtype = torch_dtype(meta.dtype, tensor=path)
            shape = tuple(int(n) for n in info["shape"])
            out[info["key"]] = ShardedTensor.from_rank_offsets(
                info["key"], torch.empty(shape, dtype=dtype, device="meta")).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        out = self.load_tensors_metadata(checkpoint_dir)
        stored = _StoredKeys(self._open(checkpoint_dir))
        for unique_key in stored.object_keys():
            obj = ShardedObject.empty_from_unique_key(unique_key)
            out[obj.unique_key] = obj
        return out


class _StoredKeys:
    """What a checkpoint holds in Megatron's terms: stacked keys, ShardedObjects."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.stacked: dict[str, int] = {}  # key -> number of prepended axes
        self.object_arrays: dict[str, dict[str, tuple[str, str]]] = {}  # key -> pointer -> ..
        self.opaque: dict[str, str] = {}
        for path, meta in ckpt.arrays.items():
            info = meta.attributes.get(ATTRIBUTE)
            if not isinstance(info, Mapping):
                continue
            if "key" in info and isinstance(info.get("index"), list):
                self.stacked.setdefault(str(info["key"]), len(info["index"]))
            elif "object" in info and "opaque" in info:
                self.opaque[str(info["object"])] = path
            elif "object" in info and "pointer" in info:
                self.object_arrays.setdefault(str(info["object"]), {})[str(info["pointer"])] = (
                    path, str(info.get("kind", objects.TORCH)))
        self.values: dict[str, Any] = (ckpt.values(objects.OBJECTS_GROUP)
                                       if objects.OBJECTS_GROUP in ckpt.groups else {})

    def object_keys(self) -> list[str]:
        return sorted({*self.values, *self.opaque})

    def object(self, unique_key: str, template: Any, *, allow_opaque: bool) -> Any:
        if unique_key in self.values:
            tensors = {ptr: (self.ckpt[path].read(), kind)
                       for ptr, (path, kind) in self.object_arrays.get(unique_key, {}).items()}
            return objects.decode(unique_key, self.values[unique_key], tensors, template)
        if unique_key in self.opaque:
            raw = self.ckpt[self.opaque[unique_key]].read()
            return objects.load_opaque(unique_key, raw, allow_opaque=allow_opaque)
        raise TensorNotFoundError(f"the checkpoint has no ShardedObject {unique_key!r}",
                                  path=self.ckpt.location)


def _plan_tensor(
    ckpt: Checkpoint, stored: _StoredKeys, st: ShardedTensor
) -> tuple[torch.Tensor, list[TensorRead]]:
    """The tensor a ShardedTensor loads into, and the reads that fill it."""
    key = st.key
    if st.flattened_range is not None:
        raise UnsupportedFeatureError("a flattened ShardedTensor (flattened_range) cannot be "
                                      "loaded; use 'fully_reshardable'", tensor=key)
    p = st.prepend_axis_num
    stacked = stored.stacked.get(key, p)
    offset = [int(o) for o in st.global_offset]
    local = [1] * p + [int(n) for n in st.local_shape]
    box = fragment_box(offset, local)
    data = st.data
    device = (data.device if isinstance(data, torch.Tensor) and data.device.type != "meta"
              else torch.device("cpu"))
    out = torch.empty(tuple(st.local_shape), dtype=st.dtype, device=device)
    if stacked < p:
        raise LayoutError(f"{p} prepended axes, the checkpoint stacks {stacked}",
                          rule="UCP-1.0-R110", tensor=key)
    megatron_shape = tuple(int(n) for n in st.global_shape[stacked:])
    reads = []
    for index in index_range(box[:stacked]):
        loc = locate(key, index)
        meta = ckpt.arrays.get(loc.path)
        if meta is None:
            raise TensorNotFoundError(f"the checkpoint has no array {loc.path!r} for this key",
                                      tensor=key, path=ckpt.location)
        layout = _layout(ckpt, loc.path, loc.param_path)
        lmap: LocalMap = megatron_map(meta.shape, layout, megatron_shape, tensor=key).sub_box(
            box[stacked:])
        at = tuple(i - box[d][0] for d, i in enumerate(index) if d >= p)
        target = out[at] if at else out
        if tuple(target.shape) != lmap.local_shape:  # pragma: no cover - geometry bug
            raise LayoutError(f"target {list(target.shape)} vs {list(lmap.local_shape)}",
                              tensor=key)
        if lmap.has_padding:  # vocabulary padding: not stored, loads as zeros (UCP-1.0-R113)
            target.zero_()
        reads.append(TensorRead(loc.path, target=target, local=lmap))
    return out, reads


def _layout(ckpt: Checkpoint, path: str, param_path: str) -> TensorLayout:
    """The stored layout of an array, or of its parameter for an optimizer state without
    one of the same shape (UCP-1.0-R109)."""
    meta = ckpt.arrays[path]
    if "layout" in meta.ucp or path == param_path:
        return layout_of(meta.ucp, meta.shape, tensor=path)
    param = ckpt.arrays.get(param_path)
    if param is not None and param.shape == meta.shape:
        return layout_of(param.ucp, param.shape, tensor=param_path)
    return TensorLayout()


__all__ = ["ATTRIBUTE", "BACKEND", "VERSION", "Described", "UCPLoadStrategy", "UCPSaveStrategy"]

"""What one rank of a DeepSpeed engine holds, as parts of consolidated tensors.

Saving and loading see an engine the same way (:func:`holdings`): its parameters, each
with a consolidated name, shape and the map of the rank's tensor-parallel local tensor
onto it (:class:`Placed`), and the fp32 tensors its optimizer steps (:class:`Flat`), each
with the *slots* that say which elements of which parameter lie where in it:

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and DeepSpeed's bf16 optimizer
  (``BF16_Optimizer``): one flat fp32 partition per parameter group, cut through
  parameters; each parameter's ``_hp_mapping`` says which of its elements this rank
  holds and where (alignment padding and round-robin order included);
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): each parameter split on its own into
  ``ceil(numel / world)`` elements per rank, the rank's parts of a sub-group's
  parameters concatenated (``grad_position``);
* no ZeRO: the parameter itself (fp32, a torch optimizer) or its fp32 copy
  (``FP16_UnfusedOptimizer``, fp16 or bf16).

The optimizer's state of a flat tensor (``optimizer.state[flat]``) has the same slots:
every state tensor of the flat tensor's shape is cut like it, whatever its name.

Names: without a rule file the engine's parameter names are the consolidated names
(DeepSpeed's ``PipelineModule`` names its layers by their global index, so pipeline
stages need nothing more). With a rule file (``rules=``) tensor parallelism is undone
tensor by tensor, as the importer does (:mod:`ucpformat.layout`): fused parts, padded
vocabularies, row- and column-parallel splits. An AutoTP engine needs no rule file: the
``universal_checkpoint_info`` AutoTP attaches to the module gives each tensor's layout
(:mod:`ucpformat.layout.universal_info`, as the importer reads it from the files).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ucpformat.errors import LayoutError, UnsupportedFeatureError
from ucpformat.layout import universal_info
from ucpformat.layout.boxes import Box, LocalMap, Piece, full_box
from ucpformat.layout.rank_slices import ParallelConfig, RankCoords, local_map
from ucpformat.layout.rules import RuleSet

#: The optimizer wrappers this module understands, by what they keep.
ZERO = "zero"  # ZeRO-1/2 and BF16_Optimizer: flat partitions of parameter groups
ZERO3 = "zero3"  # ZeRO-3: per-parameter partitions, concatenated per sub-group
FP32_COPIES = "fp32-copies"  # FP16_UnfusedOptimizer: an fp32 copy of each parameter
PLAIN = "plain"  # a torch optimizer stepping the (fp32) parameters themselves
NONE = "none"  # no optimizer (inference engines)


@dataclass(frozen=True)
class Placed:
    """A tensor of the engine's module as part of a consolidated tensor."""

    name: str  # consolidated name
    shape: tuple[int, ...]  # consolidated shape
    lmap: LocalMap  # the rank's (tensor-parallel local) tensor, unpartitioned, as pieces
    layout: Mapping[str, Any] | None  # layout semantics to store (None: replicated, no rule)

    def flat_pieces(self, start: int, stop: int) -> list[tuple[int, Box]]:
        """Elements [start, stop) of the flattened local tensor as (offset from ``start``,
        box of the consolidated tensor)."""
        return self.lmap.flat_range(start, stop)


@dataclass(frozen=True)
class Slot:
    """Elements [start, start + numel) of parameter ``param`` (its flattened local tensor)
    are elements [offset, offset + numel) of a flat tensor."""

    param: str  # consolidated name
    start: int
    numel: int
    offset: int


@dataclass
class Flat:
    """A tensor the optimizer steps (the key of its state), and the parameters in it."""

    master: torch.Tensor  # fp32; 1-d for flat partitions, a parameter's shape otherwise
    group: int  # index of its optimizer parameter group
    slots: list[Slot] = field(default_factory=list)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the master or a state of its shape) as one dimension."""
        return tensor.view(-1)


@dataclass
class Param:
    """A parameter of the engine's module on this rank."""

    local_name: str
    tensor: torch.Tensor  # the module's parameter (empty outside a gather under ZeRO-3)
    placed: Placed
    trainable: bool
    #: ZeRO-3: (first element of the local tensor this rank holds, how many) in ds_tensor
    partition: tuple[int, int] | None = None


@dataclass
class Holdings:
    """Everything one rank of an engine holds, by consolidated name."""

    kind: str
    zero_stage: int
    model_dtype: torch.dtype
    params: dict[str, Param]
    buffers: dict[str, tuple[torch.Tensor, Placed]]
    flats: list[Flat]
    aliases: dict[str, str]  # tied: another name of a stored parameter -> its stored name
    #: per optimizer param group, the consolidated names of its parameters held here
    group_names: list[list[str]]
    tp: tuple[int, int]  # (rank, size)
    pp: tuple[int, int]  # (stage, stages)
    dp: tuple[int, int]  # (rank, size) in the data-parallel group

    @property
    def trained(self) -> set[str]:
        """The parameters the optimizer steps."""
        return {n for names in self.group_names for n in names}

    @property
    def mixed(self) -> bool:
        """Whether the fp32 master weights are kept apart from the model's weights."""
        return self.model_dtype != torch.float32

    def slots_of(self) -> dict[str, list[tuple[Flat, Slot]]]:
        """Consolidated parameter name -> (flat tensor, slot) of every fragment held here."""
        out: dict[str, list[tuple[Flat, Slot]]] = {}
        for flat in self.flats:
            for slot in flat.slots:
                out.setdefault(slot.param, []).append((flat, slot))
        return out

    def optimizer_state(self, optimizer: Any, flat: Flat) -> dict[str, Any]:
        """The state the inner torch optimizer keeps for ``flat`` (empty before a step)."""
        state: dict[str, Any] = optimizer.state.get(flat.master, {})
        return state


# -- names and layouts ----------------------------------------------------------------------


@dataclass(frozen=True)
class Naming:
    """Engine names and local tensors -> consolidated ones (a rule file, an AutoTP engine's
    ``universal_checkpoint_info``, or the identity)."""

    rules: RuleSet | None = None
    rule_params: Mapping[str, Any] = field(default_factory=dict)
    tp: tuple[int, int] = (0, 1)
    pp: tuple[int, int] = (0, 1)
    #: an AutoTP engine's ``universal_checkpoint_info`` (used where no rule file is given)
    uci: Mapping[str, Any] | None = None

    def place(self, local_name: str, local_shape: Sequence[int]) -> Placed | str | None:
        """The consolidated tensor of a local one; the stored name if the rule file says
        it is tied to another (an alias), None if the rule file ignores it."""
        shape = tuple(int(s) for s in local_shape)
        if self.rules is None:
            if self.tp[1] == 1:
                return Placed(local_name, shape, identity(shape), None)
            if self.uci is None:
                raise UnsupportedFeatureError(
                    "a tensor-parallel engine needs a rule file (rules=...) that says how each "
                    "tensor is split (AutoTP engines carry their own: the module's "
                    "universal_checkpoint_info)", tensor=local_name,
                )
            name = local_name
            layout, conv = universal_info.tensor_layout(self.uci, name, shape, self.tp[1])
            source = "the AutoTP engine's universal_checkpoint_info"
            vocab = universal_info.original_vocab_size(self.uci)
        else:
            cfg = ParallelConfig(tp=self.tp[1], pp=self.pp[1],
                                 num_layers=self.rule_params.get("num_layers"))
            coords = RankCoords(tp=self.tp[0], pp=self.pp[0])
            name = self.rules.global_name(local_name, self.rule_params, cfg, coords)
            resolved = self.rules.resolve(name, self.rule_params)
            if resolved is None:
                return None
            if resolved.tied_to is not None:
                return resolved.tied_to
            layout, conv = resolved.layout, resolved.conventions
            source = f"rule file {self.rules.name!r}"
            vocab = self.rules.vocab_size_hint(name, self.rule_params)
        if layout.layers_dim is not None or layout.experts_dim is not None:
            raise UnsupportedFeatureError(
                "stacked layers or experts in a DeepSpeed engine are not supported", tensor=name)
        full = list(shape)
        if layout.vocab_dim is not None:
            d = layout.vocab_dim
            if vocab is None:
                raise LayoutError("the vocabulary size is needed (rule parameter 'vocab_size')",
                                  rule="UCP-1.0-R113", tensor=name)
            full[d] = vocab
            # the rows each rank holds, whatever multiple padded them
            conv = dataclasses.replace(conv, vocab_multiple=shape[d])
        elif layout.tp_dim is not None:
            full[layout.tp_dim] *= self.tp[1]
        lmap = local_map(tuple(full), layout, conv, ParallelConfig(tp=self.tp[1]),
                         RankCoords(tp=self.tp[0]), zero3=False, tensor=name)
        if lmap is None or lmap.local_shape != shape:
            raise LayoutError(
                f"the local tensor {local_name!r} has shape {list(shape)}; {source} "
                f"gives {None if lmap is None else list(lmap.local_shape)} "
                f"on tensor-parallel rank {self.tp[0]} of {self.tp[1]}",
                rule="UCP-1.0-R110", tensor=name,
            )
        return Placed(name, tuple(full), lmap, layout.to_json() or None)


def identity(shape: Sequence[int]) -> LocalMap:
    """The local map of a tensor held whole."""
    box = full_box(shape)
    return LocalMap(tuple(shape), (Piece(box, box),) if math.prod(shape) else ())


# -- the engine --------------------------------------------------------------------------------


def _kind(optimizer: Any) -> str:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if optimizer is None:
        return NONE
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "offload_param",
                                                                   False):
            raise UnsupportedFeatureError("ZeRO-3 with the optimizer state or the parameters "
                                          "offloaded to NVMe or the CPU is not supported")
        return ZERO3
    if isinstance(optimizer, DeepSpeedZeroOptimizer | BF16_Optimizer):
        return ZERO
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return FP32_COPIES
    if isinstance(optimizer, FP16_Optimizer):
        raise UnsupportedFeatureError(
            "DeepSpeed's fused fp16 optimizer (FP16_Optimizer, with FusedAdam on a GPU) is not "
            "supported; DeepSpeed picks FP16_UnfusedOptimizer with \"torch_adam\": true")
    if isinstance(optimizer, torch.optim.Optimizer):
        return PLAIN
    raise UnsupportedFeatureError(f"the optimizer {type(optimizer).__name__} is not supported")


def parallel_coords(engine: Any) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """((tp rank, size), (pipeline stage, stages), (dp rank, size)) of this rank."""
    import torch.distributed as dist
    from deepspeed.utils.bwc import (
        bwc_pipeline_parallel_world_size,
        bwc_tensor_model_parallel_rank,
        bwc_tensor_model_parallel_world_size,
    )

    mpu = getattr(engine, "mpu", None)
    tp = (bwc_tensor_model_parallel_rank(mpu), bwc_tensor_model_parallel_world_size(mpu))
    grid = getattr(engine, "grid", None)
    if grid is not None:  # PipelineEngine
        pp = (int(grid.get_stage_id()), int(grid.get_pipe_parallel_world_size()))
    else:
        pp = (0, int(bwc_pipeline_parallel_world_size(mpu)) if mpu is not None else 1)
    group = getattr(engine, "data_parallel_group", None)
    dp = (dist.get_rank(group), dist.get_world_size(group))
    return (int(tp[0]), int(tp[1])), pp, (int(dp[0]), int(dp[1]))


def model_dtype(engine: Any) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def _persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers that ``state_dict`` holds (not the non-persistent ones)."""
    for prefix, mod in module.named_modules():
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                yield (f"{prefix}.{name}" if prefix else name), buf


def holdings(engine: Any, naming: Naming | None = None) -> Holdings:
    """What this rank of ``engine`` holds (DeepSpeed's classes are imported here)."""
    tp, pp, dp = parallel_coords(engine)
    naming = naming or Naming(tp=tp, pp=pp)
    info = getattr(engine.module, "universal_checkpoint_info", None)
    naming = dataclasses.replace(naming, tp=tp, pp=pp, uci=naming.uci if naming.uci is not None
                                 else dict(info) if isinstance(info, Mapping) else None)
    optimizer = engine.optimizer
    kind = _kind(optimizer)
    stage = int(engine.zero_optimization_stage())
    module: torch.nn.Module = engine.module

    # every name of every parameter object: the first is stored, the others are aliases
    by_object: dict[int, list[str]] = {}
    objects: dict[int, Any] = {}  # DeepSpeed adds attributes to ZeRO-3 parameters
    for name, tensor in module.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(tensor), []).append(name)
        objects[id(tensor)] = tensor
    params: dict[str, Param] = {}
    by_id: dict[int, str] = {}  # parameter object -> consolidated name
    aliases: dict[str, str] = {}
    for pid, local_names in by_object.items():
        p: Any = objects[pid]
        shape = tuple(getattr(p, "ds_shape", p.shape))
        _even_autotp_split(local_names[0], p)
        placed = naming.place(local_names[0], shape)
        if placed is None:
            continue
        if isinstance(placed, str):
            aliases[local_names[0]] = placed
            continue
        if placed.name in params:
            raise LayoutError(f"parameters {params[placed.name].local_name!r} and "
                              f"{local_names[0]!r} map to the same consolidated tensor",
                              rule="UCP-1.0-R110", tensor=placed.name)
        partition = None
        if hasattr(p, "ds_tensor"):
            import torch.distributed as dist

            group = getattr(p, "ds_process_group", getattr(engine, "data_parallel_group", None))
            part = int(p.partition_numel())
            start = dist.get_rank(group) * part
            partition = (start, max(0, min(part, int(p.ds_numel) - start)))
        params[placed.name] = Param(local_names[0], p, placed, bool(p.requires_grad), partition)
        by_id[pid] = placed.name
        for alias in local_names[1:]:
            aliases[alias] = placed.name
    buffers: dict[str, tuple[torch.Tensor, Placed]] = {}
    for name, buf in _persistent_buffers(module):
        placed = naming.place(name, tuple(buf.shape))
        if isinstance(placed, Placed):
            buffers[placed.name] = (buf, placed)
        elif isinstance(placed, str):
            aliases[name] = placed
    flats = _flats(kind, optimizer, by_id)
    group_names = _group_names(kind, optimizer, by_id)
    return Holdings(kind, stage, model_dtype(engine), params, buffers, flats, aliases,
                    group_names, tp, pp, dp)


def _even_autotp_split(name: str, param: Any) -> None:
    """Refuse a parameter AutoTP split unevenly (UCP's layout semantics split evenly;
    AutoTP gives the remainder of a dimension that its grain or head count does not
    divide to some ranks: a vocabulary of 97 rows on 2 ranks is 49 + 48)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    meta = getattr(param, DS_AUTOTP_UC_META, None)
    sizes = meta.get("partition_sizes") if isinstance(meta, Mapping) else None
    if sizes and len({int(s) for s in sizes}) > 1:
        raise UnsupportedFeatureError(
            f"AutoTP split this tensor unevenly over the tensor-parallel ranks "
            f"({[int(s) for s in sizes]}); UCP's layout semantics describe even splits only",
            tensor=name)


def _group_names(kind: str, opt: Any, by_id: Mapping[int, str]) -> list[list[str]]:
    """Per optimizer param group, the consolidated names of its parameters, in order."""
    if kind == NONE:
        return []
    inner = opt.optimizer if kind != PLAIN else opt
    out: list[list[str]] = [[] for _ in inner.param_groups]
    if kind == ZERO:
        lp_groups = opt.bit16_groups if hasattr(opt, "bit16_groups") else opt.bf16_groups
        members = list(enumerate(lp_groups))
    elif kind == ZERO3:
        members = [(int(opt.sub_group_to_group_id[sg]), lps)
                   for sg, lps in enumerate(opt.fp16_groups)]
    elif kind == FP32_COPIES:
        members = list(enumerate(opt.fp16_groups))
    else:
        members = [(g, group["params"]) for g, group in enumerate(inner.param_groups)]
    for g, lps in members:
        out[g].extend(by_id[id(lp)] for lp in lps if id(lp) in by_id)
    return out


def _flats(kind: str, opt: Any, by_id: Mapping[int, str]) -> list[Flat]:
    """The optimizer's fp32 tensors and their slots."""
    flats: list[Flat] = []
    if kind == ZERO:
        masters = (opt.single_partition_of_fp32_groups if hasattr(
            opt, "single_partition_of_fp32_groups") else opt.fp32_groups_flat_partition)
        lp_groups = opt.bit16_groups if hasattr(opt, "bit16_groups") else opt.bf16_groups
        for g, (master, lps) in enumerate(zip(masters, lp_groups, strict=True)):
            flat = Flat(master, g)
            for lp in lps:
                mapping = getattr(lp, "_hp_mapping", None)
                if mapping is None or id(lp) not in by_id:
                    continue
                lp_addr, hp_addr = mapping.lp_fragment_address, mapping.hp_fragment_address
                flat.slots.append(Slot(by_id[id(lp)], int(lp_addr.start), int(lp_addr.numel),
                                       int(hp_addr.start)))
            flats.append(flat)
    elif kind == ZERO3:
        for sg, (master, lps) in enumerate(zip(opt.fp32_partitioned_groups_flat,
                                                opt.fp16_groups, strict=True)):
            flat = Flat(master, int(opt.sub_group_to_group_id[sg]))
            for lp in lps:
                if id(lp) not in by_id:
                    continue
                import torch.distributed as dist

                _, offset, _ = opt.grad_position[opt.get_param_id(lp)]
                part = int(lp.partition_numel())
                group = getattr(lp, "ds_process_group", opt.dp_process_group)
                start = dist.get_rank(group) * part
                numel = max(0, min(part, int(lp.ds_numel) - start))
                if numel:
                    flat.slots.append(Slot(by_id[id(lp)], start, numel, int(offset)))
            flats.append(flat)
    elif kind == FP32_COPIES:
        for g, (lps, masters) in enumerate(zip(opt.fp16_groups, opt.fp32_groups, strict=True)):
            for lp, master in zip(lps, masters, strict=True):
                if id(lp) in by_id:
                    flats.append(Flat(master, g, [Slot(by_id[id(lp)], 0, lp.numel(), 0)]))
    elif kind == PLAIN:
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) in by_id:
                    flats.append(Flat(p, g, [Slot(by_id[id(p)], 0, p.numel(), 0)]))
    return flats


def inner_optimizer(engine: Any) -> Any:
    """The torch optimizer that holds the state (inside DeepSpeed's wrapper, if any)."""
    opt = engine.optimizer
    if opt is None:
        return None
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


__all__ = [
    "FP32_COPIES",
    "NONE",
    "PLAIN",
    "ZERO",
    "ZERO3",
    "Flat",
    "Holdings",
    "Naming",
    "Param",
    "Placed",
    "Slot",
    "holdings",
    "identity",
    "inner_optimizer",
    "model_dtype",
    "parallel_coords",
]

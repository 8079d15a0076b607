"""Which part of a consolidated tensor each rank holds, for a target parallel layout.

Given a tensor's layout semantics (:mod:`ucpformat.layout.semantics`), the framework's
local conventions and a parallel configuration, :func:`local_map` gives a rank's local
tensor as pieces of the consolidated one: tensor parallelism (with fused parts in
part-major or group-major order, and vocabulary padding), expert parallelism, pipeline
stages by global layer index, and ZeRO-3/FSDP-style dim-0 sharding. Flat ZeRO partitions
are in :mod:`ucpformat.layout.zero`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ucpformat.errors import LayoutError
from ucpformat.layout.boxes import LocalMap, Piece
from ucpformat.layout.semantics import FUSED_ORDERS, GROUP_MAJOR, PART_MAJOR, TensorLayout

STAGES = ("all", "first", "last", "first_and_last")


@dataclass(frozen=True)
class Conventions:
    """How a framework lays one tensor out locally (not stored in the checkpoint)."""

    fused_order: str = PART_MAJOR
    stage: str = "all"  # for tensors without a layer index: which pipeline stages hold them
    vocab_multiple: int | None = None  # pad the vocabulary to a multiple of this * tp

    def __post_init__(self) -> None:
        if self.fused_order not in FUSED_ORDERS:
            raise LayoutError(f"fused_order must be one of {FUSED_ORDERS}", rule="UCP-1.0-R120")
        if self.stage not in STAGES:
            raise LayoutError(f"stage must be one of {STAGES}", rule="UCP-1.0-R120")


@dataclass(frozen=True)
class RankCoords:
    """A rank's position along each parallel dimension."""

    tp: int = 0
    cp: int = 0
    dp: int = 0
    pp: int = 0

    def ep(self, cfg: ParallelConfig) -> int:
        """Expert-parallel rank: the fastest-varying part of the data-parallel rank."""
        return self.dp % cfg.ep

    def edp(self, cfg: ParallelConfig) -> int:
        """Rank in the expert data-parallel group (data-parallel ranks holding the same experts)."""
        return self.dp // cfg.ep


@dataclass(frozen=True)
class ParallelConfig:
    """A parallel layout: sizes, ZeRO stage, and pipeline layer assignment.

    Ranks are ordered tensor-parallel fastest, then context-parallel, data-parallel and
    pipeline-parallel (Megatron's default order); expert parallelism splits the
    data-parallel dimension (``dp % ep == 0``).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    zero: int = 0  # 0: replicated; 1/2: optimizer state flat-partitioned; 3: everything
    zero_style: str = (
        "dim0"  # for zero=3: "dim0" (FSDP, torch.chunk on dim 0) or "flat" (DeepSpeed)
    )
    num_layers: int | None = None
    pp_layers: tuple[int, ...] | None = None  # layers per stage (default: even split)
    num_experts: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1", rule="UCP-1.0-R110")
        if self.dp % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp={self.dp}", rule="UCP-1.0-R111")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError("zero must be 0, 1, 2 or 3", rule="UCP-1.0-R110")
        if self.zero_style not in ("dim0", "flat"):
            raise LayoutError("zero_style must be 'dim0' or 'flat'", rule="UCP-1.0-R110")
        if self.pp_layers is not None and len(self.pp_layers) != self.pp:
            raise LayoutError("pp_layers needs one entry per stage", rule="UCP-1.0-R112")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} outside world size {self.world}", rule="UCP-1.0-R110")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return RankCoords(tp=tp, cp=cp, dp=dp, pp=pp)

    def rank(self, coords: RankCoords) -> int:
        return coords.tp + self.tp * (coords.cp + self.cp * (coords.dp + self.dp * coords.pp))

    def stage_layers(self, stage: int) -> range:
        """Global layer indices held by a pipeline stage."""
        if self.num_layers is None:
            raise LayoutError(
                "num_layers is needed to place layers on pipeline stages", rule="UCP-1.0-R112"
            )
        counts = self.pp_layers or self._even_split()
        if sum(counts) != self.num_layers:
            raise LayoutError(
                f"pp_layers {counts} do not sum to num_layers {self.num_layers}",
                rule="UCP-1.0-R112",
            )
        start = sum(counts[:stage])
        return range(start, start + counts[stage])

    def _even_split(self) -> tuple[int, ...]:
        assert self.num_layers is not None
        if self.num_layers % self.pp:
            raise LayoutError(
                f"{self.num_layers} layers do not split evenly over pp={self.pp}; give pp_layers",
                rule="UCP-1.0-R112",
            )
        return (self.num_layers // self.pp,) * self.pp

    def stage_of_layer(self, layer: int) -> int:
        if self.pp == 1 and self.num_layers is None:
            return 0  # one stage holds every layer; the model's depth is not needed
        for stage in range(self.pp):
            if layer in self.stage_layers(stage):
                return stage
        raise LayoutError(
            f"layer {layer} is outside the model's {self.num_layers} layers", rule="UCP-1.0-R112"
        )

    def holds_stage(self, conventions: Conventions, stage: int) -> bool:
        where = conventions.stage
        return (
            where == "all"
            or (where == "first" and stage == 0)
            or (where == "last" and stage == self.pp - 1)
            or (where == "first_and_last" and stage in (0, self.pp - 1))
        )


# -- one dimension at a time --------------------------------------------------------------


@dataclass(frozen=True)
class DimMap:
    """A local dimension of ``length`` made of segments (local_start, glob_start, n)."""

    length: int
    segments: tuple[tuple[int, int, int], ...]

    @staticmethod
    def identity(n: int) -> DimMap:
        return DimMap(n, ((0, 0, n),) if n else ())

    def restrict(self, lo: int, hi: int) -> DimMap:
        """The local sub-range [lo, hi), re-based at 0."""
        out = []
        for ls, gs, n in self.segments:
            a, b = max(ls, lo), min(ls + n, hi)
            if a < b:
                out.append((a - lo, gs + a - ls, b - a))
        return DimMap(hi - lo, tuple(out))

    @staticmethod
    def concat(maps: Sequence[DimMap]) -> DimMap:
        out: list[tuple[int, int, int]] = []
        off = 0
        for m in maps:
            out.extend((ls + off, gs, n) for ls, gs, n in m.segments)
            off += m.length
        return DimMap(off, tuple(_merge(out)))


def _merge(segments: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    merged: list[tuple[int, int, int]] = []
    for seg in segments:
        if merged:
            ls, gs, n = merged[-1]
            if ls + n == seg[0] and gs + n == seg[1]:
                merged[-1] = (ls, gs, n + seg[2])
                continue
        merged.append(seg)
    return merged


def product(dims: Sequence[DimMap]) -> LocalMap:
    """The local map whose pieces are the products of per-dimension segments."""
    pieces = []
    for combo in itertools.product(*(d.segments for d in dims)):
        local = tuple((ls, ls + n) for ls, _, n in combo)
        glob = tuple((gs, gs + n) for _, gs, n in combo)
        pieces.append(Piece(local, glob))
    return LocalMap(tuple(d.length for d in dims), tuple(pieces))


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk semantics: ceil-sized chunks, the last ones smaller or empty."""
    size = -(-n // parts) if n else 0
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def _split(n: int, ways: int, index: int, what: str, tensor: str | None) -> tuple[int, int]:
    if n % ways:
        raise LayoutError(
            f"{what} of size {n} does not divide by {ways}", rule="UCP-1.0-R110", tensor=tensor
        )
    size = n // ways
    return index * size, (index + 1) * size


def vocab_dim_map(size: int, multiple: int, ways: int, index: int) -> DimMap:
    """A vocabulary dimension padded to a multiple of ``multiple * ways``, then split.

    The consolidated tensor holds only the ``size`` real rows; padding rows have no
    piece (loaders fill them with zeros, savers drop them).
    """
    step = multiple * ways
    padded = -(-size // step) * step
    per = padded // ways
    lo, hi = index * per, (index + 1) * per
    segs = ((0, lo, min(hi, size) - lo),) if lo < size else ()
    return DimMap(per, segs)


def tp_dim_map(
    size: int,
    layout: TensorLayout,
    conventions: Conventions,
    tp: int,
    tp_rank: int,
    *,
    tensor: str | None = None,
) -> DimMap:
    """The local tensor-parallel dimension of ``tp_rank``."""
    if layout.vocab_dim is not None and layout.vocab_dim == layout.tp_dim:
        return vocab_dim_map(size, conventions.vocab_multiple or 1, tp, tp_rank)
    if not layout.parts:
        lo, hi = _split(size, tp, tp_rank, f"dimension {layout.tp_dim}", tensor)
        return DimMap.identity(size).restrict(lo, hi)
    groups = layout.groups or tp
    if groups % tp:
        raise LayoutError(
            f"{groups} groups of fused parts {[p.name for p in layout.parts]} cannot be split "
            f"over tp={tp}",
            rule="UCP-1.0-R110",
            tensor=tensor,
        )
    for part in layout.parts:
        if part.size % groups:
            raise LayoutError(
                f"fused part {part.name!r} of size {part.size} cannot be split over tp={tp} "
                f"({groups} groups)",
                rule="UCP-1.0-R110",
                tensor=tensor,
            )
    mine = range(tp_rank * groups // tp, (tp_rank + 1) * groups // tp)
    pieces: list[DimMap] = []
    offsets = layout.part_offsets()
    # the fused order applies at every degree, tp=1 included (UCP-1.0-R119)
    if conventions.fused_order == GROUP_MAJOR:
        order = [(g, p, off) for g in mine for p, off in offsets]
    else:
        order = [(g, p, off) for p, off in offsets for g in mine]
    for g, p, off in order:
        gsize = p.size // groups
        pieces.append(DimMap(gsize, ((0, off + g * gsize, gsize),)))
    return DimMap.concat(pieces)


def local_map(
    shape: Sequence[int],
    layout: TensorLayout,
    conventions: Conventions,
    cfg: ParallelConfig,
    coords: RankCoords,
    *,
    zero3: bool = True,
    tensor: str | None = None,
) -> LocalMap | None:
    """The local tensor of rank ``coords`` as pieces of the consolidated ``shape``.

    None if this rank does not hold the tensor (another pipeline stage or expert rank).
    ``zero3=False`` gives the map before ZeRO-3/FSDP sharding (the tensor-parallel
    local tensor that flat ZeRO partitions are cut from).
    """
    shape = tuple(int(s) for s in shape)
    layout.check(shape, tensor=tensor)
    if layout.layer is not None:
        if cfg.stage_of_layer(layout.layer) != coords.pp:
            return None
    elif layout.layers_dim is None and not cfg.holds_stage(conventions, coords.pp):
        return None
    is_expert = layout.expert is not None or layout.experts_dim is not None
    if layout.expert is not None:
        if cfg.num_experts is None:
            raise LayoutError(
                "num_experts is needed to place per-expert tensors",
                rule="UCP-1.0-R111",
                tensor=tensor,
            )
        per = _split(cfg.num_experts, cfg.ep, 0, "experts", tensor)[1]
        if layout.expert // per != coords.ep(cfg):
            return None
    dims = [DimMap.identity(n) for n in shape]
    if layout.layers_dim is not None:
        held = cfg.stage_layers(coords.pp)
        dims[layout.layers_dim] = dims[layout.layers_dim].restrict(held.start, held.stop)
    if layout.experts_dim is not None:
        lo, hi = _split(shape[layout.experts_dim], cfg.ep, coords.ep(cfg), "experts", tensor)
        dims[layout.experts_dim] = dims[layout.experts_dim].restrict(lo, hi)
    if layout.tp_dim is not None and (cfg.tp > 1 or layout.vocab_dim is not None or layout.parts):
        dims[layout.tp_dim] = tp_dim_map(
            shape[layout.tp_dim], layout, conventions, cfg.tp, coords.tp, tensor=tensor
        )
    elif layout.vocab_dim is not None:
        # not split, but padded as the model's vocabulary is: to m * tp (UCP-1.0-R118)
        dims[layout.vocab_dim] = vocab_dim_map(
            shape[layout.vocab_dim], (conventions.vocab_multiple or 1) * cfg.tp, 1, 0
        )
    if zero3 and cfg.zero == 3 and cfg.zero_style == "dim0" and dims:
        ways = cfg.dp // cfg.ep if is_expert else cfg.dp
        index = coords.edp(cfg) if is_expert else coords.dp
        lo, hi = chunk_bounds(dims[0].length, ways, index)
        dims[0] = dims[0].restrict(lo, hi)
    return product(dims)


def zero3_flat_map(tp_local: LocalMap, ways: int, index: int) -> LocalMap:
    """DeepSpeed ZeRO-3: the flattened local tensor padded to ``ways`` equal partitions."""
    numel = math.prod(tp_local.local_shape)
    size = -(-numel // ways) if numel else 0
    lo, hi = min(index * size, numel), min((index + 1) * size, numel)
    pieces = [
        Piece(((off, off + math.prod(b[1] - b[0] for b in glob)),), glob)
        for off, glob in tp_local.flat_range(lo, hi)
    ]
    return LocalMap((size,), tuple(pieces))

"""Target and source layouts of the suite, computed with the reference layout library.

A *target* (``config`` of a reader request, UCP-1.0-R215) asks a layout-aware reader for
one rank's local tensor under tensor, pipeline and expert parallelism. A *source*
(``content.source`` of a writer scenario, UCP-1.0-R222) says how a framework cut a
tensor into the per-rank local tensors that a layout-aware writer consolidates: the
Megatron-style tensor-parallel convention, or DTensor placements over a device mesh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucpformat.checkpoint.reader import Checkpoint
from ucpformat.errors import LayoutError
from ucpformat.layout.boxes import LocalMap, as_slices, box_shape
from ucpformat.layout.dtensor import dtensor_local_map, placement_from_json
from ucpformat.layout.rank_slices import Conventions, ParallelConfig, RankCoords, local_map
from ucpformat.layout.semantics import TensorLayout

TARGET_DEFAULTS: Mapping[str, Any] = {
    "tp": 1,
    "tp_rank": 0,
    "pp": 1,
    "pp_rank": 0,
    "ep": 1,
    "ep_rank": 0,
    "fused_order": "part-major",
    "vocab_multiple": 1,
    "stage": "all",
}


@dataclass(frozen=True)
class Target:
    """One rank of a target parallel layout (tensor, pipeline and expert parallelism; no
    data-parallel degree: ``ep`` stands for it, UCP-1.0-R216)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    num_layers: int | None = None
    num_experts: int | None = None
    fused_order: str = "part-major"
    vocab_multiple: int = 1
    stage: str = "all"  # the stages that hold tensors without a layer index (UCP-1.0-R115)
    pp_layers: tuple[int, ...] | None = None  # layers of each stage (default: even, UCP-1.0-R116)

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> Target:
        known = {f for f in Target.__dataclass_fields__}
        given = {k: v for k, v in doc.items() if k in known}
        if given.get("pp_layers") is not None:
            given["pp_layers"] = tuple(given["pp_layers"])
        return Target(**given)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in Target.__dataclass_fields__:
            value = getattr(self, key)
            if value is not None and TARGET_DEFAULTS.get(key) != value:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def local_map(self, shape: Sequence[int], layout: TensorLayout, *, tensor: str
                  ) -> LocalMap | None:
        """The rank's local tensor as pieces of the consolidated one; None if not held.

        Raises LayoutError (with UCP-1.0-R110, UCP-1.0-R111 or UCP-1.0-R112) for a target that
        cannot
        hold the tensor exactly.
        """
        for name in ("tp", "pp", "ep"):
            degree, rank = getattr(self, name), getattr(self, f"{name}_rank")
            if degree < 1:
                raise LayoutError(f"{name} must be at least 1", rule="UCP-1.0-R110", tensor=tensor)
            if not 0 <= rank < degree:
                raise LayoutError(f"{name}_rank {rank} is outside {name}={degree}",
                                  rule="UCP-1.0-R110", tensor=tensor)
        if layout.experts_dim is not None and shape[layout.experts_dim] % self.ep:
            raise LayoutError(
                f"ep={self.ep} does not divide the {shape[layout.experts_dim]} experts",
                rule="UCP-1.0-R111",
                tensor=tensor,
            )
        if (layout.experts_dim is not None and self.num_experts is not None
                and self.num_experts != shape[layout.experts_dim]):
            raise LayoutError(  # a stacked tensor holds every expert (UCP-1.0-R117)
                f"num_experts={self.num_experts} differs from the {shape[layout.experts_dim]} "
                "stacked experts", rule="UCP-1.0-R111", tensor=tensor,
            )
        num_experts = self.num_experts
        if layout.expert is not None and num_experts is None and self.ep == 1:
            num_experts = layout.expert + 1  # one expert-parallel rank holds every expert
        if layout.expert is not None and (num_experts is None or num_experts % self.ep):
            raise LayoutError(f"ep={self.ep} does not divide num_experts={num_experts}",
                              rule="UCP-1.0-R111", tensor=tensor)
        if layout.expert is not None and num_experts is not None and layout.expert >= num_experts:
            raise LayoutError(f"expert {layout.expert} is outside the model's {num_experts}",
                              rule="UCP-1.0-R111", tensor=tensor)
        num_layers = self.num_layers  # (UCP-1.0-R116)
        if num_layers is None and self.pp_layers is not None:
            num_layers = sum(self.pp_layers)
        if num_layers is None and layout.layers_dim is not None:
            num_layers = shape[layout.layers_dim]  # a stacked tensor holds every layer
        elif num_layers is None and self.pp == 1 and layout.layer is not None:
            num_layers = layout.layer + 1  # one stage holds every layer
        if layout.layers_dim is not None and num_layers != shape[layout.layers_dim]:
            raise LayoutError(
                f"num_layers={num_layers} differs from the {shape[layout.layers_dim]} "
                "stacked layers", rule="UCP-1.0-R112", tensor=tensor,
            )
        cfg = ParallelConfig(
            tp=self.tp,
            pp=self.pp,
            dp=self.ep,
            ep=self.ep,
            num_layers=num_layers,
            pp_layers=self.pp_layers,
            num_experts=num_experts,
        )
        coords = RankCoords(tp=self.tp_rank, dp=self.ep_rank, pp=self.pp_rank)
        conv = Conventions(fused_order=self.fused_order, stage=self.stage,
                           vocab_multiple=self.vocab_multiple)
        return local_map(shape, layout, conv, cfg, coords, zero3=False, tensor=tensor)


def local_from_array(full: np.ndarray[Any, Any], lmap: LocalMap) -> np.ndarray[Any, Any]:
    """The local tensor of ``lmap`` cut from the consolidated ``full`` (padding: zero bits)."""
    out = np.zeros(lmap.local_shape, dtype=full.dtype)
    for piece in lmap.pieces:
        out[as_slices(piece.local)] = full[as_slices(piece.glob)]
    return out


def local_from_checkpoint(ckpt: Checkpoint, path: str, lmap: LocalMap) -> np.ndarray[Any, Any]:
    """The local tensor of ``lmap`` read from a checkpoint (padding: zero bits)."""
    tensor = ckpt[path]
    out = np.zeros(lmap.local_shape, dtype=tensor.dtype)
    for piece in lmap.pieces:
        lo = [a for a, _ in piece.glob]
        hi = [b for _, b in piece.glob]
        out[as_slices(piece.local)] = tensor.read_region(lo, hi).reshape(box_shape(piece.local))
    return out


# -- sources of writer scenarios ----------------------------------------------------------


def source_maps(
    source: Mapping[str, Any], shape: Sequence[int], layout: TensorLayout, *, tensor: str
) -> list[LocalMap]:
    """The local map of every rank of a scenario source, in rank order."""
    kind = source.get("kind")
    if kind == "megatron":
        tp = int(source.get("tp", 1))
        target = Target(tp=tp, fused_order=str(source.get("fused_order", "part-major")),
                        vocab_multiple=int(source.get("vocab_multiple", 1)))
        maps = []
        for r in range(tp):
            m = Target(**{**target.__dict__, "tp_rank": r}).local_map(shape, layout, tensor=tensor)
            assert m is not None
            maps.append(m)
        return maps
    if kind == "dtensor":
        mesh = [int(n) for n in source["mesh"]]
        placements = [placement_from_json(p) for p in source["placements"]]
        out = []
        for rank in range(int(np.prod(mesh))):
            coords = list(np.unravel_index(rank, mesh)) if mesh else []
            out.append(dtensor_local_map(shape, mesh, placements, [int(c) for c in coords],
                                         tensor=tensor))
        return out
    raise LayoutError(f"unknown source kind {kind!r}", rule="UCP-1.0-R222", tensor=tensor)


__all__ = ["Target", "local_from_array", "local_from_checkpoint", "source_maps"]

"""A framework's per-rank state <-> the consolidated checkpoint, through a rule file.

:class:`ModelLayout` is a rule set, its parameters and a parallel configuration. For
one rank it turns the rank's local tensors (local names, stage-local layer numbers,
padded vocabularies, fused interleaved parts, ZeRO-3 partitions) into fragments of the
consolidated tensors for :func:`ucpformat.distributed.save_fragments`, and it builds
a rank's local tensors back from any checkpoint, whatever layout saved it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucpformat.checkpoint.reader import Checkpoint
from ucpformat.distributed import Fragment, TensorSpec, read_flat, read_local
from ucpformat.errors import LayoutError
from ucpformat.format import dtypes, names
from ucpformat.layout.boxes import LocalMap, as_slices, box_shape
from ucpformat.layout.rank_slices import (
    Conventions,
    ParallelConfig,
    RankCoords,
    local_map,
    zero3_flat_map,
)
from ucpformat.layout.rules import Resolved, RuleSet
from ucpformat.layout.semantics import TensorLayout, layout_of
from ucpformat.layout.zero import FlatPartition, flat_partition


@dataclass(frozen=True)
class ModelLayout:
    """A model family's rules with its parameters, under one parallel configuration."""

    rules: RuleSet
    params: Mapping[str, Any]
    cfg: ParallelConfig
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def coords(self, rank: int) -> RankCoords:
        return self.cfg.coords(rank)

    def resolve(self, global_name: str) -> Resolved | None:
        return self.rules.resolve(global_name, self.params)

    def _is_expert(self, layout: TensorLayout) -> bool:
        return layout.expert is not None or layout.experts_dim is not None

    def tensor_map(
        self,
        global_shape: Sequence[int],
        layout: TensorLayout,
        conv: Conventions,
        coords: RankCoords,
        *,
        zero3: bool = True,
        tensor: str,
    ) -> LocalMap | None:
        """The local map of a tensor on ``coords``, including ZeRO-3 (dim-0 or flat)."""
        tp_local = local_map(
            global_shape, layout, conv, self.cfg, coords, zero3=zero3, tensor=tensor
        )
        if tp_local is None or not zero3 or self.cfg.zero != 3 or self.cfg.zero_style != "flat":
            return tp_local
        expert = self._is_expert(layout)
        ways = self.cfg.dp // self.cfg.ep if expert else self.cfg.dp
        index = coords.edp(self.cfg) if expert else coords.dp
        return zero3_flat_map(tp_local, ways, index)

    # -- shapes ----------------------------------------------------------------------------

    def global_shape(
        self, name: str, local_shape: Sequence[int], resolved: Resolved
    ) -> tuple[int, ...]:
        """The consolidated shape of a tensor, given its tensor-parallel local shape."""
        if name in self.shapes:
            return tuple(self.shapes[name])
        if self.cfg.zero == 3:
            raise LayoutError(
                "under ZeRO-3 local tensors are partitions: give the consolidated shapes",
                rule="UCP-1.0-R110",
                tensor=name,
            )
        lay = resolved.layout
        shape = list(local_shape)
        if lay.vocab_dim is not None:
            hint = self.rules.vocab_size_hint(name, self.params)
            assert lay.vocab_dim is not None
            if hint is None:
                raise LayoutError(
                    "the vocabulary size is needed (rule 'vocab.size')",
                    rule="UCP-1.0-R113",
                    tensor=name,
                )
            shape[lay.vocab_dim] = hint
        elif lay.tp_dim is not None:
            shape[lay.tp_dim] *= self.cfg.tp
        if lay.experts_dim is not None:
            shape[lay.experts_dim] *= self.cfg.ep
        if lay.layers_dim is not None:
            if self.cfg.num_layers is None:
                raise LayoutError(
                    "num_layers is needed for stacked layers", rule="UCP-1.0-R112", tensor=name
                )
            shape[lay.layers_dim] = self.cfg.num_layers
        return tuple(shape)

    # -- save side ---------------------------------------------------------------------------

    def fragments(
        self,
        rank: int,
        local_state: Mapping[str, np.ndarray[Any, Any]],
        *,
        prefix: str = "model",
        role: str | None = "parameter",
        path_of: Callable[[str], str] | None = None,
        with_layout: bool = True,
    ) -> tuple[list[TensorSpec], list[Fragment], dict[str, str]]:
        """Specs and fragments of a rank's local tensors, and the aliases of tied tensors.

        Tensors are stored at ``path_of(global name)`` (default ``prefix/<escaped name>``).
        ``with_layout=False`` leaves the layout out of the attributes: optimizer states
        follow their parameter's layout (spec UCP-1.0-R109).
        """
        coords = self.coords(rank)
        specs: list[TensorSpec] = []
        frags: list[Fragment] = []
        aliases: dict[str, str] = {}
        for local_name, value in local_state.items():
            name = self.rules.global_name(local_name, self.params, self.cfg, coords)
            resolved = self.resolve(name)
            if resolved is None:
                continue
            if resolved.tied_to is not None:
                aliases[name] = resolved.tied_to
                continue
            arr = np.asarray(value)
            shape = self.global_shape(name, arr.shape, resolved)
            lmap = self.tensor_map(
                shape, resolved.layout, resolved.conventions, coords, tensor=name
            )
            if lmap is None:
                raise LayoutError(
                    f"rank {rank} holds {local_name!r}, which this layout places on another rank",
                    rule="UCP-1.0-R112",
                    tensor=name,
                )
            if tuple(arr.shape) != lmap.local_shape:
                raise LayoutError(
                    f"local tensor {local_name!r} has shape {list(arr.shape)}, the layout gives "
                    f"{list(lmap.local_shape)} on rank {rank}",
                    rule="UCP-1.0-R110",
                    tensor=name,
                )
            path = path_of(name) if path_of else f"{prefix}/{names.escape(name)}"
            attrs: dict[str, Any] = {"layout": resolved.layout.to_json()} if with_layout else {}
            if role:
                attrs["role"] = role
            specs.append(
                TensorSpec(
                    path, shape, dtypes.from_numpy(arr.dtype, tensor=name).name, {"ucp": attrs}
                )
            )
            for piece in lmap.pieces:
                if box_shape(piece.local) == box_shape(piece.glob):
                    frags.append(Fragment(path, piece.glob, arr[as_slices(piece.local)]))
                else:  # flat local (ZeRO-3 flat)
                    ((a, b),) = piece.local
                    frags.append(Fragment(path, piece.glob, arr.reshape(-1)[a:b]))
        return specs, frags, aliases

    def group_params(
        self,
        rank: int,
        local_names: Sequence[str],
        shapes: Mapping[str, Sequence[int]],
        *,
        experts: bool | None = None,
    ) -> list[tuple[str, LocalMap]]:
        """(global name, tensor-parallel local map) of the parameters of a flat group, in order."""
        coords = self.coords(rank)
        out = []
        for local_name in local_names:
            name = self.rules.global_name(local_name, self.params, self.cfg, coords)
            resolved = self.resolve(name)
            if resolved is None or resolved.tied_to is not None:
                continue
            if experts is not None and self._is_expert(resolved.layout) != experts:
                continue
            m = local_map(
                shapes[name],
                resolved.layout,
                resolved.conventions,
                self.cfg,
                coords,
                zero3=False,
                tensor=name,
            )
            if m is not None:
                out.append((name, m))
        return out

    def flat_partition(
        self,
        rank: int,
        params: Sequence[tuple[str, LocalMap]],
        *,
        experts: bool = False,
        align: int = 1,
    ) -> FlatPartition:
        """This rank's ZeRO-1/2 partition of a flat group, over the (expert) data-parallel ranks."""
        coords = self.coords(rank)
        ways = self.cfg.dp // self.cfg.ep if experts else self.cfg.dp
        index = coords.edp(self.cfg) if experts else coords.dp
        return flat_partition(params, ways, index, align=align)

    # -- load side ---------------------------------------------------------------------------

    def local_state(
        self,
        ckpt: Checkpoint,
        rank: int,
        *,
        prefix: str = "model",
        path_of: Callable[[str], str] | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """The local tensors of ``rank`` under this layout, read from any checkpoint.

        Names come from the group ``prefix`` (and its aliases); with ``path_of`` the data
        of each name is read from ``path_of(name)`` instead (e.g. an optimizer state).
        """
        coords = self.coords(rank)
        out: dict[str, np.ndarray[Any, Any]] = {}
        group = ckpt.groups.get(prefix)
        aliases = dict(group.ucp.get("aliases", {})) if group is not None else {}
        start = prefix + "/"
        entries: list[tuple[str, str]] = []  # (global name, path of the stored array)
        for path in ckpt:
            if path.startswith(start) and "/" not in path[len(start) :]:
                entries.append((names.unescape(path[len(start) :]), path))
        if path_of is None:  # a tied tensor's optimizer state is kept once, with its target
            for alias, target in sorted(aliases.items()):
                entries.append((alias, f"{prefix}/{names.escape(target)}"))
        else:
            entries = [(name, path_of(names.unescape(p[len(start) :]))) for name, p in entries]
        for name, path in entries:
            if path not in ckpt:
                continue
            tensor = ckpt[path]
            resolved = self.resolve(name)
            if resolved is None:
                continue
            stored = layout_of(tensor.attributes, tensor.shape, tensor=path)
            if "layout" not in tensor.attributes and path_of is not None:
                stored = self._parameter_layout(ckpt, prefix, name, tensor.shape) or stored
            layout = _with_position(stored, resolved)
            lmap = self.tensor_map(tensor.shape, layout, resolved.conventions, coords, tensor=name)
            if lmap is None:
                continue
            local_name = self.rules.local_name(name, self.params, self.cfg, coords)
            out[local_name] = read_local(ckpt, path, lmap)
        return out

    def _parameter_layout(
        self, ckpt: Checkpoint, prefix: str, name: str, shape: Sequence[int]
    ) -> TensorLayout | None:
        """The layout of parameter ``name``, which a same-shaped state follows (UCP-1.0-R109)."""
        path = f"{prefix}/{names.escape(name)}"
        if path not in ckpt or ckpt[path].shape != tuple(shape):
            return None
        param = ckpt[path]
        return layout_of(param.attributes, param.shape, tensor=path)

    def read_partition(
        self, ckpt: Checkpoint, partition: FlatPartition, path_of: Any, dtype: Any
    ) -> np.ndarray[Any, Any]:
        """A flat partition buffer from the consolidated arrays ``path_of(global name)``."""
        return read_flat(
            ckpt,
            [(path_of(p.tensor), p.offset, p.glob) for p in partition.pieces],
            partition.size,
            dtype,
        )


def _with_position(stored: TensorLayout, resolved: Resolved) -> TensorLayout:
    """The stored semantics, with the layer/expert position the name gives if unset."""
    if (
        (stored.layer is None
        and resolved.layer is not None)
        or (stored.expert is None
        and resolved.expert is not None)
    ):
        doc = stored.to_json()
        if resolved.layer is not None:
            doc.setdefault("layer", resolved.layer)
        if resolved.expert is not None:
            doc.setdefault("expert", resolved.expert)
        return TensorLayout.from_json(doc)
    return stored


def flat_fragments(
    buffer: np.ndarray[Any, Any], partition: FlatPartition, path_of: Any
) -> list[Fragment]:
    """Fragments of the consolidated tensors held in a rank's flat partition buffer."""
    if buffer.size != partition.size:
        raise LayoutError(
            f"flat buffer has {buffer.size} elements, the partition has {partition.size}",
            rule="UCP-1.0-R110",
        )
    flat = buffer.reshape(-1)
    return [
        Fragment(path_of(p.tensor), p.glob, flat[p.offset : p.offset + p.size])
        for p in partition.pieces
    ]


__all__ = ["ModelLayout", "flat_fragments"]

"""Where the fragment of a Megatron ``ShardedTensor`` lies in the consolidated arrays.

megatron-core names every tensor of a checkpoint by a *key* and describes each rank's
part of it as a region of the key's *Megatron global tensor*. That tensor differs from
UCP's consolidated tensors (spec, layout chapter) in three ways, and this module maps
one onto the other (numpy only; the strategies in :mod:`ucpformat.megatron.strategies`
use it for saving and loading alike):

1. **Stacked layers and experts.** A transformer block's layers share one key, with a
   prepended axis for the global layer index (``decoder.layers.self_attention.linear_qkv
   .weight`` of shape ``(L, 3h', h)``), and a SequentialMLP's experts a second one. UCP
   stores one array per layer and expert, named like the model's own tensors, with the
   global indices inserted (:func:`tensor_name`): the layer after the key's first
   ``layers`` component, the expert after its last ``experts`` component.
2. **Fused parts with query groups.** Megatron's global tensor of a fused QKV weight is
   the concatenation of the tensor-parallel ranks' local tensors: interleaved per query
   group (``[q_g; k_g; v_g]`` for each group g). UCP stores the parts one after the other
   (``[q; k; v]``, UCP-1.0-R102). Megatron's form is the group-major local tensor of
   tensor-parallel degree 1, which :func:`megatron_map` builds from the layout semantics.
   (SwiGLU's ``linear_fc1`` has no groups: Megatron's factory already gives it the
   stored form ``[gate; up]``.)
3. **Vocabulary padding.** Megatron's global embedding and output layer have the padded
   vocabulary; UCP stores the real rows only (UCP-1.0-R113). The padding rows map to nothing:
   a save drops them, a load fills them with zeros.

Optimizer states of the parameter-shaped kinds (``optimizer.state.<state>.<key>``:
Megatron's regular optimizers and the distributed optimizer's ``fully_reshardable``
state dict) go to ``optimizer/state/<parameter>/<state>`` (UCP-1.0-R081), with the fp32 master
copy under one name, ``master_param``, whichever optimizer saved it (``fp32_param`` of
the mixed-precision optimizer, ``param`` of the distributed one), so that a checkpoint
saved with the distributed optimizer loads without it and the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from ucpformat.errors import LayoutError
from ucpformat.format import names
from ucpformat.layout.boxes import Box, LocalMap
from ucpformat.layout.rank_slices import Conventions, DimMap, product, tp_dim_map, vocab_dim_map
from ucpformat.layout.semantics import GROUP_MAJOR, TensorLayout

#: The key components after which the prepended axes' indices are inserted, in order.
STACKED: Final = ("layers", "experts")
OPTIMIZER_PREFIX: Final = "optimizer.state."
#: The name UCP stores a master (fp32) copy under, and Megatron's names for it.
MASTER_STATE: Final = "master_param"
MASTER_ALIASES: Final = ("param", "fp32_param")
MODEL_GROUP: Final = "model"


def tensor_name(key: str, index: Sequence[int]) -> str:
    """The consolidated name of one slice of a stacked key (``index``: the values of its
    prepended axes): the layer index goes after the first ``layers`` component, the
    expert index after the last ``experts`` component behind it."""
    if not index:
        return key
    parts = key.split(".")
    if len(index) > len(STACKED) or "layers" not in parts:
        raise LayoutError(
            f"{len(index)} prepended axes: only stacked layers (after a 'layers' component) "
            "and experts (after an 'experts' component) can be named", tensor=key,
        )
    at = [parts.index("layers")]
    if len(index) == 2:
        later = [i for i, p in enumerate(parts) if p == "experts" and i > at[0]]
        if not later:
            raise LayoutError(
                "two prepended axes need an 'experts' component after 'layers' for the "
                "expert index", tensor=key,
            )
        at.append(later[-1])
    for pos, value in sorted(zip(at, index, strict=True), reverse=True):
        parts.insert(pos + 1, str(int(value)))
    return ".".join(parts)


def split_state_key(key: str) -> tuple[str, str] | None:
    """``optimizer.state.<state>.<parameter key>`` -> (state, parameter key); None for
    other keys."""
    if not key.startswith(OPTIMIZER_PREFIX):
        return None
    state, _, param = key[len(OPTIMIZER_PREFIX):].partition(".")
    if not state or not param:
        return None
    return state, param


def stored_state(state: str) -> str:
    """The name UCP stores optimizer state ``state`` under (master copies unified)."""
    return MASTER_STATE if state in MASTER_ALIASES else state


@dataclass(frozen=True)
class Location:
    """Where one slice of a Megatron key lives in a UCP checkpoint."""

    name: str  # the consolidated tensor name (global indices inserted)
    path: str  # the array's node path
    param_path: str  # the node path of its parameter (== path for model tensors)
    state: str | None  # the optimizer state's stored name; None for model tensors


def locate(key: str, index: Sequence[int]) -> Location:
    """The array of slice ``index`` of ``key``: ``model/<name>``, or
    ``optimizer/state/<name>/<state>`` for a parameter-shaped optimizer state."""
    split = split_state_key(key)
    if split is None:
        name = tensor_name(key, index)
        path = f"{MODEL_GROUP}/{names.escape(name)}"
        return Location(name, path, path, None)
    state, param = split
    name = tensor_name(param, index)
    stored = stored_state(state)
    return Location(
        name,
        f"optimizer/state/{names.escape(name)}/{names.escape(stored)}",
        f"{MODEL_GROUP}/{names.escape(name)}",
        stored,
    )


def megatron_map(
    shape: Sequence[int],
    layout: TensorLayout,
    megatron_shape: Sequence[int],
    *,
    tensor: str,
) -> LocalMap:
    """Megatron's global tensor of one slice (``megatron_shape``, the prepended axes left
    out) as pieces of the stored array of ``shape`` with ``layout``; rows of a padded
    vocabulary have no piece."""
    shape = tuple(int(n) for n in shape)
    megatron_shape = tuple(int(n) for n in megatron_shape)
    layout.check(shape, tensor=tensor)
    if len(megatron_shape) != len(shape):
        raise LayoutError(
            f"Megatron's tensor has shape {list(megatron_shape)}, the stored one "
            f"{list(shape)}", rule="UCP-1.0-R110", tensor=tensor,
        )
    dims = [DimMap.identity(n) for n in shape]
    vocab = layout.vocab_dim
    if vocab is not None:
        if megatron_shape[vocab] < shape[vocab]:
            raise LayoutError(
                f"Megatron's tensor has {megatron_shape[vocab]} vocabulary rows, fewer than "
                f"the {shape[vocab]} stored", rule="UCP-1.0-R113", tensor=tensor,
            )
        dims[vocab] = vocab_dim_map(shape[vocab], megatron_shape[vocab], 1, 0)
    elif layout.tp_dim is not None and layout.parts:
        dims[layout.tp_dim] = tp_dim_map(shape[layout.tp_dim], layout,
                                         Conventions(fused_order=GROUP_MAJOR), 1, 0,
                                         tensor=tensor)
    lmap = product(dims)
    if lmap.local_shape != megatron_shape:
        raise LayoutError(
            f"Megatron's tensor has shape {list(megatron_shape)}; the stored tensor of "
            f"shape {list(shape)} gives {list(lmap.local_shape)}", rule="UCP-1.0-R110",
            tensor=tensor,
        )
    return lmap


def stored_shape(
    megatron_shape: Sequence[int], layout: TensorLayout, vocab_size: int | None, *, tensor: str
) -> tuple[int, ...]:
    """The consolidated shape of a slice saved from Megatron's ``megatron_shape``: the
    real vocabulary size (``vocab_size``) along a vocabulary dimension."""
    shape = [int(n) for n in megatron_shape]
    if layout.vocab_dim is not None:
        if vocab_size is None:
            raise LayoutError(
                "the real vocabulary size is needed to drop the padding (give the rule "
                "parameter vocab_size)", rule="UCP-1.0-R113", tensor=tensor,
            )
        if not 0 < vocab_size <= shape[layout.vocab_dim]:
            raise LayoutError(
                f"vocab_size={vocab_size} does not fit Megatron's "
                f"{shape[layout.vocab_dim]} vocabulary rows", rule="UCP-1.0-R113",
                tensor=tensor,
            )
        shape[layout.vocab_dim] = vocab_size
    return tuple(shape)


def fragment_box(offset: Sequence[int], local_shape: Sequence[int]) -> Box:
    """The region of a fragment of ``local_shape`` at ``offset``."""
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, local_shape, strict=True))


def index_range(box: Box) -> list[tuple[int, ...]]:
    """Every index tuple of the leading (stacked) dimensions ``box`` spans, in C order."""
    out: list[tuple[int, ...]] = [()]
    for a, b in box:
        out = [(*t, i) for t in out for i in range(a, b)]
    return out if math.prod(b - a for a, b in box) else []


__all__ = [
    "MASTER_ALIASES",
    "MASTER_STATE",
    "MODEL_GROUP",
    "OPTIMIZER_PREFIX",
    "STACKED",
    "Location",
    "fragment_box",
    "index_range",
    "locate",
    "megatron_map",
    "split_state_key",
    "stored_shape",
    "stored_state",
    "tensor_name",
]

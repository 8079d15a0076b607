"""DeepSpeed's ``universal_checkpoint_info`` -> layout semantics.

DeepSpeed's AutoTP and Megatron-DeepSpeed describe how tensor parallelism splits each
parameter in ``universal_checkpoint_info``: regular-expression lists that sort parameter
names into ``ds_to_universal``'s categories (replicated; split along dimension 0, or 1
for row-parallel weights; two or more sub-parameters; vocabulary rows beyond
``original_vocab_size``). :func:`tensor_layout` reads a tensor's category as UCP layout
semantics; the DeepSpeed importer (files) and ``ucpformat.deepspeed`` (live AutoTP
engines) both use it.

DeepSpeed 0.19 also writes an ``affine_map`` (pieces with strides) beside the
categories, for converters that prefer it; it describes the same splits and is not read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ucpformat.errors import FormatError, UnsupportedFeatureError
from ucpformat.layout.rank_slices import Conventions
from ucpformat.layout.semantics import PART_MAJOR, Part, TensorLayout


def tensor_layout(info: Mapping[str, Any], name: str, local_shape: tuple[int, ...], tp: int
                  ) -> tuple[TensorLayout, Conventions]:
    """The layout semantics ``info`` gives tensor ``name``, whose tensor-parallel local
    tensor (one of ``tp`` even shards) has ``local_shape``."""
    conv = Conventions(fused_order=PART_MAJOR)
    if tp == 1:
        return TensorLayout(), conv

    def hit(key: str) -> bool:
        return any(re.match(p, name) for p in info.get(key, []) or [])

    if hit("parameter_to_average_patterns"):
        raise UnsupportedFeatureError("parameters averaged over tensor-parallel ranks are "
                                      "not supported", tensor=name)
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    for pattern, reason in dict(unsupported).items():
        if re.match(pattern, name):
            raise UnsupportedFeatureError(f"DeepSpeed cannot describe this tensor's split: "
                                          f"{reason}", tensor=name)
    vocab = hit("vocabulary_parameter_patterns")
    if hit("tp_replicated_parameter_patterns"):
        return TensorLayout(), conv
    if hit("parameter_with_2_sub_params_cat_dim_0"):
        half = local_shape[0] * tp // 2
        return TensorLayout(tp_dim=0, parts=(Part("0", half), Part("1", half))), conv
    for sub in info.get("parameter_with_sub_params", []) or []:
        if isinstance(sub, Mapping) and any(re.match(p, name)
                                            for p in sub.get("patterns", []) or []):
            return _sub_params(info, name, sub, local_shape, tp), conv
    dim = 1 if hit("parameter_with_row_parallelism_patterns") else 0
    return TensorLayout(tp_dim=dim, vocab_dim=0 if vocab else None), conv


def original_vocab_size(info: Mapping[str, Any]) -> int | None:
    """The vocabulary size before padding, if ``info`` records it."""
    size = info.get("original_vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _sub_params(info: Mapping[str, Any], name: str, sub: Mapping[str, Any],
                local_shape: tuple[int, ...], tp: int) -> TensorLayout:
    dim = sub.get("partition_dim")
    spec = list(sub.get("shape") or [])
    if not isinstance(dim, int) or not 0 <= dim < len(spec) or dim >= len(local_shape):
        raise FormatError(f"universal_checkpoint_info: bad sub-parameter entry {sub!r}",
                          tensor=name)
    total = local_shape[dim] * tp
    sizes = spec[dim]
    if isinstance(sizes, int):  # the number of equal sub-parameters
        if sizes <= 0 or total % sizes:
            raise FormatError(f"{sizes} sub-parameters do not divide {total}", tensor=name)
        sizes = [total // sizes] * sizes
    sizes = [int(s) for s in sizes]
    widths = info.get("sub_param_shard_widths") or {}
    for pattern, rows in dict(widths).items():
        if re.match(pattern, name) and any(len(set(w)) != 1 for w in rows):
            raise UnsupportedFeatureError("sub-parameters split unevenly over "
                                          "tensor-parallel ranks are not supported",
                                          tensor=name)
    return TensorLayout(tp_dim=dim, parts=tuple(Part(str(i), s) for i, s in enumerate(sizes)))


__all__ = ["original_vocab_size", "tensor_layout"]

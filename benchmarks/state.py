"""The synthetic training state every throughput benchmark saves and loads.

A Llama-like decoder (grouped-query attention, SwiGLU MLP, untied embeddings) in mixed
precision: the bfloat16 weights the model computes with, plus, per parameter, the float32
master weight and the two float32 Adam moments. Shapes are a transformer's (square
attention projections, narrow K/V, wide MLP, a 32,000-row vocabulary, 1-D norms); the
layer count is chosen so that the state is about ``size_mib`` MiB. Values are random
normal (they compress like trained weights do: barely, see bench_compression).

Tensor parallelism, as the distributed benchmarks use it (``tp_dim``): column-parallel
weights (embedding, Q/K/V, gate/up, LM head) split dimension 0, row-parallel weights
(O, down) dimension 1, norms are replicated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: Bytes per parameter: bf16 weight + fp32 master + fp32 exp_avg + fp32 exp_avg_sq.
BYTES_PER_PARAM = 2 + 4 + 4 + 4
VOCAB = 32000


@dataclass(frozen=True)
class TensorDef:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "bfloat16" or "float32"
    tp_dim: int | None  # the dimension tensor parallelism splits; None: replicated

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "bfloat16" else 4)


def _hidden_for(size_mib: float) -> int:
    """A model width that gives a few layers or more at this size."""
    for hidden in (1024, 512, 256, 128):
        params = size_mib * 2**20 / BYTES_PER_PARAM
        if params >= 2 * VOCAB * hidden + 4 * _layer_params(hidden) or hidden == 128:
            return hidden
    return 128


def _vocab_for(size_mib: float, hidden: int) -> int:
    # small states (quick mode) get a small vocabulary, so that they still have layers
    params = size_mib * 2**20 / BYTES_PER_PARAM
    return VOCAB if params >= 4 * VOCAB * hidden else max(256, int(params / (8 * hidden)))


def _layer_params(hidden: int) -> int:
    return sum(math.prod(s) for _, s, _ in _layer_shapes(hidden))


def _layer_shapes(hidden: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    ffn = int(hidden * 2.75) // 64 * 64
    kv = hidden // 4
    return [
        ("self_attn.q_proj.weight", (hidden, hidden), 0),
        ("self_attn.k_proj.weight", (kv, hidden), 0),
        ("self_attn.v_proj.weight", (kv, hidden), 0),
        ("self_attn.o_proj.weight", (hidden, hidden), 1),
        ("mlp.gate_proj.weight", (ffn, hidden), 0),
        ("mlp.up_proj.weight", (ffn, hidden), 0),
        ("mlp.down_proj.weight", (hidden, ffn), 1),
        ("input_layernorm.weight", (hidden,), None),
        ("post_attention_layernorm.weight", (hidden,), None),
    ]


def parameters(size_mib: float) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, tp_dim) of every parameter of the model sized for ``size_mib``."""
    hidden = _hidden_for(size_mib)
    vocab = _vocab_for(size_mib, hidden)
    top = [
        ("embed_tokens.weight", (vocab, hidden), 0),
        ("norm.weight", (hidden,), None),
        ("lm_head.weight", (vocab, hidden), 0),
    ]
    fixed = sum(math.prod(s) for _, s, _ in top)
    budget = size_mib * 2**20 / BYTES_PER_PARAM - fixed
    layers = max(1, round(budget / _layer_params(hidden)))
    out = list(top)
    for i in range(layers):
        out += [(f"layers.{i}.{n}", s, d) for n, s, d in _layer_shapes(hidden)]
    return out


def tensors(size_mib: float) -> Iterator[TensorDef]:
    """Every tensor of the state: ``model.<p>`` (bf16) and ``optim.<p>.{master,exp_avg,
    exp_avg_sq}`` (fp32) for each parameter ``p``."""
    params = parameters(size_mib)
    for name, shape, tp in params:
        yield TensorDef(f"model.{name}", shape, "bfloat16", tp)
    for name, shape, tp in params:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            yield TensorDef(f"optim.{name}.{kind}", shape, "float32", tp)


def describe(size_mib: float, select: Callable[[TensorDef], bool] | None = None) -> str:
    if select is not None:
        defs = [d for d in tensors(size_mib) if select(d)]
        total = sum(d.nbytes for d in defs)
        return (f"{total / 2**20:,.0f} MiB in {len(defs)} tensors of the "
                f"{size_mib:.0f} MiB state ({describe(size_mib).split(': ', 1)[1]})")
    defs = list(tensors(size_mib))
    params = parameters(size_mib)
    layers = sum(1 for n, _, _ in params if n.endswith("input_layernorm.weight"))
    hidden = params[1][1][0]
    total = sum(d.nbytes for d in defs)
    largest = max(defs, key=lambda d: d.nbytes)
    return (
        f"{total / 2**20:,.0f} MiB in {len(defs)} tensors: a {layers}-layer decoder of width "
        f"{hidden} (vocabulary {params[0][1][0]:,}), bf16 weights + fp32 master weights and "
        f"Adam moments; largest tensor {largest.name} {list(largest.shape)} "
        f"{largest.nbytes / 2**20:.0f} MiB"
    )


def make(
    size_mib: float, seed: int = 0, select: Callable[[TensorDef], bool] | None = None
) -> dict[str, object]:
    """The state as a flat dict of CPU torch tensors (``torch`` is imported here).

    Each tensor is filled in place (no temporary copies), so that a process holding the
    state has used no more memory than the state itself (the peak-memory benchmark
    relies on it)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, object] = {}
    for d in tensors(size_mib):
        if select is not None and not select(d):
            continue
        dtype = torch.bfloat16 if d.dtype == "bfloat16" else torch.float32
        out[d.name] = torch.empty(d.shape, dtype=dtype).normal_(generator=gen)
    return out

"""Synthetic per-rank states of large training runs: specs and fragment boxes, no data.

Each scenario builds, for every rank of a parallel layout, what that rank would tell the
distributed save pipeline (:func:`ucpformat.distributed.rank_description.describe`): the specs of
the tensors it knows and the boxes of the fragments it holds, computed with the project's own layout
geometry (:func:`ucpformat.layout.rank_slices.local_map`,
:func:`ucpformat.layout.zero.flat_partition`, :func:`ucpformat.layout.dtensor.dtensor_local_map`).
Ranks that hold the same thing (data parallel replicas) share one Python list of specs, so 16,384
simulated ranks fit in memory; every rank's boxes are its own.

Scenarios:

* ``megatron``: a transformer under TP x PP x DP, Megatron names (fused QKV with
  grouped-query attention, fused SwiGLU gate/up), bf16 weights replicated over DP and
  fp32 master weights and Adam moments in flat ZeRO-1 partitions over DP, one flat group
  per (stage, TP rank), in parameter order;
* ``moe``: the same with experts (one tensor per expert and layer) under expert
  parallelism; expert parameters form their own flat group over the expert-data-parallel
  ranks;
* ``fsdp2``: Hugging Face names, FSDP2 x TP on a 2-D (dp, tp) mesh: every tensor (fp32
  parameters, Adam moments) a DTensor with ``_StridedShard`` on dim 0 for column-parallel
  weights (rank order is not offset order); each rank describes the DTensors by the mesh
  and their placements (:class:`~ucpformat.distributed.rank_description.MeshTensor`, shared by
  every rank) and its place in the mesh, or, with ``compact=False``, by its fragments' boxes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ucpformat.distributed.rank_description import MeshPosition, MeshTensor, mesh_boxes
from ucpformat.distributed.save_plan import TensorSpec
from ucpformat.format import names
from ucpformat.layout.boxes import Box, LocalMap, Piece
from ucpformat.layout.dtensor import Placement, Replicate, Shard, StridedShard, dtensor_local_map
from ucpformat.layout.rank_slices import Conventions, ParallelConfig, RankCoords, local_map
from ucpformat.layout.semantics import Part, TensorLayout
from ucpformat.layout.zero import flat_partition


@dataclass(frozen=True)
class Transformer:
    """The shape of a decoder-only transformer (what the tensor shapes follow from)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0  # 0: dense

    def parameters(self) -> int:
        return sum(math.prod(p.shape) for p in megatron_params(self))


LLAMA_405B = Transformer("Llama-3-405B", 126, 16384, 128, 8, 128, 53248, 128256)
MIXTRAL_8X7B = Transformer("Mixtral-8x7B", 32, 4096, 32, 8, 128, 14336, 32000, experts=8)


@dataclass(frozen=True)
class Param:
    """One consolidated parameter: its name, full shape and layout semantics."""

    name: str
    shape: tuple[int, ...]
    layout: TensorLayout
    conventions: Conventions = field(default_factory=Conventions)

    @property
    def is_expert(self) -> bool:
        return self.layout.expert is not None


def megatron_params(model: Transformer) -> list[Param]:
    """Megatron-core names and layouts, in the order of the model (the flat group order)."""
    h, hd = model.hidden, model.head_dim
    q, kv = model.heads * hd, model.kv_heads * hd
    out = [Param("embedding.word_embeddings.weight", (model.vocab, h),
                 TensorLayout(tp_dim=0, vocab_dim=0), Conventions(stage="first"))]
    for i in range(model.layers):
        pre = f"decoder.layers.{i}."
        out += [
            Param(pre + "input_layernorm.weight", (h,), TensorLayout(layer=i)),
            Param(pre + "self_attention.linear_qkv.weight", (q + 2 * kv, h),
                  TensorLayout(tp_dim=0, parts=(Part("q", q), Part("k", kv), Part("v", kv)),
                               groups=model.kv_heads, layer=i)),
            Param(pre + "self_attention.linear_proj.weight", (h, q),
                  TensorLayout(tp_dim=1, layer=i)),
            Param(pre + "pre_mlp_layernorm.weight", (h,), TensorLayout(layer=i)),
        ]
        mlps: list[tuple[str, int | None]] = [
            (f"mlp.experts.{e}.", e) for e in range(model.experts)] or [("mlp.", None)]
        if model.experts:
            out.append(Param(pre + "mlp.router.weight", (model.experts, h), TensorLayout(layer=i)))
        for sub, e in mlps:
            out += [
                Param(pre + sub + "linear_fc1.weight", (2 * model.ffn, h),
                      TensorLayout(tp_dim=0, parts=(Part("gate", model.ffn), Part("up", model.ffn)),
                                   layer=i, expert=e)),
                Param(pre + sub + "linear_fc2.weight", (h, model.ffn),
                      TensorLayout(tp_dim=1, layer=i, expert=e)),
            ]
    out += [
        Param("decoder.final_layernorm.weight", (h,), TensorLayout(), Conventions(stage="last")),
        Param("output_layer.weight", (model.vocab, h), TensorLayout(tp_dim=0, vocab_dim=0),
              Conventions(stage="last")),
    ]
    return out


def hf_params(model: Transformer) -> list[tuple[Param, str]]:
    """Hugging Face names (q/k/v and gate/up apart), each with its TP style: "col", "row"
    or "rep" (as ``parallelize_module`` places them)."""
    h, hd = model.hidden, model.head_dim
    q, kv = model.heads * hd, model.kv_heads * hd
    out = [(Param("model.embed_tokens.weight", (model.vocab, h), TensorLayout(tp_dim=0)), "col")]
    for i in range(model.layers):
        pre = f"model.layers.{i}."
        col, row = TensorLayout(tp_dim=0, layer=i), TensorLayout(tp_dim=1, layer=i)
        out += [
            (Param(pre + "input_layernorm.weight", (h,), TensorLayout(layer=i)), "rep"),
            (Param(pre + "self_attn.q_proj.weight", (q, h), col), "col"),
            (Param(pre + "self_attn.k_proj.weight", (kv, h), col), "col"),
            (Param(pre + "self_attn.v_proj.weight", (kv, h), col), "col"),
            (Param(pre + "self_attn.o_proj.weight", (h, q), row), "row"),
            (Param(pre + "post_attention_layernorm.weight", (h,), TensorLayout(layer=i)), "rep"),
            (Param(pre + "mlp.gate_proj.weight", (model.ffn, h), col), "col"),
            (Param(pre + "mlp.up_proj.weight", (model.ffn, h), col), "col"),
            (Param(pre + "mlp.down_proj.weight", (h, model.ffn), row), "row"),
        ]
    out += [
        (Param("model.norm.weight", (h,), TensorLayout()), "rep"),
        (Param("lm_head.weight", (model.vocab, h), TensorLayout(tp_dim=0)), "col"),
    ]
    return out


# -- a simulated rank ---------------------------------------------------------------------


@dataclass
class SimRank:
    """What one rank tells the pipeline: the specs it knows (shared between ranks that
    know the same), its fragments' boxes, and the tensors it lays out on device meshes
    (``on_mesh``, shared between the ranks of a mesh) with its place in each mesh."""

    rank: int
    specs: Sequence[TensorSpec]
    boxes: list[tuple[str, Box]]
    meshes: Sequence[MeshPosition] = ()
    on_mesh: Sequence[MeshTensor] = ()

    def all_boxes(self) -> list[tuple[str, Box]]:
        """Every fragment's box, those of the tensors on meshes included
        (:func:`~ucpformat.distributed.rank_description.mesh_boxes` of this rank's places)."""
        place = {m.name: m for m in self.meshes}
        shape = {s.path: s.shape for s in self.specs}
        out = list(self.boxes)
        for t in self.on_mesh:
            m = place[t.mesh]
            out += [(t.path, box) for box in mesh_boxes(shape[t.path], m.shape, m.coords,
                                                         t.placements, tensor=t.path)]
        return out


@dataclass
class Scenario:
    """A parallel layout of a model, its ranks built lazily (:meth:`ranks`)."""

    name: str
    model: Transformer
    world: int
    kind: str  # "megatron", "moe" or "fsdp2"
    cfg: ParallelConfig | None = None  # megatron and moe
    mesh: tuple[int, int] | None = None  # fsdp2: (dp, tp)
    compact: bool = True  # fsdp2: tensors described on their mesh, not by boxes

    def ranks(self) -> Iterator[SimRank]:
        if self.kind == "fsdp2":
            yield from _fsdp2_ranks(self)
        else:
            yield from _zero1_ranks(self)

    def describe(self) -> str:
        if self.mesh is not None:
            return f"FSDP2 {self.mesh[0]} x TP {self.mesh[1]}"
        cfg = self.cfg
        assert cfg is not None
        ep = f" x EP {cfg.ep}" if cfg.ep > 1 else ""
        return f"TP {cfg.tp} x PP {cfg.pp} x DP {cfg.dp}{ep}, ZeRO-1"


def even_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, the remainder spread over the middle stages (first and last
    stages carry the embedding and the output layer)."""
    base, extra = divmod(layers, pp)
    counts = [base] * pp
    order = [*range(1, pp - 1), 0, pp - 1] if pp > 2 else list(range(pp))
    for s in order[:extra]:
        counts[s] += 1
    return tuple(counts)


def megatron(model: Transformer, tp: int, pp: int, dp: int, *, ep: int = 1) -> Scenario:
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, zero=1, num_layers=model.layers,
                         pp_layers=even_layers(model.layers, pp),
                         num_experts=model.experts or None)
    kind = "moe" if model.experts else "megatron"
    return Scenario(f"{model.name} {kind} {cfg.world}", model, cfg.world, kind, cfg=cfg)


def fsdp2(model: Transformer, dp: int, tp: int, *, compact: bool = True) -> Scenario:
    """FSDP2 x TP; ``compact``: each rank describes the DTensors by mesh and placements
    (else by its fragments' boxes, one per tensor)."""
    return Scenario(f"{model.name} fsdp2 {dp * tp}", model, dp * tp, "fsdp2", mesh=(dp, tp),
                    compact=compact)


#: The optimizer's per-parameter arrays beside the bf16 weights (ZeRO-1 layouts).
ZERO_STATES = ("master", "exp_avg", "exp_avg_sq")
#: FSDP2 keeps fp32 parameters sharded; the optimizer's moments beside them.
FSDP_STATES = ("exp_avg", "exp_avg_sq")
#: The name of the FSDP2 x TP device mesh (every rank is in it).
FSDP_MESH = "dp_tp"


def model_path(name: str) -> str:
    return f"model/{names.escape(name)}"


def state_path(name: str, state: str) -> str:
    return f"optimizer/state/{names.escape(name)}/{state}"


def _spec(path: str, p: Param, dtype: str, role: str) -> TensorSpec:
    return TensorSpec(path, p.shape, dtype, {"ucp": {"role": role, "layout": p.layout.to_json()}})


def _zero1_ranks(sc: Scenario) -> Iterator[SimRank]:
    cfg = sc.cfg
    assert cfg is not None
    params = megatron_params(sc.model)
    # per (stage, tp rank, ep rank): the tensor-parallel local maps, the specs (shared)
    cache: dict[tuple[int, int, int], tuple[list[TensorSpec], list[tuple[Param, LocalMap]]]] = {}
    for rank in range(sc.world):
        c = cfg.coords(rank)
        key = (c.pp, c.tp, c.ep(cfg))
        if key not in cache:
            held = []
            for p in params:
                m = local_map(p.shape, p.layout, p.conventions, cfg, c, zero3=False, tensor=p.name)
                if m is not None:
                    held.append((p, m))
            specs = [_spec(model_path(p.name), p, "bfloat16", "parameter") for p, _ in held]
            specs += [_spec(state_path(p.name, s), p, "float32", "optimizer_state")
                      for p, _ in held for s in ZERO_STATES]
            cache[key] = (specs, held)
        specs, held = cache[key]
        boxes = [(model_path(p.name), piece.glob) for p, m in held for piece in m.pieces]
        dense = [(p.name, m) for p, m in held if not p.is_expert]
        expert = [(p.name, m) for p, m in held if p.is_expert]
        groups = [(dense, cfg.dp, c.dp)]
        if expert:
            groups.append((expert, cfg.dp // cfg.ep, c.edp(cfg)))
        for group, ways, index in groups:
            part = flat_partition(group, ways, index)
            for piece in part.pieces:
                boxes += [(state_path(piece.tensor, s), piece.glob) for s in ZERO_STATES]
        yield SimRank(rank, specs, boxes)


def fsdp2_placements(style: str, tp: int) -> list[Placement]:
    """(dp, tp) mesh placements of a parameter under FSDP2 x TP."""
    if style == "col":  # TP shards dim 0 first; FSDP shards the local dim 0: strided
        return [StridedShard(0, tp), Shard(0)]
    if style == "row":
        return [Shard(0), Shard(1)]
    return [Shard(0), Replicate()]


def _fsdp2_ranks(sc: Scenario) -> Iterator[SimRank]:
    assert sc.mesh is not None
    dp, tp = sc.mesh
    params = hf_params(sc.model)
    specs = [_spec(model_path(p.name), p, "float32", "parameter") for p, _ in params]
    specs += [_spec(state_path(p.name, s), p, "float32", "optimizer_state")
              for p, _ in params for s in FSDP_STATES]
    if sc.compact:
        on_mesh = [MeshTensor(path, FSDP_MESH, tuple(fsdp2_placements(style, tp)))
                   for p, style in params
                   for path in (model_path(p.name), *(state_path(p.name, s) for s in FSDP_STATES))]
        for rank in range(sc.world):
            place = MeshPosition(FSDP_MESH, (dp, tp), (rank // tp, rank % tp))
            yield SimRank(rank, specs, [], (place,), on_mesh)
        return
    for rank in range(sc.world):
        coords = (rank // tp, rank % tp)
        boxes: list[tuple[str, Box]] = []
        for p, style in params:
            m = dtensor_local_map(p.shape, (dp, tp), fsdp2_placements(style, tp), coords,
                                  tensor=p.name)
            globs = [piece.glob for piece in m.pieces]
            for path in (model_path(p.name), *(state_path(p.name, s) for s in FSDP_STATES)):
                boxes += [(path, g) for g in globs]
        yield SimRank(rank, specs, boxes)


def load_config(model: Transformer, tp: int, pp: int, dp: int) -> ParallelConfig:
    """A target layout for a resharded load (no ZeRO: every DP rank reads its TP shard)."""
    return ParallelConfig(tp=tp, pp=pp, dp=dp, zero=1, num_layers=model.layers,
                          pp_layers=even_layers(model.layers, pp),
                          num_experts=model.experts or None)


def load_targets(model: Transformer, cfg: ParallelConfig, rank: int
                 ) -> list[tuple[str, LocalMap]]:
    """What one rank of a ZeRO-1 target layout reads: the bf16 weights of its TP shard,
    and its flat partition of the fp32 states (as flat pieces)."""
    c: RankCoords = cfg.coords(rank)
    held = []
    for p in megatron_params(model):
        m = local_map(p.shape, p.layout, p.conventions, cfg, c, zero3=False, tensor=p.name)
        if m is not None:
            held.append((p, m))
    out: list[tuple[str, LocalMap]] = [(model_path(p.name), m) for p, m in held]
    part = flat_partition([(p.name, m) for p, m in held], cfg.dp, c.dp)
    for piece in part.pieces:
        n = piece.size
        flat = LocalMap((n,), (Piece(((0, n),), piece.glob),))
        out += [(state_path(piece.tensor, s), flat) for s in ZERO_STATES]
    return out


__all__ = [
    "FSDP_MESH",
    "FSDP_STATES",
    "LLAMA_405B",
    "MIXTRAL_8X7B",
    "ZERO_STATES",
    "Param",
    "Scenario",
    "SimRank",
    "Transformer",
    "even_layers",
    "fsdp2",
    "fsdp2_placements",
    "hf_params",
    "load_config",
    "load_targets",
    "megatron",
    "megatron_params",
    "model_path",
    "state_path",
]

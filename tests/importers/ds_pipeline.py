"""DeepSpeed pipeline-parallel runs (``PipelineModule``) for the importer tests, on gloo.

Run by ``python -m tests.importers.frameworks deepspeed-pp OUT`` (4 ranks). Every run
trains two steps (``torch_adam``) and saves with ``save_checkpoint``, which
writes ``layer_XX[-model_YY]-model_states.pt`` per pipeline layer, one
``mp_rank_XX_model_states.pt`` per (stage, tensor-parallel rank) and one ZeRO optimizer
file per data-parallel rank of each:

* ``pp2-dp2-zero1-fp32``, ``pp2-dp2-zero1-bf16``, ``pp2-dp2-zero0-bf16`` (DeepSpeed's bf16
  optimizer, the default of bf16 pipelines, whose files lack ZeRO's metadata): layers of
  awkward sizes (flat partitions cut through parameters; padding), a buffer per block, an
  embedding tied to the output head (``TiedLayerSpec``) on 2 stages x 2 data-parallel ranks;
* ``gpt-pp2-tp2-zero1-fp32``, ``gpt-pp2-tp2-zero1-bf16``: a Megatron-DeepSpeed-style GPT
  (``GPTModelPipe`` names; grouped-query fused QKV interleaved per query group, fused
  SwiGLU ``[gate_r; up_r]`` per rank, a vocabulary-parallel padded embedding tied to the
  head) on 2 stages x 2 tensor-parallel ranks (``PipeModelDataParallelTopology``), with the
  ``universal_checkpoint_info`` Megatron-DeepSpeed gives ``ds_to_universal``.

Each rank also writes what its engine holds after training (``engine/rank<r>.pt``: its
coordinates, module parameters and buffers, and ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` of every parameter), and rank 0 runs DeepSpeed's own
``ds_to_universal`` and ``zero_to_fp32`` on each run, writing what they said to
``<run>/tools.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

#: the GPT of the tensor-parallel run
GPT = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 8, "num_query_groups": 4,
       "kv_channels": 4, "ffn_hidden_size": 24, "vocab_size": 50, "vocab_multiple": 8,
       "max_position_embeddings": 16}
#: ZeRO-0 with bf16 is DeepSpeed's bf16 optimizer (flat partitions without ZeRO's metadata)
PIPE_RUNS = ["pp2-dp2-zero1-fp32", "pp2-dp2-zero1-bf16", "pp2-dp2-zero0-bf16"]
GPT_RUNS = ["gpt-pp2-tp2-zero1-fp32", "gpt-pp2-tp2-zero1-bf16"]
#: megatron-core names under DeepSpeed's engine (no pipeline), its mpu giving TP=2 x DP=2
CORE_RUNS = ["megatron-tp2-dp2-zero2-bf16"]
STEPS = 2


# -- the data-parallel pipeline model ---------------------------------------------------


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(37, 12))

    def forward(self, x: Any) -> Any:
        return self.weight[x]


class Block(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.register_buffer("running", torch.linspace(0, 1, 3) + n_in)

    def forward(self, x: Any) -> Any:
        return torch.relu(self.fc(x))


def _embed_head(embed: Embed, x: Any) -> Any:
    return x @ embed.weight.t()


def _pipe_loss(out: Any, labels: Any) -> Any:
    return F.cross_entropy(out.float().reshape(-1, 37), labels.reshape(-1))


def pipe_net(num_stages: int) -> Any:
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = [TiedLayerSpec("embed", Embed), LayerSpec(Block, 12, 29), LayerSpec(Block, 29, 7),
              LayerSpec(Block, 7, 12), TiedLayerSpec("embed", Embed, forward_fn=_embed_head)]
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=_pipe_loss,
                          partition_method="uniform")


# -- Megatron-style tensor parallelism -----------------------------------------------------

_TP: dict[str, Any] = {"rank": 0, "size": 1, "group": None}


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=_TP["group"])
        return grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        x = x.contiguous()
        dist.all_reduce(x, group=_TP["group"])
        return x

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        parts = [torch.empty_like(x) for _ in range(_TP["size"])]
        dist.all_gather(parts, x.contiguous(), group=_TP["group"])
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad.chunk(_TP["size"], dim=-1)[_TP["rank"]].contiguous()


def _full(seed: int, *shape: int) -> Any:
    """A consolidated tensor, the same on every rank (then sliced by the layers)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.2


def _rows(t: Any, ways: int, index: int) -> Any:
    n = t.shape[0] // ways
    return t[index * n:(index + 1) * n]


class VocabEmbedding(nn.Module):
    """Megatron-DeepSpeed's ``EmbeddingPipe``: vocabulary-parallel words, positions."""

    def __init__(self) -> None:
        super().__init__()
        tp, r, h = _TP["size"], _TP["rank"], GPT["hidden_size"]
        step = GPT["vocab_multiple"] * tp
        padded = -(-GPT["vocab_size"] // step) * step
        full = torch.zeros(padded, h)
        full[:GPT["vocab_size"]] = _full(1, GPT["vocab_size"], h)
        self.word_embeddings = nn.Embedding(padded // tp, h)
        self.word_embeddings.weight.data.copy_(_rows(full, tp, r))
        self.position_embeddings = nn.Embedding(GPT["max_position_embeddings"], h)
        self.position_embeddings.weight.data.copy_(_full(2, GPT["max_position_embeddings"], h))

    def forward(self, tokens: Any) -> Any:
        per = self.word_embeddings.weight.shape[0]
        lo = _TP["rank"] * per
        outside = (tokens < lo) | (tokens >= lo + per)
        local = (tokens - lo).masked_fill(outside, 0)
        words = self.word_embeddings(local).masked_fill(outside.unsqueeze(-1), 0.0)
        words = _ReduceFromTP.apply(words)
        pos = self.position_embeddings(torch.arange(tokens.shape[1]))
        return words + pos


def _logits(embed: VocabEmbedding, hidden: Any) -> Any:
    """The tied output head: vocabulary-parallel logits (the loss gathers them)."""
    return _CopyToTP.apply(hidden) @ embed.word_embeddings.weight.t()


def _gpt_loss(logits: Any, labels: Any) -> Any:
    full = _GatherFromTP.apply(logits.float())[..., :GPT["vocab_size"]]
    return F.cross_entropy(full.reshape(-1, GPT["vocab_size"]), labels.reshape(-1))


class ColumnParallel(nn.Module):
    def __init__(self, weight: Any, bias: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone())

    def forward(self, x: Any) -> Any:
        return F.linear(_CopyToTP.apply(x), self.weight, self.bias)


class RowParallel(nn.Module):
    def __init__(self, weight: Any, bias: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone())  # replicated, added after the reduction

    def forward(self, x: Any) -> Any:
        return _ReduceFromTP.apply(F.linear(x, self.weight)) + self.bias


class Attention(nn.Module):
    """Grouped-query attention with Megatron's fused QKV (per query group: q heads, k, v)."""

    def __init__(self, seed: int, names: tuple[str, str] = ("query_key_value", "dense")) -> None:
        super().__init__()
        self.names = names
        tp, r = _TP["size"], _TP["rank"]
        h, heads, groups, kv = (GPT["hidden_size"], GPT["num_attention_heads"],
                                GPT["num_query_groups"], GPT["kv_channels"])
        q, k, v = (_full(seed, heads * kv, h), _full(seed + 1, groups * kv, h),
                   _full(seed + 2, groups * kv, h))
        qb, kb, vb = (_full(seed + 3, heads * kv), _full(seed + 4, groups * kv),
                      _full(seed + 5, groups * kv))
        per_group = heads // groups * kv
        mine = range(r * groups // tp, (r + 1) * groups // tp)
        w = torch.cat([torch.cat([q[g * per_group:(g + 1) * per_group], k[g * kv:(g + 1) * kv],
                                  v[g * kv:(g + 1) * kv]]) for g in mine])
        b = torch.cat([torch.cat([qb[g * per_group:(g + 1) * per_group], kb[g * kv:(g + 1) * kv],
                                  vb[g * kv:(g + 1) * kv]]) for g in mine])
        dense = _full(seed + 6, h, heads * kv)
        self.add_module(names[0], ColumnParallel(w, b))
        self.add_module(names[1], RowParallel(dense.chunk(tp, dim=1)[r], _full(seed + 7, h)))

    def forward(self, x: Any) -> Any:
        b, s, _ = x.shape
        heads, groups, kv = GPT["num_attention_heads"], GPT["num_query_groups"], GPT["kv_channels"]
        local_groups = groups // _TP["size"]
        hpg = heads // groups
        mixed = getattr(self, self.names[0])(x).view(b, s, local_groups, hpg + 2, kv)
        q = mixed[:, :, :, :hpg].reshape(b, s, local_groups * hpg, kv).transpose(1, 2)
        k = mixed[:, :, :, hpg].transpose(1, 2).repeat_interleave(hpg, dim=1)
        v = mixed[:, :, :, hpg + 1].transpose(1, 2).repeat_interleave(hpg, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, local_groups * hpg * kv)
        return getattr(self, self.names[1])(out)


class SwiGLU(nn.Module):
    """Megatron's fused SwiGLU: ``dense_h_to_4h`` holds [gate_r; up_r] on each rank."""

    def __init__(self, seed: int,
                 names: tuple[str, str] = ("dense_h_to_4h", "dense_4h_to_h")) -> None:
        super().__init__()
        self.names = names
        tp, r, h, f = _TP["size"], _TP["rank"], GPT["hidden_size"], GPT["ffn_hidden_size"]
        gate, up = _full(seed, f, h), _full(seed + 1, f, h)
        gb, ub = _full(seed + 2, f), _full(seed + 3, f)
        down = _full(seed + 4, h, f)
        self.add_module(names[0], ColumnParallel(
            torch.cat([_rows(gate, tp, r), _rows(up, tp, r)]),
            torch.cat([_rows(gb, tp, r), _rows(ub, tp, r)])))
        self.add_module(names[1], RowParallel(down.chunk(tp, dim=1)[r], _full(seed + 5, h)))

    def forward(self, x: Any) -> Any:
        gate, up = getattr(self, self.names[0])(x).chunk(2, dim=-1)
        return getattr(self, self.names[1])(F.silu(gate) * up)


class TransformerLayerPipe(nn.Module):
    """Megatron-DeepSpeed's ``ParallelTransformerLayerPipe`` (its parameter names)."""

    def __init__(self, number: int) -> None:
        super().__init__()
        h = GPT["hidden_size"]
        self.input_layernorm = nn.LayerNorm(h)
        self.self_attention = Attention(100 * (number + 1))
        self.post_attention_layernorm = nn.LayerNorm(h)
        self.mlp = SwiGLU(100 * (number + 1) + 50)

    def forward(self, x: Any) -> Any:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class CoreLayer(nn.Module):
    """megatron-core's ``TransformerLayer`` (local spec): its parameter names."""

    def __init__(self, number: int) -> None:
        super().__init__()
        h = GPT["hidden_size"]
        self.input_layernorm = nn.LayerNorm(h)
        self.self_attention = Attention(100 * (number + 1), ("linear_qkv", "linear_proj"))
        self.pre_mlp_layernorm = nn.LayerNorm(h)
        self.mlp = SwiGLU(100 * (number + 1) + 50, ("linear_fc1", "linear_fc2"))

    def forward(self, x: Any) -> Any:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class CoreDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CoreLayer(i) for i in range(GPT["num_layers"]))
        self.final_layernorm = nn.LayerNorm(GPT["hidden_size"])

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class CoreGPT(nn.Module):
    """A GPT with megatron-core's names (``GPTModel``), tensor parallel, untied output."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = VocabEmbedding()
        self.decoder = CoreDecoder()
        padded = self.embedding.word_embeddings.weight.shape[0] * _TP["size"]
        out = torch.zeros(padded, GPT["hidden_size"])
        out[:GPT["vocab_size"]] = _full(3, GPT["vocab_size"], GPT["hidden_size"])
        self.output_layer = nn.Linear(GPT["hidden_size"], padded // _TP["size"], bias=False)
        self.output_layer.weight.data.copy_(_rows(out, _TP["size"], _TP["rank"]))

    def forward(self, tokens: Any) -> Any:
        hidden = self.decoder(self.embedding(tokens))
        logits = F.linear(_CopyToTP.apply(hidden), self.output_layer.weight)
        return _gpt_loss(logits, tokens)


class MPU:
    """The model-parallel unit DeepSpeed's engine asks for groups (Megatron's interface)."""

    def __init__(self, tp_group: Any, tp: tuple[int, int], dp_group: Any,
                 dp: tuple[int, int]) -> None:
        self.tp_group, self.tp, self.dp_group, self.dp = tp_group, tp, dp_group, dp

    def get_model_parallel_rank(self) -> int:
        return self.tp[0]

    def get_model_parallel_world_size(self) -> int:
        return self.tp[1]

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp[0]

    def get_data_parallel_world_size(self) -> int:
        return self.dp[1]

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


def _to_hidden(tokens: Any) -> Any:
    return tokens  # spec 0: a function, as Megatron-DeepSpeed's fp32 -> fp16 cast


#: Megatron-DeepSpeed's universal_checkpoint_info for this model (its GPTModelPipe's)
GPT_UCI = {
    "universal_checkpoint_version": 0.2,
    "original_vocab_size": GPT["vocab_size"],
    "vocabulary_parameter_patterns": [r"tied_modules\.embed\.word_embeddings\.weight"],
    "pipeline_replicated_parameter_patterns": [
        r"tied_modules\.embed\.word_embeddings\.weight",
        r"tied_modules\.embed\.position_embeddings\.weight"],
    "tp_replicated_parameter_patterns": [
        r"tied_modules\.embed\.position_embeddings\.weight",
        r"\d+\.input_layernorm\.weight", r"\d+\.input_layernorm\.bias",
        r"\d+\.post_attention_layernorm\.weight", r"\d+\.post_attention_layernorm\.bias",
        r"\d+\.self_attention\.dense\.bias", r"\d+\.mlp\.dense_4h_to_h\.bias",
        r"\d+\.weight", r"\d+\.bias"],
    "parameter_with_row_parallelism_patterns": [
        r"\d+\.mlp\.dense_4h_to_h\.weight", r"\d+\.self_attention\.dense\.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [
        r"\d+\.mlp\.dense_h_to_4h\.weight", r"\d+\.mlp\.dense_h_to_4h\.bias"],
}


def gpt_pipe(topology: Any) -> Any:
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    specs: list[Any] = [_to_hidden, TiedLayerSpec("embed", VocabEmbedding,
                                                  tied_weight_attr="word_embeddings.weight")]
    specs += [LayerSpec(TransformerLayerPipe, i) for i in range(GPT["num_layers"])]
    specs += [LayerSpec(nn.LayerNorm, GPT["hidden_size"]),
              TiedLayerSpec("embed", VocabEmbedding, forward_fn=_logits,
                            tied_weight_attr="word_embeddings.weight")]
    model = PipelineModule(layers=specs, topology=topology, loss_fn=_gpt_loss,
                           partition_method="type:TransformerLayerPipe")
    model.universal_checkpoint_info = dict(GPT_UCI)
    return model


# -- the runs ----------------------------------------------------------------------------------


def _config(run: str) -> dict[str, Any]:
    dtype = run.rsplit("-", 1)[1]
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True,
                                                "weight_decay": 0.0}},
        "zero_optimization": {"stage": int(run.split("zero")[1][0])},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1000,
    }


def _engine_state(engine: Any, coords: dict[str, int] | None = None) -> dict[str, Any]:
    """What the engine holds: coordinates, module tensors, full fp32 master and moments."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if coords is None:
        grid = engine.grid
        coords = {"pp": grid.get_stage_id(), "dp": grid.data_parallel_id,
                  "tp": grid.get_slice_parallel_rank()}
    out: dict[str, Any] = {"coords": coords}
    for name, p in engine.module.named_parameters():
        out[f"module/{name}"] = p.detach().clone()
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).clone()
        for s in ("exp_avg", "exp_avg_sq"):
            out[f"{s}/{name}"] = safe_get_full_optimizer_state(p, s).clone()
    for name, b in engine.module.named_buffers():
        out[f"buffer/{name}"] = b.detach().clone()
    return out


def _train(engine: Any, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def batches() -> Any:
        while True:
            x = torch.randint(0, vocab, (2, 6), generator=g)
            yield x, x

    it = batches()
    for _ in range(STEPS):
        engine.train_batch(data_iter=it)


def pipe_worker(rank: int, world: int, init: str, out: str) -> None:
    from tests.importers.frameworks import _finish, _no_shm_build

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    _no_shm_build()
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    deepspeed.init_distributed(dist_backend="gloo", init_method=init, rank=rank,
                               world_size=world, auto_mpi_discovery=False)
    for run in PIPE_RUNS + GPT_RUNS:
        torch.manual_seed(0)
        if run.startswith("gpt"):
            topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
            # the tensor-parallel groups, created in the same order on every rank
            for ranks in topo.get_axis_comm_lists("model"):
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    _TP.update(group=group, size=len(ranks), rank=ranks.index(rank))
            model = gpt_pipe(topo)
            vocab = GPT["vocab_size"]
        else:
            model = pipe_net(2)
            vocab = 37
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=_config(run))
        _train(engine, vocab, seed=5 + engine.grid.data_parallel_id)
        engine.save_checkpoint(os.path.join(out, run), tag=f"global_step{STEPS}")
        _save_engine(engine, Path(out) / run, rank)
        engine.destroy()
        dist.barrier()
    for run in CORE_RUNS:
        _core_run(rank, run, Path(out) / run)
    if rank == 0:
        for run in PIPE_RUNS + GPT_RUNS:
            ds_tools(Path(out) / run)
    _finish()


def _save_engine(engine: Any, run_dir: Path, rank: int,
                 coords: dict[str, int] | None = None) -> None:
    state = _engine_state(engine, coords)
    path = run_dir / "engine" / f"rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def _core_run(rank: int, run: str, run_dir: Path) -> None:
    """A megatron-core-named GPT, TP=2 x DP=2 (TP fastest), under DeepSpeed's engine."""
    import deepspeed

    groups = {}
    for kind, lists in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]])):
        for ranks in lists:  # every rank creates every group, in the same order
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                groups[kind] = (group, ranks.index(rank))
    _TP.update(group=groups["tp"][0], size=2, rank=groups["tp"][1])
    torch.manual_seed(0)
    model = CoreGPT()
    mpu = MPU(groups["tp"][0], (groups["tp"][1], 2), groups["dp"][0], (groups["dp"][1], 2))
    cfg = _config(run) | {"gradient_accumulation_steps": 1}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg, mpu=mpu)
    g = torch.Generator().manual_seed(5 + groups["dp"][1])  # the same batch on a TP pair
    for _ in range(STEPS):
        loss = engine(torch.randint(0, GPT["vocab_size"], (2, 6), generator=g))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(run_dir), tag=f"global_step{STEPS}")
    _save_engine(engine, run_dir, rank, {"pp": 0, "dp": groups["dp"][1], "tp": groups["tp"][1]})
    engine.destroy()
    dist.barrier()


def ds_tools(run: Path) -> None:
    """DeepSpeed's own consolidation tools on a pipeline run; what each did, in tools.json."""
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    said: dict[str, str] = {}
    try:
        torch.save(get_fp32_state_dict_from_zero_checkpoint(str(run)), run / "zero_to_fp32.pt")
        said["zero_to_fp32"] = "ok"
    except Exception as exc:
        said["zero_to_fp32"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    try:
        ds_to_universal.main(argparse.Namespace(
            input_folder=str(run / f"global_step{STEPS}"), output_folder=str(run / "universal"),
            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
            inject_missing_state=True, no_strict=False))
        said["ds_to_universal"] = "ok"
    except Exception as exc:
        said["ds_to_universal"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    (run / "tools.json").write_text(json.dumps(said, indent=1))


def gpt_canonical_qkv(group_major: Any) -> Any:
    """Megatron's per-group [q_g; k_g; v_g] rows (any number of groups) -> [q; k; v]."""
    heads, groups, kv = GPT["num_attention_heads"], GPT["num_query_groups"], GPT["kv_channels"]
    per = (heads // groups + 2) * kv
    blocks = [group_major[g * per:(g + 1) * per] for g in range(groups)]
    q_rows = heads // groups * kv
    return torch.cat([b[:q_rows] for b in blocks] + [b[q_rows:q_rows + kv] for b in blocks]
                     + [b[q_rows + kv:] for b in blocks])


__all__ = ["CORE_RUNS", "GPT", "GPT_RUNS", "GPT_UCI", "PIPE_RUNS", "STEPS", "gpt_canonical_qkv",
           "pipe_worker"]

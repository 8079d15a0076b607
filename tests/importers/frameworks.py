"""Real frameworks writing real checkpoints, for the importer tests and the benchmark.

Run as ``python -m tests.importers.frameworks KIND OUT [options]``: it spawns the ranks
(gloo on CPU, file rendezvous so that parallel runs never fight over a port), trains
a little and saves. Every worker ends with a barrier, ``destroy_process_group()``,
flushed output and ``os._exit(0)``: torch 2.13 + gloo sometimes aborts at interpreter
shutdown otherwise.

Kinds:

* ``dcp``: FSDP2 (4 ranks), tensor parallel (4 ranks), FSDP2 x TP on a 2x2 mesh, and a
  bare FSDP2 model state dict, each saved with ``torch.distributed.checkpoint``;
* ``deepspeed``: DeepSpeed ZeRO stage 1, 2 and 3, fp32 and bf16, on 2 ranks; AutoTP
  (tensor parallel 2) of a small Llama with ZeRO-1 fp32 and ZeRO-2 bf16; then
  DeepSpeed's own ``zero_to_fp32`` and ``ds_to_universal`` of each;
* ``deepspeed-pp``: DeepSpeed pipeline parallelism (``PipelineModule``) on 4 ranks, with
  data and tensor parallelism (see ``tests/importers/ds_pipeline.py``);
* ``ds-universal-load``: DeepSpeed loads universal checkpoints (``load_universal``) on
  another number of ranks and writes what it loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn as nn


def _finish() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn: Any, world: int, *args: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        mp.spawn(fn, args=(world, init, *args), nprocs=world, join=True)


# -- PyTorch DCP ------------------------------------------------------------------------


class DcpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 8)
        self.register_buffer("scale", torch.tensor([2.0, 3.0], dtype=torch.bfloat16))

    def forward(self, x: Any) -> Any:
        return self.fc2(torch.relu(self.fc1(self.emb(x)))) * self.scale.float().sum()


def _dcp_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for mode in ("fsdp2", "tp", "2d", "fsdp2-model"):
        torch.manual_seed(0)
        model = DcpNet()
        if mode in ("fsdp2", "fsdp2-model"):
            mesh = init_device_mesh("cpu", (world,))
            fully_shard(model.fc1, mesh=mesh)
            fully_shard(model.fc2, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif mode == "tp":
            mesh = init_device_mesh("cpu", (world,))
            parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        else:
            mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh2["tp"],
                               {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            fully_shard(model, mesh=mesh2["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            torch.manual_seed(100 * step + rank)
            x = torch.randint(0, 11, (4, 3))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        path = os.path.join(out, mode)
        if mode == "fsdp2-model":
            dcp.save(msd, checkpoint_id=path)
        else:
            dcp.save({"model": msd, "optim": osd, "step": 2, "extra": {"note": mode}},
                     checkpoint_id=path)
        dist.barrier()
    _finish()


# -- DeepSpeed ----------------------------------------------------------------------------

DS_CONFIGS = [(stage, dtype) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]
#: DeepSpeed AutoTP (tensor parallel 2, on the 2 ranks) of a small Llama
DS_AUTOTP = [(1, "fp32"), (2, "bf16")]


def tiny_llama(vocab_size: int = 96) -> Any:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


class DsNet(nn.Module):
    """Parameters of awkward sizes, so flat partitions cut through them; a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 12)
        self.fc1 = nn.Linear(12, 29)
        self.fc2 = nn.Linear(29, 7)
        self.register_buffer("running", torch.linspace(0, 1, 5))

    def forward(self, x: Any) -> Any:
        return self.fc2(torch.relu(self.fc1(self.emb(x))))


def ds_config(stage: int, dtype: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True,
                                                "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1000,
    }


def _no_shm_build() -> None:
    """DeepSpeed compiles a shared-memory op for CPU collectives; gloo needs none."""
    import importlib

    # sys.modules' entry: the package attribute ``deepspeed.comm.torch`` is torch itself
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None


def _ds_worker(rank: int, world: int, init: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    _no_shm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", init_method=init, rank=rank,
                               world_size=world, auto_mpi_discovery=False)
    for stage, dtype in DS_CONFIGS:
        torch.manual_seed(0)
        model = DsNet()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(stage, dtype))
        for step in range(3):
            torch.manual_seed(10 * step + rank)
            x = torch.randint(0, 37, (2, 5))
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(os.path.join(out, f"zero{stage}-{dtype}"), tag="global_step3")
        engine.destroy()
    for stage, dtype in DS_AUTOTP:
        torch.manual_seed(0)
        model = tiny_llama()
        cfg = ds_config(stage, dtype)
        cfg["tensor_parallel"] = {"autotp_size": world}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=cfg)
        for step in range(3):
            torch.manual_seed(10 * step)  # the same batch on both tensor-parallel ranks
            x = torch.randint(0, 96, (2, 8))
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        engine.save_checkpoint(os.path.join(out, f"autotp2-zero{stage}-{dtype}"),
                               tag="global_step3")
        engine.destroy()
    torch.distributed.barrier()
    if rank == 0:  # DeepSpeed is imported here already: its own tools, once per run
        ds_references(Path(out))
    _finish()


def _ds_load_worker(rank: int, world: int, init: str, jobs_file: str) -> None:
    """Each job: load a universal checkpoint, write the loaded state for comparison."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    _no_shm_build()
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo", init_method=init, rank=rank,
                               world_size=world, auto_mpi_discovery=False)
    for job in json.loads(Path(jobs_file).read_text()):
        torch.manual_seed(1234)  # different weights than the saved ones
        model = tiny_llama() if job.get("model") == "llama" else DsNet()
        cfg = ds_config(job.get("load_stage", job["stage"]), job["dtype"])
        cfg["checkpoint"] = {"load_universal": True}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=cfg)
        engine.load_checkpoint(job["dir"], tag=job["tag"], load_optimizer_states=True,
                               load_lr_scheduler_states=False)
        loaded: dict[str, Any] = {}
        for name, p in engine.module.named_parameters():
            loaded[f"fp32/{name}"] = safe_get_full_fp32_param(p).clone()
            for s in ("exp_avg", "exp_avg_sq"):
                loaded[f"{s}/{name}"] = safe_get_full_optimizer_state(p, s).clone()
        # the module's own (low precision) weights
        if job.get("load_stage", job["stage"]) == 3:
            from deepspeed import zero

            params = list(engine.module.parameters())
            with zero.GatheredParameters(params):
                for name, p in engine.module.named_parameters():
                    loaded[f"module/{name}"] = p.detach().clone()
        else:
            for name, p in engine.module.named_parameters():
                loaded[f"module/{name}"] = p.detach().clone()
        loaded["global_steps"] = torch.tensor(engine.global_steps)
        adam = [st["step"] for st in engine.optimizer.optimizer.state.values() if "step" in st]
        loaded["adam_step"] = torch.stack([torch.as_tensor(a, dtype=torch.float32) for a in adam])
        if rank == 0:
            torch.save(loaded, job["result"])
        engine.destroy()
    _finish()


# -- Megatron (megatron-core models, Megatron-LM's legacy per-rank files) ------------------

MEG = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2,
       "ffn_hidden_size": 96, "vocab_size": 100, "make_vocab_size_divisible_by": 16,
       "max_position_embeddings": 32}


def _meg_model(tp: int, pp: int, seed: int) -> Any:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=MEG["num_layers"], hidden_size=MEG["hidden_size"],
        num_attention_heads=MEG["num_attention_heads"],
        num_query_groups=MEG["num_query_groups"], ffn_hidden_size=MEG["ffn_hidden_size"],
        gated_linear_unit=True, add_bias_linear=False, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    multiple = MEG["make_vocab_size_divisible_by"] * tp
    padded = -(-MEG["vocab_size"] // multiple) * multiple
    return GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=padded,
        max_sequence_length=MEG["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    ), padded


def _meg_save(model: Any, out: str, tp: int, pp: int, padded: int) -> None:
    """What Megatron-LM's legacy save_checkpoint writes (``--ckpt-format torch``)."""
    import random

    import numpy
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(
        **MEG, group_query_attention=True, kv_channels=MEG["hidden_size"] //
        MEG["num_attention_heads"], swiglu=True, untie_embeddings_and_output_weights=True,
        padded_vocab_size=padded, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        attention_backend=AttnBackend.auto, ckpt_format="torch",
    )
    t = parallel_state.get_tensor_model_parallel_rank()
    p = parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    path = Path(out) / "iter_0000010" / name / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "args": args, "checkpoint_version": 3.0, "iteration": 10,
        "model": model.state_dict_for_save_checkpoint(),
        "rng_state": [{"random_rng_state": random.getstate(),
                       "np_rng_state": numpy.random.get_state(),
                       "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
    }, path)
    (Path(out) / "latest_checkpointed_iteration.txt").write_text("10")


def _meg_logits(model: Any, vocab: int) -> Any:
    from megatron.core import tensor_parallel

    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 97]])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, mask)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab].clone()


def _meg_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    # megatron-core asks CUDA for its buffers' device even on CPU (see DESIGN.md)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    import contextlib

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as meg_random

    # dropout RNG states live on CUDA; there is no dropout here (rates are 0)
    meg_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    # 1. TP=2 x PP=2: a legacy per-rank checkpoint
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=2)
    model, padded = _meg_model(2, 2, seed=1)
    _meg_save(model, os.path.join(out, "tp2-pp2"), 2, 2, padded)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    # 2. TP=2 (data parallel 2): save, and the logits of a forward pass
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model, padded = _meg_model(2, 1, seed=2)
    if parallel_state.get_data_parallel_rank() == 0:
        _meg_save(model, os.path.join(out, "tp2"), 2, 1, padded)
    logits = _meg_logits(model, MEG["vocab_size"])
    if rank == 0:
        torch.save(logits, os.path.join(out, "tp2-logits.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    # 3. one rank: the consolidated UCP checkpoint of run 2, loaded into a TP=1 model
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    if rank == 0:
        import ucpformat
        from ucpformat import importers
        from ucpformat.distributed.framework import ModelLayout
        from ucpformat.layout.rank_slices import ParallelConfig
        from ucpformat.layout.rules import RuleSet

        ucp = os.path.join(out, "tp2.ucp")
        importers.convert(os.path.join(out, "tp2"), ucp, durable=False)
        ckpt = ucpformat.open(ucp)
        params = ckpt.metadata["source"]["rule_params"]
        layout = ModelLayout(RuleSet.load("megatron-gpt"), params,
                             ParallelConfig(num_layers=MEG["num_layers"]))
        local = layout.local_state(ckpt, 0)
        single, _ = _meg_model(1, 1, seed=3)
        missing, unexpected = single.load_state_dict(
            {k: torch.from_numpy(v) for k, v in local.items()}, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        torch.save(_meg_logits(single, MEG["vocab_size"]), os.path.join(out, "tp1-logits.pt"))
    _finish()


def ds_references(out: Path) -> None:
    """DeepSpeed's own consolidation of every run: zero_to_fp32 and ds_to_universal."""
    _no_shm_build()
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    runs = [(f"zero{stage}-{dtype}", True) for stage, dtype in DS_CONFIGS]
    runs += [(f"autotp2-zero{stage}-{dtype}", False) for stage, dtype in DS_AUTOTP]
    for name, fp32 in runs:
        run = out / name
        if fp32:  # zero_to_fp32 reads data parallelism only
            torch.save(get_fp32_state_dict_from_zero_checkpoint(str(run)),
                       run / "zero_to_fp32.pt")
        uargs = argparse.Namespace(
            input_folder=str(run / "global_step3"), output_folder=str(run / "universal"),
            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
            inject_missing_state=True, no_strict=False,
        )
        ds_to_universal.main(uargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["dcp", "deepspeed", "deepspeed-pp", "ds-universal-load",
                                         "megatron"])
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=None)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.kind == "dcp":
        _spawn(_dcp_worker, args.world or 4, args.out)
    elif args.kind == "megatron":
        _spawn(_meg_worker, 4, args.out)
    elif args.kind == "deepspeed":
        _spawn(_ds_worker, args.world or 2, args.out)
    elif args.kind == "deepspeed-pp":
        from tests.importers.ds_pipeline import pipe_worker

        _spawn(pipe_worker, 4, args.out)
    else:
        _spawn(_ds_load_worker, args.world or 3, os.path.join(args.out, "jobs.json"))


if __name__ == "__main__":
    main()

"""megatron-core models saved and loaded through ``ucpformat.megatron`` and ``torch_dist``.

Run as ``python -m tests.megatron.jobs KIND OUT`` (gloo on CPU, file rendezvous). Every
worker ends with a barrier, ``destroy_process_group()``, flushed output and
``os._exit(0)`` (see DESIGN.md). megatron-core starts slowly, so each job does a lot:

* ``save`` (4 ranks): a GPT at TP2 x PP2 (grouped-query attention, SwiGLU, padded
  vocabulary, embeddings tied across the two pipeline stages) with the
  parameter-shaped optimizer states of the distributed optimizer's ``fully_reshardable``
  state dict (built here: that optimizer needs CUDA) and Megatron-LM-style RNG
  ShardedObjects, saved by both strategies; a mixture-of-experts GPT at EP2 saved by
  both; two saves refused for a ShardedObject that is not JSON (one into a committed
  checkpoint); then loads at TP4 by both strategies, with logits and the conformance
  reader contract's local tensors.
* ``pair`` (2 ranks): loads at TP2 x PP1 by both strategies, with logits.
* ``single`` (1 rank): loads at TP1 x PP1 by both strategies (the optimizer states asked
  for under the mixed-precision optimizer's names from the UCP checkpoint), logits, the
  MoE model at EP1, ``load_plain_tensors``, the ShardedObjects.

Results go to ``OUT/results/*.pt`` (torch.save of plain tensors); the tests compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

GPT: dict[str, Any] = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8,
                       "num_query_groups": 4, "ffn_hidden_size": 96}
MOE: dict[str, Any] = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                       "num_query_groups": 2, "ffn_hidden_size": 64, "num_moe_experts": 4,
                       "moe_ffn_hidden_size": 32, "moe_router_topk": 2}
VOCAB, DIVISIBLE, SEQ = 100, 16, 32
STATES = ("param", "exp_avg", "exp_avg_sq")  # the distributed optimizer's names
TOKENS = [[3, 14, 15, 92, 65, 35, 8, 97]]
#: A ShardedObject value that JSON cannot hold (a set), stored opaque when opted in.
OPAQUE_VALUE = {"ids": {3, 1, 2}}


def cpu_shims() -> None:
    """megatron-core asks CUDA for devices and RNG states even on CPU (see DESIGN.md)."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # tied embeddings across pipeline stages move the output layer's copy to CUDA
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    from megatron.core.tensor_parallel import random as meg_random

    # dropout's model-parallel RNG lives on CUDA; the dropout rates here are 0
    meg_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    # without TransformerEngine, 0.16.1's router refers to a name it never defined
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def padded_vocab(tp: int, vocab: int = VOCAB) -> int:
    step = DIVISIBLE * tp
    return -(-vocab // step) * step


def build(tp: int, pp: int, seed: int, *, moe: bool = False,
          shape: dict[str, Any] | None = None, vocab: int = VOCAB) -> Any:
    """A GPTModel (local spec) of this rank: ``GPT`` or ``MOE`` unless ``shape`` says."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    shape = shape or (MOE if moe else GPT)
    extra = {"moe_grouped_gemm": False, "expert_model_parallel_size":
             parallel_state.get_expert_model_parallel_world_size()} if moe else {}
    cfg = TransformerConfig(
        **shape, **extra, gated_linear_unit=True, add_bias_linear=False,
        use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(num_experts=shape.get("num_moe_experts"),
                                    moe_grouped_gemm=False)
    return GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab(tp, vocab),
        max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not moe,
    )


def params_of(model: Any, *, moe: bool = False, vocab: int = VOCAB) -> dict[str, Any]:
    from ucpformat.megatron import rule_params

    return rule_params(model.config, vocab_size=vocab, tie_word_embeddings=not moe,
                       make_vocab_size_divisible_by=DIVISIBLE)


def optimizer_states(model_sd: dict[str, Any], names: tuple[str, ...] = STATES, *,
                     empty: bool = False) -> dict[str, Any]:
    """What ``DistributedOptimizer.sharded_param_state_fully_reshardable`` returns: per
    parameter and state a copy of the parameter's ShardedTensor (or factory) with key
    ``optimizer.state.<state>.<key>``. The values are functions of the parameter's, so
    that every layout agrees on them (``empty``: zeros to load into)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[str, Any] = {}
    for name, sh in model_sd.items():
        if not isinstance(sh, ShardedTensor | ShardedTensorFactory):
            continue
        for k, state in enumerate(names):
            data = torch.zeros_like(sh.data) if empty else sh.data.detach() * (k + 2) + k
            kwargs: dict[str, Any] = {"key": f"optimizer.state.{state}.{sh.key}", "data": data}
            if isinstance(sh, ShardedTensor):
                kwargs["dtype"] = data.dtype
            out[f"optimizer/{k}/{name}"] = replace(sh, **kwargs)
    return out


def rng_data(pp_rank: int, tp_rank: int) -> list[dict[str, Any]]:
    """A Megatron-LM-style RNG state (tuples, numpy and torch tensors), per position."""
    seed = 100 + 10 * pp_rank + tp_rank
    return [{
        "random_rng_state": random.Random(seed).getstate(),
        "np_rng_state": np.random.RandomState(seed).get_state(),
        "torch_rng_state": torch.Generator().manual_seed(seed).get_state(),
        "rng_tracker_states": {"model-parallel-rng": torch.Generator().manual_seed(
            seed + 1).get_state()},
        "note": f"pp{pp_rank} tp{tp_rank}", "scale": float("inf"),
    }]


def rng_object() -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    return ShardedObject("rng_state", rng_data(pp, tp),
                         (ps.get_pipeline_model_parallel_world_size(),
                          ps.get_tensor_model_parallel_world_size()), (pp, tp),
                         replica_id=ps.get_data_parallel_rank())


def logits(model: Any) -> torch.Tensor:
    from megatron.core import tensor_parallel

    tokens = torch.tensor(TOKENS)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
    model.eval()
    with torch.no_grad():
        out = model(tokens, positions, mask)
        out = tensor_parallel.gather_from_tensor_model_parallel_region(out)
    return out[..., :VOCAB].clone()


def plain(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a loaded state dict, by dotted path (factories are merged already)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(plain(v, f"{prefix}{k}."))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            out.update(plain(v, f"{prefix}{i}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree.detach().clone()
    return out


def ucp_names(model_sd: dict[str, Any]) -> dict[str, str]:
    """Model state-dict name -> the consolidated tensor name the strategy stores it as."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
    )

    from ucpformat.megatron.regions import tensor_name

    wanted = {k for k, v in model_sd.items() if isinstance(v, ShardedTensor | ShardedTensorFactory)}
    apply_factories(model_sd)
    out = {}
    for k in wanted:
        v = model_sd[k]
        st = v if isinstance(v, ShardedTensor) else next(
            x for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, ShardedTensor))
        out[k] = tensor_name(st.key, st.global_offset[: st.prepend_axis_num])
    return out


def stop_results_manager() -> None:
    """torch_dist's writer starts a multiprocessing manager for its results queue, whose
    server process ``os._exit`` would orphan (it holds the job's output pipes open)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        queue._manager.shutdown()
        filesystem_async._results_queue = None


def _finish() -> None:
    import torch.distributed as dist

    dist.barrier()
    stop_results_manager()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(rank: int, world: int, init: str) -> None:
    import torch.distributed as dist

    cpu_shims()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)


def _fresh(path: Path) -> str:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return str(path)


# -- the 4-rank job ---------------------------------------------------------------------------


def _save_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    _start(rank, world, init)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import ucpformat.megatron as um
    from ucpformat.megatron.strategies import UCPSaveStrategy

    out = Path(out_dir)
    results = out / "results"
    # 1. the dense GPT at TP2 x PP2, saved by both strategies
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model = build(2, 2, seed=1)
    um.register(params_of(model))

    def state() -> dict[str, Any]:
        sd = model.sharded_state_dict()
        return {**sd, **optimizer_states(sd), "rng_state": rng_object()}

    for fmt, strategy in (("ucp", ("ucp", 1)), ("dist", ("torch_dist", 1))):
        dist_checkpointing.save(state(), _fresh(out / f"dense.{fmt}"), sharded_strategy=strategy)
    # 2. a ShardedObject that is not JSON (on rank 1 only): refused by name, nothing
    # committed, the committed checkpoint being replaced left as it was
    report: dict[str, Any] = {}
    for name, first in (("bad-new", False), ("bad-replace", True)):
        where = _fresh(out / name)
        if first:
            dist_checkpointing.save(state(), where, sharded_strategy=("ucp", 1))
        bad = state()
        if rank == 1:
            bad["extra"] = ShardedObject("extra_state", {"when": object()}, (1,), (0,))
        try:
            dist_checkpointing.save(bad, where, sharded_strategy=UCPSaveStrategy(
                params_of(model), overwrite=True))
            report[name] = "saved"
        except Exception as exc:  # the test reads what every rank got
            report[name] = f"{type(exc).__name__}: {exc}"
    (results / f"refused-{rank}.json").write_text(json.dumps(report))
    # 3. the same object stored as opaque bytes, opted in
    opaque = state()
    if rank == 1:
        opaque["extra"] = ShardedObject("extra_state", OPAQUE_VALUE, (1,), (0,))
    dist_checkpointing.save(opaque, _fresh(out / "opaque"), sharded_strategy=UCPSaveStrategy(
        params_of(model), allow_opaque=True))
    ps.destroy_model_parallel()
    # 4. the mixture of experts at EP2 (experts split over 2 of the 4 data-parallel ranks)
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    moe = build(1, 1, seed=2, moe=True)
    um.register(params_of(moe, moe=True))
    for fmt, strategy in (("ucp", ("ucp", 1)), ("dist", ("torch_dist", 1))):
        dist_checkpointing.save(moe.sharded_state_dict(), _fresh(out / f"moe.{fmt}"),
                                sharded_strategy=strategy)
    ps.destroy_model_parallel()
    # 5. loads at TP4
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    torch.save(load_both(4, out, contract=True), results / f"tp4-rank{rank}.pt")
    ps.destroy_model_parallel()
    _finish()


def _pair_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    """Loads at TP2 x PP1 on 2 ranks."""
    _start(rank, world, init)
    from megatron.core import parallel_state as ps

    import ucpformat.megatron as um

    out = Path(out_dir)
    um.register()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.save(load_both(2, out), out / "results" / f"tp2-rank{rank}.pt")
    ps.destroy_model_parallel()
    _finish()


def load_both(tp: int, out: Path, *, contract: bool = False) -> dict[str, Any]:
    """Load the dense checkpoints at TP ``tp`` with each strategy; what each gave."""
    from megatron.core import dist_checkpointing

    record: dict[str, Any] = {}
    model = build(tp, 1, seed=50 + tp)  # weights that differ from the saved ones
    for fmt, states in (("ucp", ("fp32_param", *STATES[1:])), ("dist", STATES)):
        sd = model.sharded_state_dict()
        request = {**sd, **optimizer_states(sd, states, empty=True)}
        loaded = dist_checkpointing.load(request, str(out / f"dense.{fmt}"))
        tensors = plain(loaded)
        record[fmt] = tensors
        model.load_state_dict({k: v for k, v in loaded.items() if not k.startswith("optim")})
        record[f"logits-{fmt}"] = logits(model)
    if contract:
        record["contract"] = reader_contract(model, out / "dense.ucp", tp)
    return record


def reader_contract(model: Any, ckpt_dir: Path, tp: int) -> dict[str, torch.Tensor]:
    """Every model tensor of this rank as the layout-aware reader contract (UCP-1.0-R215)
    computes it from the stored layout semantics alone: Megatron's conventions
    (group-major fused parts, the padding multiple) and this rank's coordinates."""
    from megatron.core import parallel_state as ps

    import ucpformat
    from ucpformat.conformance.layouts import Target, local_from_checkpoint
    from ucpformat.format import names
    from ucpformat.layout.semantics import layout_of
    from ucpformat.torch.numpy_bridge import from_numpy

    ckpt = ucpformat.open(ckpt_dir)
    target = Target(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(),
                    num_layers=GPT["num_layers"], fused_order="group-major",
                    vocab_multiple=DIVISIBLE)
    out = {}
    for name, ucp_name in ucp_names(model.sharded_state_dict()).items():
        path = names.path_of("model", ucp_name)
        meta = ckpt.arrays[path]
        lmap = target.local_map(meta.shape, layout_of(meta.ucp, meta.shape), tensor=path)
        assert lmap is not None, path
        out[name] = from_numpy(local_from_checkpoint(ckpt, path, lmap))
    return out


# -- the 1-rank job ---------------------------------------------------------------------------


def _single_worker(rank: int, world: int, init: str, out_dir: str) -> None:
    _start(rank, world, init)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    import ucpformat.megatron as um
    from ucpformat.megatron.strategies import UCPLoadStrategy

    out = Path(out_dir)
    results = out / "results"
    um.register()  # loading needs no model description
    ps.initialize_model_parallel()
    record = load_both(1, out)
    # every tensor whole, as megatron-core's tools read them
    for fmt in ("ucp", "dist"):
        record[f"plain-{fmt}"] = plain(dist_checkpointing.load_plain_tensors(
            str(out / f"dense.{fmt}")))
    # the ShardedObjects, by the unique keys the checkpoint lists, with live templates
    meta = serialization.load_sharded_metadata(str(out / "dense.ucp"))
    keys = sorted(k for k, v in meta.items() if isinstance(v, ShardedObject)
                  and v.key == "rng_state")
    request = {}
    for k in keys:
        obj = meta[k]
        request[k] = replace(obj, data=rng_data(*obj.global_offset))
    loaded = dist_checkpointing.load(request, str(out / "dense.ucp"),
                                     validate_access_integrity=False)
    torch.save({"keys": keys, "objects": loaded}, results / "objects.pt")
    torch.save(record, results / "tp1-rank0.pt")
    # the opaque object: refused without the opt-in, unpickled with it
    extra = {"extra": ShardedObject("extra_state", None, (1,), (0,))}
    opaque: dict[str, Any] = {}
    for allow in (False, True):
        try:
            got = dist_checkpointing.load(
                dict(extra), str(out / "opaque"), sharded_strategy=UCPLoadStrategy(
                    allow_opaque=allow), validate_access_integrity=False)
            opaque[str(allow)] = repr(got["extra"])
        except Exception as exc:  # the test reads the message
            opaque[str(allow)] = f"{type(exc).__name__}: {exc}"
    (results / "opaque.json").write_text(json.dumps(opaque))
    # the mixture of experts at EP1
    moe_record = {}
    for fmt in ("ucp", "dist"):
        moe = build(1, 1, seed=7, moe=True)
        loaded = dist_checkpointing.load(moe.sharded_state_dict(), str(out / f"moe.{fmt}"))
        moe_record[fmt] = plain(loaded)
        moe.load_state_dict(loaded)
        moe_record[f"logits-{fmt}"] = logits(moe)
    torch.save(moe_record, results / "moe-ep1.pt")
    _finish()


def _spawn(fn: Any, world: int, out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, f"file://{tmp}/rendezvous", out), nprocs=world, join=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=list(JOBS))
    parser.add_argument("out")
    args = parser.parse_args(argv)
    (Path(args.out) / "results").mkdir(parents=True, exist_ok=True)
    worker, world = JOBS[args.kind]
    _spawn(worker, world, args.out)


#: The jobs, in the order they run: worker and number of ranks.
JOBS: dict[str, tuple[Any, int]] = {"save": (_save_worker, 4), "pair": (_pair_worker, 2),
                                    "single": (_single_worker, 1)}


if __name__ == "__main__":
    main()

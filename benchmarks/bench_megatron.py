"""megatron-core dist_checkpointing: the ``ucp`` strategy vs ``torch_dist``, same model.

A GPTModel (megatron-core 0.16.1, local spec, grouped-query attention, SwiGLU, padded
vocabulary, fp32) with the three parameter-shaped optimizer states of the distributed
optimizer's ``fully_reshardable`` state dict (master copy, ``exp_avg``, ``exp_avg_sq``)
is held by 4 gloo processes at TP2 x PP2. Round-robin, in one run:

* **save** from the 4 ranks: ``dist_checkpointing.save(..., sharded_strategy=("ucp", 1))``
  (ucpformat.megatron) vs ``("torch_dist", 1)`` (PyTorch DCP underneath);
* **load** into the same layout, and **resharded loads** into TP4 and into TP1 (each of
  the 4 ranks then loads the whole model, data-parallel), all with
  ``dist_checkpointing.load``, which picks the strategy from ``metadata.json``.

Times are the slowest rank's, medians over repetitions after one warm-up; loads are
cold (the checkpoint's pages dropped from the page cache first). megatron-core needs
CUDA for some of its bookkeeping: the CPU shims of tests/megatron/jobs.py are applied.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import Table, common

RANKS = 4
#: The model's shape: default, and quick (the tests' tiny model).
DEFAULT_SHAPE: dict[str, Any] = {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
                                 "num_query_groups": 4, "ffn_hidden_size": 1536}
DEFAULT_VOCAB = 32000
QUICK_SHAPE: dict[str, Any] = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8,
                               "num_query_groups": 4, "ffn_hidden_size": 96}
QUICK_VOCAB = 100
METHODS = ("dist", "ucp")
STRATEGIES = {"dist": ("torch_dist", 1), "ucp": ("ucp", 1)}
TARGETS = {"same": (2, 2), "tp4": (4, 1), "tp1": (1, 1)}
TARGET_LABELS = {"same": "load, TP2 x PP2 (same layout)", "tp4": "resharded load, TP4",
                 "tp1": "resharded load, TP1 (4 data-parallel replicas)"}


def worker(rank: int, world: int, shape: dict[str, Any], vocab: int, repeats: int,
           root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import ucpformat.megatron as um
    from tests.megatron.jobs import (
        STATES,
        build,
        cpu_shims,
        optimizer_states,
        params_of,
        stop_results_manager,
    )

    warnings.filterwarnings("ignore")
    cpu_shims()

    def slowest(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    def evict(path: str) -> None:
        dist.barrier()
        if rank == 0:
            common.evict(path)
        dist.barrier()

    times: dict[str, list[float]] = {f"{m} {op}": [] for m in METHODS
                                     for op in ("save", *TARGETS)}
    paths: dict[str, str] = {}
    for r in range(repeats + 1):
        order = METHODS if r % 2 == 0 else METHODS[::-1]
        ps.initialize_model_parallel(tensor_model_parallel_size=2,
                                     pipeline_model_parallel_size=2)
        model = build(2, 2, seed=1, shape=shape, vocab=vocab)
        um.register(params_of(model, vocab=vocab))
        sd = model.sharded_state_dict()
        for method in order:
            path = f"{root}/{method}-{r}"
            if rank == 0:
                Path(path).mkdir(parents=True)
            state = {**model.sharded_state_dict(), **optimizer_states(sd)}
            seconds = slowest(lambda p=path, m=method, s=state: dist_checkpointing.save(
                s, p, sharded_strategy=STRATEGIES[m]))
            if r:
                times[f"{method} save"].append(seconds)
            if rank == 0 and method in paths:
                shutil.rmtree(paths[method], ignore_errors=True)
            paths[method] = path
        ps.destroy_model_parallel()
        for target, (tp, pp) in TARGETS.items():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                         pipeline_model_parallel_size=pp)
            into = build(tp, pp, seed=2, shape=shape, vocab=vocab)
            for method in order:
                evict(paths[method])
                msd = into.sharded_state_dict()
                request = {**msd, **optimizer_states(msd, STATES, empty=True)}
                seconds = slowest(lambda p=paths[method], q=request: dist_checkpointing.load(
                    q, p))
                if r:
                    times[f"{method} {target}"].append(seconds)
            ps.destroy_model_parallel()
    out: dict[str, Any] = {"times": times}
    if rank == 0:
        out["files"] = {m: len(common.files_under(p)) for m, p in paths.items()}
        out["disk_bytes"] = {m: common.disk_bytes(p) for m, p in paths.items()}
        import ucpformat

        with ucpformat.open(paths["ucp"]) as ckpt:
            out["arrays"] = len(ckpt.arrays)
            out["params"] = sum(math.prod(a.shape) for p, a in ckpt.arrays.items()
                                if p.startswith("model/"))
            out["nbytes"] = sum(math.prod(a.shape) * a.dtype.itemsize
                                for a in ckpt.arrays.values())
    stop_results_manager()
    return out


def measure(shape: dict[str, Any], vocab: int, repeats: int, root: Path) -> dict[str, Any]:
    from ucpformat.torch.launch import spawn

    results = spawn(worker, RANKS, shape, vocab, repeats, str(root), timeout=3000, threads=1)
    return {**results[0], "shape": shape, "vocab": vocab, "repeats": repeats,
            "load_average": common.load_average()}


def tables(m: dict[str, Any]) -> list[Table]:
    med = statistics.median
    t = m["times"]
    table = Table(
        title=f"megatron-core dist_checkpointing: ucp vs torch_dist, GPT at TP2 x PP2 on "
              f"{RANKS} ranks",
        columns=["operation", "torch_dist s", "ucp s", "torch_dist / ucp"],
    )
    for op, label in (("save", f"save ({RANKS} ranks)"), *TARGET_LABELS.items()):
        d, u = med(t[f"dist {op}"]), med(t[f"ucp {op}"])
        table.rows.append([label, f"{d:.2f}", f"{u:.2f}", f"{d / u:.2f}"])
    files, disk = m["files"], m["disk_bytes"]
    table.notes += [
        f"model: {m['shape']}, vocabulary {m['vocab']} (padded at save), tied "
        f"embeddings: {m['params'] / 1e6:.2f} M parameters and 3 optimizer states of "
        f"each, {m['nbytes'] / 2**20:.1f} MiB in {m['arrays']} consolidated arrays",
        f"files per checkpoint: torch_dist {files['dist']} ({disk['dist'] / 2**20:.1f} MiB), "
        f"ucp {files['ucp']} ({disk['ucp'] / 2**20:.1f} MiB); both with Megatron's "
        "common.pt and metadata.json",
        f"slowest rank, median of {m['repeats']} round-robin repetitions after one warm-up; "
        "loads cold; gloo, one torch thread per process",
        f"load average (1/5/15 min) at the end: {m['load_average']}",
    ]
    return [table]


def run(quick: bool = False, *, repeats: int | None = None,
        directory: Path | None = None) -> list[Table]:
    shape, vocab = (QUICK_SHAPE, QUICK_VOCAB) if quick else (DEFAULT_SHAPE, DEFAULT_VOCAB)
    reps = repeats if repeats is not None else (1 if quick else 3)
    tmp = tempfile.mkdtemp(prefix="ucp-bench-megatron-", dir=directory)
    try:
        return tables(measure(shape, vocab, reps, Path(tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover
    import sys

    for table in run(quick="--quick" in sys.argv):
        print(table.to_markdown())
    os._exit(0)

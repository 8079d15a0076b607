"""Asynchronous save: training blocked vs a plain copy of the state; throughput async vs sync.

A model of linear layers (``--mb`` MB of float32 parameters, AdamW state twice that)
is sharded with FSDP2 over ``--ranks`` gloo processes. Each rank measures, on the same
state in one run:

* **plain copy**: ``clone()`` of every local tensor it holds (parameters, moments,
  steps): the least any snapshot can cost;
* **async save, blocked**: how long ``AsyncSaver.save`` keeps training from running
  (the snapshot into host staging buffers; the first save also allocates them);
* **async save, total**: from the call until the checkpoint is committed;
* **sync save, total**: ``save_distributed`` from call to commit.

Blocked times are the slowest rank's (training waits for it at the next collective);
throughput is the checkpoint's logical size over the total time.

    python benchmarks/bench_async.py [--quick] [--mb 64] [--ranks 2] [--repeats 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ucpformat.torch.launch import spawn


def _model(mb: float) -> torch.nn.Module:
    width = 1024
    layers = max(1, round(mb * (1 << 20) / (4 * width * width)))
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def worker(rank: int, world: int, mb: float, repeats: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import ucpformat
    from ucpformat.torch.async_save import AsyncSaver
    from ucpformat.torch.distributed import save_distributed

    torch.manual_seed(0)
    model = _model(mb)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    opt.zero_grad()

    def local_tensors() -> list[torch.Tensor]:
        msd = get_model_state_dict(model)
        osd = get_optimizer_state_dict(model, opt)
        out = [v.to_local() if isinstance(v, DTensor) else v for v in msd.values()]
        for entry in osd["state"].values():
            out += [v.to_local() if isinstance(v, DTensor) else v for v in entry.values()]
        return out

    local_bytes = sum(t.numel() * t.element_size() for t in local_tensors())

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # interleaved, so that every kind of measurement sees the same conditions
    saver = AsyncSaver()
    copies, sync, blocked, total = [], [], [], []
    for i in range(repeats):
        copies.append(timed(lambda: [t.clone() for t in local_tensors()]))
        path = f"{root}/async-{i}"
        dist.barrier()
        t0 = time.perf_counter()
        future = saver.save(path, model=model, optimizer=opt)
        blocked.append(time.perf_counter() - t0)  # the whole call: what training waits
        future.result()
        total.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0 and i < repeats - 1:
            shutil.rmtree(path)
        path = f"{root}/sync-{i}"
        sync.append(timed(lambda p=path: save_distributed(p, model=model, optimizer=opt)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    saver.close()
    ckpt_bytes = 0
    if rank == 0:
        ckpt = ucpformat.open_checkpoint(f"{root}/async-{repeats - 1}")
        ckpt_bytes = sum(t.nbytes for t in ckpt.tensors())
    return {
        "local_bytes": local_bytes,
        "ckpt_bytes": ckpt_bytes,
        "copy": copies,
        "sync": sync,
        "blocked": blocked,
        "async_total": total,
    }


def measure(mb: float, ranks: int, repeats: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="ucp-bench-async-")
    try:
        results = spawn(worker, ranks, mb, repeats, root, timeout=1200)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def slowest(key: str) -> list[float]:  # per repetition, the slowest rank
        return [max(r[key][i] for r in results) for i in range(repeats)]

    ckpt = results[0]["ckpt_bytes"]
    copy = statistics.median(slowest("copy"))
    blocked = slowest("blocked")
    steady = statistics.median(blocked[1:]) if repeats > 1 else blocked[0]
    sync = statistics.median(slowest("sync"))
    async_total = statistics.median(slowest("async_total"))
    return {
        "ranks": ranks,
        "checkpoint_mb": ckpt / 2**20,
        "local_state_mb": max(r["local_bytes"] for r in results) / 2**20,
        "plain_copy_ms": copy * 1e3,
        "blocked_first_ms": blocked[0] * 1e3,
        "blocked_ms": steady * 1e3,
        "blocked_over_copy": steady / copy,
        "sync_total_s": sync,
        "async_total_s": async_total,
        "sync_mb_per_s": ckpt / 2**20 / sync,
        "async_mb_per_s": ckpt / 2**20 / async_total,
        "repeats": repeats,
    }


def rows(m: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"measure": "checkpoint (logical) / local state per rank",
         "value": f"{m['checkpoint_mb']:.0f} MB / {m['local_state_mb']:.0f} MB "
                  f"on {m['ranks']} ranks"},
        {"measure": "plain copy of the local state (clone)",
         "value": f"{m['plain_copy_ms']:.1f} ms"},
        {"measure": "async save: training blocked, first save (allocates staging)",
         "value": f"{m['blocked_first_ms']:.1f} ms"},
        {"measure": "async save: training blocked, later saves",
         "value": f"{m['blocked_ms']:.1f} ms ({m['blocked_over_copy']:.2f} x the plain copy)"},
        {"measure": "sync save: call to commit",
         "value": f"{m['sync_total_s']:.2f} s ({m['sync_mb_per_s']:.0f} MB/s)"},
        {"measure": "async save: call to commit",
         "value": f"{m['async_total_s']:.2f} s ({m['async_mb_per_s']:.0f} MB/s)"},
    ]


def run(quick: bool = False) -> list[dict[str, str]]:
    """The benchmark-runner interface: rows of one table."""
    return rows(measure(16 if quick else 64, 2, 2 if quick else 5))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MB of parameters, 2 repeats")
    parser.add_argument("--mb", type=float, default=None, help="MB of float32 parameters (64)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    mb = args.mb if args.mb is not None else (16 if args.quick else 64)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    m = measure(mb, args.ranks, max(2, repeats))
    width = max(len(r["measure"]) for r in rows(m))
    print(__doc__.splitlines()[0])
    for r in rows(m):
        print(f"  {r['measure']:<{width}}  {r['value']}")
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

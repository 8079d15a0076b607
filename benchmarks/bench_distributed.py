"""Distributed save, load and resharded load: ucpformat vs PyTorch DCP, same DTensor state.

The synthetic state of :mod:`benchmarks.state` is held as DTensors by 4 gloo processes
with tensor parallelism 4 (column-parallel weights split dimension 0, row-parallel ones
dimension 1, norms replicated; the parameters of a module). Round-robin, in one run:

* **save** from 4 ranks: ``ucpformat.torch.save_distributed(model=...)`` vs
  ``dcp.save(model.state_dict(), FileSystemWriter)``;
* **load** into the same layout (new, untouched local tensors):
  ``ucpformat.torch.load_distributed`` vs ``dcp.load``;
* **resharded load** of the 4-rank checkpoints by 2 processes, into tensor parallelism 2
  and into a different layout altogether (every tensor split along dimension 0 over the 2
  ranks, as FSDP does: the row-parallel weights are now cut across the saved cut).

Times are the slowest rank's (the next collective waits for it), medians over
repetitions; loads are cold (the checkpoint's pages dropped from the page cache first).
Read amplification is bytes read / bytes the target tensors hold, with bytes read
counted the same way for both (``rchar`` of ``/proc/self/io``: every byte a process
asked the kernel for, page-cache hits included), and ucpformat's own count beside it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import Table, common
from benchmarks import state as synthetic

DEFAULT_SIZE_MIB = 2048
QUICK_SIZE_MIB = 16
SAVE_RANKS = 4
LOAD_RANKS = 2
TARGETS = ("tp", "dim0")
TARGET_LABELS = {"tp": "TP2", "dim0": "dim-0 (FSDP-like)"}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def build(size_mib: float, layout: str, *, empty: bool, seed: int = 0) -> Any:
    """A module whose parameters are this rank's DTensors of the synthetic state.

    ``layout`` "tp": tensor parallelism over all ranks (``TensorDef.tp_dim``, norms
    replicated); "dim0": every tensor split along dimension 0. ``empty``: new untouched
    local tensors (a load target) instead of random values.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    root = torch.nn.Module()
    for d in synthetic.tensors(size_mib):
        if layout == "tp":
            placement: Any = Replicate() if d.tp_dim is None else Shard(d.tp_dim)
        else:
            placement = Shard(0)
        local_shape, _ = compute_local_shape_and_global_offset(d.shape, mesh, [placement])
        dtype = torch.bfloat16 if d.dtype == "bfloat16" else torch.float32
        if empty:
            local = torch.empty(tuple(local_shape), dtype=dtype)
        else:
            local = torch.empty(tuple(local_shape), dtype=dtype).normal_(generator=gen)
        dt = DTensor.from_local(local, mesh, [placement], run_check=False, shape=d.shape,
                                stride=_contiguous_stride(d.shape))
        *parents, leaf = d.name.split(".")
        node = root
        for part in parents:
            if part not in node._modules:
                node.add_module(part, torch.nn.Module())
            node = node._modules[part]
        node.register_parameter(leaf, torch.nn.Parameter(dt, requires_grad=False))
    return root


def _local_bytes(model: Any) -> int:
    return sum(p.to_local().nbytes for p in model.parameters())


def worker(rank: int, world: int, phase: str, size_mib: float, repeats: int, root: str,
           paths: dict[str, str] | None = None,
           save_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ucpformat.torch as ucpt

    warnings.filterwarnings("ignore")

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def evict(path: str) -> None:
        dist.barrier()
        if rank == 0:
            common.evict(path)
        dist.barrier()

    def load(method: str, path: str, layout: str) -> tuple[float, Any]:
        """Seconds to load into new untouched local tensors; ucpformat's LoadResult."""
        into = build(size_mib, layout, empty=True)
        results: list[Any] = []
        if method == "dcp":
            seconds = timed(lambda: dcp.load(into.state_dict(),
                                             storage_reader=dcp.FileSystemReader(path)))
        else:
            seconds = timed(lambda: results.append(ucpt.load_distributed(path, model=into)))
        return seconds, results[0] if results else None  # the loaded tensors go here

    out: dict[str, Any] = {"rank": rank}
    if phase == "save":
        model = build(size_mib, "tp", empty=False)
        out["local_bytes"] = _local_bytes(model)
        times: dict[str, list[float]] = {
            f"{m} {op}": [] for m in ("dcp", "ucp") for op in ("save", "load", "load warm")}
        last: dict[str, str] = {}
        for r in range(repeats + 1):
            for method in (("dcp", "ucp") if r % 2 == 0 else ("ucp", "dcp")):
                path = f"{root}/{method}-{r}"
                if method == "dcp":
                    s = timed(lambda p=path: dcp.save(
                        model.state_dict(), storage_writer=dcp.FileSystemWriter(p)))
                else:
                    s = timed(lambda p=path: ucpt.save_distributed(
                        p, model=model, **(save_kwargs or {})))
                evict(path)
                cold, _ = load(method, path, "tp")
                warm, _ = load(method, path, "tp")
                if r:
                    times[f"{method} save"].append(s)
                    times[f"{method} load"].append(cold)
                    times[f"{method} load warm"].append(warm)
                dist.barrier()
                if rank == 0 and method in last:
                    shutil.rmtree(last[method], ignore_errors=True)
                last[method] = path
        out["times"] = times
        out["paths"] = last
        if rank == 0:
            out["files"] = {k: len(common.files_under(p)) for k, p in last.items()}
            out["disk_bytes"] = {k: common.disk_bytes(p) for k, p in last.items()}
            import ucpformat

            with ucpformat.open(last["ucp"]) as ckpt:
                out["ucp_shards"] = sum(m.object_count for m in ckpt.arrays.values())
                out["ucp_chunks"] = sum(
                    m.object_count * _prod(m.chunks_per_shard) for m in ckpt.arrays.values()
                )
                out["ucp_arrays"] = len(ckpt.arrays)
        return out

    # phase "reshard": load the 4-rank checkpoints into other layouts, on fewer ranks
    assert paths is not None
    times = {f"{m} {t}{w}": [] for t in TARGETS for m in ("dcp", "ucp")
             for w in ("", " warm")}
    rchar: dict[str, int] = {}
    own: dict[str, int] = {}
    needed: dict[str, int] = {}
    for r in range(repeats + 1):
        for target in TARGETS:
            needed[target] = _local_bytes(build(size_mib, target, empty=True))
            for method in (("dcp", "ucp") if r % 2 == 0 else ("ucp", "dcp")):
                evict(paths[method])
                before = common.io_read_chars()
                cold, result = load(method, paths[method], target)
                rchar[f"{method} {target}"] = common.io_read_chars() - before
                if result is not None:
                    own[target] = result.bytes_read
                warm, _ = load(method, paths[method], target)
                if r:
                    times[f"{method} {target}"].append(cold)
                    times[f"{method} {target} warm"].append(warm)
    out["times"] = times
    out["rchar"] = rchar
    out["own"] = own
    out["needed"] = needed
    return out


def _prod(values: Any) -> int:
    n = 1
    for v in values:
        n *= int(v)
    return n


def measure(size_mib: float, repeats: int, root: Path,
            save_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    from ucpformat.torch.launch import spawn

    saved = spawn(worker, SAVE_RANKS, "save", size_mib, repeats, str(root), None, save_kwargs,
                  timeout=3000, threads=1)
    resharded = spawn(worker, LOAD_RANKS, "reshard", size_mib, repeats, str(root),
                      saved[0]["paths"], timeout=3000, threads=1)

    def slowest(results: list[dict[str, Any]], key: str) -> list[float]:
        n = len(results[0]["times"][key])
        return [max(res["times"][key][i] for res in results) for i in range(n)]

    return {
        "size_mib": size_mib,
        "repeats": repeats,
        "nbytes": sum(d.nbytes for d in synthetic.tensors(size_mib)),
        "save": {k: slowest(saved, k) for k in saved[0]["times"]},
        "reshard": {k: slowest(resharded, k) for k in resharded[0]["times"]},
        "rchar": {k: sum(res["rchar"][k] for res in resharded) for k in resharded[0]["rchar"]},
        "own": {k: sum(res["own"][k] for res in resharded) for k in resharded[0]["own"]},
        "needed": {k: sum(res["needed"][k] for res in resharded)
                   for k in resharded[0]["needed"]},
        "files": saved[0]["files"],
        "disk_bytes": saved[0]["disk_bytes"],
        "ucp_shards": saved[0]["ucp_shards"],
        "ucp_chunks": saved[0]["ucp_chunks"],
        "ucp_arrays": saved[0]["ucp_arrays"],
        "load_average": common.load_average(),
    }


def tables(m: dict[str, Any]) -> list[Table]:
    med = statistics.median
    nbytes = m["nbytes"]

    def gib_s(seconds: float) -> str:
        return f"{nbytes / 2**30 / seconds:.2f}"

    s = m["save"]
    t = Table(
        title=f"Distributed: {SAVE_RANKS} ranks (TP{SAVE_RANKS}) save and load, "
              f"{nbytes / 2**30:.2f} GiB of DTensors",
        columns=["operation", "DCP s", "ucpformat s", "ucpformat GiB/s", "DCP / ucpformat"],
    )
    for op, label in (("save", "save"), ("load", "load, cold"), ("load warm", "load, warm")):
        d, u = med(s[f"dcp {op}"]), med(s[f"ucp {op}"])
        t.rows.append([f"{label} ({SAVE_RANKS} ranks)", f"{d:.2f}", f"{u:.2f}", gib_s(u),
                       f"{d / u:.2f}"])
    rs = m["reshard"]
    amp = Table(
        title=f"Resharded load: the {SAVE_RANKS}-rank TP{SAVE_RANKS} checkpoint into "
              f"{LOAD_RANKS} ranks",
        columns=["target layout", "DCP s cold", "ucpformat s cold", "DCP / ucpformat cold",
                 "DCP s warm", "ucpformat s warm", "DCP / ucpformat warm",
                 "DCP read amplification", "ucpformat read amplification",
                 "ucpformat (own count)"],
    )
    for target in TARGETS:
        d, u = med(rs[f"dcp {target}"]), med(rs[f"ucp {target}"])
        dw, uw = med(rs[f"dcp {target} warm"]), med(rs[f"ucp {target} warm"])
        need = m["needed"][target]
        amp.rows.append([
            f"{TARGET_LABELS[target]} on {LOAD_RANKS} ranks", f"{d:.2f}", f"{u:.2f}",
            f"{d / u:.2f}", f"{dw:.2f}", f"{uw:.2f}", f"{dw / uw:.2f}",
            f"{m['rchar'][f'dcp {target}'] / need:.3f}",
            f"{m['rchar'][f'ucp {target}'] / need:.3f}", f"{m['own'][target] / need:.3f}",
        ])
    files = m["files"]
    t.notes += [
        synthetic.describe(m["size_mib"]),
        f"slowest rank, median of {m['repeats']} round-robin repetitions after one warm-up; "
        "loads cold (pages of the checkpoint dropped from the page cache first); gloo, "
        "one torch thread per process",
        f"files per checkpoint: DCP {files['dcp']} ({SAVE_RANKS} .distcp + .metadata), "
        f"ucpformat {files['ucp']:,} ({m['ucp_arrays']} arrays: one zarr.json each, "
        f"{m['ucp_shards']:,} shards holding {m['ucp_chunks']:,} inner chunks, plus groups, "
        "manifest, root)",
        f"load average (1/5/15 min) at the end: {m['load_average']}",
    ]
    amp.notes += [
        "read amplification: bytes read (rchar: what the process asked the kernel for, "
        "metadata included) / bytes of the target local tensors; ucpformat's own count is "
        "its ReadStats (chunk and shard-index bytes)",
        "TP2: the saved dims, half as many ways; dim-0: every tensor split along "
        "dimension 0, so row-parallel weights (saved split along dimension 1) are cut "
        "across the saved cut",
    ]
    chart = {f"save, {SAVE_RANKS} ranks": (med(s["dcp save"]), med(s["ucp save"])),
             f"load cold, {SAVE_RANKS} ranks": (med(s["dcp load"]), med(s["ucp load"]))}
    for target in TARGETS:
        chart[f"{TARGET_LABELS[target]} cold, {LOAD_RANKS} ranks"] = (
            med(rs[f"dcp {target}"]), med(rs[f"ucp {target}"]))
    t.data = {"dist": chart}
    return [t, amp]


def run(quick: bool = False, *, size_mib: float | None = None, repeats: int | None = None,
        directory: Path | None = None) -> list[Table]:
    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else DEFAULT_SIZE_MIB)
    reps = repeats if repeats is not None else (1 if quick else 5)
    tmp = tempfile.mkdtemp(prefix="ucp-bench-dist-", dir=directory)
    try:
        return tables(measure(size, reps, Path(tmp)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover
    import sys

    for table in run(quick="--quick" in sys.argv):
        print(table.to_markdown())
    os._exit(0)

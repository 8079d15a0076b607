"""DeepSpeed: time to a checkpoint that resumes on another world size, ucpformat vs DeepSpeed.

A DeepSpeed 0.19.8 engine (an MLP of ``--hidden`` x ``--layers``, fp32, AdamW, trained
one step) on 4 gloo processes, ZeRO-2 and ZeRO-3. What it takes until a checkpoint
exists that an engine of another world size can resume from:

* **DeepSpeed**: ``engine.save_checkpoint`` (per-rank pickles laid out for this world
  size) on every rank, then ``ds_to_universal`` (DeepSpeed's offline conversion, on
  rank 0: 1 extract and 1 merge worker, as in ``bench_import``) into the universal
  layout ``load_universal`` reads;
* **ucpformat**: ``ucpformat.deepspeed.save`` on every rank: the consolidated arrays,
  written straight away (durable: fsynced; DeepSpeed's files are not).

Times are rank 0's, from a barrier before to a barrier after (every rank waits for the
slowest), medians over ``--repeats``, the two paths alternating. *Written* is the bytes
of the files each path produced, DeepSpeed's temporary slice files (``tmp/``, deleted
at the end of the conversion) included. *Peak added* is the largest rise of any rank's
resident set during the path (``VmHWM`` reset before it); *bound* is what a rank holds
(its model, its fp32 partition and optimizer state) plus the largest tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import Table, common

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
STAGES = (2, 3)
PATHS = ("deepspeed", "ucpformat")
LABELS = {"deepspeed": "DeepSpeed: save_checkpoint + ds_to_universal",
          "ucpformat": "ucpformat.deepspeed.save"}


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1 << 30,
    }


def _tree_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _ds_path(engine: Any, rank: int, where: Path) -> tuple[float, int]:
    """save_checkpoint + ds_to_universal; (seconds without measuring tmp/, bytes written)."""
    import torch.distributed as dist
    from deepspeed.checkpoint import ds_to_universal

    t0 = time.perf_counter()
    engine.save_checkpoint(str(where / "ds"), tag="t")
    dist.barrier()
    written = 0
    if rank == 0:
        out = where / "universal"
        with contextlib.redirect_stdout(io.StringIO()):  # its progress report
            ds_to_universal.main(argparse.Namespace(
                input_folder=str(where / "ds" / "t"), output_folder=str(out),
                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=True,
                strict=True, inject_missing_state=True, no_strict=False))
        paused = time.perf_counter()
        written = _tree_bytes(where / "ds") + _tree_bytes(out)  # tmp/ still there
        resumed = time.perf_counter()
        shutil.rmtree(out / "tmp")  # what keep_temp_folder=False does
        t0 += resumed - paused
    dist.barrier()
    return time.perf_counter() - t0, written


def _ucp_path(engine: Any, rank: int, where: Path) -> tuple[float, int]:
    import torch.distributed as dist

    import ucpformat.deepspeed as uds

    t0 = time.perf_counter()
    uds.save(engine, where / "ucp")
    dist.barrier()
    seconds = time.perf_counter() - t0
    return seconds, _tree_bytes(where / "ucp") if rank == 0 else 0


def _held_bytes(engine: Any) -> tuple[int, int]:
    """(bytes this rank holds: model, fp32 partition, optimizer state; largest tensor)."""
    import torch

    from ucpformat.deepspeed.rank_fragments import holdings, inner_optimizer

    h = holdings(engine)
    inner = inner_optimizer(engine)
    held = 0
    for flat in h.flats:
        held += flat.master.numel() * flat.master.element_size()
        for value in inner.state.get(flat.master, {}).values():
            if isinstance(value, torch.Tensor):
                held += value.numel() * value.element_size()
    largest = 0
    for p in engine.module.parameters():
        local = getattr(p, "ds_tensor", p)
        held += local.numel() * local.element_size()
        largest = max(largest, int(getattr(p, "ds_numel", p.numel())) * p.element_size())
    return held, largest


def worker(rank: int, world: int, hidden: int, layers: int, repeats: int,
           workdir: str) -> dict[str, Any]:
    """Every stage, every path, ``repeats`` times (alternating); this rank's figures."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    out: dict[str, Any] = {}
    for stage in STAGES:
        torch.manual_seed(0)
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(hidden, hidden), nn.ReLU()]
        model = nn.Sequential(*mods)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(stage))
        loss = engine(torch.randn(2, hidden)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        held, largest = _held_bytes(engine)
        figures: dict[str, Any] = {"held": held, "largest": largest}
        for r in range(repeats):
            for path in PATHS if r % 2 == 0 else reversed(PATHS):
                where = Path(workdir) / f"zero{stage}-{path}-{r}"
                dist.barrier()
                base = common.reset_peak_rss()
                run = _ds_path if path == "deepspeed" else _ucp_path
                seconds, written = run(engine, rank, where)
                added = common.peak_rss_bytes() - base
                got = figures.setdefault(path, {"seconds": [], "written": 0, "added": 0})
                got["seconds"].append(seconds)
                got["written"] = max(got["written"], written)
                got["added"] = max(got["added"], added)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(where)
        out[f"zero{stage}"] = figures
        engine.destroy()
    return out


def measure(hidden: int, layers: int, repeats: int, workdir: Path) -> dict[str, Any]:
    """Run the workers, forked from this process (which imports DeepSpeed once)."""
    from ucpformat.deepspeed import demo
    from ucpformat.torch.launch import spawn

    demo.prepare()
    workdir.mkdir(parents=True, exist_ok=True)
    ranks = spawn(worker, WORLD, hidden, layers, repeats, str(workdir), timeout=3600,
                  start_method="fork")
    out: dict[str, Any] = {}
    for stage in STAGES:
        key = f"zero{stage}"
        per_rank = [r[key] for r in ranks]
        merged: dict[str, Any] = {
            "held": max(r["held"] for r in per_rank),
            "largest": per_rank[0]["largest"],
        }
        for path in PATHS:
            merged[path] = {
                "seconds": statistics.median(per_rank[0][path]["seconds"]),
                "written": per_rank[0][path]["written"],
                "added": max(r[path]["added"] for r in per_rank),
            }
        out[key] = merged
    return out


def measure_in_child(hidden: int, layers: int, repeats: int, workdir: Path) -> dict[str, Any]:
    """:func:`measure` in a fresh process: the workers fork from a process that has no
    threads of earlier benchmarks, and DeepSpeed's set-up stays out of this one."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_BUILD_OPS="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_deepspeed", "--child", str(hidden),
         str(layers), str(repeats), str(workdir)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the DeepSpeed benchmark failed:\n{proc.stderr[-3000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def run(quick: bool = False, *, hidden: int | None = None, layers: int | None = None,
        repeats: int | None = None, workdir: Path | None = None) -> list[Table]:
    hidden = hidden or (512 if quick else 2048)
    layers = layers or (4 if quick else 8)
    repeats = repeats or (1 if quick else 3)
    work = workdir or ROOT / "out" / "bench-deepspeed"
    if work.exists():
        shutil.rmtree(work)
    figures = measure_in_child(hidden, layers, repeats, work)
    params = layers * (hidden * hidden + hidden)
    rows: list[Sequence[str]] = []
    for stage in STAGES:
        f = figures[f"zero{stage}"]
        bound = (f["held"] + f["largest"]) / 2**20
        ds, ours = f["deepspeed"], f["ucpformat"]
        for path in PATHS:
            got = f[path]
            rows.append([
                f"ZeRO-{stage}: {LABELS[path]}",
                f"{got['seconds']:.2f}",
                f"{ds['seconds'] / got['seconds']:.2f}x" if path == "ucpformat" else "1.00x",
                f"{got['written'] / 2**20:.0f}",
                f"{got['added'] / 2**20:.0f}",
                f"{bound:.0f}",
            ])
        f["speedup"] = ds["seconds"] / ours["seconds"]
    notes = [
        f"{params / 1e6:.1f} M fp32 parameters ({hidden} x {hidden} x {layers} layers), AdamW; "
        f"{WORLD} gloo processes on {os.cpu_count()} cores; median of {repeats}; "
        f"load average {common.load_average()}",
        "ucpformat's checkpoint is universal when save returns; DeepSpeed's needs the "
        "conversion before another world size can load it",
    ]
    return [Table("DeepSpeed: time to a checkpoint resumable on another world size "
                  f"({WORLD} ranks)",
                  ["path", "seconds", "speed-up", "written MiB", "peak added MiB (max rank)",
                   "bound MiB (held + largest)"], rows, notes, data=figures)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("HIDDEN", "LAYERS", "REPEATS", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        hidden, layers, repeats, work = args.child
        print("\n" + json.dumps(measure(int(hidden), int(layers), int(repeats), Path(work))))
        sys.stdout.flush()
        return
    tables = run(args.quick, hidden=args.hidden, layers=args.layers, repeats=args.repeats,
                 workdir=args.workdir)
    if args.json:
        print(json.dumps(tables[0].data, indent=2))
    else:
        print(tables[0].to_markdown())
    sys.stdout.flush()


if __name__ == "__main__":
    main()

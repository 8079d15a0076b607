"""Import/export throughput and peak memory, beside each framework's own consolidation tool.

Real frameworks write the sources (an MLP of ``--hidden`` x ``--layers`` trained one
step on 2 gloo ranks): PyTorch DCP from FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 (fp32, Adam),
plus a safetensors file and a torch.save training checkpoint. Every conversion runs in a
fresh process, one after another, and reports wall time, throughput (bytes of tensors
written / time) and peak resident memory: the process's maximum RSS, and that maximum
less the RSS after its imports (what the conversion itself added). The tools compared:

* ``ucp convert`` (this library; 4 threads, 1 GiB memory limit by default) and
  ``ucp export --to deepspeed-universal`` / ``--to safetensors``;
* ``dcp_to_torch_save`` (torch), ``zero_to_fp32`` (DeepSpeed's
  ``convert_zero_checkpoint_to_fp32_state_dict``: weights only) and ``ds_to_universal``
  (DeepSpeed; weights and Adam moments, 1 extract and 1 merge worker; the RSS of its
  worker processes is in the ``children`` column). Peak RSS is the process's ``VmHWM``, reset after
the imports; ``children`` is ``ru_maxrss`` of the largest finished child process.

Sources are cached in ``--workdir`` (default ``out/bench-import``); the page cache is
warm for every tool alike.

    python -m benchmarks.bench_import [--quick] [--hidden 2048 --layers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

ROOT = Path(__file__).resolve().parents[1]


# -- sources: real frameworks -------------------------------------------------------------


def _mlp(hidden: int, layers: int) -> Any:
    import torch.nn as nn

    mods: list[Any] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods)


def _dcp_worker(rank: int, world: int, init: str, out: str, hidden: int, layers: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests.importers.frameworks import _finish

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _mlp(hidden, layers)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, hidden)).pow(2).mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    _finish()


def _ds_worker(rank: int, world: int, init: str, out: str, hidden: int, layers: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    from tests.importers.frameworks import _finish, _no_shm_build, ds_config

    _no_shm_build()
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo", init_method=init, rank=rank,
                               world_size=world, auto_mpi_discovery=False)
    for stage in (2, 3):
        torch.manual_seed(0)
        model = _mlp(hidden, layers)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(stage, "fp32"))
        loss = engine(torch.randn(2, hidden)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(os.path.join(out, f"zero{stage}"), tag="global_step1")
        engine.destroy()
    _finish()


def make_sources(work: Path, hidden: int, layers: int) -> dict[str, Path]:
    """Every source checkpoint, written once (kept in ``work`` between runs)."""
    import torch

    from tests.importers.frameworks import _spawn

    src = work / f"sources-{hidden}x{layers}"
    done = src / "DONE"
    paths = {
        "safetensors": src / "model.safetensors",
        "torch": src / "train.pt",
        "dcp": src / "dcp-fsdp2",
        "deepspeed-zero2": src / "deepspeed" / "zero2",
        "deepspeed-zero3": src / "deepspeed" / "zero3",
    }
    if done.exists():
        return paths
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    print(f"writing sources ({hidden}x{layers}) ...", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    model = _mlp(hidden, layers)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    model(torch.randn(2, hidden)).pow(2).mean().backward()
    opt.step()
    from safetensors.torch import save_file

    save_file(model.state_dict(), str(paths["safetensors"]))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1},
               paths["torch"])
    del model, opt
    _spawn(_dcp_worker, 2, str(paths["dcp"]), hidden, layers)
    _spawn(_ds_worker, 2, str(src / "deepspeed"), hidden, layers)
    done.write_text("ok")
    return paths


# -- one measured conversion per process ----------------------------------------------------


def child(tool: str, src: str, dst: str) -> dict[str, Any]:
    """Run one conversion here; return time and memory (called in a fresh process)."""
    import torch  # noqa: F401 - every tool needs it; imported before the baseline

    from tests.importers.frameworks import _no_shm_build

    if "zero" in tool or "universal" in tool:
        _no_shm_build()
        import deepspeed  # noqa: F401
    from ucpformat import exporters, importers

    base = common.reset_peak_rss() // 1024
    start = time.perf_counter()
    if tool == "ucp convert":
        options = {"allow_pickle": True} if importers.detect(src) == "dcp" else {}
        importers.convert(src, dst, durable=False, **options)
    elif tool.startswith("ucp export "):
        exporters.export(src, dst, to=tool.removeprefix("ucp export "))
    elif tool == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(src, dst)
    elif tool == "zero_to_fp32":
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(src, dst)
    elif tool == "ds_to_universal":
        from deepspeed.checkpoint import ds_to_universal

        ds_to_universal.main(argparse.Namespace(
            input_folder=src, output_folder=dst, num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=True,
        ))
    else:
        raise ValueError(tool)
    seconds = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"seconds": seconds, "peak_kb": common.peak_rss_bytes() // 1024, "base_kb": base,
            "children_kb": children}


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(tool: str, src: Path, dst: Path) -> dict[str, Any]:
    if dst.exists():
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_import", "--child", tool, str(src), str(dst)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} on {src} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["out_bytes"] = _tree_bytes(dst)
    return result


def run(quick: bool = False, *, hidden: int | None = None, layers: int | None = None,
        workdir: Path | None = None) -> list[dict[str, Any]]:
    hidden = hidden or (512 if quick else 2048)
    layers = layers or (4 if quick else 16)
    work = workdir or ROOT / "out" / "bench-import"
    src = make_sources(work, hidden, layers)
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    plan: list[tuple[str, str, Path, Path]] = [
        ("safetensors", "ucp convert", src["safetensors"], runs / "st.ucp"),
        ("torch.save", "ucp convert", src["torch"], runs / "pt.ucp"),
        ("DCP (FSDP2, 2 ranks)", "ucp convert", src["dcp"], runs / "dcp.ucp"),
        ("DCP (FSDP2, 2 ranks)", "dcp_to_torch_save", src["dcp"], runs / "dcp.pt"),
    ]
    for stage in ("zero2", "zero3"):
        s = src[f"deepspeed-{stage}"]
        label = f"DeepSpeed {stage.upper()} (2 ranks)"
        plan += [
            (label, "ucp convert", s, runs / f"{stage}.ucp"),
            (label, "zero_to_fp32", s, runs / f"{stage}-fp32"),
            (label, "ds_to_universal", s / "global_step1", runs / f"{stage}-universal"),
        ]
    plan += [
        ("UCP (from ZeRO-2)", "ucp export deepspeed-universal", runs / "zero2.ucp",
         runs / "zero2-ucp-universal"),
        ("UCP (from safetensors)", "ucp export safetensors", runs / "st.ucp",
         runs / "st-out.safetensors"),
    ]
    rows = []
    for source, tool, s, d in plan:
        print(f"  {source}: {tool} ...", file=sys.stderr, flush=True)
        m = measure(tool, s, d)
        in_bytes = _tree_bytes(s)
        rows.append({
            "source": source,
            "tool": tool,
            "source MB": round(in_bytes / 1e6, 1),
            "written MB": round(m["out_bytes"] / 1e6, 1),
            "seconds": round(m["seconds"], 2),
            "MB/s (source)": round(in_bytes / 1e6 / max(m["seconds"], 1e-9), 1),
            "peak RSS MB": round(m["peak_kb"] / 1024, 0),
            "added RSS MB": round((m["peak_kb"] - m["base_kb"]) / 1024, 0),
            "children MB": round(m["children_kb"] / 1024, 0),
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("TOOL", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    rows = run(args.quick, hidden=args.hidden, layers=args.layers, workdir=args.workdir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()

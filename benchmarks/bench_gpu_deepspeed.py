"""DeepSpeed's save path on one CUDA device: ZeRO-style flat partitions through the pool.

What ``ucpformat.deepspeed.save`` hands the pipeline is an
:class:`~ucpformat.deepspeed.save.EngineFragments` over the engine's flat partitions:
each parameter a slice of one flat buffer per dtype, as ZeRO holds them. This benchmark
makes the synthetic state of benchmarks/state.py as such slices on the GPU (bf16 weights
in one flat buffer, fp32 master weights and Adam moments in another; DeepSpeed itself
is not needed) and measures, one after the other in one process:

* ``d2h_pinned``: the pinned device-to-host copy of both flat buffers (the limit);
* ``ucp_save``: ``ucpformat.torch.save`` of the same tensors (bench_gpu's sync save);
* ``deepspeed_sync``: the pipeline's save of the fragments through the default
  512 MiB pinned pool (the synchronous DeepSpeed save);
* ``deepspeed_async_blocked_{first,steady}``: an async snapshot of the fragments
  (``EngineFragments.snapshot`` into pinned buffers, the caller's stream guarded),
  from the call until the caller's stream is free, and ``deepspeed_async_total_steady``
  until committed.

    python -m benchmarks.bench_gpu_deepspeed [--gib 8] [--dir DIR] [--json FILE]
    python -m benchmarks.bench_gpu_deepspeed --dry-run   # every step on a CPU state
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import Table, bench_gpu, common
from benchmarks import state as synthetic

SIZES_GIB = (8,)


def flat_state(gib: float, device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(name -> tensor, a view of its dtype's flat buffer; dtype name -> flat buffer)."""
    import torch

    defs = list(synthetic.tensors(gib * 1024))
    flats: dict[str, Any] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for name in ("bfloat16", "float32"):
        total = sum(int(torch.Size(d.shape).numel()) for d in defs if d.dtype == name)
        flats[name] = torch.empty(total, dtype=getattr(torch, name),
                                  device=device).normal_(generator=gen)
    views: dict[str, Any] = {}
    offsets = dict.fromkeys(flats, 0)
    for d in defs:
        n = int(torch.Size(d.shape).numel())
        views[d.name] = flats[d.dtype][offsets[d.dtype]:offsets[d.dtype] + n].view(d.shape)
        offsets[d.dtype] += n
    return views, flats


def measure(gib: float, root: Path, device: str) -> dict[str, Any]:
    import torch

    import ucpformat.torch as ucpt
    from ucpformat.deepspeed.save import EngineFragments
    from ucpformat.distributed.comm import SingleProcess
    from ucpformat.distributed.pipeline import save as run_pipeline
    from ucpformat.distributed.save_plan import TensorSpec
    from ucpformat.layout.boxes import full_box
    from ucpformat.torch.staging import DeviceCopier, HostBufferPool, Snapshot, Staging

    cuda = device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    views, flats = flat_state(gib, device)
    sync()
    nbytes = sum(t.numel() * t.element_size() for t in flats.values())
    out: dict[str, Any] = {"gib": gib, "bytes": nbytes, "tensors": len(views),
                           "state": synthetic.describe(gib * 1024), "seconds": {},
                           "errors": {}}
    secs: dict[str, float] = out["seconds"]
    specs = [TensorSpec(k, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                        {"ucp": {"role": "parameter"}}) for k, v in views.items()]

    def fragments(staging: Staging) -> EngineFragments:
        src = EngineFragments(staging)
        for k, v in views.items():
            src.add(k, full_box(tuple(v.shape)), v.reshape(-1))
        return src

    def timed(name: str, fn: Callable[[], object]) -> None:
        sync()
        t0 = time.perf_counter()
        try:
            fn()
            sync()
            secs[name] = time.perf_counter() - t0
        except Exception as exc:  # one step failing must not lose the others
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        print(f"bench_gpu_deepspeed {gib:g} GiB: {name} "
              f"{secs.get(name, out['errors'].get(name))}", file=sys.stderr, flush=True)

    pinned = {k: torch.empty(f.shape, dtype=f.dtype, pin_memory=cuda) for k, f in flats.items()}
    timed("d2h_pinned", lambda: [pinned[k].copy_(f, non_blocking=True)
                                 for k, f in flats.items()])
    pinned.clear()

    def ucp_save() -> None:
        ucpt.save(root / "ucp", model=common.buffer_module(views))

    timed("ucp_save", ucp_save)
    common.remove(root / "ucp")

    def deepspeed_sync() -> None:
        src = fragments(Staging())
        try:
            run_pipeline(root / "ds", SingleProcess(), specs=specs, source=src)
        finally:
            src.stop()

    timed("deepspeed_sync", deepspeed_sync)
    common.remove(root / "ds")

    pool = HostBufferPool(None)  # the snapshot's buffers: allocated once, then reused
    copier = DeviceCopier()
    for tag in ("first", "steady"):
        snap = Snapshot(pool, copier)
        try:
            src = fragments(Staging())
            sync()
            t0 = time.perf_counter()
            copier.begin(src.tensors())
            frags = src.snapshot(snap)
            snap.guard()  # the caller's stream waits for the copies
            if cuda:
                torch.cuda.current_stream().synchronize()
            secs[f"deepspeed_async_blocked_{tag}"] = time.perf_counter() - t0
            snap.wait()
            run_pipeline(root / f"ds-async-{tag}", SingleProcess(), specs=specs, source=frags)
            secs[f"deepspeed_async_total_{tag}"] = time.perf_counter() - t0
        except Exception as exc:
            out["errors"][f"deepspeed_async_{tag}"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            snap.wait()  # no copy may still write into a buffer given back
            snap.release()
        common.remove(root / f"ds-async-{tag}")
        print(f"bench_gpu_deepspeed {gib:g} GiB: async {tag} "
              f"{secs.get(f'deepspeed_async_blocked_{tag}')}", file=sys.stderr, flush=True)
    pool.clear()
    return out


def ratios(m: dict[str, Any]) -> dict[str, float]:
    s = m["seconds"]
    r: dict[str, float] = {}
    if {"ucp_save", "deepspeed_sync"} <= s.keys():
        r["deepspeed_sync_speed_over_ucp_save"] = s["ucp_save"] / s["deepspeed_sync"]
    if {"d2h_pinned", "deepspeed_sync"} <= s.keys():
        r["deepspeed_sync_time_over_d2h"] = s["deepspeed_sync"] / s["d2h_pinned"]
    if {"d2h_pinned", "deepspeed_async_blocked_steady"} <= s.keys():
        r["deepspeed_async_blocked_over_d2h"] = (s["deepspeed_async_blocked_steady"]
                                                 / s["d2h_pinned"])
    return r


LABELS = [
    ("d2h_pinned", "limit: device → pinned host copy (the flat buffers)"),
    ("ucp_save", "ucpformat.torch.save of the same tensors"),
    ("deepspeed_sync", "DeepSpeed path: fragments through the 512 MiB pool"),
    ("deepspeed_async_blocked_first", "DeepSpeed path async: blocked, first"),
    ("deepspeed_async_blocked_steady", "DeepSpeed path async: blocked"),
    ("deepspeed_async_total_steady", "DeepSpeed path async: call to commit"),
]


def table(m: dict[str, Any], device: str) -> Table:
    return bench_gpu.seconds_table(m, device,
                                   f"DeepSpeed save path on the GPU, {m['gib']:g} GiB state",
                                   LABELS, ratios(m))


def run(quick: bool = False, *, sizes: Sequence[float] | None = None,
        directory: Path | None = None, device: str = "cuda") -> list[Table]:
    """The runner's interface: no tables where there is no CUDA device (but a dry run)."""
    if device == "cuda" and not bench_gpu.cuda_available():
        return []
    line = bench_gpu.device_line() if device == "cuda" else "cpu dry run (the seconds mean nothing)"
    tables = []
    for gib in sizes or ((1,) if quick else SIZES_GIB):
        root = Path(tempfile.mkdtemp(prefix="ucp-gpu-ds-", dir=directory))
        try:
            tables.append(table(measure(gib, root, device), line))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return tables


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=None)
    parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"every step on the CPU on a {bench_gpu.DRY_RUN_GIB * 1024:g} "
                             "MiB state: checks the calls, measures nothing")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not bench_gpu.cuda_available():
        print("bench_gpu_deepspeed: no CUDA device here; nothing was measured.")
        return 0
    sizes = args.gib or ([bench_gpu.DRY_RUN_GIB] if args.dry_run else None)
    tables = run(sizes=sizes, directory=Path(args.dir) if args.dir else None, device=device)
    print("\n".join(t.to_markdown() for t in tables))
    if args.json:
        Path(args.json).write_text(json.dumps([t.data for t in tables], indent=2) + "\n")
    return 1 if any(t.data["errors"] for t in tables) else 0


if __name__ == "__main__":
    sys.exit(main())

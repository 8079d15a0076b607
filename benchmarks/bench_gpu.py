"""The GPU path: saves from and loads to one CUDA device, against the peers and the limits.

Runs only where CUDA exists (elsewhere it says so and exits; the benchmark runner leaves
it out). For each state size (``--gib``, default 8 and 32), the synthetic training state
of benchmarks/state.py (bf16 weights, fp32 master weights and Adam moments) is made on
the GPU, and one process measures, one after the other on the same state:

* the limits: pinned device-to-host copy of the whole state (into page-locked buffers
  allocated beforehand), the disk's raw write (the state's bytes into one file, fsync),
  its raw read (cold: the pages dropped first) and a raw read into pinned buffers with
  each tensor's host-to-device copy issued as soon as it is read;
* saves: ``ucpformat.torch.save`` (synchronous, staged through its 512 MiB pinned pool);
  ``AsyncSaver.save``, blocked time = from the call until the caller's CUDA stream is
  free again (the copies done: what training waits for), first save (allocates the
  pinned snapshot) and second (reuses it), and the time to commit; DCP ``async_save``,
  blocked the same way (until staging is complete, where the stager is asynchronous);
  DCP ``save``; ``torch.save`` (the file fsynced after, as every other save is durable);
* loads to the GPU, each cold: ``ucpformat.torch.load_state_dict(map_location="cuda")``
  (new tensors, through the pinned pool), ``ucpformat.torch.load(..., in_place=True)``
  into a module of CUDA buffers (read into pinned buffers, copied while the next are
  read), ``ucpformat.torch.load`` staged (the default: read into host memory, then
  copied through the pinned pool once every read succeeded), DCP ``load`` into CUDA
  tensors, and ``torch.load(map_location="cuda")``.

Every checkpoint is deleted once measured (a 32 GiB state needs about 40 GiB of disk
at any time). Throughputs are the state's bytes over the time.

    python -m benchmarks.bench_gpu [--gib 8 32] [--dir DIR] [--json FILE] [--markdown FILE]
    python -m benchmarks.bench_gpu --dry-run   # every step on a 4 MiB CPU state, anywhere

``--dry-run`` runs every step on the CPU (no pinned memory, no stream waits) on a tiny
state: it checks that the calls to ucpformat, DCP and torch work and that every figure
is produced; its seconds mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import Table, common
from benchmarks import state as synthetic

SIZES_GIB = (8, 32)
#: The state of ``--dry-run`` (4 MiB).
DRY_RUN_GIB = 4 / 1024
#: Where the state lives: "cpu" only for a dry run of every step (--dry-run, tests).
DEVICE = "cuda"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def device_line() -> str:
    import torch

    props = torch.cuda.get_device_properties(0)
    driver = ""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(Exception):
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
                 "pcie.link.width.current", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB · CUDA "
            f"{torch.version.cuda} · driver/PCIe gen/width {driver or '?'} · "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs · "
            f"torch {torch.__version__}")


def make_state(gib: float, device: str | None = None) -> dict[str, Any]:
    """The synthetic state, made on ``device`` (default :data:`DEVICE`; no host copy)."""
    import torch

    device = device or DEVICE
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    for d in synthetic.tensors(gib * 1024):
        dtype = torch.bfloat16 if d.dtype == "bfloat16" else torch.float32
        out[d.name] = torch.empty(d.shape, dtype=dtype, device=device).normal_(generator=gen)
    if device == "cuda":
        torch.cuda.synchronize()
    return out


def _sync() -> None:
    """Wait for the device (every stream)."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _stream_free() -> None:
    """Wait until the caller's stream has run what is queued on it (training's view)."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.current_stream().synchronize()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    t0 = time.perf_counter()
    value = fn()
    _sync()
    return time.perf_counter() - t0, value


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def measure(gib: float, root: Path) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import ucpformat.torch as ucpt
    from ucpformat.torch.async_save import AsyncSaver

    warnings.filterwarnings("ignore", category=UserWarning)
    state = make_state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"gib": gib, "bytes": nbytes, "tensors": len(state),
                           "state": synthetic.describe(gib * 1024), "seconds": {},
                           "errors": {}}
    secs: dict[str, float] = out["seconds"]

    def attempt(name: str, fn: Callable[[], float | None]) -> None:
        before = set(secs)
        try:
            value = fn()
            if value is not None:
                secs[name] = value
        except Exception as exc:  # one method failing must not lose the others
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            _free()
            # progress on stderr: a run stopped at its time limit still shows what it measured
            done = {k: round(v, 3) for k, v in secs.items() if k not in before}
            print(f"bench_gpu {gib:g} GiB: {name} {done or out['errors'].get(name)}",
                  file=sys.stderr, flush=True)

    # -- the limits ---------------------------------------------------------------------
    raw = root / "raw.bin"

    def limits() -> None:
        pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=DEVICE == "cuda")
                  for k, t in state.items()}
        secs["d2h_pinned"], _ = _timed(lambda: [pinned[k].copy_(t, non_blocking=True)
                                                for k, t in state.items()])
        dst = {k: torch.empty_like(t) for k, t in state.items()}
        secs["h2d_pinned"], _ = _timed(lambda: [dst[k].copy_(pinned[k], non_blocking=True)
                                                for k in state])
        dst.clear()
        _free()
        secs["disk_write"], _ = _timed(lambda: common.raw_write(str(raw), pinned))
        common.evict(raw)
        layout = common.numpy_layout(pinned)
        secs["disk_read"], arrays = _timed(lambda: common.raw_read(str(raw), layout))
        arrays.clear()
        common.evict(raw)

        def read_and_copy() -> list[Any]:
            fd = os.open(raw, os.O_RDONLY)
            moved = []
            try:
                offset = 0
                for view, (k, t) in zip(common.raw_bytes(pinned), state.items(), strict=True):
                    common.pread_exactly(fd, view, offset)
                    offset += len(view)
                    moved.append(pinned[k].to(t.device, non_blocking=True))
            finally:
                os.close(fd)
            return moved

        secs["read_plus_h2d"], moved = _timed(read_and_copy)
        moved.clear()
        pinned.clear()
        common.remove(raw)

    attempt("limits", limits)

    # -- ucpformat -----------------------------------------------------------------------
    module = common.buffer_module(state)
    ucp = root / "ucp"

    def ucp_save() -> float:
        t, _ = _timed(lambda: ucpt.save(ucp, model=module))
        return t

    def ucp_load() -> float:
        common.evict(ucp)
        t, loaded = _timed(lambda: ucpt.load_state_dict(ucp, map_location=DEVICE))
        del loaded
        return t

    def ucp_load_in_place() -> float:
        target = common.buffer_module({k: torch.empty_like(v) for k, v in state.items()})
        common.evict(ucp)
        t, _ = _timed(lambda: ucpt.load(ucp, model=target, in_place=True))
        return t

    def ucp_load_staged() -> float:
        target = common.buffer_module({k: torch.empty_like(v) for k, v in state.items()})
        common.evict(ucp)
        t, _ = _timed(lambda: ucpt.load(ucp, model=target))
        return t

    attempt("ucp_save", ucp_save)
    attempt("ucp_load", ucp_load)
    attempt("ucp_load_in_place", ucp_load_in_place)
    attempt("ucp_load_staged", ucp_load_staged)
    common.remove(ucp)

    def ucp_async() -> None:
        saver = AsyncSaver()
        try:
            for i in range(2):
                path = root / f"ucp-async-{i}"
                _sync()
                t0 = time.perf_counter()
                future = saver.save(path, model=module)
                returned = time.perf_counter() - t0
                _stream_free()
                blocked = time.perf_counter() - t0
                future.result()
                total = time.perf_counter() - t0
                tag = "first" if i == 0 else "steady"
                secs[f"ucp_async_returned_{tag}"] = returned
                secs[f"ucp_async_blocked_{tag}"] = blocked
                secs[f"ucp_async_total_{tag}"] = total
                common.remove(path)
        finally:
            saver.close()

    attempt("ucp_async", ucp_async)

    # -- DCP -----------------------------------------------------------------------------
    def dcp_async() -> None:
        for i in range(2):
            path = root / f"dcp-async-{i}"
            _sync()
            t0 = time.perf_counter()
            response = dcp.async_save(dict(state), checkpoint_id=str(path))
            staging = getattr(response, "staging_completion", None)
            upload = getattr(response, "upload_completion", response)
            if staging is not None:
                staging.result()
            _stream_free()
            blocked = time.perf_counter() - t0
            upload.result()
            total = time.perf_counter() - t0
            tag = "first" if i == 0 else "steady"
            secs[f"dcp_async_blocked_{tag}"] = blocked
            secs[f"dcp_async_total_{tag}"] = total
            common.remove(path)

    attempt("dcp_async", dcp_async)
    dcp_path = root / "dcp"

    def dcp_save() -> float:
        t, _ = _timed(lambda: dcp.save(dict(state), checkpoint_id=str(dcp_path)))
        return t

    def dcp_load() -> float:
        target = {k: torch.empty_like(v) for k, v in state.items()}
        common.evict(dcp_path)
        t, _ = _timed(lambda: dcp.load(target, checkpoint_id=str(dcp_path)))
        target.clear()
        return t

    attempt("dcp_save", dcp_save)
    attempt("dcp_load", dcp_load)
    common.remove(dcp_path)

    # -- torch.save ------------------------------------------------------------------------
    pt = root / "state.pt"

    def torch_save() -> float:
        def run() -> None:
            torch.save(state, pt)
            common.fsync_path(pt)

        t, _ = _timed(run)
        return t

    def torch_load() -> float:
        common.evict(pt)
        t, loaded = _timed(lambda: torch.load(pt, map_location=DEVICE, weights_only=True))
        del loaded
        return t

    attempt("torch_save", torch_save)
    attempt("torch_load", torch_load)
    common.remove(pt)
    return out


def ratios(m: dict[str, Any]) -> dict[str, float]:
    """The acceptance ratios of issue 18 (where both sides were measured)."""
    s = m["seconds"]
    r: dict[str, float] = {}

    def put(name: str, num: str, den: str) -> None:
        if num in s and den in s and s[den] > 0:
            r[name] = s[num] / s[den]

    put("async_blocked_over_d2h", "ucp_async_blocked_steady", "d2h_pinned")
    put("async_blocked_over_dcp_async", "ucp_async_blocked_steady", "dcp_async_blocked_steady")
    # throughput over the slower limit's = the slower limit's time over ours
    if {"disk_write", "d2h_pinned", "ucp_save"} <= s.keys():
        r["sync_save_over_limit"] = max(s["disk_write"], s["d2h_pinned"]) / s["ucp_save"]
    if {"disk_read", "h2d_pinned", "ucp_load"} <= s.keys():
        r["load_over_limit"] = max(s["disk_read"], s["h2d_pinned"]) / s["ucp_load"]
    put("sync_save_speed_over_dcp", "dcp_save", "ucp_save")
    put("load_speed_over_dcp", "dcp_load", "ucp_load")
    return r


LABELS = [
    ("d2h_pinned", "limit: device → pinned host copy"),
    ("h2d_pinned", "limit: pinned host → device copy"),
    ("disk_write", "limit: raw write + fsync"),
    ("disk_read", "limit: raw read (cold)"),
    ("read_plus_h2d", "raw read (cold) + H2D per tensor"),
    ("ucp_save", "ucpformat save (sync)"),
    ("ucp_async_blocked_first", "ucpformat async: blocked, first save"),
    ("ucp_async_blocked_steady", "ucpformat async: blocked"),
    ("ucp_async_returned_steady", "ucpformat async: call returns"),
    ("ucp_async_total_steady", "ucpformat async: call to commit"),
    ("dcp_async_blocked_first", "DCP async_save: blocked, first save"),
    ("dcp_async_blocked_steady", "DCP async_save: blocked"),
    ("dcp_async_total_steady", "DCP async_save: call to done"),
    ("dcp_save", "DCP save"),
    ("torch_save", "torch.save + fsync"),
    ("ucp_load", "ucpformat load_state_dict → cuda (cold)"),
    ("ucp_load_in_place", "ucpformat load in place into CUDA buffers (cold)"),
    ("ucp_load_staged", "ucpformat load (staged) into CUDA buffers (cold)"),
    ("dcp_load", "DCP load into CUDA tensors (cold)"),
    ("torch_load", "torch.load(map_location='cuda') (cold)"),
]


def seconds_table(m: dict[str, Any], device: str, title: str,
                  labels: Sequence[tuple[str, str]], figures: dict[str, float]) -> Table:
    """A GPU benchmark's measurement ``m`` as a table: seconds and GiB/s per method of
    ``labels`` (a failed one says so), then the device, the state, the ratios
    (``figures``) and the failures."""
    s = m["seconds"]
    rows: list[Sequence[str]] = []
    for key, label in labels:
        if key in s:
            rows.append([label, f"{s[key]:.2f}", f"{m['bytes'] / 2**30 / s[key]:.2f}"])
        elif key.split("_")[0] in m["errors"] or key in m["errors"]:
            rows.append([label, "failed", ""])
    notes = [device, m["state"]]
    notes += [f"{k}: {v:.2f}" for k, v in figures.items()]
    notes += [f"{k} failed: {v}" for k, v in m["errors"].items()]
    return Table(title, ["method", "seconds", "GiB/s"], rows, notes, data=m)


def table(m: dict[str, Any], device: str) -> Table:
    return seconds_table(m, device, f"GPU path, {m['gib']:g} GiB state", LABELS, ratios(m))


def run(quick: bool = False, *, sizes: Sequence[float] | None = None,
        directory: Path | None = None) -> list[Table]:
    """The runner's interface: no tables where there is no CUDA device."""
    if not cuda_available():
        return []
    device = device_line()
    tables = []
    for gib in sizes or ((1,) if quick else SIZES_GIB):
        root = Path(tempfile.mkdtemp(prefix="ucp-gpu-", dir=directory))
        try:
            tables.append(table(measure(gib, root), device))
        finally:
            shutil.rmtree(root, ignore_errors=True)
            _free()
    return tables


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=None,
                        help=f"state sizes (default {' '.join(map(str, SIZES_GIB))}; "
                             f"with --dry-run {DRY_RUN_GIB:g})")
    parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--markdown", default=None, help="write the tables here")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the CPU on a tiny state (default 4 MiB): "
                             "checks the calls, measures nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run(args.gib or [DRY_RUN_GIB], args)
    if not cuda_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False); this "
              "benchmark runs on a machine with an NVIDIA GPU. Nothing was measured.")
        return 0
    _emit(run(sizes=args.gib, directory=Path(args.dir) if args.dir else None), args)
    return 0


def dry_run(sizes: Sequence[float], args: argparse.Namespace) -> int:
    """Every step on the CPU: 1 (and the errors printed) if any step failed."""
    global DEVICE
    device, DEVICE = DEVICE, "cpu"
    try:
        tables, failed = [], False
        for gib in sizes:
            root = Path(tempfile.mkdtemp(prefix="ucp-gpu-dry-", dir=args.dir))
            try:
                m = measure(gib, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            tables.append(table(m, "cpu dry run (the seconds mean nothing)"))
            failed = failed or bool(m["errors"])
        _emit(tables, args)
        return 1 if failed else 0
    finally:
        DEVICE = device


def _emit(tables: list[Table], args: argparse.Namespace) -> None:
    text = "\n".join(t.to_markdown() for t in tables)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps([t.data for t in tables], indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())

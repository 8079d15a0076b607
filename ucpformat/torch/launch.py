"""Run a function on N local processes with ``torch.distributed`` (tests, demo, benchmarks).

:func:`spawn` starts ``world_size`` processes, initialises a process group in each (gloo
by default, rendezvous through a file so no TCP port has to be free), calls
``fn(rank, world_size, *args)``, and returns what each rank's ``fn`` returned (JSON).

Each worker ends the way that keeps CI stable with torch 2.13 and gloo: a barrier,
``destroy_process_group()``, flushed output and ``os._exit`` (a gloo worker thread can
otherwise abort the interpreter at shutdown, "terminate called without an active
exception", after all work is done). A worker that raises prints its traceback and exits
with status 1; the others are then stopped and :class:`WorkerError` is raised. A run that
exceeds ``timeout`` seconds (a deadlock) is stopped the same way.

``start_method="fork"`` starts the workers as copies of the caller, modules already
imported: DeepSpeed's engines import torch's compiler stack (about 13 s of CPU per
process here), which a parent that imported it once shares with every worker. Fork only
from a process that has started no threads and no process group.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker process failed, or the run timed out."""


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    workdir: str,
    backend: str,
    threads: int | None,
    args: tuple[Any, ...],
) -> None:
    status = 0
    try:
        if threads:
            torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
            rank=rank,
            world_size=world_size,
        )
        result = fn(rank, world_size, *args)
        if result is not None:
            with open(os.path.join(workdir, f"result-{rank}.json"), "w") as f:
                json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    backend: str = "gloo",
    threads: int | None = 1,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results by rank.

    ``fn`` must be importable by name (a module-level function); its return value, if not
    None, must be JSON. ``threads`` sets ``torch.set_num_threads`` in each worker (1 by
    default: several workers share the host's cores).
    """
    with tempfile.TemporaryDirectory(prefix="ucp-spawn-") as workdir:
        ctx = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _entry,
            args=(fn, world_size, workdir, backend, threads, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise WorkerError(f"workers did not finish within {timeout:.0f} s")
        except mp.ProcessExitedException as exc:  # type: ignore[attr-defined]
            raise WorkerError(f"a worker failed: {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        results: list[Any] = []
        for rank in range(world_size):
            path = Path(workdir) / f"result-{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
        return results


__all__ = ["WorkerError", "spawn"]

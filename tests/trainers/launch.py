"""Launching a test worker on one process or several (gloo, the torchrun environment)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(module: str, args: list[str], root: Path, world: int, name: str,
           timeout: float = 240, extra_env: dict[str, str] | None = None) -> None:
    """Run ``python -m module *args`` on ``world`` ranks with torchrun's variables set;
    output goes to files under ``root`` (a full pipe blocks); a failing rank fails the
    test with its log."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(extra_env or {})
    logs = [root / f"{name}-rank{r}.log" for r in range(world)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"--- {name} rank {r} (exit {procs[r].returncode}):\n"
                                  f"{logs[r].read_text()[-5000:]}" for r in failed)


def finish(code: int) -> None:
    """End a worker: barrier and destroy the process group if there is one, flush, exit
    (torch 2.13 with gloo sometimes aborts at interpreter shutdown otherwise)."""
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

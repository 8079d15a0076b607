"""Launching a test worker on one process or several (gloo, the torchrun environment)."""

from __future__ import annotations

import os
import sys

# the launcher is the test suite's (tests/helpers.py); the name these tests know it by
from tests.helpers import free_port
from tests.helpers import launch_ranks as launch

__all__ = ["finish", "free_port", "launch"]


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

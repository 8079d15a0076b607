"""The Megatron checkpoints of the strategy tests: written and loaded once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.importers.conftest import shared_cache

ROOT = Path(__file__).resolve().parents[2]


def run_job(kind: str, out: Path, timeout: int = 600) -> None:
    """``python -m tests.megatron.jobs KIND OUT`` in a fresh process (gloo ranks)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.megatron.jobs", kind, str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"megatron {kind} job failed ({proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")


def _every_job(out: Path) -> None:
    from tests.megatron.jobs import JOBS

    for kind in JOBS:
        run_job(kind, out)


@pytest.fixture(scope="session")
def meg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints saved at TP2 x PP2 (and MoE at EP2) by both strategies, and what the
    loads at TP1 (1 rank), TP2 (2 ranks) and TP4 (4 ranks) gave (``results/``)."""
    pytest.importorskip("megatron.core")
    return shared_cache(tmp_path_factory, "megatron-strategies", _every_job)

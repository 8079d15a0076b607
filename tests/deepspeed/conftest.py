"""Fixtures of the ucpformat.deepspeed tests: one harness run per session (real engines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.importers.conftest import shared_cache


def _run_harness(out: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", DS_BUILD_OPS="0")
    proc = subprocess.run([sys.executable, "-m", "tests.deepspeed.harness", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not (out / "results.json").exists():
        raise RuntimeError(f"the DeepSpeed harness failed ({proc.returncode}):\n"
                           f"{proc.stderr[-6000:]}")


@pytest.fixture(scope="session")
def ds_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The harness's output, made once per session (UCP_TEST_DEEPSPEED_RUN: a directory
    a previous ``python -m tests.deepspeed.harness DIR`` filled, to iterate faster)."""
    pytest.importorskip("deepspeed")
    given = os.environ.get("UCP_TEST_DEEPSPEED_RUN")
    if given:
        return Path(given)
    return shared_cache(tmp_path_factory, "deepspeed-harness", _run_harness)


@pytest.fixture(scope="session")
def results(ds_run: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((ds_run / "results.json").read_text())
    return doc


def array_differences(a: Path, b: Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Arrays that differ between two checkpoints (bit for bit), or that one lacks."""
    out = []
    with ucpformat.open(a) as x, ucpformat.open(b) as y:
        for path in sorted(set(x.keys()) | set(y.keys())):
            if path.startswith(skip):
                continue
            if path not in x or path not in y:
                out.append(f"{path}: only in {'the first' if path in x else 'the second'}")
                continue
            p, q = x[path].read(), y[path].read()
            if p.dtype != q.dtype or p.shape != q.shape or not np.array_equal(
                    np.ascontiguousarray(p).view(np.uint8), np.ascontiguousarray(q).view(np.uint8)):
                out.append(f"{path}: {p.dtype}{list(p.shape)} != {q.dtype}{list(q.shape)} or "
                           "values differ")
    return out

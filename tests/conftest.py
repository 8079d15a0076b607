"""Shared fixtures of the test suite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest


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
    import ucpformat

    def _save(state: dict[str, Any] | None = None, name: str = "ckpt", **kw: Any) -> Path:
        path = tmp_path / name
        ucpformat.save(path, small_state if state is None else state, **kw)
        return path

    return _save

"""Workers of tests/torch/test_rank_state.py: each rank's own generators and data-loader
state saved by ``save_distributed`` and given back to the same rank by
``load_distributed`` (spec UCP-1.0-R086, UCP-1.0-R087)."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

import ucpformat.torch as ucpt


class Loader:
    """A stateful data loader: where it is in its epoch, and its shuffling seed."""

    def __init__(self, position: int = 0, seed: int = 0) -> None:
        self.position = position
        self.seed = seed

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed,
                "order": torch.arange(4, dtype=torch.int64) + self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        assert torch.equal(state["order"], torch.arange(4) + self.seed)


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank (replicated)
    return torch.nn.Linear(4, 3)


def draws() -> dict[str, Any]:
    """What this rank's generators give next (dropout masks, shuffles, augmentation)."""
    return {"torch": torch.rand(3).tolist(), "numpy": np.random.rand(2).tolist(),
            "python": random.random(),
            "dropout": torch.nn.functional.dropout(torch.ones(8), 0.5).tolist()}


def save(rank: int, world: int, path: str) -> dict[str, Any]:
    net = model()
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    draws()  # the generators are somewhere in their streams, different on each rank
    loader = Loader(position=3 + rank, seed=10 * rank)
    ucpt.save_distributed(path, model=net, step=5, rng=True, rank_state={"loader": loader})
    return {"after": draws()}


def load(rank: int, world: int, path: str) -> dict[str, Any]:
    net = model()
    torch.manual_seed(999)  # anything but the saved state
    np.random.seed(999)
    random.seed(999)
    loader = Loader(position=-1, seed=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ucpt.load_distributed(path, model=net, rng=True, rank_state={"loader": loader})
    return {"after": draws(), "loader": [loader.position, loader.seed],
            "notes": result.rank_notes, "saved_world_size": result.saved_world_size,
            "stored": sorted(result.rank_state or {}), "step": result.step,
            "training": sorted(result.training),
            "warnings": [str(w.message) for w in caught
                         if type(w.message).__name__ == "RankStateWarning"]}

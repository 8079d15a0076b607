"""Which mappings of a saved state become groups (and which become JSON values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import ucpformat


def test_reserved_top_level_mappings_are_groups_even_without_arrays(tmp_path: Path) -> None:
    # Saving before the first optimizer step leaves no optimizer array; the optimizer and
    # training values must still live in their groups, not in the root's values.
    state = {
        "model": {"w": np.ones(3, np.float32)},
        "optimizer": {"type": "torch.optim.sgd.SGD", "param_groups": [{"params": ["w"]}]},
        "training": {"step": 0, "best": float("inf")},
        "other": {"a": 1},
    }
    ucpformat.save(tmp_path / "c", state)
    ckpt = ucpformat.open(tmp_path / "c")
    assert {"model", "optimizer", "training"} <= set(ckpt.groups)
    assert ckpt.values("training") == {"step": 0, "best": float("inf")}
    assert ckpt.values("optimizer")["type"] == "torch.optim.sgd.SGD"
    # a non-reserved mapping without arrays stays a JSON value of its parent
    assert "other" not in ckpt.groups
    assert ckpt.values() == {"other": {"a": 1}}
    assert ucpformat.validate(tmp_path / "c").valid
    assert ckpt.to_dict()["training"] == {"step": 0, "best": float("inf")}


def test_group_marker_forces_a_group(tmp_path: Path) -> None:
    state = {
        "optimizer": {
            "state": {"fc.weight": ucpformat.Group({"step": 3}), "fc.bias": {"n": 1}},
        },
        "ext": {"inner": ucpformat.Group()},
    }
    ucpformat.save(tmp_path / "c", state)
    ckpt = ucpformat.open(tmp_path / "c")
    assert "optimizer/state/fc.weight" in ckpt.groups
    assert ckpt.values("optimizer/state/fc.weight") == {"step": 3}
    assert ckpt.values("optimizer/state") == {"fc.bias": {"n": 1}}
    assert "ext/inner" in ckpt.groups and "ext" in ckpt.groups
    assert ckpt.to_dict()["optimizer"]["state"] == {"fc.weight": {"step": 3}, "fc.bias": {"n": 1}}


def test_group_carries_further_ucp_members(tmp_path: Path) -> None:
    tied = {"emb.weight": np.ones((2, 2), np.float32), "bias": np.zeros(2, np.float32)}
    state = {"model": ucpformat.Group(tied, ucp={"aliases": {"head.weight": "emb.weight"}})}
    ucpformat.save(tmp_path / "c", state)
    ckpt = ucpformat.open(tmp_path / "c")
    assert ckpt.groups["model"].ucp["aliases"] == {"head.weight": "emb.weight"}
    assert ucpformat.validate(tmp_path / "c").valid
    state = {"model": ucpformat.Group(tied, ucp={"aliases": {"head.weight": "nothing"}})}
    ucpformat.save(tmp_path / "d", state)
    assert "UCP-1.0-R108" in ucpformat.validate(tmp_path / "d").rules()

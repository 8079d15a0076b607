"""Invalid layout metadata is refused with its requirement id (by validate and by loaders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.errors import LayoutError
from ucpformat.layout.rank_slices import Conventions, ParallelConfig, RankCoords, local_map
from ucpformat.layout.semantics import Part, TensorLayout, layout_of


def _save_with_layout(path: Path, shape: tuple[int, ...], layout: dict[str, Any]) -> Path:
    def attrs(p: str, a: np.ndarray[Any, Any]) -> dict[str, Any]:
        return {"ucp": {"role": "parameter", "layout": layout}} if p == "model/w" else {}

    ucpformat.save(path, {"model": {"w": np.zeros(shape, np.float32)}}, array_attributes=attrs)
    return path


CASES = [
    (
        "parts do not sum to the dimension",
        (12, 4),
        {"tp": {"dim": 0}, "parts": [{"name": "q", "size": 8}, {"name": "k", "size": 2}]},
        "UCP-1.0-R102",
    ),
    ("split dimension out of range", (12, 4), {"tp": {"dim": 2}}, "UCP-1.0-R101"),
    (
        "parts without a split dimension",
        (12, 4),
        {"parts": [{"name": "q", "size": 12}]},
        "UCP-1.0-R100",
    ),
    (
        "groups that do not divide a part",
        (12, 4),
        {
            "tp": {"dim": 0},
            "parts": [{"name": "q", "size": 8}, {"name": "k", "size": 4}],
            "groups": 3,
        },
        "UCP-1.0-R103",
    ),
    ("expert count mismatch", (4, 6, 6), {"experts": {"dim": 0, "count": 8}}, "UCP-1.0-R105"),
    ("layers count mismatch", (3, 6), {"layers": {"dim": 0, "count": 4}}, "UCP-1.0-R106"),
    (
        "two semantics on one dimension",
        (4, 6),
        {"tp": {"dim": 0}, "experts": {"dim": 0, "count": 4}},
        "UCP-1.0-R107",
    ),
    (
        "vocabulary on a dimension tp does not split",
        (10, 4),
        {"tp": {"dim": 1}, "vocab": {"dim": 0}},
        "UCP-1.0-R104",
    ),
    ("negative layer", (4,), {"layer": -1}, "UCP-1.0-R106"),
]


@pytest.mark.parametrize(("why", "shape", "layout", "rule"), CASES, ids=[c[0] for c in CASES])
def test_validate_refuses_invalid_layout(
    tmp_path: Path, why: str, shape: tuple[int, ...], layout: dict[str, Any], rule: str
) -> None:
    path = _save_with_layout(tmp_path / "ckpt", shape, layout)
    report = ucpformat.validate(path)
    assert not report.valid
    assert rule in report.rules(), report.to_json()
    assert any(i.path == "model/w" for i in report.errors)


def test_loader_refuses_invalid_layout(tmp_path: Path) -> None:
    path = _save_with_layout(
        tmp_path / "ckpt",
        (12, 4),
        {"tp": {"dim": 0}, "parts": [{"name": "q", "size": 8}, {"name": "k", "size": 2}]},
    )
    t = ucpformat.open(path)["model/w"]
    with pytest.raises(LayoutError) as info:
        layout_of(t.attributes, t.shape, tensor=t.path)
    assert info.value.rule == "UCP-1.0-R102"
    assert "model/w" in str(info.value)


def test_target_tp_that_does_not_divide_a_part_is_refused() -> None:
    layout = TensorLayout(tp_dim=0, parts=(Part("q", 8), Part("k", 2), Part("v", 2)))
    with pytest.raises(LayoutError) as info:
        local_map(
            (12, 4), layout, Conventions(), ParallelConfig(tp=4), RankCoords(tp=0), tensor="qkv"
        )
    assert info.value.rule == "UCP-1.0-R110"
    assert "'k'" in str(info.value) and "tp=4" in str(info.value)


def test_ep_that_does_not_divide_experts_is_refused() -> None:
    layout = TensorLayout(experts_dim=0, experts_count=3)
    with pytest.raises(LayoutError) as info:
        local_map(
            (3, 4), layout, Conventions(), ParallelConfig(dp=2, ep=2), RankCoords(), tensor="e"
        )
    assert info.value.rule == "UCP-1.0-R110"


def test_alias_to_missing_tensor_is_refused(tmp_path: Path) -> None:
    from ucpformat.distributed import Fragment, TensorSpec, save_fragments
    from ucpformat.distributed.comm import run_threads

    def rank_main(comm: Any) -> Any:
        return save_fragments(
            tmp_path / "ckpt",
            comm,
            specs=[TensorSpec("model/w", (2,), "float32")],
            fragments=[Fragment("model/w", ((0, 2),), np.zeros(2, np.float32))],
            group_attributes={"model": {"aliases": {"head.weight": "nope"}}},
        )

    run_threads(1, rank_main)
    report = ucpformat.validate(tmp_path / "ckpt")
    assert "UCP-1.0-R108" in report.rules()

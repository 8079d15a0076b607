"""Save from any parallel layout, load into any other: the universal-checkpoint matrix.

Every source layout saves the same reference model (sharded by the independent
reference in megatron_reference.py) straight into the consolidated format with the
distributed writer; the consolidated arrays must equal the ground truth whatever the
source; then every target layout's ranks load their local state, which must equal,
bit for bit, direct sharding of the ground truth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.layout import megatron_reference as ref
from ucpformat.distributed import Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import ThreadGroup, run_threads
from ucpformat.distributed.framework import ModelLayout, flat_fragments
from ucpformat.format import names
from ucpformat.layout.rank_slices import ParallelConfig
from ucpformat.layout.rules import RuleSet

LAYOUTS: dict[str, ParallelConfig] = {
    "single": ParallelConfig(),
    "tp2": ParallelConfig(tp=2),
    "tp4": ParallelConfig(tp=4),
    "pp4": ParallelConfig(pp=4),
    "pp2-dp2-zero1": ParallelConfig(pp=2, dp=2, zero=1),
    "tp2-pp2": ParallelConfig(tp=2, pp=2),
    "dp4-ep2-zero1": ParallelConfig(dp=4, ep=2, zero=1),
    "tp2-dp2-ep2-zero3": ParallelConfig(tp=2, dp=2, ep=2, zero=3),
    "dp2-zero3-flat": ParallelConfig(dp=2, zero=3, zero_style="flat"),
    "tp2-pp2-dp2-ep2-zero1": ParallelConfig(tp=2, pp=2, dp=2, ep=2, zero=1),
}


def _cfg(name: str, mc: ref.ModelConfig) -> ParallelConfig:
    base = LAYOUTS[name]
    return ParallelConfig(
        tp=base.tp,
        pp=base.pp,
        dp=base.dp,
        ep=base.ep,
        zero=base.zero,
        zero_style=base.zero_style,
        num_layers=mc.layers,
        num_experts=mc.experts,
    )


def _opt_path(kind: str) -> Any:
    return lambda name: f"optimizer/state/{names.escape(name)}/{kind}"


def save_from(path: Path, mc: ref.ModelConfig, gt: dict[str, Any], layout: str) -> list[Any]:
    cfg = _cfg(layout, mc)
    rules = RuleSet.load("megatron-gpt")
    shapes = {n: a.shape for n, a in gt["model"].items()}
    param_names = [n for n in gt["model"]]

    def rank_main(comm: ThreadGroup) -> Any:
        rank = comm.rank
        local = ref.shard(gt, mc, cfg, rank)
        ml = ModelLayout(rules, mc.params(), cfg, shapes)
        specs, frags, aliases = ml.fragments(rank, local["model"])
        if cfg.zero in (0, 3):
            for kind in ref.OPT_KINDS:
                s2, f2, _ = ml.fragments(
                    rank,
                    local["optimizer"][kind],
                    role="optimizer_state",
                    path_of=_opt_path(kind),
                    with_layout=False,
                )
                specs += s2
                frags += f2
        else:
            for group in ("dense", "expert"):
                order = ref.flat_group_order(mc, cfg, rank, group)
                params = ml.group_params(rank, order, shapes, experts=group == "expert")
                part = ml.flat_partition(rank, params, experts=group == "expert")
                for kind in ref.OPT_KINDS:
                    frags += flat_fragments(local["optimizer"][kind][group], part, _opt_path(kind))
                    specs += [
                        TensorSpec(
                            _opt_path(kind)(n),
                            shapes[n],
                            "float32",
                            {"ucp": {"role": "optimizer_state"}},
                        )
                        for n, _ in params
                    ]
        groups: dict[str, Any] = {
            "optimizer": {
                "values": {
                    "type": "megatron.DistributedOptimizer",
                    "param_groups": [{"params": param_names, "lr": 3e-4}],
                }
            }
        }
        if aliases:
            groups["model"] = {"aliases": aliases}
        return save_fragments(
            path,
            comm,
            specs=specs,
            fragments=frags,
            group_attributes=groups,
            root_values={"step": 7},
            chunk_bytes=256,
            min_shard_bytes=256,
            durable=False,
        )

    return run_threads(cfg.world, rank_main)


def _bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert np.array_equal(_bits(got), _bits(want)), f"{what}: values differ"


def check_consolidated(path: Path, gt: dict[str, Any], mc: ref.ModelConfig) -> None:
    ckpt = ucpformat.open(path)
    for name, want in gt["model"].items():
        assert_same(ckpt.tensor("model", name).read(), want, f"model/{name}")
    for kind in ref.OPT_KINDS:
        for name, want in gt[kind].items():
            assert_same(ckpt[_opt_path(kind)(name)].read(), want, f"{kind}/{name}")
    expected_arrays = len(gt["model"]) * (1 + len(ref.OPT_KINDS))
    assert len(ckpt) == expected_arrays
    if mc.tied:
        assert ckpt.groups["model"].ucp["aliases"] == {
            "output_layer.weight": "embedding.word_embeddings.weight"
        }
    report = ucpformat.validate(path, deep=True)
    assert report.valid, report.to_json()


def check_target(path: Path, gt: dict[str, Any], mc: ref.ModelConfig, layout: str) -> None:
    cfg = _cfg(layout, mc)
    rules = RuleSet.load("megatron-gpt")
    shapes = {n: a.shape for n, a in gt["model"].items()}
    ckpt = ucpformat.open(path)
    for rank in range(cfg.world):
        want = ref.shard(gt, mc, cfg, rank)
        ml = ModelLayout(rules, mc.params(), cfg, shapes)
        got = ml.local_state(ckpt, rank)
        assert sorted(got) == sorted(want["model"]), f"{layout} rank {rank}: tensor names differ"
        for n in got:
            assert_same(got[n], want["model"][n], f"{layout} rank {rank} {n}")
        if cfg.zero in (0, 3):
            for kind in ref.OPT_KINDS:
                got_k = ml.local_state(ckpt, rank, path_of=_opt_path(kind))
                assert sorted(got_k) == sorted(want["optimizer"][kind])
                for n in got_k:
                    assert_same(
                        got_k[n], want["optimizer"][kind][n], f"{layout} rank {rank} {kind} {n}"
                    )
        else:
            for group in ("dense", "expert"):
                order = ref.flat_group_order(mc, cfg, rank, group)
                params = ml.group_params(rank, order, shapes, experts=group == "expert")
                part = ml.flat_partition(rank, params, experts=group == "expert")
                for kind in ref.OPT_KINDS:
                    buf = ml.read_partition(ckpt, part, _opt_path(kind), np.float32)
                    assert_same(
                        buf, want["optimizer"][kind][group], f"{layout} rank {rank} {kind} {group}"
                    )


@pytest.fixture(scope="module")
def untied() -> tuple[ref.ModelConfig, dict[str, Any]]:
    mc = ref.ModelConfig()
    return mc, ref.ground_truth(mc)


@pytest.fixture(scope="module")
def saved_untied(
    tmp_path_factory: pytest.TempPathFactory, untied: tuple[ref.ModelConfig, dict[str, Any]]
) -> dict[str, Path]:
    mc, gt = untied
    out = {}
    for layout in LAYOUTS:
        path = tmp_path_factory.mktemp("matrix") / layout
        save_from(path, mc, gt, layout)
        out[layout] = path
    return out


@pytest.mark.parametrize("source", list(LAYOUTS))
def test_consolidated_identical_whatever_the_source(
    saved_untied: dict[str, Path], untied: tuple[ref.ModelConfig, dict[str, Any]], source: str
) -> None:
    mc, gt = untied
    check_consolidated(saved_untied[source], gt, mc)


@pytest.mark.parametrize("target", list(LAYOUTS))
@pytest.mark.parametrize("source", list(LAYOUTS))
def test_load_into_any_layout(
    saved_untied: dict[str, Path],
    untied: tuple[ref.ModelConfig, dict[str, Any]],
    source: str,
    target: str,
) -> None:
    mc, gt = untied
    check_target(saved_untied[source], gt, mc, target)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("tp2-pp2", "single"),
        ("single", "tp2-pp2-dp2-ep2-zero1"),
        ("pp4", "tp4"),
        ("dp2-zero3-flat", "pp2-dp2-zero1"),
    ],
)
def test_tied_output_layer(tmp_path: Path, source: str, target: str) -> None:
    mc = ref.ModelConfig(tied=True)
    gt = ref.ground_truth(mc, seed=1)
    save_from(tmp_path / "ckpt", mc, gt, source)
    check_consolidated(tmp_path / "ckpt", gt, mc)
    check_target(tmp_path / "ckpt", gt, mc, target)


def test_fragments_with_a_hole_are_refused(tmp_path: Path) -> None:
    """Coverage is checked before anything is written (UCP-1.0-R131)."""
    spec = TensorSpec("model/w", (8, 4), "float32")
    data = np.ones((4, 4), np.float32)

    def rank_main(comm: ThreadGroup) -> Any:
        return save_fragments(
            tmp_path / "ckpt",
            comm,
            specs=[spec],
            fragments=[Fragment("model/w", ((0, 4), (0, 4)), data)],
        )

    with pytest.raises(ucpformat.errors.LayoutError) as info:
        run_threads(2, rank_main)
    assert info.value.rule == "UCP-1.0-R131"
    assert "(4, 8)" in str(info.value)
    assert not (tmp_path / "ckpt").exists()

"""Pipeline and tensor parallelism: a Megatron-DeepSpeed-style GPT on 2 stages x 2
tensor-parallel ranks (rule file megatron-deepspeed-gpt), saved on 4 ranks, resumes at
other degrees with equal parameters and state; a pipeline of 2 stages x 2 data-parallel
ranks under DeepSpeed's bf16 optimizer resumes on 1 stage; a Llama split by DeepSpeed's
AutoTP (TP 2 x DP 2) resumes at TP 2 and TP 1 (tests/deepspeed/harness.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucpformat
from tests.deepspeed.conftest import array_differences

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

from tests.deepspeed.harness import (  # noqa: E402
    AUTOTP,
    AUTOTP_AFTER,
    AUTOTP_RESUMES,
    GPT_RESUMES,
    GPT_RULES,
    autotp_name,
)


@pytest.fixture(scope="session")
def converted_pipelines(ds_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.importers.conftest import shared_cache
    from ucpformat import importers

    def build(base: Path) -> None:
        importers.convert(ds_run / "ds" / "gpt-pp2-tp2", base / "gpt-pp2-tp2", durable=False,
                          **GPT_RULES)
        importers.convert(ds_run / "ds" / "pipe-pp2-dp2-bf16", base / "pipe-pp2-dp2-bf16",
                          durable=False)
        importers.convert(ds_run / "ds" / AUTOTP, base / AUTOTP, durable=False)

    return shared_cache(tmp_path_factory, "deepspeed-converted-pipelines", build)


@pytest.mark.parametrize("run", ["gpt-pp2-tp2", "pipe-pp2-dp2-bf16"])
def test_pipeline_saves_equal_ucp_convert(ds_run: Path, results: dict[str, Any],
                                          converted_pipelines: Path, run: str) -> None:
    assert results["checks"][f"save {run}"] == []
    assert ucpformat.validate(ds_run / "ucp" / run, deep=True).valid
    assert array_differences(ds_run / "ucp" / run, converted_pipelines / run) == []


def test_gpt_is_stored_consolidated(ds_run: Path) -> None:
    with ucpformat.open(ds_run / "ucp" / "gpt-pp2-tp2") as ckpt:
        qkv = ckpt.tensor("model", "2.self_attention.query_key_value.weight")
        assert qkv.shape == (8 * 4 + 2 * 4 * 4, 32)  # q (8 heads) + k, v (4 groups), unsplit
        assert qkv.attributes["layout"]["tp"] == {"dim": 0}
        # the vocabulary-parallel embedding, unpadded (50 rows), stored once for two stages
        assert ckpt.tensor("model", "tied_modules.embed.word_embeddings.weight").shape == (50, 32)
        assert ckpt.metadata["source"]["tp_world_size"] == 2
        assert ckpt.metadata["source"]["pp_world_size"] == 2


@pytest.mark.parametrize(("pp", "tp"), [d for degrees in GPT_RESUMES.values()
                                        for d in degrees])
def test_gpt_resumes_at_other_degrees(ds_run: Path, results: dict[str, Any], pp: int,
                                      tp: int) -> None:
    """Loaded at another pipeline and tensor-parallel degree and saved again: the same
    arrays; the next training step gives the uninterrupted run's loss."""
    name = f"gpt-pp2-tp2->pp{pp}-tp{tp}"
    assert results["checks"][name] == []
    assert array_differences(ds_run / "ucp" / "gpt-pp2-tp2", ds_run / "resaved" / name) == []
    want = results["losses"]["gpt-pp2-tp2 rank0"][0]
    got = results["losses"][f"{name} rank0"][0]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_pipeline_of_bf16_optimizer_resumes_on_one_stage(ds_run: Path,
                                                         results: dict[str, Any]) -> None:
    name = "pipe-pp2-dp2-bf16->pp1-dp2"
    assert results["checks"][name] == []
    assert array_differences(ds_run / "ucp" / "pipe-pp2-dp2-bf16",
                             ds_run / "resaved" / name) == []


def test_autotp_save_equals_ucp_convert(ds_run: Path, results: dict[str, Any],
                                        converted_pipelines: Path) -> None:
    """An AutoTP engine (TP 2 x DP 2, no rule file: the engine's own
    universal_checkpoint_info) saves what ucp convert makes of its save_checkpoint:
    the same arrays, the same layout semantics."""
    assert results["checks"][f"save {AUTOTP}"] == []
    ours, theirs = ds_run / "ucp" / AUTOTP, converted_pipelines / AUTOTP
    assert ucpformat.validate(ours, deep=True).valid
    assert array_differences(ours, theirs) == []
    with ucpformat.open(ours) as a, ucpformat.open(theirs) as b:
        layout = {t.name: dict(t.attributes).get("layout") for t in a.tensors("model")}
        assert layout == {t.name: dict(t.attributes).get("layout") for t in b.tensors("model")}
        assert layout["model.layers.0.self_attn.o_proj.weight"] == {"tp": {"dim": 1}}
        assert layout["model.layers.1.self_attn.k_proj.weight"] == {"tp": {"dim": 0}}
        assert layout["lm_head.weight"] == {"tp": {"dim": 0}, "vocab": {"dim": 0}}
        assert layout["model.norm.weight"] is None
        assert a.tensor("model", "model.layers.0.mlp.down_proj.weight").shape == (32, 64)
        assert a.metadata["source"]["tp_world_size"] == 2
        assert a.metadata["source"]["dp_world_size"] == 2


@pytest.mark.parametrize(("tp", "stage"), [d for degrees in AUTOTP_RESUMES.values()
                                           for d in degrees])
def test_autotp_resumes_at_other_degrees(ds_run: Path, results: dict[str, Any], tp: int,
                                         stage: int) -> None:
    """Loaded at TP 2 x DP 1, TP 1 x DP 2 and on 1 rank, under other ZeRO stages, and
    saved again: the same arrays; the next two steps give the uninterrupted run's losses
    (the second after an optimizer step from the loaded state)."""
    name = autotp_name(tp, stage)
    assert results["checks"][name] == []
    assert array_differences(ds_run / "ucp" / AUTOTP, ds_run / "resaved" / name) == []
    want = results["losses"][f"{AUTOTP} rank0"]
    got = results["losses"][f"{name} rank0"]
    assert len(got) == len(want) == len(AUTOTP_AFTER)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)


def test_autotp_uneven_split_is_refused(results: dict[str, Any]) -> None:
    """A vocabulary of 97 rows that AutoTP splits 49 + 48 over 2 ranks: UCP's layout
    semantics split evenly, so the save names lm_head.weight and commits nothing."""
    assert results["checks"]["refuse an uneven AutoTP split"] == []

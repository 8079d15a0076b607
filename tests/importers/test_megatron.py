"""Megatron-LM legacy per-rank checkpoints -> UCP, through the megatron-gpt rule file.

megatron-core 0.16.1 GPT models (fused grouped-query QKV, SwiGLU, padded vocabulary)
run on gloo with TP=2 x PP=2 and TP=2, and their ranks' state dicts are saved as
Megatron-LM's legacy ``--ckpt-format torch`` save writes them (megatron-core's pip
package does not ship that writer). A TP=1 model loaded from the consolidated UCP
checkpoint gives the TP=2 model's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.importers.conftest import assert_same, cached_framework_run
from ucpformat import importers
from ucpformat.distributed.framework import ModelLayout
from ucpformat.layout.rank_slices import ParallelConfig, RankCoords
from ucpformat.layout.rules import RuleSet

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="session")
def meg_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_framework_run(tmp_path_factory, "megatron")


def test_tp1_model_from_ucp_gives_the_tp2_logits(meg_runs: Path) -> None:
    tp2 = torch.load(meg_runs / "tp2-logits.pt", weights_only=True)
    tp1 = torch.load(meg_runs / "tp1-logits.pt", weights_only=True)
    assert tp2.shape == (1, 8, 100)
    torch.testing.assert_close(tp1, tp2, rtol=1e-5, atol=1e-5)
    assert ucpformat.validate(meg_runs / "tp2.ucp", deep=True).valid


def _local(path: Path) -> dict[str, Any]:
    state = torch.load(path, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def test_tp2_pp2_round_trips_to_every_rank(meg_runs: Path, tmp_path: Path) -> None:
    src = meg_runs / "tp2-pp2"
    assert importers.detect(src) == "megatron"
    result = importers.convert(src, tmp_path / "ckpt", durable=False)
    assert any("optimizer" in n for n in result.notes)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ucpformat.validate(tmp_path / "ckpt", deep=True).valid
    assert ckpt.values("training") == {"step": 10}
    qkv = ckpt.tensor("model", "decoder.layers.3.self_attention.linear_qkv.weight")
    assert qkv.shape == (96, 64)
    assert qkv.attributes["layout"]["groups"] == 2
    assert qkv.attributes["layout"]["layer"] == 3  # stage-local layer 1 of stage 1
    assert ckpt.tensor("model", "embedding.word_embeddings.weight").shape == (100, 64)
    params = ckpt.metadata["source"]["rule_params"]
    cfg = ParallelConfig(tp=2, pp=2, num_layers=4)
    layout = ModelLayout(RuleSet.load("megatron-gpt"), params, cfg)
    for t in range(2):
        for p in range(2):
            want = _local(src / "iter_0000010" / f"mp_rank_{t:02d}_{p:03d}" /
                          "model_optim_rng.pt")
            got = layout.local_state(ckpt, cfg.rank(RankCoords(tp=t, pp=p)))
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                    # vocabulary padding is not stored (R113): loaders fill it with zeros
                    rows = 100 - t * value.shape[0]
                    keep = max(0, min(value.shape[0], rows))
                    assert_same(got[name][:keep], value[:keep], name)
                    assert not np.any(got[name][keep:])
                else:
                    assert_same(got[name], value, f"tp{t} pp{p} {name}")


def test_a_rule_file_that_does_not_fit_is_refused(meg_runs: Path, tmp_path: Path) -> None:
    with pytest.raises(ucpformat.errors.LayoutError):
        importers.convert(meg_runs / "tp2", tmp_path / "ckpt",
                          rule_params={"num_query_groups": 3})

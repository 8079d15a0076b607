"""megatron-core 0.16.1 saving through ``ucpformat.megatron`` and loading at other layouts.

Three session-wide jobs (tests/megatron/jobs.py, about 2 minutes) save a GPT at TP2 x PP2 on 4
gloo ranks with both the ``ucp`` and the ``torch_dist`` strategy, and loads each at
TP1 (1 rank), TP2 (2 ranks) and TP4 (4 ranks); these tests compare what the two
strategies gave. Vocabulary padding rows are not stored by UCP (UCP-1.0-R113): they load
as zeros, while torch_dist gives back whatever the saving run had there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.errors import UCPError
from ucpformat.format import names

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

VOCAB_TENSORS = ("word_embeddings.weight", "output_layer.weight")


def _results(meg: Path, name: str) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(meg / "results" / name, weights_only=True)
    return out


def _assert_equal_but_padding(got: dict[str, Any], want: dict[str, Any], tp_rank: int,
                              what: str) -> None:
    """Bit-equal tensors, except the rows of this tensor-parallel rank's vocabulary
    shard past the real vocabulary: zeros in ``got``."""
    from tests.megatron.jobs import VOCAB

    assert sorted(got) == sorted(want), what
    for name, value in want.items():
        mine = got[name]
        assert mine.shape == value.shape and mine.dtype == value.dtype, f"{what} {name}"
        if name.endswith(VOCAB_TENSORS):
            rows = value.shape[0]
            keep = max(0, min(rows, VOCAB - tp_rank * rows))
            assert not mine[keep:].any(), f"{what} {name}: padding rows are not zeros"
            mine, value = mine[:keep], value[:keep]
        assert torch.equal(mine, value), f"{what} {name}: values differ"


@pytest.mark.parametrize(("name", "tp_rank"), [
    ("tp1-rank0.pt", 0),
    ("tp2-rank0.pt", 0), ("tp2-rank1.pt", 1),
    ("tp4-rank0.pt", 0), ("tp4-rank1.pt", 1), ("tp4-rank2.pt", 2), ("tp4-rank3.pt", 3),
])
def test_resharded_load_equals_torch_dist(meg: Path, name: str, tp_rank: int) -> None:
    """Parameters and the parameter-shaped optimizer states (the distributed optimizer's
    fully_reshardable names on save, the mixed-precision optimizer's on the UCP load)
    saved at TP2 x PP2, loaded at TP1/TP2/TP4; then the same logits."""
    record = _results(meg, name)
    ucp, dist = record["ucp"], record["dist"]
    assert len(dist) == 144  # 36 model tensors, 3 optimizer states of each
    _assert_equal_but_padding(ucp, dist, tp_rank, name)
    assert torch.equal(record["logits-ucp"], record["logits-dist"])


def test_load_plain_tensors_gives_megatron_global_tensors(meg: Path) -> None:
    record = _results(meg, "tp1-rank0.pt")
    _assert_equal_but_padding(record["plain-ucp"], record["plain-dist"], 0, "plain")
    assert record["plain-ucp"]["decoder.layers.self_attention.linear_qkv.weight"].shape == (
        4, 128, 64)


@pytest.mark.parametrize("rank", range(4))
def test_reader_contract_gives_megatrons_tp4_tensors(meg: Path, rank: int) -> None:
    """The layout-aware reader contract, from the stored layout semantics alone, gives
    each TP4 rank what Megatron's own load gave it."""
    record = _results(meg, f"tp4-rank{rank}.pt")
    contract = record["contract"]
    assert len(contract) == 36
    _assert_equal_but_padding(contract, {k: record["ucp"][k] for k in contract}, rank,
                              "contract")


def test_moe_saved_at_ep2_loads_at_ep1(meg: Path) -> None:
    record = _results(meg, "moe-ep1.pt")
    assert any(".experts." in k for k in record["dist"])
    _assert_equal_but_padding(record["ucp"], record["dist"], 0, "moe")
    assert torch.equal(record["logits-ucp"], record["logits-dist"])
    ckpt = ucpformat.open(meg / "moe.ucp")
    for expert in range(4):
        name = f"decoder.layers.1.mlp.experts.experts.{expert}.linear_fc1.weight"
        layout = ckpt.tensor("model", name).attributes["layout"]
        assert layout["expert"] == expert and layout["layer"] == 1, name


def _same(got: Any, want: Any, where: str = "") -> None:
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}/{i}")
    else:
        assert got == want, where


def test_sharded_objects_come_back_as_saved(meg: Path) -> None:
    """RNG-state ShardedObjects (tuples, numpy and torch tensors, inf) are JSON values and
    arrays in the checkpoint, and load back equal, tuples as tuples."""
    from tests.megatron.jobs import rng_data

    got = torch.load(meg / "results" / "objects.pt", weights_only=False)
    assert got["keys"] == [f"rng_state/shard_{p}.{t}_2.2" for p in (0, 1) for t in (0, 1)]
    for key in got["keys"]:
        pp, tp = (int(i) for i in key.split("_")[-2].split("."))
        _same(got["objects"][key], rng_data(pp, tp), key)
    ckpt = ucpformat.open(meg / "dense.ucp")
    values = ckpt.values("training/sharded_objects")
    assert values["rng_state/shard_1.0_2.2"][0]["note"] == "pp1 tp0"
    assert values["rng_state/shard_1.0_2.2"][0]["torch_rng_state"] is None  # an array
    array = "training/sharded_objects/" + names.escape(
        "rng_state/shard_1.0_2.2/0/torch_rng_state")
    assert ckpt.arrays[array].attributes["megatron"] == {
        "object": "rng_state/shard_1.0_2.2", "pointer": "/0/torch_rng_state", "kind": "torch"}


def test_layout_semantics_are_written(meg: Path) -> None:
    ckpt = ucpformat.open(meg / "dense.ucp")
    qkv = ckpt.tensor("model", "decoder.layers.3.self_attention.linear_qkv.weight")
    assert qkv.shape == (128, 64)
    layout = qkv.attributes["layout"]
    assert layout["groups"] == 4 and layout["layer"] == 3
    assert [p["name"] for p in layout["parts"]] == ["q", "k", "v"]
    fc1 = ckpt.tensor("model", "decoder.layers.0.mlp.linear_fc1.weight").attributes["layout"]
    assert [p["name"] for p in fc1["parts"]] == ["gate", "up"]
    emb = ckpt.tensor("model", "embedding.word_embeddings.weight")
    assert emb.shape == (100, 64) and emb.attributes["layout"]["vocab"] == {"dim": 0}
    assert ckpt.arrays["optimizer/state/embedding.word_embeddings.weight/exp_avg"].shape == (
        100, 64)
    assert ckpt.metadata["megatron"]["rule_params"]["num_query_groups"] == 4


def test_only_megatrons_own_files_beside_the_checkpoint(meg: Path) -> None:
    """No per-object torch.save files: Megatron's common.pt and metadata.json only."""
    for name in ("dense.ucp", "moe.ucp"):
        top = {p.name for p in (meg / name).iterdir()} - {"model", "optimizer", "training"}
        assert top == {"common.pt", "manifest.ucp.json", "metadata.json", "zarr.json"}, name
        assert not [p for p in (meg / name).rglob("*") if p.suffix in (".pt", ".distcp")
                    and p.name != "common.pt"], name
        assert json.loads((meg / name / "metadata.json").read_text())[
            "sharded_backend"] == "ucp"


@pytest.mark.parametrize("name", ["dense.ucp", "moe.ucp"])
def test_validates_deep_with_megatrons_files_present(meg: Path, name: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "ucpformat.cli", "validate", "--deep",
                           str(meg / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid:" in proc.stdout + proc.stderr


def test_a_sharded_object_that_is_not_json_is_refused_by_name(meg: Path) -> None:
    """Rank 1 holds ShardedObject 'extra_state' with an object() in it: every rank
    raises, rank 1 naming the key, and nothing is committed: no checkpoint in a new
    directory, the committed one being replaced left as it was."""
    reports = [json.loads((meg / "results" / f"refused-{r}.json").read_text())
               for r in range(4)]
    for case in ("bad-new", "bad-replace"):
        assert reports[1][case].startswith("InvalidValueError")
        assert "'extra_state/shard_0_1'" in reports[1][case]
        assert "allow_opaque" in reports[1][case]
        for r in (0, 2, 3):
            assert reports[r][case].startswith("WriteError"), reports[r][case]
            assert "rank 1" in reports[r][case] and "nothing was committed" in reports[r][case]
    with pytest.raises(UCPError):
        ucpformat.open(meg / "bad-new")
    assert not (meg / "bad-new" / "zarr.json").exists()
    assert ucpformat.validate(meg / "bad-replace", deep=True).valid
    before = ucpformat.open(meg / "bad-replace")
    same = ucpformat.open(meg / "dense.ucp")
    name = "decoder.layers.2.self_attention.linear_qkv.weight"
    assert np.array_equal(before.tensor("model", name).read(), same.tensor("model", name).read())
    assert "extra_state/shard_0_1" not in before.values("training/sharded_objects")


def test_an_opaque_object_is_stored_and_loaded_only_when_opted_in(meg: Path) -> None:
    """With allow_opaque, the same kind of object is torch.save bytes in the extension
    group megatron_opaque: the checkpoint validates, and loading needs the opt-in too."""
    from tests.megatron.jobs import OPAQUE_VALUE

    ckpt = ucpformat.open(meg / "opaque")
    (path,) = [p for p in ckpt.arrays if p.startswith("megatron_opaque/")]
    assert ckpt.arrays[path].attributes["megatron"]["opaque"] == "torch.save"
    assert ucpformat.validate(meg / "opaque", deep=True).valid
    loaded = json.loads((meg / "results" / "opaque.json").read_text())
    assert loaded["False"].startswith("LoadError") and "allow_opaque=True" in loaded["False"]
    assert "'extra_state/shard_0_1'" in loaded["False"]
    assert loaded["True"] == repr(OPAQUE_VALUE)

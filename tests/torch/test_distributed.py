"""Collective save and load with torch.distributed (gloo, CPU): N ranks -> M ranks.

Three multi-process runs share the checkpoints they write, in order: 2 ranks save FSDP2
and TP checkpoints (and load one written by a single process); 4 ranks load them into
FSDP2 (2 -> 4), TP (2 -> 4), save FSDP2 x TP on a 2x2 mesh and load it into FSDP2 on 4
(TP 1 x FSDP 4), load model-only, save FSDP2 on 4 with uneven and empty shards, load it
into HSDP; 2 ranks load that (4 -> 2), reading only about their half, and save
asynchronously while training goes on; a copy of a checkpoint with an object that only
rank 1 reads damaged (or missing) fails on both ranks and changes nothing on either.
This process finally loads a distributed checkpoint with the single-process API. Every
check is bit for bit against the consolidated arrays (see dist_workers.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import numpy as np  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from tests.torch import dist_workers as w  # noqa: E402
from ucpformat.torch.launch import spawn  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
]


def _raw(t: Any) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def test_n_to_m_ranks_any_layout(tmp_path: Path) -> None:
    root = str(tmp_path)
    single_state = w.save_single(tmp_path / "single")

    two = spawn(w.save_two, 2, root, timeout=240)
    for rank in range(2):
        assert set(two[rank]) == {"save fsdp2", "save tp2", "single -> fsdp2"}
        assert all(v["checked"] > 10 for v in two[rank].values())

    four = spawn(w.load_four, 4, root, timeout=300)
    expected = {
        "fsdp2 -> fsdp4", "tp2 -> tp4", "save 2x2", "2x2 -> fsdp4",
        "2x2 -> fsdp4 model only", "save fsdp4", "fsdp4 -> hsdp2x2", "save hsdp",
    }
    for rank in range(4):
        assert set(four[rank]) == expected, four[rank]
        # every DTensor (parameters, Adam moments) was described by its mesh
        for save in ("save 2x2", "save hsdp"):
            result = four[rank][save]
            assert result["on mesh"] == result["dtensors"] >= 8, four[rank]
    for rank in range(2):
        for save in ("save fsdp2", "save tp2"):
            result = two[rank][save]
            assert result["on mesh"] == result["dtensors"] >= 8, two[rank]

    back = spawn(w.load_two, 2, root, timeout=240)
    for rank in range(2):
        result = back[rank]
        assert "fsdp4 -> fsdp2" in result
        assert result["failed loads"] == ["crc", "missing"]
        assert result["failed in place"] == "named"
        # FSDP2 on 2 ranks needs about half of every sharded tensor: far less than all
        assert result["bytes_read"] < 0.8 * result["bytes_read_whole"], result
        assert "emb.weight" in result["mismatch"]

    # distributed -> single process, with the single-process API
    model = w.build("plain", seed=99)
    opt = w.make_optimizer(model, lr=0.5)
    loaded = ucpt.load(f"{root}/2x2", model=model, optimizer=opt)
    assert loaded.step == 2
    ck = ucpformat.open_checkpoint(f"{root}/2x2")
    for fqn, value in model.state_dict().items():
        assert np.array_equal(ck.tensor("model", fqn).read(), value.numpy()), fqn
    state = ucpt.read_optimizer_state(f"{root}/2x2")
    for fqn, entry in state["state"].items():
        live = opt.state[model.get_parameter(fqn)]
        for name, value in entry.items():
            assert _raw(live[name]) == _raw(value), (fqn, name)
    assert opt.param_groups[0]["lr"] == w.LR

    # the single-process checkpoint that the 2-rank run loaded is what the model held
    ck = ucpformat.open_checkpoint(f"{root}/single")
    for fqn, value in single_state.items():
        assert np.array_equal(ck.tensor("model", fqn).read(), value.numpy()), fqn


def test_pipeline_stages_on_slices_of_one_mesh(tmp_path: Path) -> None:
    """Stages hold their own layers on the data-parallel slices of a (pp, dp) mesh:
    the slices lifted to the root would disagree on its tensors, so the save describes
    them by boxes (every rank agrees on that first) and keeps both stages."""
    out = spawn(w.save_pipeline_stages, 4, str(tmp_path), timeout=240)
    assert sorted(r["stage"] for r in out) == [0, 0, 1, 1]
    assert all(r["on mesh"] == 0 for r in out), out
    ckpt = ucpformat.open_checkpoint(tmp_path / "pp")
    for stage in (0, 1):
        expected = np.arange(24, dtype=np.float32).reshape(6, 4) + 100 * stage
        assert np.array_equal(ckpt.tensor("model", f"stage{stage}").read(), expected)


def test_fsdp2_and_tp_built_on_meta(tmp_path: Path) -> None:
    """Refused without assign; to_empty + load, and assign=True, load bit for bit."""
    out = spawn(w.meta_loads, 2, str(tmp_path), timeout=240)
    for rank in range(2):
        assert set(out[rank]) == {"fsdp meta + to_empty", "fsdp meta + assign",
                                  "tp meta + assign", "2x2 meta + assign"}, out[rank]
        assert all(v["checked"] >= 8 for v in out[rank].values()), out[rank]


def test_load_distributed_in_one_process(tmp_path: Path) -> None:
    """Without torch.distributed, save_distributed / load_distributed act as one rank."""
    assert not dist.is_initialized()
    model = w.build("plain")
    opt = w.make_optimizer(model)
    w.train(model, opt, 2)
    ucpt.save_distributed(tmp_path / "c", model=model, optimizer=opt, step=2)
    other = w.build("plain", seed=5)
    other_opt = w.make_optimizer(other, lr=0.5)
    result = ucpt.load_distributed(tmp_path / "c", model=other, optimizer=other_opt)
    assert result.step == 2
    for (k, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(),
                              strict=True):
        assert _raw(a) == _raw(b), k
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert _raw(opt.state[p][name]) == _raw(other_opt.state[q][name])
    assert other_opt.param_groups[0]["lr"] == w.LR
    # and the single-process loader reads it the same way
    third = w.build("plain", seed=6)
    ucpt.load(tmp_path / "c", model=third)
    for (k, a), (_, b) in zip(model.state_dict().items(), third.state_dict().items(),
                              strict=True):
        assert _raw(a) == _raw(b), k

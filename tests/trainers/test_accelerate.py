"""Accelerate's save_state / load_state through UCP (ucpformat.trainers.accelerate).

Four launches of tests/trainers/accelerate_worker.py: 4 epochs on one process, under DDP
and under FSDP2 on 2 gloo processes, each saving after epoch 2; new processes resume
(losses bit-equal to the runs that did not stop) and load the other world size's
checkpoint (2 -> 1 and 1 -> 2: values equal to the state gathered at the save).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("accelerate")

import ucpformat
from tests.trainers.launch import launch
from ucpformat.errors import ShapeMismatchError

pytestmark = [pytest.mark.torch, pytest.mark.distributed]
WORKER = "tests.trainers.accelerate_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("accelerate")
    launch(WORKER, ["single_full", str(root)], root, 1, "single_full")
    launch(WORKER, ["ddp_full,fsdp_full", str(root)], root, 2, "full")
    launch(WORKER, ["single_resume,single_gather", str(root)], root, 1, "single_resume")
    launch(WORKER, ["ddp_resume,fsdp_resume,fsdp_gather", str(root)], root, 2, "resume")
    yield root


@pytest.mark.parametrize(("layout", "ranks"), [("single", 1), ("ddp", 2), ("fsdp", 2)])
def test_resume_is_bit_equal(runs: Path, layout: str, ranks: int) -> None:
    for rank in range(ranks):
        full = json.loads((runs / f"{layout}_full-{rank}.json").read_text())["losses"]
        resumed = json.loads((runs / f"{layout}_resume-{rank}.json").read_text())["losses"]
        assert len(resumed) == len(full) // 2 > 0
        assert resumed == full[len(full) // 2:]


@pytest.mark.parametrize(("saved", "loaded"), [("fsdp", "single"), ("single", "fsdp")])
def test_universal_load_holds_the_gathered_state(runs: Path, saved: str, loaded: str) -> None:
    with np.load(runs / f"{saved}_saved.npz") as want, \
            np.load(runs / f"{loaded}_gathered.npz") as got:
        assert sorted(want.files) == sorted(got.files)
        assert any(k.endswith("exp_avg_sq") for k in want.files)
        for key in want.files:
            assert np.array_equal(want[key], got[key]), key


@pytest.mark.parametrize(("layout", "ranks"), [("single", 1), ("ddp", 2), ("fsdp", 2)])
def test_checkpoint_validates_deep_and_holds_everything(runs: Path, layout: str,
                                                        ranks: int) -> None:
    path = runs / layout / "epoch-2"
    report = ucpformat.validate(path, deep=True)
    assert not report.issues, report.issues
    with ucpformat.open(path) as ckpt:
        training = ckpt.to_dict("training")
        assert training["step"] == 0  # no gradient accumulation
        assert sorted(training["ranks"]) == [*(str(r) for r in range(ranks)), "world_size"]
        # Accelerate steps a prepared scheduler once per process per call
        assert training["scheduler"]["last_epoch"] == 2 * ranks
        if ranks > 1:  # Accelerate shuffles with a generator of its own when distributed
            assert training["dataloaders"]["0"]["generator"].dtype == np.uint8


def test_another_model_is_refused_before_anything_changes(runs: Path) -> None:
    import torch

    from tests.trainers.accelerate_worker import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator, model, optimizer, _, scheduler = build("single", width=12)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        sched_before = scheduler.state_dict()
        with pytest.raises(ShapeMismatchError, match=r"model/0\.(weight|bias)"):
            accelerator.load_state(str(runs / "single" / "epoch-2"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scheduler.state_dict() == sched_before and optimizer.state_dict()["state"] == {}

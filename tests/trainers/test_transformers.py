"""The Hugging Face Trainer saves and resumes UCP (ucpformat.trainers.transformers).

Two runs of tests/trainers/hf_worker.py: 12 steps saving every 3 (two kept), then a new
process resumes the mid-epoch checkpoint-9: losses and final parameters bit-equal.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import ucpformat
from tests.trainers.launch import launch
from ucpformat.errors import ShapeMismatchError

pytestmark = [pytest.mark.torch]
WORKER = "tests.trainers.hf_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("hf")
    launch(WORKER, ["full", str(root)], root, 1, "full")
    launch(WORKER, ["resume", str(root)], root, 1, "resume")
    yield root


def test_resume_is_bit_equal(runs: Path) -> None:
    full = json.loads((runs / "full.json").read_text())
    resumed = json.loads((runs / "resume.json").read_text())
    assert len(full["losses"]) == 12 and resumed["step"] == 12
    assert resumed["losses"] == full["losses"][9:]  # mid-epoch: order and dropout restored
    assert resumed["params"] == full["params"]


def test_checkpoints_are_ucp_alone_and_rotated(runs: Path) -> None:
    assert sorted(p.name for p in (runs / "full").iterdir()) == ["checkpoint-12",
                                                               "checkpoint-9"]
    for path in [*(runs / "full").iterdir(), *(runs / "resume").iterdir()]:
        report = ucpformat.validate(path, deep=True)
        assert not report.issues, (path, report.issues)
        assert sorted(p.name for p in path.iterdir()) == [
            "manifest.ucp.json", "model", "optimizer", "training", "zarr.json"]
    with ucpformat.open(runs / "full" / "checkpoint-9") as ckpt:
        training = ckpt.to_dict("training")
        assert training["step"] == 9 and "last_epoch" in training["scheduler"]
        state = dict(training["trainer_state"])
        assert state["global_step"] == 9 and len(state["log_history"]) == 9
        assert sorted(training["ranks"]) == ["0", "world_size"]


def test_another_model_is_refused_before_anything_changes(runs: Path, tmp_path: Path) -> None:
    import torch

    from tests.trainers.hf_worker import make

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make(tmp_path / "other", width=12)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        with pytest.raises(ShapeMismatchError, match=r"model/up\.(weight|bias)"):
            trainer.train(resume_from_checkpoint=str(runs / "full" / "checkpoint-9"))
    assert trainer.state.global_step == 0 and trainer.losses == []
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())

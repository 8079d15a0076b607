"""Lightning saves and resumes UCP (ucpformat.trainers.lightning).

Four launches of tests/trainers/lightning_worker.py: 4 epochs on one device and on 2 gloo
processes (DDP with the CheckpointIO, and FSDP2 under UCPModelParallelStrategy), each
saving every epoch; then each resumes its epoch-2 checkpoint in a new process (losses
bit-equal to the run that did not stop) and resumes another kind's (2 ranks -> 1 and
1 -> 2: the values it holds equal to the state gathered when that checkpoint was saved).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lightning")

import ucpformat
from tests.trainers.launch import launch
from ucpformat.errors import ShapeMismatchError
from ucpformat.trainers.common import UntestedVersionWarning, check_version

pytestmark = [pytest.mark.torch, pytest.mark.distributed]
WORKER = "tests.trainers.lightning_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("lightning")
    launch(WORKER, ["single_full", str(root)], root, 1, "single_full")
    launch(WORKER, ["mp_full,ddp_full", str(root)], root, 2, "mp_full")
    launch(WORKER, ["single_resume,single_gather,single_gatherddp", str(root)], root, 1,
           "single_resume")
    launch(WORKER, ["mp_resume,mp_gather,ddp_resume", str(root)], root, 2, "mp_resume")
    yield root


def _losses(root: Path, name: str, rank: int = 0) -> list[float]:
    return list(json.loads((root / f"{name}-{rank}.json").read_text())["losses"])


@pytest.mark.parametrize(("kind", "ranks"), [("single", 1), ("ddp", 2), ("mp", 2)])
def test_resume_is_bit_equal(runs: Path, kind: str, ranks: int) -> None:
    for rank in range(ranks):
        full = _losses(runs, f"{kind}_full", rank)
        resumed = _losses(runs, f"{kind}_resume", rank)
        assert len(resumed) == len(full) // 2 > 0
        assert resumed == full[len(full) // 2:]  # exact floats: dropout and order restored


@pytest.mark.parametrize(("saved", "loaded"), [("mp", "single"), ("single", "mp"),
                                               ("ddp", "single")])
def test_universal_resume_holds_the_gathered_state(runs: Path, saved: str, loaded: str
                                                   ) -> None:
    with np.load(runs / f"{saved}_epoch2.npz") as want, \
            np.load(runs / f"{loaded}_gathered_{saved}.npz") as got:
        assert sorted(want.files) == sorted(got.files)
        assert any(k.endswith("exp_avg") for k in want.files)
        for key in want.files:
            assert np.array_equal(want[key], got[key]), key


@pytest.mark.parametrize("kind", ["single", "ddp", "mp"])
def test_top_k_last_and_removal(runs: Path, kind: str) -> None:
    best = runs / kind / "best"
    kept = sorted(p.name for p in best.iterdir())
    assert len(kept) == 3 and "last.ckpt" in kept, kept  # 2 best of 4 and last.ckpt
    assert sorted(p.name for p in (runs / kind / "every").iterdir()) == [
        f"epoch={e}.ckpt" for e in range(4)]
    with ucpformat.open(best / "last.ckpt") as ckpt:
        training = ckpt.to_dict("training")
        assert training["step"] == 16 // (1 if kind == "single" else 2)
        assert sorted(training["ranks"]) == (["0"] if kind == "single" else ["0", "1"]) + [
            "world_size"]
        assert {"model", "optimizer", "training"} <= set(ckpt.groups)


def test_every_checkpoint_validates_deep(runs: Path) -> None:
    paths = sorted(runs.glob("*/*/*.ckpt"))
    assert len(paths) == 21
    for path in paths:
        report = ucpformat.validate(path, deep=True)
        assert not report.issues, (path, report.issues)


def test_another_model_is_refused_before_anything_changes(runs: Path, tmp_path: Path) -> None:
    import lightning as L
    import torch

    from tests.trainers.lightning_worker import Net, data
    from ucpformat.trainers.lightning import UCPCheckpointing

    net = Net(width=12)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, logger=False,
                            default_root_dir=tmp_path,
                            callbacks=[UCPCheckpointing()], enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0)
        with pytest.raises(ShapeMismatchError, match=r"model/layers\.0\.(weight|bias)"):
            trainer.fit(net, train_dataloaders=data(),
                        ckpt_path=runs / "single" / "every" / "epoch=1.ckpt")
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_untested_version_is_named() -> None:
    with pytest.warns(UntestedVersionWarning, match=r"lightning 3\.0\.1 .*2\.6 to 2\.6"):
        check_version("lightning", "3.0.1", ((2, 6), (2, 6)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_version("lightning", "2.6.6", ((2, 6), (2, 6)))



"""torchtitan's checkpoint manager saves and loads UCP (ucpformat.trainers.torchtitan).

Four launches of tests/trainers/titan_worker.py: 8 steps and 4 steps on one process
(synchronous saves) and on 2 gloo processes (FSDP2, ``async_mode="async"``); new
processes resume the newest step folder the manager finds (losses bit-equal to the runs
that did not stop) and load step 4 of the other world size (values equal to the state
gathered at the save).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torchtitan")

import ucpformat
from tests.trainers.launch import launch

pytestmark = [pytest.mark.torch, pytest.mark.distributed]
WORKER = "tests.trainers.titan_worker"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("torchtitan")
    launch(WORKER, ["full,first", str(root), "disabled"], root, 1, "first-1")
    launch(WORKER, ["full,first", str(root), "async"], root, 2, "first-2")
    launch(WORKER, ["resume,gather", str(root), "disabled"], root, 1, "resume-1")
    launch(WORKER, ["resume,gather", str(root), "async"], root, 2, "resume-2")
    yield root


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_bit_equal(runs: Path, world: int) -> None:
    for rank in range(world):
        full = json.loads((runs / f"full_{world}-{rank}.json").read_text())["losses"]
        resumed = json.loads((runs / f"resume_{world}-{rank}.json").read_text())["losses"]
        assert len(full) == 8 and resumed == full[4:]


@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2)])
def test_universal_load_holds_the_gathered_state(runs: Path, saved: int, loaded: int) -> None:
    with np.load(runs / f"saved_{saved}.npz") as want, \
            np.load(runs / f"gathered_{loaded}.npz") as got:
        assert sorted(want.files) == sorted(got.files) and len(want.files) == 4
        for key in want.files:
            assert np.array_equal(want[key], got[key]), key


def test_step_folders_are_ucp_and_purged(runs: Path) -> None:
    # sync: keep_latest_k=3 deleted step-2 once step-8 was saved
    assert sorted(p.name for p in (runs / "run_1" / "checkpoint").iterdir()) == [
        "step-4", "step-6", "step-8"]
    paths = sorted(runs.glob("*/checkpoint/step-*"))
    assert len(paths) >= 12
    for path in paths:
        report = ucpformat.validate(path, deep=True)
        assert not report.issues, (path, report.issues)
    with ucpformat.open(runs / "run_2" / "checkpoint" / "step-4") as ckpt:
        assert {"model", "optimizer", "training"} <= set(ckpt.groups)
        training = ckpt.to_dict("training")
        assert training["train_state"]["step"] == 4
        assert sorted(training["train_state"]["rank_rng"]) == ["0", "1"]
        assert "0.weight" in ckpt.to_dict("model")


def test_another_model_and_pickled_bytes_are_refused(runs: Path, tmp_path: Path) -> None:
    import torch
    import torch.distributed as dist
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from tests.trainers.launch import free_port
    from ucpformat.errors import InvalidValueError, LoadError
    from ucpformat.trainers.torchtitan import UCPCheckpointManager

    class Bytes:
        def state_dict(self) -> dict[str, bytes]:
            return {"dp_rank_0": b"\x80\x04pickled"}

        def load_state_dict(self, state: dict[str, bytes]) -> None: ...

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.25), torch.nn.Linear(12, 4))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = OptimizersContainer(OptimizersContainer.Config(
            implementation="for-loop", param_groups=[ParamGroupConfig(
                pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})]),
            model_parts=[model])
        sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt,
                                                                   training_steps=8)
        opt_before = {k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in opt.state_dict().items()}
        manager = UCPCheckpointManager.Config(enable=True, folder="checkpoint").build(
            dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
            states={}, sd_adapter=None, base_folder=str(runs / "run_1"))
        with pytest.raises(LoadError, match=r"Size mismatch .* for 0\.(weight|bias)"):
            manager.load(step=4)
        manager.close()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        after = opt.state_dict()
        assert after.keys() == opt_before.keys()
        assert all(torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]
                   for k, v in opt_before.items())
        writer = UCPCheckpointManager.Config(enable=True, folder="checkpoint", interval=1).build(
            dataloader=Bytes(), model_parts=[model], optimizers=opt, lr_schedulers=sched,
            states={}, sd_adapter=None, base_folder=str(tmp_path))
        with pytest.raises(InvalidValueError, match=r"dataloader\.dp_rank_0.*no pickle"):
            writer.save(2)
        writer.close()
        assert not (tmp_path / "checkpoint" / "step-2" / "zarr.json").exists()
    finally:
        if started:
            dist.destroy_process_group()

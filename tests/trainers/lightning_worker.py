"""One rank of the Lightning tests: ``python -m tests.trainers.lightning_worker <scenario>
<root>`` (run by tests/trainers/test_lightning.py; several ranks: torchrun's variables).

A tiny model with dropout on shuffled data trains 4 epochs (Adam, StepLR), a
``ModelCheckpoint`` keeping the best 2 and ``last.ckpt`` and another one every epoch;
every rank records its losses in ``<root>/<scenario>-<rank>.json``. Several scenarios
(comma-separated) run one after the other in one process. ``*_resume``
scenarios resume from the epoch-2 checkpoint; ``*_gather`` ones resume a checkpoint of
the other kind (``*_gather<kind>``: of that kind) with nothing left to train and write the
full state they hold. Kinds: ``single`` (one device), ``ddp`` (DDP, the ``CheckpointIO``),
``mp`` (FSDP2 under ``UCPModelParallelStrategy``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from tests.trainers.launch import finish  # noqa: E402
from ucpformat.trainers.lightning import (  # noqa: E402
    UCPCheckpointing,
    UCPModelParallelStrategy,
)

EPOCHS = 4


class Net(L.LightningModule):
    def __init__(self, parallel: bool = False, width: int = 16) -> None:
        super().__init__()
        self.parallel = parallel
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Dropout(0.25),
            torch.nn.Linear(width, 4))

    def configure_model(self) -> None:
        if self.parallel:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.layers[0], mesh=mesh)
            fully_shard(self.layers[3], mesh=mesh)
            fully_shard(self.layers, mesh=mesh)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layers(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)}


def data() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = torch.randn(32, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8,
                                       shuffle=True)


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def full_state(trainer: L.Trainer) -> dict[str, np.ndarray[Any, Any]]:
    """The gathered model and optimizer state (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = trainer.strategy.model
    opt = trainer.optimizers[0]
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    out = {f"model/{k}": v.detach().numpy().copy() for k, v in msd.items()}
    for fqn, entries in osd["state"].items():
        for name, value in entries.items():
            out[f"optimizer/state/{fqn}/{name}"] = value.detach().numpy().copy()
    return out


class Gather(Callback):
    """After epoch 2 (as its checkpoint is saved) or after a resume: the full state."""

    def __init__(self, root: Path, name: str, at_epoch: int | None) -> None:
        self.root, self.name, self.at_epoch = root, name, at_epoch

    def _dump(self, trainer: L.Trainer) -> None:
        state = full_state(trainer)
        if trainer.global_rank == 0:
            np.savez(self.root / f"{self.name}.npz", **state)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.at_epoch is not None and trainer.current_epoch == self.at_epoch:
            self._dump(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.at_epoch is None:
            self._dump(trainer)


def run(scenario: str, root: Path, world: int) -> None:
    kind, _, step = scenario.partition("_")
    parallel = kind == "mp"
    strategy: Any = (UCPModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
                     if parallel else "ddp" if kind == "ddp" else "auto")
    record = Record()
    callbacks: list[Callback] = [UCPCheckpointing(), record]
    ckpt_path = None
    epochs = EPOCHS
    if step == "full":
        callbacks += [
            Gather(root, f"{kind}_epoch2", at_epoch=1),
            ModelCheckpoint(dirpath=root / kind / "best", monitor="train_loss",
                            save_top_k=2, save_last=True, filename="{epoch}"),
            ModelCheckpoint(dirpath=root / kind / "every", save_top_k=-1, filename="{epoch}")]
    elif step == "resume":
        ckpt_path = root / kind / "every" / "epoch=1.ckpt"
    elif step.startswith("gather"):  # another kind's checkpoint, nothing left to train
        other = step.removeprefix("gather") or ("single" if parallel else "mp")
        ckpt_path = root / other / "every" / "epoch=1.ckpt"
        callbacks.append(Gather(root, f"{kind}_gathered_{other}", at_epoch=None))
        epochs = 2
    L.seed_everything(7, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs,
        callbacks=callbacks, logger=False, default_root_dir=root / f"{scenario}-root",
        enable_checkpointing=step == "full", enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    trainer.fit(Net(parallel=parallel), train_dataloaders=data(), ckpt_path=ckpt_path)
    (root / f"{scenario}-{trainer.global_rank}.json").write_text(
        json.dumps({"losses": record.losses, "epoch": trainer.current_epoch}))


def main() -> None:
    scenarios, root = sys.argv[1].split(","), Path(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    code = 0
    try:
        for scenario in scenarios:
            run(scenario, root, world)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


if __name__ == "__main__":
    main()

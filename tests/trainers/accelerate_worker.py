"""One rank of the Accelerate tests: ``python -m tests.trainers.accelerate_worker
<scenarios> <root>`` (run by tests/trainers/test_accelerate.py; several ranks:
torchrun's variables; scenarios comma-separated run one after the other).

``<layout>_full`` trains a tiny model with dropout on shuffled data for 4 epochs (Adam,
StepLR), saving with ``save_state`` after epoch 2 and writing the gathered state then;
``<layout>_resume`` loads that checkpoint in a new process and trains epochs 3-4;
``<layout>_gather`` loads the checkpoint of the other world size and writes the gathered
state it holds. Layouts: ``single`` (one process), ``ddp`` and ``fsdp`` (FSDP2 by
``fully_shard``). Losses go to ``<root>/<scenario>-<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

warnings.filterwarnings("ignore")

from tests.trainers.launch import finish  # noqa: E402
from ucpformat.trainers.accelerate import UCPAccelerator  # noqa: E402

EPOCHS, SAVED = 4, 2


def build(layout: str, width: int = 16) -> tuple[UCPAccelerator, Any, Any, Any, Any]:
    accelerator = UCPAccelerator(cpu=True)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                torch.nn.Dropout(0.25), torch.nn.Linear(width, 4))
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (accelerator.num_processes,))
        for sub in (model[0], model[3], model):
            fully_shard(sub, mesh=mesh)
        model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randn(32, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    if layout == "fsdp":
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                                  scheduler)
    return accelerator, model, optimizer, loader, scheduler


def gathered(accelerator: UCPAccelerator, model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    inner = accelerator.unwrap_model(model)
    opt = getattr(optimizer, "optimizer", optimizer)
    options = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v.detach().numpy().copy()
           for k, v in get_model_state_dict(inner, options=options).items()}
    osd = get_optimizer_state_dict(inner, opt, options=options)
    for fqn, entries in osd["state"].items():
        for name, value in entries.items():
            out[f"optimizer/state/{fqn}/{name}"] = value.detach().numpy().copy()
    return out


def run(scenario: str, root: Path) -> None:
    layout, _, step = scenario.partition("_")
    accelerator, model, optimizer, loader, scheduler = build(layout)
    losses: list[float] = []
    first = 0
    ckpt = root / layout / "epoch-2"
    if step in ("resume", "gather"):
        source = ckpt if step == "resume" else root / (
            "fsdp" if layout == "single" else "single") / "epoch-2"
        accelerator.load_state(str(source))
        first = SAVED
    if step == "gather":
        state = gathered(accelerator, model, optimizer)
        if accelerator.is_main_process:
            np.savez(root / f"{layout}_gathered.npz", **state)
        return
    for epoch in range(first, EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        scheduler.step()
        if step == "full" and epoch + 1 == SAVED:
            accelerator.save_state(str(ckpt))
            state = gathered(accelerator, model, optimizer)
            if accelerator.is_main_process:
                np.savez(root / f"{layout}_saved.npz", **state)
    (root / f"{scenario}-{accelerator.process_index}.json").write_text(
        json.dumps({"losses": losses}))


def main() -> None:
    scenarios, root = sys.argv[1].split(","), Path(sys.argv[2])
    code = 0
    try:
        for scenario in scenarios:
            run(scenario, root)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


if __name__ == "__main__":
    main()

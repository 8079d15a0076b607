"""One rank of the torchtitan tests: ``python -m tests.trainers.titan_worker <scenarios>
<root> <async_mode>`` (run by tests/trainers/test_torchtitan.py; torchrun's variables;
scenarios comma-separated run one after the other).

torchtitan's trainer does not run on CPU; its checkpoint manager does. A tiny model
(FSDP2 on 2 ranks) with dropout trains 8 steps on shuffled batches (torchtitan's
``OptimizersContainer`` "for-loop" AdamW and LR schedulers), ``UCPCheckpointManager``
saving every 2 steps (keeping 3) with the data position and every rank's generators in a
train state: ``full`` 8 steps, ``first`` 4; ``resume`` builds everything afresh,
``load()`` finds the newest step folder and trains on to 8; ``gather`` loads step 4 of
the other world size's run and writes the full state it holds.
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
import torch.distributed as dist

warnings.filterwarnings("ignore")

from tests.trainers.launch import finish  # noqa: E402

STEPS, SAVE_AT = 8, 4


class TrainState:
    """The step, the data generator and every rank's generators (tensors and JSON)."""

    def __init__(self, data: torch.Generator) -> None:
        self.step, self.data = 0, data

    def state_dict(self) -> dict[str, Any]:
        from ucpformat.trainers.common import gathered_rng

        # per-rank values are gathered and keyed by rank: DCP keeps one copy of a plain
        # tensor (a replica), so a rank's own value under one key would be lost
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.data.get_state().numpy())
        return {"step": self.step, "rank_rng": gathered_rng(),
                "data": {str(r): torch.from_numpy(s) for r, s in enumerate(everyone)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from ucpformat.trainers.common import set_own_rng

        self.step = int(state["step"])
        self.data.set_state(torch.as_tensor(state["data"][str(dist.get_rank())]).to(torch.uint8))
        rank = dist.get_rank() if dist.is_initialized() else 0
        set_own_rng(state["rank_rng"][str(rank)])


def run(scenario: str, root: Path, mode: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ucpformat.trainers.torchtitan import UCPCheckpointManager

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.25), torch.nn.Linear(16, 4))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for sub in (model[0], model[3], model):
            fully_shard(sub, mesh=mesh)
    opt = OptimizersContainer(OptimizersContainer.Config(
        implementation="for-loop", param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})]),
        model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt,
                                                               training_steps=STEPS)
    data = torch.Generator().manual_seed(rank)
    state = TrainState(data)
    folder = root / (f"full_{world}" if scenario == "full" else
                     f"run_{3 - world}" if scenario == "gather" else f"run_{world}")
    manager = UCPCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=2, keep_latest_k=3, async_mode=mode,
        # the generators of each rank depend on the world size: not loaded into another
        exclude_from_loading=["train_state"] if scenario == "gather" else []).build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched,
        states={"train_state": state}, sd_adapter=None, base_folder=str(folder))
    losses: list[float] = []
    if scenario == "resume":
        assert manager.load(), "no checkpoint found"
    if scenario == "gather":
        assert manager.load(step=SAVE_AT)
    else:
        last = SAVE_AT if scenario == "first" else STEPS
        while state.step < last:
            x = torch.randn(4, 8, generator=data)
            y = torch.randn(4, 4, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            state.step += 1
            losses.append(float(loss.detach()))
            manager.save(state.step)
        manager.maybe_wait_for_saving()
    manager.close()
    if scenario in ("first", "gather"):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            name = "saved" if scenario == "first" else "gathered"
            np.savez(root / f"{name}_{world}.npz", **{k: v.numpy() for k, v in full.items()})
    (root / f"{scenario}_{world}-{rank}.json").write_text(json.dumps({"losses": losses}))


def main() -> None:
    scenarios, root, mode = sys.argv[1].split(","), Path(sys.argv[2]), sys.argv[3]
    code = 0
    try:
        dist.init_process_group("gloo")
        for scenario in scenarios:
            run(scenario, root, mode)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


if __name__ == "__main__":
    main()

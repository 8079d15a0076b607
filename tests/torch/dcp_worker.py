"""One rank of the multi-process DCP plugin tests (run by tests/torch/test_dcp_plugin.py).

``python -m tests.torch.dcp_worker <scenario> <directory>`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Each scenario writes what the test checks under
``<directory>``: checkpoints, and from rank 0 the consolidated reference tensors as
``.npz`` files (keys are UCP node paths) and a ``<scenario>.json`` result.

Every rank ends with a barrier, ``destroy_process_group()``, flushed output and
``os._exit`` (torch 2.13 with gloo sometimes aborts at interpreter shutdown otherwise).
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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import ucpformat
from ucpformat.errors import UCPError
from ucpformat.torch.dcp import UCPReader, UCPWriter
from ucpformat.torch.numpy_bridge import to_numpy

warnings.filterwarnings("ignore")


class MLP(torch.nn.Module):
    """Uneven row counts: 10 rows split 5/5 on 2 ranks and 3/3/3/1 on 4; 5 rows 3/2, 2/2/1/0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 5)
        self.norm = torch.nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


def build_fsdp(seed: int, world: int, *, train: bool) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = MLP()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if train:
        torch.manual_seed(seed + 100)
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def build_tp(seed: int, world: int) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = MLP()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(seed + 100)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def full_state(model: torch.nn.Module, opt: Any) -> dict[str, np.ndarray[Any, Any]]:
    """The unsharded model and optimizer tensors (on rank 0), keyed by UCP node path."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    out = {f"model/{k}": to_numpy(v).copy() for k, v in msd.items()}
    for fqn, states in osd.get("state", {}).items():  # empty but on rank 0
        for name, v in states.items():
            out[f"optimizer/state/{fqn}/{name}"] = to_numpy(torch.as_tensor(v)).copy()
    return out


def save_npz(path: Path, arrays: dict[str, np.ndarray[Any, Any]]) -> None:
    np.savez(path, **arrays)


def scenario_save(root: Path, rank: int, world: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    # FSDP2, default planning: tensors this small are one shard each, whose owner
    # receives the other rank's rows (durable: the one save here that syncs its files)
    model, opt = build_fsdp(0, world, train=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 1},
             storage_writer=UCPWriter(root / "fsdp"))
    # the same state with shards on every chunk boundary: no data moves between ranks
    dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=root / "fsdp_aligned",
             storage_writer=UCPWriter(min_shard_bytes=0, durable=False))
    reference = full_state(model, opt)
    if rank == 0:
        save_npz(root / "fsdp_reference.npz", reference)

    # a failure in one rank's write_data (its storage fails): nothing is committed
    class FailingWriter(UCPWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kw: Any) -> None:
            super().set_up_storage_writer(is_coordinator, *args, **kw)
            store = self._store
            assert store is not None
            create = store.create  # stored objects are created, never replaced (R059)

            def failing_create(key: str, *a: Any, **k: Any) -> Any:
                if rank == 1 and "/c" in key:
                    raise OSError(28, "injected: no space left on device")
                return create(key, *a, **k)

            store.create = failing_create  # type: ignore[method-assign]

    failing = FailingWriter(root / "failed", durable=False)
    try:
        dcp.save({"model": msd, "optim": osd}, storage_writer=failing)
        result["failure_raised"] = False
    except BaseException as exc:  # DCP raises CheckpointException (a BaseException) everywhere
        result["failure_raised"] = True
        result["failure_message"] = str(exc)[-3000:]
    dist.barrier()
    if rank == 0:  # refused until the writer is reset, which removes the remains (R049)
        try:
            ucpformat.open(root / "failed")
            result["failed_refused_with"] = None
        except UCPError as exc:
            result["failed_refused_with"] = exc.rule
    dist.barrier()
    failing.reset()  # what DCP calls when the writer's next save begins
    dist.barrier()
    result["failed_files_after_reset"] = sorted(
        str(p.relative_to(root / "failed")) for p in (root / "failed").rglob("*")
        if not p.is_dir())

    # tensor parallel: colwise fc1, rowwise fc2
    tp_model, tp_opt = build_tp(0, world)
    tmsd, tosd = get_state_dict(tp_model, tp_opt)
    dcp.save({"model": tmsd, "optim": tosd}, storage_writer=UCPWriter(root / "tp", durable=False))
    tp_reference = full_state(tp_model, tp_opt)
    if rank == 0:
        save_npz(root / "tp_reference.npz", tp_reference)

    # a checkpoint of ucpformat.torch.save (single process) into an FSDP2 model
    model2, opt2 = build_fsdp(5, world, train=False)
    msd2, osd2 = get_state_dict(model2, opt2)
    sd2 = {"model": msd2, "optim": osd2}
    dcp.load(sd2, storage_reader=UCPReader(root / "single"))
    set_state_dict(model2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
    loaded = full_state(model2, opt2)
    if rank == 0:
        save_npz(root / "single_loaded.npz", loaded)
        result["single_param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in opt2.state_dict()["param_groups"]
        ]
    return result


def scenario_load(root: Path, rank: int, world: int) -> dict[str, Any]:
    model, opt = build_fsdp(7, world, train=True)  # other values, optimizer state exists
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 0}
    reader = UCPReader(root / "fsdp")
    dcp.load(sd, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loaded = full_state(model, opt)
    stats = reader.checkpoint.stats
    all_read = [0] * world
    dist.all_gather_object(all_read, stats.bytes_read)
    if rank == 0:
        save_npz(root / "fsdp_loaded4.npz", loaded)
    return {"step": sd["step"], "bytes_read": all_read}


def scenario_exchange_failure(root: Path, rank: int, world: int) -> dict[str, Any]:
    """Replace a checkpoint while rank 1's tensors cannot be read (its planner's
    resolve_data raises) after DCP has planned: the shards are assembled by owners from
    both ranks' rows, so rank 0 expects cells from rank 1."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    model, opt = build_fsdp(0, world, train=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd},
             storage_writer=UCPWriter(root / "replaced", durable=False))
    reference = full_state(model, opt)
    if rank == 0:
        save_npz(root / "replaced_reference.npz", reference)
        files = {str(p.relative_to(root / "replaced")): p.read_bytes().hex()
                 for p in sorted((root / "replaced").rglob("*")) if p.is_file()}
        (root / "replaced_files.json").write_text(json.dumps(files))
    dist.barrier()

    class UnreadablePlanner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if rank == 1 and write_item.type != WriteItemType.BYTE_IO:
                raise RuntimeError("injected: this rank's tensor could not be read")
            return super().resolve_data(write_item)

    other, other_opt = build_fsdp(1, world, train=True)
    msd2, osd2 = get_state_dict(other, other_opt)
    outcome: dict[str, Any] = {"rank": rank, "raised": False}
    try:
        dcp.save({"model": msd2, "optim": osd2}, planner=UnreadablePlanner(),
                 storage_writer=UCPWriter(root / "replaced", overwrite=True, durable=False))
    except BaseException as exc:  # DCP raises CheckpointException (a BaseException)
        outcome.update(raised=True, message=str(exc)[-3000:])
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, outcome)
    return {"outcomes": outcomes}


def main() -> None:
    scenario, root = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    code = 0
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {"save": scenario_save, "load": scenario_load,
                  "exchange_failure": scenario_exchange_failure}[scenario](root, rank, world)
        if rank == 0:
            (root / f"{scenario}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

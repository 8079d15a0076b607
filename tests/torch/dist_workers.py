"""Worker functions of the multi-process tests (run by ucpformat.torch.launch.spawn).

A tiny model with dimensions that no degree divides (11, 10, 5, 3 rows: uneven shards,
and empty ones on 4 ranks) is trained for two AdamW steps under one layout, saved, and
loaded under others. Every check compares, bit for bit, the full tensors of the live
(loaded or saved) state with the consolidated arrays of the checkpoint, read in one
process: saving must write the truth, loading must place exactly it.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import ucpformat
from ucpformat.torch.async_save import AsyncSaver
from ucpformat.torch.distributed import load_distributed, local_map_of, save_distributed

LR = 0.0123
WEIGHT_DECAY = 0.05


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 5)
        self.head = torch.nn.Linear(5, 3)
        self.register_buffer("scale", torch.tensor([1.5, 2.0]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = torch.relu(self.up(x))
        x = self.down(x) * self.scale[0]
        return self.head(x)


def build(layout: str, seed: int = 0) -> torch.nn.Module:
    """The model under a layout: plain, fsdp, tp, 2x2 (FSDP2 x TP) or hsdp."""
    torch.manual_seed(seed)
    model = Tiny()
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for sub in (model.up, model.down, model.head):
            fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, tp_plan)
    elif layout == "2x2":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif layout != "plain":
        raise ValueError(layout)
    return model


def make_optimizer(model: torch.nn.Module, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 11, (4, 3), generator=g)
        model(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _equal(a: np.ndarray[Any, Any], b: torch.Tensor, what: str) -> None:
    assert a.shape == tuple(b.shape), f"{what}: shape {a.shape} vs {tuple(b.shape)}"
    got = b.reshape(-1).contiguous().view(torch.uint8).numpy()
    want = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    assert np.array_equal(got, want), f"{what}: values differ"


def check_state(
    path: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer | None,
    *,
    lr: float = LR,
) -> dict[str, Any]:
    """Collective: the live state equals the checkpoint's arrays, bit for bit."""
    ck = ucpformat.open_checkpoint(path)
    msd = get_model_state_dict(model)
    count = 0
    for fqn in sorted(msd):
        _equal(ck.tensor("model", fqn).read(), _full(msd[fqn]), f"model/{fqn}")
        count += 1
    if opt is not None:
        osd = get_optimizer_state_dict(model, opt)
        for fqn in sorted(osd["state"]):
            for name in sorted(osd["state"][fqn]):
                value = osd["state"][fqn][name]
                _equal(ck.tensor("optimizer", "state", fqn, name).read(), _full(value),
                       f"optimizer/state/{fqn}/{name}")
                count += 1
        saved = ck.values("optimizer")["param_groups"]
        for group, saved_group in zip(opt.param_groups, saved, strict=True):
            assert math.isclose(group["lr"], lr, rel_tol=0, abs_tol=0), group["lr"]
            for key in ("lr", "weight_decay", "eps", "amsgrad"):
                assert group[key] == saved_group[key], key
            assert tuple(group["betas"]) == tuple(saved_group["betas"])
    return {"checked": count}


def described_on_mesh(save: Any) -> int:
    """Run ``save()``; how many tensors this rank described by their device mesh (the
    pipeline's describe step, observed) rather than by their fragments' boxes."""
    import ucpformat.distributed.pipeline as pipeline

    seen: list[int] = []
    real = pipeline.describe

    def spy(*args: Any, **kwargs: Any) -> dict[str, Any]:
        doc = real(*args, **kwargs)
        seen.append(len(doc["sharded"]))
        return doc

    pipeline.describe = spy  # type: ignore[assignment]
    try:
        save()
    finally:
        pipeline.describe = real  # type: ignore[assignment]
    assert len(seen) == 1, seen
    return seen[0]


def dtensor_count(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """The model's and optimizer's tensors that are DTensors (what a save describes by
    mesh; the rest, such as Adam's step counts, by boxes)."""
    osd = get_optimizer_state_dict(model, opt)
    values = [*get_model_state_dict(model).values(),
              *(v for entry in osd["state"].values() for v in entry.values())]
    return sum(isinstance(v, DTensor) for v in values)


def check_placements(model: torch.nn.Module, expect: dict[str, str]) -> None:
    """The layout really is what the test claims (placements by parameter)."""
    for fqn, text in expect.items():
        param = model.get_parameter(fqn)
        assert isinstance(param, DTensor), fqn
        got = ",".join(str(p) for p in param.placements)
        assert got == text, f"{fqn}: {got} != {text}"


# -- the scenarios ---------------------------------------------------------------------------


def save_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks: save FSDP2 and TP checkpoints; load a single-process one into FSDP2."""
    out: dict[str, Any] = {}
    for layout in ("fsdp", "tp"):
        model = build(layout)
        opt = make_optimizer(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
        train(model, opt, 2)
        sched.step()
        path = f"{root}/{layout}2"
        on_mesh = described_on_mesh(lambda: save_distributed(
            path, model=model, optimizer=opt, scheduler=sched, step=2))  # noqa: B023
        out[f"save {layout}2"] = {**check_state(path, model, opt), "on mesh": on_mesh,
                                  "dtensors": dtensor_count(model, opt)}
    model = build("fsdp", seed=7)
    opt = make_optimizer(model, lr=0.5)
    load_distributed(f"{root}/single", model=model, optimizer=opt)
    out["single -> fsdp2"] = check_state(f"{root}/single", model, opt)
    return out


def load_four(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 ranks: FSDP2 2->4, TP 2->4, FSDP2xTP 2x2 -> FSDP 4, save FSDP2 4, HSDP, model only."""
    out: dict[str, Any] = {}
    # FSDP2 2 -> 4, with the scheduler and step
    model = build("fsdp", seed=3)
    opt = make_optimizer(model, lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    result = load_distributed(f"{root}/fsdp2", model=model, optimizer=opt, scheduler=sched)
    assert result.step == 2 and sched.last_epoch == 1, (result.step, sched.last_epoch)
    out["fsdp2 -> fsdp4"] = check_state(f"{root}/fsdp2", model, opt)
    # TP 2 -> 4 (10 features on 4 ranks: 3, 3, 3, 1)
    model = build("tp", seed=3)
    check_placements(model, {"up.weight": "S(0)", "down.weight": "S(1)"})
    opt = make_optimizer(model, lr=0.5)
    load_distributed(f"{root}/tp2", model=model, optimizer=opt)
    out["tp2 -> tp4"] = check_state(f"{root}/tp2", model, opt)
    # FSDP2 x TP on a 2x2 mesh (strided shards, uneven) -> TP 1 x FSDP 4
    model = build("2x2")
    check_placements(model, {"up.weight": "_S(0, 2),S(0)", "down.weight": "S(0),S(1)"})
    opt = make_optimizer(model)
    train(model, opt, 2)
    on_mesh = described_on_mesh(lambda: save_distributed(
        f"{root}/2x2", model=model, optimizer=opt, step=2))
    out["save 2x2"] = {**check_state(f"{root}/2x2", model, opt), "on mesh": on_mesh,
                       "dtensors": dtensor_count(model, opt)}
    model = build("fsdp", seed=5)
    opt = make_optimizer(model, lr=0.5)
    load_distributed(f"{root}/2x2", model=model, optimizer=opt)
    out["2x2 -> fsdp4"] = check_state(f"{root}/2x2", model, opt)
    # model only
    model = build("fsdp", seed=6)
    load_distributed(f"{root}/2x2", model=model)
    out["2x2 -> fsdp4 model only"] = check_state(f"{root}/2x2", model, None)
    # FSDP2 on 4 ranks (5 rows: 2, 2, 1, 0), tiny chunks so that loads read slices
    model = build("fsdp")
    opt = make_optimizer(model)
    train(model, opt, 2)
    save_distributed(f"{root}/fsdp4", model=model, optimizer=opt, step=2, chunk_bytes=16)
    out["save fsdp4"] = check_state(f"{root}/fsdp4", model, opt)
    # HSDP (replicate 2 x shard 2)
    model = build("hsdp", seed=8)
    check_placements(model, {"up.weight": "R,S(0)"})
    opt = make_optimizer(model, lr=0.5)
    load_distributed(f"{root}/fsdp4", model=model, optimizer=opt)
    out["fsdp4 -> hsdp2x2"] = check_state(f"{root}/fsdp4", model, opt)
    # HSDP save: replicas are written once
    on_mesh = described_on_mesh(lambda: save_distributed(
        f"{root}/hsdp", model=model, optimizer=opt, step=2))
    out["save hsdp"] = {**check_state(f"{root}/hsdp", model, opt), "on mesh": on_mesh,
                        "dtensors": dtensor_count(model, opt)}
    return out


def load_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks: FSDP2 4 -> 2 reading only its half; async save while training goes on."""
    out: dict[str, Any] = {}
    model = build("fsdp", seed=4)
    opt = make_optimizer(model, lr=0.5)
    train(model, opt, 1, seed=3)  # the optimizer holds state before loading
    out["failed loads"] = failed_loads_change_nothing(rank, root, model, opt)
    out["failed in place"] = failed_in_place_load_says_what_changed(rank, root, model, opt)
    result = load_distributed(f"{root}/fsdp4", model=model, optimizer=opt)
    out["fsdp4 -> fsdp2"] = check_state(f"{root}/fsdp4", model, opt)
    ck = ucpformat.open_checkpoint(f"{root}/fsdp4")
    for tensor in ck.tensors():
        tensor.read()
    out["bytes_read"] = result.bytes_read
    out["bytes_read_whole"] = ck.stats.bytes_read
    # async: the checkpoint holds the state at the time of the call, not later updates
    saver = AsyncSaver()
    snapshot = {k: _full(v).clone() for k, v in sorted(get_model_state_dict(model).items())}
    future = saver.save(f"{root}/async", model=model, optimizer=opt, step=3)
    train(model, opt, 1, seed=9)  # modifies every parameter while the save may run
    saver.close()
    assert future.done()
    ck = ucpformat.open_checkpoint(f"{root}/async")
    for fqn, value in snapshot.items():
        _equal(ck.tensor("model", fqn).read(), value, f"async model/{fqn}")
    out["async"] = {"blocked_s": saver.last_blocked_s}
    # a mismatched model fails on every rank, without hanging
    torch.manual_seed(0)
    other = Tiny()
    other.emb = torch.nn.Embedding(12, 6)
    fully_shard(other)
    try:
        load_distributed(f"{root}/fsdp4", model=other)
    except ucpformat.errors.ShapeMismatchError as exc:
        out["mismatch"] = str(exc)
    else:
        raise AssertionError("a model of another shape loaded")
    return out


def _local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of every tensor of the model and the optimizer, as bytes."""
    def raw(t: torch.Tensor) -> bytes:
        local = (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous()
        return bytes(local.reshape(-1).view(torch.uint8).numpy())

    out: dict[str, Any] = {f"model/{k}": raw(v) for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        for name, value in state.items():
            out[f"optimizer/{i}/{name}"] = raw(value)
    out["lr"] = [g["lr"] for g in opt.param_groups]
    return out


def _rows_read(model: torch.nn.Module, fqn: str) -> tuple[int, int]:
    """The rows (dim 0) of parameter ``fqn`` this rank reads when loading."""
    lm = local_map_of(model.get_parameter(fqn), name=fqn)
    assert lm is not None
    rows = [piece.glob[0] for piece in lm.pieces]
    return min(a for a, _ in rows), max(b for _, b in rows)


def failed_loads_change_nothing(
    rank: int, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> list[str]:
    """Load copies of a checkpoint (stored in objects of 2 rows) in which an object only
    rank 1 reads is damaged or missing: rank 1 fails reading, rank 0 hears of it, and
    neither changes anything."""
    import ucpformat.torch as ucpt

    source = f"{root}/two-rows"
    if rank == 0:
        plain = build("plain", seed=7)
        plain_opt = make_optimizer(plain)
        train(plain, plain_opt, 1)
        ucpt.save(source, model=plain, optimizer=plain_opt, chunk_bytes=48, shard_bytes=48)
    dist.barrier()
    ranges = torch.zeros(2 * dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_into_tensor(ranges, torch.tensor(_rows_read(model, "emb.weight")))
    (lo0, hi0), (lo1, hi1) = ranges.view(-1, 2).tolist()
    meta = ucpformat.open_checkpoint(source).arrays["model/emb.weight"]
    rows, n = meta.object_shape[0], meta.shape[0]
    spans = [(k, k * rows, min((k + 1) * rows, n)) for k in range(-(-n // rows))]
    coords = next(k for k, a, b in spans if lo1 <= a and b <= hi1 and (b <= lo0 or a >= hi0))
    key = meta.object_key((coords, 0))
    done = []
    for damage in ("crc", "missing"):
        path = f"{root}/two-rows-{damage}"
        if rank == 0:
            shutil.copytree(source, path)
            target = Path(path) / key
            if damage == "crc":
                data = bytearray(target.read_bytes())
                data[0] ^= 0x01
                target.write_bytes(bytes(data))
            else:
                target.unlink()
        dist.barrier()
        before = _local_bytes(model, opt)
        try:
            load_distributed(path, model=model, optimizer=opt)
        except ucpformat.errors.UCPError as exc:
            if rank == 1:
                expected = {"crc": ("ChecksumError", "UCP-1.0-R041"),
                            "missing": ("MissingChunkError", "UCP-1.0-R031")}[damage]
                assert (type(exc).__name__, exc.rule) == expected, repr(exc)
                assert exc.tensor == "model/emb.weight", repr(exc)
            else:
                assert type(exc).__name__ == "LoadError" and "rank 1" in str(exc), repr(exc)
        else:
            raise AssertionError(f"a load of a checkpoint with a {damage} object succeeded")
        assert _local_bytes(model, opt) == before, f"{damage}: the state changed"
        done.append(damage)
    return done


def failed_in_place_load_says_what_changed(
    rank: int, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> str:
    """``in_place=True`` on the copy with a damaged object only rank 1 reads (made by
    :func:`failed_loads_change_nothing`): every rank raises, each saying that its own
    tensors were changed and naming them."""
    before = _local_bytes(model, opt)
    try:
        load_distributed(f"{root}/two-rows-crc", model=model, optimizer=opt, in_place=True)
    except ucpformat.errors.UCPError as exc:
        message = str(exc)
        if rank == 1:
            assert type(exc).__name__ == "ChecksumError", repr(exc)
            assert exc.tensor == "model/emb.weight", repr(exc)
        else:
            assert type(exc).__name__ == "LoadError" and "rank 1" in message, repr(exc)
    else:
        raise AssertionError("an in-place load of a damaged checkpoint succeeded")
    assert "in_place=True), so the model and the optimizer were partly changed" in message
    after = _local_bytes(model, opt)
    changed = [k for k in before if k.startswith("model/") and after[k] != before[k]]
    assert changed, "nothing was read in place"
    for name in changed:
        assert f"'{name}'" in message, (name, message)
    return "named"


def save_single(path: Path) -> dict[str, torch.Tensor]:
    """The single-process checkpoint that the 2-rank run loads (ucpformat.torch.save)."""
    import ucpformat.torch as ucpt

    model = build("plain", seed=11)
    opt = make_optimizer(model)
    train(model, opt, 2)
    ucpt.save(path, model=model, optimizer=opt, step=2)
    return {k: v.clone() for k, v in model.state_dict().items()}


def meta_loads(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks: FSDP2 and TP models built on the meta device. Without ``assign`` the load
    is refused; ``to_empty`` then a plain load (model and optimizer), or ``assign=True``
    (then an optimizer built on the new parameters), give the checkpoint's state."""
    out: dict[str, Any] = {}
    model = build("fsdp")
    opt = make_optimizer(model)
    train(model, opt, 2)
    path = f"{root}/fsdp-src"
    save_distributed(path, model=model, optimizer=opt, step=2)

    def on_meta(layout: str) -> torch.nn.Module:
        with torch.device("meta"):
            return build(layout, seed=5)

    meta = on_meta("fsdp")
    try:
        load_distributed(path, model=meta)
    except ucpformat.errors.LoadError as exc:
        assert "meta device" in str(exc) and "assign=True" in str(exc), repr(exc)
    else:
        raise AssertionError("a meta model loaded without assign")
    assert all(t.is_meta for t in meta.state_dict().values())
    # the torchtitan way: to_empty, optimizer, one load of both
    meta.to_empty(device="cpu")
    meta_opt = make_optimizer(meta, lr=0.5)
    result = load_distributed(path, model=meta, optimizer=meta_opt)
    assert result.step == 2 and result.on_meta == []
    out["fsdp meta + to_empty"] = check_state(path, meta, meta_opt)
    # by assignment, then an optimizer on the new parameters, which trains
    for layout in ("fsdp", "tp", "2x2"):
        meta = on_meta(layout)
        try:
            load_distributed(path, model=meta, optimizer=make_optimizer(meta), assign=True)
        except ucpformat.errors.LoadError as exc:
            assert "build the optimizer" in str(exc), repr(exc)
        else:
            raise AssertionError("assign=True with an optimizer built before was accepted")
        load_distributed(path, model=meta, assign=True)
        for name, t in meta.named_parameters():
            assert isinstance(t, torch.nn.Parameter) and t.requires_grad, name
            assert not t.is_meta and (layout == "tp" or isinstance(t, DTensor)), name
        out[f"{layout} meta + assign"] = check_state(path, meta, None)
        new_opt = make_optimizer(meta)
        train(meta, new_opt, 1)
        assert all(not s["exp_avg"].is_meta for s in new_opt.state.values())
    return out


def save_pipeline_stages(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 ranks on a (pp 2, dp 2) mesh: each stage's parameter sharded over the stage's
    data-parallel slice. As slices of the root mesh the stages hold different tensors,
    so they are described by boxes; the checkpoint holds both stages whole."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    coords = mesh.get_coordinate()
    assert coords is not None
    stage, dp = coords[0], mesh["dp"]
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4) + 100 * stage
    local = full.chunk(2)[dp.get_local_rank()].clone()
    model = torch.nn.Module()
    model.register_parameter(f"stage{stage}", torch.nn.Parameter(
        DTensor.from_local(local, dp, [Shard(0)], run_check=False)))
    on_mesh = described_on_mesh(lambda: save_distributed(f"{root}/pp", model=model))
    return {"on mesh": on_mesh, "stage": stage}



def async_process_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """2 ranks, FSDP2: AsyncSaver(writer="process"), each rank's writer process joining a
    gloo group of the writers; the state at call time is saved; a failure in the writers
    (a committed location, no overwrite) is raised on every rank."""
    model = build("fsdp", seed=5)
    opt = make_optimizer(model)
    train(model, opt, 1, seed=2)
    out: dict[str, Any] = {}
    with AsyncSaver(writer="process") as saver:
        out["writer_pid"] = saver.writer_pid
        snapshot = {k: _full(v).clone() for k, v in sorted(get_model_state_dict(model).items())}
        future = saver.save(f"{root}/procasync", model=model, optimizer=opt, step=4)
        train(model, opt, 1, seed=8)  # modifies every parameter while the writers write
        out["tensors"] = future.result().tensors
        ck = ucpformat.open_checkpoint(f"{root}/procasync")
        for fqn, value in snapshot.items():
            _equal(ck.tensor("model", fqn).read(), value, f"process writer model/{fqn}")
        saver.save(f"{root}/procasync", model=model)
        try:
            saver.wait()
        except ucpformat.errors.WriteError as exc:
            out["failure"] = f"{type(exc).__name__}: {exc}"
        out["second"] = saver.save(f"{root}/procasync2", model=model).result().tensors
    out["writer_gone"] = not os.path.exists(f"/proc/{out['writer_pid']}")
    return out

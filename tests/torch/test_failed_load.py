"""A load that fails changes nothing, and every error it raises is a UCPError naming the
tensor or value and, where the spec has one, the rule.

Each case loads into a trained model (parameters and buffers), optimizer (with state)
and scheduler that differ from the checkpoint's, and checks them bit for bit against a
copy taken before: the single-process ``load`` and ``load_distributed`` (one process).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.errors import (  # noqa: E402
    ChecksumError,
    LoadError,
    MissingChunkError,
    ShapeMismatchError,
)
from ucpformat.torch.state import state_of  # noqa: E402

pytestmark = pytest.mark.torch

LOADERS = ["load", "load_distributed"]


def _trained(seed: int) -> tuple[Any, Any, Any]:
    """A model with parameters and buffers (batch norm), AdamW with state, a scheduler."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 32),
        torch.nn.ReLU(), torch.nn.Linear(32, 8),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2 * (seed + 1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(seed)
    for _ in range(seed + 2):
        opt.zero_grad()
        model(torch.randn(16, 6, generator=g)).square().mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _bits(value: Any) -> Any:
    """Every tensor of a (nested) state as its bytes, every other value as it is."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return (str(t.dtype), tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()))
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_bits(v) for v in value]
    return copy.deepcopy(value)


def _snapshot(model: Any, opt: Any, sched: Any) -> Any:
    return _bits({"model": dict(model.state_dict()), "optimizer": opt.state_dict(),
                  "scheduler": sched.state_dict(),
                  "lr": [g["lr"] for g in opt.param_groups]})


def _load(loader: str, path: Path, model: Any, opt: Any, sched: Any, **kw: Any) -> Any:
    fn = ucpt.load if loader == "load" else ucpt.load_distributed
    return fn(path, model=model, optimizer=opt, scheduler=sched, **kw)


def _object(root: Path, node: str) -> Path:
    """The file of the (single) stored object of a small array."""
    ckpt = ucpformat.open_checkpoint(root)
    meta = ckpt.arrays[node]
    assert meta.shard_shape is None and meta.object_count == 1
    return root / meta.object_key((0,) * len(meta.shape))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, opt, sched = _trained(0)
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, scheduler=sched, step=7)
    return tmp_path / "c"


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("node", ["model/2.weight", "optimizer/state/2.weight/exp_avg"])
@pytest.mark.parametrize("damage", ["crc", "missing"])
def test_a_damaged_or_missing_chunk_changes_nothing(
    saved: Path, loader: str, node: str, damage: str
) -> None:
    target = _object(saved, node)
    if damage == "crc":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    model, opt, sched = _trained(1)
    before = _snapshot(model, opt, sched)
    error, rule = ((ChecksumError, "UCP-1.0-R041") if damage == "crc"
                   else (MissingChunkError, "UCP-1.0-R031"))
    with pytest.raises(error) as info:
        _load(loader, saved, model, opt, sched)
    assert (info.value.tensor, info.value.rule) == (node, rule)
    assert node in str(info.value) and rule in str(info.value)
    assert _snapshot(model, opt, sched) == before  # every tensor bit-identical, all else equal
    # and the same objects load the undamaged checkpoint afterwards
    ucpt.save(saved.parent / "good", model=_trained(0)[0], durable=False)
    ucpt.load(saved.parent / "good", model=model)


class _ListState:
    """A scheduler-like object whose state is a list (valid JSON: the checkpoint is valid)."""

    def __init__(self) -> None:
        self.state: list[int] = [1, 2, 3]

    def state_dict(self) -> list[int]:
        return self.state

    def load_state_dict(self, state: list[int]) -> None:
        self.state = list(state)


@pytest.mark.parametrize("loader", LOADERS)
def test_a_scheduler_state_of_another_kind_is_refused_before_anything_changes(
    tmp_path: Path, loader: str
) -> None:
    model, opt, _ = _trained(0)
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, scheduler=_ListState())
    assert ucpformat.validate(tmp_path / "c").valid
    model, opt, sched = _trained(1)
    before = _snapshot(model, opt, sched)
    with pytest.raises(LoadError, match=r"^training/scheduler: .*list.*mapping") as info:
        _load(loader, tmp_path / "c", model, opt, sched)
    assert info.value.path == "training/scheduler"
    assert _snapshot(model, opt, sched) == before


class _Refusing:
    """A scheduler that refuses any state but its own (a check no planner can make)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["epoch"] != self.epoch:
            raise RuntimeError("not this one")


@pytest.mark.parametrize("loader", LOADERS)
def test_an_object_refusing_its_state_undoes_what_was_loaded(
    tmp_path: Path, loader: str
) -> None:
    model, opt, _ = _trained(1)
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, scheduler=_Refusing(5))
    model, opt, sched = _trained(2)
    before = _snapshot(model, opt, sched)
    with pytest.raises(LoadError, match=r"training/scheduler: the scheduler refused .*"
                       r"RuntimeError: not this one.*; nothing was changed"):
        _load(loader, tmp_path / "c", model, opt, _Refusing(1))
    assert _snapshot(model, opt, sched) == before


def _with_optimizer_state(path: Path, fqn: str, name: str, value: np.ndarray[Any, Any]) -> None:
    """Save a trained state with one optimizer state replaced (the file is valid)."""
    model, opt, sched = _trained(0)
    state, _ = state_of(model=model, optimizer=opt, scheduler=sched)
    state["optimizer"]["state"][fqn][name] = value
    ucpformat.save(path, state)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh optimizer", "optimizer with state"])
def test_an_optimizer_state_of_the_wrong_shape_is_refused(
    tmp_path: Path, loader: str, fresh: bool
) -> None:
    model, opt, sched = _trained(0)
    bias = opt.state[model[4].bias]["exp_avg"].numpy()
    _with_optimizer_state(tmp_path / "c", "4.bias", "exp_avg", bias.reshape(1, 8))
    model, opt, sched = _trained(1)
    if fresh:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    before = _snapshot(model, opt, sched)
    with pytest.raises(ShapeMismatchError, match=r"\[1, 8\].*\[8\]") as info:
        _load(loader, tmp_path / "c", model, opt, sched)
    assert info.value.tensor == "optimizer/state/4.bias/exp_avg"
    assert info.value.rule == "UCP-1.0-R081"
    assert _snapshot(model, opt, sched) == before


@pytest.mark.parametrize("loader", LOADERS)
def test_an_optimizer_state_unlike_the_optimizers_own_is_refused(
    tmp_path: Path, loader: str
) -> None:
    """A state of another size than the parameter's is the optimizer's business, but it
    must be the shape of the state the optimizer holds."""
    _with_optimizer_state(tmp_path / "c", "4.bias", "exp_avg", np.zeros(3, np.float32))
    model, opt, sched = _trained(1)
    before = _snapshot(model, opt, sched)
    with pytest.raises(ShapeMismatchError, match=r"\[3\].*own state.*4\.bias.*\[8\]") as info:
        _load(loader, tmp_path / "c", model, opt, sched)
    assert info.value.tensor == "optimizer/state/4.bias/exp_avg"
    assert _snapshot(model, opt, sched) == before


@pytest.mark.parametrize("loader", LOADERS)
def test_a_hyperparameter_of_another_kind_is_refused(tmp_path: Path, loader: str) -> None:
    model, opt, sched = _trained(0)
    state, _ = state_of(model=model, optimizer=opt, scheduler=sched)
    state["optimizer"]["param_groups"][0]["lr"] = "fast"
    state["optimizer"]["param_groups"][0]["betas"] = {"b1": 0.9}
    ucpformat.save(tmp_path / "c", state)
    model, opt, sched = _trained(1)
    before = _snapshot(model, opt, sched)
    with pytest.raises(LoadError, match=r"optimizer/param_groups\[0\]\.lr: .*string.*number"):
        _load(loader, tmp_path / "c", model, opt, sched)
    assert _snapshot(model, opt, sched) == before


@pytest.mark.parametrize("loader", LOADERS)
def test_a_hyperparameter_the_checkpoint_lacks_keeps_the_optimizers_value(
    tmp_path: Path, loader: str
) -> None:
    model, opt, sched = _trained(0)
    state, _ = state_of(model=model, optimizer=opt, scheduler=sched)
    del state["optimizer"]["param_groups"][0]["betas"]
    ucpformat.save(tmp_path / "c", state)
    model, opt, sched = _trained(1)
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    _load(loader, tmp_path / "c", model, opt, sched)
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert opt.param_groups[0]["lr"] == state["optimizer"]["param_groups"][0]["lr"]
    model(torch.randn(4, 6)).sum().backward()
    opt.step()  # a group without betas would fail here (KeyError)


@pytest.mark.parametrize("loader", LOADERS)
def test_in_place_a_damaged_chunk_says_the_model_was_partly_changed(
    saved: Path, loader: str
) -> None:
    """``in_place=True`` reads into the live tensors: a damaged chunk then leaves the model
    partly changed, and the error says so and names the tensors; the scheduler, and with
    ``load`` the optimizer (whose state is read into new tensors), are as they were."""
    node = "model/2.weight"
    target = _object(saved, node)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    model, opt, sched = _trained(1)
    before = _snapshot(model, opt, sched)
    with pytest.raises(ChecksumError) as info:
        _load(loader, saved, model, opt, sched, in_place=True)
    assert (info.value.tensor, info.value.rule) == (node, "UCP-1.0-R041")
    message = str(info.value)
    # load_distributed reads the optimizer's state into its live tensors too
    owners = "model was" if loader == "load" else "model and the optimizer were"
    assert f"in_place=True), so the {owners} partly changed" in message
    after = _snapshot(model, opt, sched)
    unchanged = ("scheduler", "lr", "optimizer") if loader == "load" else ("scheduler", "lr")
    assert {k: after[k] for k in unchanged} == {k: before[k] for k in unchanged}
    ckpt = ucpformat.open_checkpoint(saved)
    changed = [k for k in before["model"] if after["model"][k] != before["model"][k]]
    assert changed  # the other tensors of the batch were read into the model
    for name in changed:
        assert f"'model/{name}'" in message, name  # every changed tensor is named
        if f"model/{name}" != node:
            assert after["model"][name][2] == ckpt[f"model/{name}"].read().tobytes(), name

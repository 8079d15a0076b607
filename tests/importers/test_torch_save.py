"""torch.save <-> UCP: state dicts and training checkpoints written by torch itself."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest

import ucpformat
from tests.importers.conftest import assert_same
from ucpformat import exporters, importers
from ucpformat.errors import FormatError, InvalidValueError

torch = pytest.importorskip("torch")


class Net(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x: Any) -> Any:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _train(named: bool, steps: int = 2) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = Net()
    params = model.named_parameters() if named else model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(steps):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _step(model: Any, opt: Any) -> None:
    torch.manual_seed(1)
    model(torch.randn(8, 6)).pow(2).mean().backward()
    opt.step()


def test_state_dict_of_every_dtype_both_ways(tmp_path: Path) -> None:
    state = {
        "w.f32": torch.randn(7, 5),
        "w.bf16": torch.randn(4, 9).to(torch.bfloat16),
        "w.f16": torch.randn(3).half(),
        "w.fp8": torch.randn(6, 2).to(torch.float8_e4m3fn),
        "w.fp8e5": torch.randn(6).to(torch.float8_e5m2),
        "ids": torch.arange(10),
        "mask": torch.tensor([True, False]),
        "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    torch.save(state, tmp_path / "sd.pt")
    assert importers.detect(tmp_path / "sd.pt") == "torch"
    importers.convert(tmp_path / "sd.pt", tmp_path / "ckpt", durable=False)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    for name, want in state.items():
        assert_same(ckpt.tensor("model", name).read(), want, name)
    assert ckpt.tensor("model", "w.fp8").meta.dtype.name == "float8_e4m3fn"
    assert ckpt.tensor("model", "ids").attributes["role"] == "buffer"
    exporters.export(tmp_path / "ckpt", tmp_path / "back.pt", to="torch")
    for mmap in (False, True):
        back = torch.load(tmp_path / "back.pt", weights_only=True, mmap=mmap)
        assert set(back) == set(state)
        for name, want in state.items():
            assert back[name].dtype == want.dtype
            assert_same(back[name], want, name)


def test_training_checkpoint_resumes_identically(tmp_path: Path) -> None:
    model, opt, sched = _train(named=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "epoch": 3, "rng": torch.get_rng_state()},
               tmp_path / "train.pt")
    importers.convert(tmp_path / "train.pt", tmp_path / "ckpt", durable=False)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ucpformat.validate(tmp_path / "ckpt", deep=True).valid
    groups = ckpt.values("optimizer")["param_groups"]
    assert groups[0]["params"] == [n for n, _ in model.named_parameters()]
    assert_same(ckpt.tensor("optimizer", "state", "fc1.weight", "exp_avg").read(),
                opt.state[model.fc1.weight]["exp_avg"])
    assert ckpt.values("training")["epoch"] == 3
    assert ckpt.values("training")["scheduler"]["step_size"] == 2

    exporters.export(tmp_path / "ckpt", tmp_path / "back.pt", to="torch", layout="training")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_same(back["rng"], torch.get_rng_state())
    fresh, fresh_opt, fresh_sched = _train(named=True, steps=0)
    fresh.load_state_dict(back["model"])
    fresh_opt.load_state_dict(back["optimizer"])
    fresh_sched.load_state_dict(back["scheduler"])
    assert fresh_sched.state_dict() == sched.state_dict()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.named_parameters(), lr=1e-2)
    ref_opt.load_state_dict(opt.state_dict())
    _step(reference, ref_opt)
    _step(fresh, fresh_opt)
    for (name, a), b in zip(reference.state_dict().items(), fresh.state_dict().values(),
                            strict=True):
        assert_same(b, a, name)


def test_numbered_optimizer_needs_names(tmp_path: Path) -> None:
    model, opt, _ = _train(named=False)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               tmp_path / "train.pt")
    with pytest.raises(InvalidValueError, match="param_names"):
        importers.convert(tmp_path / "train.pt", tmp_path / "a")
    # the model's buffers sit between its parameters: the order check catches it
    with pytest.raises(InvalidValueError, match="shape"):
        importers.convert(tmp_path / "train.pt", tmp_path / "b", param_names="model-order")
    names = [n for n, _ in model.named_parameters()]
    importers.convert(tmp_path / "train.pt", tmp_path / "c", param_names=names, durable=False)
    ckpt = ucpformat.open(tmp_path / "c")
    assert_same(ckpt.tensor("optimizer", "state", "fc2.bias", "exp_avg_sq").read(),
                opt.state[model.fc2.bias]["exp_avg_sq"])


class Evil:
    def __reduce__(self) -> Any:
        return (open, ("/tmp/ucp-evil-marker", "w"))


class Custom:
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize("payload", [Evil(), Custom()])
def test_arbitrary_objects_are_never_unpickled(tmp_path: Path, payload: Any) -> None:
    marker = Path("/tmp/ucp-evil-marker")
    marker.unlink(missing_ok=True)
    torch.save({"model": {"w": torch.ones(2)}, "extra": payload}, tmp_path / "evil.pt")
    with pytest.raises(FormatError, match="never unpickles"):
        importers.convert(tmp_path / "evil.pt", tmp_path / "ckpt")
    assert not marker.exists()
    assert not (tmp_path / "ckpt").exists()


def test_legacy_format_and_plain_pickle(tmp_path: Path) -> None:
    state = {"a": torch.arange(6.0).reshape(2, 3)}
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert importers.detect(tmp_path / "legacy.pt") == "torch"
    importers.convert(tmp_path / "legacy.pt", tmp_path / "ckpt", durable=False)
    assert_same(ucpformat.open(tmp_path / "ckpt").tensor("model", "a").read(), state["a"])
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(FormatError):
        importers.detect(tmp_path / "plain.pkl")


def test_huggingface_bin_shards_and_tied_storage(tmp_path: Path) -> None:
    hub = pytest.importorskip("huggingface_hub")
    emb = torch.randn(50, 8)
    state = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(8),
             "layer.weight": torch.randn(64, 8)}
    (tmp_path / "hf").mkdir()
    hub.save_torch_state_dict(state, tmp_path / "hf", max_shard_size=1500,
                              safe_serialization=False)
    assert (tmp_path / "hf" / "pytorch_model.bin.index.json").is_file()
    assert importers.detect(tmp_path / "hf") == "torch"
    importers.convert(tmp_path / "hf", tmp_path / "ckpt", durable=False)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    for name in ("embed.weight", "norm.weight", "layer.weight"):
        assert_same(ckpt.tensor("model", name).read(), state[name], name)
    exporters.export(tmp_path / "ckpt", tmp_path / "out.pt", to="torch")
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    for name in back:
        assert_same(back[name], state[name], name)

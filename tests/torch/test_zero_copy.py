"""ucpformat.torch loads read as one batch: new tensors are the read buffers themselves;
a model's live tensors are filled from staging only once every read has been checked."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.checkpoint.reader import Checkpoint  # noqa: E402
from ucpformat.torch.numpy_bridge import to_numpy  # noqa: E402

pytestmark = pytest.mark.torch


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 16))


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Every batch of regions read: a list of their ``out`` arrays per call."""
    calls: list[list[Any]] = []
    real = Checkpoint.read_regions

    def recording(self: Checkpoint, regions: Any) -> Any:
        calls.append([r.out for r in regions])
        return real(self, regions)

    monkeypatch.setattr(Checkpoint, "read_regions", recording)
    return calls


def test_load_stages_then_copies_into_the_parameters_memory(
    tmp_path: Path, spy: list[list[Any]]
) -> None:
    src = _model(0)
    ucpt.save(tmp_path / "c", model=src, durable=False)
    dst = _model(1)
    params = dict(dst.named_parameters())
    before = {k: p.data_ptr() for k, p in params.items()}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    tracemalloc.start()
    try:
        ucpt.load(tmp_path / "c", model=dst)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(spy) == 1  # one batch for every tensor of the model
    outs = [o for o in spy[0] if o is not None]
    assert len(outs) == len(params)
    for name, p in params.items():
        assert p.data_ptr() == before[name]  # copied into, never replaced
        assert torch.equal(p, dict(src.named_parameters())[name])
        mine = to_numpy(p.detach())
        assert not any(np.shares_memory(o, mine) for o in outs), name  # read into staging
    # the staging is one copy of what the model receives, no more
    assert nbytes <= peak < 1.25 * nbytes


def test_in_place_load_reads_straight_into_the_parameters_memory(
    tmp_path: Path, spy: list[list[Any]]
) -> None:
    src = _model(0)
    ucpt.save(tmp_path / "c", model=src, durable=False)
    dst = _model(1)
    params = dict(dst.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    tracemalloc.start()
    try:
        ucpt.load(tmp_path / "c", model=dst, in_place=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(spy) == 1
    outs = [o for o in spy[0] if o is not None]
    for name, p in params.items():
        assert torch.equal(p, dict(src.named_parameters())[name])
        mine = to_numpy(p.detach())
        assert sum(np.shares_memory(o, mine) for o in outs) == 1, name  # the read buffer
    assert peak < 0.1 * nbytes  # no staging


@pytest.mark.parametrize("in_place", [False, True])
def test_load_into_another_dtype_is_staged_and_copied(tmp_path: Path, in_place: bool) -> None:
    src = _model(0)
    ucpt.save(tmp_path / "c", model=src, durable=False)
    dst = _model(1).to(torch.bfloat16)
    ucpt.load(tmp_path / "c", model=dst, in_place=in_place)
    for (name, p), q in zip(dst.named_parameters(), src.parameters(), strict=True):
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, q.to(torch.bfloat16)), name


def test_load_state_dict_and_optimizer_state_read_as_one_batch_each(
    tmp_path: Path, spy: list[list[Any]]
) -> None:
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, durable=False)
    sd = ucpt.load_state_dict(tmp_path / "c")
    assert len(spy) == 1 and len(spy[0]) == len(sd) == 4
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v)
    spy.clear()
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    ucpt.load(tmp_path / "c", model=model2, optimizer=opt2)
    assert len(spy) == 1  # the model's tensors and the optimizer's state arrays together
    for a, b in zip(opt2.state_dict()["state"].values(), opt.state_dict()["state"].values(),
                    strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])

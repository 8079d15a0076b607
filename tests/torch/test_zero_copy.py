"""ucpformat.torch loads read as one batch: new tensors are the read buffers themselves;
a model's live tensors get the staging only once every read has been checked: its memory
where no one else sees theirs, a copy of it where someone does."""

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


def test_load_stages_then_hands_the_staging_to_the_parameters(
    tmp_path: Path, spy: list[list[Any]]
) -> None:
    src = _model(0)
    ucpt.save(tmp_path / "c", model=src, durable=False)
    dst = _model(1)
    opt = torch.optim.SGD(dst.parameters(), lr=1.0)
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
    for name, p in dst.named_parameters():
        assert p is params[name]  # the same Parameter objects: the optimizer still has them
        assert p.data_ptr() != before[name]  # no one else saw the old memory: replaced
        assert torch.equal(p, dict(src.named_parameters())[name])
        mine = to_numpy(p.detach())
        assert sum(np.shares_memory(o, mine) for o in outs) == 1, name  # the staging itself
    # the staging is one copy of what the model receives, no more
    assert sum(o.nbytes for o in outs) == nbytes and nbytes <= peak < 1.25 * nbytes
    dst(torch.ones(1, 512)).sum().backward()
    opt.step()  # training goes on in the new memory
    assert not torch.equal(dst[1].bias, src[1].bias)


def _view(model: Any) -> Any:
    return model[0].weight.view(-1)


def _alias(model: Any) -> Any:
    return model[0].weight.detach()


def _shared(model: Any) -> Any:
    return model.share_memory()[0].weight


@pytest.mark.parametrize("seen_by", [_view, _alias, _shared])
def test_a_tensor_someone_else_sees_is_copied_into(
    tmp_path: Path, seen_by: Any
) -> None:
    src = _model(0)
    ucpt.save(tmp_path / "c", model=src, durable=False)
    dst = _model(1)
    other = seen_by(dst)  # a view, an alias, or memory another process may map
    weight = dst[0].weight
    address = weight.data_ptr()
    ucpt.load(tmp_path / "c", model=dst)
    assert weight.data_ptr() == address  # copied into: what else sees it sees the load
    assert torch.equal(other.reshape(weight.shape), src[0].weight)
    assert dst[1].weight.data_ptr() != 0 and torch.equal(dst[1].weight, src[1].weight)


def test_can_take_memory_only_where_nothing_but_the_address_differs() -> None:
    from ucpformat.torch.reads import can_take_memory

    data = torch.ones(4, 3)
    assert can_take_memory(torch.zeros(4, 3), data)
    assert not can_take_memory(torch.zeros(3, 4).t(), data)  # another layout
    assert not can_take_memory(torch.zeros(4, 3, dtype=torch.float64), data)
    assert not can_take_memory(torch.zeros(12)[:12].view(4, 3), data)  # a view
    assert not can_take_memory(torch.zeros(13)[1:].view(4, 3), data)
    assert not can_take_memory(torch.zeros(4, 3), torch.ones(5, 3)[:4])  # part of a storage
    with torch.inference_mode():
        frozen = torch.zeros(4, 3)
    assert not can_take_memory(frozen, data)

    class Marked(torch.Tensor):
        pass

    assert not can_take_memory(torch.zeros(4, 3).as_subclass(Marked), data)


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

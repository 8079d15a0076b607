"""The staged load's page moves (ucpformat.torch.page_moves): large CPU targets receive the
checked staging's pages instead of a copy; the values, addresses, neighbours and sharing
are what a copy would leave, and a failed load still changes nothing."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.errors import UCPError  # noqa: E402
from ucpformat.torch import page_moves  # noqa: E402

pytestmark = pytest.mark.torch

ROWS = 1031  # odd sizes: targets that start and end inside a page


def _module(tensors: dict[str, Any]) -> Any:
    m = torch.nn.Module()
    for name, t in tensors.items():
        m.register_buffer(name, t)
    return m


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each large target was moved into (True) or copied (False)."""
    seen: list[bool] = []
    real = page_moves.move_into

    def recording(target: Any, data: Any, ranges: Any) -> bool:
        seen.append(real(target, data, ranges))
        return seen[-1]

    monkeypatch.setattr("ucpformat.torch.reads.move_into", recording)
    return seen


def test_moved_pages_carry_the_values_and_leave_neighbours_alone(
    tmp_path: Path, moves: list[bool]
) -> None:
    torch.manual_seed(0)
    src = {"a": torch.randn(ROWS, 517), "b": torch.randn(ROWS, 601).to(torch.bfloat16)}
    ucpt.save(tmp_path / "c", model=_module(src), durable=False)
    # "b" is a view into a larger buffer at an odd byte offset: its first and last
    # pages hold bytes of other tensors
    flat = torch.full((ROWS * 601 + 77,), 7.0, dtype=torch.bfloat16)
    view = flat[33:33 + ROWS * 601].view(ROWS, 601)
    dst = _module({"a": torch.empty(ROWS, 517), "b": view})
    before = {k: t.data_ptr() for k, t in dst.state_dict().items()}
    ucpt.load(tmp_path / "c", model=dst)
    assert moves == [True, True]
    for k, t in dst.state_dict().items():
        assert t.data_ptr() == before[k]  # copied into, never replaced
        assert torch.equal(t, src[k]), k
    assert torch.equal(view, src["b"])  # the view into the buffer sees the values
    assert (flat[:33] == 7).all() and (flat[33 + ROWS * 601:] == 7).all()
    ucpt.load(tmp_path / "c", model=dst)  # again, into pages moved there before
    assert all(torch.equal(t, src[k]) for k, t in dst.state_dict().items())


def test_shared_memory_targets_are_copied_and_stay_shared(
    tmp_path: Path, moves: list[bool]
) -> None:
    src = {"a": torch.arange(ROWS * 517, dtype=torch.float32).view(ROWS, 517)}
    ucpt.save(tmp_path / "c", model=_module(src), durable=False)
    target = torch.zeros(ROWS, 517).share_memory_()
    ucpt.load(tmp_path / "c", model=_module({"a": target}))
    assert moves == [False]  # not a private anonymous mapping: copied
    assert target.is_shared() and torch.equal(target, src["a"])


def test_a_failed_load_changes_no_large_target(tmp_path: Path) -> None:
    src = {"a": torch.randn(ROWS, 517), "b": torch.randn(ROWS, 517)}
    ucpt.save(tmp_path / "c", model=_module(src), durable=False)
    # damage the last chunk of "b": "a" is read and checked first, then the load fails
    chunks = sorted(p for p in (tmp_path / "c" / "model" / "b").rglob("*")
                    if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunks[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunks[-1].write_bytes(bytes(data))
    dst = _module({"a": torch.full((ROWS, 517), 3.0), "b": torch.full((ROWS, 517), 4.0)})
    with pytest.raises(UCPError):
        ucpt.load(tmp_path / "c", model=dst)
    assert (dst.a == 3).all() and (dst.b == 4).all()
    shutil.rmtree(tmp_path / "c")

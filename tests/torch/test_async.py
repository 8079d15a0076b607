"""AsyncSaver in one process (no torch.distributed): snapshot semantics, one save at a time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from tests.torch import dist_workers as w  # noqa: E402
from ucpformat.errors import CheckpointExistsError  # noqa: E402
from ucpformat.torch.async_save import AsyncSaver  # noqa: E402

pytestmark = pytest.mark.torch


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def test_saves_the_state_at_call_time_and_reuses_staging(tmp_path: Path) -> None:
    model = w.build("plain")
    opt = w.make_optimizer(model)
    w.train(model, opt, 1)
    with AsyncSaver() as saver:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        first = saver.save(tmp_path / "a", model=model, optimizer=opt, step=1)
        staged = saver.staging_bytes
        assert staged > 0
        w.train(model, opt, 1)  # changes every parameter, maybe while the write runs
        second = saver.save(tmp_path / "b", model=model, optimizer=opt, step=2)
        assert first.done()  # the next save waited for the previous one
        assert saver.staging_bytes == staged  # the same buffers, reused
        assert saver.last_blocked_s > 0
    assert second.done() and second.result().tensors == first.result().tensors
    ck = ucpformat.open_checkpoint(tmp_path / "a")
    for fqn, value in before.items():
        assert ck.tensor("model", fqn).read().tobytes() == _raw(value), fqn
    ck = ucpformat.open_checkpoint(tmp_path / "b")
    for fqn, value in model.state_dict().items():
        assert ck.tensor("model", fqn).read().tobytes() == _raw(value), fqn
    assert ck.values("training")["step"] == 2


def test_a_failed_save_is_reported_by_the_next_call(tmp_path: Path) -> None:
    model = w.build("plain")
    saver = AsyncSaver()
    saver.save(tmp_path / "a", model=model).result()
    failing = saver.save(tmp_path / "a", model=model)  # committed already, no overwrite
    with pytest.raises(CheckpointExistsError):
        saver.save(tmp_path / "b", model=model)
    assert failing.done()
    assert not (tmp_path / "b").exists()  # nothing of the next save was started
    saver.save(tmp_path / "b", model=model)
    saver.close()
    assert ucpformat.open_checkpoint(tmp_path / "b").tensor("model", "up.weight").shape == (10, 6)
    with pytest.raises(RuntimeError):
        saver.save(tmp_path / "c", model=model)


def test_a_one_file_path_is_refused_at_the_call(tmp_path: Path) -> None:
    """A background save writes a directory: a .ucpz path is refused before the snapshot,
    not by the save in the background (whose error the next call would raise)."""
    model = w.build("plain")
    with AsyncSaver() as saver:
        with pytest.raises(ucpformat.errors.WriteError, match="ucp pack") as err:
            saver.save(tmp_path / "a.ucpz", model=model)
        assert err.value.rule == "UCP-1.0-R074"
        saver.save(tmp_path / "b", model=model).result()  # the next save is not affected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_background_saves_leave_training_its_cores(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An async save writes on half the CPUs' threads (``background_workers``) unless the
    caller names a number: with twice the CPUs (a synchronous save's default) its threads
    took the cores from training (BENCHMARKS.md, bench_training)."""
    from ucpformat.checkpoint import write_loop
    from ucpformat.checkpoint.options import SaveOptions
    from ucpformat.distributed import pipeline

    seen: list[int | None] = []
    real = write_loop.write_objects

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("workers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "write_objects", recording)
    model = torch.nn.Linear(4, 4)
    saver = ucpt.AsyncSaver()
    try:
        saver.save(tmp_path / "a", model=model).result()
        saver.save(tmp_path / "b", model=model, workers=3).result()
        saver.save(tmp_path / "c", model=model, options=SaveOptions(workers=5)).result()
        saver.save(tmp_path / "d", model=model, options=SaveOptions()).result()
    finally:
        saver.close()
    half = max(1, (os.cpu_count() or 1) // 2)
    assert seen == [half, 3, 5, half]
    assert write_loop.background_workers() == half < write_loop.default_workers()

"""CheckpointManager as Orbax users expect it: async saves, best-K and every-N retention,
a save on preemption, latest_step / all_steps / restore(step), several ranks, S3."""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint.manager import CheckpointManager
from ucpformat.distributed import Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import ThreadGroup, run_threads
from ucpformat.errors import CheckpointNotFoundError, InvalidValueError
from ucpformat.testing.common import SMALL_CHUNKING, differences, small_state


def _save_later(pool: ThreadPoolExecutor, gate: threading.Event, step: int
                ) -> Callable[[str], Future[None]]:
    """A save callback that returns a future; the save waits for ``gate``."""

    def run(path: str) -> None:
        assert gate.wait(30)
        ucpformat.save(path, small_state(step), **SMALL_CHUNKING)

    return lambda path: pool.submit(run, path)


def test_an_async_save_is_recorded_and_rotated_only_once_committed(tmp_path: Path) -> None:
    """A callback returning a future was verified at once ("R051 never committed") before."""
    manager = CheckpointManager(tmp_path / "run", keep_last=1, **SMALL_CHUNKING)
    manager.maybe_save(1, small_state(1))
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        entry = manager.maybe_save(2, _save_later(pool, gate, 2))
        assert entry is not None and entry.step == 2
        assert manager.all_steps() == [1]  # not committed yet: not recorded, nothing deleted
        assert manager.latest_step() == 1
        gate.set()
        assert manager.wait_until_finished() == entry
    assert manager.all_steps() == [2]  # recorded; step 1 rotated out only now
    with manager.restore(2) as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(2)) == []


def test_a_failed_async_save_is_raised_and_keeps_the_only_good_checkpoint(
    tmp_path: Path,
) -> None:
    manager = CheckpointManager(tmp_path / "run", keep_last=1, **SMALL_CHUNKING)
    manager.maybe_save(1, small_state(1))

    def fails(path: str) -> None:
        os.makedirs(path)
        Path(path, "write-in-progress.ucp.json").write_text("{}")  # remains of the save
        raise OSError("the disk went away")

    with ThreadPoolExecutor(1) as pool:
        manager.maybe_save(2, lambda path: pool.submit(fails, path))
        with pytest.raises(OSError, match="went away"):
            manager.maybe_save(3, small_state(3))  # the next save reports it, saves nothing
    assert manager.all_steps() == [1]
    assert not Path(manager.location(2)).exists()  # its remains are gone
    assert not Path(manager.location(3)).exists()
    assert manager.latest_step() == 1


def test_with_ucpformat_torch_async_saver(tmp_path: Path) -> None:
    """The issue's case: ``maybe_save(step, lambda p: save_async(...))`` failed with R051."""
    torch = pytest.importorskip("torch")
    import ucpformat.torch as ucpt
    from ucpformat.torch.async_save import AsyncSaver

    model = torch.nn.Linear(4, 3)
    weights = {}
    with AsyncSaver() as saver, CheckpointManager(tmp_path / "run", save_every=2,
                                                   keep_last=2) as manager:
        for step in range(7):
            with torch.no_grad():
                model.weight.add_(1.0)
            weights[step] = model.weight.detach().clone()
            manager.maybe_save(step, lambda path, s=step: saver.save(path, model=model, step=s))
    assert manager.all_steps() == [4, 6]  # close() waited for step 6 and rotated
    fresh = torch.nn.Linear(4, 3)
    assert ucpt.load(manager.location(6), model=fresh).step == 6
    assert torch.equal(fresh.weight, weights[6])


def test_keeps_the_best_k_by_a_metric_besides_the_last_k(tmp_path: Path) -> None:
    losses = {0: 5.0, 1: 1.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 2.0, 6: 6.0}

    def run(steps: range) -> CheckpointManager:
        manager = CheckpointManager(tmp_path / "run", keep_last=2, keep_best=2,
                                    best_metric="loss", best_mode="min", **SMALL_CHUNKING)
        for step in steps:
            manager.maybe_save(step, small_state(step), metrics={"loss": losses[step]})
        return manager

    manager = run(range(5))
    assert manager.all_steps() == [1, 3, 4]  # best two (3, 1) and the last two (3, 4)
    assert manager.metrics(3) == {"loss": 0.5}
    manager = run(range(5, 7))  # a restart: the metrics are read back from storage
    assert manager.all_steps() == [1, 3, 5, 6]
    assert manager.metrics(4) is None  # deleted with its checkpoint
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_file()) == [
        f"step-{s:010d}.metrics.json" for s in (1, 3, 5, 6)
    ] + ["ucp-manager.json"]
    high = CheckpointManager(tmp_path / "high", keep_last=1, keep_best=1,
                             best_metric=lambda m: m["acc"], **SMALL_CHUNKING)
    for step, acc in enumerate([0.2, 0.9, 0.5, 0.1]):
        high.maybe_save(step, small_state(step), metrics={"acc": acc})
    assert high.all_steps() == [1, 3]  # best_mode "max" with a function; the newest stays
    with pytest.raises(InvalidValueError, match="finite"):
        high.maybe_save(4, small_state(4), metrics={"acc": float("nan")})
    assert high.all_steps() == [1, 3]  # refused before anything was saved
    with pytest.raises(ValueError, match="best_metric"):
        CheckpointManager(tmp_path / "x", keep_best=1)


def test_keeps_every_nth_step_for_good(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", keep_last=1, keep_every=4, **SMALL_CHUNKING)
    for step in range(10):
        manager.maybe_save(step, small_state(step))
        if step == 4:  # damaged later: kept all the same (nothing goes for a failed read)
            Path(manager.location(4), "manifest.ucp.json").write_bytes(b"{}")
    assert manager.all_steps() == [0, 4, 8, 9]


def test_saves_once_on_sigterm(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    manager = CheckpointManager(tmp_path / "run", save_every=100, keep_last=5,
                                save_on_preemption=True, **SMALL_CHUNKING)
    assert signal.getsignal(signal.SIGTERM) != before  # the process would die otherwise
    assert manager.maybe_save(1, small_state(1)) is None
    assert not manager.reached_preemption(1)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal asks for nothing more
    entry = manager.maybe_save(3, small_state(3))  # not due, saved for the preemption
    assert entry is not None and entry.step == 3
    assert manager.reached_preemption(3)
    assert manager.maybe_save(4, small_state(4)) is None  # once
    manager.close()
    assert signal.getsignal(signal.SIGTERM) == before
    assert manager.all_steps() == [3]


def test_latest_step_all_steps_and_restore_a_step(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", save_every=2, keep_last=2, **SMALL_CHUNKING)
    assert manager.latest_step() is None and manager.all_steps() == []
    assert manager.restore() is None
    for step in range(7):
        manager.maybe_save(step, lambda s=step: small_state(s))
    assert manager.all_steps() == [4, 6]
    assert manager.latest_step() == 6
    with manager.restore(4) as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(4)) == []
    with pytest.raises(CheckpointNotFoundError, match="step 2"):
        manager.restore(2)


def test_ranks_saving_together(tmp_path: Path) -> None:
    """Several ranks call maybe_save with a collective save; they agree on a preemption
    signal that one rank got, and rank 0 alone verifies, records and deletes."""
    state = {"model/w": np.arange(64, dtype=np.float32).reshape(8, 8)}

    def rank_main(comm: ThreadGroup) -> list[tuple[int, bool]]:
        manager = CheckpointManager(tmp_path / "run", save_every=10, keep_last=1, comm=comm,
                                    save_on_preemption=True, preemption_signals=())
        rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        frags = [Fragment("model/w", ((rows.start, rows.stop), (0, 8)), state["model/w"][rows])]

        def write(path: str) -> Any:
            return save_fragments(path, comm, specs=[TensorSpec("model/w", (8, 8), "float32")],
                                    fragments=frags, durable=False)

        seen = []
        for step in range(13):
            if step == 12 and comm.rank == 1:
                manager.request_preemption()  # only rank 1 got the notice
            saved = manager.maybe_save(step, write) is not None
            seen.append((step, saved))
        return seen

    for seen in run_threads(2, rank_main):
        assert [s for s, saved in seen if saved] == [0, 10, 12]
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    assert manager.all_steps() == [12]
    with manager.restore() as ckpt:  # type: ignore[union-attr]
        assert np.array_equal(ckpt["model/w"].read(), state["model/w"])


# -- object stores ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from ucpformat.testing.s3 import s3_server

    with s3_server() as options:
        yield options


def test_on_s3(s3: dict[str, Any]) -> None:
    from ucpformat.testing.s3 import BUCKET

    root = f"s3://{BUCKET}/manager-{os.getpid()}"
    manager = CheckpointManager(root, keep_last=1, keep_best=1, best_metric="loss",
                                best_mode="min", keep_every=3, storage_options=s3,
                                **SMALL_CHUNKING)
    gate = threading.Event()
    gate.set()
    with ThreadPoolExecutor(1) as pool:
        for step, loss in enumerate([3.0, 1.0, 2.0, 4.0]):
            manager.maybe_save(step, lambda path, s=step: pool.submit(
                ucpformat.save, ucpformat.store.open_store(path, storage_options=s3),
                small_state(s), **SMALL_CHUNKING), metrics={"loss": loss})
        manager.close()
    assert manager.all_steps() == [0, 1, 3]  # every 3rd, the best (1), the last
    assert manager.latest_step() == 3
    assert manager.metrics(1) == {"loss": 1.0} and manager.metrics(2) is None
    with manager.restore(1) as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(1)) == []


def test_with_dcp_async_save_and_the_ucp_plugin(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ucpformat.torch.dcp import UCPWriter

    model = torch.nn.Linear(3, 2)
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialised
        for step in range(3):
            manager.maybe_save(step, lambda path: dcp.async_save(
                {"model": model.state_dict()}, storage_writer=UCPWriter(path), no_dist=True))
        manager.close()
    assert manager.all_steps() == [2]

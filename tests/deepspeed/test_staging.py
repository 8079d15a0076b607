"""The DeepSpeed save path's staging, on the CPU: an engine's fragments (flat ZeRO
partitions, boxes of whole tensors, scalars) reach the pipeline through the same bounded
pool and copy thread as ``save_distributed`` and the DCP plugin, and an asynchronous
save's snapshot copies them into reusable buffers. ``Staging(cpu=True)`` stages CPU
tensors as a GPU's would be; the real engines are in test_engines.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucpformat  # noqa: E402
from tests.helpers import FailingCopier  # noqa: E402
from ucpformat.deepspeed.save import EngineFragments  # noqa: E402
from ucpformat.distributed.comm import SingleProcess  # noqa: E402
from ucpformat.distributed.pipeline import save as run_pipeline  # noqa: E402
from ucpformat.distributed.save_plan import TensorSpec  # noqa: E402
from ucpformat.errors import UCPError, WriteError  # noqa: E402
from ucpformat.torch.staging import (  # noqa: E402
    ALIGN_BYTES,
    HostBufferPool,
    Snapshot,
    Staging,
)

pytestmark = pytest.mark.torch

WEIGHT = 64  # a weight of WEIGHT x WEIGHT float32: 16 KiB


class Events:
    """A recorder: every (event, key) in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, event: str, key: str) -> None:
        with self._lock:
            self.log.append((event, key))

    def keys(self, event: str) -> list[str]:
        return [k for e, k in self.log if e == event]


def _engine_like(staging: Staging) -> tuple[EngineFragments, list[TensorSpec],
                                            dict[str, np.ndarray[Any, Any]]]:
    """Fragments as ``collect`` makes them: a flat partition holding two parameters'
    master weights, a weight held as two row boxes and a column box of a strided
    view, a 0-d step; the specs and every tensor's expected values."""
    torch.manual_seed(0)
    n = WEIGHT * WEIGHT
    flat = torch.randn(2 * n)  # two parameters' fp32 master weights, flattened
    weight = torch.randn(WEIGHT, WEIGHT)
    wide = torch.randn(WEIGHT, 2 * WEIGHT)  # its left half is stored: a strided view
    step = torch.tensor(7, dtype=torch.int64)
    src = EngineFragments(staging)
    full = ((0, WEIGHT), (0, WEIGHT))
    src.add("optimizer/state/a/master", full, flat[:n])
    src.add("optimizer/state/b/master", full, flat[n:])
    src.add("model/w", ((0, WEIGHT // 2), (0, WEIGHT)), weight[: WEIGHT // 2])
    src.add("model/w", ((WEIGHT // 2, WEIGHT), (0, WEIGHT)), weight[WEIGHT // 2:])
    src.add("model/left", full, wide[:, :WEIGHT],
            lambda: wide.numpy()[:, :WEIGHT])
    src.add("optimizer/state/a/step", (), step)
    shape = (WEIGHT, WEIGHT)
    specs = [TensorSpec(p, shape, "float32", {"ucp": {"role": "parameter"}})
             for p in ("optimizer/state/a/master", "optimizer/state/b/master", "model/w",
                       "model/left")]
    specs.append(TensorSpec("optimizer/state/a/step", (), "int64",
                            {"ucp": {"role": "optimizer_state"}}))
    expected = {"optimizer/state/a/master": flat[:n].reshape(shape).numpy().copy(),
                "optimizer/state/b/master": flat[n:].reshape(shape).numpy().copy(),
                "model/w": weight.numpy().copy(),
                "model/left": wide[:, :WEIGHT].numpy().copy(),
                "optimizer/state/a/step": step.numpy().copy()}
    return src, specs, expected


def _check(path: Path, expected: dict[str, np.ndarray[Any, Any]]) -> None:
    with ucpformat.open_checkpoint(path) as ck:
        for name, values in expected.items():
            assert ck[name].read().tobytes() == values.tobytes(), name


def test_engine_fragments_stage_through_a_bounded_pool(tmp_path: Path) -> None:
    cap = 2 * WEIGHT * WEIGHT * 4 + 4 * ALIGN_BYTES  # two weights at a time
    pool = HostBufferPool(cap, pin=False)
    events = Events()
    src, specs, expected = _engine_like(Staging(pool=pool, cpu=True, recorder=events))
    run_pipeline(tmp_path / "ckpt", SingleProcess(), specs=specs, source=src, durable=False,
                 workers=2)
    _check(tmp_path / "ckpt", expected)
    staged = [EngineFragments.key(p, i) for p, held in src.items.items()
              for i in range(len(held))]
    assert sorted(events.keys("copy-start")) == sorted(events.keys("release")) == sorted(staged)
    assert pool.stats.peak_allocated_bytes <= cap  # 6 fragments, 80 KiB, in a 40 KiB pool
    assert pool.stats.in_use_bytes == 0 and pool.stats.reuses > 0


def test_engine_fragments_on_the_cpu_are_not_copied_by_default(tmp_path: Path) -> None:
    pool = HostBufferPool(1 << 20, pin=False)
    src, specs, expected = _engine_like(Staging(pool=pool))
    run_pipeline(tmp_path / "ckpt", SingleProcess(), specs=specs, source=src, durable=False)
    _check(tmp_path / "ckpt", expected)
    assert pool.stats.allocations == 0  # numpy views of the engine's memory, as before


def test_a_failed_copy_of_an_engine_fragment_commits_nothing(tmp_path: Path) -> None:
    pool = HostBufferPool(1 << 20, pin=False)
    src, specs, _ = _engine_like(Staging(pool=pool, cpu=True, copier=FailingCopier(3)))
    with pytest.raises(WriteError, match="device lost"):
        run_pipeline(tmp_path / "ckpt", SingleProcess(), specs=specs, source=src,
                     durable=False)
    src.stop()  # as ucpformat.deepspeed.save does after the pipeline, whatever happened
    with pytest.raises(UCPError):
        ucpformat.open_checkpoint(tmp_path / "ckpt")
    assert pool.stats.in_use_bytes == 0  # every buffer came back


def test_the_snapshot_of_engine_fragments_is_a_copy_in_reused_buffers(tmp_path: Path) -> None:
    pool = HostBufferPool(None, pin=False)
    src, specs, expected = _engine_like(Staging(pool=HostBufferPool(1, pin=False)))
    copier = FailingCopier(0)  # never fails
    snap = Snapshot(pool, copier)
    frags = src.snapshot(snap)
    snap.guard()
    with torch.no_grad():  # training goes on: every engine tensor changes
        for tensor in src.tensors():
            tensor.add_(1)
    snap.wait()
    run_pipeline(tmp_path / "ckpt", SingleProcess(), specs=specs, source=frags, durable=False)
    _check(tmp_path / "ckpt", expected)  # the values at the snapshot
    snap.release()
    allocated = pool.stats.allocated_bytes
    again = Snapshot(pool, copier)
    src.snapshot(again)
    again.release()
    assert pool.stats.allocated_bytes == allocated and pool.stats.reuses >= 6

"""The streaming engine: results in order, bounded memory, errors surface, nothing committed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.errors import IncompleteCheckpointError, WriteError
from ucpformat.format import dtypes
from ucpformat.importers._engine import Scan, TensorSource, write_scan
from ucpformat.interchange import bounded_map


def test_bounded_map_keeps_order_and_memory_bound() -> None:
    sizes = [5, 1, 8, 3, 20, 2, 7, 7, 1, 9]
    held = 0
    peak = 0
    lock = threading.Lock()

    def work(n: int) -> int:
        nonlocal held, peak
        with lock:
            held += n
            peak = max(peak, held)
        time.sleep(0.001 * n)
        return n

    out = []
    for n in bounded_map(work, sizes, lambda n: n, workers=4, memory_limit=10):
        out.append(n)
        with lock:
            held -= n
    assert out == sizes
    assert peak <= 20  # the one item larger than the limit ran alone
    assert max(sizes) == 20


def test_bounded_map_raises_the_first_error() -> None:
    def work(n: int) -> int:
        if n == 3:
            raise ValueError("three")
        return n

    with pytest.raises(ValueError, match="three"):
        list(bounded_map(work, [1, 2, 3, 4, 5], lambda n: 1, workers=2, memory_limit=4))


def _scan(fail: bool = False) -> Scan:
    scan = Scan("test", "/nowhere")
    f32 = dtypes.BY_NAME["float32"]

    def reader(i: int) -> Any:
        def read() -> np.ndarray[Any, Any]:
            if fail and i == 7:
                raise OSError("disk on fire")
            return np.full((64, 4), i, np.float32)

        return read

    for i in range(12):
        scan.tensors.append(TensorSource(f"model/t{i}", (64, 4), f32, reader(i)))
    return scan


def test_a_failed_source_read_commits_nothing(tmp_path: Path) -> None:
    with pytest.raises(WriteError, match="disk on fire"):
        write_scan(_scan(fail=True), tmp_path / "ckpt", durable=False, memory_limit=2048)
    with pytest.raises(IncompleteCheckpointError):
        ucpformat.open(tmp_path / "ckpt")
    result = write_scan(_scan(), tmp_path / "ckpt", overwrite=True, durable=False,
                        memory_limit=2048, workers=3)
    assert result.tensors == 12
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert float(ckpt["model/t11"].read()[0, 0]) == 11.0

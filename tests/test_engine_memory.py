"""New memory for what a load reads: large arrays mapped without huge-page advice."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.engine.memory import MAPPED_BYTES, new_array


def _mapping(array: np.ndarray[Any, Any]) -> mmap.mmap | None:
    base: Any = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else getattr(
            base, "obj", None)
    return base


def test_a_large_array_is_its_own_anonymous_mapping() -> None:
    rows = MAPPED_BYTES // (4 * 256)
    big = new_array((rows, 256), np.float32)
    assert big.shape == (rows, 256) and big.dtype == np.float32
    assert big.flags.c_contiguous and big.flags.writeable
    assert _mapping(big) is not None
    assert big.ctypes.data % mmap.PAGESIZE == 0
    big[...] = 3.0
    assert float(big.sum()) == 3.0 * big.size
    small = new_array((16,), "<u2")
    assert _mapping(small) is None and small.dtype == np.dtype("<u2")


def test_a_load_reads_a_large_tensor_into_mapped_memory_that_outlives_the_checkpoint(
    tmp_path: Path,
) -> None:
    values = np.arange(MAPPED_BYTES // 4 + 1024, dtype=np.float32).reshape(-1, 1024)
    ucpformat.save(tmp_path / "c", {"model": {"w": values, "b": values[0, :8].copy()}},
                   durable=False)
    ckpt = ucpformat.open_checkpoint(tmp_path / "c")
    big, small = ckpt["model/w"].read(), ckpt["model/b"].read()
    assert _mapping(big) is not None and _mapping(small) is None
    del ckpt
    gc.collect()
    np.testing.assert_array_equal(big, values)  # the mapping lives as long as its array
    np.testing.assert_array_equal(small, values[0, :8])


def test_a_loaded_tensor_keeps_its_mapping() -> None:
    torch = pytest.importorskip("torch")
    from ucpformat.torch.numpy_bridge import from_numpy

    array = new_array((MAPPED_BYTES // 4,), np.float32)
    array[...] = 1.5
    tensor = from_numpy(array)
    del array
    gc.collect()
    assert float(tensor.sum()) == 1.5 * tensor.numel()
    assert torch.equal(tensor * 2, torch.full_like(tensor, 3.0))

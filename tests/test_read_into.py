"""Reading into caller-owned memory: Tensor.read_region(out=) and read_local(out=)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.helpers import flip_byte
from ucpformat.checkpoint.reader import Region
from ucpformat.distributed import read_local
from ucpformat.errors import ChecksumError, LayoutError, SelectionError
from ucpformat.layout.boxes import LocalMap, Piece
from ucpformat.layout.dtensor import Shard, StridedShard, dtensor_local_map
from ucpformat.store import LocalStore


@pytest.fixture
def ckpt(tmp_path: Path) -> ucpformat.Checkpoint:
    a = np.arange(13 * 6, dtype=np.float32).reshape(13, 6)
    ucpformat.save(tmp_path / "c", {"model": {"w": a, "s": np.float32(2.5)}}, chunk_bytes=48)
    return ucpformat.open_checkpoint(tmp_path / "c")


def test_read_region_into_out(ckpt: ucpformat.Checkpoint) -> None:
    t = ckpt.tensor("model", "w")
    whole = t.read()
    buf = np.full((20, 6), -1, np.float32)
    got = t.read_region([3, 0], [11, 6], out=buf[5:13])
    assert got.base is buf or got is buf[5:13] or np.shares_memory(got, buf)
    assert np.array_equal(buf[5:13], whole[3:11])
    assert (buf[:5] == -1).all() and (buf[13:] == -1).all()
    strided = np.zeros((8, 12), np.float32)[:, ::2]  # not contiguous: still correct
    t.read_region([3, 0], [11, 6], out=strided)
    assert np.array_equal(strided, whole[3:11])
    with pytest.raises(SelectionError):
        t.read_region([0, 0], [2, 6], out=np.zeros((3, 6), np.float32))
    with pytest.raises(SelectionError):
        t.read_region([0, 0], [2, 6], out=np.zeros((2, 6), np.float64))
    frozen = np.zeros((2, 6), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(SelectionError):
        t.read_region([0, 0], [2, 6], out=frozen)


def test_read_local_into_out(ckpt: ucpformat.Checkpoint) -> None:
    whole = ckpt.tensor("model", "w").read()
    for placements, mesh in (([Shard(0)], [4]), ([StridedShard(0, 2), Shard(0)], [2, 2])):
        coords = [1] * len(mesh)
        lm = dtensor_local_map(whole.shape, mesh, placements, coords)
        expect = read_local(ckpt, "model/w", lm)
        out = np.empty(lm.local_shape, np.float32)
        assert read_local(ckpt, "model/w", lm, out=out) is out
        assert np.array_equal(out, expect)
    scalar = np.zeros((), np.float32)
    read_local(ckpt, "model/s", LocalMap((), (Piece((), ()),)), out=scalar)
    assert scalar == np.float32(2.5)
    with pytest.raises(LayoutError):
        read_local(ckpt, "model/w", lm, out=np.empty((1, 1), np.float32))



class _SlowStore(LocalStore):
    """Reads of ``slow`` keys take a while (a slow disk or object store)."""

    def __init__(self, root: Path, slow: str) -> None:
        super().__init__(root, durable=False)
        self.slow = slow

    def read_into(self, key: str, offset: int, buffers: Any) -> int | None:
        if key.startswith(self.slow):
            time.sleep(0.3)
        return super().read_into(key, offset, buffers)


def test_a_failed_read_leaves_no_write_behind(tmp_path: Path) -> None:
    """When one chunk of a batch fails, the call returns (raises) only once no other chunk
    is still being written into the caller's memory: a caller that then loads another
    checkpoint into the same tensors (the previous one, after a damaged newest) must not
    have them overwritten behind its back by the failed read."""
    a = np.arange(64, dtype=np.float32)
    ucpformat.save(tmp_path / "c", {"model": {"a": a, "b": a + 1}}, durable=False)
    flip_byte(tmp_path / "c" / "model" / "a" / "c" / "0", 3)
    ckpt = ucpformat.open_checkpoint(_SlowStore(tmp_path / "c", "model/b/"))
    out_a, out_b = np.zeros(64, np.float32), np.zeros(64, np.float32)
    with pytest.raises(ChecksumError):
        ckpt.read_regions([Region("model/a", [0], [64], out_a),
                           Region("model/b", [0], [64], out_b)])
    seen = out_b.copy()
    time.sleep(0.6)
    assert np.array_equal(out_b, seen), "out was written after read_regions had raised"

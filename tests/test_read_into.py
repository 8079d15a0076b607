"""Reading into caller-owned memory: Tensor.read_region(out=) and read_local(out=)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ucpformat
from ucpformat.distributed import read_local
from ucpformat.errors import LayoutError, SelectionError
from ucpformat.layout.boxes import LocalMap, Piece
from ucpformat.layout.dtensor import Shard, StridedShard, dtensor_local_map


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


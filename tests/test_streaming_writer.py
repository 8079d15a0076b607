"""StreamingWriter: declare every array first, write tensors one by one, commit last."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint.streaming import StreamingWriter
from ucpformat.errors import (
    CheckpointExistsError,
    IncompleteCheckpointError,
    InvalidValueError,
    WriteError,
)


def test_streamed_checkpoint_equals_its_data(tmp_path: Path) -> None:
    import ml_dtypes

    rng = np.random.default_rng(0)
    a = rng.standard_normal((100, 7)).astype(np.float32)
    b = rng.standard_normal(33).astype(ml_dtypes.bfloat16)
    w = StreamingWriter(tmp_path / "ckpt", chunk_bytes=256, shard_bytes=1024, durable=False)
    w.declare("model/a", a.shape, "float32", attributes={"ucp": {"role": "parameter"}})
    w.declare("model/b", b.shape, b.dtype)
    w.declare("model/empty", (0, 3), "int64")
    w.group("optimizer", values={"type": "x", "param_groups": [{"params": ["a"]}]})
    w.group("optimizer", values={"extra": 1})
    w.write("model/b", b)
    # a large tensor can be given one stored object at a time
    regions = w.object_regions("model/a")
    assert len(regions) > 1
    for coords, region in regions:
        w.write_object("model/a", coords, a[region])
    w.write("model/empty", np.zeros((0, 3), np.int64))
    result = w.commit(metadata={"source": "test"}, root_values={"step": 4})
    assert result.tensors == 3
    ckpt = ucpformat.open(tmp_path / "ckpt")
    np.testing.assert_array_equal(ckpt["model/a"].read(), a)
    assert ckpt["model/b"].read().tobytes() == b.tobytes()
    assert ckpt.values("optimizer") == {"type": "x", "param_groups": [{"params": ["a"]}],
                                        "extra": 1}
    assert ckpt.values() == {"step": 4}
    assert ckpt.metadata == {"source": "test"}
    assert ucpformat.validate(tmp_path / "ckpt", deep=True).valid


def test_commit_refuses_missing_objects_and_nothing_opens(tmp_path: Path) -> None:
    w = StreamingWriter(tmp_path / "ckpt", durable=False)
    w.declare("model/a", (4,), "float32")
    w.declare("model/b", (4,), "float32")
    w.write("model/a", np.ones(4, np.float32))
    with pytest.raises(WriteError, match="model/b"):
        w.commit()
    with pytest.raises(IncompleteCheckpointError):
        ucpformat.open(tmp_path / "ckpt")


def test_one_writer_per_object_and_no_silent_casts(tmp_path: Path) -> None:
    w = StreamingWriter(tmp_path / "ckpt", durable=False)
    w.declare("model/a", (4,), "float32")
    with pytest.raises(InvalidValueError, match="never cast"):
        w.write("model/a", np.ones(4, np.float64))
    with pytest.raises(InvalidValueError, match="shape"):
        w.write("model/a", np.ones(5, np.float32))
    w.write("model/a", np.ones(4, np.float32))
    with pytest.raises(WriteError, match="already written"):
        w.write("model/a", np.ones(4, np.float32))
    with pytest.raises(InvalidValueError, match="already declared"):
        w.declare("model/a", (4,), "float32")
    with pytest.raises(InvalidValueError, match="declared"):
        w.write("model/nope", np.ones(4, np.float32))
    with pytest.raises(InvalidValueError, match="reserved"):
        w.declare("x.ucp.json/a", (1,), "float32")


def test_threads_write_concurrently(tmp_path: Path) -> None:
    w = StreamingWriter(tmp_path / "ckpt", chunk_bytes=64, shard_bytes=256, durable=False)
    arrays = {f"model/t{i}": np.full((50, 3), i, np.int32) for i in range(16)}
    for path, a in arrays.items():
        w.declare(path, a.shape, a.dtype)
    threads = [threading.Thread(target=w.write, args=(p, a)) for p, a in arrays.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.commit()
    ckpt = ucpformat.open(tmp_path / "ckpt")
    for path, a in arrays.items():
        np.testing.assert_array_equal(ckpt[path].read(), a)


def test_never_replaces_a_committed_checkpoint_unasked(tmp_path: Path) -> None:
    ucpformat.save(tmp_path / "ckpt", {"model": {"a": np.ones(2, np.float32)}})
    with pytest.raises(CheckpointExistsError):
        StreamingWriter(tmp_path / "ckpt")
    StreamingWriter(tmp_path / "ckpt", overwrite=True)
    with pytest.raises(IncompleteCheckpointError):
        ucpformat.open(tmp_path / "ckpt")

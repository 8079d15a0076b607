"""The I/O paths the benchmarks called for: batched durability, coalesced and batched reads.

These check how the library does its I/O (how many fsyncs, how many read requests, which
memory is read into), not how fast: a regression here is a slowdown that no timing in a
test could catch reliably.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.helpers import fail_fsync
from ucpformat import errors
from ucpformat.checkpoint.metadata import IN_PROGRESS_KEY, ZARR_JSON
from ucpformat.checkpoint.reader import Checkpoint, Region
from ucpformat.engine import read as read_engine
from ucpformat.engine.compression import Compression
from ucpformat.engine.shard_index import encode_index
from ucpformat.format.dtypes import by_name
from ucpformat.store import LocalStore


class RecordingStore(LocalStore):
    """A LocalStore that logs puts, flushes and every fsync (by path) in order."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(root, durable=True)
        self.log: list[tuple[str, str]] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            self.log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        monkeypatch.setattr("ucpformat.store.os.fsync", fsync)

    def put(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        self.log.append(("put", os.path.join(self.location, *key.split("/"))))
        n = super().put(key, buffers, atomic=atomic)
        self.log.append(("put-done", key))
        return n

    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        self.log.append(("put", os.path.join(self.location, *key.split("/"))))
        n = super().create(key, buffers, atomic=atomic)
        self.log.append(("put-done", key))
        return n

    def flush(self) -> None:
        self.log.append(("flush", ""))
        super().flush()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_durability_is_batched_and_precedes_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RecordingStore(tmp_path / "c", monkeypatch)
    rng = np.random.default_rng(0)
    state = {"model": {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32)
                       for i in range(12)}}
    ucpformat.save(store, state, chunk_bytes=4096)
    log = store.log
    root = os.path.join(store.location, ZARR_JSON)
    root_put = next(i for i, (op, p) in enumerate(log) if op == "put" and p == root)
    data_files = {p for op, p in log[:root_put] if op == "put"
                  and not p.endswith(IN_PROGRESS_KEY)}
    fsynced = [p for op, p in log if op == "fsync"]
    # every file is fsynced exactly once, and before the root (the commit) is written
    for path in data_files:
        assert fsynced.count(path) == 1, path
        assert log.index(("fsync", path)) < root_put
    # a non-atomic put returns without waiting for its own fsync
    for i, (op, path) in enumerate(log):
        if op == "put" and path in data_files:
            assert log[i + 1][0] == "put-done" or log[i + 1][0] == "put"
    # each directory is fsynced once per flush, not once per file under it
    dirs = [p for p in fsynced if os.path.isdir(p)]
    flushes = sum(1 for op, _ in log if op == "flush")
    distinct = len(set(dirs))
    assert len(dirs) <= distinct * (flushes + 2)
    assert len(fsynced) <= len(data_files) + distinct + 2 * flushes + 4
    got = ucpformat.open(store.location)["model/w3"].read()
    assert np.array_equal(got, state["model"]["w3"])


def test_a_failed_fsync_fails_the_save_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_fsync(monkeypatch, 5)
    with pytest.raises(errors.WriteError):
        ucpformat.save(tmp_path / "c", {"model": {f"w{i}": np.ones((8, 8), np.float32)
                                                  for i in range(10)}})
    assert not (tmp_path / "c" / ZARR_JSON).exists()
    with pytest.raises((errors.IncompleteCheckpointError, errors.CheckpointNotFoundError)):
        ucpformat.open(tmp_path / "c")
    assert not [p for p in (tmp_path / "c").rglob("*") if not p.is_dir()]  # partial: removed


@pytest.fixture
def many_chunks(tmp_path: Path) -> tuple[Path, np.ndarray[Any, Any]]:
    a = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)  # 16 chunks of 4 rows
    ucpformat.save(tmp_path / "c", {"model": {"w": a}}, chunk_bytes=16 << 10, durable=False)
    return tmp_path / "c", a


def test_a_small_shard_wanted_whole_is_read_with_one_request(
    many_chunks: tuple[Path, np.ndarray[Any, Any]]
) -> None:
    path, a = many_chunks
    with ucpformat.open(path) as ckpt:
        assert ckpt.arrays["model/w"].nbytes <= read_engine.WHOLE_OBJECT_BYTES
        assert np.array_equal(ckpt["model/w"].read(), a)
        assert ckpt.stats.requests == 1  # index and chunks together, checked from memory
        ckpt.stats.reset()
        assert np.array_equal(ckpt["model/w"][5:41], a[5:41])  # a part: index, then a run
        assert ckpt.stats.requests == 2


def test_adjacent_chunks_are_read_with_one_request(
    many_chunks: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(read_engine, "WHOLE_OBJECT_BYTES", 0)  # every shard by its index
    monkeypatch.setattr(read_engine, "IN_ONE_BYTES", 0)  # in runs, even when read whole
    path, a = many_chunks
    with ucpformat.open(path) as ckpt:
        meta = ckpt.arrays["model/w"]
        assert meta.chunks_per_shard == (16, 1)
        assert np.array_equal(ckpt["model/w"].read(), a)
        assert ckpt.stats.requests == 2  # the shard index, then one run of 16 chunks
        ckpt.stats.reset()
        assert np.array_equal(ckpt["model/w"][5:41], a[5:41])
        assert ckpt.stats.requests == 2
        assert ckpt.stats.bytes_read <= 11 * (16 << 10) + 11 * 4 + 16 * 16 + 4
        ckpt.stats.reset()
        with pytest.MonkeyPatch.context() as mp:  # runs are capped
            mp.setattr(Checkpoint, "RUN_BYTES", 3 * ((16 << 10) + 4))
            assert np.array_equal(ckpt["model/w"].read(), a)
        assert ckpt.stats.requests == 1 + 6


def read_by(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a whole read take ``path``: "run" (the index, then runs of chunks),
    "whole-shard" (a small shard in one buffer, then checked) or "in-one" (one request
    straight into the caller's array, the default for uncompressed row blocks)."""
    if path != "in-one":
        monkeypatch.setattr(read_engine, "IN_ONE_BYTES", 0)
    if path == "run":
        monkeypatch.setattr(read_engine, "WHOLE_OBJECT_BYTES", 0)


@pytest.mark.parametrize("whole", ["run", "whole-shard", "in-one"])
def test_a_damaged_chunk_inside_a_run_is_named(
    many_chunks: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch, whole: str
) -> None:
    read_by(whole, monkeypatch)
    path, _ = many_chunks
    shard = path / "model" / "w" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[7 * ((16 << 10) + 4) + 100] ^= 0xFF  # inside chunk 7
    shard.write_bytes(bytes(data))
    with ucpformat.open(path) as ckpt, pytest.raises(errors.ChecksumError) as exc:
        ckpt["model/w"].read()
    assert "(7, 0)" in str(exc.value)
    assert exc.value.tensor == "model/w"


@pytest.mark.parametrize("whole", ["run", "whole-shard", "in-one"])
def test_a_shard_cut_short_inside_a_run_is_an_error(
    many_chunks: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch, whole: str
) -> None:
    read_by(whole, monkeypatch)
    path, _ = many_chunks
    shard = path / "model" / "w" / "c" / "0" / "0"
    data = shard.read_bytes()
    index = data[-(16 * 16 + 4):]
    shard.write_bytes(data[: 9 * ((16 << 10) + 4)] + index)  # chunks 9.. gone, index kept
    with ucpformat.open(path) as ckpt, pytest.raises(errors.CorruptDataError):
        ckpt["model/w"].read()


#: Damage to a shard of 16 chunks of 4 rows (the last one past the array's edge) and how
#: to do it: (shard bytes, chunk size with its CRC32C, index size) -> damaged bytes.
SHARD_DAMAGE: dict[str, Any] = {
    "a chunk's byte": lambda d, c, i: flip(d, 7 * c + 100),
    "a chunk's CRC32C": lambda d, c, i: flip(d, 4 * c - 2),
    "a byte past the array's edge": lambda d, c, i: flip(d, 16 * c - 8),
    "the index's CRC32C": lambda d, c, i: flip(d, len(d) - 1),
    "an index entry beyond the shard": lambda d, c, i: d[:-i] + encode_index(
        np.array([[k * c, c] for k in range(15)] + [[16 * c, c]], dtype="<u8")),
    "the shard cut short": lambda d, c, i: d[:-1],
    "a byte more": lambda d, c, i: d + b"\0",
    "the chunks in another order": lambda d, c, i: d[c:16 * c] + d[:c] + encode_index(
        np.array([[15 * c, c]] + [[k * c, c] for k in range(15)], dtype="<u8")),
}


def flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1:]


def read_error(path: Path) -> tuple[Any, ...]:
    """What a whole read of ``model/w`` raises (type, rule, tensor, message), or its values;
    and the requests it made."""
    with ucpformat.open(path) as ckpt:
        try:
            got: Any = ckpt["model/w"].read().tobytes()
        except errors.UCPError as exc:
            got = (type(exc), exc.rule, exc.tensor, str(exc))
        return got, ckpt.stats.requests


@pytest.mark.parametrize("damage", SHARD_DAMAGE)
def test_the_read_in_one_request_refuses_damage_as_the_chunk_by_chunk_read_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    # 61 rows: the 16th chunk holds one row of the array and three past its edge
    a = np.arange(61 * 1024, dtype=np.float32).reshape(61, 1024)
    ucpformat.save(tmp_path / "c", {"model": {"w": a}}, chunk_bytes=16 << 10, durable=False)
    assert read_error(tmp_path / "c") == (a.tobytes(), 1)  # one request, every check passed
    shard = tmp_path / "c" / "model" / "w" / "c" / "0" / "0"
    shard.write_bytes(SHARD_DAMAGE[damage](shard.read_bytes(), (16 << 10) + 4, 16 * 16 + 4))
    in_one, requests = read_error(tmp_path / "c")
    with monkeypatch.context() as m:
        read_by("run", m)
        by_chunks, _ = read_error(tmp_path / "c")
    assert in_one == by_chunks
    if damage == "the chunks in another order":
        assert in_one == a.tobytes() and requests > 1  # read again, chunk by chunk
    else:
        assert in_one[0] in (errors.ChecksumError, errors.CorruptDataError)


def test_a_small_object_wanted_whole_is_read_with_one_system_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a shard of 8 chunks, an unsharded chunk, a scalar: each read with one preadv (the
    # file's size, from the check of the descriptor, says that nothing is left to read)
    model = {"w": np.arange(64 * 300, dtype=np.float32).reshape(64, 300),
             "b": np.arange(300, dtype=np.float32), "s": np.float32(4.5)}
    ucpformat.save(tmp_path / "c", {"model": model}, chunk_bytes=8 * 1200, durable=False)
    calls: list[int] = []
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        calls.append(fd)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with ucpformat.open(tmp_path / "c") as ckpt:
        assert ckpt.arrays["model/w"].chunks_per_shard == (8, 1)
        got = ckpt.read_whole(sorted(ckpt.arrays))
        assert ckpt.stats.requests == 3
    assert len(calls) == 3
    for path, value in zip(sorted(ckpt.arrays), got, strict=True):
        assert np.array_equal(value, model[path.split("/")[1]])


def test_a_checkpoint_that_has_read_is_freed_as_soon_as_it_is_let_go(
    many_chunks: tuple[Path, np.ndarray[Any, Any]]
) -> None:
    # it keeps a reader per array read: none may hold it back (a cycle waits for the
    # cyclic collector, and a checkpoint's metadata can be hundreds of MiB)
    path, a = many_chunks
    ckpt = ucpformat.open(path)
    assert np.array_equal(ckpt.read_whole(["model/w"])[0], a) and ckpt.stats.requests == 1
    ckpt.close()
    gone = weakref.ref(ckpt)
    gc.disable()
    try:
        del ckpt
        assert gone() is None
    finally:
        gc.enable()


def test_read_regions_reads_many_tensors_in_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    model = {f"t{i}": rng.standard_normal((i + 1, 300)).astype(np.float32) for i in range(20)}
    model["s"] = np.float32(4.5)
    ucpformat.save(tmp_path / "c", {"model": model}, chunk_bytes=2048, durable=False)
    maps: list[int] = []
    real = Checkpoint._map

    def counting(self: Checkpoint, fn: Any, items: Any, **kw: Any) -> list[Any]:
        maps.append(len(items))
        return real(self, fn, items, **kw)

    monkeypatch.setattr(Checkpoint, "_map", counting)
    with ucpformat.open(tmp_path / "c") as ckpt:
        regions = [Region(k, [0] * ckpt[k].ndim, list(ckpt[k].shape)) for k in ckpt]
        outs = ckpt.read_regions(regions)
    assert len(maps) == 2  # shard indexes of every tensor, then every chunk run
    for region, out in zip(regions, outs, strict=True):
        assert np.array_equal(out, model[region.path.split("/")[1]])


def test_reads_go_into_caller_memory_without_allocating_the_tensor(
    many_chunks: tuple[Path, np.ndarray[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a shard of at most WHOLE_OBJECT_BYTES wanted whole is read into one buffer of its
    # size: test_a_small_shard_wanted_whole_is_read_with_one_request)
    monkeypatch.setattr(read_engine, "WHOLE_OBJECT_BYTES", 0)
    monkeypatch.setattr(read_engine, "IN_ONE_BYTES", 0)
    path, a = many_chunks
    out = np.empty_like(a)
    with ucpformat.open(path) as ckpt:
        tracemalloc.start()
        try:
            ckpt.read_regions([Region("model/w", [0, 0], list(a.shape), out)])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert np.array_equal(out, a)
    assert peak < a.nbytes // 4  # no tensor-sized (or chunk-run-sized) buffer


def test_saving_does_not_copy_the_tensor(tmp_path: Path) -> None:
    a = np.random.default_rng(2).standard_normal((1024, 512)).astype(np.float32)  # 2 MiB
    tracemalloc.start()
    try:
        ucpformat.save(tmp_path / "c", {"model": {"w": a}}, chunk_bytes=256 << 10,
                       durable=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < a.nbytes // 4
    assert np.array_equal(ucpformat.open(tmp_path / "c")["model/w"].read(), a)


def test_blosc_options_and_typesize() -> None:
    f32, bf16 = by_name("float32"), by_name("bfloat16")
    c = Compression.parse("blosc:lz4:5:bitshuffle", f32)
    assert c is not None and dict(c.configuration) == {
        "cname": "lz4", "clevel": 5, "shuffle": "bitshuffle", "typesize": 4, "blocksize": 0}
    c = Compression.parse("blosc", bf16)
    assert c is not None and c.configuration["typesize"] == 2
    assert c.configuration["shuffle"] == "shuffle" and c.configuration["cname"] == "zstd"
    d = Compression.parse({"name": "blosc", "configuration": {
        "cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 0}}, bf16)
    assert d is not None and d.configuration["typesize"] == 2
    with pytest.raises(errors.UnsupportedFeatureError):
        Compression.parse("blosc:snappy", f32)


def test_a_store_saves_again_after_its_directory_was_removed(tmp_path: Path) -> None:
    """A LocalStore remembers the directories it has made (one makedirs per directory);
    a directory removed since, e.g. a checkpoint location deleted by a
    CheckpointManager's rotation or by hand, is made again on the next save."""
    import shutil

    store = LocalStore(tmp_path / "c", durable=False)
    w = np.arange(10, dtype=np.float32)
    ucpformat.save(store, {"model": {"w": w}})
    shutil.rmtree(tmp_path / "c")
    ucpformat.save(store, {"model": {"w": w + 1}})
    assert np.array_equal(ucpformat.open(tmp_path / "c")["model/w"].read(), w + 1)

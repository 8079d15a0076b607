"""The flat API's fast reads: single-chunk tensors handed out as checked copy-on-write
mappings of their files, other uncompressed tensors read with one request per file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.errors import ChecksumError, CorruptDataError  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="maps through Linux's libc"),
]


def mapped_file(t: Any) -> str | None:
    """The file whose mapping holds the tensor's memory (None: anonymous memory)."""
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_single_chunk_tensors_are_checked_copy_on_write_mappings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ucpformat.engine import read as read_engine

    monkeypatch.setattr(read_engine, "MAP_MIN_BYTES", 1)  # small tensors too, here
    src = {"w": torch.arange(96, dtype=torch.float32).reshape(8, 12),
           "b": torch.arange(5, dtype=torch.bfloat16)}
    ucpt.save_file(src, tmp_path / "c", durable=False)
    chunk = tmp_path / "c" / "model" / "w" / "c" / "0" / "0"
    before = chunk.read_bytes()
    back = ucpt.load_file(tmp_path / "c")
    assert all(torch.equal(back[k], src[k]) for k in src)
    assert mapped_file(back["w"]) == str(chunk)
    assert mapped_file(back["b"]) == str(tmp_path / "c" / "model" / "b" / "c" / "0")
    # writable, and a write changes this process's copy, never the file
    back["w"].add_(1)
    assert torch.equal(back["w"], src["w"] + 1)
    assert chunk.read_bytes() == before
    assert torch.equal(ucpt.load_file(tmp_path / "c")["w"], src["w"])
    with ucpt.safe_open(tmp_path / "c", framework="numpy") as f:
        array = f.get_tensor("w")
        assert array.flags.writeable and (array == src["w"].numpy()).all()
    # a flipped byte in a mapped chunk is refused before any value is handed out
    flip(chunk, 17)
    with pytest.raises(ChecksumError) as info:
        ucpt.load_file(tmp_path / "c")
    assert info.value.rule == "UCP-1.0-R041" and info.value.tensor == "model/w"
    assert "chunk (0, 0)" in str(info.value) and "CRC32C" in str(info.value)


def test_multi_chunk_tensors_are_read_with_one_request_and_every_chunk_checked(
        tmp_path: Path) -> None:
    # 701 rows of 3 bf16 (6 bytes): chunks of 88 rows, the last one past the edge; chunk k
    # starts at byte k * (528 + 4) of its shard, misaligned for the type from k = 1
    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(701, 3, generator=g).to(torch.bfloat16),
           "big": torch.randn(3000, 48, generator=g)}  # 1,000 chunks, over 512 KiB
    ucpt.save_file(src, tmp_path / "c", durable=False, chunk_bytes=768)
    with ucpformat.open(tmp_path / "c") as ckpt:
        assert ckpt.arrays["model/w"].chunks_per_shard[0] > 1
        back = ucpt.load_file(ckpt)
        assert ckpt.stats.requests == 2  # one request per shard: no index read, no plan
    for k in src:
        assert torch.equal(back[k], src[k]), k
        assert mapped_file(back[k]) is None  # a copy: the values are not contiguous on disk
        assert back[k].data_ptr() % back[k].element_size() == 0
    shard = tmp_path / "c" / "model" / "w" / "c" / "0" / "0"
    chunk_rows = ucpformat.open(tmp_path / "c").arrays["model/w"].chunk_shape[0]
    flip(shard, 2 * (chunk_rows * 6 + 4) + 1)  # a byte of the third chunk
    with pytest.raises(ChecksumError) as info:
        ucpt.load_file(tmp_path / "c")
    assert info.value.rule == "UCP-1.0-R041" and info.value.tensor == "model/w"
    assert "chunk (2, 0)" in str(info.value)


def test_compressed_small_and_damaged_chunks_take_the_read_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = {"w": torch.arange(96, dtype=torch.float32).reshape(8, 12)}
    ucpt.save_file(src, tmp_path / "s", durable=False)
    assert mapped_file(ucpt.load_file(tmp_path / "s")["w"]) is None  # under MAP_MIN_BYTES
    from ucpformat.engine import read as read_engine

    monkeypatch.setattr(read_engine, "MAP_MIN_BYTES", 1)
    ucpt.save_file(src, tmp_path / "z", durable=False, compression="zstd")
    back = ucpt.load_file(tmp_path / "z")
    assert torch.equal(back["w"], src["w"]) and mapped_file(back["w"]) is None
    ucpt.save_file(src, tmp_path / "c", durable=False)
    chunk = tmp_path / "c" / "model" / "w" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-1])  # not the size a mapping needs: read, refused
    with pytest.raises(CorruptDataError) as info:
        ucpt.load_file(tmp_path / "c")
    assert info.value.rule == "UCP-1.0-R041" and info.value.tensor == "model/w"


def test_a_shard_laid_out_otherwise_is_read_chunk_by_chunk(tmp_path: Path) -> None:
    # the same chunks in reverse order (another writer may order them so): the one-request
    # read finds an index it did not expect and leaves the shard to the chunk-by-chunk read
    import numpy as np

    from ucpformat.engine.shard_index import encode_index

    src = {"w": torch.arange(701 * 3, dtype=torch.float32).reshape(701, 3)}
    ucpt.save_file(src, tmp_path / "c", durable=False, chunk_bytes=1024)
    shard = tmp_path / "c" / "model" / "w" / "c" / "0" / "0"
    cps = ucpformat.open(tmp_path / "c").arrays["model/w"].chunks_per_shard
    data = shard.read_bytes()
    isize = cps[0] * 16 + 4
    index = np.frombuffer(data[-isize:-4], dtype="<u8").reshape(cps[0], 1, 2).copy()
    chunks = [data[int(o):int(o) + int(n)] for o, n in index.reshape(-1, 2)]
    offset = 0
    for i in reversed(range(cps[0])):
        index[i, 0] = (offset, len(chunks[i]))
        offset += len(chunks[i])
    shard.write_bytes(b"".join(reversed(chunks)) + encode_index(index))
    assert ucpformat.validate(tmp_path / "c").valid
    with ucpformat.open(tmp_path / "c") as ckpt:
        assert torch.equal(ucpt.load_file(ckpt)["w"], src["w"])
        assert ckpt.stats.requests > 1


def test_mappings_alive_at_once_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    from ucpformat.engine import read as read_engine
    from ucpformat.store import posix

    monkeypatch.setattr(read_engine, "MAP_MIN_BYTES", 1)
    src = {f"t{i}": torch.full((4,), float(i)) for i in range(6)}
    ucpt.save_file(src, tmp_path / "c", durable=False)
    before = posix._mappings
    monkeypatch.setattr(posix, "MAX_MAPPINGS", before + 2)
    back = ucpt.load_file(tmp_path / "c")
    assert all(torch.equal(back[k], src[k]) for k in src)
    assert sum(mapped_file(t) is not None for t in back.values()) == 2  # the rest read
    assert posix._mappings == before + 2
    del back  # unmapped once the tensors are gone, and no longer counted
    assert posix._mappings == before


def test_a_mapped_tensor_outlives_the_exit_handlers_registered_before_it(
        tmp_path: Path) -> None:
    """An exit handler (a last save, a summary) may read tensors loaded after it was
    registered: their mappings must not be undone before it runs."""
    import subprocess

    ucpt.save_file({"w": torch.ones(8, 12)}, tmp_path / "c", durable=False)  # one chunk
    code = (
        "import atexit\n"
        "held = {}\n"
        "atexit.register(lambda: print('sum', float(held['w'].sum())))\n"
        "import torch, ucpformat.torch as ucpt\n"
        "from ucpformat.engine import read\n"
        "read.MAP_MIN_BYTES = 1\n"
        f"held.update(ucpt.load_file({str(tmp_path / 'c')!r}))\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('mapped', any(line.split()[-1].endswith('/model/w/c/0/0')\n"
        "                    for line in maps.splitlines()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "mapped True" in done.stdout  # the case this is about
    assert "sum 96.0" in done.stdout


# -- save_file's chunking, and a checkpoint in one file ---------------------------------


def test_save_file_stores_each_tensor_as_one_chunk_unless_told(tmp_path: Path) -> None:
    src = {"w": torch.randn(512, 256), "b": torch.randn(256)}  # 512 KiB: 8 chunks before
    ucpt.save_file(src, tmp_path / "one", durable=False)
    with ucpformat.open(tmp_path / "one") as ckpt:
        assert ckpt.arrays["model/w"].chunk_shape == (512, 256)
        assert ckpt.arrays["model/w"].shard_shape is None
    back = ucpt.load_file(tmp_path / "one")
    assert mapped_file(back["w"]) == str(tmp_path / "one" / "model" / "w" / "c" / "0" / "0")
    ucpt.save_file(src, tmp_path / "small", durable=False, chunk_bytes=64 << 10)
    with ucpformat.open(tmp_path / "small") as ckpt:
        assert ckpt.arrays["model/w"].chunk_shape == (64, 256)  # the size cap alone
    ucpt.save_file(src, tmp_path / "tp", durable=False, chunk_bytes=1 << 20, chunk_splits=8)
    with ucpformat.open(tmp_path / "tp") as ckpt:
        assert ckpt.arrays["model/w"].chunk_shape == (64, 256)  # edges for 8-way splits
    with pytest.raises(ucpformat.UCPError, match="chunk_splits must be at least 1"):
        ucpt.save_file(src, tmp_path / "bad", durable=False, chunk_splits=0)


def test_one_file_tensors_are_checked_mappings_of_the_archive(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(256, 128, generator=g), "e": torch.randn(300, 64, generator=g),
           "n": torch.randn(7, generator=g).to(torch.bfloat16)}
    path = tmp_path / "model.ucpz"
    ucpt.save_file(src, path, durable=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ucpz"]
    before = path.read_bytes()
    back = ucpt.load_file(path)
    assert all(torch.equal(back[k], src[k]) for k in src)
    assert mapped_file(back["w"]) == str(path) and mapped_file(back["e"]) == str(path)
    # small too: in one file, a first mapping is a view of the archive's, no system call
    assert mapped_file(back["n"]) == str(path)
    assert back["n"].data_ptr() % 64 == 0  # (every member's data on a 64-byte boundary)
    again = ucpt.load_file(path)
    back["w"].add_(1)  # this process's copy only: the file and another load are unchanged
    assert torch.equal(again["w"], src["w"]) and path.read_bytes() == before
    with ucpt.safe_open(path) as f:
        assert f.keys() == ["e", "n", "w"]
        assert torch.equal(f.get_slice("e")[10:20], src["e"][10:20])
        first, second = f.get_tensor("w"), f.get_tensor("w")  # one mapping, then its own
        assert mapped_file(first) == mapped_file(second) == str(path)
        first.zero_()
        assert torch.equal(second, src["w"]) and not torch.equal(first, second)
    # a flipped byte of a mapped tensor is refused before any value is handed out
    import struct
    import zipfile

    header = zipfile.ZipFile(path).getinfo("model/e/c/0/0").header_offset
    start = header + 30 + sum(struct.unpack_from("<HH", before, header + 26))
    data = bytearray(before)
    data[start + 1000] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError) as info:
        ucpt.load_file(path)
    assert info.value.rule == "UCP-1.0-R041" and info.value.tensor == "model/e"


def test_a_slice_of_a_one_chunk_tensor_is_copied_out_of_its_checked_mapping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ucpformat.checkpoint.reader import Checkpoint

    def no_read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read into new memory, not mapped")

    src = {"e": torch.arange(300 * 64, dtype=torch.float32).reshape(300, 64)}  # 75 KiB
    for path in (tmp_path / "dir", tmp_path / "one.ucpz"):
        ucpt.save_file(src, path, durable=False)
        with ucpformat.open(path) as ckpt, monkeypatch.context() as patch:
            patch.setattr(Checkpoint, "read_regions", no_read)
            box = ckpt["model/e"][10:20, ::2]
            assert np.array_equal(box, src["e"][10:20, ::2].numpy())
            assert mapped_file(torch.from_numpy(np.ascontiguousarray(box))) is None  # a copy
            assert ckpt.stats.bytes_read == src["e"].nbytes + 4  # the chunk, checked whole
    chunk = tmp_path / "dir" / "model" / "e" / "c" / "0" / "0"
    flip(chunk, 40_000)  # a byte far from the slice: the whole chunk is checked
    with ucpformat.open(tmp_path / "dir") as ckpt, pytest.raises(ChecksumError) as info:
        ckpt["model/e"][10:20]
    assert info.value.rule == "UCP-1.0-R041"


def test_small_tensors_of_one_file_are_views_checked_like_large_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import struct
    import zipfile

    from ucpformat.checkpoint.reader import Checkpoint

    src = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(40)}  # 4 to 160 bytes
    src["flag"] = torch.tensor([True, False])  # bool: decoded, every byte checked (R008)
    path = tmp_path / "small.ucpz"
    ucpt.save_file(src, path, durable=False)
    back = ucpt.load_file(path)
    assert all(torch.equal(back[k], src[k]) for k in src)
    assert all(mapped_file(back[f"t{i}"]) == str(path) for i in range(40))
    assert mapped_file(back["flag"]) is None
    back["t3"].add_(1)  # neighbours on the same page keep their values; the file too
    assert torch.equal(back["t2"], src["t2"]) and torch.equal(back["t4"], src["t4"])
    assert torch.equal(ucpt.load_file(path)["t3"], src["t3"])
    with ucpt.safe_open(path) as f:  # asked for again: read, not a mapping of its own
        first, again = f.get_tensor("t5"), f.get_tensor("t5")
        assert mapped_file(first) == str(path) and mapped_file(again) is None
        assert torch.equal(again, src["t5"]) and torch.equal(f.get_slice("t5")[2:4],
                                                             src["t5"][2:4])
    with monkeypatch.context() as patch, ucpt.safe_open(path) as f:
        # every tensor mapped: the read path (its pause of the collector, its batch of
        # the store, its pools) is not entered at all, once per get_tensor
        patch.setattr(Checkpoint, "read_regions", lambda *a, **k: pytest.fail("read"))
        assert torch.equal(f.get_tensor("t9"), src["t9"])
        assert torch.equal(f.get_tensor("t39"), src["t39"])
    raw = path.read_bytes()
    header = zipfile.ZipFile(path).getinfo("model/t7/c/0").header_offset
    start = header + 30 + sum(struct.unpack_from("<HH", raw, header + 26))
    flipped = bytearray(raw)
    flipped[start + 5] ^= 0x01  # a value of t7: its CRC32C refuses it, mapped or read
    path.write_bytes(bytes(flipped))
    with pytest.raises(ChecksumError) as info:
        ucpt.load_file(path)
    assert info.value.rule == "UCP-1.0-R041" and info.value.tensor == "model/t7"
    renamed = bytearray(raw)
    renamed[header + 30 + len("model/")] ^= 0x20  # its local header names another member
    path.write_bytes(bytes(renamed))
    with pytest.raises(CorruptDataError, match="local header does not match") as info:
        ucpt.load_file(path)
    assert info.value.rule == "UCP-1.0-R077"

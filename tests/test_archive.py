"""A checkpoint in one file (spec §11.5): a ZIP archive of the checkpoint's objects.

What the writer makes (the same objects as a directory, byte for byte; stored, aligned,
CRC-32s right, ZIP64 where needed), what the reader refuses, and that a save into one
file keeps the guarantees of a save into a directory.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.distributed import Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import SingleProcess
from ucpformat.distributed.pipeline import FragmentList
from ucpformat.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptDataError,
    UnsafePathError,
    UnsupportedFeatureError,
    WriteError,
)
from ucpformat.store import ArchiveStore, ArchiveWriter, is_archive_path, zip_layout

FIXED = {"created": "2026-11-28T00:00:00Z", "producer": {"name": "test", "version": "1"}}


def state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "model": {"w": rng.standard_normal((64, 48)).astype(np.float32),
                  "b": np.arange(5, dtype=np.int64),
                  "big": rng.standard_normal((300, 100)).astype(np.float32)},
        "training": {"step": 7},
    }


def save(path: Path, **kwargs: Any) -> None:
    ucpformat.save(path, state(), durable=False, chunk_bytes=8192, **FIXED, **kwargs)


def data_offsets(path: Path) -> dict[str, int]:
    """Where each member's data starts, from Python's zipfile and the local headers."""
    raw = path.read_bytes()
    out = {}
    for info in zipfile.ZipFile(path).infolist():
        nlen, elen = struct.unpack_from("<HH", raw, info.header_offset + 26)
        out[info.filename] = info.header_offset + 30 + nlen + elen
    return out


def test_one_file_holds_the_directory_form_byte_for_byte(tmp_path: Path) -> None:
    save(tmp_path / "dir")
    save(tmp_path / "one.ucpz")
    files = {str(p.relative_to(tmp_path / "dir")): p.read_bytes()
             for p in (tmp_path / "dir").rglob("*") if p.is_file()}
    archive = zipfile.ZipFile(tmp_path / "one.ucpz")
    assert archive.testzip() is None  # every member's CRC-32 is right
    members = {i.filename: archive.read(i) for i in archive.infolist()}
    assert members == files
    assert all(i.compress_type == zipfile.ZIP_STORED for i in archive.infolist())
    assert all(off % zip_layout.ALIGNMENT == 0
               for off in data_offsets(tmp_path / "one.ucpz").values())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []
    with ucpformat.open(tmp_path / "one.ucpz") as ckpt:
        for name, value in state()["model"].items():
            assert np.array_equal(ckpt[f"model/{name}"][...], value)
        assert ckpt["model/big"][10:20, 5].tolist() == state()["model"]["big"][10:20, 5].tolist()
    report = ucpformat.validate(tmp_path / "one.ucpz", deep=True)
    assert report.valid, report.issues
    # the same members in the same order make the same file (the save's threads may
    # order them otherwise: ucpformat.pack copies in a fixed order, tests/test_pack.py)
    save(tmp_path / "again.ucpz")
    again = zipfile.ZipFile(tmp_path / "again.ucpz")
    assert {i.filename: again.read(i) for i in again.infolist()} == members


def test_zarr_python_reads_the_archive(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    save(tmp_path / "one.ucpz")
    group = zarr.open_group(zarr.storage.ZipStore(tmp_path / "one.ucpz", mode="r"), mode="r")
    for name, value in state()["model"].items():
        assert np.array_equal(group[f"model/{name}"][...], value)


def test_an_archive_made_by_another_zip_writer_reads(tmp_path: Path) -> None:
    """Unaligned members, directory entries, a data descriptor: read all the same."""
    save(tmp_path / "dir")
    with zipfile.ZipFile(tmp_path / "other.ucpz", "w", zipfile.ZIP_STORED) as z:
        for p in sorted((tmp_path / "dir").rglob("*")):
            name = str(p.relative_to(tmp_path / "dir"))
            if p.is_dir():
                z.writestr(name + "/", b"")
            else:
                with z.open(name, "w") as f:  # streamed: sizes in a data descriptor
                    f.write(p.read_bytes())
    with ucpformat.open(tmp_path / "other.ucpz") as ckpt:
        assert np.array_equal(ckpt["model/big"][...], state()["model"]["big"])
    assert ucpformat.validate(tmp_path / "other.ucpz", deep=True).valid


def test_existing_paths_are_refused_or_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "one.ucpz"
    save(path)
    before = path.read_bytes()
    with pytest.raises(CheckpointExistsError, match="overwrite=True") as err:
        save(path)
    assert err.value.rule == "UCP-1.0-R053"
    assert path.read_bytes() == before
    ucpformat.save(path, {"model": {"x": np.ones(3)}}, durable=False, overwrite=True)
    with ucpformat.open(path) as ckpt:
        assert list(ckpt.arrays) == ["model/x"]
    other = tmp_path / "notes.ucpz"
    other.write_bytes(b"my notes")
    with pytest.raises(CheckpointExistsError, match="not a checkpoint in one file") as err:
        save(other, overwrite=True)
    assert err.value.rule == "UCP-1.0-R066" and other.read_bytes() == b"my notes"
    (tmp_path / "d.ucpz").mkdir()
    with pytest.raises(CheckpointExistsError, match="a directory is at this path"):
        save(tmp_path / "d.ucpz", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.ucpz", "notes.ucpz", "one.ucpz"]


def test_a_failed_save_leaves_the_previous_archive_and_no_partial_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "one.ucpz"
    save(path)
    before = path.read_bytes()
    calls = []

    def failing_put(self: ArchiveWriter, key: str, buffers: Any, *, atomic: bool = False) -> int:
        calls.append(key)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return original(self, key, buffers, atomic=atomic)

    original = ArchiveWriter.put
    monkeypatch.setattr(ArchiveWriter, "put", failing_put)
    with pytest.raises(ucpformat.UCPError):
        save(path, overwrite=True)
    monkeypatch.setattr(ArchiveWriter, "put", original)
    monkeypatch.setattr(zip_layout, "directory", lambda *a: 1 / 0)  # fails in the commit
    with pytest.raises(ZeroDivisionError):
        save(path, overwrite=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.ucpz"]


def test_a_distributed_save_to_one_file_is_refused(tmp_path: Path) -> None:
    data = np.arange(48, dtype=np.float32).reshape(6, 8)
    frags = FragmentList([Fragment("model/w", ((0, 6), (0, 8)), data)])
    with pytest.raises(WriteError, match="this writer writes a directory") as err:
        save_fragments(tmp_path / "d.ucpz", SingleProcess(),
                       specs=[TensorSpec("model/w", (6, 8), "float32")], fragments=frags,
                       durable=False)
    assert err.value.rule == "UCP-1.0-R074"
    assert not (tmp_path / "d.ucpz").exists()


def test_archive_paths(tmp_path: Path) -> None:
    assert is_archive_path("x/model.ucpz") and is_archive_path("file:///x/M.UCPZ")
    assert not is_archive_path("x/model") and not is_archive_path("s3://b/model.ucpz")
    from ucpformat.store import LocalStore

    save(LocalStore(tmp_path / "old.ucpz"))  # a directory checkpoint named so: read as one
    assert not is_archive_path(tmp_path / "old.ucpz")
    with ucpformat.open(tmp_path / "old.ucpz") as ckpt:
        assert "model/w" in ckpt.arrays
    (tmp_path / "file").write_bytes(b"x")
    assert is_archive_path(tmp_path / "file")


# -- what a reader refuses ---------------------------------------------------------------


def rezip(src: Path, dst: Path, *, compress: str | None = None,
          rename: dict[str, str] | None = None, duplicate: str | None = None) -> None:
    """The directory checkpoint ``src`` as an archive made by Python's zipfile, changed."""
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                name = str(p.relative_to(src))
                kind = zipfile.ZIP_DEFLATED if name == compress else zipfile.ZIP_STORED
                z.writestr((rename or {}).get(name, name), p.read_bytes(), compress_type=kind)
                if name == duplicate:
                    with pytest.warns(UserWarning, match="Duplicate"):
                        z.writestr(name, p.read_bytes())


@pytest.mark.parametrize(("change", "error", "rule"), [
    ({"compress": "model/w/c/0/0"}, UnsupportedFeatureError, "UCP-1.0-R075"),
    ({"duplicate": "model/b/zarr.json"}, CorruptDataError, "UCP-1.0-R075"),
    ({"rename": {"model/b/zarr.json": "model/../../b"}}, UnsafePathError, "UCP-1.0-R091"),
])
def test_members_that_break_the_form_are_refused_at_open(
        tmp_path: Path, change: dict[str, Any], error: type[Exception], rule: str) -> None:
    save(tmp_path / "dir")
    rezip(tmp_path / "dir", tmp_path / "bad.ucpz", **change)
    with pytest.raises(error) as err:
        ucpformat.open(tmp_path / "bad.ucpz")
    assert err.value.rule == rule  # type: ignore[attr-defined]
    report = ucpformat.validate(tmp_path / "bad.ucpz")
    assert not report.valid and report.errors[0].rule == rule


def test_damage_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "one.ucpz"
    save(path)
    raw = path.read_bytes()
    offsets = data_offsets(path)
    (tmp_path / "cut.ucpz").write_bytes(raw[:-30])  # the end record lost
    with pytest.raises(CorruptDataError, match="no end of central directory") as err:
        ucpformat.open(tmp_path / "cut.ucpz")
    assert err.value.rule == "UCP-1.0-R077"
    # a local header whose name differs from its central entry's
    header = zipfile.ZipFile(path).getinfo("model/w/c/0/0").header_offset
    bad = bytearray(raw)
    bad[header + 30] ^= 0x20
    (tmp_path / "header.ucpz").write_bytes(bytes(bad))
    with ucpformat.open(tmp_path / "header.ucpz") as ckpt, \
            pytest.raises(CorruptDataError, match="local header does not match") as err:
        ckpt["model/w"][...]
    assert err.value.rule == "UCP-1.0-R077"
    # a flipped byte in a chunk: the chunk's CRC32C refuses it, as in a directory
    bad = bytearray(raw)
    bad[offsets["model/w/c/0/0"] + 100] ^= 0x01
    (tmp_path / "flip.ucpz").write_bytes(bytes(bad))
    with ucpformat.open(tmp_path / "flip.ucpz") as ckpt, pytest.raises(ChecksumError) as err:
        ckpt["model/w"][...]
    assert err.value.rule == "UCP-1.0-R041"
    # a central directory larger than the reader's limit for metadata, refused unread
    with pytest.raises(CorruptDataError, match="over the limit") as err:
        ArchiveStore(path, max_directory_bytes=100).size("zarr.json")
    assert err.value.rule == "UCP-1.0-R098"


def test_a_file_that_is_no_archive_is_not_a_checkpoint(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(CheckpointNotFoundError, match="neither") as err:
        ucpformat.open(notes)
    assert err.value.rule == "UCP-1.0-R051"
    with pytest.raises(CheckpointNotFoundError):
        ucpformat.open(tmp_path / "absent.ucpz")


def test_archive_store_reads_only(tmp_path: Path) -> None:
    save(tmp_path / "one.ucpz")
    store = ArchiveStore(tmp_path / "one.ucpz")
    assert sorted(store.list("model/b")) == ["model/b/c/0", "model/b/zarr.json"]
    assert store.get_range("model/b/c/0", 8, 8) == np.int64(1).tobytes()
    assert store.get_suffix("model/b/c/0", 4) == store.get("model/b/c/0")[-4:]  # type: ignore[index]
    with pytest.raises(WriteError, match=r"ucp pack DIRECTORY FILE\.ucpz"):
        store.put("x", [b"1"])
    with pytest.raises(WriteError):
        store.delete("zarr.json")
    store.close()


def test_zip64_records_for_sizes_and_offsets_beyond_4_gib(tmp_path: Path) -> None:
    """A sparse file: one member of 4 GiB + 10 bytes, then a small one past 4 GiB."""
    path = tmp_path / "big.ucpz"
    size = (1 << 32) + 10
    first = zip_layout.member_header("model/a/c/0", 0, size, 0)
    at = len(first) + size
    second = zip_layout.member_header("model/b/c/0", at, 3, 0x352441C2)
    end = at + len(second) + 3
    members = [zip_layout.Member("model/a/c/0", 0, size, 0),
               zip_layout.Member("model/b/c/0", at, 3, 0x352441C2)]
    with open(path, "wb") as f:
        f.write(first)
        f.seek(at)
        f.write(second + b"abc")
        f.write(zip_layout.directory(members, end))
    infos = {i.filename: i for i in zipfile.ZipFile(path).infolist()}
    assert infos["model/a/c/0"].file_size == size
    assert infos["model/b/c/0"].header_offset == at
    store = ArchiveStore(path)
    assert store.size("model/a/c/0") == size
    assert store.get("model/b/c/0") == b"abc"
    assert zipfile.ZipFile(path).read("model/b/c/0") == b"abc"
    os.unlink(path)


def test_deep_validation_checks_every_members_zip_crc32(tmp_path: Path) -> None:
    path = tmp_path / "one.ucpz"
    save(path)
    raw = bytearray(path.read_bytes())
    entry = raw.rfind(b"PK\x01\x02")  # the last central directory entry
    assert raw[entry + 46:entry + 46 + 9] == b"zarr.json"  # the root is written last
    raw[entry + 16] ^= 0xFF  # its CRC-32 in the central directory
    path.write_bytes(bytes(raw))
    assert ucpformat.validate(path).valid  # a shallow validation reads no CRC-32
    report = ucpformat.validate(path, deep=True)
    assert [(i.rule, i.path) for i in report.errors] == [("UCP-1.0-R075", "zarr.json")]
    with ucpformat.open(path) as ckpt:  # a reader may skip it: the digests protect the root
        assert np.array_equal(ckpt["model/b"][...], state()["model"]["b"])


# -- the key rule every member name is checked against -------------------------------------


def _key_by_components(key: str) -> bool:
    """UCP-1.0-R091 and R012 for one key, component by component (the rule's words)."""
    import re

    return bool(key) and all(
        part not in ("", ".", "..") and len(part) <= 255
        and re.fullmatch(r"[A-Za-z0-9._%-]+", part) is not None for part in key.split("/"))


@pytest.mark.parametrize("key", ["a", "a/b", "...", "a/...", ".a", "a.", "%", "a%2F", "x" * 255,
                                 ".", "..", "a/.", "a/..", "../a", "a//b", "/a", "a/", "a b",
                                 "a\n", "a\n/b", "x" * 256, "a/" + "y" * 256, "caf\u00e9"])
def test_check_key_takes_exactly_the_keys_of_the_rule(key: str) -> None:
    from ucpformat.store import is_safe_key

    assert is_safe_key(key) == _key_by_components(key)


def test_check_key_takes_exactly_the_keys_of_the_rule_at_random() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ucpformat.store import is_safe_key

    @settings(max_examples=2000, deadline=None)
    @given(st.text(alphabet="ab./%\n -\u00e9", max_size=12))
    def check(key: str) -> None:
        assert is_safe_key(key) == _key_by_components(key)

    check()


def test_a_killed_writers_file_is_removed_and_a_live_writers_refuses_a_second(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "one.ucpz"
    code = ("import os, signal, sys\n"
            "from ucpformat.store import ArchiveWriter\n"
            f"w = ArchiveWriter({str(path)!r}, durable=False)\n"
            "w.put('model/x/c/0', [b'1' * 1000])\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        partial = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
        assert len(partial) == 1
        with pytest.raises(ucpformat.errors.ConcurrentWriteError) as err:
            save(path)  # the child still writes this path
        assert err.value.rule == "UCP-1.0-R059" and not path.exists()
        assert [p for p in tmp_path.iterdir()] == partial  # its file untouched, none of ours
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == -9 and partial[0].exists()  # killed: its file stays ...
    save(path)  # ... until the next writer to the path removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.ucpz"]


def test_missing_parents_are_made_and_a_compressed_zip_is_never_replaced(
        tmp_path: Path) -> None:
    save(tmp_path / "a" / "b" / "one.ucpz")
    assert ucpformat.validate(tmp_path / "a" / "b" / "one.ucpz").valid
    save(tmp_path / "dir")
    rezip(tmp_path / "dir", tmp_path / "zipped.ucpz", compress="model/w/c/0/0")
    before = (tmp_path / "zipped.ucpz").read_bytes()
    with pytest.raises(CheckpointExistsError, match="remove it first") as err:
        save(tmp_path / "zipped.ucpz", overwrite=True)
    assert err.value.rule == "UCP-1.0-R066" and "compressed" in str(err.value)
    assert (tmp_path / "zipped.ucpz").read_bytes() == before


def test_the_streaming_writer_and_convert_write_one_file(tmp_path: Path) -> None:
    from ucpformat.checkpoint.streaming import StreamingWriter

    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    with StreamingWriter(tmp_path / "s.ucpz", durable=False) as w:
        w.declare("model/w", data.shape, data.dtype)
        w.write("model/w", data)
        assert not (tmp_path / "s.ucpz").exists()  # nothing at the path before the commit
        w.commit(root_values={"step": 3})
    with ucpformat.open(tmp_path / "s.ucpz") as ckpt:
        assert np.array_equal(ckpt["model/w"][...], data)
    with pytest.raises(RuntimeError), StreamingWriter(tmp_path / "t.ucpz", durable=False) as w:
        w.declare("model/w", data.shape, data.dtype)
        w.write("model/w", data)
        raise RuntimeError("the import failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.ucpz"]


def test_writers_of_directories_refuse_a_one_file_path_before_they_start(
        tmp_path: Path) -> None:
    from ucpformat.distributed.pipeline import DistributedSave

    with pytest.raises(WriteError, match=r"ucp pack DIRECTORY FILE\.ucpz") as err:
        DistributedSave(tmp_path / "d.ucpz", SingleProcess())
    assert err.value.rule == "UCP-1.0-R074" and list(tmp_path.iterdir()) == []


def test_an_archive_of_the_checkpoints_folder_says_how_to_make_one(tmp_path: Path) -> None:
    save(tmp_path / "ckpt")
    with zipfile.ZipFile(tmp_path / "folder.zip", "w") as z:
        for p in sorted((tmp_path / "ckpt").rglob("*")):
            if p.is_file():
                z.write(p, str(p.relative_to(tmp_path)))
    with pytest.raises(CheckpointNotFoundError, match=r"ucp pack ckpt FILE\.ucpz") as err:
        ucpformat.open(tmp_path / "folder.zip")
    assert err.value.rule == "UCP-1.0-R051" and "under 'ckpt/'" in str(err.value)
    report = ucpformat.validate(tmp_path / "folder.zip")
    assert not report.valid and "under 'ckpt/'" in report.errors[0].message

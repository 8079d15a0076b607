"""``ucpformat.pack`` / ``unpack`` and ``ucp pack`` / ``ucp unpack``: a committed checkpoint
copied between a directory and one file (spec §11.5), byte for byte, only its own
objects, a damaged source refused, and the destination committed or left alone."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.helpers import one_error_line, ucp
from ucpformat.checkpoint import pack as pack_module
from ucpformat.checkpoint.metadata import IN_PROGRESS_KEY, MANIFEST_KEY, ZARR_JSON
from ucpformat.distributed import Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import SingleProcess
from ucpformat.distributed.pipeline import FragmentList
from ucpformat.errors import (
    CheckpointExistsError,
    FormatError,
    IncompleteCheckpointError,
    InvalidValueError,
    UCPError,
    WriteError,
)
from ucpformat.store import ArchiveWriter, LocalStore, zip_layout

FIXED: dict[str, Any] = {"created": "2026-11-28T00:00:00Z",
                         "producer": {"name": "test", "version": "1"}}


def state(scale: float = 1.0) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "model": {"w": (scale * rng.standard_normal((64, 48))).astype(np.float32),
                  "b": np.arange(5, dtype=np.int64),
                  "big": rng.standard_normal((300, 100)).astype(np.float32)},
        "training": {"step": 7},
    }


def save(path: Path, **kwargs: Any) -> Path:
    kwargs.setdefault("chunk_bytes", 8192)
    ucpformat.save(path, kwargs.pop("values", None) or state(), durable=False, **FIXED,
                   **kwargs)
    return path


def files(directory: Path) -> dict[str, bytes]:
    """Every file under a directory, by its key."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in directory.rglob("*") if p.is_file()}


def members(archive: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(archive) as z:
        assert z.testzip() is None  # every member's CRC-32 is right
        return {i.filename: z.read(i) for i in z.infolist()}


def flip(path: Path, at: int = 100) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def left_over(directory: Path) -> list[str]:
    """Names in ``directory`` that a copy could have left (partial archives included)."""
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("hash_algorithm", [None, "sha256"])
def test_pack_then_unpack_gives_the_directory_back_byte_for_byte(
        tmp_path: Path, hash_algorithm: str | None) -> None:
    src = save(tmp_path / "src", hash_algorithm=hash_algorithm)
    result = ucpformat.pack(src, tmp_path / "one.ucpz", durable=False)
    assert members(tmp_path / "one.ucpz") == files(src)
    back = ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back", durable=False)
    assert files(tmp_path / "back") == files(src)
    for where in (src, tmp_path / "one.ucpz", tmp_path / "back"):
        report = ucpformat.validate(where, deep=True)
        assert report.valid and not report.warnings, (where, report.issues)
    # what was copied: every file, the stored objects among them
    own = files(src)
    assert (result.files, result.file_bytes) == (len(own), sum(map(len, own.values())))
    assert (back.files, back.file_bytes) == (result.files, result.file_bytes)
    assert result.tensors == 3 and result.location == str(tmp_path / "one.ucpz")
    assert result.objects == len([k for k in files(src) if "/c/" in k])
    assert back.location == str(tmp_path / "back")
    # stored, aligned, the root last; the same checkpoint packs to the same file
    with zipfile.ZipFile(tmp_path / "one.ucpz") as z:
        infos = z.infolist()
    assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
    assert [i.filename for i in infos][-2:] == [MANIFEST_KEY, ZARR_JSON]
    raw = (tmp_path / "one.ucpz").read_bytes()
    for info in infos:
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
        assert (info.header_offset + 30 + name_len + extra_len) % zip_layout.ALIGNMENT == 0
    seen: list[int] = []  # progress: the bytes verified, then the bytes copied
    ucpformat.pack(src, tmp_path / "again.ucpz", durable=False, progress=seen.append)
    assert (tmp_path / "again.ucpz").read_bytes() == raw
    assert sum(seen) > result.file_bytes
    with ucpformat.open(tmp_path / "one.ucpz") as ckpt:
        assert np.array_equal(ckpt["model/big"][...], state()["model"]["big"])


def test_only_the_checkpoints_own_objects_are_copied(tmp_path: Path) -> None:
    src = save(tmp_path / "src")
    own = files(src)
    (src / "notes.txt").write_text("mine")
    (src / "model" / "w" / "extra").mkdir()
    (src / "model" / "w" / "extra" / "x").write_bytes(b"stray")
    (src / IN_PROGRESS_KEY).write_text("{}")  # a marker left after a commit (R056)
    report = ucpformat.validate(src)
    assert report.valid and {i.rule for i in report.warnings} == {"UCP-1.0-R044",
                                                                  "UCP-1.0-R056"}
    ucpformat.pack(src, tmp_path / "one.ucpz", durable=False)
    assert members(tmp_path / "one.ucpz") == own
    ucpformat.unpack(src, tmp_path / "copy", durable=False)  # a directory to a directory
    assert files(tmp_path / "copy") == own


def test_a_distributed_save_packs(tmp_path: Path) -> None:
    data = np.arange(48 * 10, dtype=np.float32).reshape(48, 10)
    frags = FragmentList([Fragment("model/w", ((0, 24), (0, 10)), data[:24]),
                          Fragment("model/w", ((24, 48), (0, 10)), data[24:])])
    save_fragments(tmp_path / "dist", SingleProcess(),
                   specs=[TensorSpec("model/w", (48, 10), "float32")], fragments=frags,
                   root_values={"training": {"step": 3}}, hash_algorithm="sha256",
                   durable=False)
    ucpformat.pack(tmp_path / "dist", tmp_path / "dist.ucpz", durable=False)
    assert members(tmp_path / "dist.ucpz") == files(tmp_path / "dist")
    with ucpformat.open(tmp_path / "dist.ucpz") as ckpt:
        assert np.array_equal(ckpt["model/w"][...], data)
    assert ucpformat.validate(tmp_path / "dist.ucpz", deep=True).valid
    ucpformat.unpack(tmp_path / "dist.ucpz", tmp_path / "back", durable=False)
    assert files(tmp_path / "back") == files(tmp_path / "dist")


def test_an_archive_of_another_zip_writer_repacks_aligned(tmp_path: Path) -> None:
    src = save(tmp_path / "src")
    with zipfile.ZipFile(tmp_path / "other.ucpz", "w", zipfile.ZIP_STORED) as z:
        for key, body in sorted(files(src).items()):
            z.writestr(key, body)
    ucpformat.pack(tmp_path / "other.ucpz", tmp_path / "one.ucpz", durable=False)
    ucpformat.pack(src, tmp_path / "direct.ucpz", durable=False)
    assert (tmp_path / "one.ucpz").read_bytes() == (tmp_path / "direct.ucpz").read_bytes()


def test_a_source_that_is_not_committed_is_refused(tmp_path: Path) -> None:
    src = save(tmp_path / "src")
    (src / ZARR_JSON).unlink()
    with pytest.raises(IncompleteCheckpointError) as err:
        ucpformat.pack(src, tmp_path / "one.ucpz")
    assert err.value.rule == "UCP-1.0-R051"
    with pytest.raises(IncompleteCheckpointError):
        ucpformat.unpack(src, tmp_path / "back")
    assert left_over(tmp_path) == ["src"]


@pytest.mark.parametrize("hash_algorithm", [None, "sha256"])
def test_a_damaged_source_is_refused_and_nothing_is_written(
        tmp_path: Path, hash_algorithm: str | None) -> None:
    src = save(tmp_path / "src", hash_algorithm=hash_algorithm)
    flip(src / "model" / "w" / "c" / "0" / "0")
    with pytest.raises(FormatError, match="not a valid checkpoint") as err:
        ucpformat.pack(src, tmp_path / "one.ucpz")
    assert err.value.rule == ("UCP-1.0-R043" if hash_algorithm else "UCP-1.0-R041")
    assert "nothing was written" in str(err.value)
    with pytest.raises(FormatError):
        ucpformat.unpack(src, tmp_path / "back")
    assert left_over(tmp_path) == ["src"]
    # unverified, the damage is copied as it is (and found where it lands)
    ucpformat.pack(src, tmp_path / "one.ucpz", verify=False, durable=False)
    assert not ucpformat.validate(tmp_path / "one.ucpz", deep=True).valid
    # a damaged archive is refused alike
    with pytest.raises(FormatError) as err:
        ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back")
    assert left_over(tmp_path) == ["one.ucpz", "src"]


def test_an_object_of_another_size_is_refused_even_unverified(tmp_path: Path) -> None:
    src = save(tmp_path / "src")
    chunk = src / "model" / "big" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-1])
    # a shallow validation finds it, from the sizes in the manifest (R043)
    with pytest.raises(FormatError) as err:
        ucpformat.pack(src, tmp_path / "one.ucpz", verify=False)
    assert err.value.rule == "UCP-1.0-R043"
    assert left_over(tmp_path) == ["src"]


def test_an_existing_destination_is_refused_unless_overwrite(tmp_path: Path) -> None:
    src = save(tmp_path / "src")
    other = save(tmp_path / "other", values=state(scale=2.0))
    ucpformat.pack(other, tmp_path / "one.ucpz", durable=False)
    ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back", durable=False)
    before = (tmp_path / "one.ucpz").read_bytes()
    with pytest.raises(CheckpointExistsError, match="overwrite=True") as err:
        ucpformat.pack(src, tmp_path / "one.ucpz")
    assert err.value.rule == "UCP-1.0-R053"
    assert (tmp_path / "one.ucpz").read_bytes() == before
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        ucpformat.unpack(tmp_path / "one.ucpz", src)
    assert files(tmp_path / "back") == files(other)
    ucpformat.pack(src, tmp_path / "one.ucpz", overwrite=True, durable=False)
    assert members(tmp_path / "one.ucpz") == files(src)
    ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back", overwrite=True, durable=False)
    assert files(tmp_path / "back") == files(src)
    assert left_over(tmp_path) == ["back", "one.ucpz", "other", "src"]
    # a destination that is no checkpoint is never replaced
    (tmp_path / "notes.ucpz").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="not a checkpoint in one file"):
        ucpformat.pack(src, tmp_path / "notes.ucpz", overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="not a UCP checkpoint"):
        ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "mine", overwrite=True)
    assert (tmp_path / "notes.ucpz").read_text() == "mine"
    assert files(tmp_path / "mine") == {"notes.txt": b"mine"}


def test_an_existing_destination_is_refused_before_the_source_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "src")
    ucpformat.pack(src, tmp_path / "one.ucpz", durable=False)
    ucpformat.unpack(src, tmp_path / "back", durable=False)

    def no_validation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the source was validated before the destination was checked")

    monkeypatch.setattr(pack_module, "validate", no_validation)
    with pytest.raises(CheckpointExistsError):
        ucpformat.pack(src, tmp_path / "one.ucpz")
    with pytest.raises(CheckpointExistsError):
        ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back")
    assert left_over(tmp_path) == ["back", "one.ucpz", "src"]


def test_a_destination_that_overlaps_the_source_is_refused(tmp_path: Path) -> None:
    src = save(tmp_path / "src")
    own = files(src)
    with pytest.raises(CheckpointExistsError, match="inside it"):
        ucpformat.pack(src, src / "one.ucpz")
    with pytest.raises(CheckpointExistsError, match="inside it"):
        ucpformat.unpack(src, src, overwrite=True)
    with pytest.raises(CheckpointExistsError, match="inside it"):
        ucpformat.unpack(src, tmp_path, overwrite=True)
    with pytest.raises(InvalidValueError, match="writes a directory") as err:
        ucpformat.unpack(src, tmp_path / "back.ucpz")
    assert err.value.rule == "UCP-1.0-R074"
    assert files(src) == own and left_over(tmp_path) == ["src"]


def failing_on_the_third(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> None:
    """Make ``cls.method`` (a store's write) fail on its third call, as a full disk would."""
    original = getattr(cls, method)
    calls = []

    def failing(self: Any, key: str, buffers: Any, *, atomic: bool = False) -> int:
        calls.append(key)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return int(original(self, key, buffers, atomic=atomic))

    monkeypatch.setattr(cls, method, failing)


def test_a_failed_pack_leaves_the_previous_archive_and_no_partial_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "src")
    other = save(tmp_path / "other", values=state(scale=2.0))
    ucpformat.pack(other, tmp_path / "one.ucpz", durable=False)
    before = (tmp_path / "one.ucpz").read_bytes()
    failing_on_the_third(monkeypatch, ArchiveWriter, "put")
    with pytest.raises(WriteError, match="No space left") as err:
        ucpformat.pack(src, tmp_path / "one.ucpz", overwrite=True)
    assert "nothing was committed" in str(err.value)
    assert (tmp_path / "one.ucpz").read_bytes() == before
    assert left_over(tmp_path) == ["one.ucpz", "other", "src"]


def test_a_failed_unpack_removes_what_it_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save(tmp_path / "src")
    ucpformat.pack(src, tmp_path / "one.ucpz", durable=False)
    failing_on_the_third(monkeypatch, LocalStore, "create")
    with pytest.raises(WriteError, match="No space left") as err:
        ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back")
    assert "nothing was committed" in str(err.value)
    assert "the files it had written were removed" in str(err.value)
    assert files(tmp_path / "back") == {}
    # replacing a checkpoint: the protocol un-commits it first, and the error says so
    monkeypatch.undo()
    ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back", durable=False)
    failing_on_the_third(monkeypatch, LocalStore, "create")
    with pytest.raises(UCPError, match="the checkpoint that was here is gone"):
        ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back", overwrite=True)
    assert files(tmp_path / "back") == {}


# -- the command ------------------------------------------------------------------------


def test_ucp_pack_and_unpack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save(tmp_path / "src")
    one, back = tmp_path / "one.ucpz", tmp_path / "back"
    code, out, err = ucp(capsys, "pack", str(src), str(one))
    assert (code, err) == (0, "")
    assert out.startswith(f"packed {src} -> {one}: {len(files(src))} files")
    assert "every byte of the source verified" in out
    code, out, err = ucp(capsys, "unpack", str(one), str(back))
    assert code == 0 and out.startswith(f"unpacked {one} -> {back}:")
    assert files(back) == files(src)
    # an existing destination: could not run, the flag named; replaced with it
    code, out, err = ucp(capsys, "pack", str(src), str(one))
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        f"ucp: error: [UCP-1.0-R053] {one}: a file is already at this path; pass "
        "--overwrite to replace a checkpoint")
    code, _, err = ucp(capsys, "unpack", str(one), str(back))
    assert code == 2 and "pass --overwrite" in one_error_line(err)
    assert ucp(capsys, "pack", "--overwrite", "--quiet", str(src), str(one)) == (0, "", "")
    code, out, _ = ucp(capsys, "unpack", "--overwrite", "--no-verify", str(one), str(back))
    assert code == 0 and "not verified" in out
    assert files(back) == files(src)


def test_ucp_pack_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = save(tmp_path / "src")
    code, out, err = ucp(capsys, "pack", str(tmp_path / "nope"), str(tmp_path / "x.ucpz"))
    assert (code, out) == (2, "")
    assert one_error_line(err) == (f"ucp: error: [UCP-1.0-R051] {tmp_path / 'nope'}: no such "
                                   "file or directory")
    flip(src / "model" / "w" / "c" / "0" / "0")
    code, out, err = ucp(capsys, "pack", str(src), str(tmp_path / "x.ucpz"))
    assert (code, out) == (1, "")  # the source is invalid
    line = one_error_line(err)
    assert line.startswith(f"ucp: error: [UCP-1.0-R041] {src}: the source is not a valid")
    assert f"`ucp validate --deep {src}` lists every problem" in line
    (src / ZARR_JSON).unlink()
    code, _, err = ucp(capsys, "unpack", str(src), str(tmp_path / "back"))
    assert code == 1 and "[UCP-1.0-R051]" in one_error_line(err)
    assert left_over(tmp_path) == ["src"]


def test_damage_in_an_archive_is_refused_by_unpack(tmp_path: Path) -> None:
    """The members' ZIP CRC-32s are checked too (a deep validation of an archive)."""
    src = save(tmp_path / "src")
    ucpformat.pack(src, tmp_path / "one.ucpz", durable=False)
    raw = bytearray((tmp_path / "one.ucpz").read_bytes())
    entry = raw.rfind(b"PK\x01\x02")  # the root's central directory entry
    raw[entry + 16] ^= 0xFF  # its CRC-32
    (tmp_path / "one.ucpz").write_bytes(bytes(raw))
    with pytest.raises(FormatError) as err:
        ucpformat.unpack(tmp_path / "one.ucpz", tmp_path / "back")
    assert err.value.rule == "UCP-1.0-R075"
    assert left_over(tmp_path) == ["one.ucpz", "src"]

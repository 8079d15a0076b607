"""Issue 13: reads that fail with UCPError only (R099), memory and work bounded by what is
read (R098), Unicode strings only (R006), and a root checked by its digest on open (R058).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ucpformat
from tests.helpers import edit_root, read_json
from ucpformat.checkpoint.metadata import ROOT_DIGEST, encode_root, loads
from ucpformat.checkpoint.validation import Issue, Report
from ucpformat.cli import main as ucp
from ucpformat.engine import checksum, compression
from ucpformat.errors import (
    CheckpointNotFoundError,
    FormatError,
    ResourceLimitError,
    StorageError,
    UCPError,
)
from ucpformat.store import LocalStore


def _save(path: Path, **kw: Any) -> Path:
    state = {
        "model": {"w": np.arange(24, dtype=np.float32).reshape(6, 4),
                  "emb": np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)},
        "training": {"step": 3, "note": "x"},
    }
    ucpformat.save(path, state, durable=False, **kw)
    return path


# -- R099: no raw OSError from open, read or validate -----------------------------------------


class _Refusing(LocalStore):
    """A local store whose reads of one key fail as the operating system would."""

    def __init__(self, root: Path, key: str, error: OSError) -> None:
        super().__init__(root, durable=False)
        self.key, self.error = key, error

    def _fail(self, key: str) -> None:
        if key == self.key:
            raise self.error

    def get(self, key: str) -> bytes | None:
        self._fail(key)
        return super().get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        self._fail(key)
        return super().get_range(key, offset, length)

    def get_suffix(self, key: str, length: int) -> bytes | None:
        self._fail(key)
        return super().get_suffix(key, length)

    def read_into(self, key: str, offset: int, buffers: Any) -> int | None:
        self._fail(key)
        return super().read_into(key, offset, buffers)

    def size(self, key: str) -> int | None:
        self._fail(key)
        return super().size(key)


OS_ERRORS = {
    "permission": PermissionError(13, "Permission denied"),
    "not a directory": NotADirectoryError(20, "Not a directory"),
    "name too long": OSError(36, "File name too long"),
    "i/o error": OSError(5, "Input/output error"),
}


@pytest.mark.parametrize("error", list(OS_ERRORS))
@pytest.mark.parametrize("key", ["zarr.json", "manifest.ucp.json", "model/w/zarr.json",
                                 "model/w/c/0/0"])
def test_storage_failures_are_ucp_errors(tmp_path: Path, key: str, error: str) -> None:
    """UCP-1.0-R099: open, reads and validate fail with a StorageError naming the file;
    validate reports it (invalid), never raises."""
    path = _save(tmp_path / "ckpt")
    store = _Refusing(path, key, OS_ERRORS[error])
    try:
        with ucpformat.open(store) as ckpt:
            for name in ckpt:
                ckpt[name].read()
    except StorageError as exc:
        assert exc.rule == "UCP-1.0-R099" and key in str(exc)
        assert OS_ERRORS[error].strerror in str(exc)
    except CheckpointNotFoundError as exc:  # the location itself is no directory
        assert key == "zarr.json" and error == "not a directory" and exc.rule == "UCP-1.0-R051"
    report = ucpformat.validate(store, deep=True)
    assert not report.valid
    if "UCP-1.0-R051" not in report.rules():
        assert "UCP-1.0-R099" in report.rules(), report.to_json()
        assert any(i.path == key for i in report.errors if i.rule == "UCP-1.0-R099")


def test_a_file_where_a_directory_should_be(tmp_path: Path) -> None:
    """UCP-1.0-R099: NotADirectoryError from the file system (a chunk's directory replaced
    by a file) is an error of the read and of the report; ``ucp validate`` exits 1."""
    path = _save(tmp_path / "ckpt")
    chunks = path / "model" / "w" / "c"
    for sub in sorted(chunks.rglob("*"), reverse=True):
        sub.unlink() if sub.is_file() else sub.rmdir()
    chunks.rmdir()
    chunks.write_bytes(b"a file")
    with pytest.raises(StorageError, match="Not a directory"):
        ucpformat.open(path)["model/w"].read()
    report = ucpformat.validate(path, deep=True)
    assert "UCP-1.0-R099" in report.rules()
    assert ucp(["validate", "--quiet", str(path)]) == 1


def test_locations_that_are_no_directory(tmp_path: Path) -> None:
    """UCP-1.0-R099, UCP-1.0-R051: a file, a name too long, a NUL: UCPErrors, never OSError."""
    (tmp_path / "file").write_bytes(b"x")
    for location, error in [(tmp_path / "file", CheckpointNotFoundError),
                            (tmp_path / ("x" * 300), StorageError),
                            (str(tmp_path / "a\x00b"), StorageError)]:
        with pytest.raises(error):
            ucpformat.open(location)
        assert not ucpformat.validate(location).valid


# -- R098: memory bounded by what is legitimately read ----------------------------------------


@contextlib.contextmanager
def _peak() -> Iterator[list[int]]:
    out: list[int] = []
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        yield out
    finally:
        out.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def _sparse(path: Path, size: int) -> None:
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(size)


def test_a_root_over_the_limit_is_refused_unread(tmp_path: Path) -> None:
    """UCP-1.0-R098 (a): a root larger than the metadata limit is refused before it is
    read: a 1 GiB (sparse) root costs no memory."""
    path = _save(tmp_path / "ckpt")
    _sparse(path / "zarr.json", 1 << 30)
    with _peak() as peak:
        with pytest.raises(ResourceLimitError, match="refused unread") as info:
            ucpformat.open(path)
        report = ucpformat.validate(path, deep=True)
    assert info.value.rule == "UCP-1.0-R098"
    assert "UCP-1.0-R098" in report.rules()
    assert peak[0] < 8 << 20, peak


def test_the_limit_follows_max_read_bytes(tmp_path: Path) -> None:
    """UCP-1.0-R098 (b): by default no root is read whose parse could exceed max_read_bytes
    (48 bytes of memory per byte of JSON); max_metadata_bytes sets the limit itself."""
    path = _save(tmp_path / "ckpt", metadata={"pad": "x" * (100 << 10)})
    size = (path / "zarr.json").stat().st_size
    with pytest.raises(ResourceLimitError):
        ucpformat.open(path, max_read_bytes=48 * size - 48)
    ucpformat.open(path, max_read_bytes=48 * size)
    ucpformat.open(_save(tmp_path / "small"), max_read_bytes=1000)  # 64 KiB at least
    with pytest.raises(ResourceLimitError):
        ucpformat.open(path, max_metadata_bytes=size - 1)
    assert ucpformat.validate(path, max_metadata_bytes=size).valid
    assert "UCP-1.0-R098" in ucpformat.validate(path, max_metadata_bytes=size - 1).rules()


@pytest.mark.parametrize("key", ["manifest.ucp.json", "model/w/zarr.json"])
def test_validate_reads_no_document_beyond_its_listed_size(tmp_path: Path, key: str) -> None:
    """UCP-1.0-R098 (a): a manifest or node document grown to 2 GiB (sparse) is reported
    by its size (R043), not read."""
    path = _save(tmp_path / "ckpt")
    _sparse(path / key, 2 << 30)
    with _peak() as peak:
        report = ucpformat.validate(path, deep=True)
    assert "UCP-1.0-R043" in report.rules()
    assert peak[0] < 16 << 20, peak


def test_deep_validation_hashes_in_pieces(tmp_path: Path) -> None:
    """UCP-1.0-R098 (d): a 512 MiB (sparse) chunk whose manifest entry says so is hashed in
    pieces (R043: not its digest) and refused as a chunk (R041); memory stays near the
    8 MiB read limit (it was the file's size, per worker)."""
    path = _save(tmp_path / "ckpt", hash_algorithm="sha256")
    key = "model/w/c/0/0"
    _sparse(path / key, 512 << 20)
    manifest = read_json(path / "manifest.ucp.json")
    manifest["files"][key]["nbytes"] = 512 << 20
    body = json.dumps(manifest).encode()
    (path / "manifest.ucp.json").write_bytes(body)
    edit_root(path, lambda d: d["attributes"]["ucp"]["manifest"].update(
        nbytes=len(body), sha256=__import__("hashlib").sha256(body).hexdigest()))
    with _peak() as peak:
        report = ucpformat.validate(path, deep=True, max_read_bytes=8 << 20, workers=2)
    assert {"UCP-1.0-R043", "UCP-1.0-R041"} <= report.rules(), report.to_json()
    assert peak[0] < 24 << 20, peak


def test_an_oversized_chunk_is_refused_unread(tmp_path: Path) -> None:
    """UCP-1.0-R098 (c): a chunk stored in more than twice its size plus 64 KiB (here a
    valid zstd frame and a skippable frame of padding) is refused, not read."""
    path = _save(tmp_path / "ckpt", compression="zstd")
    key = path / "model" / "w" / "c" / "0" / "0"
    payload = key.read_bytes()[:-4]
    pad = 200_000
    body = payload + (0x184D2A50).to_bytes(4, "little") + pad.to_bytes(4, "little") + bytes(pad)
    key.write_bytes(body + checksum.crc_bytes(body))
    with pytest.raises(UCPError) as info:
        ucpformat.open(path)["model/w"].read()
    assert info.value.rule == "UCP-1.0-R098" and "refused unread" in str(info.value)


# -- R098 (e): work linear in what is read ----------------------------------------------------


def test_report_add_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCP-1.0-R098 (e): 5,000 distinct issues need no comparison of issue with issue
    (a list's membership test made 24,000 issues take 77 s)."""
    compared = 0
    original = Issue.__eq__

    def counting(self: Issue, other: object) -> bool:
        nonlocal compared
        compared += 1
        return bool(original(self, other))

    monkeypatch.setattr(Issue, "__eq__", counting)
    report = Report("x")
    for i in range(5000):
        report.add("UCP-1.0-R031", f"model/w{i}", "missing")
    report.add("UCP-1.0-R031", "model/w7", "missing")  # a repeat is still dropped
    assert len(report.issues) == 5000
    assert compared < 100, compared


def test_gzip_members_are_decoded_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCP-1.0-R098 (e): a chunk of 100,000 empty gzip members (a 10 MB one took 252 s)
    hands zlib each input byte a bounded number of times."""
    fed = 0
    real = zlib.decompressobj

    class Counting:
        def __init__(self, *args: Any) -> None:
            self.inner = real(*args)

        def decompress(self, data: Any, max_length: int = 0) -> bytes:
            nonlocal fed
            fed += len(data)
            return self.inner.decompress(data, max_length)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    monkeypatch.setattr(compression.zlib, "decompressobj", Counting)
    data = gzip.compress(b"", mtime=0) * 100_000 + gzip.compress(bytes(32), mtime=0)
    assert bytes(compression._gunzip(data, 32)) == bytes(32)
    assert fed <= 16 * len(data), (fed, len(data))


# -- R006: no unpaired surrogate --------------------------------------------------------------


@pytest.mark.parametrize("edit", ["value", "member name", "producer"])
def test_a_lone_surrogate_is_refused_everywhere(tmp_path: Path, edit: str) -> None:
    """UCP-1.0-R006: open, validate and ``ucp inspect --json`` agree: refused (exit 1),
    never a UnicodeEncodeError."""
    path = _save(tmp_path / "ckpt")
    old = {"value": '"note":"x"', "member name": '"note":"x"', "producer": '"name":"ucpformat"'}
    new = {"value": '"note":"\\ud800"', "member name": '"\\udfffnote":"x"',
           "producer": '"name":"\\ud83d"'}
    raw = (path / "zarr.json").read_bytes().decode()
    assert old[edit] in raw
    doc = json.loads(raw.replace(old[edit], new[edit]))
    (path / "zarr.json").write_bytes(encode_root_escaped(doc))
    with pytest.raises(FormatError) as info:
        ucpformat.open(path)
    assert info.value.rule == "UCP-1.0-R006"
    assert ucpformat.validate(path).rules() == {"UCP-1.0-R006"}
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # strict, as a pipe is
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert ucp(["inspect", "--json", str(path)]) == 1
    assert loads(b'"\\ud83d\\ude00"', what="x") == "\U0001f600"  # a pair is one code point


def encode_root_escaped(doc: Any) -> bytes:
    """A sealed root written with ASCII escapes (a lone surrogate has no UTF-8 form)."""
    placeholder = "f" * 64
    doc["attributes"]["ucp"][ROOT_DIGEST] = placeholder
    body = json.dumps(doc).encode()
    pos = body.index(placeholder.encode())
    zeroed = body[:pos] + b"0" * 64 + body[pos + 64 :]
    digest = __import__("hashlib").sha256(zeroed).hexdigest().encode()
    return zeroed[:pos] + digest + zeroed[pos + 64 :]


# -- R058: the root's digest, checked on open -------------------------------------------------


def _edit_unsealed(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    edit_root(path, fn, seal=False)


def test_an_edit_of_the_root_alone_is_refused_on_open(tmp_path: Path) -> None:
    """UCP-1.0-R058: a data type changed from bfloat16 to float16 in the root alone read
    wrong values with no error; now open refuses it, naming the rule."""
    path = _save(tmp_path / "ckpt")
    _edit_unsealed(path, lambda d: d["consolidated_metadata"]["metadata"]["model/emb"]
                   .__setitem__("data_type", "float16"))
    with pytest.raises(FormatError, match="damaged") as info:
        ucpformat.open(path)
    assert info.value.rule == "UCP-1.0-R058"
    assert "UCP-1.0-R058" in ucpformat.validate(path).rules()


def test_a_sparse_flag_and_a_deleted_chunk_are_refused(tmp_path: Path) -> None:
    """UCP-1.0-R058: marking an array sparse and deleting its chunk gave fill values."""
    path = _save(tmp_path / "ckpt")
    (path / "model" / "w" / "c" / "0" / "0").unlink()
    _edit_unsealed(path, lambda d: d["consolidated_metadata"]["metadata"]["model/w"]
                   ["attributes"].setdefault("ucp", {}).__setitem__("sparse", True))
    with pytest.raises(FormatError) as info:
        ucpformat.open(path)
    assert info.value.rule == "UCP-1.0-R058"


def test_any_byte_of_the_root_is_covered(tmp_path: Path) -> None:
    """UCP-1.0-R058: whitespace, attributes, a digit of the digest itself."""
    path = _save(tmp_path / "ckpt")
    raw = (path / "zarr.json").read_bytes()
    digest = json.loads(raw)["attributes"]["ucp"][ROOT_DIGEST]
    for damaged in [raw + b" ", raw.replace(b'"step":3', b'"step":4'),
                    raw.replace(digest.encode(), digest[:-1].encode() + b"0"
                                if not digest.endswith("0") else digest[:-1].encode() + b"1"),
                    raw.replace(digest.encode(), b"0" * 64)]:
        (path / "zarr.json").write_bytes(damaged)
        with pytest.raises(FormatError) as info:
            ucpformat.open(path)
        assert info.value.rule == "UCP-1.0-R058", damaged[:80]
    (path / "zarr.json").write_bytes(raw)
    assert ucpformat.open(path)["model/w"].shape == (6, 4)


def test_a_root_of_an_earlier_draft_is_refused_clearly(tmp_path: Path) -> None:
    """UCP-1.0-R058: a root without root_sha256 (written before the digest existed) is
    refused on open with a message that says so; a root sealed again opens."""
    path = _save(tmp_path / "ckpt")
    doc = read_json(path / "zarr.json")
    del doc["attributes"]["ucp"][ROOT_DIGEST]
    (path / "zarr.json").write_bytes(json.dumps(doc).encode())
    with pytest.raises(FormatError, match="older than this reader") as info:
        ucpformat.open(path)
    assert info.value.rule == "UCP-1.0-R058"
    (path / "zarr.json").write_bytes(encode_root(doc))
    assert ucpformat.validate(path, deep=True).valid


def test_the_digest_is_cheap_to_find_and_unique(tmp_path: Path) -> None:
    """UCP-1.0-R058: the writer's digest appears exactly once, as written."""
    path = _save(tmp_path / "ckpt", metadata={"looks_like": "0" * 64})
    raw = (path / "zarr.json").read_bytes()
    digest = json.loads(raw)["attributes"]["ucp"][ROOT_DIGEST]
    assert raw.count(digest.encode()) == 1
    assert ucpformat.open(path).metadata["looks_like"] == "0" * 64
    assert os.path.getsize(path / "zarr.json") == len(raw)

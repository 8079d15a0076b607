"""Damaged, hostile and unsupported input: each is refused with the right error class, the
requirement it breaks (``exc.rule``) and a message that names the tensor or file."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ucpformat
from tests.helpers import (
    assert_bits_equal,
    edit_node,
    edit_root,
    flip_byte,
    snapshot,
    write_explicit,
    write_json,
)
from ucpformat import errors
from ucpformat.checkpoint import commit as protocol
from ucpformat.checkpoint.metadata import ArrayMeta, GroupMeta, default_producer
from ucpformat.engine.checksum import crc_bytes
from ucpformat.engine.shard_index import EMPTY, index_nbytes
from ucpformat.engine.write import write_object
from ucpformat.format.dtypes import BY_NAME
from ucpformat.store import LocalStore

REPO = Path(__file__).resolve().parent.parent


def rule(n: int) -> str:
    return f"UCP-1.0-R{n:03d}"


def assert_refused(
    exc: pytest.ExceptionInfo[errors.UCPError], cls: type[Exception], rule_id: int,
    *names: str,
) -> None:
    """The error is of ``cls``, carries ``rule_id``, and its message names each of ``names``."""
    assert isinstance(exc.value, cls), repr(exc.value)
    assert exc.value.rule == rule(rule_id), repr(exc.value)
    for name in names:
        assert name in str(exc.value), (name, str(exc.value))


def assert_same_state(actual: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys()
        for k in expected:
            assert_same_state(actual[k], expected[k])
    elif isinstance(expected, np.ndarray | np.generic):
        assert_bits_equal(actual, np.asarray(expected))
    else:
        assert actual == expected or (actual != actual and expected != expected)


# -- damaged stored objects ------------------------------------------------------------------


def test_truncated_shard(sharded: Path) -> None:
    shard = sharded / "model" / "w" / "c" / "0" / "0"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    t = ucpformat.open(sharded)["model/w"]
    for read in (t.read, lambda: t[0, :2], lambda: t[:, 3]):
        with pytest.raises(errors.CorruptDataError) as exc:
            read()
        assert_refused(exc, errors.CorruptDataError, 41, "model/w", "model/w/c/0/0")
    shard.write_bytes(data[:10])  # shorter than the shard index
    with pytest.raises(errors.CorruptDataError) as exc:
        t.read()
    assert_refused(exc, errors.CorruptDataError, 41, "model/w", "truncated")
    assert ucpformat.open(sharded)["model/w"][4:, :].shape == (9, 11)  # other shards are fine


def test_flipped_byte_in_a_chunk_names_tensor_and_chunk(sharded: Path) -> None:
    flip_byte(sharded / "model" / "w" / "c" / "3" / "0", 0)  # first inner chunk of shard (3, 0)
    t = ucpformat.open(sharded)["model/w"]
    for read in (t.read, lambda: t[6, 0], lambda: t[6:8, :2]):
        with pytest.raises(errors.ChecksumError) as exc:
            read()
        assert_refused(exc, errors.ChecksumError, 41, "model/w", "chunk (3, 0)", "model/w/c/3/0")
    assert np.array_equal(t[:6], ucpformat.open(sharded)["model/w"][:6])  # untouched shards read

    flip_byte(sharded / "model" / "b" / "c" / "0", 1)  # an unsharded chunk
    with pytest.raises(errors.ChecksumError) as exc:
        ucpformat.open(sharded)["model/b"].read()
    assert_refused(exc, errors.ChecksumError, 41, "model/b", "model/b/c/0")


def test_flipped_byte_in_a_shard_index(sharded: Path) -> None:
    flip_byte(sharded / "model" / "w" / "c" / "1" / "0", -10)
    t = ucpformat.open(sharded)["model/w"]
    for read in (t.read, lambda: t[2, 1]):
        with pytest.raises(errors.ChecksumError) as exc:
            read()
        assert_refused(exc, errors.ChecksumError, 41, "model/w", "model/w/c/1/0", "index")


def test_deleted_shard_is_an_error_never_zeros(sharded: Path) -> None:
    (sharded / "model" / "w" / "c" / "2" / "0").unlink()
    t = ucpformat.open(sharded)["model/w"]
    for read in (t.read, lambda: t[4:6], lambda: t[5, 10], lambda: t[3:, ::4]):
        with pytest.raises(errors.MissingChunkError) as exc:
            read()
        assert_refused(exc, errors.MissingChunkError, 31, "model/w", "model/w/c/2/0")
    assert t[:4].shape == (4, 11)  # what does not touch the shard reads

    (sharded / "model" / "b" / "c" / "0").unlink()
    with pytest.raises(errors.MissingChunkError) as exc:
        ucpformat.open(sharded)["model/b"][1:3]
    assert_refused(exc, errors.MissingChunkError, 31, "model/b", "model/b/c/0")


def _mark_inner_chunk_empty(shard: Path, cps: tuple[int, ...], local: tuple[int, ...]) -> None:
    """Rewrite a shard's index so that inner chunk ``local`` is absent (offset = nbytes =
    2**64-1), with a valid index CRC: what a writer produces when it skips a chunk."""
    data = shard.read_bytes()
    isize = index_nbytes(cps)
    index = np.frombuffer(data[-isize:-4], "<u8").reshape((*cps, 2)).copy()
    index[local] = (EMPTY, EMPTY)
    body = index.tobytes()
    shard.write_bytes(data[:-isize] + body + crc_bytes(body))


def test_inner_chunk_marked_empty_is_missing_unless_sparse(
    sharded: Path, saved: Callable[..., Path]
) -> None:
    meta = ucpformat.open(sharded).arrays["model/w"]
    expected = ucpformat.open(sharded)["model/w"].read()
    _mark_inner_chunk_empty(sharded / "model" / "w" / "c" / "1" / "0", meta.chunks_per_shard,
                            (0, 2))
    t = ucpformat.open(sharded)["model/w"]
    for read in (t.read, lambda: t[2:4, 4:6], lambda: t[3, 5]):
        with pytest.raises(errors.MissingChunkError) as exc:
            read()
        assert_refused(exc, errors.MissingChunkError, 31, "model/w", "inner chunk (1, 2)")
    assert np.array_equal(t[2:4, :4], expected[2:4, :4])  # the shard's other chunks read

    edit_node(sharded, "model/w",
              lambda d: d["attributes"].setdefault("ucp", {}).update(sparse=True))
    got = ucpformat.open(sharded)["model/w"].read()
    expected[2:4, 4:6] = 0  # the fill value
    assert_bits_equal(got, expected)
    assert ucpformat.validate(sharded, deep=True).valid


def test_missing_shard_of_a_sparse_array_reads_fill_values(sharded: Path) -> None:
    expected = ucpformat.open(sharded)["model/w"].read()
    edit_node(sharded, "model/w",
              lambda d: d["attributes"].setdefault("ucp", {}).update(sparse=True))
    (sharded / "model" / "w" / "c" / "2" / "0").unlink()
    expected[4:6] = 0
    assert_bits_equal(ucpformat.open(sharded)["model/w"].read(), expected)
    assert_bits_equal(ucpformat.open(sharded)["model/w"][5, ::2], expected[5, ::2])


# -- the root: commit, version, features -----------------------------------------------------


def test_missing_root_is_an_incomplete_checkpoint(saved: Callable[..., Path]) -> None:
    path = saved()
    (path / "zarr.json").unlink()
    with pytest.raises(errors.IncompleteCheckpointError) as exc:
        ucpformat.open(path)
    assert_refused(exc, errors.IncompleteCheckpointError, 51, str(path))
    (path / "write-in-progress.ucp.json").write_text("{}")
    with pytest.raises(errors.IncompleteCheckpointError) as exc:
        ucpformat.open(path)
    assert_refused(exc, errors.IncompleteCheckpointError, 51, "interrupted")
    assert ucpformat.validate(path).rules() == {rule(51)}


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    for where in (tmp_path / "absent", tmp_path):
        with pytest.raises(errors.CheckpointNotFoundError) as exc:
            ucpformat.open(where)
        assert_refused(exc, errors.CheckpointNotFoundError, 51, str(where))


@pytest.mark.parametrize("version", [None, "1", 1.0, 1, "v1.0", "1.0.0", "01.0", "1.x", ""])
def test_missing_or_malformed_version(saved: Callable[..., Path], version: Any) -> None:
    path = saved()

    def set_version(doc: dict[str, Any]) -> None:
        if version is None:
            del doc["attributes"]["ucp"]["version"]
        else:
            doc["attributes"]["ucp"]["version"] = version

    edit_root(path, set_version)
    with pytest.raises(errors.VersionError) as exc:
        ucpformat.open(path)
    assert_refused(exc, errors.VersionError, 3, str(path))
    assert rule(3) in ucpformat.validate(path).rules()


def test_other_major_version_is_refused_naming_both_versions(saved: Callable[..., Path]) -> None:
    path = saved()
    edit_root(path, lambda d: d["attributes"]["ucp"].update(version="2.0"))
    with pytest.raises(errors.VersionError) as exc:
        ucpformat.open(path)
    assert_refused(exc, errors.VersionError, 60, "2.0", "1.0")
    assert rule(60) in ucpformat.validate(path).rules()


def test_newer_minor_version_with_unknown_keys_is_read(
    saved: Callable[..., Path], small_state: dict[str, Any]
) -> None:
    """R060/R062: a 1.7 checkpoint is readable by a 1.0 reader, which ignores what it does
    not know (new members of attributes.ucp, of the root, of array metadata)."""
    path = saved()

    def future(doc: dict[str, Any]) -> None:
        doc["attributes"]["ucp"].update(version="1.7", new_feature={"x": [1, 2]}, hint="y")
        doc["attributes"]["other_tool"] = {"k": 1}
        for node in doc["consolidated_metadata"]["metadata"].values():
            node.setdefault("attributes", {}).setdefault("ucp", {})["added_in_1_7"] = True

    edit_root(path, future)
    ckpt = ucpformat.open(path)
    assert ckpt.version == "1.7"
    assert_same_state(ckpt.to_dict(), small_state)


def test_must_understand_unknown_feature_is_refused(saved: Callable[..., Path]) -> None:
    path = saved()
    edit_root(path, lambda d: d["attributes"]["ucp"].update(must_understand=["x"]))
    with pytest.raises(errors.UnsupportedFeatureError) as exc:
        ucpformat.open(path)
    assert_refused(exc, errors.UnsupportedFeatureError, 61, "'x'")
    assert rule(61) in ucpformat.validate(path).rules()


# -- array metadata outside the format -------------------------------------------------------


def _codec_chain(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunk codec chain of an array document (inside the sharding codec if sharded)."""
    first = doc["codecs"][0]
    sharded = first["name"] == "sharding_indexed"
    return first["configuration"]["codecs"] if sharded else doc["codecs"]


BAD_ARRAYS: dict[str, tuple[str, Callable[[dict[str, Any]], Any], type[Exception], int]] = {
    "float8_e4m3 is not float8_e4m3fn": (
        "f8", lambda d: d.update(data_type="float8_e4m3"), errors.UnsupportedFeatureError, 20),
    "unknown data type": ("w", lambda d: d.update(data_type="float128"),
                          errors.UnsupportedFeatureError, 20),
    "big endian": ("w", lambda d: _codec_chain(d)[0].update(configuration={"endian": "big"}),
                   errors.FormatError, 23),
    "no endian on a 2-byte type": ("bf", lambda d: _codec_chain(d)[0].pop("configuration"),
                                   errors.FormatError, 23),
    "endian on a 1-byte type": (
        "u8", lambda d: _codec_chain(d)[0].update(configuration={"endian": "little"}),
        errors.FormatError, 23),
    "transpose codec first": (
        "w", lambda d: _codec_chain(d).insert(0, {"name": "transpose",
                                                  "configuration": {"order": [1, 0]}}),
        errors.FormatError, 22),
    "transpose codec in the compressor's place": (
        "w", lambda d: _codec_chain(d).__setitem__(1, {"name": "transpose",
                                                       "configuration": {"order": [1, 0]}}),
        errors.UnsupportedFeatureError, 24),
    "unknown compressor": (
        "w", lambda d: _codec_chain(d).__setitem__(1, {"name": "lzma", "configuration": {}}),
        errors.UnsupportedFeatureError, 24),
    "two compressors": (
        "w", lambda d: _codec_chain(d).insert(1, {"name": "gzip", "configuration": {"level": 1}}),
        errors.FormatError, 22),
    "missing crc32c": ("w", lambda d: _codec_chain(d).pop(), errors.FormatError, 40),
    "bytes codec alone": ("w", lambda d: _codec_chain(d).__delitem__(slice(1, None)),
                          errors.FormatError, 40),
    "missing crc32c, compressed": (
        "w", lambda d: _codec_chain(d).__setitem__(-1, {"name": "zstd",
                                                        "configuration": {"level": 3}}),
        errors.FormatError, 40),
    "index without crc32c": (
        "w", lambda d: d["codecs"][0]["configuration"]["index_codecs"].pop(),
        errors.FormatError, 40),
    "index at the start": (
        "w", lambda d: d["codecs"][0]["configuration"].update(index_location="start"),
        errors.FormatError, 22),
    "storage transformer": (
        "w", lambda d: d.update(storage_transformers=[{"name": "chunk_manifest_json"}]),
        errors.FormatError, 25),
    "shard not a multiple of the chunk": (
        "w", lambda d: d["codecs"][0]["configuration"].update(chunk_shape=[3, 2]),
        errors.FormatError, 28),
    "inner chunk rank differs from shape rank": (
        "w", lambda d: d["codecs"][0]["configuration"].update(chunk_shape=[2]),
        errors.FormatError, 28),
    "chunk grid rank differs from shape rank": (
        "w", lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[2, 12, 1]),
        errors.FormatError, 21),
    "chunk key encoding v2": (  # R035 spells out R021's chunk key encoding
        "w", lambda d: d.update(chunk_key_encoding={"name": "v2"}), errors.FormatError, 35),
    "bfloat16 fill value of float16 width": (  # R038: hexadecimal fill values (R026)
        "bf", lambda d: d.update(fill_value="0x3f8000"), errors.FormatError, 38),
    "shape beyond 2**63 bytes": (
        "w", lambda d: d.update(shape=[2**62, 13]), errors.FormatError, 27),
    "negative shape": ("w", lambda d: d.update(shape=[-1, 11]), errors.FormatError, 27),
    "version in a node": (
        "w", lambda d: d.setdefault("attributes", {}).update(ucp={"version": "1.0"}),
        errors.FormatError, 3),
}


@pytest.fixture
def typed(tmp_path: Path, rng: np.random.Generator) -> Path:
    """Arrays of a 4-, 2- and two 1-byte types, zstd-compressed 2x2 chunks in 4x4 shards."""
    return write_explicit(tmp_path / "typed", {
        f"model/{name}": (value, (2, 2), (4, 4), "zstd") for name, value in {
            "w": rng.standard_normal((13, 11)).astype(np.float32),
            "bf": rng.standard_normal((13, 11)).astype(ml_dtypes.bfloat16),
            "f8": rng.standard_normal((13, 11)).astype(ml_dtypes.float8_e4m3fn),
            "u8": rng.integers(0, 255, (13, 11)).astype(np.uint8),
        }.items()
    })


@pytest.mark.parametrize("case", list(BAD_ARRAYS))
def test_array_metadata_outside_the_format_is_refused_and_reported(typed: Path, case: str) -> None:
    tensor, damage, cls, rule_id = BAD_ARRAYS[case]
    path = f"model/{tensor}"
    assert ucpformat.open(typed).arrays[path].shard_shape is not None
    edit_node(typed, path, damage)
    with pytest.raises(errors.UCPError) as exc:
        ucpformat.open(typed)
    assert_refused(exc, cls, rule_id, path)
    report = ucpformat.validate(typed)
    assert rule(rule_id) in report.rules(), report.to_json()
    assert any(e.path == path for e in report.errors if e.rule == rule(rule_id))


# -- hostile shapes ---------------------------------------------------------------------------


def _huge(path: Path, *, sparse: bool) -> np.ndarray[Any, Any]:
    """A float32 array of shape (2**40, 2**10): 4 PiB, stored as 64 KiB chunks. Only the chunk
    at (0, 0) is written; unless sparse, every other chunk is missing."""
    meta = ArrayMeta(path="model/huge", shape=(2**40, 2**10), dtype=BY_NAME["float32"],
                     chunk_shape=(16, 1024), shard_shape=None, compression=None,
                     fill_value=np.float32(0), attributes={"ucp": {"sparse": sparse}})
    first = np.arange(16 * 1024, dtype=np.float32).reshape(16, 1024)
    store = LocalStore(path, durable=False)
    protocol.prepare_destination(store, overwrite=False)
    objects = [write_object(store, meta, (0, 0), first)]
    protocol.commit_checkpoint(store, arrays=[meta], groups=[GroupMeta("model")], objects=objects,
                  root_ucp={"producer": default_producer()})
    return first


@pytest.mark.parametrize("sparse", [True, False])
def test_petabyte_shape_opens_without_allocating_and_reads_slices(
    tmp_path: Path, sparse: bool
) -> None:
    first = _huge(tmp_path / "c", sparse=sparse)
    tracemalloc.start()
    try:
        ckpt = ucpformat.open(tmp_path / "c")
        t = ckpt["model/huge"]
        assert t.nbytes == 2**52
        assert_bits_equal(t[0, :4], first[0, :4])
        assert_bits_equal(t[15, -3:], first[15, -3:])
        if sparse:
            assert_bits_equal(t[2**40 - 1, 5:9], np.zeros(4, np.float32))
        else:
            with pytest.raises(errors.MissingChunkError):
                t[2**40 - 1, 5:9]
        with pytest.raises(errors.ResourceLimitError) as exc:
            t.read()
        assert_refused(exc, errors.ResourceLimitError, 90, "model/huge")
        with pytest.raises(errors.ResourceLimitError):
            t[: 2**35]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_validate_bounds_its_work_on_petabyte_shapes(tmp_path: Path) -> None:
    _huge(tmp_path / "dense", sparse=False)
    report = ucpformat.validate(tmp_path / "dense")
    assert rule(30) in report.rules()  # 2**36 chunks, one written; counted, not listed
    _huge(tmp_path / "sparse", sparse=True)
    assert ucpformat.validate(tmp_path / "sparse", deep=True).valid


# -- names that try to leave the checkpoint ---------------------------------------------------

HOSTILE_KEYS = [
    "../x", "/abs", "model/../../b", "a\\b", "%2e%2e", "model/%2e%2e", "model/%2E%2e",
    "model/..", "model/.", "model//w", "model/w/", "./model", "model/%41", "model/%2f",
    "model/w%00", "model/%C3%28", "model/%", "model/%2", "model/ w", "model/é", "~/x",
    "C:\\x", "model/__x",
]


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_consolidated_keys_that_escape_or_are_not_canonical_are_refused(
    sharded: Path, key: str
) -> None:
    def rename(doc: dict[str, Any]) -> None:
        meta = doc["consolidated_metadata"]["metadata"]
        meta[key] = meta.pop("model/w")

    edit_root(sharded, rename)
    with pytest.raises(errors.UnsafePathError) as exc:
        ucpformat.open(sharded)
    assert_refused(exc, errors.UnsafePathError, 10, repr(key))
    assert rule(10) in ucpformat.validate(sharded).rules()


@pytest.mark.parametrize("node", ["zarr.json", "ZARR.JSON", "Zarr.Json"])
def test_node_named_zarr_json_in_consolidated_metadata_is_refused(sharded: Path, node: str) -> None:
    """A tensor *called* zarr.json is stored as zarr%2Ejson; the unescaped node name would
    collide with its group's own metadata file, so it is not canonical (R010)."""
    def rename(doc: dict[str, Any]) -> None:
        meta = doc["consolidated_metadata"]["metadata"]
        meta[f"model/{node}"] = meta.pop("model/w")

    edit_root(sharded, rename)
    with pytest.raises(errors.UnsafePathError) as exc:
        ucpformat.open(sharded)
    assert_refused(exc, errors.UnsafePathError, 10, node)


def test_tensors_called_zarr_json_round_trip(saved: Callable[..., Path]) -> None:
    state = {"model": {"zarr.json": A}, "ext": {"ZARR.JSON": {"x": A + 1}}}
    path = saved(state)
    assert (path / "model" / "zarr%2Ejson" / "zarr.json").is_file()
    assert (path / "ext" / "ZARR%2EJSON" / "x" / "zarr.json").is_file()
    back = ucpformat.open(path).to_dict()
    assert_bits_equal(back["model"]["zarr.json"], A)
    assert_bits_equal(back["ext"]["ZARR.JSON"]["x"], A + 1)
    assert ucpformat.validate(path, deep=True).valid


def test_escaped_dot_dot_names_a_tensor_inside_never_the_parent(saved: Callable[..., Path]) -> None:
    """``%2E%2E`` is the canonical node name of a tensor *called* "..": it is a directory of
    that literal name inside its group, so it can never reach the parent directory."""
    secret = np.arange(4, dtype=np.int32)
    inside = np.arange(4, 8, dtype=np.int32)
    path = saved({"model": {"..": inside, "x": {"..": inside + 10}}, "w": secret})
    ckpt = ucpformat.open(path)
    assert sorted(ckpt.keys()) == ["model/%2E%2E", "model/x/%2E%2E", "w"]
    assert_bits_equal(ckpt["model/%2E%2E"].read(), inside)
    assert_bits_equal(ckpt["model/x/%2E%2E"].read(), inside + 10)
    assert (path / "model" / "%2E%2E" / "c" / "0").is_file()


def test_symlink_out_of_the_checkpoint_is_refused(sharded: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    chunk = sharded / "model" / "b" / "c" / "0"
    shutil.copy(chunk, outside / "0")  # same bytes: only the link is wrong
    chunk.unlink()
    chunk.symlink_to(outside / "0")
    with pytest.raises(errors.UnsafePathError) as exc:
        ucpformat.open(sharded)["model/b"].read()
    assert_refused(exc, errors.UnsafePathError, 91, "model/b/c/0", "outside the checkpoint")
    assert rule(91) in ucpformat.validate(sharded).rules()

    shards = sharded / "model" / "w" / "c"
    shutil.copytree(shards, outside / "c")
    shutil.rmtree(shards)
    shards.symlink_to(outside / "c", target_is_directory=True)
    with pytest.raises(errors.UnsafePathError) as exc:
        ucpformat.open(sharded)["model/w"][0]
    assert_refused(exc, errors.UnsafePathError, 91, "model/w/c/0/0")

    root = sharded / "zarr.json"
    shutil.copy(root, outside / "zarr.json")
    root.unlink()
    root.symlink_to(outside / "zarr.json")
    with pytest.raises(errors.UnsafePathError) as exc:
        ucpformat.open(sharded)
    assert_refused(exc, errors.UnsafePathError, 91, "zarr.json")


def test_symlink_planted_after_a_read_is_refused_by_the_open_checkpoint(
    sharded: Path, tmp_path: Path
) -> None:
    """The store remembers which paths it has checked (UCP-1.0-R091) so that reading
    many chunks of a shard checks its path once; a file replaced since, here by a link
    out of the checkpoint, is checked again by a checkpoint that is still open."""
    ckpt = ucpformat.open(sharded)
    assert_bits_equal(ckpt["model/b"].read(), np.arange(5, dtype=np.int32))
    assert ckpt["model/w"][0].shape == (11,)
    outside = tmp_path / "outside"
    outside.mkdir()
    chunk = sharded / "model" / "b" / "c" / "0"
    shutil.copy(chunk, outside / "0")
    chunk.unlink()
    chunk.symlink_to(outside / "0")
    with pytest.raises(errors.UnsafePathError) as exc:
        ckpt["model/b"].read()
    assert_refused(exc, errors.UnsafePathError, 91, "model/b/c/0", "outside the checkpoint")
    shards = sharded / "model" / "w" / "c"
    shutil.copytree(shards, outside / "c")
    shutil.rmtree(shards)
    shards.symlink_to(outside / "c", target_is_directory=True)
    with pytest.raises(errors.UnsafePathError) as exc:
        ckpt["model/w"][0]
    assert_refused(exc, errors.UnsafePathError, 91, "model/w/c/0/0")


def test_symlink_inside_the_checkpoint_is_refused_too(sharded: Path) -> None:
    """UCP-1.0-R089: no link is followed, even one that stays inside the checkpoint (a
    reader cannot check where a link leads and then open it without a race)."""
    chunk = sharded / "model" / "b" / "c" / "0"
    os.replace(chunk, sharded / "model" / "b" / "elsewhere")
    chunk.symlink_to(sharded / "model" / "b" / "elsewhere")
    with pytest.raises(errors.UnsafePathError) as exc:
        ucpformat.open(sharded)["model/b"].read()
    assert_refused(exc, errors.UnsafePathError, 89, "model/b/c/0", "symbolic link")
    assert rule(89) in ucpformat.validate(sharded).rules()


# -- what the writer refuses ------------------------------------------------------------------

A = np.zeros(3, np.float32)


@pytest.mark.parametrize(
    ("state", "rule_id", "named"),
    [
        ({"model": {"": A}}, 11, "empty"),
        ({"model": {"a\x00b": A}}, 11, "NUL"),
        ({"model": {"\ud800": A}}, 11, "surrogate"),
        ({"model": {"x" * 256: A}}, 12, "255"),
        ({"model": {"語" * 29: A}}, 12, "255"),  # 29 * 9 = 261 escaped bytes
        ({"model": {"W": A, "w": A}}, 13, "'w'"),
        ({"model": {"W": A, "w": {"x": A}}}, 13, "'w'"),
        ({"x.ucp.json": A}, 4, ".ucp.json"),
        ({"model": {3: A}}, 11, "3"),
    ],
)
def test_writer_refuses_bad_names_before_writing(
    tmp_path: Path, state: dict[Any, Any], rule_id: int, named: str
) -> None:
    with pytest.raises((errors.InvalidNameError, errors.InvalidValueError)) as exc:
        ucpformat.save(tmp_path / "c", state)
    assert exc.value.rule == rule(rule_id), repr(exc.value)
    assert named in str(exc.value)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "value",
    [
        np.array([object(), 1], dtype=object),
        np.array(["2026-01-01"], dtype="datetime64[D]"),
        np.array([1], dtype="timedelta64[s]"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
        np.array(["abc"]),
        np.array([b"abc"]),
        np.zeros(2, dtype=np.longdouble),
        np.zeros(2, dtype=ml_dtypes.int4),
        np.zeros(2, dtype=ml_dtypes.float8_e4m3b11fnuz),
        np.zeros(2, dtype="V4"),
    ],
    ids=lambda v: str(v.dtype),
)
def test_writer_refuses_dtypes_outside_the_closed_list(tmp_path: Path, value: Any) -> None:
    with pytest.raises(errors.UnsupportedDtypeError) as exc:
        ucpformat.save(tmp_path / "c", {"model": {"bad.weight": value}})
    assert_refused(exc, errors.UnsupportedDtypeError, 20, "model/bad.weight")
    assert not (tmp_path / "c").exists()


def test_writer_refuses_values_that_are_not_json(tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"training": {"x": {1, 2}}}, {}),
        ({"model": {"w": A}}, {"metadata": {"x": object()}}),
    ]
    for state, kw in cases:
        with pytest.raises(errors.InvalidValueError) as exc:
            ucpformat.save(tmp_path / "c", state, **kw)
        assert exc.value.rule == rule(70)
        assert not (tmp_path / "c").exists()  # checked before anything is written


def test_saving_onto_a_committed_checkpoint_refuses_and_changes_nothing(
    saved: Callable[..., Path], small_state: dict[str, Any]
) -> None:
    path = saved()
    before = snapshot(path)
    with pytest.raises(errors.CheckpointExistsError) as exc:
        ucpformat.save(path, {"model": {"other": A}})
    assert_refused(exc, errors.CheckpointExistsError, 53, str(path), "overwrite=True")
    assert snapshot(path) == before
    ucpformat.save(path, {"model": {"other": A}}, overwrite=True, durable=False)
    assert list(ucpformat.open(path).keys()) == ["model/other"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_saving_into_a_directory_of_foreign_files_refuses(tmp_path: Path, overwrite: bool) -> None:
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "notes.txt").write_text("mine")
    (tmp_path / "c" / "sub" / "zarr.json").write_text("{}")
    before = snapshot(tmp_path / "c")
    with pytest.raises(errors.CheckpointExistsError) as exc:
        ucpformat.save(tmp_path / "c", {"model": {"w": A}}, overwrite=overwrite)
    assert_refused(exc, errors.CheckpointExistsError, 53, str(tmp_path / "c"), "not a UCP")
    assert snapshot(tmp_path / "c") == before
    # a root zarr.json that is not a UCP root is foreign too
    write_json(tmp_path / "c" / "zarr.json", {"zarr_format": 3, "node_type": "group"})
    with pytest.raises(errors.CheckpointExistsError):
        ucpformat.save(tmp_path / "c", {"model": {"w": A}}, overwrite=True)
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


# -- interrupted and failing saves ------------------------------------------------------------

CHILD = r"""
import sys, time
import numpy as np
import ucpformat
from ucpformat.store import LocalStore

path, mode = sys.argv[1], sys.argv[2]


class Slow(LocalStore):
    # Slow enough to be killed half-way, deterministically: 10 ms per object.
    def put(self, key, buffers, *, atomic=False):
        n = super().put(key, buffers, atomic=atomic)
        time.sleep(0.01)
        return n

    def create(self, key, buffers, *, atomic=False):
        n = super().create(key, buffers, atomic=atomic)
        time.sleep(0.01)
        return n

    def delete(self, key):
        if key == "zarr.json":
            time.sleep(0.5)  # widen the window between the marker and the un-commit
        super().delete(key)


state = {"model": {f"w{i}": np.full((32, 32), i + 1000, np.float32) for i in range(60)}}
ucpformat.save(Slow(path), state, overwrite=mode == "overwrite", workers=1, durable=True)
print("finished", flush=True)
"""


def _new_state() -> dict[str, Any]:
    return {"model": {f"w{i}": np.full((32, 32), i + 1000, np.float32) for i in range(60)}}


def _start_save(path: Path, mode: str) -> subprocess.Popen[bytes]:
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _kill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the save never reached the kill point"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    out, _err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL and b"finished" not in out


def _objects(path: Path) -> int:
    """Data objects of the new state written so far."""
    return sum(p.is_file() for p in path.glob("model/w*/c/**/*"))


@pytest.mark.slow
def test_killed_save_is_refused_and_nothing_else_is_hurt(
    saved: Callable[..., Path], small_state: dict[str, Any], tmp_path: Path
) -> None:
    previous = saved(name="previous")
    target = tmp_path / "target"
    proc = _start_save(target, "new")
    _kill_when(proc, lambda: _objects(target) >= 5)
    assert not (target / "zarr.json").exists()

    with pytest.raises(errors.IncompleteCheckpointError) as exc:
        ucpformat.open(target)
    assert_refused(exc, errors.IncompleteCheckpointError, 51, str(target))
    report = ucpformat.validate(target)
    assert not report.valid and report.rules() == {rule(51)}
    assert_same_state(ucpformat.open(previous).to_dict(), small_state)
    assert ucpformat.validate(previous, deep=True).valid

    ucpformat.save(target, _new_state(), durable=False)  # a retry needs no overwrite
    assert_same_state(ucpformat.open(target).to_dict(), _new_state())
    assert ucpformat.validate(target, deep=True).valid


@pytest.mark.slow
@pytest.mark.parametrize("kill_point", ["marker", "objects"])
def test_killed_overwrite_leaves_the_old_checkpoint_intact_or_refused(
    saved: Callable[..., Path], small_state: dict[str, Any], kill_point: str
) -> None:
    path = saved(name="ckpt")
    marker = path / "write-in-progress.ucp.json"
    proc = _start_save(path, "overwrite")
    if kill_point == "marker":
        _kill_when(proc, marker.exists)
    else:
        _kill_when(proc, lambda: _objects(path) >= 5)
        assert not (path / "zarr.json").exists()  # un-committed before new data was written

    if (path / "zarr.json").exists():
        # killed before the un-commit: the old checkpoint, whole and unchanged
        assert_same_state(ucpformat.open(path).to_dict(), small_state)
        report = ucpformat.validate(path, deep=True)
        assert report.valid and [w.rule for w in report.warnings] == [rule(56)]
    else:
        with pytest.raises(errors.IncompleteCheckpointError):
            ucpformat.open(path)
        assert ucpformat.validate(path).rules() == {rule(51)}
    ucpformat.save(path, _new_state(), overwrite=True, durable=False)
    assert_same_state(ucpformat.open(path).to_dict(), _new_state())


class FailingStore(LocalStore):
    """A store whose ``fail_at``-th write (put or create) raises OSError (as a full disk
    would)."""

    def __init__(self, root: Path, fail_at: int | None) -> None:
        super().__init__(root, durable=False)
        self.fail_at = fail_at
        self.puts = 0
        self._count_lock = threading.Lock()

    def _fail(self, key: str) -> None:
        with self._count_lock:
            self.puts += 1
            fail = self.puts == self.fail_at
        if fail:
            raise OSError(28, "No space left on device", key)

    def put(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        self._fail(key)
        return super().put(key, buffers, atomic=atomic)

    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        self._fail(key)
        return super().create(key, buffers, atomic=atomic)


def _count_puts(tmp_path: Path, state: dict[str, Any]) -> int:
    store = FailingStore(tmp_path / "count", None)
    ucpformat.save(store, state)
    return store.puts


def test_injected_storage_failures_give_write_error_and_nothing_committed(
    tmp_path: Path, small_state: dict[str, Any]
) -> None:
    total = _count_puts(tmp_path, small_state)
    assert total > 10
    for n in range(1, total + 1):
        path = tmp_path / f"fresh{n}"
        with pytest.raises(errors.WriteError) as exc:
            ucpformat.save(FailingStore(path, n), small_state)
        assert type(exc.value) is errors.WriteError
        assert str(path) in str(exc.value) and "No space left" in str(exc.value)
        with pytest.raises((errors.IncompleteCheckpointError, errors.CheckpointNotFoundError)):
            ucpformat.open(path)
        assert not list(path.glob("*.tmp-*"))
        ucpformat.save(path, small_state, durable=False)  # the retry works, no overwrite needed
        assert_same_state(ucpformat.open(path).to_dict(), small_state)


def test_injected_failures_during_overwrite_never_half_load(
    saved: Callable[..., Path], small_state: dict[str, Any], tmp_path: Path
) -> None:
    new = {"model": {"x": np.arange(6.0), "y": np.ones((3, 3), np.int8)}, "training": {"s": 1}}
    total = _count_puts(tmp_path, new)
    for n in range(1, total + 1):
        path = saved(name=f"old{n}")
        with pytest.raises(errors.WriteError) as exc:
            ucpformat.save(FailingStore(path, n), new, overwrite=True)
        try:
            ckpt = ucpformat.open(path)
        except (errors.IncompleteCheckpointError, errors.CheckpointNotFoundError):
            # the message says the old checkpoint is gone, and the partial files are
            assert "the checkpoint that was here is gone" in str(exc.value), exc.value
            assert "files it had written were removed" in str(exc.value), exc.value
            assert not [p for p in path.rglob("*") if not p.is_dir()]
        else:
            assert n == 1  # only a failure before anything changed leaves the old one
            assert "is gone" not in str(exc.value)
            assert_same_state(ckpt.to_dict(), small_state)
        ucpformat.save(path, new, overwrite=True, durable=False)
        assert_same_state(ucpformat.open(path).to_dict(), new)


def test_json_documents_with_duplicate_keys_or_nan_are_refused(saved: Callable[..., Path]) -> None:
    path = saved()
    text = (path / "zarr.json").read_text()
    twice = re.sub(r'"zarr_format": ?3', '"zarr_format": 3, "zarr_format": 3', text, count=1)
    (path / "zarr.json").write_text(twice)
    with pytest.raises(errors.FormatError) as exc:
        ucpformat.open(path)
    assert "duplicate" in str(exc.value) and exc.value.rule == rule(1)
    (path / "zarr.json").write_text(re.sub(r'"zarr_format": ?3', '"zarr_format": NaN', text,
                                           count=1))
    with pytest.raises(errors.FormatError):
        ucpformat.open(path)


def test_manifest_of_refused_checkpoint_is_not_needed_to_refuse(saved: Callable[..., Path]) -> None:
    """open reads only the root: a checkpoint whose other metadata is gone still opens, and
    what is missing is reported when it is read (and by validate)."""
    path = saved()
    (path / "manifest.ucp.json").unlink()
    os.remove(path / "model" / "fc.weight" / "zarr.json")
    ckpt = ucpformat.open(path)
    assert ckpt["model/fc.weight"].read().shape == (96, 40)
    assert {rule(42), rule(55)} <= ucpformat.validate(path).rules()


# -- compressed chunks that lie about their size -----------------------------------------------

BOMBS = r"""
import json, resource, sys
import numpy as np
import ucpformat
from ucpformat.engine.checksum import crc_bytes
from ucpformat.engine.compression import Compression
from ucpformat.format.dtypes import BY_NAME

root = sys.argv[1]
bombs = {}
for name in ("zstd", "gzip:1", "blosc"):
    comp = Compression.parse(name, BY_NAME["uint8"])
    bombs[name] = bytes(comp.numcodec().encode(np.zeros(300_000_000, np.uint8)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = {}
for name, bomb in bombs.items():
    path = f"{root}/{name.split(':')[0]}"
    ucpformat.save(path, {"model": {"x": np.ones(64, np.uint8)}}, compression=name,
                   durable=False)
    with open(f"{path}/model/x/c/0", "wb") as f:  # a valid CRC: only the size lies
        f.write(bomb + crc_bytes(bomb))
    try:
        ucpformat.open(path)["model/x"].read()
        results[name] = None
    except ucpformat.errors.UCPError as exc:
        results[name] = [type(exc).__name__, exc.rule, str(exc), len(bomb)]
growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"results": results, "growth_kib": growth}))
"""


@pytest.mark.slow
def test_decompression_bombs_are_refused_before_they_expand(tmp_path: Path) -> None:
    """A few-KB chunk that expands to 300 MB is refused without allocating the 300 MB
    (measured as the peak resident memory of a fresh process)."""
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", BOMBS, str(tmp_path)], capture_output=True,
                          env={**os.environ, "PYTHONPATH": pythonpath}, check=True)
    out = json.loads(done.stdout)
    for name, result in out["results"].items():
        assert result is not None, name
        cls, rule_id, message, size = result
        # refused before decompressing (R093), or unread: too large for its chunk (R098)
        assert size < 3_000_000 and cls == "CorruptDataError", result
        assert rule_id in (rule(93), rule(98)), result
        assert "model/x" in message and "chunk (0)" in message
    assert out["growth_kib"] < 100 * 1024, out


@pytest.mark.parametrize("name", ["zstd", "gzip", "blosc"])
def test_chunks_that_decompress_short_or_long_are_refused(tmp_path: Path, name: str) -> None:
    """A writer that stores an edge chunk unpadded (a classic zarr bug) or too long is
    refused, never padded with garbage or cut."""
    from ucpformat.engine.checksum import crc_bytes
    from ucpformat.engine.compression import Compression

    ucpformat.save(tmp_path / "c", {"model": {"x": np.arange(64, dtype=np.uint8)}},
                   compression=name, durable=False)
    chunk = tmp_path / "c" / "model" / "x" / "c" / "0"
    codec = Compression.parse(name, BY_NAME["uint8"]).numcodec()
    for n in (60, 65, 0):
        body = bytes(codec.encode(np.arange(n, dtype=np.uint8)))
        chunk.write_bytes(body + crc_bytes(body))
        with pytest.raises(errors.CorruptDataError) as exc:
            ucpformat.open(tmp_path / "c")["model/x"].read()
        assert_refused(exc, errors.CorruptDataError, 93, "model/x", "chunk (0)")


def test_zstd_chunks_are_one_frame_that_declares_its_size(tmp_path: Path) -> None:
    """UCP-1.0-R047: several frames, a skippable frame, a frame without a content size or
    with a window larger than the chunk are refused before decompressing (valid zstd, but
    a reader could not bound what it allocates from their headers); so are frames that
    declare another size (R093) or are cut short."""
    import numcodecs

    from ucpformat.engine.checksum import crc_bytes

    z = numcodecs.Zstd(level=3)
    a = np.arange(100, dtype=np.uint8)
    ucpformat.save(tmp_path / "c", {"model": {"x": a}}, compression="zstd", durable=False)
    chunk = tmp_path / "c" / "model" / "x" / "c" / "0"
    one = bytes(z.encode(a))
    assert one[4] == 0x20  # single segment, 1-byte content size
    chunk.write_bytes(one + crc_bytes(one))
    assert_bits_equal(ucpformat.open(tmp_path / "c")["model/x"].read(), a)
    no_size = one[:4] + b"\x00\x08" + one[6:]  # same blocks, window descriptor, no size
    big_window = one[:4] + b"\x80\x50" + (100).to_bytes(4, "little") + one[6:]  # 1 MiB
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    refused = {
        "two frames": (bytes(z.encode(a[:30])) + bytes(z.encode(a[30:])), 47),
        "skippable frame first": (skippable + one, 47),
        "no content size": (no_size, 47),
        "window beyond the chunk": (big_window, 47),
        "bytes after the frame": (one + b"\x00", 47),
        "another size": (bytes(z.encode(a[:99])), 93),
        "cut short": (one[:-3], 41),
    }
    for what, (body, rule_id) in refused.items():
        chunk.write_bytes(body + crc_bytes(body))
        with pytest.raises(errors.CorruptDataError) as exc:
            ucpformat.open(tmp_path / "c")["model/x"].read()
        assert exc.value.rule == rule(rule_id), (what, exc.value)


# -- random damage ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint with sharded compressed, sharded raw and unsharded arrays, and its state."""
    rng = np.random.default_rng(11)
    state = {"model": {"w": rng.standard_normal((13, 11)).astype(np.float32),
                       "z": rng.integers(0, 9, (9, 7)).astype(np.int16),
                       "b": np.arange(5, dtype=np.int32)},
             "training": {"step": 5}}
    path = tmp_path_factory.mktemp("template") / "c"
    ucpformat.save(path, state, chunk_bytes=16, shard_bytes=160, compression="zstd",
                   durable=False)
    return path, state


DAMAGES = ["flip", "truncate", "append", "replace", "zero"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_damage_to_stored_objects_is_detected_never_misread(
    template: tuple[Path, dict[str, Any]], data: st.DataObject
) -> None:
    src, state = template
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c"
        shutil.copytree(src, path)
        files = sorted(str(p.relative_to(path)) for p in path.glob("model/*/c/**/*")
                       if p.is_file())
        target = path / data.draw(st.sampled_from(files))
        raw = bytearray(target.read_bytes())
        damage = data.draw(st.sampled_from(DAMAGES))
        if damage == "flip":
            for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4,
                                        unique=True)):
                raw[i] ^= data.draw(st.integers(1, 255))
        elif damage == "truncate":
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
        elif damage == "append":
            raw += data.draw(st.binary(min_size=1, max_size=40))
        elif damage == "replace":
            raw = bytearray(data.draw(st.binary(min_size=len(raw), max_size=len(raw))))
        else:
            raw = bytearray(len(raw))
        assume(bytes(raw) != target.read_bytes())
        target.write_bytes(bytes(raw))
        ckpt = ucpformat.open(path)
        for name, expected in state["model"].items():
            t = ckpt[f"model/{name}"]
            for index in ((), (slice(1, None), slice(None, None, 2))[: expected.ndim]):
                try:
                    got = t[index]
                except (errors.CorruptDataError, errors.MissingChunkError) as exc:
                    assert exc.rule in (rule(41), rule(31)) and exc.tensor == t.path
                    continue
                assert_bits_equal(got, expected[index])
        report = ucpformat.validate(path, deep=True)
        assert not report.valid


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_damage_to_metadata_never_crashes(
    template: tuple[Path, dict[str, Any]], data: st.DataObject
) -> None:
    """Any damage to the root or a node's zarr.json gives a checkpoint that opens, or an
    error of ucpformat's hierarchy; reads and validation raise nothing else either."""
    src, _state = template
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c"
        shutil.copytree(src, path)
        target = path / data.draw(st.sampled_from(
            ["zarr.json", "zarr.json", "model/w/zarr.json", "manifest.ucp.json"]))
        raw = bytearray(target.read_bytes())
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.sampled_from(list(b'0123456789-.,:[]{}"eE \\x')))
        target.write_bytes(bytes(raw))
        try:
            ckpt = ucpformat.open(path)
        except errors.UCPError:
            pass
        else:
            for t in ckpt.tensors():
                with contextlib.suppress(errors.UCPError):
                    t[...]
        report = ucpformat.validate(path, deep=True)
        assert isinstance(report.valid, bool)


# -- bool bytes (UCP-1.0-R008) -----------------------------------------------------------


def test_bool_bytes_other_than_0_and_1_are_never_saved(tmp_path: Path) -> None:
    mask = np.array([0, 1, 2, 1], dtype=np.uint8).view(np.bool_)  # a view of other bytes
    with pytest.raises(errors.InvalidValueError) as info:
        ucpformat.save(tmp_path / "c", {"model": {"mask": mask}}, durable=False)
    assert info.value.rule == "UCP-1.0-R008" and info.value.tensor == "model/mask"
    assert not (tmp_path / "c" / "zarr.json").exists()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_bool_bytes_other_than_0_and_1_are_refused_on_read(
    tmp_path: Path, compression: str | None
) -> None:
    """Also in the edge chunk's padding, and from the zero-copy path of uncompressed chunks."""
    path = write_explicit(tmp_path / "c", {
        "model/mask": (np.ones((5, 4), np.bool_), (2, 4), None, compression)})
    meta = ucpformat.open(path).arrays["model/mask"]
    # the last chunk holds row 4 and one row of padding: 0x02 in the padding
    chunk = np.ones((2, 4), np.uint8)
    chunk[1, 3] = 2
    key = "model/mask/c/2/0"
    payload = meta.codec.encode(chunk.view(np.bool_))
    (path / key).write_bytes(b"".join(bytes(b) for b in payload))
    for region in ([0, 0], [5, 4]), ([4, 0], [5, 4]):
        with pytest.raises(errors.CorruptDataError) as info:
            ucpformat.open(path)["model/mask"].read_region(*region)
        assert info.value.rule == "UCP-1.0-R008" and "(2, 0)" in info.value.message
    assert ucpformat.open(path)["model/mask"].read_region([0, 0], [4, 4]).all()

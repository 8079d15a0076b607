"""ucpformat.validate: every kind of damage is reported with its requirement id; deep
validation reads every byte."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.helpers import (
    edit_node,
    edit_root,
    flip_byte,
    read_json,
    refresh_manifest,
    write_explicit,
    write_json,
)
from ucpformat.engine.checksum import crc_bytes
from ucpformat.engine.shard_index import EMPTY, index_nbytes


def rule(n: int) -> str:
    return f"UCP-1.0-R{n:03d}"


def warning_rules(report: ucpformat.Report) -> set[str | None]:
    return {w.rule for w in report.warnings}


def _shard(ckpt: Path, i: int = 0) -> Path:
    return ckpt / "model" / "w" / "c" / str(i) / "0"


def test_a_valid_checkpoint_is_valid_without_warnings(
    saved: Callable[..., Path], sharded: Path
) -> None:
    for path in (saved(), sharded, saved(name="nohash", hash_algorithm=None)):
        for deep in (False, True):
            report = ucpformat.validate(path, deep=deep)
            assert report.to_json() == {"valid": True, "errors": [], "warnings": []}
            assert report.valid and not report.issues
    report = ucpformat.validate(sharded, deep=True)
    assert report.checked_objects == sum(
        m.object_count for m in ucpformat.open(sharded).arrays.values()
    )


def test_report_json_shape(sharded: Path) -> None:
    (sharded / "zarr.json").unlink()
    doc = ucpformat.validate(sharded).to_json()
    assert set(doc) == {"valid", "errors", "warnings"} and doc["valid"] is False
    assert doc["errors"] and all(set(e) == {"rule", "path", "message"} for e in doc["errors"])
    assert all(re.fullmatch(r"UCP-1\.0-R\d{3}", e["rule"]) for e in doc["errors"])
    assert json.loads(json.dumps(doc)) == doc
    assert doc["errors"][0]["rule"] == rule(51)


def _set_empty(shard: Path, cps: tuple[int, ...], local: tuple[int, ...]) -> None:
    data = shard.read_bytes()
    isize = index_nbytes(cps)
    index = np.frombuffer(data[-isize:-4], "<u8").reshape((*cps, 2)).copy()
    index[local] = (EMPTY, EMPTY)
    body = index.tobytes()
    shard.write_bytes(data[:-isize] + body + crc_bytes(body))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _drop_from_manifest(ckpt: Path, key: str) -> None:
    manifest = read_json(ckpt / "manifest.ucp.json")
    del manifest["files"][key]
    write_json(ckpt / "manifest.ucp.json", manifest)


def _tamper_manifest(ckpt: Path) -> None:
    manifest = read_json(ckpt / "manifest.ucp.json")
    entry = manifest["files"]["model/w/c/0/0"]
    entry["nbytes"] += 1
    write_json(ckpt / "manifest.ucp.json", manifest)


def _rename_node(ckpt: Path, old: str, new: str) -> None:
    def rename(doc: dict[str, Any]) -> None:
        meta = doc["consolidated_metadata"]["metadata"]
        meta[new] = meta.pop(old)

    edit_root(ckpt, rename)


def _consolidated_differs(ckpt: Path) -> None:
    own = ckpt / "model" / "w" / "zarr.json"
    doc = read_json(own)
    doc["attributes"] = {"ucp": {"role": "buffer"}}
    write_json(own, doc)
    refresh_manifest(ckpt)  # so that only the disagreement is wrong


def _symlink_out(ckpt: Path) -> None:
    chunk = ckpt / "model" / "b" / "c" / "0"
    outside = ckpt.parent / "outside-chunk"
    os.replace(chunk, outside)
    chunk.symlink_to(outside)


# damage -> (errors, warnings) that shallow validation must report
SHALLOW: dict[str, tuple[Callable[[Path], Any], set[int], set[int]]] = {
    "missing root": (lambda c: (c / "zarr.json").unlink(), {51}, set()),
    "deleted shard": (lambda c: _shard(c, 2).unlink(), {31}, set()),
    "truncated shard": (lambda c: _truncate(_shard(c)), {43}, set()),
    "manifest deleted": (lambda c: (c / "manifest.ucp.json").unlink(), {42}, set()),
    "manifest tampered": (_tamper_manifest, {43}, set()),
    "object missing from the manifest": (
        lambda c: (_drop_from_manifest(c, "model/w/c/1/0"), refresh_manifest(c)), {30}, {44}),
    "node zarr.json missing from the manifest": (
        lambda c: (_drop_from_manifest(c, "model/w/zarr.json"), refresh_manifest(c)), {42},
        {44}),
    "extra file": (lambda c: (c / "model" / "notes.txt").write_text("x"), set(), {44}),
    "consolidated differs from the node": (_consolidated_differs, {55}, set()),
    "node zarr.json missing": (lambda c: (c / "model" / "w" / "zarr.json").unlink(), {55, 31},
                               set()),
    "version 2.0": (lambda c: edit_root(c, lambda d: d["attributes"]["ucp"].update(
        version="2.0")), {60}, set()),
    "version missing": (lambda c: edit_root(c, lambda d: d["attributes"]["ucp"].pop("version")),
                        {3}, set()),
    "must_understand": (lambda c: edit_root(c, lambda d: d["attributes"]["ucp"].update(
        must_understand=["sparse-v2"])), {61}, set()),
    "write in progress next to the root": (
        lambda c: (c / "write-in-progress.ucp.json").write_text("{}"), set(), {56}),
    "parent group missing": (
        lambda c: edit_root(c, lambda d: d["consolidated_metadata"]["metadata"].pop("model")),
        {5}, set()),
    "reserved root name": (lambda c: _rename_node(c, "model/b", "b.ucp.json"), {4}, set()),
    "model is an array": (lambda c: (edit_root(c, lambda d: d["consolidated_metadata"][
        "metadata"].pop("model")), _rename_node(c, "model/b", "model")), {4}, set()),
    "case-colliding siblings": (lambda c: _rename_node(c, "model/b", "model/W"), {13}, set()),
    "escaping name": (lambda c: _rename_node(c, "model/b", "model/%2e%2e"), {10}, set()),
    "symlink out of the checkpoint": (_symlink_out, {91}, set()),
    "big-endian bytes codec": (
        lambda c: edit_node(c, "model/w", lambda d: d["codecs"][0]["configuration"]["codecs"][0]
                            .update(configuration={"endian": "big"})), {23}, set()),
    "index_location start": (
        lambda c: edit_node(c, "model/w", lambda d: d["codecs"][0]["configuration"].update(
            index_location="start")), {22}, set()),
}


@pytest.mark.parametrize("damage", list(SHALLOW))
def test_damage_is_reported_with_its_rule(sharded: Path, damage: str) -> None:
    fn, errors, warnings = SHALLOW[damage]
    fn(sharded)
    report = ucpformat.validate(sharded)
    assert {rule(n) for n in errors} <= report.rules(), report.to_json()
    assert {rule(n) for n in warnings} <= warning_rules(report), report.to_json()
    assert report.valid == (not errors)
    if not errors and not warnings:
        assert not report.issues
    deep = ucpformat.validate(sharded, deep=True)
    assert {rule(n) for n in errors} <= deep.rules()


@pytest.mark.parametrize("hashed", [True, False])
def test_deep_catches_same_size_corruption_that_shallow_cannot(
    tmp_path: Path, rng: np.random.Generator, hashed: bool
) -> None:
    w = rng.standard_normal((13, 11)).astype(np.float32)
    path = write_explicit(tmp_path / "c", {"model/w": (w, (2, 2), (2, 12), None)},
                          hash_algorithm="sha256" if hashed else None)
    flip_byte(_shard(path, 3), 2)  # inside the first inner chunk of shard 3: same size
    assert ucpformat.validate(path).valid  # sizes all match
    deep = ucpformat.validate(path, deep=True)
    assert not deep.valid
    assert rule(41) in deep.rules()  # the chunk's CRC32C
    assert (rule(43) in deep.rules()) == hashed  # the file's SHA-256, when the manifest has it
    crc = next(e for e in deep.errors if e.rule == rule(41))
    assert crc.path == "model/w" and "chunk (3, 0)" in crc.message
    if hashed:
        sha = next(e for e in deep.errors if e.rule == rule(43))
        assert sha.path == "model/w/c/3/0"


def test_deep_catches_corrupt_shard_index_and_empty_inner_chunk(sharded: Path) -> None:
    flip_byte(_shard(sharded, 1), -5)
    meta = ucpformat.open(sharded).arrays["model/w"]
    _set_empty(_shard(sharded, 4), meta.chunks_per_shard, (0, 1))
    refresh_manifest(sharded)  # hashes match the damaged bytes: only the content is wrong
    assert ucpformat.validate(sharded).valid
    deep = ucpformat.validate(sharded, deep=True)
    assert {rule(41), rule(31)} <= deep.rules()
    assert any("model/w/c/1/0" in e.message and "index" in e.message for e in deep.errors)
    assert any("inner chunk (4, 1)" in e.message for e in deep.errors if e.rule == rule(31))


def test_deep_sha256_mismatch_in_metadata_files(sharded: Path) -> None:
    node = sharded / "model" / "b" / "zarr.json"
    text = node.read_text()
    node.write_text(text.replace('"int32"', '"int16"'))  # same size, different meaning
    report = ucpformat.validate(sharded, deep=True)
    assert {rule(55), rule(43)} <= report.rules()
    assert any(e.path == "model/b/zarr.json" for e in report.errors if e.rule == rule(43))


def test_optimizer_naming_tensors_outside_model(saved: Callable[..., Path],
                                                small_state: dict[str, Any]) -> None:
    state = dict(small_state)
    state["optimizer"] = dict(small_state["optimizer"])
    state["optimizer"]["param_groups"] = [{"params": ["fc.weight", "fc.bias", "ghost.weight"]}]
    report = ucpformat.validate(saved(state, name="pg"))
    assert rule(82) in report.rules()
    assert any("ghost.weight" in e.message for e in report.errors)

    state["optimizer"]["param_groups"] = [{"params": ["fc.weight"]}]
    report = ucpformat.validate(saved(state, name="unlisted"))
    assert rule(82) in report.rules()  # state for fc.bias, which no param group lists
    assert any("fc.bias" in e.message for e in report.errors)

    state["optimizer"]["param_groups"] = [{"params": ["fc.weight", "fc.bias", "fc.weight"]}]
    assert rule(81) in ucpformat.validate(saved(state, name="twice")).rules()


def test_huge_integers_in_values_are_a_warning(saved: Callable[..., Path]) -> None:
    path = saved({"model": {"w": np.zeros(2)}, "training": {"seed": 2**53 + 1, "ok": 2**53 - 1}})
    report = ucpformat.validate(path)
    assert report.valid and warning_rules(report) == {rule(71)}
    path = saved({"model": {"w": np.zeros(2), "cfg": {"n": -(2**60)}}}, name="group")
    assert warning_rules(ucpformat.validate(path)) == {rule(71)}
    path = saved({"model": {"w": np.zeros(2)}}, name="meta", metadata={"tokens": 10**20})
    assert warning_rules(ucpformat.validate(path)) == {rule(71)}


def test_validate_never_raises_on_garbage(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    for content in (b"", b"\xff\xfe", b"[]", b'{"zarr_format": 3}', b"null", b"{" * 100000):
        (tmp_path / "c" / "zarr.json").write_bytes(content)
        report = ucpformat.validate(tmp_path / "c", deep=True)
        assert not report.valid and report.errors


def test_an_unknown_feature_is_reported_once(sharded: Path) -> None:
    """One fault, one issue: must_understand with a feature 1.0 lacks gives one R061 error
    that names the feature (the validator checked it twice, in two wordings)."""
    edit_root(sharded, lambda d: d["attributes"]["ucp"].update(must_understand=["sparse-v2"]))
    issues = [i for i in ucpformat.validate(sharded).issues if i.rule == rule(61)]
    assert len(issues) == 1, issues
    assert "sparse-v2" in issues[0].message

"""The compiled schema validator only makes schema checks faster, never weaker.

``ucpformat.format.schemas`` asks jsonschema-rs first and ``jsonschema`` only about documents
jsonschema-rs does not accept, so every verdict and message is jsonschema's as long as
jsonschema-rs accepts nothing that jsonschema refuses: checked here on every document of
the conformance corpus and on hostile mutations of them. Also the algorithmic properties
that make ``validate`` of 100,000 arrays fast (issue 13, item 7): jsonschema runs only on
documents that fail, and the manifest check lists the checkpoint once instead of asking
for every file's size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucpformat
from ucpformat.checkpoint.metadata import MAX_DOCUMENT_DEPTH, json_depth
from ucpformat.checkpoint.validation import root_violations
from ucpformat.format import schemas
from ucpformat.store import LocalStore
from ucpformat.testing.hostile import dump, mutated

CASES = Path(__file__).resolve().parent.parent / "conformance" / "cases"


def _documents() -> Iterator[tuple[str, Any]]:
    """(schema kind, document) for every metadata document of the conformance cases."""
    for path in sorted(p for p in CASES.rglob("*.json") if p.is_file()):
        try:
            doc = json.loads(path.read_bytes())
        except ValueError:
            continue  # a case of a document that is no JSON
        if path.name == "expected.json":
            yield "conformance-expected", doc
        elif path.name == "rules.json":
            yield "rules", doc
        elif path.name == "manifest.ucp.json":
            yield "manifest", doc
        elif path.name == "zarr.json" and path.parent.name == "checkpoint":
            yield "root", doc
        elif path.name == "zarr.json" and isinstance(doc, dict):
            yield ("array" if doc.get("node_type") == "array" else "group"), doc
            attrs = doc.get("attributes")
            ucp = attrs.get("ucp") if isinstance(attrs, dict) else None
            if isinstance(ucp, dict) and "layout" in ucp:
                yield "layout", ucp["layout"]
            if isinstance(ucp, dict) and path.parent.name == "optimizer" and "values" in ucp:
                yield "optimizer", ucp["values"]


DOCUMENTS = list(_documents())


def _jsonschema_accepts(kind: str, doc: Any) -> bool:
    return bool(schemas.validator(kind).is_valid(doc))


def test_the_corpus_covers_every_metadata_kind() -> None:
    kinds = {kind for kind, _ in DOCUMENTS}
    assert {"root", "array", "group", "manifest", "optimizer", "layout", "rules",
            "conformance-expected"} <= kinds
    assert len(DOCUMENTS) > 1000


def test_the_compiled_validator_agrees_on_the_corpus() -> None:
    """It accepts what jsonschema accepts (so the fast path is taken) and nothing more;
    it may refuse more: then jsonschema decides."""
    for kind, doc in DOCUMENTS:
        fast, slow = schemas.fast_accepts(kind, doc), _jsonschema_accepts(kind, doc)
        assert not (fast and not slow), (kind, doc)
    valid = [(k, d) for k, d in DOCUMENTS if _jsonschema_accepts(k, d)]
    refused = [(k, d) for k, d in valid if not schemas.fast_accepts(k, d)]
    # the two roots it cannot convert: a lone surrogate and a NaN token (R006, R001)
    assert len(refused) <= 2 and len(valid) > 1000, refused


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_compiled_validator_accepts_no_mutation_jsonschema_refuses(data: Any) -> None:
    kind, original = data.draw(st.sampled_from(DOCUMENTS))
    doc = data.draw(mutated(original))
    try:  # as a reader would get it: hostile values expanded, through a JSON text
        doc = json.loads(dump(doc))
    except (ValueError, RecursionError):
        return
    if json_depth(doc) > MAX_DOCUMENT_DEPTH:
        return  # refused (R096) before any schema check
    fast, slow = schemas.fast_accepts(kind, doc), _jsonschema_accepts(kind, doc)
    assert not (fast and not slow), (kind, doc)
    assert schemas.is_valid(kind, doc) == slow
    assert (schemas.violations(kind, doc) == []) == slow


@pytest.mark.parametrize("value", [2**63, 2**64 + 1, -1, 1.5, True, "1", 10**40])
def test_integers_beyond_the_schema_bounds_are_refused_by_both(value: Any) -> None:
    """Big integers (no rounding to a float that would pass ``maximum``), non-integers."""
    kind, array = next((k, d) for k, d in DOCUMENTS if k == "array" and schemas.is_valid(k, d))
    doc = {**array, "shape": [value] * len(array["shape"])}
    assert not schemas.fast_accepts(kind, doc) and not _jsonschema_accepts(kind, doc)


class _CountingValidator:
    """Stands for a jsonschema validator and counts the documents it is asked about."""

    def __init__(self, inner: Any, seen: list[Any]) -> None:
        self.inner, self.seen = inner, seen

    def iter_errors(self, doc: Any) -> Any:
        self.seen.append(doc)
        return self.inner.iter_errors(doc)

    def is_valid(self, doc: Any) -> bool:
        self.seen.append(doc)
        return bool(self.inner.is_valid(doc))


def _root_of(nodes: int, tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "many"
    model = {f"w{i}": np.zeros(2, np.float32) for i in range(nodes)}
    ucpformat.save(path, {"model": model}, durable=False,
                   array_attributes=lambda p, a: {"ucp": {"layout": {"layer": int(p[7:])}}})
    doc: dict[str, Any] = json.loads((path / "zarr.json").read_bytes())
    return doc


def test_jsonschema_runs_only_on_documents_that_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root of 300 distinct array documents: none goes through jsonschema when all are
    valid; with two bad ones, only those two do (and their violations are reported)."""
    real = schemas.validator
    seen: list[Any] = []
    monkeypatch.setattr(schemas, "validator", lambda kind: _CountingValidator(real(kind), seen))
    doc = _root_of(300, tmp_path)
    assert root_violations(doc) == [] and seen == []
    nodes = doc["consolidated_metadata"]["metadata"]
    nodes["model/w7"]["data_type"] = "float31"
    nodes["model/w9"]["shape"] = [-1]
    found = root_violations(doc)
    assert {v.pointer.split("/")[3] for v in found} == {"model~1w7", "model~1w9"}
    assert all(not isinstance(d, dict) or d.get("node_type") == "array" for d in seen)
    assert len(seen) == 2, len(seen)


def test_the_manifest_check_lists_instead_of_asking_each_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCP-1.0-R098 (e): validate asks for the size of the metadata documents it reads,
    not of every stored object (a path check each: most of the time of 100,000 arrays)."""
    path = tmp_path / "ckpt"
    model = {f"w{i}": np.zeros((4, 4), np.float32) for i in range(20)}
    ucpformat.save(path, {"model": model}, durable=False, chunk_bytes=16, shard_bytes=16)
    objects = sum(1 for p in path.rglob("*") if p.is_file() and "/c/" in str(p))
    assert objects == 80
    asked: list[str] = []
    real = LocalStore.size

    def counting(self: LocalStore, key: str) -> int | None:
        asked.append(key)
        return real(self, key)

    monkeypatch.setattr(LocalStore, "size", counting)
    report = ucpformat.validate(path)
    assert report.valid, report.errors
    assert not [k for k in asked if "/c/" in k], asked


def test_a_damaged_object_is_still_found_by_the_listing(tmp_path: Path) -> None:
    """R031 and R043 as before: a missing and a shortened stored object."""
    path = tmp_path / "ckpt"
    ucpformat.save(path, {"model": {"w": np.ones((4, 4), np.float32)}}, durable=False,
                   chunk_bytes=32, shard_bytes=32)
    (path / "model" / "w" / "c" / "0" / "0").unlink()
    chunk = path / "model" / "w" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-1])
    found = {(i.rule, i.path) for i in ucpformat.validate(path).errors}
    assert ("UCP-1.0-R031", "model/w/c/0/0") in found
    assert ("UCP-1.0-R043", "model/w/c/1/0") in found


def _odd_tree(root: Path, outside: Path) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"12345")
    (root / "a" / "g").write_bytes(b"")
    (root / "z").write_bytes(b"1")
    (root / "caf\u00e9.txt").write_bytes(b"22")  # a name check_key refuses
    (root / "link").symlink_to(root / "z")  # a link to a file inside
    (root / "escape").symlink_to(outside / "secret")  # a link out
    (root / "dirlink").symlink_to(outside)  # a link to a directory: not walked
    (root / "broken").symlink_to(root / "nothing")
    os.mkfifo(root / "a" / "fifo")


def test_list_sizes_is_list_with_the_sizes_size_gives(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    root = tmp_path / "store"
    _odd_tree(root, outside)
    store = LocalStore(root, durable=False)
    listed = list(store.list_sizes())
    assert [k for k, _ in listed] == list(store.list())
    sizes = dict(listed)
    # every entry is listed, a link to a directory too (an entry, never walked: R089)
    assert sizes == {"a/b/f": 5, "a/g": 0, "z": 1, "caf\u00e9.txt": None, "link": None,
                     "escape": None, "broken": None, "a/fifo": None, "dirlink": None}
    for key, size in listed:
        if size is not None:
            assert store.size(key) == size
    assert list(store.list_sizes("a")) == [("a/b/f", 5), ("a/fifo", None), ("a/g", 0)]
    assert dict(LocalStore(root / "dirlink", durable=False).list_sizes()) == {"secret": 6}


def test_list_sizes_leaves_an_overridden_size_to_be_asked(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"abc")

    class Sized(LocalStore):
        def size(self, key: str) -> int | None:
            return 7

    assert list(Sized(root, durable=False).list_sizes()) == [("d/f", None)]
    assert list(LocalStore(root, durable=False).list_sizes()) == [("d/f", 3)]
    linked = tmp_path / "linked"
    linked.symlink_to(root / "d")
    # a prefix that is a link: the link itself is the entry, never followed (R089), and
    # its size is left to size() (which refuses it)
    store = LocalStore(tmp_path, durable=False)
    assert list(store.list_sizes("linked")) == [("linked", None)]


def test_node_documents_compared_by_text_as_json_equal_would(tmp_path: Path) -> None:
    """R055 (and R073's equality): a node file that differs from its consolidated copy only
    in a number's kind or a zero's sign is reported; one that differs only in the order of
    its members or its indentation is not."""
    path = tmp_path / "ckpt"
    ucpformat.save(path, {"model": {"w": np.ones(4, np.float32), "v": np.ones(4, np.float32)},
                          "training": {"step": 1, "lr": 0.0}}, durable=False)

    def rewrite(key: str, edit: Any) -> None:  # at the size the manifest lists (R043)
        raw = (path / key).read_bytes()
        text = edit(json.loads(raw)).encode()
        assert len(text) <= len(raw)
        (path / key).write_bytes(text + b" " * (len(raw) - len(text)))

    rewrite("model/w/zarr.json", lambda d: json.dumps(dict(reversed(list(d.items())))))
    rewrite("model/v/zarr.json", lambda d: json.dumps({**d, "zarr_format": 3.0}))
    rewrite("training/zarr.json", lambda d: json.dumps(d).replace('"lr": 0.0', '"lr": -0.0'))
    found = {i.path for i in ucpformat.validate(path).errors if i.rule == "UCP-1.0-R055"}
    assert found == {"model/v", "training"}

"""The code's parsers and the JSON Schemas agree on what a valid metadata document is.

``ucpformat.checkpoint.metadata.parse_array``/``parse_group`` and
``ucpformat.checkpoint.reader.parse_root`` (everything ``open`` checks) are the fast path;
``schemas/1.0`` is the normative, machine-readable description. For documents the library writes,
both accept. For mutated documents, whenever the schema rejects, the code rejects too; the code may
be stricter only where JSON Schema cannot express the rule (the CODE_ONLY table).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import ucpformat
from tests.helpers import random_array, read_json
from ucpformat.checkpoint.metadata import parse_array, parse_group
from ucpformat.checkpoint.reader import parse_root
from ucpformat.errors import UCPError
from ucpformat.format import schemas
from ucpformat.format.dtypes import DATA_TYPES

#: Rules the code checks and the schemas cannot: rule -> pattern its message must match
#: (None: any message of that rule). Everything else the code refuses, the schema refuses.
CODE_ONLY: dict[str, str | None] = {
    "UCP-1.0-R023": None,  # endian presence depends on the data type's size
    "UCP-1.0-R026": None,  # the fill value's form depends on the data type
    "UCP-1.0-R036": None,  # a number's range after rounding depends on the data type
    "UCP-1.0-R038": None,  # the number of hexadecimal digits depends on the data type
    "UCP-1.0-R027": r"more than 2\*\*63-1 bytes",  # the byte size is a product
    "UCP-1.0-R028": None,  # shard shape a multiple of the chunk shape; chunks per shard
    "UCP-1.0-R010": None,  # canonical escapes (the schema checks only the alphabet)
    "UCP-1.0-R013": None,  # case-colliding siblings
    "UCP-1.0-R021": r"differ in rank",  # two arrays' lengths must agree
    "UCP-1.0-R001": r"dimension_names",  # one name per dimension: lengths must agree
    "UCP-1.0-R005": None,  # a node's parent must be a group: across documents
    "UCP-1.0-R060": None,  # another major version: the schema is of 1.x documents
    "UCP-1.0-R061": r"does not implement",  # which features this reader implements
    "UCP-1.0-R070": r"nested deeper than",  # values nested beyond 64 levels (a reader limit)
}


def code_only(exc: UCPError) -> bool:
    if exc.rule not in CODE_ONLY:
        return False
    pattern = CODE_ONLY[exc.rule]
    return pattern is None or re.search(pattern, exc.message) is not None


# -- the corpus of valid documents ---------------------------------------------------------


def _ts_array(path: Path) -> None:
    """An array written by tensorstore (its own spelling: no chunk_key_encoding
    configuration, no attributes, no index_location)."""
    meta = {
        "shape": [5, 4], "data_type": "bfloat16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": "0x3f80",
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [2, 2],
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                       {"name": "gzip", "configuration": {"level": 1}}, {"name": "crc32c"}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}]}}],
    }
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)},
                 "metadata": meta, "create": True}).result()
    t.write(np.arange(20).reshape(5, 4).astype(ml_dtypes.bfloat16)).result()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    base = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    arrays: list[tuple[str, Any]] = []
    groups: list[tuple[str, Any]] = []
    roots: list[Any] = []

    def collect(path: Path, *, keep_root: bool) -> None:
        root = read_json(path / "zarr.json")
        if keep_root:
            roots.append(root)
        for node, doc in root["consolidated_metadata"]["metadata"].items():
            (arrays if doc["node_type"] == "array" else groups).append((node, doc))

    layouts = [(None, 1 << 20), ("zstd", 8), ("gzip", 1 << 20), ("blosc", 8)]
    for i, dt in enumerate(DATA_TYPES):
        compression, chunk_items = layouts[i % len(layouts)]
        arr = random_array(rng, dt, (5, 3))
        path = base / f"dt{i}"
        ucpformat.save(path, {"model": {"x": arr, "s": arr[0, 0]}}, compression=compression,
                       chunk_bytes=chunk_items * dt.itemsize, shard_bytes=8 * chunk_items
                       * dt.itemsize, durable=False)
        collect(path, keep_root=i < 2)
    state = {
        "model": {"w": np.ones((6, 4), np.float32), "語彙/emb": np.zeros(3, ml_dtypes.bfloat16)},
        "optimizer": {"type": "adam", "param_groups": [{"params": ["w"], "lr": 0.1}],
                      "state": {"w": {"exp_avg": np.ones((6, 4), np.float32)}}},
        "training": {"step": 1, "loss": float("nan")},
    }
    ucpformat.save(base / "state", state, metadata={"run": "x", "inf": float("inf")},
                   chunk_bytes=16, durable=False,
                   array_attributes=lambda p, a: {"ucp": {"role": "parameter", "sparse": False}})
    collect(base / "state", keep_root=True)
    _ts_array(base / "ts" / "model" / "t")
    arrays.append(("model/t", read_json(base / "ts" / "model" / "t" / "zarr.json")))
    ucpformat.adopt(base / "ts", durable=False)
    collect(base / "ts", keep_root=True)
    return {"array": arrays, "group": groups, "root": roots}


def code_check(kind: str, path: str, doc: Any) -> UCPError | None:
    """The code's verdict: None (accepted) or the error it raised."""
    try:
        if kind == "array":
            parse_array(path, doc)
        elif kind == "group":
            parse_group(path, doc)
        else:
            parse_root(doc, where="root")
    except UCPError as exc:
        return exc
    return None


@pytest.mark.parametrize("kind", ["array", "group", "root"])
def test_documents_the_library_writes_are_valid_for_both(
    corpus: dict[str, list[Any]], kind: str
) -> None:
    assert corpus[kind]
    for item in corpus[kind]:
        path, doc = (item if kind != "root" else ("", item))
        assert schemas.violations(kind, doc) == [], (path, doc)
        assert code_check(kind, path, doc) is None, (path, doc)


def test_corpus_covers_every_data_type_and_codec(corpus: dict[str, list[Any]]) -> None:
    docs = [d for _, d in corpus["array"]]
    text = json.dumps(docs)
    assert {d["data_type"] for d in docs} == {dt.name for dt in DATA_TYPES}
    for name in ("sharding_indexed", "zstd", "gzip", "blosc", "crc32c"):
        assert f'"{name}"' in text
    assert {"name": "default"} in [d["chunk_key_encoding"] for d in docs]


def test_schema_data_type_enum_is_the_closed_list() -> None:
    enum = schemas.schema("defs")["$defs"]["dataType"]["enum"]
    assert enum == [dt.name for dt in DATA_TYPES]


# -- mutations --------------------------------------------------------------------------------

MUTANTS: list[Any] = [
    None, True, False, 0, 1, -1, 2, 7, 64, 65, 2**63 - 1, 2**63, 2**64, 1.5, -0.5, 1e300,
    "", "x", "little", "big", "bytes", "crc32c", "zstd", "gzip", "blosc", "lz4", "shuffle",
    "transpose", "sharding_indexed", "end", "start", "regular", "default", "/", ".", "..",
    "float8_e4m3", "float8_e4m3fn", "float32", "bfloat16", "int8", "0x3f80", "0x00", "0xzz",
    "NaN", "Infinity", "-Infinity", "1.0", "2.0", "1.7", "01.0", "array", "group", "inline",
    "parameter", "weights", "manifest.ucp.json", "a" * 64, "A" * 64,
    [], [0], [1], [1, 1], [-1], [None], ["x"], ["x", "x"], [1.5], [[]],
    {}, {"name": "crc32c"}, {"name": "crc32c", "configuration": {}}, {"name": "bytes"},
    {"name": "bytes", "configuration": {"endian": "little"}},
    {"name": "transpose", "configuration": {"order": [0]}},
    {"name": "zstd", "configuration": {"level": 3}}, {"$ucp_float": "NaN"},
    {"$ucp_float": "nan"}, {"$ucp_float": "NaN", "x": 1}, {"separator": "."},
]
KEYS = ["x", "name", "configuration", "endian", "level", "checksum", "typesize", "version",
        "sparse", "role", "values", "must_understand", "storage_transformers",
        "dimension_names", "index_location", "chunk_shape", "codecs", "fill_value", "manifest",
        "producer", "created", "metadata", "attributes", "ucp", "$ucp_float", "separator"]
NODE_NAMES = ["../x", "/abs", "model/%2e%2e", "model/%41", "model/%2E", "model/__x",
              "model/zarr.json", "model/ZARR.JSON", "Model", "model/W", "model/w/c", "a\\b",
              "model/", "", "x.ucp.json", "model/%C3%A9", "model/%C3"]


def _locations(doc: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _locations(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _locations(v, (*at, i))


def _get(doc: Any, at: tuple[Any, ...]) -> Any:
    for k in at:
        doc = doc[k]
    return doc


@st.composite
def mutated(draw: st.DrawFn, doc: Any) -> Any:
    """``doc`` with 1-3 mutations: keys dropped, added or renamed, values replaced by other
    types or other names, numbers nudged, list items added or removed."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        locations = list(_locations(doc))
        at = draw(st.sampled_from(locations))
        value = _get(doc, at)
        ops = ["replace"] if at else []
        if at:
            ops.append("delete")
        if isinstance(value, int) and not isinstance(value, bool):
            ops.append("nudge")
        if isinstance(value, dict):
            ops += ["add", "rename"] if value else ["add"]
        if isinstance(value, list):
            ops.append("append")
        if not ops:
            continue
        op = draw(st.sampled_from(ops))
        parent = _get(doc, at[:-1]) if at else None
        mutant = draw(st.one_of(st.sampled_from(MUTANTS), st.integers(-3, 70),
                                st.text(max_size=4)))
        if op == "replace":
            parent[at[-1]] = copy.deepcopy(mutant)
        elif op == "delete":
            del parent[at[-1]]
        elif op == "nudge":
            parent[at[-1]] = draw(st.sampled_from(
                [value + 1, value - 1, -value, 0, value * 2**40, value * 3]))
        elif op == "add":
            value[draw(st.sampled_from(KEYS))] = copy.deepcopy(mutant)
        elif op == "append":
            value.append(copy.deepcopy(draw(st.sampled_from(value)) if value and draw(
                st.booleans()) else mutant))
        elif op == "rename":
            old = draw(st.sampled_from(sorted(value)))
            new = draw(st.sampled_from([*KEYS, *NODE_NAMES]))
            if new not in value:
                value[new] = value.pop(old)
        note(f"{op} at {at!r}")
    return doc


def single_mutations(doc: Any) -> Iterator[tuple[str, Any]]:
    """Every single mutation of ``doc`` from a fixed menu: each key deleted, each value
    replaced by each JSON type and by nearby names and numbers, each object given each
    known key, each list grown."""
    for at in _locations(doc):
        value = _get(doc, at)
        replacements: list[Any] = [None, True, -1, 0, 1.5, "x", [], {}, 2**64]
        if isinstance(value, str):
            replacements += ["", value.upper(), value + "x", "big", "start", "transpose", "lz4",
                             "float8_e4m3", "1.7", "2.0", "0x3f", "NaN", "Infinity", "..",
                             "%2e%2e", "a/b"]
        if isinstance(value, int) and not isinstance(value, bool):
            replacements += [value + 1, value - 1, -value, value * 2**40, 2**63]
        if isinstance(value, list):
            replacements += [value[:-1], value + value[-1:], [*value, None]]
        if at:
            yield f"delete {at}", _replaced(doc, at, _DELETE)
            for r in replacements:
                yield f"replace {at} by {r!r}", _replaced(doc, at, r)
        if isinstance(value, dict):
            for key in KEYS:
                if key not in value:
                    for v in (None, "x", []):
                        yield f"add {key!r}: {v!r} at {at}", _replaced(doc, (*at, key), v)
            for old in value:
                for new in NODE_NAMES[:6]:
                    if new not in value:
                        changed = copy.deepcopy(doc)
                        target = _get(changed, at)
                        target[new] = target.pop(old)
                        yield f"rename {old!r} to {new!r} at {at}", changed


_DELETE = object()


def _replaced(doc: Any, at: tuple[Any, ...], value: Any) -> Any:
    changed = copy.deepcopy(doc)
    parent = _get(changed, at[:-1])
    if value is _DELETE:
        del parent[at[-1]]
    else:
        parent[at[-1]] = copy.deepcopy(value)
    return changed


def _pick(corpus: dict[str, list[Any]], kind: str, which: str) -> tuple[str, Any]:
    if kind == "root":
        return "", min(corpus["root"], key=lambda d: len(json.dumps(d)))
    items = corpus[kind]
    if which == "tensorstore":
        return next(i for i in items if i[0] == "model/t")
    if which == "sharded":
        return next(i for i in items if i[1]["codecs"][0]["name"] == "sharding_indexed"
                    and i[1]["data_type"] == "float32")
    if which == "one-byte":
        return next(i for i in items if i[1]["data_type"] == "float8_e4m3fn")
    if which == "values":
        return next(i for i in items if i[1].get("attributes", {}).get("ucp", {}).get("values"))
    return items[0]


@pytest.mark.parametrize(("kind", "which"), [
    ("array", "sharded"), ("array", "one-byte"), ("array", "tensorstore"), ("group", "values"),
    ("root", "smallest"),
])
def test_every_single_mutation_schema_rejects_implies_code_rejects(
    corpus: dict[str, list[Any]], kind: str, which: str
) -> None:
    path, doc = _pick(corpus, kind, which)
    disagreements = []
    checked = 0
    for what, changed in single_mutations(doc):
        checked += 1
        violations = schemas.violations(kind, changed)
        exc = code_check(kind, path, changed)
        if violations and exc is None:
            disagreements.append(f"{what}: schema refuses ({violations[0].message}), code accepts")
        elif exc is not None and not violations and not code_only(exc):
            disagreements.append(f"{what}: code refuses ({exc}), schema accepts")
    assert checked > 500
    assert disagreements == []


SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _check_agreement(kind: str, path: str, doc: Any) -> None:
    violations = schemas.violations(kind, doc)
    exc = code_check(kind, path, doc)
    note(f"schema: {[(v.rule, v.pointer, v.message) for v in violations][:3]}")
    note(f"code: {exc!r}")
    if violations:
        assert exc is not None, "the schema refuses a document the code accepts"
    elif exc is not None:
        assert code_only(exc), f"the code refuses, under {exc.rule}, a document the schema accepts"


@SETTINGS
@given(data=st.data())
def test_mutated_arrays_schema_rejects_implies_code_rejects(
    corpus: dict[str, list[Any]], data: st.DataObject
) -> None:
    path, doc = data.draw(st.sampled_from(corpus["array"]))
    _check_agreement("array", path, data.draw(mutated(doc)))


@SETTINGS
@given(data=st.data())
def test_mutated_groups_schema_rejects_implies_code_rejects(
    corpus: dict[str, list[Any]], data: st.DataObject
) -> None:
    path, doc = data.draw(st.sampled_from(corpus["group"]))
    _check_agreement("group", path, data.draw(mutated(doc)))


@SETTINGS
@given(data=st.data())
def test_mutated_roots_schema_rejects_implies_code_rejects(
    corpus: dict[str, list[Any]], data: st.DataObject
) -> None:
    doc = data.draw(st.sampled_from(corpus["root"]))
    _check_agreement("root", "", data.draw(mutated(doc)))


@pytest.mark.parametrize(
    ("kind", "doc_fn", "rule"),
    [
        # documents the schema accepts and only the code can refuse, one per code-only rule
        ("array", lambda d: d.update(fill_value="0x3f"), "UCP-1.0-R038"),
        ("array", lambda d: d.update(fill_value=3.5e38), "UCP-1.0-R036"),
        ("array", lambda d: d.update(fill_value=[0, 0]), "UCP-1.0-R026"),
        ("array", lambda d: d.update(shape=[2**62, 2**62]), "UCP-1.0-R027"),
        ("array", lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[1]),
         "UCP-1.0-R021"),
        ("array", lambda d: d.update(dimension_names=["a"]), "UCP-1.0-R001"),
    ],
)
def test_code_only_rules_are_code_only(
    corpus: dict[str, list[Any]], kind: str, doc_fn: Any, rule: str
) -> None:
    path, doc = next((p, copy.deepcopy(d)) for p, d in corpus["array"]
                     if d["data_type"] == "float32" and len(d["shape"]) == 2)
    doc_fn(doc)
    assert schemas.violations(kind, doc) == []
    exc = code_check(kind, path, doc)
    assert exc is not None and exc.rule == rule and code_only(exc)


def test_deeply_nested_values_are_a_code_only_limit(corpus: dict[str, list[Any]]) -> None:
    path, doc = _pick(corpus, "group", "values")
    doc = copy.deepcopy(doc)
    deep: Any = 1
    for _ in range(70):
        deep = [deep]
    doc["attributes"]["ucp"]["values"]["deep"] = deep
    assert schemas.violations("group", doc) == []
    exc = code_check("group", path, doc)
    assert exc is not None and code_only(exc)


# -- decisions of the spec that both must pin (issue: spec 1.0 hardening) ----------------------


def _float32_array(corpus: dict[str, list[Any]]) -> tuple[str, Any]:
    return next((p, copy.deepcopy(d)) for p, d in corpus["array"]
                if d["data_type"] == "float32" and len(d["shape"]) == 2
                and d["codecs"][0]["name"] == "sharding_indexed")


def _verdicts(kind: str, path: str, doc: Any) -> tuple[set[str], str | None]:
    exc = code_check(kind, path, doc)
    return {v.rule for v in schemas.violations(kind, doc)}, (exc.rule if exc else None)


@pytest.mark.parametrize("spelling", [
    {"name": "default", "configuration": {"separator": "/"}},
    {"name": "default", "configuration": {}},
    {"name": "default"},
])
def test_chunk_key_encoding_spellings_are_valid_for_both(
    corpus: dict[str, list[Any]], spelling: Any
) -> None:
    path, doc = _float32_array(corpus)
    doc["chunk_key_encoding"] = spelling
    assert _verdicts("array", path, doc) == (set(), None)


@pytest.mark.parametrize("spelling", [
    "default", {"name": "default", "configuration": {"separator": "."}},
    {"name": "v2", "configuration": {"separator": "/"}},
    {"name": "default", "configuration": {"separator": "/", "x": 1}},
    {"name": "default", "configuration": None}, {"name": "default", "x": {}},
])
def test_other_chunk_key_encodings_are_refused_by_both(
    corpus: dict[str, list[Any]], spelling: Any
) -> None:
    path, doc = _float32_array(corpus)
    doc["chunk_key_encoding"] = spelling
    assert _verdicts("array", path, doc) == ({"UCP-1.0-R035"}, "UCP-1.0-R035")


def _set_chain(doc: Any, chain: list[Any]) -> None:
    doc["codecs"][0]["configuration"]["codecs"] = chain


_LE = {"name": "bytes", "configuration": {"endian": "little"}}
_BLOSC = {"cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": 4, "blocksize": 0}


@pytest.mark.parametrize(("edit", "rule"), [
    # UCP-1.0-R039: every member R024 lists is required but zstd's checksum and blosc's
    # typesize while it does not shuffle
    (lambda d: _set_chain(d, [_LE, {"name": "zstd", "configuration": {"level": 1}},
                              {"name": "crc32c"}]), None),
    (lambda d: _set_chain(d, [_LE, {"name": "blosc", "configuration": {
        **_BLOSC, "shuffle": "noshuffle", "typesize": None}}, {"name": "crc32c"}]), "drop"),
    (lambda d: _set_chain(d, [_LE, {"name": "zstd", "configuration": {"checksum": True}},
                              {"name": "crc32c"}]), "UCP-1.0-R039"),
    (lambda d: _set_chain(d, [_LE, {"name": "gzip", "configuration": {}},
                              {"name": "crc32c"}]), "UCP-1.0-R039"),
    *[(lambda d, k=k: _set_chain(d, [_LE, {"name": "blosc", "configuration": {
        m: v for m, v in _BLOSC.items() if m != k}}, {"name": "crc32c"}]), "UCP-1.0-R039")
      for k in ("cname", "clevel", "shuffle", "typesize", "blocksize")],
    # UCP-1.0-R046: crc32c with or without an empty configuration, in both places
    (lambda d: d["codecs"][0]["configuration"]["index_codecs"].__setitem__(
        1, {"name": "crc32c", "configuration": {}}), None),
    (lambda d: d["codecs"][0]["configuration"]["codecs"].__setitem__(
        -1, {"name": "crc32c", "configuration": {}}), None),
    (lambda d: d["codecs"][0]["configuration"]["index_codecs"].__setitem__(
        1, {"name": "crc32c", "configuration": {"x": 1}}), "UCP-1.0-R046"),
    (lambda d: d["codecs"][0]["configuration"]["codecs"].__setitem__(
        -1, {"name": "crc32c", "configuration": {"x": 1}}), "UCP-1.0-R046"),
])
def test_codec_spellings_agree(corpus: dict[str, list[Any]], edit: Any, rule: str | None
                               ) -> None:
    path, doc = _float32_array(corpus)
    edit(doc)
    if rule == "drop":  # a member given as None here is left out
        cfg = doc["codecs"][0]["configuration"]["codecs"][1]["configuration"]
        for key in [k for k, v in cfg.items() if v is None]:
            del cfg[key]
        rule = None
    schema_rules, code_rule = _verdicts("array", path, doc)
    if rule is None:
        assert (schema_rules, code_rule) == (set(), None)
    else:  # the schema refuses too (which subschema it blames follows its oneOf branches)
        assert code_rule == rule and schema_rules, (schema_rules, code_rule)


@pytest.mark.parametrize("kind", ["array", "group"])
@pytest.mark.parametrize(("value", "rule"), [
    ({"must_understand": False}, None),
    ({"must_understand": False, "anything": [1, 2]}, None),
    ({"must_understand": True}, "UCP-1.0-R007"),
    ({"anything": 1}, "UCP-1.0-R007"),
    ("text", "UCP-1.0-R007"),
    (None, "UCP-1.0-R007"),
])
def test_members_zarr_does_not_define_agree(
    corpus: dict[str, list[Any]], kind: str, value: Any, rule: str | None
) -> None:
    """UCP-1.0-R007: only members marked "must_understand": false may join zarr's own."""
    path, doc = _float32_array(corpus) if kind == "array" else _pick(corpus, "group", "values")
    doc = copy.deepcopy(doc)
    doc["x_extension"] = value
    schema_rules, code_rule = _verdicts(kind, path, doc)
    if rule is None:
        assert (schema_rules, code_rule) == (set(), None)
    else:
        assert code_rule == rule and rule in schema_rules, (schema_rules, code_rule)


def test_a_consolidated_entry_for_the_empty_path_is_refused_by_both(
    corpus: dict[str, list[Any]]
) -> None:
    """UCP-1.0-R010: every node of the consolidated metadata has a name; an entry for the
    empty path (the root's own) is refused by the schema and, since hypothesis found the
    code accepting it, by the code too."""
    _, doc = _pick(corpus, "root", "")
    doc = copy.deepcopy(doc)
    nodes = doc["consolidated_metadata"]["metadata"]
    nodes[""] = copy.deepcopy(next(n for n in nodes.values() if n["node_type"] == "group"))
    assert any(v.rule == "UCP-1.0-R010" for v in schemas.violations("root", doc))
    exc = code_check("root", "", doc)
    assert exc is not None and exc.rule == "UCP-1.0-R010"

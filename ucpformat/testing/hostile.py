"""Hostile input, measured: property-based fuzzing of every metadata document and reader.

Each *target* takes a valid checkpoint and replaces one thing with what hypothesis
generates - the root ``zarr.json`` (structure and raw bytes), an array's or a group's
``zarr.json`` (in the consolidated metadata and in its own file alike), the manifest,
an array's layout semantics, the node names, a rule file, the bytes of a chunk (with a
valid CRC32C, so that decompression is reached: zstd, gzip and blosc frames that claim
or produce any size), and files replaced by symbolic links to a canary outside the
checkpoint - then runs the readers: ``open``, a read of every tensor, ``validate`` and
``validate(deep=True)``.

The only outcome allowed (UCP-1.0-R097) is success or a :class:`~ucpformat.errors.UCPError`
with a message; :class:`Guard` fails the example on any other exception, on a run longer
than its time limit, on a traced allocation beyond ``max_read_bytes`` plus a margin
(UCP-1.0-R090, UCP-1.0-R093, UCP-1.0-R094), and on any file opened outside the checkpoint and the
library's own
files (UCP-1.0-R091), recorded with a ``sys.addaudithook`` hook.

Run ``python -m ucpformat.testing.hostile --examples 2000`` (``make stress``) for the
figures; the test suite runs each target with fewer examples.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import hashlib
import json
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import ucpformat
from ucpformat.checkpoint.metadata import MANIFEST_KEY, ROOT_DIGEST, ZARR_JSON
from ucpformat.engine.checksum import crc_bytes
from ucpformat.errors import UCPError
from ucpformat.store import LocalStore
from ucpformat.testing.common import tree_bytes
from ucpformat.testing.hostile_guard import (  # the limits stay importable from here
    CLI_ROOT_BYTES as CLI_ROOT_BYTES,
)
from ucpformat.testing.hostile_guard import (
    LIMIT as LIMIT,
)
from ucpformat.testing.hostile_guard import (
    MARGIN as MARGIN,
)
from ucpformat.testing.hostile_guard import (
    TIME_LIMIT as TIME_LIMIT,
)
from ucpformat.testing.hostile_guard import (
    Guard,
    HostileInputFailure,
    exercise,
    exercise_watching,
)

# -- hostile values --------------------------------------------------------------------------

HOSTILE_NAMES = [
    "..", ".", "", "/", "/etc/passwd", "../../../../etc/passwd", "a/../../b", "model/../..",
    "a\x00b", "\x00", "%2E%2E", "%2e%2e", "%2F", "zarr.json", "ZARR.JSON", "c", "c/0",
    "\u2024\u2024", "\uff0e\uff0e", "a\u202eb", "\ud800", "\\..\\..", "C:\\x", "~", "\n",
    "model", "manifest.ucp.json", "x" * 300, "%" , "%G0", "%00", "%C0%AE", "é", "e\u0301",
]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, -0.0, 1e308, 3.0]),
    st.text(max_size=20),
    st.sampled_from(HOSTILE_NAMES),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@dataclass(frozen=True)
class Deep:
    """Stands for ``depth`` nested lists and objects (expanded only in the JSON text)."""

    depth: int

    @property
    def token(self) -> str:
        return f"\x00DEEP{self.depth}\x00"

    def text(self) -> str:
        return '{"a": [' * (self.depth // 2) + "0" + "]}" * (self.depth // 2)


hostile_values = st.one_of(
    json_values,
    st.integers(min_value=60, max_value=5000).map(Deep),
    st.lists(st.sampled_from([0, 1, -1, 2**40, 2**62, 2**63 - 1]), max_size=70),
)


def _pointers(doc: Any, max_depth: int = 12) -> list[tuple[Any, ...]]:
    """Paths to the members of ``doc`` (down to ``max_depth``), without recursion."""
    out: list[tuple[Any, ...]] = []
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while stack:
        value, prefix = stack.pop()
        out.append(prefix)
        if len(prefix) >= max_depth:
            continue
        if isinstance(value, dict):
            stack.extend((v, (*prefix, k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, (*prefix, i)) for i, v in enumerate(value))
    return sorted(out, key=lambda p: (len(p), [str(x) for x in p]))


@st.composite
def mutated(draw: st.DrawFn, doc: Any) -> Any:
    """``doc`` with one to three of its members replaced, deleted or added."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        pointers = _pointers(doc)
        pointer = draw(st.sampled_from(pointers))
        action = draw(st.sampled_from(["replace", "replace", "delete", "add", "type"]))
        if not pointer:
            doc = draw(hostile_values) if action in ("replace", "type") else doc
            continue
        parent = doc
        for part in pointer[:-1]:
            parent = parent[part]
        last = pointer[-1]
        if action == "delete":
            del parent[last]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from([*HOSTILE_NAMES, "must_understand", "version"]))] = draw(
                hostile_values
            )
        elif action == "add" and isinstance(parent, list):
            parent.insert(int(last), draw(hostile_values))
        elif action == "type":
            old = parent[last]
            parent[last] = [old] if not isinstance(old, list) else {"0": old}
        else:
            parent[last] = draw(hostile_values)
    return doc


def dump_root(doc: Any, *, replace: tuple[bytes, bytes] | None = None) -> bytes:
    """A root document's text (as :func:`dump`), sealed with its digest (UCP-1.0-R058) where
    it has an ``attributes.ucp`` object, so that what is fuzzed is the document, not only
    the digest check. (The ``root-edited`` target leaves roots unsealed.)"""
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    if not isinstance(attributes, dict) or not isinstance(attributes.get("ucp"), dict):
        return dump(doc) if replace is None else dump(doc).replace(*replace)
    placeholder = "f" * 64
    sealed = {**doc, "attributes": {**attributes,
                                    "ucp": {**attributes["ucp"], ROOT_DIGEST: placeholder}}}
    body = dump(sealed)
    if replace is not None:
        body = body.replace(*replace)
    token = f'"{placeholder}"'.encode()
    pos = body.find(token) + 1
    if pos == 0 or body.find(token, pos) >= 0:
        return body
    zeroed = body[:pos] + b"0" * 64 + body[pos + 64 :]
    return zeroed[:pos] + hashlib.sha256(zeroed).hexdigest().encode() + zeroed[pos + 64 :]


def dump(doc: Any) -> bytes:
    """JSON text, with NaN tokens and deep nesting allowed (readers must refuse them)."""
    deep: dict[str, Deep] = {}

    def default(value: Any) -> Any:
        if isinstance(value, Deep):
            deep[json.dumps(value.token)] = value
            return value.token
        raise TypeError(type(value).__name__)

    text = json.dumps(doc, allow_nan=True, default=default)
    for quoted, value in deep.items():
        text = text.replace(quoted, value.text())
    return text.encode("utf-8", "surrogatepass")


# -- the checkpoint every example starts from ------------------------------------------------


@dataclass
class Fixture:
    """A valid checkpoint on disk, and its files, to damage and restore."""

    root: Path
    files: dict[str, bytes]
    canary: Path

    def doc(self, key: str) -> Any:
        return json.loads(self.files[key])

    @contextlib.contextmanager
    def replaced(self, new: dict[str, bytes | None]) -> Iterator[Path]:
        """Files replaced (None: deleted) for the duration of the block."""
        try:
            for key, data in new.items():
                path = self.root / key
                if path.is_symlink() or data is None:
                    path.unlink(missing_ok=True)
                if data is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
            yield self.root
        finally:
            for key in new:
                path = self.root / key
                if path.is_symlink() or path.exists():
                    path.unlink()
                if key in self.files:
                    path.write_bytes(self.files[key])

    @contextlib.contextmanager
    def linked(self, key: str, target: Path) -> Iterator[Path]:
        path = self.root / key
        try:
            path.unlink(missing_ok=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(target)
            yield self.root
        finally:
            path.unlink(missing_ok=True)
            if key in self.files:
                path.write_bytes(self.files[key])


def tiny_state() -> dict[str, Any]:
    """Few files, every kind of node: a sharded and an unsharded array, a 0-d one, values."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(5)
    return {
        "model": {
            "fc.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "norm.scale": rng.integers(0, 255, size=(7,), dtype=np.uint8),
            "emb.weight": rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16),
        },
        "optimizer": {
            "type": "torch.optim.AdamW",
            "param_groups": [{"params": ["fc.weight"], "lr": 1e-3}],
            "state": {"fc.weight": {"step": np.array(3.0, np.float32)}},
        },
        "training": {"step": 3, "best_loss": float("inf")},
    }


def make_fixture(directory: Path, *, compression: str | None = "zstd") -> Fixture:
    root = directory / "ckpt"
    ucpformat.save(root, tiny_state(), compression=compression, hash_algorithm="sha256",
                   durable=False, chunk_bytes=128, shard_bytes=256, metadata={"run": "fuzz"})
    canary = directory / "canary"
    canary.mkdir(exist_ok=True)
    (canary / "secret").write_bytes(b'{"zarr_format": 3, "node_type": "group"}')
    return Fixture(root, tree_bytes(root), canary / "secret")


def _with_node(fx: Fixture, path: str, node: Any) -> dict[str, bytes | None]:
    """The root and the node's own zarr.json, both holding ``node`` (so UCP-1.0-R055 holds)."""
    root = fx.doc(ZARR_JSON)
    root["consolidated_metadata"]["metadata"][path] = node
    return {ZARR_JSON: dump_root(root), f"{path}/{ZARR_JSON}": dump(node)}


# -- targets ---------------------------------------------------------------------------------

Target = Callable[[Fixture], Any]  # returns a hypothesis-decorated test of one Fixture

TARGETS: dict[str, Callable[[Fixture], tuple[Any, Callable[[Any], dict[str, bytes | None]]]]] = {}


def target(name: str) -> Callable[[Any], Any]:
    def register(fn: Any) -> Any:
        TARGETS[name] = fn
        return fn

    return register


@target("root-document")
def _root_document(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    return mutated(fx.doc(ZARR_JSON)), lambda doc: {ZARR_JSON: dump_root(doc)}


@target("root-bytes")
def _root_bytes(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    raw = fx.files[ZARR_JSON]
    strategy = st.one_of(
        st.binary(max_size=400),
        st.builds(lambda cut: raw[:cut], st.integers(0, len(raw))),
        st.builds(lambda pos, b: raw[:pos] + bytes([b]) + raw[pos + 1 :],
                  st.integers(0, len(raw) - 1), st.integers(0, 255)),
        st.sampled_from([b"\xef\xbb\xbf" + raw, raw + b"\x00", b"[" * 100000, b"{}" * 3,
                         b'{"a": NaN}', b'{"a": 1, "a": 2}', b"\xff\xfe" + raw]),
    )
    return strategy, lambda data: {ZARR_JSON: data}


def _node_document(fx: Fixture, path: str
                   ) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    node = fx.doc(ZARR_JSON)["consolidated_metadata"]["metadata"][path]
    return mutated(node), lambda doc: _with_node(fx, path, doc)


@target("array-document")
def _array_document(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    return _node_document(fx, "model/fc.weight")


@target("unsharded-array-document")
def _unsharded_document(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    path = "model/norm.scale"
    node = fx.doc(ZARR_JSON)["consolidated_metadata"]["metadata"][path]
    shapes = st.lists(st.sampled_from([0, 1, 7, 2**31, 2**40, 2**62, -1]), min_size=0,
                      max_size=3)

    @st.composite
    def strategy(draw: st.DrawFn) -> Any:
        doc = copy.deepcopy(node)
        if draw(st.booleans()):
            doc["shape"] = draw(shapes)
        if draw(st.booleans()):
            doc["chunk_grid"]["configuration"]["chunk_shape"] = draw(shapes)
        if draw(st.booleans()):
            doc["data_type"] = draw(st.sampled_from(
                ["float8_e4m3", "float32", "bfloat16", "complex128", "object", "<f4", "r16",
                 "bool", "string", "int128"]))
        if draw(st.booleans()):
            doc["codecs"] = draw(st.sampled_from([
                [{"name": "bytes"}, {"name": "crc32c"}],
                [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 3}},
                 {"name": "crc32c"}],
                [{"name": "bytes"}, {"name": "blosc", "configuration": {
                    "cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": 255,
                    "blocksize": 2**31 - 1}}, {"name": "crc32c"}],
                [{"name": "transpose", "configuration": {"order": [0]}}, {"name": "bytes"},
                 {"name": "crc32c"}],
                [{"name": "bytes"}, {"name": "vlen-utf8"}, {"name": "crc32c"}],
                [{"name": "bytes"}, {"name": "numcodecs.pickle"}, {"name": "crc32c"}],
                [{"name": "bytes"}],
            ]))
        return draw(mutated(doc)) if draw(st.booleans()) else doc

    return strategy(), lambda doc: _with_node(fx, path, doc)


@target("group-document")
def _group_document(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    return _node_document(fx, "optimizer")


@target("layout")
def _layout(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    path = "model/fc.weight"
    node = fx.doc(ZARR_JSON)["consolidated_metadata"]["metadata"][path]
    base = {"tp": {"dim": 0}, "parts": [{"name": "a", "size": 24}, {"name": "b", "size": 24}],
            "vocab": {"dim": 0}, "experts": {"dim": 0, "count": 2}, "layer": 3}

    def put(layout: Any) -> dict[str, bytes | None]:
        doc = copy.deepcopy(node)
        doc["attributes"].setdefault("ucp", {})["layout"] = layout
        return _with_node(fx, path, doc)

    return st.one_of(mutated(base), hostile_values), put


@target("node-names")
def _node_names(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    def put(name: str) -> dict[str, bytes | None]:
        root = fx.doc(ZARR_JSON)
        meta = root["consolidated_metadata"]["metadata"]
        meta[f"model/{name}"] = meta.pop("model/norm.scale")
        return {ZARR_JSON: dump_root(root)}

    names = st.one_of(st.sampled_from(HOSTILE_NAMES), st.text(max_size=12),
                      st.builds("/".join, st.lists(st.sampled_from(["..", ".", "a", ""]),
                                                   max_size=4)))
    return names, put


@target("manifest")
def _manifest(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    def put(doc: Any) -> dict[str, bytes | None]:
        body = dump(doc)
        root = fx.doc(ZARR_JSON)
        import hashlib

        # a manifest that passes its digest check, so that its content is what is fuzzed
        root["attributes"]["ucp"]["manifest"].update(
            nbytes=len(body), sha256=hashlib.sha256(body).hexdigest()
        )
        return {MANIFEST_KEY: body, ZARR_JSON: dump_root(root)}

    return mutated(fx.doc(MANIFEST_KEY)), put


def _bomb_frames() -> list[bytes]:
    """zstd frames (RLE blocks) that claim, or produce, far more than a chunk holds."""
    frames = []
    for fcs in (None, 1 << 40, 1 << 20, 3):
        header = bytes([(3 << 6) if fcs is not None else 0, 0x58])
        if fcs is not None:
            header += fcs.to_bytes(8, "little")
        blocks = b""
        for i in range(64):
            bh = (1 if i == 63 else 0) | (1 << 1) | (131072 << 3)
            blocks += bh.to_bytes(4, "little")[:3] + b"\x00"
        frames.append((0xFD2FB528).to_bytes(4, "little") + header + blocks)
    gz = zlib.compressobj(9, zlib.DEFLATED, 31)
    frames.append(gz.compress(bytes(64 << 20)) + gz.flush())  # 64 MiB of zeros, ~64 KiB
    blosc_header = bytes([2, 1, 1, 4]) + (1 << 31).to_bytes(4, "little") + bytes(4)
    frames.append(blosc_header + (32).to_bytes(4, "little") + bytes(16))
    return frames


@target("chunk-bytes")
def _chunk_bytes(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    keys = sorted(k for k in fx.files if "/c" in k and not k.endswith(".json"))

    def put(arg: tuple[str, bytes, bool]) -> dict[str, bytes | None]:
        key, payload, with_crc = arg
        return {key: payload + crc_bytes(payload) if with_crc else payload}

    payloads = st.one_of(st.binary(max_size=300), st.sampled_from(_bomb_frames()))
    return st.tuples(st.sampled_from(keys), payloads, st.booleans()), put


@target("rule-file")
def _rule_file(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    from ucpformat.layout.rules import RuleSet

    base = json.loads((Path(ucpformat.__file__).parent / "layout/rules/llama.json").read_text())
    exprs = st.one_of(
        st.sampled_from(["vocab_size", "vocab_size // 0", "(" * 300 + "1" + ")" * 300,
                         "+".join(["1"] * 20000), "9" * 5000, "vocab_size * " * 2000 + "2",
                         "__import__", "a.b", "1 if 1 else 2", "{layer:999999999}"]),
        st.text(alphabet="0123456789+-*/() vocab_size", max_size=40),
    )
    tied = st.sampled_from(["{layer}", "{layer:999999999999}", "{expert}", "{0}", "{",
                            "{layer.__class__.__mro__}", "x{layer!r:>{layer}}"])

    @st.composite
    def strategy(draw: st.DrawFn) -> Any:
        doc = draw(mutated(base)) if draw(st.booleans()) else copy.deepcopy(base)
        if isinstance(doc, dict) and isinstance(doc.get("rules"), list) and doc["rules"]:
            rule = doc["rules"][0]
            if isinstance(rule, dict):
                if draw(st.booleans()):
                    rule["pattern"] = draw(st.sampled_from([
                        "{layer", "{bad}", "**" * 50 + "x", "model.{layer}.{layer}", "[", "(?P<x>"
                    ]))
                if draw(st.booleans()):
                    rule["layout"] = {"tp": {"dim": draw(exprs)}}
                if draw(st.booleans()):
                    rule["tied_to"] = draw(tied)
        name = draw(st.sampled_from([
            "model.embed_tokens.weight", "model.layers.3.mlp.up_proj.weight", "lm_head.weight",
            "x" * 1000, "",
        ]))
        params = draw(st.fixed_dictionaries(
            {"vocab_size": st.sampled_from([32000, 0, -1, 2**70]),
             "tie_word_embeddings": st.booleans()}))
        return doc, name, params

    def run(arg: Any) -> dict[str, bytes | None]:
        doc, name, params = arg
        path = fx.root.parent / "rules" / "fuzz.json"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(dump(doc))
        guard = Guard(path.parent)
        with guard.armed(), contextlib.suppress(UCPError):
            rules = RuleSet.load(path)
            rules.resolve(name, params)
        return {}

    return strategy(), run


@target("symlinks")
def _symlinks(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    keys = sorted(fx.files)
    return st.sampled_from(keys), lambda key: {"__link__": key.encode()}


@target("root-edited")
def _root_edited(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    """The root edited and left unsealed: ``open`` must refuse every change (UCP-1.0-R058)."""
    def put(doc: Any) -> dict[str, bytes | None]:
        body = dump(doc)
        return {ZARR_JSON: body, "__must_refuse__": b"" if body != fx.files[ZARR_JSON] else None}

    return mutated(fx.doc(ZARR_JSON)), put


#: Errors the operating system gives a read (the classes of issue 13).
OS_ERRORS = [
    PermissionError(13, "Permission denied"), NotADirectoryError(20, "Not a directory"),
    IsADirectoryError(21, "Is a directory"), OSError(36, "File name too long"),
    OSError(5, "Input/output error"), FileNotFoundError(2, "No such file or directory"),
    OSError(40, "Too many levels of symbolic links"),
]
_READS = ("get", "get_range", "get_suffix", "read_into", "size", "exists", "list", "list_sizes",
          "is_empty")


class FailingStore(LocalStore):
    """A local store one of whose read operations fails, for one key (or every key), with
    an error of the operating system."""

    def __init__(self, root: Path, *, key: str | None, operation: str, error: OSError) -> None:
        super().__init__(root, durable=False)
        self.failing_key, self.operation, self.error = key, operation, error

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name not in _READS or name != super().__getattribute__("operation"):
            return attr
        failing, error = super().__getattribute__("failing_key"), super().__getattribute__(
            "error")

        def failing_call(*args: Any, **kw: Any) -> Any:
            if failing is None or (args and args[0] == failing):
                raise error
            return attr(*args, **kw)

        return failing_call


@target("os-errors")
def _os_errors(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    """A read the operating system refuses (UCP-1.0-R099): only UCPError, validate never raises."""
    keys = st.one_of(st.none(), st.sampled_from(sorted(fx.files)))
    return st.tuples(keys, st.sampled_from(_READS), st.sampled_from(OS_ERRORS)), lambda arg: {
        "__store__": json.dumps([arg[0], arg[1], OS_ERRORS.index(arg[2])]).encode()}


def _nested(depth: int, leaf: str) -> str:
    return "[" * depth + leaf + "]" * depth


@target("large-root")
def _large_root(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    """Roots of up to 4 MiB of the structures that cost the most memory to parse (nested
    one-element lists, empty objects, short strings, many keys): refused unread beyond
    the metadata limit, parsed within 48 times their size below it (UCP-1.0-R098)."""
    shapes: dict[str, Callable[[int], str]] = {
        "nested lists": lambda n: "[" + ",".join([_nested(40, "{}")] * (n // 84)) + "]",
        "empty objects": lambda n: "[" + "{}," * (n // 3) + "{}]",
        "short strings": lambda n: "[" + '"ab",' * (n // 5) + '"x"]',
        "many keys": lambda n: "{" + ",".join(f'"{i:x}":0' for i in range(n // 9)) + "}",
    }

    def put(arg: tuple[str, int]) -> dict[str, bytes | None]:
        shape, size = arg
        doc = fx.doc(ZARR_JSON)
        doc["attributes"]["ucp"]["metadata"] = {"x": "__BIG__"}
        return {ZARR_JSON: dump_root(doc, replace=(b'"__BIG__"', shapes[shape](size).encode()))}

    # Readers get LIMIT (8 MiB), so roots over 8 MiB / 48 are refused unread; the small
    # ones are parsed (validate's JSON Schema check of values costs about 0.1 ms per
    # hostile byte, so they stay small enough to be checked within the time limit).
    sizes = st.sampled_from([1 << 10, 4 << 10, 200 << 10, 1 << 20, 4 << 20])
    return st.tuples(st.sampled_from(sorted(shapes)), sizes), put


@target("gzip-members")
def _gzip_members(fx: Fixture) -> tuple[Any, Callable[[Any], dict[str, bytes | None]]]:
    """A gzip chunk of up to 400,000 concatenated members, empty or not (UCP-1.0-R098: decoded in
    one pass, not once per member over the rest of the chunk)."""
    path = "model/norm.scale"
    node = fx.doc(ZARR_JSON)["consolidated_metadata"]["metadata"][path]
    doc = copy.deepcopy(node)
    doc["codecs"] = [doc["codecs"][0], {"name": "gzip", "configuration": {"level": 1}},
                     {"name": "crc32c"}]
    empty = gzip.compress(b"", mtime=0)

    def put(arg: tuple[int, int]) -> dict[str, bytes | None]:
        members, tail = arg
        payload = empty * members + gzip.compress(bytes(tail), mtime=0)
        return {**_with_node(fx, path, doc), f"{path}/c/0": payload + crc_bytes(payload)}

    counts = st.sampled_from([0, 1, 2, 1000, 3000, 100_000, 400_000])
    return st.tuples(counts, st.sampled_from([0, 6, 7, 8, 1000])), put


# -- running ---------------------------------------------------------------------------------


@dataclass
class Figures:
    inputs: int = 0
    crashes: int = 0
    refused: int = 0
    per_target: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def fuzz_target(name: str, fx: Fixture, examples: int, figures: Figures,
                *, seed: int | None = None) -> None:
    """Run ``examples`` hypothesis examples of one target; failures raise."""
    strategy, make = TARGETS[name](fx)
    count = 0

    def one(value: Any) -> None:
        nonlocal count
        count += 1
        new = make(value)
        must_refuse = "__must_refuse__" in new and new.pop("__must_refuse__") is not None
        opened: list[bool] = []
        if "__link__" in new:
            with fx.linked(new["__link__"].decode(), fx.canary):  # type: ignore[union-attr]
                outcomes = exercise_watching(fx.root, fx.canary.parent)
        elif "__store__" in new:
            key, operation, error = json.loads(new["__store__"] or b"")
            store = FailingStore(fx.root, key=key, operation=operation,
                                 error=OS_ERRORS[error])
            outcomes = exercise(fx.root, store=store)
        elif new:
            with fx.replaced(new):
                outcomes = exercise(fx.root, opened=opened)
        else:
            return  # the target ran its own check (rule files)
        if must_refuse and opened:
            raise HostileInputFailure("open accepted a root edited after its commit (UCP-1.0-R058)")
        if outcomes:
            figures.refused += 1

    test: Callable[[], None] = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )(given(strategy)(one))  # type: ignore[no-untyped-call]
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    try:
        test()
    finally:
        figures.inputs += count
        figures.per_target[name] = figures.per_target.get(name, 0) + count


def run(examples: int, *, targets: Sequence[str] | None = None, seed: int | None = None,
        progress: bool = False) -> Figures:
    figures = Figures()
    with tempfile.TemporaryDirectory() as tmp:
        fx = make_fixture(Path(tmp))
        exercise(fx.root)  # warm up: imports, schemas
        for name in targets or list(TARGETS):
            try:
                fuzz_target(name, fx, examples, figures, seed=seed)
            except Exception as exc:
                figures.crashes += 1
                found = list(exc.exceptions) if isinstance(exc, BaseExceptionGroup) else [exc]
                for one in found:
                    where = traceback.extract_tb(one.__traceback__)[-3:]
                    figures.failures.append(
                        f"{name}: {type(one).__name__}: {str(one)[:500]} at "
                        + " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                      for f in reversed(where))
                    )
            if progress:
                print(f"  {name}: {figures.per_target.get(name, 0)} inputs", flush=True)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    from ucpformat.testing.common import print_figures

    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.hostile",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--examples", type=int, default=2000, help="examples per target")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS))
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed (default: derandomized, reproducible)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    figures = run(args.examples, targets=args.target, seed=args.seed, progress=not args.json)
    out = {
        "fuzz inputs tried": figures.inputs,
        "crashes (failed safety checks)": figures.crashes,
        "inputs refused with a UCPError": figures.refused,
        "inputs per target": figures.per_target,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print_figures("hostile input (ucpformat.testing.hostile)", out, as_json=args.json)
    for line in figures.failures:
        print("FAILED:", line)
    return 0 if figures.crashes == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Hostile input (UCP-1.0-R090 to R097, R091): only UCPError, bounded time, memory, files.

Each fuzz target of ucpformat.testing.hostile runs a few examples here; ``make stress``
runs thousands (``python -m ucpformat.testing.hostile``). The parsers are also fuzzed
directly, which is fast enough for many examples.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucpformat
from ucpformat.checkpoint import metadata
from ucpformat.checkpoint.reader import parse_consolidated
from ucpformat.engine.checksum import crc_bytes
from ucpformat.engine.codecs import ChunkCodec
from ucpformat.engine.compression import Compression
from ucpformat.engine.shard_index import encode_index
from ucpformat.errors import (
    CorruptDataError,
    FormatError,
    ResourceLimitError,
    UCPError,
    UnsafePathError,
)
from ucpformat.format import jsonvalues, names, schemas
from ucpformat.format.dtypes import BY_NAME
from ucpformat.layout.semantics import TensorLayout
from ucpformat.store import LocalStore
from ucpformat.testing import hostile

EXAMPLES = int(os.environ.get("UCP_FUZZ_EXAMPLES", "10"))
FAST_EXAMPLES = int(os.environ.get("UCP_FUZZ_FAST_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hostile.Fixture]:
    fx = hostile.make_fixture(tmp_path_factory.mktemp("hostile"))
    hostile.exercise(fx.root)  # warm up imports and schemas outside the guard's clock
    yield fx


@pytest.mark.parametrize("target", sorted(hostile.TARGETS))
def test_fuzz_target(fixture: hostile.Fixture, target: str) -> None:
    """UCP-1.0-R097: open, read, validate and validate --deep on generated input."""
    figures = hostile.Figures()
    hostile.fuzz_target(target, fixture, EXAMPLES, figures)
    assert figures.inputs >= EXAMPLES // 2
    assert ucpformat.validate(fixture.root, deep=True).valid  # restored after each example


# -- the parsers, directly ---------------------------------------------------------------

_fast = settings(max_examples=FAST_EXAMPLES, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


def _only_ucp_errors(fn: Callable[[], Any]) -> None:
    start = time.monotonic()
    try:
        fn()
    except UCPError as exc:
        assert exc.message
    assert time.monotonic() - start < 5


_ARRAY = json.loads((Path(__file__).parent / "hostile_array.json").read_text())


@_fast
@given(hostile.mutated(_ARRAY))
def test_parse_array_refuses_with_ucp_errors_only(doc: Any) -> None:
    """UCP-1.0-R097 (array zarr.json); the schema check never raises either."""
    def parse() -> None:
        loaded = metadata.loads(hostile.dump(doc), what="x")  # refuses NaN, depth (R096)
        schemas.violations("array", loaded)
        metadata.parse_array("model/x", loaded)

    _only_ucp_errors(parse)


@_fast
@given(hostile.mutated({"zarr_format": 3, "node_type": "group",
                        "attributes": {"ucp": {"values": {"step": 1, "x": [1.5, {"a": None}]}}}}))
def test_parse_group_and_values(doc: Any) -> None:
    """UCP-1.0-R097 (group zarr.json and JSON values)."""

    def parse() -> None:
        group = metadata.parse_group("g", metadata.loads(hostile.dump(doc), what="g"))
        jsonvalues.decode(dict(group.values), where="g")

    _only_ucp_errors(parse)


@_fast
@given(st.dictionaries(st.one_of(st.sampled_from(hostile.HOSTILE_NAMES), st.text(max_size=10)),
                       hostile.json_values, max_size=4))
def test_parse_consolidated(nodes: dict[str, Any]) -> None:
    """UCP-1.0-R097, UCP-1.0-R010: hostile node paths and nodes in consolidated metadata."""
    doc = {"consolidated_metadata": {"kind": "inline", "metadata": nodes}}
    _only_ucp_errors(
        lambda: parse_consolidated(metadata.loads(hostile.dump(doc), what="x"), where="x")
    )


@_fast
@given(st.one_of(st.sampled_from(hostile.HOSTILE_NAMES), st.text(), st.binary().map(
    lambda b: b.decode("latin-1"))))
def test_names_and_paths(name: str) -> None:
    """UCP-1.0-R010, UCP-1.0-R091: unescape/split_path refuse, never escape the root."""
    _only_ucp_errors(lambda: names.split_path(name))
    try:
        parts = names.split_path(name)
    except UCPError:
        return
    for part in parts:
        escaped = names.escape(part)
        assert "/" not in escaped and escaped not in (".", "..")


#: Node paths at the edges of what a name that is its own escape may be.
PLAIN_EDGES = ["zarr.json", "ZaRr.JsOn", "x/zarr.json", "x/zarr.jsonx", ".", "..", "...",
               "a/./b", "a/../b", "__a", "_a", "a__", "a/__b", "a" * 255, "a" * 256,
               "x/" + "a" * 256, "a//b", "/a", "a/", "", "é", "a\x00b", "a.b/c-d_e"]


@_fast
@given(st.one_of(st.sampled_from(PLAIN_EDGES),
                 st.text(alphabet="aZ09._-/zarjsonZARJSON_é\x00", max_size=14)))
def test_a_path_without_percent_is_valid_exactly_when_each_name_is_its_own_escape(
        path: str) -> None:
    """UCP-1.0-R010, UCP-1.0-R012: split_path's one-match check of a path without ``%``
    (the common case) agrees with the rule itself: each of its names is valid exactly
    when it escapes to itself, and is then its own logical name."""

    def own_escape(part: str) -> bool:
        try:
            return names.escape(part) == part
        except UCPError:
            return False

    expected = path == "" or all(own_escape(p) for p in path.split("/"))
    try:
        got = names.split_path(path)
    except UnsafePathError:
        assert not expected
    else:
        assert expected and got == (path.split("/") if path else [])
    for part in path.split("/"):
        try:
            assert names.unescape(part) == part and own_escape(part)
        except UnsafePathError:
            assert not own_escape(part)


@_fast
@given(hostile.mutated({"tp": {"dim": 0}, "parts": [{"name": "q", "size": 4}],
                        "vocab": {"dim": 0}, "experts": {"dim": 0, "count": 2}, "layer": 1}))
def test_layout_semantics(doc: Any) -> None:
    """UCP-1.0-R097 (layout semantics)."""
    _only_ucp_errors(
        lambda: TensorLayout.from_json(metadata.loads(hostile.dump(doc), what="t"), tensor="t")
        .check((8, 8), tensor="t")
    )


@_fast
@given(st.binary(max_size=200))
def test_loads_refuses_any_bytes_with_a_format_error(data: bytes) -> None:
    _only_ucp_errors(lambda: metadata.loads(data, what="x"))


def test_deep_nesting_is_refused_before_it_is_walked(saved: Callable[..., Path]) -> None:
    """UCP-1.0-R096: documents nest at most 80 levels; deeper ones are refused."""
    ok = b'{"a": ' * 80 + b"0" + b"}" * 80
    assert metadata.json_depth(metadata.loads(ok, what="x")) == 80
    metadata.check_depth(metadata.loads(ok, what="x"), what="x")
    with pytest.raises(FormatError) as info:
        metadata.check_depth(metadata.loads(b"[" * 500 + b"]" * 500, what="x"), what="x")
    assert info.value.rule == "UCP-1.0-R096"
    with pytest.raises(FormatError):  # beyond the parser's own limit
        metadata.loads(b"[" * 100_000 + b"]" * 100_000, what="x")
    path = saved()
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["ucp"]["metadata"] = {"deep": json.loads("[" * 500 + "]" * 500)}
    (path / "zarr.json").write_text(json.dumps(root))
    assert "UCP-1.0-R096" in ucpformat.validate(path).rules()


# -- decompression is bounded by the chunk (R093) ----------------------------------------


def _rle_zstd(blocks: int, content_size: int | None) -> bytes:
    header = bytes([(3 << 6) if content_size is not None else 0, 0x58])
    if content_size is not None:
        header += content_size.to_bytes(8, "little")
    body = b"".join(
        ((1 if i == blocks - 1 else 0) | 2 | (131072 << 3)).to_bytes(4, "little")[:3] + b"\0"
        for i in range(blocks)
    )
    return (0xFD2FB528).to_bytes(4, "little") + header + body


def _peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        fn()
    except UCPError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


BOMBS = {
    "zstd-claims-1TiB": ("zstd", _rle_zstd(2, 1 << 40)),
    "zstd-rle-bomb-no-size": ("zstd", _rle_zstd(2000, None)),  # 262 MB from 8 KB
    "zstd-claims-less": ("zstd", _rle_zstd(2, 4096)),
    "gzip-bomb": ("gzip", (lambda c: c.compress(bytes(200 << 20)) + c.flush())(
        zlib.compressobj(9, zlib.DEFLATED, 31))),
    "blosc-claims-2GiB": ("blosc", bytes([2, 1, 1, 4]) + (1 << 31).to_bytes(4, "little")
                          + bytes(4) + (32).to_bytes(4, "little") + bytes(16)),
    "blosc-cbytes-beyond-buffer": ("blosc", bytes([2, 1, 1, 4]) + (4096).to_bytes(4, "little")
                                   + bytes(4) + (1 << 20).to_bytes(4, "little") + bytes(16)),
}


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_decompression_never_exceeds_the_chunk(bomb: str) -> None:
    """UCP-1.0-R093: a frame that claims or produces more is refused, naming the chunk."""
    name, payload = BOMBS[bomb]
    codec = ChunkCodec(BY_NAME["float32"], Compression.parse(name, BY_NAME["float32"]))
    data = payload + crc_bytes(payload)  # a valid CRC: the decompressor is reached

    def decode() -> None:
        codec.decode(data, (1024,), tensor="model/w", chunk="(0) [object model/w/c/0]")

    with pytest.raises(CorruptDataError) as info:
        decode()
    assert info.value.tensor == "model/w" and "model/w/c/0" in str(info.value)
    assert _peak(decode) < 8 << 20  # the chunk is 4 KiB; the bombs claim up to 1 TiB


def test_bounded_decompression_round_trips() -> None:
    """UCP-1.0-R093: valid frames decode exactly, for each compressor."""
    values = np.arange(3000, dtype=np.float32)
    for name in ("zstd", "gzip", "blosc"):
        codec = ChunkCodec(BY_NAME["float32"], Compression.parse(name, BY_NAME["float32"]))
        encoded = b"".join(bytes(memoryview(p)) for p in codec.encode(values))
        out = codec.decode(encoded, (3000,), tensor="t", chunk="c")
        assert out.tobytes() == values.tobytes()
        with pytest.raises(CorruptDataError):
            codec.decode(encoded, (2999,), tensor="t", chunk="c")  # a size mismatch
    two = zlib.compress(b"abcd", wbits=31) + zlib.compress(b"efgh", wbits=31)  # two members
    codec = ChunkCodec(BY_NAME["float32"], Compression.parse("gzip", BY_NAME["float32"]))
    assert codec.decode(two + crc_bytes(two), (2,), tensor="t", chunk="c").tobytes() == b"abcdefgh"


# -- stored sizes bound allocation (R094), validation bounds its work (R095) ---------------


def _rewrite_root(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    root = json.loads((path / "zarr.json").read_text())
    edit(root)
    (path / "zarr.json").write_bytes(metadata.encode_root(root))  # sealed (R058)


def test_shard_index_pointing_far_beyond_its_shard(saved: Callable[..., Path]) -> None:
    """UCP-1.0-R094: an index entry of 2**40 bytes costs what the shard holds, no more."""
    path = saved(chunk_bytes=1024, shard_bytes=4096)
    with ucpformat.open(path) as ckpt:
        meta = ckpt.arrays["model/fc.weight"]
        key = meta.object_key([0] * len(meta.shape))
    shard = path / key
    cps = meta.chunks_per_shard
    index = np.zeros((*cps, 2), dtype="<u8")
    index[..., 0] = 0
    index[..., 1] = 1 << 40
    shard.write_bytes(b"\0" * 64 + encode_index(index))

    def read() -> None:
        with ucpformat.open(path) as ckpt:
            ckpt["model/fc.weight"].read()

    with pytest.raises(CorruptDataError) as info:
        read()
    assert info.value.tensor == "model/fc.weight" and key.split("/c/")[1] in str(info.value)
    assert _peak(read) < 16 << 20


def test_chunk_larger_than_the_limit_is_refused_before_reading(
    saved: Callable[..., Path],
) -> None:
    """UCP-1.0-R090: a chunk's decoded size counts against max_read_bytes."""
    path = saved()
    with ucpformat.open(path, max_read_bytes=1000) as ckpt, pytest.raises(
        ResourceLimitError
    ) as info:
        ckpt["model/fc.weight"][0, 0]
    assert info.value.rule == "UCP-1.0-R090"


def test_claimed_chunk_size_is_not_allocated_for_a_small_file(saved: Callable[..., Path]) -> None:
    """UCP-1.0-R094: metadata that claims a 1 GiB unsharded chunk, over a 20-byte file."""
    path = saved()

    def huge(root: dict[str, Any]) -> None:
        node = root["consolidated_metadata"]["metadata"]["model/fc.bias"]
        node["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 28]

    _rewrite_root(path, huge)

    def read() -> None:
        with ucpformat.open(path) as ckpt:
            ckpt["model/fc.bias"][:2]

    with pytest.raises(CorruptDataError):
        read()
    assert _peak(read) < 16 << 20


def test_validation_of_a_huge_grid_is_bounded(saved: Callable[..., Path]) -> None:
    """UCP-1.0-R095: 2**60 stored objects are not enumerated; the array is reported."""
    path = saved()

    def huge(root: dict[str, Any]) -> None:
        node = root["consolidated_metadata"]["metadata"]["model/fc.bias"]
        node["shape"] = [1 << 60]
        node["chunk_grid"]["configuration"]["chunk_shape"] = [1]

    _rewrite_root(path, huge)
    start = time.monotonic()
    report = ucpformat.validate(path, deep=True)
    assert time.monotonic() - start < 10
    assert "UCP-1.0-R030" in report.rules()


# -- nothing outside the checkpoint (R091) -------------------------------------------------


def test_symlinks_out_of_the_checkpoint_are_never_followed(
    saved: Callable[..., Path], tmp_path: Path
) -> None:
    """UCP-1.0-R091, UCP-1.0-R089: for every file of a checkpoint replaced by a link to a
    canary outside it, no reader opens the canary (inotify), and the link is refused or
    unused."""
    path = saved(hash_algorithm="sha256")
    canary = tmp_path / "outside" / "secret"
    canary.parent.mkdir()
    canary.write_bytes((path / "zarr.json").read_bytes())
    fx = hostile.Fixture(path, {k: (path / k).read_bytes() for k in _keys(path)}, canary)
    refused = 0
    for key in sorted(fx.files):
        with fx.linked(key, canary):
            outcomes = hostile.exercise_watching(path, canary.parent)  # raises if touched
        refused += any("R091" in o for o in outcomes)
    assert refused >= len(fx.files) - 1  # every link is refused (the marker needs no read)
    assert hashlib.sha256(canary.read_bytes()).digest()  # still there, never written


def _keys(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_unsafe_keys_never_reach_the_file_system(tmp_path: Path) -> None:
    """UCP-1.0-R091: keys with .., absolute paths, NUL and backslashes are refused."""
    store = LocalStore(tmp_path / "c")
    for key in ["../x", "/etc/passwd", "a/../../b", "a\x00b", "a\\..\\b", "", "a//b", "./a"]:
        with pytest.raises(UnsafePathError):
            store.get(key)
        with pytest.raises(UnsafePathError):
            store.put(key, [b"x"])
    assert not (tmp_path / "x").exists()

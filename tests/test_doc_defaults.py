"""The defaults the docs state are the defaults of the code (issue 29, item 8)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ucpformat import interchange
from ucpformat.checkpoint import reader
from ucpformat.engine import chunking

DOCS = Path(__file__).resolve().parent.parent / "docs"

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

# (doc file, a pattern whose groups are a number and a unit, the code's value)
CLAIMS = [
    ("torch.md", r"inner chunks it\s+overlaps \((\d+) (\w+) by default",
     chunking.DEFAULT_CHUNK_BYTES),
    ("scale.md", r"default chunking \((\d+) (\w+) inner chunks", chunking.DEFAULT_CHUNK_BYTES),
    ("scale.md", r"shards up to (\d+) (\w+)", chunking.DEFAULT_SHARD_BYTES),
    ("dcp.md", r"`min_shard_bytes` \((\d+) (\w+) by default", chunking.DEFAULT_MIN_SHARD_BYTES),
    ("importers.md", r"`memory_limit` \(tensor bytes in memory at once, default (\d+) (\w+)",
     interchange.DEFAULT_MEMORY_LIMIT),
    ("reliability.md", r"`max_metadata_bytes`, default (\d+) (\w+)", reader.MAX_METADATA_BYTES),
]


@pytest.mark.parametrize(("doc", "pattern", "value"), CLAIMS,
                         ids=[f"{c[0]}:{c[2]}" for c in CLAIMS])
def test_stated_default_matches_code(doc: str, pattern: str, value: int) -> None:
    text = (DOCS / doc).read_text()
    found = re.findall(pattern, text)
    assert found, f"{doc} no longer states this default ({pattern!r}): update this test"
    for number, unit in found:
        assert int(number) * _UNITS[unit] == value, (
            f"{doc} says {number} {unit} by default; the code's default is {value} bytes")


def test_pool_default_matches_code() -> None:
    pytest.importorskip("torch")
    from ucpformat.torch import staging

    for doc, pattern in [("torch.md", r"pinned buffers \((\d+) (\w+) by default"),
                         ("gpu.md", r"`DEFAULT_POOL_BYTES` \((\d+) (\w+)\)")]:
        found = re.findall(pattern, (DOCS / doc).read_text())
        assert found, f"{doc} no longer states the pool's default: update this test"
        for number, unit in found:
            assert int(number) * _UNITS[unit] == staging.DEFAULT_POOL_BYTES, doc

"""ucpformat.save(created=..., producer=...) writes the same bytes twice (what the cases need)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ucpformat
from ucpformat.conformance import contents
from ucpformat.errors import InvalidValueError


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("compression", [None, "gzip", "zstd", "blosc"])
def test_same_state_same_bytes(tmp_path: Path, compression: str | None) -> None:
    state = {"model": {"w": contents.generate("float32", (64, 32), 1),
                       "b": np.zeros(32, np.float32)},
             "training": {"step": 7}}
    kw = {"created": "2026-01-01T00:00:00Z", "producer": {"name": "test", "version": "1"},
          "compression": compression, "hash_algorithm": "sha256", "durable": False}
    ucpformat.save(tmp_path / "a", state, **kw)
    ucpformat.save(tmp_path / "b", state, **kw)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    ckpt = ucpformat.open(tmp_path / "a")
    assert ckpt.ucp["created"] == "2026-01-01T00:00:00Z"
    assert ckpt.ucp["producer"] == {"name": "test", "version": "1"}


def test_created_must_be_rfc3339(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match="RFC 3339"):
        ucpformat.save(tmp_path / "c", {"model": {"w": np.zeros(2)}}, created="yesterday")


@pytest.mark.parametrize("created", ["2026-13-01T00:00:00Z", "2026-02-30T25:00:00Z",
                                     "2026-01-01T00:00:00+1:00"])
def test_created_that_readers_refuse_is_refused_before_writing(tmp_path: Path,
                                                               created: str) -> None:
    """The writer checks ``created`` with the reader's rule: a date-time the reader refuses
    (month 13, hour 25) is never written into a checkpoint that then cannot be opened."""
    with pytest.raises(InvalidValueError, match="RFC 3339") as info:
        ucpformat.save(tmp_path / "c", {"model": {"w": np.zeros(2)}}, created=created)
    assert info.value.rule == "UCP-1.0-R002"
    assert not (tmp_path / "c").exists()

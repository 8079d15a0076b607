"""Corruption (UCP-1.0-R041 to R045, R055, R057): every damage detected and named."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import ucpformat
from ucpformat.checkpoint.metadata import ROOT_DIGEST, encode_root
from ucpformat.errors import FormatError
from ucpformat.testing import corruption


def test_quick_corruption_run_detects_and_names_every_damage() -> None:
    """UCP-1.0-R041, UCP-1.0-R043, UCP-1.0-R045, UCP-1.0-R055: 125 random damages."""
    figures = corruption.run(125, seed=11)
    assert figures.tried == 125
    assert figures.crashes == 0, figures.failures
    assert figures.detected == figures.tried, figures.failures
    assert figures.named == figures.tried, figures.failures
    assert len(figures.by_cell) == len(corruption.TARGETS) * len(corruption.DAMAGES)


def _edit(path: Path, fn: Callable[[dict[str, object]], None]) -> None:
    """Edit a root zarr.json and seal it again (UCP-1.0-R058): what is tested is what a
    tool that rewrites a root consistently would leave."""
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_bytes(encode_root(doc))


def test_a_changed_root_value_is_caught_by_the_sealed_copy(
    saved: Callable[..., Path],
) -> None:
    """UCP-1.0-R045: the root cannot hold its own digest; the manifest seals a copy."""
    path = saved(hash_algorithm=None)
    manifest = json.loads((path / "manifest.ucp.json").read_text())
    root = json.loads((path / "zarr.json").read_text())
    sealed = manifest["root_attributes"]
    expected = dict(root["attributes"])
    expected["ucp"] = {k: v for k, v in expected["ucp"].items()
                       if k not in ("manifest", ROOT_DIGEST)}
    assert sealed == expected
    assert ucpformat.validate(path).valid

    def tamper(doc: dict[str, object]) -> None:
        doc["attributes"]["ucp"]["created"] = "2000-01-01T00:00:00Z"  # type: ignore[index]

    _edit(path / "zarr.json", tamper)
    report = ucpformat.validate(path)
    assert "UCP-1.0-R045" in report.rules()
    assert any("created" in i.message for i in report.errors)


def test_json_values_compare_by_type(saved: Callable[..., Path]) -> None:
    """UCP-1.0-R045, UCP-1.0-R055: 1, 1.0 and true are three different values."""
    from ucpformat.checkpoint.validation import json_equal

    assert not json_equal(1, 1.0) and not json_equal(1, True)
    assert json_equal([1, {"a": 2}], [1, {"a": 2}])
    path = saved(metadata={"step": 3})

    def tamper(doc: dict[str, object]) -> None:
        doc["attributes"]["ucp"]["metadata"]["step"] = 3.0  # type: ignore[index]

    _edit(path / "zarr.json", tamper)
    assert "UCP-1.0-R045" in ucpformat.validate(path).rules()


def test_unknown_members_of_the_root_are_refused(saved: Callable[..., Path]) -> None:
    """UCP-1.0-R057: no member of the root outside those UCP defines."""
    path = saved()

    def extra(doc: dict[str, object]) -> None:
        doc["consolidated_metadata"]["must_understanf"] = False  # type: ignore[index]

    _edit(path / "zarr.json", extra)
    with pytest.raises(FormatError) as info:
        ucpformat.open(path)
    assert info.value.rule == "UCP-1.0-R057"
    assert "UCP-1.0-R057" in ucpformat.validate(path).rules()

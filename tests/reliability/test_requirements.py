"""Every reader-safety and commit requirement has a test here that cites it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

import ucpformat
from tests import spec_helpers as sh
from ucpformat.checkpoint.metadata import encode_root
from ucpformat.errors import UnsupportedFeatureError

HERE = Path(__file__).parent
#: Reader safety (section 15), and the integrity and commit requirements measured here.
OWNED = re.compile(r"UCP-1\.0-R(09[0-9]|089|04[359]|05[01346789])$")


def test_each_reader_safety_requirement_is_cited_by_a_test() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in HERE.glob("test_*.py"))
    owned = sorted(r.id for r in sh.all_requirements() if OWNED.match(r.id))
    assert {"UCP-1.0-R093", "UCP-1.0-R097", "UCP-1.0-R045", "UCP-1.0-R057", "UCP-1.0-R059",
            "UCP-1.0-R049", "UCP-1.0-R089"} <= set(owned)
    missing = [i for i in owned if i not in text]
    assert not missing, f"requirements without a test citing them: {missing}"


def test_a_data_type_outside_the_table_is_refused_by_name(saved: Callable[..., Path]) -> None:
    """UCP-1.0-R092, UCP-1.0-R020: an array whose type this reader does not implement is
    refused, naming the array and the type; its bits are never reinterpreted."""
    path = saved()
    root = json.loads((path / "zarr.json").read_text())
    node = root["consolidated_metadata"]["metadata"]["model/fc.bias"]
    node["data_type"] = "float8_e4m3"  # zarr-extensions' type, not PyTorch's e4m3fn
    (path / "zarr.json").write_bytes(encode_root(root))
    with pytest.raises(UnsupportedFeatureError) as info:
        ucpformat.open(path)
    assert info.value.tensor == "model/fc.bias" and "float8_e4m3" in str(info.value)
    assert info.value.rule == "UCP-1.0-R020"

"""JSON values compare as UCP-1.0-R073 says: by kind, integers exactly, other numbers by bits."""

from __future__ import annotations

import json

import pytest

from ucpformat.format.jsonvalues import json_equal


@pytest.mark.parametrize(("a", "b"), [
    ("1", "1.0"), ("1", "true"), ("0", "false"), ("0.0", "-0.0"), ("0", "-0.0"),
    ("1152921504606846976", "1152921504606846977"), ("1152921504606846976", "1.152921504606847e18"),
    ("[1.0]", "[1]"), ('{"a": 0.0}', '{"a": -0.0}'), ('{"a": 1}', '{"a": 1, "b": 1}'),
    ("null", "0"), ('"1"', "1"), ("[1, 2]", "[2, 1]"),
])
def test_different_values(a: str, b: str) -> None:
    assert not json_equal(json.loads(a), json.loads(b))
    assert not json_equal(json.loads(b), json.loads(a))


@pytest.mark.parametrize(("a", "b"), [
    ("1.0", "1.00"), ("1.0", "1e0"), ("100.0", "1E2"), ("-0", "0"), ("-0.0", "-0e0"),
    ("1152921504606846977", "1152921504606846977"),
    ('{"a": 1, "b": [true]}', '{"b": [true], "a": 1}'),
    ("0.1", "0.10000000000000001"),  # the same binary64 value
])
def test_equal_values(a: str, b: str) -> None:
    assert json_equal(json.loads(a), json.loads(b))

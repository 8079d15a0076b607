"""Deliberately broken adapters are caught, each with the requirement it breaks."""

from __future__ import annotations

import pytest

from tests.conformance.conftest import broken
from ucpformat.conformance.runner import reader_suite, writer_suite


@pytest.mark.parametrize(
    ("script", "only", "faults", "rules"),
    [
        ("wrong_dtype_exporter.py", ["basic"], False, {"UCP-1.0-R020"}),
        ("missing_chunk_exporter.py", ["basic"], False, {"UCP-1.0-R030"}),
        ("padded_vocab_exporter.py", ["layout-tp2-group-major"], False, {"UCP-1.0-R113"}),
        ("root_first_exporter.py", ["basic", "many-tensors"], True,
         {"UCP-1.0-R050", "UCP-1.0-R054"}),
        ("double_write_exporter.py", ["layout-dtensor"], False, {"UCP-1.0-R130"}),
        ("no_coverage_exporter.py", ["coverage-gap"], False, {"UCP-1.0-R131"}),
    ],
)
def test_broken_exporter(script: str, only: list[str], faults: bool, rules: set[str]) -> None:
    report = writer_suite(broken(script), only=only, faults=faults)
    assert not report.passed
    assert rules <= set(report.failed_rules()), report.render()
    assert report.claim is None


@pytest.mark.parametrize(
    ("script", "only", "rules"),
    [
        ("wrong_digest_reader.py", ["valid/dtypes-*", "valid/basic"], {"UCP-1.0-R210"}),
        ("fill_value_reader.py", ["invalid/missing-*", "invalid/empty-index-entry",
                                  "valid/basic"], {"UCP-1.0-R031"}),
        ("loose_values_reader.py", ["valid/json-numbers"], {"UCP-1.0-R211"}),
    ],
)
def test_broken_reader(script: str, only: list[str], rules: set[str]) -> None:
    report = reader_suite(broken(script), only=only)
    assert not report.passed
    assert rules <= set(report.failed_rules()), report.render()
    failing = [r for r in report.results if r.status == "fail"]
    assert all(r.failed_rules() for r in failing), "every failure names a requirement"

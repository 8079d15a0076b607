"""The reference library passes its own suite: reader, writer and validator adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conformance.conftest import REPO, reference
from ucpformat.conformance import command
from ucpformat.conformance.runner import reader_suite, validator_suite, writer_suite
from ucpformat.format import schemas


def test_reference_reader() -> None:
    report = reader_suite(reference())
    assert report.passed, report.render()
    assert report.claim == "passes ucpformat conformance 1.0, reader (layout-aware)"
    checks = {r.check for r in report.results}
    assert {"reader.valid", "reader.invalid", "reader.layout", "reader.contract"} <= checks


def test_reference_writer() -> None:
    report = writer_suite(reference())
    assert report.passed, report.render()
    assert report.claim == "passes ucpformat conformance 1.0, writer (layout-aware)"
    ran = {(r.check, r.status) for r in report.results}
    for check in ("writer.fault-data", "writer.fault-root", "writer.existing",
                  "writer.stray", "writer.concurrent", "writer.coverage", "writer.dtensor",
                  "writer.layout"):
        assert (check, "pass") in ran, check


def test_reference_validator_through_its_command_line() -> None:
    report = validator_suite(reference(), only=["valid/warnings", "invalid/missing-chunk",
                                                "invalid/rules-unmatched-name"], strict=True)
    assert report.passed, report.render()
    assert len(report.by_check("validator.cases")) == 3


def test_suite_command_line_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """ucp conformance reader --json --junit: a valid report and JUnit XML."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    junit = tmp_path / "reader.xml"
    status = command.main(["reader", "--json", "--junit", str(junit), "--only", "valid/basic",
                           "--only", "invalid/no-root", "--", *reference().command])
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    doc = json.loads(out)
    assert not schemas.violations("conformance-report", doc)
    assert doc["passed"] and doc["suite"] == "reader"
    xml = junit.read_text(encoding="utf-8")
    assert xml.startswith("<?xml") and 'name="valid/basic"' in xml
    assert command.main(["reader"]) == 2  # no adapter command

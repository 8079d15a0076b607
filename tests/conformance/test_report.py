"""Reports: the terminal summary, JSON (valid against its schema) and JUnit XML."""

from __future__ import annotations

import json
from xml.etree import ElementTree as ET

from ucpformat.conformance.report import Result, SuiteReport, junit_document, merge_json
from ucpformat.format import schemas


def _report() -> SuiteReport:
    report = SuiteReport("reader", "my-reader")
    ok = report.add(Result("reader.valid", "valid/basic", ["UCP-1.0-R210"]))
    ok.warn("UCP-1.0-R213", "refused without naming a requirement")
    bad = report.add(Result("reader.valid", "valid/dtypes-unsharded", ["UCP-1.0-R210"]))
    bad.error("UCP-1.0-R210", "model/t.bfloat16: SHA-256 differs")
    bad.note(None, "a note")
    report.add(Result("reader.layout", "valid/layout")).skip("not layout-aware")
    report.seconds = 1.5
    return report


def test_counts_and_status() -> None:
    report = _report()
    assert report.counts() == {"pass": 1, "fail": 1, "skip": 1}
    assert not report.passed and report.failed_rules() == ["UCP-1.0-R210"]


def test_json_report_is_valid() -> None:
    doc = json.loads(json.dumps(merge_json([_report()])))
    assert not schemas.violations("conformance-report", doc)
    assert doc["failed_requirements"] == ["UCP-1.0-R210"]
    two = merge_json([_report(), _report()])
    assert not schemas.violations("conformance-report", two)


def test_junit_xml() -> None:
    root = ET.fromstring(junit_document([_report()]))
    assert root.tag == "testsuites" and root.get("failures") == "1"
    (suite,) = root
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["valid/basic", "valid/dtypes-unsharded",
                                              "valid/layout"]
    failure = cases[1].find("failure")
    assert failure is not None and failure.get("type") == "UCP-1.0-R210"
    assert cases[2].find("skipped") is not None
    assert "UCP-1.0-R213" in (cases[0].findtext("system-out") or "")


def test_terminal_summary() -> None:
    text = _report().render()
    assert "FAIL  reader.valid valid/dtypes-unsharded" in text
    assert "failed requirements: UCP-1.0-R210" in text and text.endswith("FAILED")

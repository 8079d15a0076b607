"""Results of the suite and their three forms: a terminal summary, JSON, and JUnit XML.

A :class:`SuiteReport` holds one :class:`Result` per case, scenario or check. A result
has a status (``pass``, ``fail``, ``skip``) and findings, each naming the requirement it
concerns: ``error`` findings make the result fail (MUST), ``warning`` findings do not
(SHOULD), ``note`` findings explain (a skip, a reader's rule that differs from the
expected one). The JSON form is valid against
``schemas/1.0/conformance-report.schema.json``.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from xml.etree import ElementTree as ET

from ucpformat._version import __version__

Status = Literal["pass", "fail", "skip"]
FindingLevel = Literal["error", "warning", "note"]
SUITE_VERSION = "1.0"


@dataclass(frozen=True)
class Finding:
    level: FindingLevel
    rule: str | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "rule": self.rule, "message": self.message}

    def __str__(self) -> str:
        rule = f"[{self.rule}] " if self.rule else ""
        return f"{self.level}: {rule}{self.message}"


@dataclass
class Result:
    """The outcome of one check on one case, scenario or adapter."""

    check: str  # a check id of ucpformat.conformance.checks (or "check" for `ucp ... check`)
    name: str  # the case, scenario or subject
    requirements: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    skipped: str | None = None  # the reason, if skipped
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        if self.skipped is not None:
            return "skip"
        return "fail" if any(f.level == "error" for f in self.findings) else "pass"

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def error(self, rule: str | None, message: str) -> None:
        self._add(Finding("error", rule, message))

    def warn(self, rule: str | None, message: str) -> None:
        self._add(Finding("warning", rule, message))

    def note(self, rule: str | None, message: str) -> None:
        self._add(Finding("note", rule, message))

    def skip(self, reason: str) -> None:
        self.skipped = reason

    def _add(self, finding: Finding) -> None:
        if finding not in self.findings:
            self.findings.append(finding)

    def failed_rules(self) -> list[str]:
        return sorted({f.rule for f in self.errors if f.rule})

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "check": self.check,
            "name": self.name,
            "status": self.status,
            "requirements": sorted(set(self.requirements)),
            "findings": [f.to_json() for f in self.findings],
            "seconds": round(self.seconds, 3),
        }
        if self.skipped is not None:
            doc["skipped"] = self.skipped
        doc.update(self.extra)
        return doc


@dataclass
class SuiteReport:
    """Every result of one run of a suite against one implementation."""

    suite: str  # "reader", "writer", "validator" or "check"
    subject: str  # the adapter command, or "ucpformat (in process)"
    results: list[Result] = field(default_factory=list)
    capabilities: Mapping[str, Any] | None = None
    claim: str | None = None
    started: float = field(default_factory=time.time)
    seconds: float = 0.0

    def add(self, result: Result) -> Result:
        self.results.append(result)
        return result

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "skip": 0}
        for r in self.results:
            out[r.status] += 1
        return out

    @property
    def passed(self) -> bool:
        return not any(r.status == "fail" for r in self.results)

    def failed_rules(self) -> list[str]:
        return sorted({rule for r in self.results for rule in r.failed_rules()})

    def by_check(self, check: str) -> list[Result]:
        return [r for r in self.results if r.check == check]

    def result(self, check: str, name: str) -> Result | None:
        for r in self.results:
            if r.check == check and r.name == name:
                return r
        return None

    # -- JSON ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "$schema": "https://ucpformat.org/schemas/1.0/conformance-report.schema.json",
            "ucp_conformance": SUITE_VERSION,
            "suite": self.suite,
            "subject": self.subject,
            "runner": {"name": "ucpformat", "version": __version__,
                       "python": platform.python_version()},
            "passed": self.passed,
            "counts": self.counts(),
            "failed_requirements": self.failed_rules(),
            "claim": self.claim,
            "capabilities": dict(self.capabilities) if self.capabilities is not None else None,
            "seconds": round(self.seconds, 3),
            "results": [r.to_json() for r in self.results],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, ensure_ascii=False)

    # -- JUnit XML ----------------------------------------------------------------------

    def junit(self) -> ET.Element:
        counts = self.counts()
        suite = ET.Element(
            "testsuite",
            name=f"ucp-conformance-{self.suite}",
            tests=str(len(self.results)),
            failures=str(counts["fail"]),
            errors="0",
            skipped=str(counts["skip"]),
            time=f"{self.seconds:.3f}",
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.started)),
        )
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="subject", value=self.subject)
        ET.SubElement(props, "property", name="suite_version", value=SUITE_VERSION)
        if self.claim:
            ET.SubElement(props, "property", name="claim", value=self.claim)
        for r in self.results:
            case = ET.SubElement(suite, "testcase", classname=f"ucp.{r.check}", name=r.name,
                                 time=f"{r.seconds:.3f}")
            if r.status == "skip":
                ET.SubElement(case, "skipped", message=r.skipped or "")
            elif r.status == "fail":
                first = r.errors[0]
                failure = ET.SubElement(case, "failure", message=_clip(str(first), 300),
                                        type=first.rule or "error")
                failure.text = "\n".join(str(f) for f in r.findings)
            others = [f for f in r.findings if f.level != "error"]
            if others and r.status != "fail":
                out = ET.SubElement(case, "system-out")
                out.text = "\n".join(str(f) for f in others)
            if r.requirements:
                props_el = ET.SubElement(case, "properties")
                ET.SubElement(props_el, "property", name="requirements",
                              value=" ".join(sorted(set(r.requirements))))
        return suite

    # -- terminal -----------------------------------------------------------------------

    def render(self, *, verbose: bool = False) -> str:
        lines = [f"ucp conformance {self.suite}: {self.subject}"]
        width = max([len(f"{r.check} {r.name}") for r in self.results] + [20])
        for r in self.results:
            show = verbose or r.status != "pass" or r.warnings
            if not show:
                continue
            mark = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}[r.status]
            label = f"{r.check} {r.name}".ljust(width)
            extra = f"  ({r.skipped})" if r.skipped else ""
            lines.append(f"  {mark}  {label}{extra}")
            for f in r.findings:
                if f.level == "note" and not verbose:
                    continue
                lines.append(f"          {_clip(str(f), 160)}")
        counts = self.counts()
        lines.append(
            f"{len(self.results)} results: {counts['pass']} passed, {counts['fail']} failed, "
            f"{counts['skip']} skipped in {self.seconds:.1f} s"
        )
        failed = self.failed_rules()
        if failed:
            lines.append("failed requirements: " + ", ".join(failed))
        if self.claim:
            lines.append(f"claim: {self.claim}")
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def junit_document(reports: Iterable[SuiteReport]) -> bytes:
    """One JUnit XML document with a ``testsuite`` per report."""
    root = ET.Element("testsuites", name="ucp-conformance")
    total = fails = skips = 0
    for report in reports:
        root.append(report.junit())
        counts = report.counts()
        total += len(report.results)
        fails += counts["fail"]
        skips += counts["skip"]
    root.set("tests", str(total))
    root.set("failures", str(fails))
    root.set("skipped", str(skips))
    ET.indent(root)
    body: bytes = ET.tostring(root, encoding="utf-8")
    if body.startswith(b"<?xml"):
        body = body.split(b"\n", 1)[1]
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + body


def merge_json(reports: Sequence[SuiteReport]) -> dict[str, Any]:
    if len(reports) == 1:
        return reports[0].to_json()
    return {"ucp_conformance": SUITE_VERSION, "reports": [r.to_json() for r in reports]}


__all__ = ["Finding", "Result", "SuiteReport", "junit_document", "merge_json"]

"""The validator suite: judge a validator by every case (UCP-1.0-R250, UCP-1.0-R251).

Without an adapter command the reference validator is judged, in process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ucpformat.conformance.adapter import Adapter
from ucpformat.conformance.cases import Case, load_cases
from ucpformat.conformance.report import Result, SuiteReport
from ucpformat.conformance.suites.core import (
    adapter_of,
    features_of,
    read_capabilities,
    requirements_of,
    schema_errors,
    select,
    timed,
)

ValidateFn = Callable[[Case], tuple[int, Any]]


def reference_validate(case: Case) -> tuple[int, Any]:
    """The reference validator, in process: (exit status, result document)."""
    from ucpformat.conformance.adapters import reference

    if case.is_rules:
        doc = reference.validate_rules(case.directory / case.expected["rules"],
                                       case.directory / case.expected["apply"])
    else:
        doc = reference.validate(case.checkpoint)
    return (0 if doc["valid"] else 1), doc


def validator_suite(
    command: Sequence[str] | Adapter | None = None,
    *,
    cases: Sequence[Case] | None = None,
    only: Sequence[str] | None = None,
    strict: bool = False,
    timeout: float = 300.0,
) -> SuiteReport:
    """Judge a validator by every case (UCP-1.0-R250); without a command, the reference one.

    ``strict``: every requirement an invalid case ``violates`` must be named (the
    reference validator's own standard), not just one of them.
    """
    report = SuiteReport("validator", "ucpformat (in process)")
    start = time.monotonic()
    features = {"rules", "archive"}
    validate_fn: ValidateFn = reference_validate
    if command is not None:
        adapter = adapter_of(command, timeout)
        report.subject = str(adapter)
        caps = read_capabilities(adapter, "validator", report)
        features = features_of(caps)

        def validate_fn(case: Case) -> tuple[int, Any]:
            run = (adapter.validate_rules(case.directory / case.expected["rules"],
                                          case.directory / case.expected["apply"])
                   if case.is_rules else adapter.validate(case.checkpoint))
            try:
                return run.returncode, run.json()
            except ValueError:
                return run.returncode, None

    all_cases = list(cases if cases is not None else load_cases())
    chosen = select((c.name for c in all_cases), only)
    for case in all_cases:
        if case.name not in chosen:
            continue
        result = report.add(Result("validator.cases", case.name,
                                   requirements_of("validator.cases", *case.violates)))
        if case.is_rules and "rules" not in features:
            result.skip("the validator does not declare the feature 'rules'")
            continue
        if case.feature is not None and case.feature not in features:
            result.skip(f"the validator does not declare the feature {case.feature!r}")
            continue
        with timed(result):
            status, doc = validate_fn(case)
        judge_validation(result, case, status, doc, strict=strict)
    report.seconds = time.monotonic() - start
    if report.passed and not only:
        report.claim = "passes ucpformat conformance 1.0, validator"
    return report


def judge_validation(result: Result, case: Case, status: int, doc: Any, *,
                     strict: bool = False) -> None:
    if not isinstance(doc, dict):
        result.error("UCP-1.0-R234", f"no validation result (exit status {status})")
        return
    for message in schema_errors("conformance-validation", doc):
        result.error("UCP-1.0-R234", f"validation result: {message}")
    errors = {e.get("rule") for e in doc.get("errors", []) if isinstance(e, dict)}
    warnings = {e.get("rule") for e in doc.get("warnings", []) if isinstance(e, dict)}
    result.extra["reported"] = sorted(r for r in errors if r)
    if case.valid:
        if status != 0 or doc.get("valid") is not True:
            shown = "; ".join(f"[{e.get('rule')}] {e.get('message', '')}"[:160]
                              for e in doc.get("errors", [])[:3])
            result.error("UCP-1.0-R250", f"a valid case judged invalid (exit {status}): {shown}")
        for rule in case.expected.get("warnings", []):
            if rule not in warnings:
                result.warn(rule, "this case holds a SHOULD-level finding the validator did "
                                  "not report as a warning")
        return
    if status != 1 or doc.get("valid") is not False:
        result.error(case.violates[0], f"an invalid case judged valid (exit {status}): "
                                       f"{case.description}")
        return
    acceptable = set(case.violates) | set(case.expected.get("also", []))
    if strict:
        missing = [r for r in case.violates if r not in errors]
        if missing:
            result.error(missing[0], f"does not name {', '.join(missing)} (named: "
                                     f"{sorted(r for r in errors if r)})")
    elif not errors & acceptable:
        result.error(case.violates[0], f"judged invalid, but names {sorted(r for r in errors if r)}"
                                       f", not {' or '.join(case.violates)}")

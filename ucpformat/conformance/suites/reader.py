"""The reader suite: run a reader adapter over every case (UCP-1.0-R210 to UCP-1.0-R215).

Valid cases are read bit for bit (digests of tensors and selections, values, metadata,
local tensors of target layouts); invalid cases of stage ``open`` or ``read`` are refused;
tensors of undeclared data types are refused, never misread (UCP-1.0-R092, UCP-1.0-R203).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ucpformat.conformance.adapter import Adapter, Run
from ucpformat.conformance.cases import READER_STAGES, Case, load_cases
from ucpformat.conformance.report import Result, SuiteReport
from ucpformat.conformance.suites.core import (
    ALL_TYPES,
    READER_MINIMUM_TYPES,
    adapter_of,
    all_passed,
    claim_text,
    features_of,
    read_capabilities,
    requirements_of,
    schema_errors,
    select,
    timed,
    types_of,
)
from ucpformat.format.jsonvalues import json_equal


def reader_suite(
    command: Sequence[str] | Adapter,
    *,
    cases: Sequence[Case] | None = None,
    only: Sequence[str] | None = None,
    timeout: float = 300.0,
    single: bool = True,
) -> SuiteReport:
    """Run a reader adapter over every case (UCP-1.0-R210 to UCP-1.0-R215).

    ``command`` is the adapter's command line, or an :class:`Adapter` (such as a
    :class:`~ucpformat.conformance.adapter.CallableAdapter` for code tested in process).
    """
    adapter = adapter_of(command, timeout)
    report = SuiteReport("reader", str(adapter))
    start = time.monotonic()
    caps = read_capabilities(adapter, "reader", report)
    supported = types_of(caps)
    features = features_of(caps)
    layout_aware = "layout" in features
    every_case = [c for c in (cases if cases is not None else load_cases()) if not c.is_rules]
    chosen = select((c.name for c in every_case), only)
    for case in every_case:  # a case of an optional form the reader does not claim
        if case.feature is not None and case.feature not in features and case.name in chosen \
                and (case.valid or case.stage in READER_STAGES):
            report.add(Result("reader.valid" if case.valid else "reader.invalid", case.name,
                              requirements_of("reader.valid" if case.valid else
                                              "reader.invalid"))).skip(
                f"the reader does not declare the feature {case.feature!r}")
    all_cases = [c for c in every_case if c.feature is None or c.feature in features]
    selected = [c for c in all_cases if c.name in chosen
                and (c.valid or c.stage in READER_STAGES)]
    with tempfile.TemporaryDirectory(prefix="ucp-conformance-reader-") as tmp:
        work = Path(tmp)
        responses = _read_all(adapter, selected, work, layout_aware,
                              batch="batch" in features_of(caps), timeout=timeout)
        unsupported_seen: dict[str, dict[str, list[str]]] = {}
        for case in selected:
            run, response, problem = responses[case.name]
            if case.valid:
                _judge_valid(report, case, run, response, problem, supported,
                             unsupported_seen)
                if case.expected.get("targets"):
                    _judge_targets(report, case, response, problem, layout_aware)
            else:
                _judge_invalid(report, case, run, response, problem)
        _judge_unsupported(report, supported, unsupported_seen)
        if single:
            _single_mode(report, adapter, all_cases, work, supported)
    report.claim = _reader_claim(report, supported, layout_aware, partial=bool(only))
    report.seconds = time.monotonic() - start
    return report


Reply = tuple[Run | None, Any, str | None]  # (process, response document, problem)


def _read_all(adapter: Adapter, cases: Sequence[Case], work: Path, layout_aware: bool, *,
              batch: bool, timeout: float) -> dict[str, Reply]:
    out: dict[str, Reply] = {}
    if batch and cases:
        items = [{"id": c.name, "checkpoint": str(c.checkpoint),
                  "request": c.request(layout=layout_aware)} for c in cases]
        run = adapter.read_batch({"cases": items}, work, timeout=timeout)
        try:
            doc = run.json()
            results = doc["results"]
            if not isinstance(results, dict):
                raise ValueError("results is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"read-batch gave no results ({exc}); {run.describe()}"
            return {c.name: (run, None, problem) for c in cases}
        for case in cases:
            if case.name not in results:
                out[case.name] = (run, None, "read-batch gave no result for this case")
            else:
                out[case.name] = (run, results[case.name], None)
        return out
    for case in cases:
        run = adapter.read(case.checkpoint, case.request(layout=layout_aware), work)
        try:
            out[case.name] = (run, run.json(), None)
        except ValueError as exc:
            out[case.name] = (run, None, f"no JSON response ({exc}); {run.describe()}")
    return out


def _response_errors(response: Any) -> list[dict[str, Any]]:
    """Every error object of a response (top level, tensors, targets)."""
    out: list[dict[str, Any]] = []
    if not isinstance(response, dict):
        return out
    if isinstance(response.get("error"), dict):
        out.append(response["error"])
    for section in ("tensors", "targets"):
        entries = response.get(section)
        if isinstance(entries, dict):
            for entry in entries.values():
                if isinstance(entry, dict) and isinstance(entry.get("error"), dict):
                    out.append(entry["error"])
    return out


def _judge_valid(report: SuiteReport, case: Case, run: Run | None, response: Any,
                 problem: str | None, supported: set[str],
                 unsupported_seen: dict[str, dict[str, list[str]]]) -> None:
    result = report.add(Result("reader.valid", case.name,
                               requirements_of("reader.valid",
                                               *case.expected.get("exercises", []))))
    if run is not None and run.argv[-3:-2] == ["read"]:
        result.seconds = run.seconds
    if problem is not None or response is None:
        result.error("UCP-1.0-R231", problem or "no response")
        return
    for message in schema_errors("conformance-response", response):
        result.error("UCP-1.0-R231", f"response: {message}")
    if not isinstance(response, dict):
        return
    if "error" in response:
        err = response["error"]
        result.error("UCP-1.0-R211", f"refused a valid checkpoint: {_err_text(err)}")
        return
    got = response.get("tensors", {})
    expected = case.expected.get("tensors", {})
    if not isinstance(got, dict):
        return
    extra = sorted(set(got) - set(expected))
    if extra:
        result.error("UCP-1.0-R211", f"lists tensors the checkpoint does not have: {extra[:5]}")
    skipped_here = []
    for path, exp in expected.items():
        entry = got.get(path)
        if not isinstance(entry, dict):
            result.error("UCP-1.0-R211", f"{path}: missing from the response")
            continue
        dtype = exp["dtype"]
        seen = unsupported_seen.setdefault(dtype, {"refused": [], "misread": []}) if (
            dtype not in supported) else None
        if "error" in entry:
            if seen is not None:
                seen["refused"].append(f"{case.name}:{path}")
                skipped_here.append(f"{path} ({dtype})")
                continue
            result.error("UCP-1.0-R211", f"{path}: refused: {_err_text(entry['error'])}")
            continue
        errors_before = len(result.errors)
        if entry.get("dtype") != dtype:
            result.error("UCP-1.0-R211", f"{path}: data type {entry.get('dtype')!r}, expected "
                                         f"{dtype!r}")
        if entry.get("shape") != exp["shape"]:
            result.error("UCP-1.0-R211", f"{path}: shape {entry.get('shape')}, expected "
                                         f"{exp['shape']}")
        if exp.get("sha256") is not None and entry.get("sha256") != exp["sha256"]:
            result.error("UCP-1.0-R210", f"{path}: SHA-256 of the tensor {entry.get('sha256')}, "
                                         f"expected {exp['sha256']}")
        digests = entry.get("slices", [])
        for i, sel in enumerate(exp.get("slices", [])):
            have = digests[i] if isinstance(digests, list) and i < len(digests) else None
            if have != sel["sha256"]:
                result.error("UCP-1.0-R210", f"{path}: SHA-256 of slice {sel['slice']} is {have}, "
                                             f"expected {sel['sha256']}")
        if seen is not None and len(result.errors) > errors_before:
            seen["misread"].append(f"{case.name}:{path}")
            result.error("UCP-1.0-R092", f"{path}: a tensor of {dtype}, which the reader declares "
                                         "unsupported, was read wrongly instead of refused")
    if "values" in response:
        values = response["values"]
        for gpath, exp_values in case.expected.get("groups", {}).items():
            if not isinstance(values, dict) or not json_equal(values.get(gpath, {}), exp_values):
                shown = values.get(gpath) if isinstance(values, dict) else values
                result.error("UCP-1.0-R211", f"values of group {gpath or '/'!r}: {shown!r}, "
                                             f"expected {exp_values!r}")
    if "metadata" in response and not json_equal(response["metadata"],
                                                 case.expected.get("metadata", {})):
        result.error("UCP-1.0-R211", f"metadata {response['metadata']!r}, expected "
                                     f"{case.expected.get('metadata')!r}")
    if skipped_here:
        result.note("UCP-1.0-R092", f"{len(skipped_here)} tensors of unsupported data types "
                                    f"refused: {', '.join(skipped_here[:6])}")
        if len(skipped_here) == len(expected) and not result.errors:
            result.skip("every tensor is of a data type the reader does not support")


def _err_text(err: Any) -> str:
    if isinstance(err, dict):
        rule = f"[{err['rule']}] " if err.get("rule") else ""
        return f"{rule}{err.get('message', '')}"[:300]
    return repr(err)[:300]


def _judge_targets(report: SuiteReport, case: Case, response: Any, problem: str | None,
                   layout_aware: bool) -> None:
    result = report.add(Result("reader.layout", case.name, requirements_of("reader.layout")))
    if not layout_aware:
        result.skip("the reader does not declare the feature 'layout'")
        return
    if problem is not None or not isinstance(response, dict):
        result.error("UCP-1.0-R231", problem or "no response")
        return
    got = response.get("targets")
    if not isinstance(got, dict):
        result.error("UCP-1.0-R215", "the response has no targets")
        return
    for target in case.expected["targets"]:
        tid = target["id"]
        entry = got.get(tid)
        if not isinstance(entry, dict):
            result.error("UCP-1.0-R215", f"{tid}: missing from the response")
            continue
        if "refuse" in target:
            if "error" not in entry:
                result.error(target["refuse"], f"{tid}: a target that cannot hold the tensor "
                                               f"exactly was not refused")
            elif entry["error"].get("rule") not in (target["refuse"], None):
                result.note(None, f"{tid}: refused with {entry['error'].get('rule')}, the "
                                  f"suite expects {target['refuse']}")
            continue
        if "error" in entry:
            result.error("UCP-1.0-R215", f"{tid}: refused: {_err_text(entry['error'])}")
            continue
        if not target.get("held", True):
            if entry.get("held") is not False:
                result.error("UCP-1.0-R215", f"{tid}: this rank holds no part of the tensor; the "
                                             "response should say held: false")
            continue
        if entry.get("shape") != target["shape"] or entry.get("sha256") != target["sha256"]:
            result.error("UCP-1.0-R215", f"{tid}: local tensor {entry.get('shape')} "
                                         f"{entry.get('sha256')}, expected {target['shape']} "
                                         f"{target['sha256']}")


def _judge_invalid(report: SuiteReport, case: Case, run: Run | None, response: Any,
                   problem: str | None) -> None:
    result = report.add(Result("reader.invalid", case.name,
                               requirements_of("reader.invalid", *case.violates)))
    if run is not None and run.timed_out:
        result.error("UCP-1.0-R212", f"the reader did not finish: {run.describe()}")
        return
    if problem is not None and response is None:
        result.error("UCP-1.0-R231", problem)
        return
    errors = _response_errors(response)
    if not errors:
        result.error(case.violates[0],
                     f"not refused (stage {case.stage}): {case.description}")
        return
    acceptable = set(case.violates) | set(case.expected.get("also", []))
    rules = {str(e["rule"]) for e in errors if e.get("rule")}
    if not rules:
        result.warn("UCP-1.0-R213", "refused without naming a requirement; expected "
                                    + " or ".join(case.violates))
    elif not rules & acceptable:
        result.note(None, f"refused with {sorted(rules)}; the case breaks "
                          f"{' and '.join(case.violates)}")


def _judge_unsupported(report: SuiteReport, supported: set[str],
                       seen: Mapping[str, Mapping[str, list[str]]]) -> None:
    """UCP-1.0-R092 and UCP-1.0-R203: tensors of undeclared data types are refused, never
    misread."""
    unsupported = sorted(set(ALL_TYPES) - supported)
    result = report.add(Result("reader.unsupported-types", ", ".join(unsupported) or "none",
                               requirements_of("reader.unsupported-types")))
    if not unsupported:
        result.skip("the reader supports every data type of Table 1")
        return
    for dtype in unsupported:
        entry = seen.get(dtype, {"refused": [], "misread": []})
        for where in entry["misread"]:
            result.error("UCP-1.0-R092", f"{where}: a {dtype} tensor was read wrongly, not refused")
        result.note(None, f"{dtype}: {len(entry['refused'])} tensors refused by name")
    result.extra["unsupported"] = unsupported


def _single_mode(report: SuiteReport, adapter: Adapter, cases: Sequence[Case], work: Path,
                 supported: set[str]) -> None:
    """The single-case command line on one valid and one invalid case (UCP-1.0-R231 exit
    statuses)."""
    result = report.add(Result("reader.contract", "read CHECKPOINT REQUEST",
                               requirements_of("reader.contract")))
    by_name = {c.name: c for c in cases}
    readable = [c.name for c in cases if c.valid and c.data_types and c.data_types <= supported]
    valid = "valid/basic" if "valid/basic" in readable else next(iter(readable), "")
    for name, want in ((valid, 0), ("invalid/missing-chunk", 1)):
        case = by_name.get(name)
        if case is None:
            continue
        with timed(result):
            run = adapter.read(case.checkpoint, case.request(), work)
        if run.returncode != want:
            result.error("UCP-1.0-R231", f"{name}: exit status {run.returncode}, expected {want} "
                                         f"({run.describe()})")
        try:
            doc = run.json()
        except ValueError as exc:
            result.error("UCP-1.0-R231", f"{name}: no JSON document on stdout ({exc})")
            continue
        for message in schema_errors("conformance-response", doc):
            result.error("UCP-1.0-R231", f"{name}: response: {message}")


def _reader_claim(report: SuiteReport, supported: set[str], layout_aware: bool,
                  partial: bool) -> str | None:
    result = report.add(Result("suite.claim", "reader", requirements_of("suite.claim")))
    missing = [t for t in READER_MINIMUM_TYPES if t not in supported]
    if missing:
        result.error("UCP-1.0-R202", f"a reader supports at least {', '.join(missing)}")
    if not report.passed:
        result.note(None, "no claim: the suite failed")
        return None
    if partial:
        result.note(None, "no claim: only some cases ran (--only)")
        return None
    layout = layout_aware and all_passed(report, "reader.layout")
    return claim_text("reader", layout, sorted(set(ALL_TYPES) - supported))



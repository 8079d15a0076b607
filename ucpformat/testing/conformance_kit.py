"""Run the UCP conformance suite from another project's tests.

With an adapter command (any language)::

    from ucpformat.testing import conformance_kit as ucp

    def test_my_reader_conforms():
        ucp.assert_passed(ucp.reader_suite(["my-reader-adapter"]))

    def test_my_exporter_conforms(tmp_path):
        ucp.assert_passed(ucp.writer_suite(["python", "-m", "myproject.ucp_adapter"]))

With Python callables, in process (no command line; the writer's fault-injection
checks, which need a process, are skipped)::

    report = ucp.reader_suite(ucp.in_process("mylib", read=my_read_request))

Case by case, with pytest's parametrisation, for a reader that is a function of a
checkpoint path, a node path and a selection::

    @pytest.mark.parametrize("case", ucp.case_params("valid"))
    def test_reads(case):
        ucp.assert_reads(case, lambda ckpt, path, sel: my_read(ckpt, path, sel))

    @pytest.mark.parametrize("case", ucp.case_params("invalid", stages=("open", "read")))
    def test_refuses(case):
        ucp.assert_refuses(case, lambda ckpt, path, sel: my_read(ckpt, path, sel))

Checkpoints a project writes are judged with :func:`check` (``ucp conformance check``).
See docs/conformance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat.conformance import contents
from ucpformat.conformance.adapter import Adapter, CallableAdapter
from ucpformat.conformance.cases import Case, Scenario, load_cases, load_scenarios
from ucpformat.conformance.command import check_path
from ucpformat.conformance.report import Result, SuiteReport
from ucpformat.conformance.runner import reader_suite, validator_suite, writer_suite
from ucpformat.format.dtypes import NAMES

#: read(checkpoint, node path, selection or None for the whole tensor) -> array
ReadFn = Callable[[Path, str, Sequence[Sequence[int]] | None], Any]


def check(path: str | Path, *, deep: bool = True) -> Result:
    """Validate a checkpoint (or a case folder) as ``ucp conformance check`` does.

    ``result.extra["valid"]`` says whether it is valid; ``result.errors`` and
    ``result.warnings`` name the requirements it breaks.
    """
    return check_path(Path(path), deep=deep)


def cases(kind: str | None = None, *, stages: Iterable[str] | None = None) -> list[Case]:
    """The suite's cases: ``kind`` ``"valid"`` or ``"invalid"``; ``stages`` of invalid ones."""
    wanted = set(stages) if stages is not None else None
    out = []
    for case in load_cases():
        if kind is not None and case.kind != kind:
            continue
        if wanted is not None and case.stage not in wanted:
            continue
        out.append(case)
    return out


def scenarios() -> list[Scenario]:
    return load_scenarios()


def case_params(kind: str | None = None, *, stages: Iterable[str] | None = None,
                rules: bool = False) -> list[Any]:
    """``pytest.param`` objects, one per case, with the case name as id."""
    import pytest

    return [pytest.param(c, id=c.name) for c in cases(kind, stages=stages)
            if rules or not c.is_rules]


def in_process(
    name: str,
    *,
    read: Callable[[Path, Mapping[str, Any]], Mapping[str, Any]] | None = None,
    write: Callable[[Path, Path], None] | None = None,
    validate: Callable[[Path], Mapping[str, Any]] | None = None,
    data_types: Sequence[str] = NAMES,
    features: Sequence[str] = (),
) -> Adapter:
    """An adapter of Python callables that take and return the contract's JSON documents."""
    roles = [r for r, fn in (("reader", read), ("writer", write), ("validator", validate))
             if fn is not None]
    caps = {"name": name, "version": "in process", "roles": roles,
            "data_types": list(data_types), "features": sorted({"batch", *features})}
    return CallableAdapter(name, capabilities=caps, read=read, write=write, validate=validate)


def digest(array: Any) -> str:
    """SHA-256 of the little-endian C-order bytes of an array (UCP-1.0-R241)."""
    return contents.sha256(np.asarray(array))


def assert_reads(case: Case, read: ReadFn) -> None:
    """``read`` returns every tensor and every slice of a valid case bit for bit."""
    assert case.valid, f"{case.name} is not a valid case"
    problems = []
    for path, exp in case.expected["tensors"].items():
        if exp.get("sha256") is not None:
            got = digest(read(case.checkpoint, path, None))
            if got != exp["sha256"]:
                problems.append(f"{path}: SHA-256 {got}, expected {exp['sha256']}")
        for sel in exp.get("slices", []):
            got = digest(read(case.checkpoint, path, sel["slice"]))
            if got != sel["sha256"]:
                problems.append(f"{path}{sel['slice']}: SHA-256 {got}, expected {sel['sha256']}")
    assert not problems, (f"[UCP-1.0-R210] {case.name}: {len(problems)} differences:\n"
                          + "\n".join(problems[:10]))


def assert_refuses(case: Case, read: ReadFn) -> BaseException:
    """``read`` raises for an invalid case of stage open or read; returns the exception."""
    assert not case.valid, f"{case.name} is a valid case"
    try:
        for path, req in case.request()["tensors"].items():
            if req.get("whole"):
                read(case.checkpoint, path, None)
            for sel in req.get("slices", []):
                read(case.checkpoint, path, sel)
    except Exception as exc:
        return exc
    raise AssertionError(f"[{case.violates[0]}] {case.name} was read, not refused: "
                         f"{case.description}")


def assert_passed(report: SuiteReport) -> None:
    """Fail (with the failed requirements and findings) unless the suite passed."""
    if report.passed:
        return
    lines = [f"ucp conformance {report.suite} failed: "
             f"{', '.join(report.failed_rules()) or 'see findings'}"]
    for result in report.results:
        if result.status == "fail":
            lines.append(f"  {result.check} {result.name}")
            lines.extend(f"    {f}" for f in result.errors[:5])
    raise AssertionError("\n".join(lines))


__all__ = [
    "ReadFn",
    "assert_passed",
    "assert_reads",
    "assert_refuses",
    "case_params",
    "cases",
    "check",
    "digest",
    "in_process",
    "reader_suite",
    "scenarios",
    "validator_suite",
    "writer_suite",
]

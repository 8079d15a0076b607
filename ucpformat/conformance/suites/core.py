"""What the reader, writer and validator suites share.

The adapter's capabilities (UCP-1.0-R230), the selection of cases by ``--only``, timing,
schema checks of what an adapter prints, and the words of a claim (UCP-1.0-R201).
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ucpformat.conformance.adapter import Adapter
from ucpformat.conformance.checks import CHECKS
from ucpformat.conformance.report import Result, SuiteReport
from ucpformat.format import dtypes, schemas

#: Data types a reader supports to claim "UCP 1.0 reader" (UCP-1.0-R202).
READER_MINIMUM_TYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16",
)
#: Data types a writer supports to claim "UCP 1.0 writer" (UCP-1.0-R202).
WRITER_MINIMUM_TYPES = ("bool", "int32", "int64", "uint8", "float32")
ALL_TYPES = tuple(dtypes.NAMES)


def requirements_of(check: str, *extra: str) -> list[str]:
    """The requirements a result of ``check`` verifies, and ``extra`` ones of its case."""
    return [*CHECKS[check].requirements, *extra]


@contextmanager
def timed(result: Result) -> Any:
    """Add the time the ``with`` block takes to ``result.seconds``."""
    start = time.monotonic()
    try:
        yield result
    finally:
        result.seconds += time.monotonic() - start


def select(names: Iterable[str], only: Sequence[str] | None) -> set[str]:
    """The names that match one of the ``only`` globs (all of them without ``only``)."""
    names = list(names)
    if not only:
        return set(names)
    return {n for n in names if any(fnmatch.fnmatch(n, p) for p in only)}


def schema_errors(kind: str, doc: Any) -> list[str]:
    """Each way ``doc`` breaks the schema ``kind``, as a message with its JSON pointer."""
    return [f"{v.message} (at {v.pointer or '/'})" for v in schemas.violations(kind, doc)]


# -- capabilities -------------------------------------------------------------------------------


def read_capabilities(adapter: Adapter, role: str, report: SuiteReport) -> dict[str, Any]:
    """Ask the adapter for its capabilities (UCP-1.0-R230) and judge them in a result of
    ``report``."""
    check = f"{role}.capabilities"
    result = report.add(Result(check, str(adapter), requirements_of(check)))
    with timed(result):
        run = adapter.capabilities()
        if run.returncode != 0:
            result.error("UCP-1.0-R230", f"capabilities failed: {run.describe()}")
            return {}
        try:
            caps = run.json()
        except ValueError as exc:
            result.error("UCP-1.0-R230", f"capabilities printed no JSON document: {exc}")
            return {}
        for message in schema_errors("conformance-capabilities", caps):
            result.error("UCP-1.0-R230", f"capabilities: {message}")
        if not isinstance(caps, dict):
            return {}
        if role not in caps.get("roles", [role]):
            result.note(None, f"the adapter does not list the role {role!r}")
        unknown = sorted(set(caps.get("data_types", [])) - set(ALL_TYPES))
        if unknown:
            result.error("UCP-1.0-R203",
                         f"capabilities list data types outside Table 1: {unknown}")
        report.capabilities = caps
        return caps


def types_of(caps: Mapping[str, Any]) -> set[str]:
    """The data types of Table 1 an adapter implements (UCP-1.0-R203; all when it lists none)."""
    listed = caps.get("data_types")
    return set(ALL_TYPES) if listed is None else set(listed) & set(ALL_TYPES)


def features_of(caps: Mapping[str, Any]) -> set[str]:
    """The features an adapter declares (UCP-1.0-R230)."""
    return set(caps.get("features", []))


# -- shared by the suites -----------------------------------------------------------------------


def adapter_of(command: Sequence[str] | Adapter, timeout: float) -> Adapter:
    """An adapter command line as an :class:`Adapter` (an adapter stays as it is)."""
    return command if isinstance(command, Adapter) else Adapter(command, timeout=timeout)


def all_passed(report: SuiteReport, *checks: str) -> bool:
    """Some result of ``checks`` passed, and none failed or was skipped."""
    results = [r for r in report.results if r.check in checks]
    return bool(results) and all(r.status == "pass" for r in results)


def claim_text(level: str, layout: bool, without: Sequence[str]) -> str:
    """The words of a claim of conformance (UCP-1.0-R201)."""
    text = f"passes ucpformat conformance 1.0, {level}"
    if layout:
        text += " (layout-aware)"
    if without:
        text += f" (without {', '.join(without)})"
    return text


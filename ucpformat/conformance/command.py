"""``ucp conformance``: the suite's command line.

    ucp conformance check PATH... [--json] [--junit FILE] [--shallow]
    ucp conformance reader [--only GLOB] [--json] [--junit FILE] -- CMD ...
    ucp conformance writer [--only GLOB] [--keep DIR] [--no-faults] [--json] -- CMD ...
    ucp conformance validator [--strict] [--json] [-- CMD ...]
    ucp conformance coverage [--json]

Exit status: 0 valid / passed, 1 invalid / failed, 2 could not run. ``check`` validates
checkpoints (or cases: a folder with ``expected.json``) and reports per requirement: MUST
violations are errors, SHOULD violations warnings. The ``ucp`` command registers this
module with :func:`add_subparser` (or ``register``); ``python -m ucpformat.conformance``
runs it on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucpformat.conformance.cases import Case, load_case, load_cases
from ucpformat.conformance.report import Result, SuiteReport, junit_document, merge_json

OK, FAILED, ERROR = 0, 1, 2


# -- check --------------------------------------------------------------------------------------


def _levels() -> dict[str, str]:
    from ucpformat.conformance.coverage import requirements

    try:
        return {rid: r.level for rid, r in requirements().items()}
    except FileNotFoundError:
        return {}


def check_path(path: Path, *, deep: bool = True, levels: dict[str, str] | None = None
               ) -> Result:
    """Validate one checkpoint, case folder or rule file; findings per requirement."""
    from ucpformat.conformance.adapters import reference
    from ucpformat.conformance.runner import judge_validation

    levels = _levels() if levels is None else levels
    result = Result("check", str(path))
    start = time.monotonic()
    case: Case | None = None
    if (path / "expected.json").is_file():
        case = load_case(path)
    if case is not None and case.is_rules:
        doc = reference.validate_rules(path / case.expected["rules"],
                                       path / case.expected["apply"])
    elif path.is_file() and path.suffix == ".json":
        doc = reference.validate_rules(path, None)
    else:
        from ucpformat.checkpoint.validation import validate

        target = case.checkpoint if case is not None else path
        doc = validate(target, deep=deep).to_json()
    for issue in doc["errors"]:
        result.error(issue.get("rule"), f"{issue.get('path', '/')}: {issue.get('message', '')}")
    for issue in doc["warnings"]:
        result.warn(issue.get("rule"), f"{issue.get('path', '/')}: {issue.get('message', '')}")
    summary: dict[str, dict[str, Any]] = {}
    for finding in result.findings:
        rule = finding.rule or "(no requirement)"
        entry = summary.setdefault(rule, {"level": levels.get(rule), "status": "warn", "count": 0})
        entry["count"] += 1
        if finding.level == "error":
            entry["status"] = "fail"
    result.extra["valid"] = bool(doc["valid"])
    result.extra["requirements_found"] = dict(sorted(summary.items()))
    result.requirements = sorted(r for r in summary if r.startswith("UCP-"))
    if case is not None:
        judged = Result("validator.cases", case.name)
        judge_validation(judged, case, 0 if doc["valid"] else 1, doc, strict=True)
        result.extra["case"] = {
            "name": case.name,
            "kind": case.kind,
            "violates": case.violates,
            "stage": case.stage,
            "as_expected": judged.status == "pass",
            "problems": [str(f) for f in judged.errors],
        }
    result.seconds = time.monotonic() - start
    return result


def check(paths: Sequence[Path], *, deep: bool = True) -> SuiteReport:
    report = SuiteReport("check", "ucpformat (in process)")
    start = time.monotonic()
    levels = _levels()
    for path in paths:
        report.add(check_path(Path(path), deep=deep, levels=levels))
    report.seconds = time.monotonic() - start
    return report


def render_check(report: SuiteReport) -> str:
    lines = []
    for r in report.results:
        valid = r.extra.get("valid")
        lines.append(f"{r.name}: {'VALID' if valid else 'INVALID'}")
        for rule, entry in r.extra.get("requirements_found", {}).items():
            level = entry["level"] or ("MUST" if entry["status"] == "fail" else "SHOULD")
            mark = "FAIL" if entry["status"] == "fail" else "WARN"
            lines.append(f"  {mark}  {level:<6} {rule}  ({entry['count']})")
            for f in r.findings:
                if (f.rule or "(no requirement)") == rule:
                    lines.append(f"          {f.message[:150]}")
        case = r.extra.get("case")
        if case is not None:
            want = ("valid" if case["kind"] == "valid"
                    else f"invalid, violates {' and '.join(case['violates'])} "
                         f"(stage {case['stage']})")
            verdict = "as expected" if case["as_expected"] else "NOT as expected"
            lines.append(f"  case {case['name']}: expected {want}: {verdict}")
            for problem in case["problems"]:
                lines.append(f"          {problem[:150]}")
    valid = sum(1 for r in report.results if r.extra.get("valid"))
    lines.append(f"{len(report.results)} checked: {valid} valid, "
                 f"{len(report.results) - valid} invalid")
    return "\n".join(lines)


# -- argument parsing ---------------------------------------------------------------------------


def _output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--junit", metavar="FILE", type=Path,
                        help="also write the report as JUnit XML to FILE")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list passed results and notes too")


def _suite_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", action="append", metavar="GLOB",
                        help="only cases or scenarios whose name matches (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each adapter command may take (default 300)")
    parser.add_argument("adapter", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                        help="the adapter command, after --")


#: ``--help`` text (plain: the module docstring is reST).
DESCRIPTION = ("The conformance suite: check checkpoints (or cases) per requirement, and judge "
               "readers, writers and validators through an adapter command.")


def add_subparser(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()
                  ) -> argparse.ArgumentParser:
    """Add ``conformance`` to the subcommands of a ``ucp`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "conformance", parents=list(parents),
        help="run the conformance suite (check, reader, writer, validator)",
        description=DESCRIPTION,
    )
    build(parser)
    parser.set_defaults(run=run)
    return parser


def register(subparsers: Any, parent: argparse.ArgumentParser | None = None) -> None:
    """The ``ucp`` command's module convention (``register``/``run``)."""
    add_subparser(subparsers, [parent] if parent is not None else [])


def build(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="conformance_command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("check", help="validate checkpoints or cases, per requirement")
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="a checkpoint, a case folder (with expected.json) or a rule file")
    p.add_argument("--shallow", action="store_true",
                   help="do not read every byte (no CRC32C and SHA-256 checks of the data)")
    _output_options(p)
    p = sub.add_parser("reader", help="run a reader adapter over every case")
    _suite_options(p)
    p.add_argument("--cases", type=Path, help="a cases folder other than the suite's")
    _output_options(p)
    p = sub.add_parser("writer", help="hand a writer adapter every scenario")
    _suite_options(p)
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="keep the scenarios and what the writer wrote under DIR")
    p.add_argument("--no-faults", action="store_true",
                   help="skip the fault-injection and existing-checkpoint checks")
    _output_options(p)
    p = sub.add_parser("validator",
                       help="judge a validator by every case (default: the reference one)")
    _suite_options(p)
    p.add_argument("--cases", type=Path, help="a cases folder other than the suite's")
    p.add_argument("--strict", action="store_true",
                   help="an invalid case must be reported with every requirement it violates")
    _output_options(p)
    p = sub.add_parser("coverage", help="which case or check verifies each requirement")
    p.add_argument("--json", action="store_true")


def _adapter(args: argparse.Namespace) -> list[str]:
    cmd = list(args.adapter or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    return cmd


def _emit(args: argparse.Namespace, reports: Sequence[SuiteReport], text: str) -> None:
    if getattr(args, "junit", None):
        Path(args.junit).write_bytes(junit_document(reports))
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(merge_json(reports), indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(text + "\n")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``ucp conformance ...`` command; returns the exit status."""
    from ucpformat.conformance import runner

    command = args.conformance_command
    if command == "check":
        report = check(args.paths, deep=not args.shallow)
        _emit(args, [report], render_check(report))
        return OK if all(r.extra.get("valid") for r in report.results) else FAILED
    if command == "coverage":
        return _coverage(args)
    cmd = _adapter(args)
    if command in ("reader", "writer") and not cmd:
        sys.stderr.write(f"ucp conformance {command}: give the adapter command after --\n")
        return ERROR
    if command == "reader":
        cases = load_cases(args.cases) if args.cases else None
        report = runner.reader_suite(cmd, cases=cases, only=args.only, timeout=args.timeout)
    elif command == "writer":
        report = runner.writer_suite(cmd, only=args.only, timeout=args.timeout,
                                     faults=not args.no_faults, keep=args.keep)
    else:
        cases = load_cases(args.cases) if args.cases else None
        report = runner.validator_suite(cmd or None, cases=cases, only=args.only,
                                        strict=args.strict, timeout=args.timeout)
    _emit(args, [report], report.render(verbose=args.verbose))
    return OK if report.passed else FAILED


def _coverage(args: argparse.Namespace) -> int:
    from ucpformat.conformance import coverage
    from ucpformat.conformance.cases import cases_dir, scenarios_dir

    doc = coverage.build(cases_dir(), scenarios_dir())
    missing = coverage.uncovered(doc)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        for rule, entry in doc["requirements"].items():
            if entry["level"] != "MUST":
                continue
            by = [*entry["cases"][:3], *entry["checks"]]
            more = len(entry["cases"]) - 3
            lines = ", ".join(by) + (f" (+{more} cases)" if more > 0 else "")
            sys.stdout.write(f"{rule}  {lines or 'NOT COVERED'}\n")
        musts = sum(1 for e in doc["requirements"].values() if e["level"] == "MUST")
        sys.stdout.write(f"{musts - len(missing)} of {musts} MUST requirements covered\n")
    return OK if not missing else FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ucpformat.conformance ...`` (the same as ``ucp conformance ...``)."""
    parser = argparse.ArgumentParser(prog="ucp conformance", description=DESCRIPTION)
    build(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else ERROR
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, like the rest of ucp
        sys.stderr.write(f"ucp conformance: error: {type(exc).__name__}: {exc}\n")
        return ERROR


__all__ = ["add_subparser", "check", "check_path", "main", "register", "render_check", "run"]

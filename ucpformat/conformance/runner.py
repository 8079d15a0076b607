"""The suites: judge a reader, a writer or a validator by the committed cases and scenarios.

Each suite returns a :class:`~ucpformat.conformance.report.SuiteReport`; every failure
names the requirement it breaks. See spec/ucp-1.0-conformance.md for what each check
requires, and :mod:`ucpformat.conformance.checks` for the checks and their requirements.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ucpformat import dtypes, schemas
from ucpformat.conformance import contents
from ucpformat.conformance.adapter import Adapter, CallableAdapter, Run
from ucpformat.conformance.cases import (
    READER_STAGES,
    Case,
    Scenario,
    load_cases,
    load_scenarios,
)
from ucpformat.conformance.checks import CHECKS
from ucpformat.conformance.layouts import Target, local_from_checkpoint
from ucpformat.conformance.report import Result, SuiteReport
from ucpformat.conformance.watch import WriteCounter
from ucpformat.errors import UCPError

R = "UCP-1.0-R"
#: Data types a reader supports to claim "UCP 1.0 reader" (UCP-1.0-R202).
READER_MINIMUM_TYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16",
)
#: Data types a writer supports to claim "UCP 1.0 writer" (UCP-1.0-R202).
WRITER_MINIMUM_TYPES = ("bool", "int32", "int64", "uint8", "float32")
ALL_TYPES = tuple(dtypes.NAMES)


def _requirements(check: str, *extra: str) -> list[str]:
    return [*CHECKS[check].requirements, *extra]


@contextmanager
def _timed(result: Result) -> Any:
    start = time.monotonic()
    try:
        yield result
    finally:
        result.seconds += time.monotonic() - start


def _select(names: Iterable[str], only: Sequence[str] | None) -> set[str]:
    names = list(names)
    if not only:
        return set(names)
    return {n for n in names if any(fnmatch.fnmatch(n, p) for p in only)}


def _schema_errors(kind: str, doc: Any) -> list[str]:
    return [f"{v.message} (at {v.pointer or '/'})" for v in schemas.violations(kind, doc)]


# -- capabilities -------------------------------------------------------------------------------


def _capabilities(adapter: Adapter, role: str, report: SuiteReport) -> dict[str, Any]:
    check = f"{role}.capabilities"
    result = report.add(Result(check, str(adapter), _requirements(check)))
    with _timed(result):
        run = adapter.capabilities()
        if run.returncode != 0:
            result.error(R + "230", f"capabilities failed: {run.describe()}")
            return {}
        try:
            caps = run.json()
        except ValueError as exc:
            result.error(R + "230", f"capabilities printed no JSON document: {exc}")
            return {}
        for message in _schema_errors("conformance-capabilities", caps):
            result.error(R + "230", f"capabilities: {message}")
        if not isinstance(caps, dict):
            return {}
        if role not in caps.get("roles", [role]):
            result.note(None, f"the adapter does not list the role {role!r}")
        unknown = sorted(set(caps.get("data_types", [])) - set(ALL_TYPES))
        if unknown:
            result.error(R + "203", f"capabilities list data types outside Table 1: {unknown}")
        report.capabilities = caps
        return caps


def _types_of(caps: Mapping[str, Any]) -> set[str]:
    listed = caps.get("data_types")
    return set(ALL_TYPES) if listed is None else set(listed) & set(ALL_TYPES)


def _features(caps: Mapping[str, Any]) -> set[str]:
    return set(caps.get("features", []))


# -- reader suite -------------------------------------------------------------------------------


def _adapter(command: Sequence[str] | Adapter, timeout: float) -> Adapter:
    return command if isinstance(command, Adapter) else Adapter(command, timeout=timeout)


def reader_suite(
    command: Sequence[str] | Adapter,
    *,
    cases: Sequence[Case] | None = None,
    only: Sequence[str] | None = None,
    timeout: float = 300.0,
    single: bool = True,
) -> SuiteReport:
    """Run a reader adapter over every case (UCP-1.0-R210 to R215).

    ``command`` is the adapter's command line, or an :class:`Adapter` (such as a
    :class:`~ucpformat.conformance.adapter.CallableAdapter` for code tested in process).
    """
    adapter = _adapter(command, timeout)
    report = SuiteReport("reader", str(adapter))
    start = time.monotonic()
    caps = _capabilities(adapter, "reader", report)
    supported = _types_of(caps)
    layout_aware = "layout" in _features(caps)
    all_cases = [c for c in (cases if cases is not None else load_cases()) if not c.is_rules]
    chosen = _select((c.name for c in all_cases), only)
    selected = [c for c in all_cases if c.name in chosen
                and (c.valid or c.stage in READER_STAGES)]
    with tempfile.TemporaryDirectory(prefix="ucp-conformance-reader-") as tmp:
        work = Path(tmp)
        responses = _read_all(adapter, selected, work, layout_aware,
                              batch="batch" in _features(caps), timeout=timeout)
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
                               _requirements("reader.valid",
                                             *case.expected.get("exercises", []))))
    if run is not None and run.argv[-3:-2] == ["read"]:
        result.seconds = run.seconds
    if problem is not None or response is None:
        result.error(R + "231", problem or "no response")
        return
    for message in _schema_errors("conformance-response", response):
        result.error(R + "231", f"response: {message}")
    if not isinstance(response, dict):
        return
    if "error" in response:
        err = response["error"]
        result.error(R + "211", f"refused a valid checkpoint: {_err_text(err)}")
        return
    got = response.get("tensors", {})
    expected = case.expected.get("tensors", {})
    if not isinstance(got, dict):
        return
    extra = sorted(set(got) - set(expected))
    if extra:
        result.error(R + "211", f"lists tensors the checkpoint does not have: {extra[:5]}")
    skipped_here = []
    for path, exp in expected.items():
        entry = got.get(path)
        if not isinstance(entry, dict):
            result.error(R + "211", f"{path}: missing from the response")
            continue
        dtype = exp["dtype"]
        seen = unsupported_seen.setdefault(dtype, {"refused": [], "misread": []}) if (
            dtype not in supported) else None
        if "error" in entry:
            if seen is not None:
                seen["refused"].append(f"{case.name}:{path}")
                skipped_here.append(f"{path} ({dtype})")
                continue
            result.error(R + "211", f"{path}: refused: {_err_text(entry['error'])}")
            continue
        errors_before = len(result.errors)
        if entry.get("dtype") != dtype:
            result.error(R + "211", f"{path}: data type {entry.get('dtype')!r}, expected "
                                    f"{dtype!r}")
        if entry.get("shape") != exp["shape"]:
            result.error(R + "211", f"{path}: shape {entry.get('shape')}, expected "
                                    f"{exp['shape']}")
        if exp.get("sha256") is not None and entry.get("sha256") != exp["sha256"]:
            result.error(R + "210", f"{path}: SHA-256 of the tensor {entry.get('sha256')}, "
                                    f"expected {exp['sha256']}")
        digests = entry.get("slices", [])
        for i, sel in enumerate(exp.get("slices", [])):
            have = digests[i] if isinstance(digests, list) and i < len(digests) else None
            if have != sel["sha256"]:
                result.error(R + "210", f"{path}: SHA-256 of slice {sel['slice']} is {have}, "
                                        f"expected {sel['sha256']}")
        if seen is not None and len(result.errors) > errors_before:
            seen["misread"].append(f"{case.name}:{path}")
            result.error(R + "092", f"{path}: a tensor of {dtype}, which the reader declares "
                                    "unsupported, was read wrongly instead of refused")
    if "values" in response:
        values = response["values"]
        for gpath, exp_values in case.expected.get("groups", {}).items():
            if not isinstance(values, dict) or values.get(gpath, {}) != exp_values:
                shown = values.get(gpath) if isinstance(values, dict) else values
                result.error(R + "211", f"values of group {gpath or '/'!r}: {shown!r}, "
                                        f"expected {exp_values!r}")
    if "metadata" in response and response["metadata"] != case.expected.get("metadata", {}):
        result.error(R + "211", f"metadata {response['metadata']!r}, expected "
                                f"{case.expected.get('metadata')!r}")
    if skipped_here:
        result.note(R + "092", f"{len(skipped_here)} tensors of unsupported data types "
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
    result = report.add(Result("reader.layout", case.name, _requirements("reader.layout")))
    if not layout_aware:
        result.skip("the reader does not declare the feature 'layout'")
        return
    if problem is not None or not isinstance(response, dict):
        result.error(R + "231", problem or "no response")
        return
    got = response.get("targets")
    if not isinstance(got, dict):
        result.error(R + "215", "the response has no targets")
        return
    for target in case.expected["targets"]:
        tid = target["id"]
        entry = got.get(tid)
        if not isinstance(entry, dict):
            result.error(R + "215", f"{tid}: missing from the response")
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
            result.error(R + "215", f"{tid}: refused: {_err_text(entry['error'])}")
            continue
        if not target.get("held", True):
            if entry.get("held") is not False:
                result.error(R + "215", f"{tid}: this rank holds no part of the tensor; the "
                                        "response should say held: false")
            continue
        if entry.get("shape") != target["shape"] or entry.get("sha256") != target["sha256"]:
            result.error(R + "215", f"{tid}: local tensor {entry.get('shape')} "
                                    f"{entry.get('sha256')}, expected {target['shape']} "
                                    f"{target['sha256']}")


def _judge_invalid(report: SuiteReport, case: Case, run: Run | None, response: Any,
                   problem: str | None) -> None:
    result = report.add(Result("reader.invalid", case.name,
                               _requirements("reader.invalid", *case.violates)))
    if run is not None and run.timed_out:
        result.error(R + "212", f"the reader did not finish: {run.describe()}")
        return
    if problem is not None and response is None:
        result.error(R + "231", problem)
        return
    errors = _response_errors(response)
    if not errors:
        result.error(case.violates[0],
                     f"not refused (stage {case.stage}): {case.description}")
        return
    acceptable = set(case.violates) | set(case.expected.get("also", []))
    rules = {str(e["rule"]) for e in errors if e.get("rule")}
    if not rules:
        result.warn(R + "213", "refused without naming a requirement; expected "
                               + " or ".join(case.violates))
    elif not rules & acceptable:
        result.note(None, f"refused with {sorted(rules)}; the case breaks "
                          f"{' and '.join(case.violates)}")


def _judge_unsupported(report: SuiteReport, supported: set[str],
                       seen: Mapping[str, Mapping[str, list[str]]]) -> None:
    """R092 and R203: tensors of undeclared data types are refused, never misread."""
    unsupported = sorted(set(ALL_TYPES) - supported)
    result = report.add(Result("reader.unsupported-types", ", ".join(unsupported) or "none",
                               _requirements("reader.unsupported-types")))
    if not unsupported:
        result.skip("the reader supports every data type of Table 1")
        return
    for dtype in unsupported:
        entry = seen.get(dtype, {"refused": [], "misread": []})
        for where in entry["misread"]:
            result.error(R + "092", f"{where}: a {dtype} tensor was read wrongly, not refused")
        result.note(None, f"{dtype}: {len(entry['refused'])} tensors refused by name")
    result.extra["unsupported"] = unsupported


def _single_mode(report: SuiteReport, adapter: Adapter, cases: Sequence[Case], work: Path,
                 supported: set[str]) -> None:
    """The single-case command line on one valid and one invalid case (R231 exit statuses)."""
    result = report.add(Result("reader.contract", "read CHECKPOINT REQUEST",
                               _requirements("reader.contract")))
    by_name = {c.name: c for c in cases}
    readable = [c.name for c in cases if c.valid and c.data_types and c.data_types <= supported]
    valid = "valid/basic" if "valid/basic" in readable else next(iter(readable), "")
    for name, want in ((valid, 0), ("invalid/missing-chunk", 1)):
        case = by_name.get(name)
        if case is None:
            continue
        with _timed(result):
            run = adapter.read(case.checkpoint, case.request(), work)
        if run.returncode != want:
            result.error(R + "231", f"{name}: exit status {run.returncode}, expected {want} "
                                    f"({run.describe()})")
        try:
            doc = run.json()
        except ValueError as exc:
            result.error(R + "231", f"{name}: no JSON document on stdout ({exc})")
            continue
        for message in _schema_errors("conformance-response", doc):
            result.error(R + "231", f"{name}: response: {message}")


def _ran(report: SuiteReport, *checks: str) -> bool:
    """Some result of ``checks`` passed, and none failed or was skipped."""
    results = [r for r in report.results if r.check in checks]
    return bool(results) and all(r.status == "pass" for r in results)


def _reader_claim(report: SuiteReport, supported: set[str], layout_aware: bool,
                  partial: bool) -> str | None:
    result = report.add(Result("suite.claim", "reader", _requirements("suite.claim")))
    missing = [t for t in READER_MINIMUM_TYPES if t not in supported]
    if missing:
        result.error(R + "202", f"a reader supports at least {', '.join(missing)}")
    if not report.passed:
        result.note(None, "no claim: the suite failed")
        return None
    if partial:
        result.note(None, "no claim: only some cases ran (--only)")
        return None
    layout = layout_aware and _ran(report, "reader.layout")
    return _claim_text("reader", layout, sorted(set(ALL_TYPES) - supported))


def _claim_text(level: str, layout: bool, without: Sequence[str]) -> str:
    text = f"passes ucpformat conformance 1.0, {level}"
    if layout:
        text += " (layout-aware)"
    if without:
        text += f" (without {', '.join(without)})"
    return text


# -- writer suite -------------------------------------------------------------------------------


def writer_suite(
    command: Sequence[str] | Adapter,
    *,
    scenarios: Sequence[Scenario] | None = None,
    only: Sequence[str] | None = None,
    timeout: float = 300.0,
    faults: bool = True,
    keep: Path | None = None,
) -> SuiteReport:
    """Hand a writer adapter every scenario and check what it wrote (UCP-1.0-R220 to R225).

    The fault-injection checks limit the size of the files the adapter's process may
    write, so they need a command; an in-process adapter skips them.
    """
    adapter = _adapter(command, timeout)
    report = SuiteReport("writer", str(adapter))
    start = time.monotonic()
    caps = _capabilities(adapter, "writer", report)
    supported = _types_of(caps)
    features = _features(caps)
    all_scenarios = list(scenarios if scenarios is not None else load_scenarios())
    chosen = _select((s.name for s in all_scenarios), only)
    outputs: dict[str, Path] = {}
    tmp = Path(tempfile.mkdtemp(prefix="ucp-conformance-writer-"))
    work = keep if keep is not None else tmp
    try:
        for scenario in all_scenarios:
            if scenario.name not in chosen:
                continue
            try:
                out = _run_scenario(report, adapter, scenario, supported, features, work)
            except Exception as exc:  # the suite reports, it does not crash
                report.add(Result("writer.valid", scenario.name)).error(
                    None, f"the suite could not judge this scenario: {type(exc).__name__}: "
                          f"{exc}")
                continue
            if out is not None:
                outputs[scenario.name] = out
        if faults:
            _fault_checks(report, adapter, all_scenarios, outputs, supported, work)
        _writer_claim(report, supported, features,
                      partial=bool(only) or not faults or isinstance(adapter, CallableAdapter))
    finally:
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    report.seconds = time.monotonic() - start
    return report


def _prepare(scenario: Scenario, supported: set[str], dest: Path) -> tuple[Path, dict[str, Any],
                                                                              list[str]]:
    """Copy a scenario, keeping only tensors of supported data types; its expected results."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(scenario.directory, dest)
    doc = json.loads(json.dumps(scenario.document))
    expected = json.loads(json.dumps(scenario.expected))
    dropped = []
    kept = []
    for entry in doc["tensors"]:
        if entry["dtype"] in supported:
            kept.append(entry)
        else:
            dropped.append(f"{'/'.join(entry['name'])} ({entry['dtype']})")
    doc["tensors"] = kept
    keep_paths = {_node_path(e["name"]) for e in kept}
    expected["tensors"] = {p: t for p, t in expected["tensors"].items() if p in keep_paths}
    expected["targets"] = [t for t in expected.get("targets", []) if t["tensor"] in keep_paths]
    # groups that only held dropped tensors are no longer expected
    needed = {""}
    for path in keep_paths:
        parts = path.split("/")
        needed.update("/".join(parts[:i]) for i in range(1, len(parts)))
    named = {_node_path(g["name"]) for g in doc.get("groups", [])}
    expected["groups"] = {g: v for g, v in expected["groups"].items()
                          if g in needed or g in named}
    (dest / "scenario.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False),
                                        encoding="utf-8")
    return dest / "scenario.json", expected, dropped


def _node_path(name: Sequence[str]) -> str:
    from ucpformat import names

    return names.path_of(*name)


def _run_scenario(report: SuiteReport, adapter: Adapter, scenario: Scenario,
                  supported: set[str], features: set[str], work: Path) -> Path | None:
    missing_features = sorted(scenario.features - features)
    check = "writer.coverage" if scenario.refuse else "writer.valid"
    result = report.add(Result(check, scenario.name, _requirements(check)))
    if missing_features:
        result.skip(f"needs the features {missing_features}")
        return None
    scenario_file, expected, dropped = _prepare(scenario, supported, work / scenario.name / "in")
    if dropped:
        result.note(R + "203", f"left out {len(dropped)} tensors of unsupported data types: "
                               f"{', '.join(dropped[:6])}")
    if not expected["tensors"]:
        result.skip("no tensor of a supported data type")
        return None
    out = work / scenario.name / "out"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)  # OUT_DIR is an empty folder (R233)
    with _timed(result), WriteCounter(out) as counter:
        run = adapter.write(scenario_file, out)
    if scenario.refuse:
        _judge_refusal(result, run, out, scenario)
        return None
    if run.returncode != 0:
        result.error(R + "233", f"the writer failed: {run.describe()}")
        return None
    if not (out / "zarr.json").is_file():
        result.error(R + "233", "the writer reported success but committed nothing "
                                "(no root zarr.json)")
        return None
    _judge_output(report, result, scenario.name, out, expected)
    _judge_writes(report, scenario.name, counter, out)
    if "layout" in scenario.features or "dtensor" in scenario.features:
        check = "writer.dtensor" if "dtensor" in scenario.features else "writer.layout"
        _judge_loading(report.add(Result(check, scenario.name, _requirements(check))), out,
                       expected)
    return out


def _judge_refusal(result: Result, run: Run, out: Path, scenario: Scenario) -> None:
    rule = scenario.refuse[0]
    if run.returncode == 0:
        result.error(rule, f"the writer accepted a scenario it must refuse: "
                           f"{scenario.document.get('description', '')}")
    if (out / "zarr.json").exists():
        result.error(rule, "a root zarr.json was written")
    stored = [p for p in out.rglob("*") if p.is_file() and _is_object(
        p.relative_to(out).as_posix())]
    if stored:
        result.error(rule, f"data was written before the refusal: "
                           f"{[str(p.relative_to(out)) for p in stored[:3]]}")
    try:
        doc = run.json()
        err = doc.get("error", {}) if isinstance(doc, dict) else {}
        if isinstance(err, dict) and err.get("rule") and err["rule"] != rule:
            result.note(None, f"refused with {err['rule']}, the suite expects {rule}")
    except ValueError:
        pass


def _judge_output(report: SuiteReport, result: Result, name: str, out: Path,
                  expected: Mapping[str, Any]) -> None:
    """Validity (deep) in ``result``; exact contents in a writer.contents result."""
    from ucpformat.validation import validate

    with _timed(result):
        validation = validate(out, deep=True)
    for issue in validation.errors:
        result.error(issue.rule, f"{issue.path}: {issue.message}")
    for issue in validation.warnings:
        result.warn(issue.rule, f"{issue.path}: {issue.message}")
    contents_result = report.add(Result("writer.contents", name, _requirements("writer.contents")))
    with _timed(contents_result):
        judge_contents(contents_result, out, expected)


def judge_contents(result: Result, location: Path, expected: Mapping[str, Any]) -> None:
    """Compare a checkpoint with expected contents (tensors, values, metadata, version)."""
    from ucpformat.reader import open_checkpoint

    try:
        ckpt = open_checkpoint(location)
    except UCPError as exc:
        result.error(exc.rule or R + "221", f"cannot open the checkpoint: {exc}")
        return
    with ckpt:
        version = ckpt.ucp.get("version")
        if version != expected.get("version", "1.0"):
            result.error(R + "063", f"version {version!r}, expected "
                                    f"{expected.get('version', '1.0')!r}")
        want = expected.get("tensors", {})
        extra = sorted(set(ckpt.arrays) - set(want))
        for path, exp in want.items():
            if path not in ckpt:
                raw = "/".join(exp["name"])
                if raw in ckpt or any(k.replace("%2F", "/") == raw for k in ckpt.arrays):
                    result.error(R + "010", f"{'/'.join(exp['name'])} is stored under a node "
                                            f"name that is not the escape of its name "
                                            f"(expected {path})")
                else:
                    result.error(R + "221", f"{path}: missing")
                continue
            tensor = ckpt[path]
            if tensor.meta.dtype.name != exp["dtype"]:
                result.error(R + "020", f"{path}: data type {tensor.meta.dtype.name}, "
                                        f"expected {exp['dtype']}")
                continue
            if list(tensor.shape) != exp["shape"]:
                layout = exp.get("ucp", {}).get("layout", {})
                vocab = layout.get("vocab", {}).get("dim") if isinstance(layout, dict) else None
                if (vocab is not None and len(tensor.shape) == len(exp["shape"])
                        and tensor.shape[vocab] > exp["shape"][vocab]):
                    result.error(R + "113", f"{path}: shape {list(tensor.shape)}: the "
                                            f"vocabulary is stored padded (expected "
                                            f"{exp['shape']})")
                else:
                    result.error(R + "080", f"{path}: shape {list(tensor.shape)}, expected the "
                                            f"full shape {exp['shape']}")
                continue
            try:
                digest = contents.sha256(tensor.read()) if exp.get("sha256") else None
            except UCPError as exc:
                result.error(exc.rule or R + "221", f"{path}: cannot be read: {exc}")
                continue
            if exp.get("sha256") and digest != exp["sha256"]:
                result.error(R + "221", f"{path}: the stored values differ from the scenario's "
                                        f"(SHA-256 {digest}, expected {exp['sha256']})")
            for key, value in exp.get("ucp", {}).items():
                if tensor.attributes.get(key) != value:
                    rule = R + "100" if key == "layout" else R + "221"
                    result.error(rule, f"{path}: attributes.ucp.{key} is "
                                       f"{tensor.attributes.get(key)!r}, expected {value!r}")
        for path in extra:
            result.error(R + "221", f"{path}: a tensor the scenario does not have")
        for gpath, values in expected.get("groups", {}).items():
            group = ckpt.root if gpath == "" else ckpt.groups.get(gpath)
            if group is None:
                result.error(R + "221", f"group {gpath!r} is missing")
                continue
            stored = dict(group.values)
            if stored != values:
                result.error(R + "221", f"values of group {gpath or '/'!r}: {stored!r}, "
                                        f"expected {values!r}")
        metadata = ckpt.ucp.get("metadata", {})
        if metadata != expected.get("metadata", {}):
            result.error(R + "221", f"metadata {metadata!r}, expected "
                                    f"{expected.get('metadata')!r}")


def _judge_loading(result: Result, out: Path, expected: Mapping[str, Any]) -> None:
    """Load the written checkpoint into other layouts with ucpformat (R222)."""
    from ucpformat.layout.semantics import layout_of
    from ucpformat.reader import open_checkpoint

    targets = expected.get("targets", [])
    with _timed(result):
        try:
            ckpt = open_checkpoint(out)
        except UCPError as exc:
            result.error(exc.rule, f"cannot open: {exc}")
            return
        with ckpt:
            for target in targets:
                path = target["tensor"]
                try:
                    tensor = ckpt[path]
                    layout = layout_of(tensor.attributes, tensor.shape, tensor=path)
                    lmap = Target.from_json(target["config"]).local_map(tensor.shape, layout,
                                                                        tensor=path)
                except UCPError as exc:
                    if "refuse" in target:
                        continue
                    result.error(R + "222", f"{target['id']}: cannot be loaded: {exc}")
                    continue
                if "refuse" in target:
                    result.error(R + "222", f"{target['id']}: loads, but should be refused "
                                            f"({target['refuse']}): the stored layout differs")
                    continue
                if lmap is None:
                    if target.get("held", True):
                        result.error(R + "222", f"{target['id']}: not held under the stored "
                                                "layout")
                    continue
                try:
                    local = local_from_checkpoint(ckpt, path, lmap)
                except UCPError as exc:
                    result.error(exc.rule or R + "222", f"{target['id']}: cannot be read: {exc}")
                    continue
                if list(local.shape) != target["shape"] or contents.sha256(local) != target[
                        "sha256"]:
                    result.error(R + "222", f"{target['id']}: the local tensor loaded by "
                                            "ucpformat differs from the expected one")
    if not targets:
        result.note(None, "every tensor was compared whole (no target layouts to load)")


def _judge_writes(report: SuiteReport, name: str, counter: WriteCounter, out: Path) -> None:
    result = report.add(Result("writer.one-write-per-object", name,
                               _requirements("writer.one-write-per-object")))
    if not counter.ok:
        result.skip("inotify is not available here")
        return
    twice = sorted(k for k, n in counter.counts.items()
                   if n > 1 and ("/c/" in f"/{k}" or k.endswith("/c")))
    for key in twice:
        result.error(R + "130", f"{key} was written {counter.counts[key]} times (one writer "
                                "per stored object, each written once, whole)")


def _sizes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size
            for p in root.rglob("*") if p.is_file()}


def _is_object(key: str) -> bool:
    parts = key.split("/")
    return "c" in parts[:-1] or parts[-1] == "c"


def _fault_checks(report: SuiteReport, adapter: Adapter, scenarios: Sequence[Scenario],
                  outputs: Mapping[str, Path], supported: set[str], work: Path) -> None:
    by_name = {s.name: s for s in scenarios}
    # a stored object bigger than every metadata document cannot be written
    result = report.add(Result("writer.fault-data", "basic", _requirements("writer.fault-data")))
    base = outputs.get("basic")
    in_process = isinstance(adapter, CallableAdapter)
    if in_process:
        result.skip("file size limits need an adapter command")
    elif base is None:
        result.skip("needs the output of scenario basic")
    else:
        sizes = _sizes(base)
        objects = {k: n for k, n in sizes.items() if _is_object(k)}
        others = {k: n for k, n in sizes.items() if not _is_object(k)}
        biggest = max(objects.values(), default=0)
        meta = max(others.values(), default=0)
        second = max([n for n in objects.values() if n < biggest] + [meta])
        if biggest <= meta:
            result.skip("no stored object is larger than every metadata document")
        else:
            limit = (second + biggest) // 2
            _fault_run(result, adapter, by_name["basic"], supported, work / "fault-data",
                       limit, R + "050", f"files larger than {limit} bytes cannot be written")
    # the root is the largest file: writing it fails halfway
    result = report.add(Result("writer.fault-root", "many-tensors",
                               _requirements("writer.fault-root")))
    many = outputs.get("many-tensors")
    if in_process:
        result.skip("file size limits need an adapter command")
    elif many is None:
        result.skip("needs the output of scenario many-tensors")
    else:
        sizes = _sizes(many)
        root = sizes.get("zarr.json", 0)
        rest = max([n for k, n in sizes.items() if k != "zarr.json"], default=0)
        if root <= rest:
            result.skip("the root zarr.json is not the largest file")
        else:
            limit = (rest + root) // 2
            _fault_run(result, adapter, by_name["many-tensors"], supported,
                       work / "fault-root", limit, R + "054",
                       f"files larger than {limit} bytes cannot be written (the root is "
                       f"{root} bytes)")
    # a committed checkpoint at the destination; the same beside a stray file
    if base is None or "many-tensors" not in by_name:
        for check in ("writer.existing", "writer.stray", "writer.concurrent"):
            report.add(Result(check, "basic <- many-tensors", _requirements(check))).skip(
                "needs the output of scenario basic")
        return
    _onto_committed(report.add(Result("writer.existing", "basic <- many-tensors",
                                      _requirements("writer.existing"))),
                    adapter, base, by_name["many-tensors"], supported, work / "existing",
                    R + "053", stray=None)
    _onto_committed(report.add(Result("writer.stray", "basic + 'notes (1).txt' <- many-tensors",
                                      _requirements("writer.stray"))),
                    adapter, base, by_name["many-tensors"], supported, work / "stray",
                    R + "049", stray="notes (1).txt")
    _concurrent(report.add(Result("writer.concurrent", "basic | many-tensors",
                                  _requirements("writer.concurrent"))),
                adapter, [by_name["basic"], by_name["many-tensors"]], supported,
                work / "concurrent")


def _onto_committed(result: Result, adapter: Adapter, base: Path, scenario: Scenario,
                    supported: set[str], work: Path, rule: str, *, stray: str | None) -> None:
    """Write ``scenario`` onto a copy of the committed checkpoint ``base`` (with a file
    named ``stray`` beside it): a refusal must change nothing; a write must replace the
    checkpoint as a whole."""
    dest = work / "out"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest, symlinks=True)
    if stray is not None:
        (dest / stray).write_bytes(b"a file that is not the checkpoint's\n")
    before = {k: (dest / k).read_bytes() for k in _sizes(dest)}
    scenario_file, expected, _ = _prepare(scenario, supported, work / "in")
    with _timed(result):
        run = adapter.write(scenario_file, dest)
    after_keys = set(_sizes(dest))
    if run.returncode != 0:
        unchanged = after_keys == set(before) and all(
            (dest / k).read_bytes() == v for k, v in before.items())
        if not unchanged:
            result.error(rule, "the writer refused to write over a committed checkpoint "
                               "but changed it")
        else:
            result.note(None, "the writer refused and left the committed checkpoint as it was")
        return
    from ucpformat.validation import validate

    validation = validate(dest, deep=True)
    for issue in validation.errors:
        result.error(rule, f"after replacing a committed checkpoint: [{issue.rule}] "
                           f"{issue.path}: {issue.message}")
    judge_contents(result, dest, expected)
    for finding in list(result.errors):
        if finding.rule != rule:
            result.findings.remove(finding)
            result.error(rule, f"the replaced checkpoint is not the new one alone: "
                               f"{finding.message}")
    if not result.errors:
        result.note(None, "the writer replaced the committed checkpoint as a whole")


def _concurrent(result: Result, adapter: Adapter, scenarios: Sequence[Scenario],
                supported: set[str], work: Path) -> None:
    """Two writes of different scenarios started at the same moment into one new
    location: at most one may report success, and the location must then hold exactly
    its checkpoint (R059); never a mix of both."""
    import threading

    dest = work / "out"
    if dest.exists():
        shutil.rmtree(dest)
    prepared = [_prepare(s, supported, work / f"in-{i}") for i, s in enumerate(scenarios)]
    runs: list[Run | None] = [None] * len(prepared)
    start = threading.Barrier(len(prepared))

    def write(i: int) -> None:
        start.wait()
        runs[i] = adapter.write(prepared[i][0], dest)

    with _timed(result):
        threads = [threading.Thread(target=write, args=(i,)) for i in range(len(prepared))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    succeeded = [i for i, run in enumerate(runs) if run is not None and run.returncode == 0]
    names = [s.name for s in scenarios]
    if len(succeeded) > 1:
        result.error(R + "059", "both writers reported success into one location")
    if not (dest / "zarr.json").exists():
        if succeeded:
            result.error(R + "233", f"{names[succeeded[0]]} reported success, nothing is "
                                    "committed")
        else:
            result.note(None, "both writers failed; nothing is committed")
        return
    from ucpformat.validation import validate

    validation = validate(dest, deep=True)
    for issue in validation.errors:
        result.error(R + "059", f"the checkpoint two writers left: [{issue.rule}] "
                                f"{issue.path}: {issue.message}")
    matches = []
    for i, (_, expected, _) in enumerate(prepared):
        check = Result("writer.contents", names[i])
        judge_contents(check, dest, expected)
        if not check.errors:
            matches.append(i)
    if not matches:
        result.error(R + "059", "the location holds neither writer's checkpoint (a mix)")
    elif succeeded and matches != succeeded[:1]:
        result.error(R + "059", f"{names[succeeded[0]]} reported success, the location holds "
                                f"{names[matches[0]]}")
    if not result.errors:
        result.note(None, f"{names[matches[0]]} committed; the other writer was refused")


def _fault_run(result: Result, adapter: Adapter, scenario: Scenario, supported: set[str],
               work: Path, limit: int, rule: str, what: str) -> None:
    scenario_file, expected, _ = _prepare(scenario, supported, work / "in")
    out = work / "out"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with _timed(result):
        run = adapter.write(scenario_file, out, file_size_limit=limit)
    result.extra["file_size_limit"] = limit
    root = out / "zarr.json"
    if not root.exists():
        if run.returncode == 0:
            result.error(R + "233", f"{what}; the writer reported success without committing")
        else:
            result.note(None, f"{what}; the writer failed and committed nothing")
        return
    from ucpformat.validation import validate

    validation = validate(out, deep=True)
    if validation.errors:
        first = validation.errors[0]
        result.error(rule, f"{what}; yet a root zarr.json was left behind, and the checkpoint "
                           f"is broken: [{first.rule}] {first.path}: {first.message}")
        return
    check = Result("writer.contents", scenario.name)
    judge_contents(check, out, expected)
    for finding in check.errors:
        result.error(rule, f"{what}; a committed checkpoint differs: {finding.message}")
    if not result.errors:
        result.note(None, f"{what}; the writer still committed a complete checkpoint")


def _writer_claim(report: SuiteReport, supported: set[str], features: set[str],
                  partial: bool) -> None:
    result = report.add(Result("suite.claim", "writer", _requirements("suite.claim")))
    missing = [t for t in WRITER_MINIMUM_TYPES if t not in supported]
    if missing:
        result.error(R + "202", f"a writer supports at least {', '.join(missing)}")
    if not report.passed:
        result.note(None, "no claim: the suite failed")
        return
    if partial:
        result.note(None, "no claim: only some scenarios or checks ran (--only, --no-faults)")
        return
    layout = {"layout", "dtensor"} <= features and _ran(report, "writer.layout",
                                                        "writer.dtensor")
    report.claim = _claim_text("writer", layout, sorted(set(ALL_TYPES) - supported))


# -- validator suite ----------------------------------------------------------------------------

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
    features = {"rules"}
    validate_fn: ValidateFn = reference_validate
    if command is not None:
        adapter = _adapter(command, timeout)
        report.subject = str(adapter)
        caps = _capabilities(adapter, "validator", report)
        features = _features(caps)

        def validate_fn(case: Case) -> tuple[int, Any]:
            run = (adapter.validate_rules(case.directory / case.expected["rules"],
                                          case.directory / case.expected["apply"])
                   if case.is_rules else adapter.validate(case.checkpoint))
            try:
                return run.returncode, run.json()
            except ValueError:
                return run.returncode, None

    all_cases = list(cases if cases is not None else load_cases())
    chosen = _select((c.name for c in all_cases), only)
    for case in all_cases:
        if case.name not in chosen:
            continue
        result = report.add(Result("validator.cases", case.name,
                                   _requirements("validator.cases", *case.violates)))
        if case.is_rules and "rules" not in features:
            result.skip("the validator does not declare the feature 'rules'")
            continue
        with _timed(result):
            status, doc = validate_fn(case)
        judge_validation(result, case, status, doc, strict=strict)
    report.seconds = time.monotonic() - start
    if report.passed and not only:
        report.claim = "passes ucpformat conformance 1.0, validator"
    return report


def judge_validation(result: Result, case: Case, status: int, doc: Any, *,
                     strict: bool = False) -> None:
    if not isinstance(doc, dict):
        result.error(R + "234", f"no validation result (exit status {status})")
        return
    for message in _schema_errors("conformance-validation", doc):
        result.error(R + "234", f"validation result: {message}")
    errors = {e.get("rule") for e in doc.get("errors", []) if isinstance(e, dict)}
    warnings = {e.get("rule") for e in doc.get("warnings", []) if isinstance(e, dict)}
    result.extra["reported"] = sorted(r for r in errors if r)
    if case.valid:
        if status != 0 or doc.get("valid") is not True:
            shown = "; ".join(f"[{e.get('rule')}] {e.get('message', '')}"[:160]
                              for e in doc.get("errors", [])[:3])
            result.error(R + "250", f"a valid case judged invalid (exit {status}): {shown}")
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


__all__ = [
    "READER_MINIMUM_TYPES",
    "WRITER_MINIMUM_TYPES",
    "judge_contents",
    "judge_validation",
    "reader_suite",
    "reference_validate",
    "validator_suite",
    "writer_suite",
]

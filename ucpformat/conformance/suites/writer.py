"""The writer suite: hand a writer adapter every scenario, check what it wrote (UCP-1.0-R220 to
UCP-1.0-R222).

Each checkpoint is validated deep and compared with the scenario's contents; layout
scenarios are loaded into other layouts; fault checks limit the size of the files the
adapter may write, put a committed checkpoint where it writes (also beside a stray file),
and start two writes into one location at once (UCP-1.0-R050, UCP-1.0-R053,
UCP-1.0-R054, UCP-1.0-R049, UCP-1.0-R059).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ucpformat.conformance import contents
from ucpformat.conformance.adapter import Adapter, CallableAdapter, Run
from ucpformat.conformance.cases import Scenario, load_scenarios
from ucpformat.conformance.layouts import Target, local_from_checkpoint
from ucpformat.conformance.report import Result, SuiteReport
from ucpformat.conformance.suites.core import (
    ALL_TYPES,
    WRITER_MINIMUM_TYPES,
    adapter_of,
    all_passed,
    claim_text,
    features_of,
    read_capabilities,
    requirements_of,
    select,
    timed,
    types_of,
)
from ucpformat.conformance.watch import WriteCounter, available, wait_for_change
from ucpformat.errors import UCPError
from ucpformat.format.jsonvalues import json_equal


def writer_suite(
    command: Sequence[str] | Adapter,
    *,
    scenarios: Sequence[Scenario] | None = None,
    only: Sequence[str] | None = None,
    timeout: float = 300.0,
    faults: bool = True,
    keep: Path | None = None,
) -> SuiteReport:
    """Hand a writer adapter every scenario and check what it wrote (UCP-1.0-R220 to UCP-1.0-R222).

    The fault-injection checks limit the size of the files the adapter's process may
    write, so they need a command; an in-process adapter skips them.
    """
    adapter = adapter_of(command, timeout)
    report = SuiteReport("writer", str(adapter))
    start = time.monotonic()
    caps = read_capabilities(adapter, "writer", report)
    supported = types_of(caps)
    features = features_of(caps)
    all_scenarios = list(scenarios if scenarios is not None else load_scenarios())
    chosen = select((s.name for s in all_scenarios), only)
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
    from ucpformat.format import names

    return names.path_of(*name)


def _run_scenario(report: SuiteReport, adapter: Adapter, scenario: Scenario,
                  supported: set[str], features: set[str], work: Path) -> Path | None:
    missing_features = sorted(scenario.features - features)
    check = "writer.coverage" if scenario.refuse else "writer.valid"
    result = report.add(Result(check, scenario.name, requirements_of(check)))
    if missing_features:
        result.skip(f"needs the features {missing_features}")
        return None
    scenario_file, expected, dropped = _prepare(scenario, supported, work / scenario.name / "in")
    if dropped:
        result.note("UCP-1.0-R203", f"left out {len(dropped)} tensors of unsupported data types: "
                                    f"{', '.join(dropped[:6])}")
    if not expected["tensors"]:
        result.skip("no tensor of a supported data type")
        return None
    out = work / scenario.name / "out"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)  # OUT_DIR is an empty folder (UCP-1.0-R233)
    with timed(result), WriteCounter(out) as counter:
        run = adapter.write(scenario_file, out)
    if scenario.refuse:
        _judge_refusal(result, run, out, scenario)
        return None
    if run.returncode != 0:
        result.error("UCP-1.0-R233", f"the writer failed: {run.describe()}")
        return None
    if not (out / "zarr.json").is_file():
        result.error("UCP-1.0-R233", "the writer reported success but committed nothing "
                                     "(no root zarr.json)")
        return None
    _judge_success_output(result, run)
    _judge_output(report, result, scenario.name, out, expected)
    _judge_writes(report, scenario.name, counter, out)
    if "layout" in scenario.features or "dtensor" in scenario.features:
        check = "writer.dtensor" if "dtensor" in scenario.features else "writer.layout"
        _judge_loading(report.add(Result(check, scenario.name, requirements_of(check))), out,
                       expected)
    return out


def _judge_success_output(result: Result, run: Run) -> None:
    """On success a writer prints nothing, or one JSON object without ``error`` (UCP-1.0-R233)."""
    text = run.stdout.strip()
    if not text:
        return
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "error" in doc:
        result.error("UCP-1.0-R233", f"on success the writer printed {text[:80]!r}: nothing, or "
                                     "one JSON object without the member error, is allowed")


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
    from ucpformat.checkpoint.validation import validate

    with timed(result):
        validation = validate(out, deep=True)
    for issue in validation.errors:
        result.error(issue.rule, f"{issue.path}: {issue.message}")
    for issue in validation.warnings:
        result.warn(issue.rule, f"{issue.path}: {issue.message}")
    if not validation.errors:
        _judge_fill_values(result, out)
    contents_result = report.add(Result("writer.contents", name,
                                        requirements_of("writer.contents")))
    with timed(contents_result):
        judge_contents(contents_result, out, expected)


#: The fill value UCP-1.0-R033 asks writers to write, spelled out, by data type.
_ZERO_FILL: dict[str, Any] = {
    "bool": False, "float32": 0.0, "float64": 0.0, "complex64": [0.0, 0.0],
    "complex128": [0.0, 0.0], "float16": "0x0000", "bfloat16": "0x0000",
    **{t: 0 for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                      "uint64")},
    **{t: "0x00" for t in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                           "float8_e5m2fnuz", "float8_e8m0fnu")},
}


def _judge_fill_values(result: Result, out: Path) -> None:
    """A warning (SHOULD) for each array whose fill value is not the zero bits spelled as
    UCP-1.0-R033 spells them ("0x0000" for float16, "0x00" for every 1-byte float type)."""
    try:
        root = json.loads((out / "zarr.json").read_bytes())
        nodes = root["consolidated_metadata"]["metadata"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for path, doc in sorted(nodes.items()):
        if not isinstance(doc, dict) or doc.get("node_type") != "array":
            continue
        want = _ZERO_FILL.get(str(doc.get("data_type")))
        if want is not None and not json_equal(doc.get("fill_value"), want):
            result.warn("UCP-1.0-R033", f"{path}: fill value {doc.get('fill_value')!r}; writers "
                                        f"write {json.dumps(want)} for {doc['data_type']}")


def judge_contents(result: Result, location: Path, expected: Mapping[str, Any]) -> None:
    """Compare a checkpoint with expected contents (tensors, values, metadata, version)."""
    from ucpformat.checkpoint.reader import open_checkpoint

    try:
        ckpt = open_checkpoint(location)
    except UCPError as exc:
        result.error(exc.rule or "UCP-1.0-R221", f"cannot open the checkpoint: {exc}")
        return
    with ckpt:
        version = ckpt.ucp.get("version")
        if version != expected.get("version", "1.0"):
            result.error("UCP-1.0-R063", f"version {version!r}, expected "
                                         f"{expected.get('version', '1.0')!r}")
        want = expected.get("tensors", {})
        extra = sorted(set(ckpt.arrays) - set(want))
        for path, exp in want.items():
            if path not in ckpt:
                raw = "/".join(exp["name"])
                if raw in ckpt or any(k.replace("%2F", "/") == raw for k in ckpt.arrays):
                    result.error("UCP-1.0-R010", f"{'/'.join(exp['name'])} is stored under a "
                                                 f"node name that is not the escape of its "
                                                 f"name (expected {path})")
                else:
                    result.error("UCP-1.0-R221", f"{path}: missing")
                continue
            tensor = ckpt[path]
            if tensor.meta.dtype.name != exp["dtype"]:
                result.error("UCP-1.0-R020", f"{path}: data type {tensor.meta.dtype.name}, "
                                             f"expected {exp['dtype']}")
                continue
            if list(tensor.shape) != exp["shape"]:
                layout = exp.get("ucp", {}).get("layout", {})
                vocab = layout.get("vocab", {}).get("dim") if isinstance(layout, dict) else None
                if (vocab is not None and len(tensor.shape) == len(exp["shape"])
                        and tensor.shape[vocab] > exp["shape"][vocab]):
                    result.error("UCP-1.0-R113", f"{path}: shape {list(tensor.shape)}: the "
                                                 f"vocabulary is stored padded (expected "
                                                 f"{exp['shape']})")
                else:
                    result.error("UCP-1.0-R080", f"{path}: shape {list(tensor.shape)}, expected "
                                                 f"the full shape {exp['shape']}")
                continue
            try:
                digest = contents.sha256(tensor.read()) if exp.get("sha256") else None
            except UCPError as exc:
                result.error(exc.rule or "UCP-1.0-R221", f"{path}: cannot be read: {exc}")
                continue
            if exp.get("sha256") and digest != exp["sha256"]:
                result.error("UCP-1.0-R221", f"{path}: the stored values differ from the "
                                             f"scenario's (SHA-256 {digest}, expected "
                                             f"{exp['sha256']})")
            for key, value in exp.get("ucp", {}).items():
                if not json_equal(tensor.attributes.get(key), value):
                    rule = "UCP-1.0-R100" if key == "layout" else "UCP-1.0-R221"
                    result.error(rule, f"{path}: attributes.ucp.{key} is "
                                       f"{tensor.attributes.get(key)!r}, expected {value!r}")
        for path in extra:
            result.error("UCP-1.0-R221", f"{path}: a tensor the scenario does not have")
        for gpath, values in expected.get("groups", {}).items():
            group = ckpt.root if gpath == "" else ckpt.groups.get(gpath)
            if group is None:
                result.error("UCP-1.0-R221", f"group {gpath!r} is missing")
                continue
            stored = dict(group.values)
            if not json_equal(stored, values):
                result.error("UCP-1.0-R221", f"values of group {gpath or '/'!r}: {stored!r}, "
                                             f"expected {values!r}")
        metadata = ckpt.ucp.get("metadata", {})
        if not json_equal(metadata, expected.get("metadata", {})):
            result.error("UCP-1.0-R221", f"metadata {metadata!r}, expected "
                                         f"{expected.get('metadata')!r}")


def _judge_loading(result: Result, out: Path, expected: Mapping[str, Any]) -> None:
    """Load the written checkpoint into other layouts with ucpformat (UCP-1.0-R222)."""
    from ucpformat.checkpoint.reader import open_checkpoint
    from ucpformat.layout.semantics import layout_of

    targets = expected.get("targets", [])
    with timed(result):
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
                    result.error("UCP-1.0-R222", f"{target['id']}: cannot be loaded: {exc}")
                    continue
                if "refuse" in target:
                    result.error("UCP-1.0-R222", f"{target['id']}: loads, but should be refused "
                                                 f"({target['refuse']}): the stored layout differs")
                    continue
                if lmap is None:
                    if target.get("held", True):
                        result.error("UCP-1.0-R222", f"{target['id']}: not held under the stored "
                                                     "layout")
                    continue
                try:
                    local = local_from_checkpoint(ckpt, path, lmap)
                except UCPError as exc:
                    result.error(exc.rule or "UCP-1.0-R222",
                                 f"{target['id']}: cannot be read: {exc}")
                    continue
                if list(local.shape) != target["shape"] or contents.sha256(local) != target[
                        "sha256"]:
                    result.error("UCP-1.0-R222", f"{target['id']}: the local tensor loaded by "
                                                 "ucpformat differs from the expected one")
    if not targets:
        result.note(None, "every tensor was compared whole (no target layouts to load)")


def _judge_writes(report: SuiteReport, name: str, counter: WriteCounter, out: Path) -> None:
    result = report.add(Result("writer.one-write-per-object", name,
                               requirements_of("writer.one-write-per-object")))
    if not counter.ok:
        result.skip("inotify is not available here")
        return
    twice = sorted(k for k, n in counter.counts.items()
                   if n > 1 and ("/c/" in f"/{k}" or k.endswith("/c")))
    for key in twice:
        result.error("UCP-1.0-R130", f"{key} was written {counter.counts[key]} times (one writer "
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
    result = report.add(Result("writer.fault-data", "basic", requirements_of("writer.fault-data")))
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
                       limit, "UCP-1.0-R050", f"files larger than {limit} bytes cannot be written")
    # the root is the largest file: writing it fails halfway
    result = report.add(Result("writer.fault-root", "many-tensors",
                               requirements_of("writer.fault-root")))
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
                       work / "fault-root", limit, "UCP-1.0-R054",
                       f"files larger than {limit} bytes cannot be written (the root is "
                       f"{root} bytes)")
    # a committed checkpoint at the destination; the same beside a stray file; two writers
    if base is None or "many-tensors" not in by_name:
        for check in ("writer.existing", "writer.stray", "writer.concurrent"):
            report.add(Result(check, "basic <- many-tensors", requirements_of(check))).skip(
                "needs the output of scenario basic")
        return
    _onto_committed(report.add(Result("writer.existing", "basic <- many-tensors",
                                      requirements_of("writer.existing"))),
                    adapter, base, by_name["many-tensors"], supported, work / "existing",
                    "UCP-1.0-R053", stray=None)
    _onto_committed(report.add(Result("writer.stray", "basic + 'notes (1).txt' <- many-tensors",
                                      requirements_of("writer.stray"))),
                    adapter, base, by_name["many-tensors"], supported, work / "stray",
                    "UCP-1.0-R049", stray="notes (1).txt")
    _concurrent(report.add(Result("writer.concurrent", "many-tensors | basic",
                                  requirements_of("writer.concurrent"))),
                adapter, [by_name["many-tensors"], by_name["basic"]], supported,
                work / "concurrent")


def _onto_committed(result: Result, adapter: Adapter, base: Path, scenario: Scenario,
                    supported: set[str], work: Path, rule: str, *, stray: str | None) -> None:
    """Write ``scenario`` onto a copy of the committed checkpoint ``base`` (with a file
    named ``stray`` beside it): a refusal must change nothing; a write must replace the
    checkpoint as a whole (UCP-1.0-R053, UCP-1.0-R049)."""
    dest = work / "out"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest, symlinks=True)
    if stray is not None:
        (dest / stray).write_bytes(b"a file that is not the checkpoint's\n")
    before = {k: (dest / k).read_bytes() for k in _sizes(dest)}
    scenario_file, expected, _ = _prepare(scenario, supported, work / "in")
    with timed(result):
        run = adapter.write(scenario_file, dest)
    after_keys = set(_sizes(dest))
    if run.returncode != 0:
        unchanged = after_keys == set(before) and all(
            (dest / k).read_bytes() == v for k, v in before.items())
        if not unchanged:
            result.error(rule, "the writer refused to write over a committed checkpoint but "
                               "changed it")
        else:
            result.note(None, "the writer refused and left the committed checkpoint as it was")
        return
    if stray is not None and (dest / stray).exists():
        result.error("UCP-1.0-R066", f"the writer replaced the committed checkpoint but left "
                                     f"{stray!r} beside it: refuse, or remove it with the "
                                     "checkpoint")
    from ucpformat.checkpoint.validation import validate

    validation = validate(dest, deep=True)
    for issue in validation.errors:
        result.error(rule, f"after replacing a committed checkpoint: [{issue.rule}] "
                           f"{issue.path}: {issue.message}")
    judge_contents(result, dest, expected)
    for finding in list(result.errors):
        if finding.rule not in (rule, "UCP-1.0-R066"):
            result.findings.remove(finding)
            result.error(rule, f"the replaced checkpoint is not the new one alone: "
                               f"{finding.message}")
    if not result.errors:
        result.note(None, "the writer replaced the committed checkpoint as a whole")


def _concurrent(result: Result, adapter: Adapter, scenarios: Sequence[Scenario],
                supported: set[str], work: Path) -> None:
    """Two writes of different scenarios into one new location whose runs overlap: at
    most one may report success, and the location must then hold exactly its checkpoint
    (UCP-1.0-R059, UCP-1.0-R064, UCP-1.0-R065); never a mix of both.

    The overlap is made, not hoped for: the first writer's process group is stopped
    (SIGSTOP) as soon as anything appears in the location (its claim, by UCP-1.0-R065), the
    second runs to its end meanwhile, then the first goes on (SIGCONT). A first writer that
    ended before it could be stopped did not overlap: tried again in a new location, three
    times at most, then the check is skipped, never passed. An in-process adapter cannot be
    stopped: its two writes start at one moment, and may not overlap.
    """
    prepared = [_prepare(s, supported, work / f"in-{i}") for i, s in enumerate(scenarios)]
    names = [s.name for s in scenarios]
    if not available() or isinstance(adapter, CallableAdapter):
        _concurrent_at_once(result, adapter, prepared, names, work / "out")
        return
    for attempt in range(1, OVERLAP_TRIES + 1):
        dest = work / f"out-{attempt}"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)  # OUT_DIR is an empty folder (UCP-1.0-R233)
        with timed(result):
            made = overlapping_writes(adapter, [str(p[0]) for p in prepared], dest)
        if made is None:
            continue
        runs, waited = made
        result.extra["overlap"] = True
        result.extra["attempts"] = attempt
        if waited:
            result.note(None, f"{names[1]} waited for {names[0]} instead of refusing; both "
                              f"went on together after {_SECOND_WAIT:.0f} s")
        _judge_concurrent(result, list(runs), dest, prepared, names)
        return
    result.extra["overlap"] = False
    result.skip(f"the writer of {names[0]} ended each of {OVERLAP_TRIES} times before it "
                "could be stopped: the two writes could not be made to overlap")


#: Locations the concurrency check tries before it gives up making two writes overlap.
OVERLAP_TRIES = 3
#: How long the second writer may run while the first is stopped (seconds).
_SECOND_WAIT = 60.0


def overlapping_writes(adapter: Adapter, scenario_files: Sequence[str], dest: Path
                 ) -> tuple[tuple[Run, Run], bool] | None:
    """Run two writes into ``dest``, the second wholly while the first is stopped after its
    first change there: ((first run, second run), whether the second had to be let go on
    with the first); None if the first ended before it was stopped (no overlap)."""
    import signal

    first = adapter.start("write", scenario_files[0], str(dest))
    if first is None:
        return None
    changed = wait_for_change(dest, given_up=lambda: not first.running(),
                              timeout=adapter.timeout)
    first.signal(signal.SIGSTOP)
    if not changed or not first.running() or (dest / "zarr.json").exists():
        first.signal(signal.SIGCONT)  # it ended, or committed, before it was stopped
        if first.finish(adapter.timeout) is None:
            first.kill()
        return None
    second = adapter.start("write", scenario_files[1], str(dest))
    if second is None:
        first.signal(signal.SIGCONT)
        first.finish(adapter.timeout) or first.kill()
        return None
    waited = False
    run2 = second.finish(min(_SECOND_WAIT, adapter.timeout))
    first.signal(signal.SIGCONT)
    if run2 is None:
        waited = True
        run2 = second.finish(adapter.timeout) or second.kill()
    run1 = first.finish(adapter.timeout) or first.kill()
    return (run1, run2), waited


def _concurrent_at_once(result: Result, adapter: Adapter,
                        prepared: Sequence[tuple[Path, dict[str, Any], list[str]]],
                        names: Sequence[str], dest: Path) -> None:
    """Two writes started at one moment (an adapter whose process cannot be stopped)."""
    import threading

    if dest.exists():
        shutil.rmtree(dest)
    runs: list[Run | None] = [None] * len(prepared)
    start = threading.Barrier(len(prepared))

    def write(i: int) -> None:
        start.wait()
        runs[i] = adapter.write(prepared[i][0], dest)

    with timed(result):
        threads = [threading.Thread(target=write, args=(i,)) for i in range(len(prepared))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    result.extra["overlap"] = None  # started at once; whether they overlapped is unknown
    result.note(None, "the two writes were started at one moment, not made to overlap (an "
                      "in-process adapter cannot be stopped); two writes that did not "
                      "overlap may both succeed (UCP-1.0-R065)")
    _judge_concurrent(result, runs, dest, prepared, names, overlapped=False)


def _judge_concurrent(result: Result, runs: Sequence[Run | None], dest: Path,
                      prepared: Sequence[tuple[Path, dict[str, Any], list[str]]],
                      names: Sequence[str], *, overlapped: bool = True) -> None:
    succeeded = [i for i, run in enumerate(runs) if run is not None and run.returncode == 0]
    if len(succeeded) > 1 and overlapped:
        result.error("UCP-1.0-R059", "both writers reported success into one location, the "
                                     "second while the first was stopped in it")
    if not (dest / "zarr.json").exists():
        if succeeded:
            result.error("UCP-1.0-R233", f"{names[succeeded[0]]} reported success, nothing is "
                                         "committed")
        else:
            result.note(None, "both writers failed; nothing is committed")
        return
    from ucpformat.checkpoint.validation import validate

    validation = validate(dest, deep=True)
    for issue in validation.errors:
        result.error("UCP-1.0-R059", f"the checkpoint two writers left: [{issue.rule}] "
                                     f"{issue.path}: {issue.message}")
    matches = []
    for i, (_, expected, _) in enumerate(prepared):
        check = Result("writer.contents", names[i])
        judge_contents(check, dest, expected)
        if not check.errors:
            matches.append(i)
    if not matches:
        result.error("UCP-1.0-R059", "the location holds neither writer's checkpoint (a mix)")
    elif not succeeded:
        result.error("UCP-1.0-R233", f"the location holds {names[matches[0]]}'s checkpoint, "
                                     "but neither writer reported success")
    elif matches[0] not in succeeded or (overlapped and matches != succeeded[:1]):
        result.error("UCP-1.0-R059", f"{names[succeeded[0]]} reported success, the location "
                                     f"holds {names[matches[0]]}")
    if not result.errors:
        other = 1 - matches[0]
        result.note(None, f"{names[matches[0]]} committed; the writer of {names[other]} "
                          f"{'was refused' if other not in succeeded else 'also succeeded'}")


def _fault_run(result: Result, adapter: Adapter, scenario: Scenario, supported: set[str],
               work: Path, limit: int, rule: str, what: str) -> None:
    scenario_file, expected, _ = _prepare(scenario, supported, work / "in")
    out = work / "out"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with timed(result):
        run = adapter.write(scenario_file, out, file_size_limit=limit)
    result.extra["file_size_limit"] = limit
    root = out / "zarr.json"
    if not root.exists():
        if run.returncode == 0:
            result.error("UCP-1.0-R233", f"{what}; the writer reported success without committing")
        else:
            result.note(None, f"{what}; the writer failed and committed nothing")
        return
    from ucpformat.checkpoint.validation import validate

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
    result = report.add(Result("suite.claim", "writer", requirements_of("suite.claim")))
    missing = [t for t in WRITER_MINIMUM_TYPES if t not in supported]
    if missing:
        result.error("UCP-1.0-R202", f"a writer supports at least {', '.join(missing)}")
    if not report.passed:
        result.note(None, "no claim: the suite failed")
        return
    if partial:
        result.note(None, "no claim: only some scenarios or checks ran (--only, --no-faults)")
        return
    layout = {"layout", "dtensor"} <= features and all_passed(report, "writer.layout",
                                                        "writer.dtensor")
    report.claim = claim_text("writer", layout, sorted(set(ALL_TYPES) - supported))



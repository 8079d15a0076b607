"""ucpformat.testing.conformance_kit: the suite from another project's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucpformat
from ucpformat.conformance import contents
from ucpformat.conformance.adapters import reference
from ucpformat.errors import UCPError
from ucpformat.testing import conformance_kit as ucp


def _read(checkpoint: Path, path: str, selection: Any) -> Any:
    with ucpformat.open(checkpoint) as ckpt:
        tensor = ckpt[path]
        if selection is None:
            return tensor.read()
        return contents.select(tensor.read(), selection)


def test_check() -> None:
    valid = ucp.check(ucp.cases("valid")[0].directory)
    assert valid.extra["valid"] and valid.status == "pass"
    case = next(c for c in ucp.cases("invalid") if c.name == "invalid/missing-chunk")
    invalid = ucp.check(case.checkpoint)
    assert not invalid.extra["valid"] and "UCP-1.0-R031" in invalid.failed_rules()


@pytest.mark.parametrize("case", ucp.case_params("valid")[:4])
def test_assert_reads(case: Any) -> None:
    ucp.assert_reads(case, _read)


@pytest.mark.parametrize("case", ucp.case_params("invalid", stages=["read"])[:4])
def test_assert_refuses(case: Any) -> None:
    exc = ucp.assert_refuses(case, _read)
    assert isinstance(exc, UCPError)


def test_assert_reads_catches_a_wrong_reader() -> None:
    case = next(c for c in ucp.cases("valid") if c.name == "valid/basic")
    with pytest.raises(AssertionError, match=r"UCP-1\.0-R210"):
        ucp.assert_reads(case, lambda ckpt, path, sel: _read(ckpt, path, sel).T.copy(order="F"))


def test_in_process_reader_suite() -> None:
    adapter = ucp.in_process("reference", read=lambda ckpt, req: reference.read(ckpt, req)[0],
                             features=["layout"])
    report = ucp.reader_suite(adapter, only=["valid/layout", "valid/names", "invalid/no-root",
                                             "invalid/crc-chunk"])
    ucp.assert_passed(report)
    assert report.claim is None  # a partial run supports no claim


def test_in_process_writer_suite() -> None:
    adapter = ucp.in_process("reference", write=reference.write,
                             features=["layout", "dtensor"])
    report = ucp.writer_suite(adapter, only=["basic", "coverage-gap"])
    ucp.assert_passed(report)
    skipped = {r.check for r in report.results if r.status == "skip"}
    assert {"writer.fault-data", "writer.fault-root"} <= skipped


def test_assert_passed_names_requirements() -> None:
    def wrong(ckpt: Path, req: Any) -> Any:
        response, _ = reference.read(ckpt, req)
        for entry in response.get("tensors", {}).values():
            if "sha256" in entry:
                entry["sha256"] = "0" * 64
        return response

    report = ucp.reader_suite(ucp.in_process("wrong", read=wrong), only=["valid/basic"])
    with pytest.raises(AssertionError, match=r"UCP-1\.0-R210"):
        ucp.assert_passed(report)


def test_an_in_process_adapter_without_an_operation_answers_like_a_command_without_it(
    tmp_path: Path,
) -> None:
    """Status 2 with the reason on stderr, as a command lacking the subcommand would."""
    from ucpformat.conformance.adapter import CallableAdapter

    adapter = CallableAdapter("partial", capabilities={"reader": False})
    runs = {
        "read": adapter.read(tmp_path / "c", {"tensors": []}, tmp_path),
        "write": adapter.write(tmp_path / "s.json", tmp_path / "out"),
        "validate": adapter.validate(tmp_path / "c"),
        "validate-rules": adapter.validate_rules(tmp_path / "r.json", tmp_path / "a.json"),
    }
    for operation, run in runs.items():
        assert run.returncode == 2, operation
        assert "partial" in run.stderr and run.stdout == "", (operation, run.stderr)
        assert operation in run.argv, run.argv
    limited = CallableAdapter("w", capabilities={}, write=lambda scenario, out: None)
    run = limited.write(tmp_path / "s.json", tmp_path / "out", file_size_limit=1024)
    assert run.returncode == 2 and "file size limits" in run.stderr


def test_archive_cases_go_only_to_readers_that_declare_the_feature() -> None:
    """The cases of the one-file form (spec section 11.5) are run by a reader that lists
    the feature 'archive' and reported skipped, never failed, for any other."""
    read = lambda ckpt, req: reference.read(ckpt, req)[0]  # noqa: E731
    archive = [c.name for c in ucp.load_cases() if c.feature == "archive"]
    assert {"valid/archive", "valid/archive-unaligned", "invalid/archive-cut-short"} <= \
        set(archive)
    with_it = ucp.reader_suite(ucp.in_process("r", read=read, features=["archive"]),
                               only=["*archive*"])
    ucp.assert_passed(with_it)
    ran = {r.name for r in with_it.results if r.skipped is None}
    assert set(archive) <= ran
    without = ucp.reader_suite(ucp.in_process("r", read=read), only=["*archive*"])
    skipped = {r.name for r in without.results if r.skipped}
    assert set(archive) <= skipped and without.passed

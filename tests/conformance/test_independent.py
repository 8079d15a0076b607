"""Two adapters written from the spec alone pass: a tensorstore reader, a zarr-python exporter.

Both run with every import of ucpformat refused, so they prove the spec can be
implemented from its text (and the schemas) without the reference library.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.conformance.conftest import ADAPTERS, BLOCK_UCPFORMAT, independent
from ucpformat.conformance.runner import reader_suite, writer_suite

SCRIPTS = ("tensorstore_reader.py", "zarr_exporter.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_ucpformat_import(script: str) -> None:
    tree = ast.parse((ADAPTERS / script).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "ucpformat" not in imported
    proc = subprocess.run([sys.executable, "-c", BLOCK_UCPFORMAT, str(ADAPTERS / script),
                           "capabilities"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_blocking_works() -> None:
    proc = subprocess.run([sys.executable, "-c", BLOCK_UCPFORMAT, "-c"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; exec(sys.argv[1])", BLOCK_UCPFORMAT.replace(
            "runpy.run_path(sys.argv[0], run_name=\"__main__\")", "import ucpformat")],
        capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "blocked" in proc.stderr


def test_tensorstore_reader() -> None:
    report = reader_suite(independent("tensorstore_reader.py"))
    assert report.passed, report.render()
    assert report.claim == "passes ucpformat conformance 1.0, reader (layout-aware)"
    assert len(report.by_check("reader.invalid")) >= 50


def test_zarr_exporter() -> None:
    report = writer_suite(independent("zarr_exporter.py"))
    assert report.passed, report.render()
    assert report.claim is not None and report.claim.startswith(
        "passes ucpformat conformance 1.0, writer (layout-aware) (without bfloat16")
    notes = [f for r in report.results for f in r.findings if f.rule == "UCP-1.0-R203"]
    assert notes, "the left-out bfloat16 and float8 tensors are reported"


def test_a_reader_without_some_data_types() -> None:
    """Tensors of undeclared types are refused by name (R092): skipped, and the claim says so."""
    reader = independent("tensorstore_reader.py")
    assert reader.env is not None
    reader.env["UCP_TS_WITHOUT"] = "float8_e8m0fnu,complex128"
    report = reader_suite(reader)
    assert report.passed, report.render()
    assert report.claim == ("passes ucpformat conformance 1.0, reader (layout-aware) "
                            "(without complex128, float8_e8m0fnu)")
    (unsupported,) = report.by_check("reader.unsupported-types")
    assert unsupported.status == "pass" and "tensors refused by name" in str(unsupported.findings)


def test_a_reader_that_misreads_an_undeclared_type_fails() -> None:
    """Declaring a type unsupported is no licence to misread it (R092)."""
    from typing import Any

    from ucpformat.conformance.adapters import reference
    from ucpformat.format.dtypes import NAMES
    from ucpformat.testing import conformance_kit as ucp

    def read(checkpoint: Any, request: Any) -> Any:
        response, _ = reference.read(checkpoint, request)
        for entry in response["tensors"].values():
            if entry.get("dtype") == "float16" and "sha256" in entry:
                entry["sha256"] = "0" * 64
        return response

    adapter = ucp.in_process("misreads float16", read=read,
                             data_types=[t for t in NAMES if t != "float16"])
    report = reader_suite(adapter, only=["valid/dtypes-unsharded"])
    assert "UCP-1.0-R092" in report.failed_rules(), report.render()

"""The JAX path passes the conformance writer suite (a few scenarios here, to stay fast;
``ucp conformance writer -- python -m ucpformat.conformance.adapters.jax_writer`` runs
them all, fault checks included)."""

from __future__ import annotations

import sys

from tests.conformance.conftest import adapter
from ucpformat.conformance.runner import writer_suite


def test_jax_writer_adapter_passes_the_writer_suite() -> None:
    jax_writer = adapter(sys.executable, "-m", "ucpformat.conformance.adapters.jax_writer")
    report = writer_suite(jax_writer, only=["basic", "layout-dtensor", "coverage-gap"],
                          faults=False)
    assert report.passed, report.render()
    checks = {(r.check, r.status) for r in report.results}
    assert ("writer.coverage", "pass") in checks and ("writer.dtensor", "pass") in checks

"""The suites' public entry points: judge a reader, a writer or a validator.

Each suite returns a :class:`~ucpformat.conformance.report.SuiteReport`; every failure
names the requirement it breaks. The suites live in :mod:`ucpformat.conformance.suites`,
one module each over a shared core; spec/ucp-1.0-conformance.md says what each check
requires, and :mod:`ucpformat.conformance.checks` lists the checks and their requirements.
"""

from __future__ import annotations

from ucpformat.conformance.suites.core import READER_MINIMUM_TYPES, WRITER_MINIMUM_TYPES
from ucpformat.conformance.suites.reader import reader_suite
from ucpformat.conformance.suites.validator import (
    judge_validation,
    reference_validate,
    validator_suite,
)
from ucpformat.conformance.suites.writer import judge_contents, writer_suite

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

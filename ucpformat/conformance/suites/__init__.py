"""The three suites of the conformance runner, one module each, over a shared core.

:mod:`~ucpformat.conformance.suites.core` holds what they share (capabilities, case
selection, claims); :mod:`~ucpformat.conformance.suites.reader`,
:mod:`~ucpformat.conformance.suites.writer` and
:mod:`~ucpformat.conformance.suites.validator` each judge one role. The public entry points
are re-exported by :mod:`ucpformat.conformance.runner`.
"""

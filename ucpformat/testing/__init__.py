"""Testing helpers for projects that read or write UCP checkpoints.

:mod:`ucpformat.testing.conformance` runs the conformance suite from a project's own
tests (pytest or otherwise).
"""

"""Adapters of the conformance suite built on ucpformat (the reference)."""

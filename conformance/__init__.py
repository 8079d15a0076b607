"""The UCP conformance suite: committed cases and scenarios, their generator, and adapters.

``python -m conformance.generate`` regenerates ``cases/`` and ``scenarios/``; the runner
is ``ucp conformance`` (``ucpformat.conformance``). See spec/ucp-1.0-conformance.md.
"""

"""The UCP conformance suite: run it, and judge readers, writers and validators by it.

The cases and scenarios live in ``conformance/`` (packaged as ``ucpformat/_conformance``);
the spec chapter is spec/ucp-1.0-conformance.md. From the command line::

    ucp conformance check PATH...            # validate checkpoints, per requirement
    ucp conformance reader -- CMD ...        # run a reader adapter over every case
    ucp conformance writer -- CMD ...        # hand a writer adapter every scenario
    ucp conformance validator [-- CMD ...]   # judge a validator by every case

From Python (and pytest): :mod:`ucpformat.testing.conformance_kit`.
"""

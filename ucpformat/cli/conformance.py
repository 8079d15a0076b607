"""``ucp conformance``: the conformance suite (see :mod:`ucpformat.conformance.command`).

The ``ucp`` command's modules are named after their subcommand; this one forwards to
the suite's own command module.
"""

from ucpformat.conformance.command import add_subparser, main, register, run

__all__ = ["add_subparser", "main", "register", "run"]

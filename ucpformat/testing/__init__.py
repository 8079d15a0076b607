"""Testing kit: the conformance suite for other projects, and the reliability harnesses.

- :mod:`~ucpformat.testing.conformance_kit`: run the conformance suite (reader, writer,
  checker) from a project's own tests, pytest or otherwise;
- :mod:`~ucpformat.testing.faults`: writers killed at every step of a save (crash
  consistency of the commit protocol, UCP-1.0-R050 to UCP-1.0-R056, UCP-1.0-R132);
- :mod:`~ucpformat.testing.corruption`: bytes, chunks, shard indexes and metadata files
  damaged at random (UCP-1.0-R041 to UCP-1.0-R043, UCP-1.0-R055);
- :mod:`~ucpformat.testing.hostile`: malformed and hostile metadata and data against the
  readers (UCP-1.0-R090 to UCP-1.0-R099); :mod:`~ucpformat.testing.fuzz_atheris` is its
  coverage-guided
  counterpart;
- :mod:`~ucpformat.testing.link_attacks`: symbolic and hard links planted in and around a
  checkpoint, against writers (single-process and distributed), readers (swapped during
  reads) and the manager (UCP-1.0-R091, UCP-1.0-R089);
- :mod:`~ucpformat.testing.concurrency`: two writers saving into one location at once
  (UCP-1.0-R059), on a file system and on S3, and distributed writers (process groups
  over gloo) against each other and a single process, with a reader during overwrites;
- :mod:`~ucpformat.testing.gloo_writers`: process groups of gloo ranks, kept up between
  trials, that run a distributed save (``save_distributed``, the DCP plugin) on command;
- :mod:`~ucpformat.testing.failed_saves`: stray files and full disks: what a failed save
  leaves behind, and whether its retry succeeds (UCP-1.0-R049);
- :mod:`~ucpformat.testing.s3`: a local S3-compatible server (moto) on loopback.

Each harness runs on its own as ``python -m ucpformat.testing.<name> --trials N`` and
prints its figures; the test suite runs each in a quick mode, ``make stress`` in a long
one. The library itself never imports this package.
"""

from typing import Any

from ucpformat.testing.common import same_state, small_state


def __getattr__(name: str) -> Any:
    from ucpformat.compat import moved_attribute  # the modules that moved in 0.2

    return moved_attribute(__name__, name)


__all__ = ["same_state", "small_state"]
